//! Producer/consumer GPU pipelines: a [`Producer`] hands frames from a pool of exportable device
//! buffers to one or more [`Consumer`] processes with zero copies, each in its own CUDA context.
//!
//! Owns: the pool, the hand-off protocol (control segment, holds, releases, delivery policies,
//! dead-peer recovery) and its GPU side (stream-ordered hand-off through ready words, release through IPC events).
//! Built on [`crate::ipc`], [`crate::driver`] and [`crate::shm`]; it never changes those layers.
//!
//! One hand-off:
//! 1. the producer [`acquires`](Producer::acquire) a free buffer once the release events of the
//!    consumers that last read it completed, so the write cannot overtake their kernels (checked on
//!    the host: a stream wait on another process's event would block for good if that process died);
//! 2. it enqueues its GPU work on [`Producer::stream`] and [`publishes`](WriteFrame::publish) with up
//!    to [`META_BYTES`] of metadata: the sequence number is bumped and the producer's stream then
//!    writes the buffer's ready word, a `u32` in the control segment's page registered with the
//!    driver;
//! 3. a consumer's [`recv`](Consumer::recv) returns a [`Frame`] whose ready word its stream already
//!    waits for (`cuStreamWaitValue32`, no host synchronisation); it enqueues its own kernels on
//!    [`Consumer::stream`]. If the producer dies before its write finished, the consumer marks the
//!    word ready itself so its stream drains (a wait on a dead process's IPC event never ends);
//! 4. dropping the frame records the consumer's release event and ends its hold.
//!
//! A consumer that dies has its holds released by the producer within about 20 ms of the producer
//! needing the buffer; consumers of a producer that dies get [`Error::ProducerGone`] within about
//! 20 ms; [`Producer::close`] waits (bounded) for outstanding holds and reports the ones it forced.

mod control;
mod host;
pub mod inspect;
#[doc(hidden)]
pub mod layout;
pub mod owned;

pub use control::{ChannelStats, ConsumerStats, MAX_CHANNEL_NAME, WaitStrategy};
pub use layout::{
    ConsumerState, Delivery, MAX_BUFFERS, MAX_CONSUMERS, META_BYTES, ProducerState, UnknownCode,
};

use crate::driver::{Context, Device, DeviceBuffer, DeviceMemory, Event, HostRegistration, Stream};
use crate::error::{Error, Result};
use crate::ffi::sys;
use crate::identity::{Liveness, ProcessIdentity};
use crate::ipc::{ImportedBuffer, IpcEvent, MemPool, PoolBuffer, VmmBuffer};
use crate::shm::SegmentOptions;
use crate::token::{TOKEN_LEN, Token, TokenKind};
use control::Control;
use host::HostPool;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a producer waiting for a consumer's GPU work checks that the consumer still lives.
const LIVENESS_CHECK: Duration = Duration::from_millis(20);
/// How long it polls the consumer's release event before sleeping between polls.
const SPIN: Duration = Duration::from_micros(50);

/// Errors of the channel layer: what its own segments' contents and its protocol report.
///
/// What the segment under a channel reports (another user's, not a file, sparse, too small) comes
/// as [`Error::Shm`], unwrapped, as from any other opener of a segment; a channel name without a
/// segment is [`ChannelError::NotFound`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelError {
    /// No channel of this name exists (no producer created it, or it was closed).
    #[error("no channel named {0:?} (start its producer first)")]
    NotFound(String),
    /// A live producer already serves this channel name.
    #[error("channel {channel:?} already has a live producer (pid {pid})")]
    AlreadyExists {
        /// The channel name.
        channel: String,
        /// The live producer's pid.
        pid: u32,
    },
    /// Every consumer slot is taken.
    #[error("all {0} consumer slots of the channel are taken")]
    NoConsumerSlot(usize),
    /// The control segment is foreign, of another version, truncated or corrupted.
    #[error("bad channel segment: {0}")]
    BadSegment(String),
    /// This consumer's slot was taken back (the producer judged it dead, or it detached).
    #[error("this consumer was detached from the channel")]
    Detached,
    /// The channel's segment has another layout version than this build reads: a producer or
    /// consumer of another cuda-ipc version. Never replaced automatically, since its producer may
    /// be alive (its liveness cannot be read in a layout this build does not know).
    #[error(
        "channel {channel:?} has layout version {found}, this build reads version {supported}; \
         stop its producer (another cuda-ipc version), or remove /dev/shm/cuda-ipc.ch.{channel} if it is gone"
    )]
    VersionMismatch {
        /// The channel name.
        channel: String,
        /// The version in the segment.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// Another process is creating this channel right now (its segment is younger than 2 s and
    /// not finished).
    #[error("channel {0:?} is being created by another process; try again")]
    CreationInProgress(String),
    /// The channel's name now stands for another segment than the one this handle attached to
    /// (it was removed and made again, e.g. by a restarted producer after `cuda-ipc gc`). Attach
    /// again.
    #[error("channel {0:?} was superseded: its segment was removed and made again; attach again")]
    Superseded(String),
    /// The pool would exceed the memory quota the user set.
    #[error("a pool of {buffers} × {buffer_bytes} bytes exceeds the quota of {quota} bytes")]
    OverQuota {
        /// Buffers asked for.
        buffers: usize,
        /// Bytes per buffer.
        buffer_bytes: usize,
        /// The quota in bytes.
        quota: u64,
    },
}

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
    /// Upper bound on the pool's device memory in bytes; `None` for no bound.
    pub quota_bytes: Option<u64>,
    /// How the producer waits in [`Producer::acquire`].
    pub wait: WaitStrategy,
    /// Give the control segment mode 0660 instead of 0600, so consumers of other users in the
    /// segment's group can attach (with [`ConsumerOptions::group_access`]). Legacy pools only: the
    /// file descriptors of VMM and memory-pool buffers are served to the same user alone.
    pub group_access: bool,
    /// Which kind of exportable memory the pool is made of; default [`MemoryKind::Auto`].
    pub memory: MemoryKind,
}

/// The kind of exportable memory a channel's pool is made of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Legacy IPC ([`MemoryKind::Legacy`]) where the platform supports it, else VMM.
    #[default]
    Auto,
    /// `cuMemAlloc` buffers shared through `IpcMemHandle`s.
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
    Host,
}

/// One buffer of a producer's pool: legacy, VMM or memory-pool memory. Use it through
/// [`DeviceMemory`].
#[derive(Debug)]
#[non_exhaustive]
pub enum ChannelBuffer {
    /// A `cuMemAlloc` buffer.
    Legacy(DeviceBuffer),
    /// A `cuMemCreate` buffer.
    Vmm(VmmBuffer),
    /// An allocation from the producer's exportable [`MemPool`].
    Pool(PoolBuffer),
}

impl ChannelBuffer {
    fn new(
        ctx: &Arc<Context>,
        kind: MemoryKind,
        len: usize,
        pool: Option<&(MemPool, Stream)>,
    ) -> Result<ChannelBuffer> {
        Ok(match (kind, pool) {
            (MemoryKind::Vmm, _) => ChannelBuffer::Vmm(VmmBuffer::new(ctx, len)?),
            (MemoryKind::Pool, Some((p, s))) => ChannelBuffer::Pool(p.alloc(len, s)?),
            _ => ChannelBuffer::Legacy(DeviceBuffer::new(ctx, len)?),
        })
    }
    fn export(&self) -> Result<Token> {
        match self {
            ChannelBuffer::Legacy(b) => b.export(),
            ChannelBuffer::Vmm(b) => b.export(),
            ChannelBuffer::Pool(b) => b.export(),
        }
    }
    /// The kind of memory.
    pub fn kind(&self) -> MemoryKind {
        match self {
            ChannelBuffer::Legacy(_) => MemoryKind::Legacy,
            ChannelBuffer::Vmm(_) => MemoryKind::Vmm,
            ChannelBuffer::Pool(_) => MemoryKind::Pool,
        }
    }
}

