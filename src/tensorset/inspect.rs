//! Read-only snapshots of tensor sets, for tools (`cuda-ipc ls`, `watch`, `gc`): the manifest's
//! header and counts, the writer and its liveness, and the generation channel's state (the
//! generation, the readers, their holds) and the holders segment (who serves the set's fds, the
//! last whole generation), read with the openers' checks and atomic loads only; nothing is
//! joined, attached or repaired.

use super::holders::{HolderSnapshot, inspect_holders};
use super::manifest::{KIND_HOST, KIND_LEGACY, KIND_POOL, KIND_VMM};
use super::segment::{self, DATA_PREFIX, GENERATION_PREFIX, HOLDERS_PREFIX, MANIFEST_PREFIX};
use crate::channel::inspect::{ChannelSnapshot, inspect_in};
use crate::error::Result;
use crate::identity::{Liveness, ProcessIdentity};

/// One reader of a set, as its generation channel's consumer slot records it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReaderSnapshot {
    /// Its slot in the generation channel.
    pub slot: usize,
    /// Its process.
    pub identity: ProcessIdentity,
    /// Whether it runs.
    pub liveness: Liveness,
    /// The generations it holds now (one per buffer held).
    pub held: Vec<u64>,
    /// The newest generation it took.
    pub cursor: u64,
}

/// What a tensor set is now.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TensorSetSnapshot {
    /// The set's name.
    pub name: String,
    /// The manifest segment's name.
    pub segment: String,
    /// The writer.
    pub writer: ProcessIdentity,
    /// Whether the writer runs.
    pub writer_liveness: Liveness,
    /// `host`, `legacy`, `vmm` or `pool`.
    pub memory: &'static str,
    /// Buffered (B ≥ 2) or in place.
    pub buffered: bool,
    /// Buffers B.
    pub buffers: usize,
    /// Allocations per buffer A.
    pub allocations: usize,
    /// Tensors.
    pub tensors: usize,
    /// Bytes of one buffer.
    pub bytes_per_buffer: u64,
    /// Bytes of the set (B × bytes per buffer).
    pub bytes: u64,
    /// The layout fingerprint.
    pub fingerprint: [u8; 32],
    /// The newest generation published (0: none; also when the generation channel cannot be
    /// read).
    pub generation: u64,
    /// The readers attached.
    pub readers: Vec<ReaderSnapshot>,
    /// Holds outstanding (over all readers and buffers).
    pub holds: u32,
    /// The generation channel as read (`None` when it is gone: a dead writer's set whose
    /// channel was removed, or a writer that never got that far; or cannot be read:
    /// [`channel_problem`](Self::channel_problem)).
    pub channel: Option<ChannelSnapshot>,
    /// Why the generation channel could not be read, where it could not (`None` when it was
    /// read): missing, something else under its name (a FIFO, another user's file), or a
    /// channel of another creation than the manifest names. `generation`, `readers` and `holds`
    /// then say nothing of the set.
    pub channel_problem: Option<String>,
    /// The serving slots of the holders segment (the writer, holders, serving readers; dead ones
    /// included, with their liveness). Empty for a set without one (host, pool, legacy).
    pub holders: Vec<HolderSnapshot>,
    /// The last whole generation its holders segment records (`None`: none, or no segment): what
    /// a reader opened after the writer's death reads.
    pub whole_generation: Option<u64>,
    /// For a host set, why its data segment `cuda-ipc.td.NAME` cannot be used, as a reader's open
    /// finds it (missing, cut short of its buffers, sparse, another creation, a FIFO, ...: the
    /// open fails with this error); `None` when it can, and for a set of device memory. Checked
    /// without reading past the file's size: the segment is mapped only once its length and
    /// pages are checked, and only its header is read.
    pub data_problem: Option<String>,
}

impl TensorSetSnapshot {
    /// Live servers other than the writer (holders and serving readers): while there is one, a
    /// dead writer's set stays attachable and its device memory (`bytes`) stays pinned.
    pub fn live_holders(&self) -> usize {
        self.holders
            .iter()
            .filter(|h| {
                h.role != super::HolderRole::Writer && h.liveness != crate::identity::Liveness::Dead
            })
            .count()
    }
}

fn kind_name(code: u32) -> &'static str {
    match code {
        KIND_HOST => "host",
        KIND_LEGACY => "legacy",
        KIND_VMM => "vmm",
        KIND_POOL => "pool",
        _ => "unknown",
    }
}

