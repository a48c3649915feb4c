//! A VMM tensor set's holders segment and manifest made without a GPU, and slots claimed in it
//! for any process: for tests of tools (`gc`, `ls`), of other users' access and of hostile
//! segments on machines without a GPU. The manifest's tokens carry placeholder handles that are
//! never opened; nothing here allocates device memory. Reached as
//! `cuda_ipc::raw::tensorset::testing`; not part of the stable API.

use super::{HolderRole, HolderSnapshot, HoldersSegment};
use crate::error::Result;
use crate::identity::ProcessIdentity;
use crate::shm::Segment;
use crate::tensorset::manifest::{KIND_VMM, Layout, Manifest, TensorSpec};
use crate::tensorset::{DType, segment};
use crate::token::{Token, TokenKind};

/// A set's holders segment (B buffers × 1 allocation), with the manifest that names it when made
/// by [`HeldSetFixture::create`]. Dropping it unmaps both and unlinks nothing
/// ([`HeldSetFixture::unlink`] does).
pub struct HeldSetFixture {
    holders: HoldersSegment,
    manifest: Option<Segment>,
}

impl std::fmt::Debug for HeldSetFixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldSetFixture")
            .field("holders", &self.holders)
            .finish_non_exhaustive()
    }
}

impl HeldSetFixture {
    /// Makes set `name`'s holders segment, then its manifest (a VMM set of `buffers` buffers of one
    /// 64-byte tensor, this process its writer and its tokens' exporter), in the order and by the
    /// replacement rules of a VMM writer.
    ///
    /// # Errors
    /// As a writer's creation of these segments (another user's or a live writer's segment under
    /// the name, a FIFO, a full `/dev/shm`, ...).
    pub fn create(name: &str, buffers: usize) -> Result<HeldSetFixture> {
        let holders = HoldersSegment::create(name, buffers, 1, [0; 32], 64)?;
        let layout = Layout::new(&[TensorSpec::new("w", DType::F32, &[16])])?;
        let me = ProcessIdentity::current()?;
        let tokens = (0..buffers)
            .map(|b| {
                vec![
                    Token {
                        kind: TokenKind::VmmMemory,
                        handle: [0; 64],
                        offset: 0,
                        len: 64,
                        device: crate::driver::Uuid([0; 16]),
                        exporter: me,
                        export_id: 1 + b as u32,
                    }
                    .to_bytes(),
                ]
            })
            .collect();
        let m = Manifest {
            kind: KIND_VMM,
            flags: u32::from(buffers > 1),
            buffers,
            layout,
            tokens,
            channel_generation: 1,
            data_generation: 0,
            max_readers: 64,
            holders_generation: holders.generation(),
            generation_base: 0,
        };
        let manifest = segment::create_manifest(name, &m)?;
        Ok(HeldSetFixture {
            holders,
            manifest: Some(manifest),
        })
    }

    /// Makes only set `name`'s holders segment (`buffers` × 1 allocation), as a writer does first.
    ///
    /// # Errors
    /// As [`HeldSetFixture::create`].
    pub fn create_holders(name: &str, buffers: usize) -> Result<HeldSetFixture> {
        Ok(HeldSetFixture {
            holders: HoldersSegment::create(name, buffers, 1, [0; 32], 64)?,
            manifest: None,
        })
    }

    /// Opens set `name`'s holders segment as a holder or a tool does (owner, layout and size
    /// checked).
    ///
    /// # Errors
    /// As the holders segment's open (missing, another user's, not a file, sparse, foreign, ...).
    pub fn open(name: &str) -> Result<HeldSetFixture> {
        Ok(HeldSetFixture {
            holders: HoldersSegment::open(name, None)?,
            manifest: None,
        })
    }

    /// Claims a slot for this process in `role` (export ids 1..=E); returns its index. The slot
    /// stays claimed until this process dies or `gc` frees it.
    ///
    /// # Errors
    /// As a holder's claim (every slot taken by a live process, a segment cut short).
    pub fn claim(&self, role: HolderRole) -> Result<usize> {
        let me = ProcessIdentity::current()?;
        self.claim_for(role, me, rustix::process::geteuid().as_raw())
    }

    /// Claims a slot in `role` recording process `who` of `uid` as its server (a dead one: a slot
    /// a killed holder left); returns its index.
    ///
    /// # Errors
    /// As [`HeldSetFixture::claim`].
    pub fn claim_for(&self, role: HolderRole, who: ProcessIdentity, uid: u32) -> Result<usize> {
        let ids: Vec<u32> = (1..=self.holders.entries() as u32).collect();
        Ok(self.holders.claim_as(role, &ids, who, uid)?.index)
    }

    /// The serving slots, as tools read them.
    pub fn holders(&self) -> Vec<HolderSnapshot> {
        self.holders.snapshot()
    }

    /// The holders segment's creation generation.
    pub fn generation(&self) -> u64 {
        self.holders.generation()
    }

    /// The holders segment's name (`cuda-ipc.th.NAME`).
    pub fn holders_segment(&self) -> &str {
        self.holders.name()
    }

    /// Unlinks the holders segment and the manifest made here, each only while its name still
    /// stands for it.
    pub fn unlink(&self) {
        self.holders.unlink();
        if let Some(m) = &self.manifest {
            segment::unlink_own(m);
        }
    }
}