impl DeviceMemory for ChannelBuffer {
    fn device_ptr(&self) -> u64 {
        match self {
            ChannelBuffer::Legacy(b) => b.device_ptr(),
            ChannelBuffer::Vmm(b) => b.device_ptr(),
            ChannelBuffer::Pool(b) => b.device_ptr(),
        }
    }
    fn len(&self) -> usize {
        match self {
            ChannelBuffer::Legacy(b) => b.len(),
            ChannelBuffer::Vmm(b) => b.len(),
            ChannelBuffer::Pool(b) => b.len(),
        }
    }
    fn context(&self) -> &Arc<Context> {
        match self {
            ChannelBuffer::Legacy(b) => b.context(),
            ChannelBuffer::Vmm(b) => b.context(),
            ChannelBuffer::Pool(b) => b.context(),
        }
    }
}

impl ChannelOptions {
    /// A pool of 4 buffers of `buffer_bytes` bytes, 8 consumers, default waiting.
    pub fn new(buffer_bytes: usize) -> Self {
        ChannelOptions {
            buffers: 4,
            buffer_bytes,
            max_consumers: 8,
            quota_bytes: None,
            wait: WaitStrategy::default(),
            group_access: false,
            memory: MemoryKind::Auto,
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
    /// Sets the pool's memory quota in bytes.
    pub fn quota_bytes(mut self, q: u64) -> Self {
        self.quota_bytes = Some(q);
        self
    }
    /// Sets the producer's wait strategy.
    pub fn wait(mut self, w: WaitStrategy) -> Self {
        self.wait = w;
        self
    }
}

/// Why [`Producer::close`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Holds still outstanding at the deadline, released by force. The pool is freed right after,
    /// so a consumer that still held one of them reads undefined data from then on.
    pub forced_holds: u64,
}

/// The producing end of a channel: owns the pool and the control segment.
///
/// # Examples
/// ```no_run
/// use cuda_ipc::channel::{ChannelOptions, Producer};
/// use cuda_ipc::driver::Context;
/// let ctx = Context::default_device()?;
/// let mut tx = Producer::create(&ctx, "frames", &ChannelOptions::new(3840 * 2160 * 4))?;
/// let frame = tx.acquire(None)?;
/// // ... enqueue kernels writing frame.buffer() on frame.stream() ...
/// frame.publish(b"frame 0")?;
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub struct Producer {
    // Drop order: the control segment is closed and drained (in Drop, which also drains the stream)
    // before the ready page is unregistered, then the segment unmapped, then the host pool
    // unmapped or the buffers and events freed, and those before the stream and context.
    /// `None` for a host channel.
    ready: Option<HostRegistration>,
    control: Control,
    /// The pool of a host channel ([`MemoryKind::Host`]).
    host: Option<HostPool>,
    name: String,
    /// The GPU side; `None` for a host channel.
    gpu: Option<GpuPool>,
    wait: WaitStrategy,
    memory: MemoryKind,
    closed: bool,
}

/// A producer's GPU side.
struct GpuPool {
    // Drop order: buffers and events before the stream and context.
    buffers: Vec<ChannelBuffer>,
    /// Per consumer slot: (generation, identity, release events) of the consumer last seen there.
    consumer_events: Vec<Option<(u64, ProcessIdentity, Vec<IpcEvent>)>>,
    /// Orders the producer's stream after other streams ([`WriteFrame::publish_after`]); locked
    /// from record to wait, so two threads never cross their records.
    join: std::sync::Mutex<Event>,
    stream: Stream,
    ctx: Arc<Context>,
}

const HOST_NO_GPU: &str = "a host-memory channel has no GPU side (no stream, context or device \
                           buffer): use the host accessors (as_ptr, len, read_at, write_at)";

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Producer {
    /// Creates channel `name` in `ctx`: allocates the pool (`cuMemAlloc` or `cuMemCreate` by
    /// [`ChannelOptions::memory`], exported), one IPC event per buffer, and the control segment
    /// `/dev/shm/cuda-ipc.ch.NAME`. A segment left by a dead producer is replaced.
    ///
    /// # Errors
    /// [`ChannelError::OverQuota`]; [`ChannelError::AlreadyExists`] when a live producer serves
    /// `name`; [`Error::InvalidArgument`] for zero-size buffers or counts out of range; CUDA errors
    /// from allocation and export; shared-memory errors (a full /dev/shm, a bad name).
    pub fn create(ctx: &Arc<Context>, name: &str, opts: &ChannelOptions) -> Result<Producer> {
        if opts.memory == MemoryKind::Host {
            return Self::create_host(name, opts);
        }
        Self::check_options(opts)?;
        Self::create_gpu(ctx, name, opts)
    }

    fn check_options(opts: &ChannelOptions) -> Result<()> {
        if let Some(q) = opts.quota_bytes
            && (opts.buffers as u64).saturating_mul(opts.buffer_bytes as u64) > q
        {
            return Err(ChannelError::OverQuota {
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

    /// Creates channel `name` with a pool of shared host memory ([`MemoryKind::Host`], whatever
    /// [`ChannelOptions::memory`] says): the pool segment `/dev/shm/cuda-ipc.hp.NAME` (mode as the
    /// control segment's, pages reserved) and the control segment `/dev/shm/cuda-ipc.ch.NAME`.
    /// Never calls the CUDA driver, so it runs on machines without a GPU. Segments of a dead
    /// producer (or a creation abandoned half-way) are replaced; anything else under either name is
    /// left alone and named in the error.
    ///
    /// # Errors
    /// [`ChannelError::OverQuota`]; [`ChannelError::AlreadyExists`] when a live producer serves
    /// `name`; [`Error::InvalidArgument`] for zero-size buffers, counts out of range or a bad name;
    /// shared-memory errors for what is in the way under either name (`WrongOwner`, `NotASegment`,
    /// `CreationInProgress`, a foreign segment as [`ChannelError::BadSegment`]) and for a full
    /// /dev/shm (`NoSpace`).
    ///
    /// # Examples
    /// ```
    /// use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
    /// let name = format!("doc-host-{}", std::process::id());
    /// let mut tx = Producer::create_host(&name, &ChannelOptions::new(64))?;
    /// let rx = Consumer::attach(&name, &ConsumerOptions::new())?;
    /// let mut w = tx.acquire(None)?;
    /// w.write_at(0, b"hello")?;
    /// w.publish(b"meta")?;
    /// let f = rx.recv()?;
    /// let mut out = [0u8; 5];
    /// f.read_at(0, &mut out)?;
    /// assert_eq!(&out, b"hello");
    /// # drop(f); drop(rx);
    /// # Ok::<(), cuda_ipc::Error>(())
    /// ```
    pub fn create_host(name: &str, opts: &ChannelOptions) -> Result<Producer> {
        Self::check_options(opts)?;
        if opts.buffer_bytes == 0 {
            return Err(Error::InvalidArgument(
                "a host pool needs buffers of at least 1 byte".into(),
            ));
        }
        control::validate_channel_name(name)?;
        let seg_opts = SegmentOptions::new().group_access(opts.group_access);
        let pool = HostPool::create(name, opts.buffers, opts.buffer_bytes, &seg_opts)?;
        let me = ProcessIdentity::current()?;
        let tokens: Vec<_> = (0..opts.buffers)
            .map(|i| (pool.token(i, me).to_bytes(), [0u8; TOKEN_LEN]))
            .collect();
        let control = match Control::create(
            name,
            opts.buffer_bytes as u64,
            opts.max_consumers,
            &tokens,
            &seg_opts,
        ) {
            Ok(c) => c,
            Err(e) => {
                // The pool is ours (just made): take it away again, then report what blocked.
                pool.unlink();
                return Err(e);
            }
        };
        Ok(Producer {
            ready: None,
            control,
            host: Some(pool),
            name: name.to_string(),
            gpu: None,
            wait: opts.wait,
            memory: MemoryKind::Host,
            closed: false,
        })
    }

    fn create_gpu(ctx: &Arc<Context>, name: &str, opts: &ChannelOptions) -> Result<Producer> {
        let kind = match opts.memory {
            MemoryKind::Auto => match crate::probe::require_legacy_ipc(&ctx.device()) {
                Ok(()) => MemoryKind::Legacy,
                Err(e) => {
                    tracing::info!(
                        "channel {name}: legacy IPC unavailable ({e}); using VMM memory"
                    );
                    MemoryKind::Vmm
                }
            },
            k => k,
        };
        let stream = Stream::new(ctx)?;
        let pool = match kind {
            MemoryKind::Pool => Some((MemPool::exportable(ctx)?, Stream::new(ctx)?)),
            _ => None,
        };
        let mut buffers = Vec::with_capacity(opts.buffers);
        let mut tokens = Vec::with_capacity(opts.buffers);
        for _ in 0..opts.buffers {
            // Each buffer is its own allocation: a legacy handle exposes the whole allocation.
            let b = ChannelBuffer::new(ctx, kind, opts.buffer_bytes, pool.as_ref())?;
            // The second token area is reserved (the producer's event in layout version 1) and
            // stays zero: readiness travels through the ready page.
            tokens.push((b.export()?.to_bytes(), [0u8; TOKEN_LEN]));
            buffers.push(b);
        }
        let seg_opts = SegmentOptions::new().group_access(opts.group_access);
        let control = Control::create(
            name,
            opts.buffer_bytes as u64,
            opts.max_consumers,
            &tokens,
            &seg_opts,
        )?;
        let (page, len) = control.ready_page();
        // SAFETY: the ready page lies in the control segment's mapping, which `control` keeps until
        // the registration drops (field order above).
        let ready = unsafe { HostRegistration::new(ctx, page, len)? };
        Ok(Producer {
            gpu: Some(GpuPool {
                consumer_events: (0..control.consumer_capacity()).map(|_| None).collect(),
                join: std::sync::Mutex::new(Event::new(ctx)?),
                buffers,
                stream,
                ctx: ctx.clone(),
            }),
            ready: Some(ready),
            control,
            host: None,
            name: name.to_string(),
            wait: opts.wait,
            memory: kind,
            closed: false,
        })
    }

    fn gpu(&self) -> &GpuPool {
        self.gpu.as_ref().expect(HOST_NO_GPU)
    }

    /// The producer's stream: enqueue the work that fills a frame here.
    ///
    /// # Panics
    /// On a host channel ([`MemoryKind::Host`]), which has no stream.
    pub fn stream(&self) -> &Stream {
        &self.gpu().stream
    }

    /// The producer's context.
    ///
    /// # Panics
    /// On a host channel ([`MemoryKind::Host`]), which has no context.
    pub fn context(&self) -> &Arc<Context> {
        &self.gpu().ctx
    }

    /// Whether the pool is host memory ([`MemoryKind::Host`]).
    pub fn is_host(&self) -> bool {
        self.host.is_some()
    }

    /// The channel name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The kind of memory the pool is made of (`Legacy`, `Vmm`, `Pool` or `Host`; an `Auto` request
    /// resolved).
    pub fn memory_kind(&self) -> MemoryKind {
        self.memory
    }

    /// Takes a free buffer to write, waiting up to `timeout` (`None`: forever) while consumers still
    /// hold every buffer or every-frame consumers have not received them, and then until the GPU
    /// work of the consumers that last read the buffer finished (their release events, checked on the
    /// host; a consumer that died is not waited for).
    ///
    /// # Errors
    /// [`Error::Timeout`] when no buffer freed up in time, or its readers' GPU work did not finish in
    /// time (the buffer is given back); CUDA errors from querying the release events.
    pub fn acquire(&mut self, timeout: Option<Duration>) -> Result<WriteFrame<'_>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        match self.control.acquire(self.wait, timeout)? {
            Some((i, used)) => self.start_write(i, used, deadline, timeout),
            None => Err(Error::Timeout {
                what: "a free buffer",
                after: timeout.unwrap_or_default(),
            }),
        }
    }

    /// Takes a free buffer if one is free now, and its last readers' GPU work on it has finished
    /// (waiting for that work without a bound, as [`Producer::acquire`] with no timeout).
    ///
    /// # Errors
    /// CUDA errors from querying the consumers' release events.
    pub fn try_acquire(&mut self) -> Result<Option<WriteFrame<'_>>> {
        match self.control.try_acquire() {
            Some((i, used)) => self.start_write(i, used, None, None).map(Some),
            None => Ok(None),
        }
    }

    fn start_write(
        &mut self,
        i: usize,
        used: u64,
        deadline: Option<Instant>,
        timeout: Option<Duration>,
    ) -> Result<WriteFrame<'_>> {
        // A host channel has no events to wait on: the consumers' reads happen before this write
        // through their hold_mask clear, which `try_acquire` saw (docs/ARCHITECTURE.md).
        let mut bits = if self.host.is_some() { 0 } else { used };
        while bits != 0 {
            let c = bits.trailing_zeros() as usize;
            match self.wait_for_consumer(c, i, deadline) {
                Ok(()) => {}
                Err(Error::Timeout { what, .. }) => {
                    // Give the buffer back with the readers it still has to wait for.
                    self.control.restore_used(i, bits);
                    self.control.abandon(i);
                    return Err(Error::Timeout {
                        what,
                        after: timeout.unwrap_or_default(),
                    });
                }
                // A consumer whose events cannot be opened has exited; its GPU work ended with its
                // context, so there is nothing left to wait for.
                Err(e) => tracing::debug!("consumer {c}'s release event for buffer {i}: {e}"),
            }
            bits &= bits - 1;
        }
        Ok(WriteFrame {
            producer: self,
            index: i,
            done: false,
        })
    }

    /// Waits until consumer `c`'s GPU work on buffer `i` (its release event) has finished, or the
    /// consumer died, or `deadline` passed ([`Error::Timeout`]).
    ///
    /// This waits on the host rather than making the producer's stream wait on the event
    /// (`cuStreamWaitEvent`): the driver never completes an interprocess event whose recording
    /// process died before the recorded work finished, so a stream wait on a dead consumer's event
    /// would block the producer's stream for good (tests/peer_death_gpu.rs shows it). The buffer
    /// acquired is the oldest one, whose readers have almost always finished: then this is one
    /// `cuEventQuery`.
    fn wait_for_consumer(&mut self, c: usize, i: usize, deadline: Option<Instant>) -> Result<()> {
        let Some(gpu) = self.gpu.as_mut() else {
            return Ok(());
        };
        let Some(generation) = self.control.consumer_generation(c) else {
            // Detached (its stream drained first) or reclaimed after its death.
            return Ok(());
        };
        let stale = !matches!(&gpu.consumer_events[c], Some((g, _, _)) if *g == generation);
        if stale {
            // A consumer new to this slot: read and open its release events once.
            let Some((generation, tokens)) = self.control.consumer_release_tokens(c) else {
                return Ok(());
            };
            let evs = tokens
                .iter()
                .map(|t| IpcEvent::open_in(&gpu.ctx, &Token::from_bytes(t)?))
                .collect::<Result<Vec<_>>>()?;
            let who = self.control.consumer_identity(c);
            gpu.consumer_events[c] = Some((generation, who, evs));
        }
        let Some((_, who, evs)) = &gpu.consumer_events[c] else {
            return Ok(());
        };
        let start = Instant::now();
        let mut next_check = start + LIVENESS_CHECK;
        let mut nap = Duration::from_micros(10);
        loop {
            if evs[i].is_complete()? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= next_check {
                if who.liveness() == Liveness::Dead {
                    tracing::debug!(
                        "consumer {c} (pid {}) died with work on buffer {i} pending",
                        who.pid
                    );
                    return Ok(());
                }
                next_check = now + LIVENESS_CHECK;
            }
            if deadline.is_some_and(|d| now >= d) {
                return Err(Error::Timeout {
                    what: "a consumer's GPU work on the buffer",
                    after: now - start,
                });
            }
            if now - start < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
        }
    }

    /// Counters of the channel and its consumers.
    pub fn stats(&self) -> ChannelStats {
        self.control.stats()
    }

    /// Closes the channel: consumers get [`Error::ChannelClosed`] once they received what was
    /// published; waits up to `timeout` for their outstanding holds, forces the rest, then frees the
    /// pool and removes the control segment.
    ///
    /// # Errors
    /// CUDA errors from synchronising the producer's stream.
    pub fn close(mut self, timeout: Duration) -> Result<ShutdownReport> {
        self.closed = true;
        self.shutdown(timeout)
    }

    fn shutdown(&mut self, timeout: Duration) -> Result<ShutdownReport> {
        self.control.close();
        let forced = self.control.drain(timeout);
        if forced > 0 {
            tracing::warn!(
                "channel {}: {forced} holds were still outstanding after {timeout:?} and were forced",
                self.name
            );
        }
        self.control.unlink();
        if let Some(pool) = &self.host {
            // No GPU work to wait for: every hold ended or was forced above.
            pool.unlink();
            return Ok(ShutdownReport {
                forced_holds: forced,
            });
        }
        let deadline = Instant::now() + timeout;
        // The pool is freed after this: first let the consumers' last kernels on each buffer
        // finish (their release events), then our own work.
        for i in 0..self.control.buffers() {
            let mut bits = self.control.take_used(i);
            while bits != 0 {
                let c = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if let Err(e) = self.wait_for_consumer(c, i, Some(deadline)) {
                    tracing::warn!("consumer {c}'s release event for buffer {i}: {e}");
                }
            }
        }
        self.gpu().stream.synchronize()?;
        Ok(ShutdownReport {
            forced_holds: forced,
        })
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        if !self.closed
            && let Err(e) = self.shutdown(Duration::from_secs(5))
        {
            tracing::warn!("closing channel {}: {e}", self.name);
        }
    }
}

/// A buffer the producer is writing. Publish it, or drop it to give it back unpublished.
pub struct WriteFrame<'a> {
    producer: &'a mut Producer,
    index: usize,
    done: bool,
}

