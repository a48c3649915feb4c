//! How a channel is created and attached: [`ChannelOptions`], [`ConsumerOptions`], [`MemoryKind`],
//! the checks of those options and of host buffer ranges, and the settings both ends share.

#[cfg(doc)]
use super::MAX_CONSUMERS;
use super::{ChannelError, Delivery, MAX_BUFFERS, WaitStrategy};
use crate::error::{Error, Result};
#[cfg(doc)]
use crate::ipc::{MemPool, VmmBuffer};
use crate::quota::QuotaScope;
use std::time::Duration;

/// How often a producer waiting for a consumer's GPU work checks that the consumer still lives.
pub(super) const LIVENESS_CHECK: Duration = Duration::from_millis(20);

/// The error message of the GPU accessors (stream, context, device buffer) on a host channel.
pub(super) const HOST_NO_GPU: &str = "a host-memory channel has no GPU side (no stream, context or \
                                      device buffer): use the host accessors (as_ptr, len, read_at, \
                                      write_at)";

/// How a channel is created.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ChannelOptions {
    /// Buffers in the pool (1 to [`MAX_BUFFERS`]); default 4.
    pub buffers: usize,
    /// Bytes per buffer.
    pub buffer_bytes: usize,
    /// Most consumers attached at once (1 to [`MAX_CONSUMERS`]); default 8.
    pub max_consumers: usize,
    /// A cap the producer puts on itself: the pool's bytes (`buffers × buffer_bytes`) may not
    /// exceed it, checked before anything is allocated ([`ChannelError::PoolOverCap`]); `None` for
    /// no cap. It counts this pool alone; for a budget shared by several processes see
    /// [`ChannelOptions::quota`].
    pub quota_bytes: Option<u64>,
    /// The shared budget this pool reserves from ([`crate::quota`]): `Some(scope)` reserves
    /// `buffers × buffer_bytes` bytes from the ledger of `scope` for the pool's device (host
    /// channels: the all-zero UUID) before the pool is allocated, and returns them when the
    /// producer closes or drops (a killed producer's bytes are reclaimed at the ledger's next
    /// reserve or inspection). Past the budget, creation fails with
    /// [`crate::quota::QuotaError::OverQuota`] naming who holds how much. `None` (the default):
    /// no ledger is used. The ledger must exist (its budget set, e.g. by `cuda-ipc quota set`);
    /// without it the producer is refused with [`crate::quota::QuotaError::NoBudget`].
    pub quota: Option<QuotaScope>,
    /// How the producer waits in [`Producer::acquire`].
    ///
    /// [`Producer::acquire`]: super::Producer::acquire
    pub wait: WaitStrategy,
    /// Give the control segment mode 0660 instead of 0600, so consumers of other users in the
    /// segment's group can attach (with [`ConsumerOptions::group_access`]). Legacy pools only: the
    /// file descriptors of VMM and memory-pool buffers are served to the same user alone.
    pub group_access: bool,
    /// Which kind of exportable memory the pool is made of; default [`MemoryKind::Auto`].
    pub memory: MemoryKind,
    /// Hand buffers out in ring order: frame `s` always lands in buffer `(s - 1) % buffers`, so
    /// every-frame consumers can post their receives ahead ([`Consumer::post`]). The producer
    /// then waits for the next buffer of the ring even when another one is free (a latest-only
    /// consumer's hold, or an every-frame consumer behind by `buffers` frames, holds it back);
    /// default off (the oldest free buffer).
    ///
    /// [`Consumer::post`]: super::Consumer::post
    pub ring: bool,
}

/// The kind of exportable memory a channel's pool is made of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemoryKind {
    /// VMM memory ([`MemoryKind::Vmm`]) where the device exports it as a file descriptor, else
    /// legacy IPC ([`MemoryKind::Legacy`]); legacy also when [`ChannelOptions::group_access`] is
    /// set (VMM descriptors are served to the producer's user alone) or the driver refuses the
    /// VMM allocation. VMM first because its imports work between any two processes of a user:
    /// a legacy handle cannot be opened by a process whose pid equals the producer's in another
    /// pid namespace (two containers whose main processes are both pid 1), and its consumers'
    /// mappings outlive a producer that dies. [`crate::channel::Producer::memory_kind`] says which
    /// kind was chosen.
    #[default]
    Auto,
    /// `cuMemAlloc` buffers shared through `IpcMemHandle`s. Consumers of other users may attach
    /// (with [`ChannelOptions::group_access`]); a consumer whose pid equals the producer's in
    /// another pid namespace cannot (the driver takes it for the producer), and gets
    /// [`crate::Error::NotImportable`] naming the cause and the fix.
    Legacy,
    /// `cuMemCreate` buffers shared as POSIX file descriptors ([`VmmBuffer`]): each consumer holds
    /// its own reference to the memory, so its mappings stay valid if the producer dies.
    Vmm,
    /// Allocations from an exportable stream-ordered memory pool ([`MemPool`], one per producer),
    /// shared through the pool's file descriptor and each pointer's export data. As with legacy
    /// memory, the driver wants consumers to drop their imports before the producer frees the pool.
    Pool,
    /// Shared host memory, no GPU: the pool is one POSIX shared-memory segment
    /// (`/dev/shm/cuda-ipc.hp.NAME`) beside the control segment, made by [`Producer::create_host`]
    /// and attached by [`Consumer::attach`] without the CUDA driver. Frames give their bytes as a
    /// raw pointer and length ([`WriteFrame::as_mut_ptr`], [`Frame::as_ptr`]) and through copy
    /// helpers ([`WriteFrame::write_at`], [`Frame::read_at`]). Stream ordering degrades to host
    /// ordering: there are no streams, ready words or events; the producer's writes are visible to
    /// a consumer that received the frame, and a consumer's reads are done once it dropped it.
    ///
    /// [`Producer::create_host`]: super::Producer::create_host
    /// [`Consumer::attach`]: super::Consumer::attach
    /// [`WriteFrame::as_mut_ptr`]: super::WriteFrame::as_mut_ptr
    /// [`Frame::as_ptr`]: super::Frame::as_ptr
    /// [`WriteFrame::write_at`]: super::WriteFrame::write_at
    /// [`Frame::read_at`]: super::Frame::read_at
    Host,
}

