//! A reader's stable addresses ([`super::ReaderOptions::stable_addresses`]): one reserved virtual
//! address range per allocation of a buffer, kept for the reader's life, at which the generation
//! the reader chooses is mapped ([`super::TensorSetReader::switch_stable`]), so CUDA graphs
//! captured over those addresses stay valid across generations.
//!
//! Owns: the ranges (`ipc::StableRange`: reserve, retain, unmap, map, set access, release), the
//! hold on the generation mapped there (a channel frame's hold detached from its borrow, counted
//! in the reader's holds like a guard's) and the lock that serialises switches. The reader's
//! takes, guards and imports are `reader.rs`'s, which calls in here; this file names none of its
//! types.

use super::error::TensorSetError;
use super::manifest::Layout;
use crate::channel::FrameHold;
use crate::driver::{Context, DeviceMemory, Stream};
use crate::error::{Error, Result};
use crate::ipc::{Access, ImportedBuffer, StableRange};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What [`super::TensorSetReader::switch_stable`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StableSwitch {
    /// The generation at the stable addresses now.
    pub generation: u64,
    /// Whether its memory was mapped there by this call (`false`: it was there already, or the
    /// set is in place, whose stable addresses are its buffer's own).
    pub remapped: bool,
    /// The whole call, in microseconds: the wait for the context's work
    /// (`cuCtxSynchronize`, or the reader's stream on the paths that map nothing) and the
    /// remapping.
    pub micros: u64,
    /// The remapping alone (per allocation `cuMemRetainAllocationHandle`, `cuMemUnmap`,
    /// `cuMemMap`, `cuMemSetAccess`, `cuMemRelease`), in microseconds; 0 when nothing was mapped.
    pub remap_micros: u64,
}

/// The generation mapped at the stable addresses, and the reader's hold on it.
struct Current {
    buffer: usize,
    generation: u64,
    hold: FrameHold,
}

/// Under the switch lock.
struct State {
    /// One per allocation of a buffer (empty in place: the addresses are buffer 0's own).
    ranges: Vec<StableRange>,
    current: Option<Current>,
}

/// A reader's stable addresses (see the module doc).
pub(super) struct Stable {
    // Drop order: the ranges are unmapped and freed (in `State`'s drop, or by `close`) before
    // the context reference goes; the reader releases the hold through `close` first.
    state: Mutex<State>,
    /// The stable address of allocation `a`'s first byte as the tensors' offsets count it (its
    /// range plus the import's offset in its allocation); fixed for the reader's life.
    bases: Vec<u64>,
    access: Access,
    ctx: Arc<Context>,
}

/// Releases a detached hold of buffer `b` through the reader's hold count.
pub(super) type Release<'r> = &'r dyn Fn(usize, FrameHold);

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl Stable {
    /// Reserves one range per allocation of a buffer (the largest of the B buffers' physical
    /// allocations, rounded up to the granularity) over `imports[b][a]`; in place (B = 1) the
    /// stable addresses are buffer 0's own and nothing is reserved.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when an allocation's tensors start at different offsets of
    /// their allocations in different buffers; [`Error::Cuda`] naming `cuMemAddressReserve`.
    pub(super) fn open(
        ctx: &Arc<Context>,
        imports: &[Vec<ImportedBuffer>],
        read_only: bool,
    ) -> Result<Stable> {
        let access = if read_only {
            Access::ReadOnly
        } else {
            Access::ReadWrite
        };
        let first = imports.first().map(Vec::as_slice).unwrap_or_default();
        let (mut ranges, mut bases) = (Vec::new(), Vec::with_capacity(first.len()));
        if imports.len() == 1 {
            bases.extend(first.iter().map(DeviceMemory::device_ptr));
        } else {
            for (a, b0) in first.iter().enumerate() {
                let offset_in = |b: &ImportedBuffer| b.device_ptr() - b.allocation_base();
                let off = offset_in(b0);
                let mut size = 0;
                for row in imports {
                    let Some(b) = row.get(a) else { continue };
                    if offset_in(b) != off {
                        return Err(Error::InvalidArgument(format!(
                            "allocation {a} starts at different offsets of its memory in \
                             different buffers: no one stable address fits them"
                        )));
                    }
                    size = size.max(b.allocation_size());
                }
                let range = StableRange::reserve(ctx, size)?;
                bases.push(range.ptr() + off);
                ranges.push(range);
            }
        }
        Ok(Stable {
            state: Mutex::new(State {
                ranges,
                current: None,
            }),
            bases,
            access,
            ctx: ctx.clone(),
        })
    }

    /// The stable address of tensor `i`.
    pub(super) fn ptr(&self, layout: &Layout, i: usize) -> Result<u64> {
        let info = layout
            .tensors()
            .get(i)
            .ok_or_else(|| TensorSetError::NoSuchTensor(i.to_string()))?;
        let base = self.bases.get(info.allocation as usize).ok_or_else(|| {
            Error::InvalidArgument(format!("tensor {i} names a missing allocation"))
        })?;
        Ok(base + info.offset)
    }

    /// The generation at the stable addresses.
    pub(super) fn generation(&self) -> Option<u64> {
        lock(&self.state).current.as_ref().map(|c| c.generation)
    }

    /// Maps `generation` (held in `buffer` by `hold`) at the stable addresses, as
    /// [`super::TensorSetReader::switch_stable`] documents; `imports[b][a]` as at open;
    /// `stream` the reader's.
    pub(super) fn switch(
        &self,
        imports: &[Vec<ImportedBuffer>],
        stream: &Stream,
        (buffer, generation, hold): (usize, u64, FrameHold),
        release: Release<'_>,
    ) -> Result<StableSwitch> {
        let start = Instant::now();
        let mut st = lock(&self.state);
        let same = st.current.as_ref().is_some_and(|c| c.buffer == buffer);
        if same || st.ranges.is_empty() {
            // Nothing to map: the same buffer again (a held buffer is not rewritten, so the same
            // generation), or an in-place set, whose stable addresses are its buffer's own. The
            // generation is ready on the reader's stream: make it ready for every stream.
            if let Err(e) = stream.synchronize() {
                release(buffer, hold);
                return Err(e);
            }
            if same {
                release(buffer, hold);
            } else if let Some(old) = st.current.replace(Current {
                buffer,
                generation,
                hold,
            }) {
                release(old.buffer, old.hold);
            }
            let generation = st.current.as_ref().map_or(generation, |c| c.generation);
            return Ok(StableSwitch {
                generation,
                remapped: false,
                micros: micros(start.elapsed()),
                remap_micros: 0,
            });
        }
        // No work of the context may still read the old generation at the stable addresses when
        // they are unmapped; this also waits for the new generation's ready word, which the
        // reader's stream waits for since the take.
        if let Err(e) = self.ctx.synchronize() {
            release(buffer, hold);
            return Err(e);
        }
        let remap_start = Instant::now();
        let Some(row) = imports.get(buffer) else {
            release(buffer, hold);
            return Err(Error::InvalidArgument(format!("no buffer {buffer}")));
        };
        let mut mapped = Ok(());
        for (range, b) in st.ranges.iter_mut().zip(row) {
            mapped = range.map_from(b.allocation_base(), b.allocation_size(), self.access);
            if mapped.is_err() {
                break;
            }
        }
        if let Err(e) = mapped {
            // Nothing half-switched: every range left unmapped (reads there fault rather than
            // read a buffer the writer may rewrite), both holds released.
            for range in &mut st.ranges {
                if let Err(u) = range.unmap() {
                    tracing::warn!("{u}; a stable range stays mapped after a failed switch");
                }
            }
            release(buffer, hold);
            if let Some(old) = st.current.take() {
                release(old.buffer, old.hold);
            }
            return Err(e);
        }
        let remap = remap_start.elapsed();
        let old = st.current.replace(Current {
            buffer,
            generation,
            hold,
        });
        // After the synchronisation: no work reads the old generation's buffer any more; its
        // release word goes on the reader's stream.
        if let Some(old) = old {
            release(old.buffer, old.hold);
        }
        Ok(StableSwitch {
            generation,
            remapped: true,
            micros: micros(start.elapsed()),
            remap_micros: micros(remap),
        })
    }

    /// Lets the stable generation go: waits for the context's work (`cuCtxSynchronize`),
    /// unmaps the ranges (buffered sets) and releases the hold. `false` when none was held.
    pub(super) fn release(&self, release: Release<'_>) -> Result<bool> {
        let mut st = lock(&self.state);
        if st.current.is_none() {
            return Ok(false);
        }
        self.ctx.synchronize()?;
        for range in &mut st.ranges {
            range.unmap()?;
        }
        if let Some(old) = st.current.take() {
            release(old.buffer, old.hold);
        }
        Ok(true)
    }

    /// The reader's drop: waits for the context's work, unmaps and frees the ranges, then
    /// releases the hold (on the reader's stream, before the consumer leaves the channel).
    pub(super) fn close(self, release: Release<'_>) {
        let mut st = self.state.into_inner().unwrap_or_else(|p| p.into_inner());
        if st.current.is_some()
            && !st.ranges.is_empty()
            && let Err(e) = self.ctx.synchronize()
        {
            tracing::warn!("{e}; unmapping the stable ranges anyway");
        }
        // Each range unmaps and frees its reservation as it drops.
        drop(std::mem::take(&mut st.ranges));
        if let Some(old) = st.current.take() {
            release(old.buffer, old.hold);
        }
    }
}