impl WriteFrame<'_> {
    /// The device buffer to write (the whole pool buffer).
    ///
    /// # Panics
    /// On a host channel ([`MemoryKind::Host`]): use [`WriteFrame::as_mut_ptr`] or
    /// [`WriteFrame::write_at`].
    pub fn buffer(&self) -> &ChannelBuffer {
        &self.producer.gpu().buffers[self.index]
    }

    /// Whether the frame's buffer is host memory ([`MemoryKind::Host`]).
    pub fn is_host(&self) -> bool {
        self.producer.host.is_some()
    }

    /// The buffer's length in bytes (the channel's `buffer_bytes`), for every memory kind.
    pub fn len(&self) -> usize {
        self.producer.control.buffer_bytes() as usize
    }

    /// Whether the buffer has no bytes (never: buffers hold at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first byte of the frame's host buffer, valid for [`WriteFrame::len`] bytes until the
    /// frame is published or dropped.
    ///
    /// A raw pointer and not a `&mut [u8]`: the bytes are shared memory that consumer processes
    /// map. No consumer holds this buffer while the producer writes it (the protocol's Dekker pair
    /// on `seq` and `hold_mask`), so plain writes through the pointer are ordered; but a reference
    /// would promise the compiler exclusive access that another (misbehaving) process could break.
    ///
    /// # Panics
    /// On a GPU channel: use [`WriteFrame::buffer`].
    pub fn as_mut_ptr(&self) -> *mut u8 {
        let pool = self
            .producer
            .host
            .as_ref()
            .expect("a GPU channel: use buffer()");
        pool.ptr(self.index)
    }

    /// Copies `src` into the frame's host buffer at byte `offset`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `offset + src.len()` passes the buffer's end, or on a GPU
    /// channel (write the device buffer on the stream there).
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        let dst = self.host_range(offset, src.len())?;
        // SAFETY: `dst..dst + src.len()` lies in this frame's buffer (checked by `host_range`),
        // which nobody else reads or writes while the producer holds it as WRITING; `src` is
        // ordinary memory of this process, so the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies `dst.len()` bytes of the frame's host buffer from byte `offset` into `dst`.
    ///
    /// # Errors
    /// As [`WriteFrame::write_at`].
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.host_range(offset, dst.len())?;
        // SAFETY: as in `write_at`, with the copy the other way.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn host_range(&self, offset: usize, n: usize) -> Result<*mut u8> {
        let Some(pool) = self.producer.host.as_ref() else {
            return Err(Error::InvalidArgument(
                "a GPU channel's frame has no host bytes; use buffer() on stream()".into(),
            ));
        };
        host_check(offset, n, pool.buffer_bytes())?;
        // SAFETY: offset + n <= buffer_bytes (checked), so the result stays in the buffer.
        Ok(unsafe { pool.ptr(self.index).add(offset) })
    }

    /// Index of the buffer in the pool.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The producer's stream, on which the write must be enqueued.
    ///
    /// # Panics
    /// On a host channel ([`MemoryKind::Host`]), which has no stream.
    pub fn stream(&self) -> &Stream {
        &self.producer.gpu().stream
    }

    /// Orders the publish after the work enqueued so far on `stream` (another stream of the
    /// producer's context that writes the buffer, such as PyTorch's current stream): the
    /// producer's stream waits for it on the GPU (an event recorded on `stream`,
    /// `cuStreamWaitEvent`), and the ready word that [`WriteFrame::publish`] enqueues there comes
    /// after. The calling thread does not block. Call it after the last write on `stream`; it may
    /// be called for several streams. Without it, only work on [`WriteFrame::stream`] is ordered
    /// before consumers read the frame.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel; [`Error::Cuda`] naming `cuEventRecord`
    /// (`stream` belongs to another context) or `cuStreamWaitEvent`.
    pub fn publish_after(&self, stream: &Stream) -> Result<()> {
        // SAFETY: `stream` is a live stream (borrowed for the call); the driver rejects one of
        // another context at `cuEventRecord`.
        unsafe { self.publish_after_raw(stream.as_raw()) }
    }

    /// [`WriteFrame::publish_after`] for a raw `CUstream` (one that PyTorch, CuPy or JAX made).
    ///
    /// # Errors
    /// As [`WriteFrame::publish_after`].
    ///
    /// # Safety
    /// 1. `stream` is a live stream of the producer's context for the duration of the call, or
    ///    null or `CU_STREAM_LEGACY` (`0x1`) or `CU_STREAM_PER_THREAD` (`0x2`), which name that
    ///    context's default streams.
    pub unsafe fn publish_after_raw(&self, stream: sys::CUstream) -> Result<()> {
        let Some(gpu) = self.producer.gpu.as_ref() else {
            return Err(Error::InvalidArgument(
                "a host channel's frame has no stream to order".into(),
            ));
        };
        let join = gpu.join.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `stream` as the caller guarantees (obligation 1 of `order_raw`); the producer's
        // stream lives as long as the producer this frame borrows (obligation 2).
        unsafe { join.order_raw(stream, gpu.stream.as_raw()) }
    }

    /// Publishes the frame with `metadata` (at most [`META_BYTES`] bytes) and wakes waiting
    /// consumers. On a host channel that is all: the writes made through the frame so far are
    /// visible to every consumer that receives it. On a GPU channel it then enqueues on the producer's stream, after the work enqueued so far, the write
    /// of the buffer's ready word (`cuStreamWriteValue32`) that consumers' streams wait for.
    /// Returns its sequence number (1, 2, ...).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for metadata over [`META_BYTES`] (the buffer is given back
    /// unpublished); CUDA errors from enqueuing the ready word's write (the frame is published
    /// and marked ready from the host once the producer's stream has drained).
    pub fn publish(mut self, metadata: &[u8]) -> Result<u64> {
        if metadata.len() > META_BYTES {
            return Err(Error::InvalidArgument(format!(
                "metadata is {} bytes; at most {META_BYTES}",
                metadata.len()
            )));
        }
        let p = &*self.producer;
        // Publish first, then enqueue the ready word's write: consumers may see the frame before
        // the write is enqueued, which is correct (their streams wait for the word on the GPU) and
        // takes the enqueue off the hand-off's path.
        let seq = p.control.publish(self.index, metadata)?;
        let (Some(ready), Some(gpu)) = (&p.ready, &p.gpu) else {
            self.done = true;
            return Ok(seq);
        };
        let word = ready.device_ptr + layout::ready_word_offset(self.index) as u64;
        // SAFETY: the word lies in the registered ready page (index < buffers), which stays
        // registered and mapped until the producer's stream has drained (Drop order of Producer).
        if let Err(e) = unsafe { gpu.stream.write_value_u32(word, seq as u32) } {
            // Consumers already wait for this word: set it from the host once our work on the
            // buffer is done (or failed), so they never wait for good.
            let _ = gpu.stream.synchronize();
            p.control.set_ready(self.index, seq);
            self.done = true;
            return Err(e);
        }
        self.done = true;
        Ok(seq)
    }
}