/// The names of this user's tensor sets in `/dev/shm`: every name with a manifest, generation
/// channel, host data or holders segment name of this user's, whatever stands there (a FIFO, a
/// directory or a symbolic link under a part's name blocks the set's creation: listed, and
/// [`inspect`] or [`super::reclaim::judged_parts`] says what it is), sorted, once each. Another user's are
/// left out, as [`crate::channel::inspect::list_channels`] leaves their channels out: their
/// segments cannot be read here (`WrongOwner`) and are not ours to clean.
///
/// # Errors
/// [`crate::Error::Os`] when `/dev/shm` cannot be listed.
pub fn list_tensor_sets() -> Result<Vec<String>> {
    let mut names: Vec<String> = crate::shm::list_own_names()?
        .into_iter()
        .filter_map(|s| {
            [
                MANIFEST_PREFIX,
                GENERATION_PREFIX,
                DATA_PREFIX,
                HOLDERS_PREFIX,
            ]
            .iter()
            .find_map(|p| s.strip_prefix(p).map(str::to_string))
        })
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

/// A snapshot of tensor set `name`.
///
/// The generation channel is read after the manifest: where it cannot be read,
/// [`TensorSetSnapshot::channel_problem`] says why (in the set's words), unless the manifest's name
/// no longer stands for the manifest read (the set was closed meanwhile: `NotFound`; made again:
/// read again, once).
///
/// # Errors
/// As the reader's open of the manifest ([`super::TensorSetError::NotFound`], `BadManifest`,
/// `VersionMismatch`, the segment's own errors); [`super::TensorSetError::NotFound`] for a set
/// closed while it was read.
pub fn inspect(name: &str) -> Result<TensorSetSnapshot> {
    let mut first = true;
    let (opened, channel, channel_problem, data_problem) = loop {
        let opened = segment::open_manifest(name, segment::INIT_WAIT)?;
        let m = &opened.manifest;
        let (channel, channel_problem) = match inspect_in(GENERATION_PREFIX, name) {
            Ok(c) if c.generation == m.channel_generation => (Some(c), None),
            Ok(c) => (
                None,
                Some(format!(
                    "{GENERATION_PREFIX}{name} is of another creation (generation {}, the \
                     manifest names {})",
                    c.generation, m.channel_generation
                )),
            ),
            // In the set's words: the channel layer's "no channel named" speaks of a producer.
            Err(e) if super::is_not_found(&e) => (
                None,
                Some(
                    crate::shm::ShmError::NotFound {
                        name: format!("{GENERATION_PREFIX}{name}"),
                    }
                    .to_string(),
                ),
            ),
            Err(e) => (None, Some(e.to_string())),
        };
        // A set closed while it was read (its writer unlinks the manifest first, then closes the
        // generation channel and its data segment) is gone, not a set without its channel or
        // data; one made again meanwhile is read again, once.
        let still_this = || match (
            crate::shm::Segment::stat(opened.seg.name()),
            opened.seg.inode(),
        ) {
            (Ok(now), Ok(read)) => now.inode == read,
            (Err(e), _) => !super::is_not_found(&e),
            _ => true,
        };
        // As a reader's open maps it (`DataSegment::open`): the header and the length the
        // manifest names, never a byte past the file's end.
        let data_problem = (m.kind == KIND_HOST)
            .then(|| segment::DataSegment::open(name, m).err())
            .flatten()
            .map(|e| e.to_string());
        if (channel_problem.is_some() || data_problem.is_some()) && !still_this() {
            if first {
                first = false;
                continue;
            }
            return Err(super::TensorSetError::NotFound(name.to_string()).into());
        }
        break (opened, channel, channel_problem, data_problem);
    };
    let (writer, uid) = opened.header().writer();
    let m = &opened.manifest;
    let (generation, readers, holds) = match &channel {
        Some(c) => {
            let readers = c
                .consumers
                .iter()
                .map(|x| ReaderSnapshot {
                    slot: x.index,
                    identity: x.identity,
                    liveness: x.liveness,
                    held: x
                        .holds
                        .iter()
                        .filter_map(|&i| match c.buffers[i].state {
                            crate::channel::inspect::BufferState::Frame(g) => Some(g),
                            _ => None,
                        })
                        .collect(),
                    cursor: x.cursor,
                })
                .collect::<Vec<_>>();
            let holds = c.buffers.iter().map(|b| b.hold_mask.count_ones()).sum();
            (c.head, readers, holds)
        }
        None => (0, Vec::new(), 0),
    };
    let bytes_per_buffer = m.layout.bytes_per_buffer();
    // The holders segment the manifest names (one of another generation is not this set's).
    let (holders, whole_generation) = match inspect_holders(name) {
        Ok(Some((h, whole, g))) if m.holders_generation != 0 && g == m.holders_generation => {
            (h, whole)
        }
        _ => (Vec::new(), None),
    };
    Ok(TensorSetSnapshot {
        name: name.to_string(),
        segment: opened.seg.name().to_string(),
        writer,
        writer_liveness: writer.liveness_as(uid),
        memory: kind_name(m.kind),
        buffered: m.buffers > 1,
        buffers: m.buffers,
        allocations: m.layout.allocations().len(),
        tensors: m.layout.len(),
        bytes_per_buffer,
        bytes: bytes_per_buffer.saturating_mul(m.buffers as u64),
        fingerprint: m.layout.fingerprint(),
        generation,
        readers,
        holds,
        channel,
        channel_problem,
        holders,
        whole_generation,
        data_problem,
    })
}