impl ChannelOptions {
    /// A pool of 4 buffers of `buffer_bytes` bytes, 8 consumers, default waiting.
    pub fn new(buffer_bytes: usize) -> Self {
        ChannelOptions {
            buffers: 4,
            buffer_bytes,
            max_consumers: 8,
            quota_bytes: None,
            quota: None,
            wait: WaitStrategy::default(),
            group_access: false,
            memory: MemoryKind::Auto,
            ring: false,
        }
    }
    /// Sets ring order (see [`ChannelOptions::ring`]).
    pub fn ring(mut self, on: bool) -> Self {
        self.ring = on;
        self
    }
    /// The control header's flags for these options.
    pub(super) fn flags(&self) -> u32 {
        if self.ring {
            super::layout::FLAG_RING
        } else {
            0
        }
    }
    /// Gives the control segment group access (see [`ChannelOptions::group_access`]).
    pub fn group_access(mut self, on: bool) -> Self {
        self.group_access = on;
        self
    }
    /// Sets the kind of pool memory.
    pub fn memory(mut self, kind: MemoryKind) -> Self {
        self.memory = kind;
        self
    }
    /// Sets the number of buffers.
    pub fn buffers(mut self, n: usize) -> Self {
        self.buffers = n;
        self
    }
    /// Sets the most consumers.
    pub fn max_consumers(mut self, n: usize) -> Self {
        self.max_consumers = n;
        self
    }
    /// Sets the producer's own cap on the pool's bytes ([`ChannelOptions::quota_bytes`]).
    pub fn quota_bytes(mut self, q: u64) -> Self {
        self.quota_bytes = Some(q);
        self
    }
    /// Reserves the pool from the shared budget of `scope` ([`ChannelOptions::quota`]).
    pub fn quota(mut self, scope: QuotaScope) -> Self {
        self.quota = Some(scope);
        self
    }
    /// Sets the producer's wait strategy.
    pub fn wait(mut self, w: WaitStrategy) -> Self {
        self.wait = w;
        self
    }
}

/// How a consumer attaches.
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct ConsumerOptions {
    /// Every frame (back-pressure) or the latest only.
    pub delivery: Delivery,
    /// How [`Consumer::recv`] waits.
    ///
    /// [`Consumer::recv`]: super::Consumer::recv
    pub wait: WaitStrategy,
    /// Also attach to a channel of another user of one of this process's groups, when its
    /// producer gave the segment group access (mode 0660). Off by default: a channel of another
    /// user is refused as `WrongOwner`.
    pub group_access: bool,
}

impl ConsumerOptions {
    /// Every frame, default waiting.
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets the delivery policy.
    pub fn delivery(mut self, d: Delivery) -> Self {
        self.delivery = d;
        self
    }
    /// Sets the wait strategy.
    pub fn wait(mut self, w: WaitStrategy) -> Self {
        self.wait = w;
        self
    }
    /// Accepts a group-shared channel of another user (see [`ConsumerOptions::group_access`]).
    pub fn group_access(mut self, on: bool) -> Self {
        self.group_access = on;
        self
    }
}

/// The pool's bytes, `buffers × buffer_bytes`.
///
/// # Errors
/// [`Error::InvalidArgument`] when that is 2^64 bytes or more: refused as such, never reserved
/// or compared as a saturated count.
fn pool_bytes(opts: &ChannelOptions) -> Result<u64> {
    (opts.buffers as u64)
        .checked_mul(opts.buffer_bytes as u64)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "a pool of {} buffers of {} bytes is 2^64 bytes or more",
                opts.buffers, opts.buffer_bytes
            ))
        })
}

/// Checks `opts`' buffer count, the pool's size ([`pool_bytes`]) and its memory cap.
pub(super) fn check_options(opts: &ChannelOptions) -> Result<()> {
    let bytes = pool_bytes(opts)?;
    if let Some(q) = opts.quota_bytes
        && bytes > q
    {
        return Err(ChannelError::PoolOverCap {
            buffers: opts.buffers,
            buffer_bytes: opts.buffer_bytes,
            quota: q,
        }
        .into());
    }
    if opts.buffers == 0 || opts.buffers > MAX_BUFFERS {
        return Err(Error::InvalidArgument(format!(
            "a pool needs 1 to {MAX_BUFFERS} buffers, got {}",
            opts.buffers
        )));
    }
    Ok(())
}

/// Reserves the pool's bytes ([`pool_bytes`]) from the ledger `opts.quota` names for `device`,
/// or nothing when it names none; `pool` is the host pool's segment name (host memory).
pub(super) fn reserve_quota(
    opts: &ChannelOptions,
    device: crate::driver::Uuid,
    pool: Option<&str>,
) -> Result<Option<crate::quota::Reservation>> {
    crate::quota::reserve_in(opts.quota, device, pool_bytes(opts)?, pool)
}

/// The error of a host accessor (`read_at`, `write_at`) used on a GPU channel's frame.
pub(super) fn no_host_bytes() -> Error {
    Error::InvalidArgument(
        "a GPU channel's frame has no host bytes; use buffer() on stream()".into(),
    )
}