impl Drop for WriteFrame<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.producer.control.abandon(self.index);
        }
    }
}

/// How a consumer attaches.
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct ConsumerOptions {
    /// Every frame (back-pressure) or the latest only.
    pub delivery: Delivery,
    /// How [`Consumer::recv`] waits.
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

/// The consuming end of a channel: imports the pool once and receives frames.
pub struct Consumer {
    // Drop order: the stream is drained and the slot freed (in Drop) first; then the watchdog stops,
    // the ready page is unregistered and the segment unmapped (the watchdog holds it too); the host
    // pool is unmapped; events and imports go before the stream and context.
    /// `None` for a host channel (nothing to mark ready).
    _watchdog: Option<Watchdog>,
    /// `None` for a host channel.
    ready: Option<HostRegistration>,
    control: Arc<Control>,
    /// The pool of a host channel.
    host: Option<HostPool>,
    slot: usize,
    /// The GPU side; `None` for a host channel.
    gpu: Option<GpuImports>,
    wait: WaitStrategy,
}

/// A consumer's GPU side.
struct GpuImports {
    // Drop order: events and imports before the stream and context.
    release_events: Vec<IpcEvent>,
    /// Orders the consumer's stream with other streams ([`Frame::ready_on`],
    /// [`Frame::release_after`]); locked from record to wait, so frames released from two threads
    /// never cross their records.
    join: std::sync::Mutex<Event>,
    buffers: Vec<ImportedBuffer>,
    stream: Stream,
    ctx: Arc<Context>,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// Attaches to channel `name` on the device that holds its pool (found by UUID), in that
    /// device's primary context; a host channel ([`MemoryKind::Host`]) is attached without the CUDA
    /// driver (it is never loaded). Receives frames published from now on.
    ///
    /// # Errors
    /// [`ChannelError::NotFound`], [`ChannelError::BadSegment`], [`ChannelError::NoConsumerSlot`];
    /// [`Error::ProducerGone`] when the producer is dead; CUDA errors from imports. For a host
    /// channel, shared-memory errors for what is under the pool's name (`NotASegment`, `Sparse`,
    /// `WrongOwner`, `TooSmall`), [`ChannelError::BadSegment`] for a pool that is missing or does
    /// not match the channel, [`ChannelError::Superseded`] for a pool made again since.
    pub fn attach(name: &str, opts: &ConsumerOptions) -> Result<Consumer> {
        let control = Control::open_with(name, opts.group_access)?;
        let (mem, _) = control.buffer_tokens(0);
        let token = Token::from_bytes(&mem)?;
        if token.kind == TokenKind::HostMemory {
            return Self::attach_host(control, name, opts);
        }
        let device = Device::by_uuid(token.device)?;
        Self::attach_with(control, &device.primary_context()?, opts)
    }

    /// Attaches to channel `name` in `ctx` (which may be on another device than the pool's). A host
    /// channel is attached as by [`Consumer::attach`], without using `ctx`.
    ///
    /// # Errors
    /// As [`Consumer::attach`].
    pub fn attach_in(ctx: &Arc<Context>, name: &str, opts: &ConsumerOptions) -> Result<Consumer> {
        let control = Control::open_with(name, opts.group_access)?;
        let (mem, _) = control.buffer_tokens(0);
        if Token::from_bytes(&mem)?.kind == TokenKind::HostMemory {
            return Self::attach_host(control, name, opts);
        }
        Self::attach_with(control, ctx, opts)
    }

    fn attach_host(control: Control, name: &str, opts: &ConsumerOptions) -> Result<Consumer> {
        control.producer_gone()?;
        let tokens = (0..control.buffers())
            .map(|i| Token::from_bytes(&control.buffer_tokens(i).0))
            .collect::<Result<Vec<_>>>()?;
        let pool = HostPool::open(name, opts.group_access, &tokens, control.buffer_bytes())?;
        // No release events: the producer waits on nothing but the hold masks.
        let release_tokens = vec![[0u8; TOKEN_LEN]; control.buffers()];
        let slot = control.attach(opts.delivery, &release_tokens)?;
        Ok(Consumer {
            _watchdog: None,
            ready: None,
            control: Arc::new(control),
            host: Some(pool),
            slot,
            gpu: None,
            wait: opts.wait,
        })
    }

    fn attach_with(
        control: Control,
        ctx: &Arc<Context>,
        opts: &ConsumerOptions,
    ) -> Result<Consumer> {
        control.producer_gone()?;
        let stream = Stream::new(ctx)?;
        let mut buffers = Vec::new();
        let mut release_events = Vec::new();
        let mut release_tokens: Vec<[u8; TOKEN_LEN]> = Vec::new();
        for i in 0..control.buffers() {
            let (mem, _) = control.buffer_tokens(i);
            let b = ImportedBuffer::open_in(ctx, &Token::from_bytes(&mem)?)?;
            if b.len() as u64 != control.buffer_bytes() {
                return Err(ChannelError::BadSegment(format!(
                    "buffer {i} holds {} bytes, the header says {}",
                    b.len(),
                    control.buffer_bytes()
                ))
                .into());
            }
            buffers.push(b);
            let r = IpcEvent::new(ctx)?;
            release_tokens.push(r.export()?.to_bytes());
            release_events.push(r);
        }
        let (page, len) = control.ready_page();
        // SAFETY: the ready page lies in the control segment's mapping, which `control` keeps until
        // the registration drops (field order above).
        let ready = unsafe { HostRegistration::new(ctx, page, len)? };
        let slot = control.attach(opts.delivery, &release_tokens)?;
        let control = Arc::new(control);
        Ok(Consumer {
            _watchdog: Some(Watchdog::start(control.clone())),
            ready: Some(ready),
            control,
            host: None,
            slot,
            gpu: Some(GpuImports {
                release_events,
                join: std::sync::Mutex::new(Event::new(ctx)?),
                buffers,
                stream,
                ctx: ctx.clone(),
            }),
            wait: opts.wait,
        })
    }

    fn gpu(&self) -> &GpuImports {
        self.gpu.as_ref().expect(HOST_NO_GPU)
    }

    /// The consumer's stream: frames are ready on it, enqueue the work that reads them here.
    ///
    /// # Panics
    /// On a host channel ([`MemoryKind::Host`]), which has no stream.
    pub fn stream(&self) -> &Stream {
        &self.gpu().stream
    }

    /// The consumer's context.
    ///
    /// # Panics
    /// On a host channel ([`MemoryKind::Host`]), which has no context.
    pub fn context(&self) -> &Arc<Context> {
        &self.gpu().ctx
    }

    /// Whether the channel's pool is host memory ([`MemoryKind::Host`]).
    pub fn is_host(&self) -> bool {
        self.host.is_some()
    }

    /// Waits for the next frame (by the delivery policy), without a timeout; still returns
    /// [`Error::ProducerGone`] promptly when the producer dies.
    ///
    /// # Errors
    /// As [`Consumer::recv_timeout`].
    pub fn recv(&self) -> Result<Frame<'_>> {
        self.recv_inner(None)?.ok_or(Error::Timeout {
            what: "a frame",
            after: Duration::MAX,
        })
    }

    /// Waits up to `timeout` for the next frame.
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`Error::ProducerGone`] when the producer died; [`Error::ChannelClosed`]
    /// when it closed and everything was received; [`ChannelError::Detached`]; CUDA errors from the
    /// stream wait.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Frame<'_>> {
        self.recv_inner(Some(timeout))?.ok_or(Error::Timeout {
            what: "a frame",
            after: timeout,
        })
    }

    /// The next frame if one is ready now.
    ///
    /// # Errors
    /// As [`Consumer::recv_timeout`], except the timeout.
    pub fn try_recv(&self) -> Result<Option<Frame<'_>>> {
        match self
            .control
            .take_or_closed(self.slot)
            .map_err(|e| self.on_error(e))?
        {
            Some((i, seq, meta)) => self.deliver(i, seq, meta).map(Some),
            None => {
                self.control.producer_gone().map_err(|e| self.on_error(e))?;
                Ok(None)
            }
        }
    }

    fn recv_inner(&self, timeout: Option<Duration>) -> Result<Option<Frame<'_>>> {
        match self.control.take(self.slot, self.wait, timeout) {
            Ok(Some((i, seq, meta))) => self.deliver(i, seq, meta).map(Some),
            Ok(None) => Ok(None),
            Err(e) => Err(self.on_error(e)),
        }
    }

    /// When the producer died, frames it published may still wait for a write that will never
    /// finish: mark them ready so this consumer's stream drains.
    fn on_error(&self, e: Error) -> Error {
        if self.gpu.is_some() && matches!(e, Error::ProducerGone { .. }) {
            self.control.force_ready();
        }
        e
    }

    fn deliver(&self, i: usize, seq: u64, metadata: Vec<u8>) -> Result<Frame<'_>> {
        let frame = Frame {
            consumer: self,
            index: i,
            seq,
            metadata,
        };
        let (Some(ready), Some(gpu)) = (&self.ready, &self.gpu) else {
            // A host channel: the Acquire load of the buffer's seq in `try_take` already ordered
            // the producer's writes before this frame's reads.
            return Ok(frame);
        };
        // If this fails the frame's Drop still releases the hold. The stream waits on the
        // buffer's ready word rather than the producer's IPC event: if the producer dies before its
        // write finished, the driver never completes its event, but a consumer can still mark the
        // word ready itself (`Control::force_ready`) and so drain its stream.
        // SAFETY: the word lies in the registered ready page (i < buffers), which stays registered
        // and mapped until this consumer's stream has drained (Drop of Consumer).
        unsafe {
            gpu.stream.wait_value_u32(
                ready.device_ptr + layout::ready_word_offset(i) as u64,
                seq as u32,
            )?;
        }
        Ok(frame)
    }

    /// Counters of the channel and its consumers.
    pub fn stats(&self) -> ChannelStats {
        self.control.stats()
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        let Some(gpu) = &self.gpu else {
            // A host channel: no GPU work can still read the pool; frames borrowed this consumer,
            // so all were dropped (their holds ended) before this.
            self.control.detach(self.slot);
            return;
        };
        // Detaching clears this consumer's bits in the buffers' used masks, after which the producer
        // no longer waits on its release events: let the work that reads the buffers finish first.
        // Poll rather than block: if the producer dies meanwhile, its frames must be marked ready
        // for the stream to drain (the watchdog does it too; this does not rely on it).
        let mut next_check = Instant::now();
        loop {
            match gpu.stream.is_idle() {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!("querying the consumer stream before detaching failed: {e}");
                    break;
                }
            }
            if Instant::now() >= next_check {
                if self.control.producer_gone().is_err() {
                    self.control.force_ready();
                }
                next_check = Instant::now() + LIVENESS_CHECK;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        self.control.detach(self.slot);
    }
}

/// A thread that marks a dead producer's frames ready (`Control::force_ready`) within about 20 ms
/// of its death, so a consumer stream waiting for a write that will never finish drains even when
/// the consumer's own thread is blocked in it (say, synchronising that stream) and never calls
/// `recv` again.
struct Watchdog {
    stop: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(control: Arc<Control>) -> Watchdog {
        let stop = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("cuda-ipc-watchdog".into())
            .spawn(move || {
                let (lock, cv) = &*s;
                let mut stopped = lock.lock().unwrap_or_else(|p| p.into_inner());
                while !*stopped {
                    stopped = cv
                        .wait_timeout(stopped, LIVENESS_CHECK)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    if !*stopped && control.producer_gone().is_err() {
                        control.force_ready();
                        return;
                    }
                }
            });
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!("no producer watchdog ({e}): a dead producer is noticed at recv");
                None
            }
        };
        Watchdog { stop, thread }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A received frame: its buffer is ready on the consumer's stream; dropping it releases it, ordered
/// after the work enqueued on the consumer's stream so far.
pub struct Frame<'a> {
    consumer: &'a Consumer,
    index: usize,
    seq: u64,
    metadata: Vec<u8>,
}

impl std::fmt::Debug for Frame<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frame")
            .field("seq", &self.seq)
            .field("index", &self.index)
            .field("metadata_len", &self.metadata.len())
            .finish()
    }
}

impl Frame<'_> {
    /// The frame's buffer, mapped in the consumer's context.
    ///
    /// # Panics
    /// On a host channel ([`MemoryKind::Host`]): use [`Frame::as_ptr`] or [`Frame::read_at`].
    pub fn buffer(&self) -> &ImportedBuffer {
        &self.consumer.gpu().buffers[self.index]
    }

    /// Whether the frame's buffer is host memory ([`MemoryKind::Host`]).
    pub fn is_host(&self) -> bool {
        self.consumer.host.is_some()
    }

    /// The buffer's length in bytes (the channel's `buffer_bytes`), for every memory kind.
    pub fn len(&self) -> usize {
        self.consumer.control.buffer_bytes() as usize
    }

    /// Whether the buffer has no bytes (never: buffers hold at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first byte of the frame's host buffer, valid for [`Frame::len`] bytes while the frame
    /// lives (it holds the buffer: the producer does not write it meanwhile).
    ///
    /// A raw pointer and never a `&[u8]`: the bytes are shared memory another process writes (the
    /// producer, after this frame is dropped; or any process of the user that maps the segment),
    /// and a shared reference would promise the compiler they do not change. Read through it with
    /// [`std::ptr::copy_nonoverlapping`] or [`std::ptr::read_unaligned`], or use
    /// [`Frame::read_at`]; the protocol orders the producer's writes before these reads (the
    /// publish Release / take Acquire pair on the buffer's `seq`).
    ///
    /// # Panics
    /// On a GPU channel: use [`Frame::buffer`].
    pub fn as_ptr(&self) -> *const u8 {
        let pool = self
            .consumer
            .host
            .as_ref()
            .expect("a GPU channel: use buffer()");
        pool.ptr(self.index)
    }

    /// Copies `dst.len()` bytes of the frame's host buffer from byte `offset` into `dst`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `offset + dst.len()` passes the buffer's end, or on a GPU
    /// channel (copy the device buffer on the stream there).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let Some(pool) = self.consumer.host.as_ref() else {
            return Err(Error::InvalidArgument(
                "a GPU channel's frame has no host bytes; use buffer() on stream()".into(),
            ));
        };
        host_check(offset, dst.len(), pool.buffer_bytes())?;
        // SAFETY: offset + dst.len() <= buffer_bytes (checked), so the source lies in this frame's
        // buffer, which the producer does not write while this frame holds it; `dst` is ordinary
        // memory of this process, so the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                pool.ptr(self.index).add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// The whole host buffer, copied.
    ///
    /// # Errors
    /// As [`Frame::read_at`].
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len()];
        self.read_at(0, &mut v)?;
        Ok(v)
    }
    /// Its sequence number (1, 2, ... per channel).
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// The producer's metadata for it.
    pub fn metadata(&self) -> &[u8] {
        &self.metadata
    }
    /// Index of the buffer in the pool.
    pub fn index(&self) -> usize {
        self.index
    }
    /// The consumer's stream.
    ///
    /// # Panics
    /// On a host channel ([`MemoryKind::Host`]), which has no stream.
    pub fn stream(&self) -> &Stream {
        &self.consumer.gpu().stream
    }

    /// Makes `stream` wait on the GPU for this frame (an event recorded on the consumer's stream,
    /// `cuStreamWaitEvent` on `stream`): work enqueued on `stream` from now on reads the
    /// producer's data. The calling thread does not block. `stream` may belong to any context (a
    /// library's own stream, such as PyTorch's current one); pair it with
    /// [`Frame::release_after`] for the same stream after the last work there that reads the
    /// frame.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel; [`Error::Cuda`] naming `cuEventRecord` or
    /// `cuStreamWaitEvent`.
    pub fn ready_on(&self, stream: &Stream) -> Result<()> {
        // SAFETY: `stream` is a live stream (borrowed for the call).
        unsafe { self.ready_on_raw(stream.as_raw()) }
    }

    /// [`Frame::ready_on`] for a raw `CUstream` (one that PyTorch, CuPy or JAX made).
    ///
    /// # Errors
    /// As [`Frame::ready_on`].
    ///
    /// # Safety
    /// 1. `stream` is a live stream of any context for the duration of the call, or null or
    ///    `CU_STREAM_LEGACY` (`0x1`) or `CU_STREAM_PER_THREAD` (`0x2`), which name the default
    ///    streams of the consumer's context.
    pub unsafe fn ready_on_raw(&self, stream: sys::CUstream) -> Result<()> {
        let gpu = self.gpu_or_err()?;
        let join = gpu.join.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the consumer's stream lives as long as the consumer this frame borrows
        // (obligation 1 of `order_raw`); `stream` as the caller guarantees (obligation 2).
        unsafe { join.order_raw(gpu.stream.as_raw(), stream) }
    }

    /// Orders this frame's release after the work enqueued so far on `stream` (a stream of the
    /// consumer's context that read the frame): the consumer's stream waits for it on the GPU (an
    /// event recorded on `stream`, `cuStreamWaitEvent`), and the release that dropping the frame
    /// records there comes after. The calling thread does not block. Call it after the last work
    /// on `stream` that reads the frame; it may be called for several streams and more than once.
    /// Without it, only work on [`Frame::stream`] is ordered before the producer reuses the
    /// buffer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel; [`Error::Cuda`] naming `cuEventRecord`
    /// (`stream` belongs to another context) or `cuStreamWaitEvent`.
    pub fn release_after(&self, stream: &Stream) -> Result<()> {
        // SAFETY: `stream` is a live stream (borrowed for the call); the driver rejects one of
        // another context at `cuEventRecord`.
        unsafe { self.release_after_raw(stream.as_raw()) }
    }

    /// [`Frame::release_after`] for a raw `CUstream`.
    ///
    /// # Errors
    /// As [`Frame::release_after`].
    ///
    /// # Safety
    /// 1. `stream` is a live stream of the consumer's context for the duration of the call, or
    ///    null or `CU_STREAM_LEGACY` (`0x1`) or `CU_STREAM_PER_THREAD` (`0x2`), which name that
    ///    context's default streams.
    pub unsafe fn release_after_raw(&self, stream: sys::CUstream) -> Result<()> {
        let gpu = self.gpu_or_err()?;
        let join = gpu.join.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `stream` as the caller guarantees (obligation 1 of `order_raw`); the consumer's
        // stream lives as long as the consumer this frame borrows (obligation 2).
        unsafe { join.order_raw(stream, gpu.stream.as_raw()) }
    }

    fn gpu_or_err(&self) -> Result<&GpuImports> {
        self.consumer.gpu.as_ref().ok_or_else(|| {
            Error::InvalidArgument("a host channel's frame has no stream to order".into())
        })
    }
}

/// Checks that `n` bytes from `offset` fit a buffer of `len` bytes.
fn host_check(offset: usize, n: usize, len: usize) -> Result<()> {
    if offset.checked_add(n).is_none_or(|end| end > len) {
        return Err(Error::InvalidArgument(format!(
            "{n} bytes at offset {offset} pass the end of a {len}-byte buffer"
        )));
    }
    Ok(())
}

impl Drop for Frame<'_> {
    fn drop(&mut self) {
        let c = self.consumer;
        if let Some(gpu) = &c.gpu
            && let Err(e) = gpu.release_events[self.index].record(&gpu.stream)
        {
            // Without the event the producer could overwrite the buffer under our kernels:
            // wait for them on the host instead.
            tracing::warn!("recording the release event failed ({e}); synchronising instead");
            if let Err(e) = gpu.stream.synchronize() {
                tracing::warn!("synchronising the consumer stream failed: {e}");
            }
        }
        // On a host channel this clear (a release) is what orders this frame's reads before the
        // producer's next write of the buffer.
        c.control.release(c.slot, self.index);
    }
}

/// Protocol-only access to a channel's control segment, without a GPU: for tests of tools that read
/// or drive the segment (the `cuda-ipc` command line, the Python consumer). The tokens given here
/// are stored as they are and never opened. Not part of the stable API.
#[doc(hidden)]
pub mod testing {
    use super::control::Control;
    use super::{ChannelStats, Delivery, WaitStrategy};
    use crate::error::Result;
    use crate::shm::SegmentOptions;
    use crate::token::TOKEN_LEN;
    use std::time::Duration;

    /// The producer's side of the protocol.
    pub struct ControlProducer(Control);

    impl ControlProducer {
        /// Creates the segment `cuda-ipc.ch.NAME`; `tokens[i]` = (memory token, reserved area) of
        /// buffer `i`, stored as given. The reserved area held the producer's event token in
        /// layout version 1; since version 2 producers write zeros there and nothing reads it
        /// (readiness travels through the ready page).
        ///
        /// # Errors
        /// As `Producer::create`, without the CUDA ones.
        pub fn create(
            name: &str,
            buffer_bytes: u64,
            max_consumers: usize,
            tokens: &[([u8; TOKEN_LEN], [u8; TOKEN_LEN])],
        ) -> Result<Self> {
            Control::create(
                name,
                buffer_bytes,
                max_consumers,
                tokens,
                &SegmentOptions::new(),
            )
            .map(Self)
        }
        /// A free buffer now: (index, mask of consumers that read it since its last write).
        pub fn try_acquire(&self) -> Option<(usize, u64)> {
            self.0.try_acquire()
        }
        /// Waits up to `timeout` for a free buffer (`Ok(None)` on timeout).
        ///
        /// # Errors
        /// As `Producer::acquire`.
        pub fn acquire(&self, timeout: Option<Duration>) -> Result<Option<(usize, u64)>> {
            self.0.acquire(WaitStrategy::Block, timeout)
        }
        /// Publishes buffer `i` with `meta`; returns its sequence number.
        ///
        /// # Errors
        /// As `WriteFrame::publish`.
        pub fn publish(&self, i: usize, meta: &[u8]) -> Result<u64> {
            self.0.publish(i, meta)
        }
        /// Gives buffer `i` back unpublished.
        pub fn abandon(&self, i: usize) {
            self.0.abandon(i)
        }
        /// Consumer `c`'s release-event tokens and their generation, if it is attached.
        pub fn consumer_release_tokens(&self, c: usize) -> Option<(u64, Vec<[u8; TOKEN_LEN]>)> {
            self.0.consumer_release_tokens(c)
        }
        /// Releases the holds of dead consumers; returns how many.
        pub fn reclaim_dead_consumers(&self) -> u64 {
            self.0.reclaim_dead_consumers()
        }
        /// Marks the channel closed.
        pub fn close(&self) {
            self.0.close()
        }
        /// Waits up to `timeout` for outstanding holds; returns how many were forced.
        pub fn drain(&self, timeout: Duration) -> u64 {
            self.0.drain(timeout)
        }
        /// Removes the segment's name.
        pub fn unlink(&self) {
            self.0.unlink()
        }
        /// Counters.
        pub fn stats(&self) -> ChannelStats {
            self.0.stats()
        }
        /// The sequence number the next publish gives.
        pub fn next_seq(&self) -> u64 {
            self.0.next_seq()
        }
        /// Sets buffer `i`'s ready word, as the producer's GPU stream does after its write.
        pub fn set_ready(&self, i: usize, value: u32) {
            let (p, _) = self.0.ready_page();
            assert!(i < self.0.buffers());
            // SAFETY: word `i` of the ready page lies in the mapping and is 4-byte aligned; shared
            // words are only accessed atomically.
            let w = unsafe {
                &*p.add(super::layout::ready_word_offset(i))
                    .cast::<std::sync::atomic::AtomicU32>()
            };
            // SYNC POINT: ready word. Release: pairs with `ready_value`'s Acquire load.
            w.store(value, std::sync::atomic::Ordering::Release);
        }
        /// Buffer `i`'s ready word.
        pub fn ready_value(&self, i: usize) -> u32 {
            self.0.ready_value(i)
        }
    }

    /// A consumer's side of the protocol.
    pub struct ControlConsumer {
        control: Control,
        slot: usize,
    }

    impl ControlConsumer {
        /// Opens channel `name` and claims a consumer slot with these release-event tokens.
        ///
        /// # Errors
        /// As `Consumer::attach`, without the CUDA ones.
        pub fn attach(
            name: &str,
            delivery: Delivery,
            release_tokens: &[[u8; TOKEN_LEN]],
        ) -> Result<Self> {
            let control = Control::open(name)?;
            let slot = control.attach(delivery, release_tokens)?;
            Ok(Self { control, slot })
        }
        /// The consumer slot index.
        pub fn slot(&self) -> usize {
            self.slot
        }
        /// The memory token of buffer `i` and its reserved second token area (zero since layout
        /// version 2; kept for the byte layout, meaningless to readers).
        pub fn buffer_tokens(&self, i: usize) -> ([u8; TOKEN_LEN], [u8; TOKEN_LEN]) {
            self.control.buffer_tokens(i)
        }
        /// Waits up to `timeout` for the next frame: (buffer index, sequence number, metadata).
        ///
        /// # Errors
        /// As `Consumer::recv_timeout`.
        pub fn take(&self, timeout: Option<Duration>) -> Result<Option<(usize, u64, Vec<u8>)>> {
            self.control.take(self.slot, WaitStrategy::Block, timeout)
        }
        /// Ends the hold on buffer `i`.
        pub fn release(&self, i: usize) {
            self.control.release(self.slot, i)
        }
    }

    impl ControlConsumer {
        /// Opens channel `name` as a consumer does, but waits at most `init_wait` for the init
        /// stamp of an unfinished segment (a consumer waits 2 s), and claims a consumer slot with
        /// zero release tokens, one per buffer (as a host channel's consumer does). For fuzzing:
        /// the segment may hold any bytes.
        ///
        /// # Errors
        /// As [`ControlConsumer::attach`].
        pub fn attach_waiting(name: &str, delivery: Delivery, init_wait: Duration) -> Result<Self> {
            let control = Control::open_waiting(name, false, init_wait)?;
            let tokens = vec![[0u8; TOKEN_LEN]; control.buffers()];
            let slot = control.attach(delivery, &tokens)?;
            Ok(Self { control, slot })
        }
        /// Buffers in the pool.
        pub fn buffers(&self) -> usize {
            self.control.buffers()
        }
        /// The next frame if there is one now: (buffer index, sequence number, metadata).
        ///
        /// # Errors
        /// As `Consumer::try_recv`.
        pub fn try_take(&self) -> Result<Option<(usize, u64, Vec<u8>)>> {
            self.control.take_or_closed(self.slot)
        }
        /// A snapshot of the channel ([`super::inspect::inspect`]), from this consumer's mapping.
        pub fn inspect(&self, name: &str) -> super::inspect::ChannelSnapshot {
            super::inspect::snapshot(name, &self.control)
        }
    }

    /// [`super::inspect::inspect`], waiting at most `init_wait` for the init stamp of an
    /// unfinished segment (it waits 2 s). For fuzzing.
    ///
    /// # Errors
    /// As [`super::inspect::inspect`].
    pub fn inspect_waiting(
        name: &str,
        init_wait: Duration,
    ) -> Result<super::inspect::ChannelSnapshot> {
        let c = Control::open_waiting(name, false, init_wait)?;
        Ok(super::inspect::snapshot(name, &c))
    }

    impl Drop for ControlConsumer {
        fn drop(&mut self) {
            self.control.detach(self.slot);
        }
    }
}
