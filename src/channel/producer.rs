//! The producing end: [`Producer`] (its pool of exportable buffers, the control segment it creates,
//! close and shutdown) and the [`WriteFrame`] it hands out (`producer/write_frame.rs`).

#[cfg(doc)]
use super::ChannelError;
use super::control::{self, Control};
use super::handoff::Claim;
use super::host::HostPool;
use super::layout;
use super::options::{HOST_NO_GPU, check_options, reserve_quota};
use super::pool::{ChannelBuffer, allocate_pool, auto_kind};
use super::watchdog::Watchdog;
use super::{ChannelOptions, ChannelStats, MemoryKind, WaitStrategy};
use crate::driver::{Context, DeviceMemory, Event, HostRegistration, Stream, Uuid};
use crate::error::{Error, Result};
use crate::identity::ProcessIdentity;
use crate::quota::Reservation;
use crate::shm::SegmentOptions;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why [`Producer::close`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Holds still outstanding at the deadline, released by force. The pool is freed right after,
    /// so a consumer that still held one of them reads undefined data from then on.
    pub forced_holds: u64,
    /// Every-frame consumers ([`Delivery::EveryFrame`](super::Delivery)) that had not received
    /// every published frame at the deadline: the close waited its whole `timeout` for them, and
    /// the frames they missed are gone.
    pub consumers_behind: u64,
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
    // Drop order: the control segment is closed and drained (in Drop, which also drains the
    // stream); then the side: the watchdog stopped, the GPU words unregistered, the buffers freed and the
    // stream and context let go (or the host pool unmapped); then the segment unmapped (the
    // registration lies in it, so it goes first).
    /// Host or GPU, decided once where the producer is made.
    side: Side,
    control: Arc<Control>,
    name: String,
    wait: WaitStrategy,
    memory: MemoryKind,
    closed: bool,
    /// Whether a close withdraws every frame as it begins ([`Control::close_withdrawing`]): a
    /// memoryless channel's (a tensor set's generations), whose consumers take the newest frame
    /// again and again, so that a close that let them take would run to its timeout; no hold is
    /// granted once its close began, and it waits only for the holds taken before. Otherwise a
    /// close lets consumers receive what was published and withdraws the frames after its wait.
    withdraws_at_close: bool,
    /// Whether frames were handed out for stream-ordered writing ([`Producer::acquire`]) since
    /// the stream was last synchronised: [`Producer::lend`] synchronises it first, so that
    /// nothing the stream still has to do (a ready word's write, a user's kernel on an abandoned
    /// frame) lands on a lent buffer.
    stream_used: bool,
    /// The pool's bytes held from a shared budget ([`ChannelOptions::quota`]); last, so they
    /// return after the pool is freed.
    _quota: Option<Reservation>,
}

/// What a producer holds of its pool: either side, never half of one.
enum Side {
    /// A pool of device memory.
    Gpu(GpuPool),
    /// A pool of shared host memory ([`MemoryKind::Host`]); `None` for a memoryless channel
    /// ([`Producer::create_memoryless`]).
    Host(Option<HostPool>),
}

/// A producer's GPU side.
struct GpuPool {
    // Drop order: the watchdog stops, then the GPU words are unregistered, then the buffers are
    // freed, before the stream and context.
    /// Frees dead consumers' slots (raising their release words) while the producer's own thread
    /// is busy.
    _watchdog: Watchdog,
    /// The GPU words' registration.
    ready: HostRegistration,
    buffers: Vec<ChannelBuffer>,
    /// Orders the producer's stream after other streams ([`WriteFrame::publish_after`]); locked
    /// from record to wait, so two threads never cross their records.
    join: std::sync::Mutex<Event>,
    stream: Stream,
    ctx: Arc<Context>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Producer {
    /// Creates channel `name` in `ctx`: allocates the pool (`cuMemAlloc`, `cuMemCreate` or a
    /// memory pool by [`ChannelOptions::memory`], exported) and the control segment
    /// `/dev/shm/cuda-ipc.ch.NAME`, whose GPU words it registers with the driver
    /// (`cuMemHostRegister`), and starts the watchdog thread that frees dead consumers' slots. A
    /// segment left by a dead producer is replaced.
    ///
    /// # Errors
    /// [`ChannelError::PoolOverCap`] past the producer's own cap ([`ChannelOptions::quota_bytes`]);
    /// with [`ChannelOptions::quota`], [`crate::quota::QuotaError::OverQuota`] past the device's
    /// shared budget (naming who holds how much) and the ledger's errors
    /// ([`crate::quota::QuotaLedger::open`]: no budget set is `Error::Shm` `NotFound`);
    /// [`ChannelError::AlreadyExists`] when a live producer serves
    /// `name`; [`Error::InvalidArgument`] for zero-size buffers or counts out of range; CUDA errors
    /// from allocation and export; shared-memory errors (a full /dev/shm, a bad name).
    pub fn create(ctx: &Arc<Context>, name: &str, opts: &ChannelOptions) -> Result<Producer> {
        if opts.memory == MemoryKind::Host {
            return Self::create_host(name, opts);
        }
        check_options(opts)?;
        Self::create_gpu(ctx, name, opts)
    }

    /// Creates channel `name` with a pool of shared host memory ([`MemoryKind::Host`], whatever
    /// [`ChannelOptions::memory`] says): the pool segment `/dev/shm/cuda-ipc.hp.NAME` (mode as the
    /// control segment's, pages reserved) and the control segment `/dev/shm/cuda-ipc.ch.NAME`.
    /// Never calls the CUDA driver, so it runs on machines without a GPU. Segments of a dead
    /// producer (or a creation abandoned half-way) are replaced; anything else under either name is
    /// left alone and named in the error.
    ///
    /// # Errors
    /// [`ChannelError::PoolOverCap`] past the producer's own cap; with [`ChannelOptions::quota`],
    /// [`crate::quota::QuotaError::OverQuota`] past the shared budget of host memory and the
    /// ledger's errors, as for [`Producer::create`]; [`ChannelError::AlreadyExists`] when a live
    /// producer serves `name`; [`Error::InvalidArgument`] for zero-size buffers, counts out of
    /// range, a pool past `isize::MAX` bytes (its buffers each rounded up to 4096 bytes) or a
    /// bad name; shared-memory errors for what is in the way under either name
    /// (`WrongOwner`, `InsecureMode`, `NotASegment`, `CreationInProgress`, a foreign segment or a
    /// live producer's segment whose init stamp was zeroed as [`ChannelError::BadSegment`], the
    /// latter after the 2 s wait for its stamp) and for a full /dev/shm (`NoSpace`).
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
        check_options(opts)?;
        if opts.buffer_bytes == 0 {
            return Err(Error::InvalidArgument(
                "a host pool needs buffers of at least 1 byte".into(),
            ));
        }
        control::validate_channel_name(name)?;
        // A pool no segment can hold is refused as such before the ledger is asked for it.
        HostPool::geometry(opts.buffers, opts.buffer_bytes)?;
        // Before anything is made or reserved: the first call of a process creates its liveness
        // file, whose failure (a full /dev/shm) must leave nothing behind.
        let me = ProcessIdentity::current()?;
        let quota = reserve_quota(opts, Uuid([0; 16]), Some(&super::host::pool_name(name)))?;
        let seg_opts = SegmentOptions::new().group_access(opts.group_access);
        let pool = HostPool::create(name, opts.buffers, opts.buffer_bytes, &seg_opts)?;
        if let Some(q) = &quota {
            q.record_memory_or_warn(pool.segment());
        }
        let tokens: Vec<_> = (0..opts.buffers)
            .map(|i| pool.token(i, me).to_bytes())
            .collect();
        let control = match Control::create_with_flags(
            name,
            opts.buffer_bytes as u64,
            opts.max_consumers,
            &tokens,
            opts.flags(),
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
            side: Side::Host(Some(pool)),
            control: Arc::new(control),
            name: name.to_string(),
            wait: opts.wait,
            memory: MemoryKind::Host,
            closed: false,
            withdraws_at_close: false,
            stream_used: false,
            _quota: quota,
        })
    }

    /// Creates a channel with no buffer memory (crate-private: a tensor set's generation channel,
    /// whose buffers stand for memory the tensor set owns): `opts.buffers` buffers of 0 bytes,
    /// empty tokens, no pool (no host pool segment either), the control segment under `prefix`
    /// ([`control::segment_name_in`]). In `ctx` (GPU words registered, the watchdog freeing dead
    /// consumers, frames ordered on the producer's stream as usual), or on the host with `None`.
    /// `opts.memory`, `buffer_bytes`, `quota` and `quota_bytes` are not used. Its consumers take
    /// the newest frame again and again (`Consumer::take_newer`), so its close withdraws every
    /// frame as it begins ([`Producer::close_to_consumers`]): no hold is granted from then on,
    /// and the close waits only for the holds taken before.
    ///
    /// # Errors
    /// As [`Producer::create`] / [`Producer::create_host`], less the pool's.
    pub(crate) fn create_memoryless(
        ctx: Option<&Arc<Context>>,
        prefix: &'static str,
        name: &str,
        opts: &ChannelOptions,
    ) -> Result<Producer> {
        let opts = ChannelOptions {
            quota: None,
            quota_bytes: None,
            buffer_bytes: 0,
            ..opts.clone()
        };
        check_options(&opts)?;
        let tokens = vec![[0u8; crate::token::TOKEN_LEN]; opts.buffers];
        let seg_opts = SegmentOptions::new().group_access(opts.group_access);
        let control = Control::create_in(
            prefix,
            name,
            0,
            opts.max_consumers,
            &tokens,
            opts.flags(),
            &seg_opts,
        )?;
        let Some(ctx) = ctx else {
            return Ok(Producer {
                side: Side::Host(None),
                control: Arc::new(control),
                name: name.to_string(),
                wait: opts.wait,
                memory: MemoryKind::Host,
                closed: false,
                withdraws_at_close: true,
                stream_used: false,
                _quota: None,
            });
        };
        let mut p = Self::gpu_side(
            ctx,
            name,
            &opts,
            control,
            Vec::new(),
            MemoryKind::Auto,
            None,
        )?;
        p.withdraws_at_close = true;
        Ok(p)
    }

    fn create_gpu(ctx: &Arc<Context>, name: &str, opts: &ChannelOptions) -> Result<Producer> {
        let quota = reserve_quota(opts, ctx.device().uuid(), None)?;
        let (kind, buffers, tokens) = match opts.memory {
            MemoryKind::Auto => {
                let first = auto_kind(ctx, opts);
                match allocate_pool(ctx, first, opts) {
                    Ok(made) => made,
                    // VMM where the device reports it but the driver still refuses (an MPS
                    // client or a restricted container, say): legacy memory instead, said once.
                    Err(e) if first == MemoryKind::Vmm => {
                        tracing::info!(
                            "channel {name}: VMM memory refused ({e}); using legacy IPC memory"
                        );
                        allocate_pool(ctx, MemoryKind::Legacy, opts)?
                    }
                    Err(e) => return Err(e),
                }
            }
            k => allocate_pool(ctx, k, opts)?,
        };
        let seg_opts = SegmentOptions::new().group_access(opts.group_access);
        let control = Control::create_with_flags(
            name,
            opts.buffer_bytes as u64,
            opts.max_consumers,
            &tokens,
            opts.flags(),
            &seg_opts,
        )?;
        Self::gpu_side(ctx, name, opts, control, buffers, kind, quota)
    }

    /// The GPU side around a created control segment: the stream, the GPU words' registration,
    /// the watchdog.
    fn gpu_side(
        ctx: &Arc<Context>,
        name: &str,
        opts: &ChannelOptions,
        control: Control,
        buffers: Vec<ChannelBuffer>,
        kind: MemoryKind,
        quota: Option<Reservation>,
    ) -> Result<Producer> {
        let stream = Stream::new(ctx)?;
        let (page, len) = control.gpu_words();
        // SAFETY: the GPU words lie in the control segment's mapping, which `control` keeps until
        // the registration drops (field order above).
        let ready = unsafe { HostRegistration::new(ctx, page, len)? };
        let join = std::sync::Mutex::new(Event::new(ctx)?);
        let control = Arc::new(control);
        let watched = control.clone();
        Ok(Producer {
            side: Side::Gpu(GpuPool {
                _watchdog: Watchdog::start(
                    "cuda-ipc-producer-watchdog",
                    "a dead consumer is noticed when the producer next waits for a buffer",
                    move || {
                        watched.reclaim_dead_consumers();
                        true
                    },
                ),
                ready,
                buffers,
                join,
                stream,
                ctx: ctx.clone(),
            }),
            control,
            name: name.to_string(),
            wait: opts.wait,
            memory: kind,
            closed: false,
            withdraws_at_close: false,
            stream_used: false,
            _quota: quota,
        })
    }

    fn gpu(&self) -> Result<&GpuPool> {
        match &self.side {
            Side::Gpu(gpu) => Ok(gpu),
            Side::Host(_) => Err(Error::InvalidArgument(HOST_NO_GPU.into())),
        }
    }

    /// The producer's stream: enqueue the work that fills a frame here.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel ([`MemoryKind::Host`]), which has no stream
    /// (formerly a panic); [`Error::ForkedChild`] in a process forked from the one that created
    /// the producer.
    pub fn stream(&self) -> Result<&Stream> {
        self.control.check_fork()?;
        Ok(&self.gpu()?.stream)
    }

    /// The producer's context.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel ([`MemoryKind::Host`]), which has no context
    /// (formerly a panic); [`Error::ForkedChild`] in a process forked from the one that created
    /// the producer.
    pub fn context(&self) -> Result<&Arc<Context>> {
        self.control.check_fork()?;
        Ok(&self.gpu()?.ctx)
    }

    /// Whether the pool is host memory ([`MemoryKind::Host`]).
    pub fn is_host(&self) -> bool {
        matches!(self.side, Side::Host(_))
    }

    /// The control segment's creation generation (crate-private: a tensor set's manifest records
    /// its generation channel's).
    pub(crate) fn control_generation(&self) -> u64 {
        self.control.generation()
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
    /// hold every buffer or every-frame consumers have not received them (in ring order,
    /// [`ChannelOptions::ring`], the next buffer of the ring). If the consumers that last read the
    /// buffer may still be reading it on their GPUs, the producer's stream waits for their release
    /// words (`cuStreamWaitValue32`) before the work enqueued next: the calling thread never waits
    /// for consumers' GPU work, and work on other streams must be ordered after the producer's
    /// stream ([`WriteFrame::ready_on`]). A consumer that dies meanwhile has its words written by
    /// the producer's watchdog within about 20 ms.
    ///
    /// # Errors
    /// [`Error::Timeout`] when no buffer freed up in time; [`Error::Cuda`] naming
    /// `cuStreamWaitValue32_v2` (the buffer is given back).
    pub fn acquire(&mut self, timeout: Option<Duration>) -> Result<WriteFrame<'_>> {
        match self.control.acquire(self.wait, timeout)? {
            Some(claim) => self.start_write(claim),
            None => Err(Error::Timeout {
                what: "a free buffer",
                after: timeout.unwrap_or_default(),
            }),
        }
    }

    /// [`Producer::acquire`] for a caller that waits in slices (a binding checking for signals
    /// between them): in a pool of one buffer, which consumers hold, the buffer is reserved at the
    /// first slice (no consumer takes its frame from then on) and a slice that times out leaves it
    /// reserved, so the next slice (this, [`Producer::acquire`] or [`Producer::try_acquire`]) goes
    /// on waiting for the same holds. Without it, consumers whose holds outlast a slice would take
    /// the frame again between slices and could keep the buffer from the producer for good. A
    /// caller that stops waiting gives the frame back with [`Producer::give_back_reservation`]; an
    /// error other than the timeout, and [`Producer::acquire`] or [`Producer::try_acquire`] that
    /// find no buffer, give it back themselves.
    ///
    /// # Errors
    /// As [`Producer::acquire`].
    pub fn acquire_slice(&mut self, timeout: Option<Duration>) -> Result<WriteFrame<'_>> {
        match self.control.acquire_reserving(self.wait, timeout)? {
            Some(claim) => self.start_write(claim),
            None => Err(Error::Timeout {
                what: "a free buffer",
                after: timeout.unwrap_or_default(),
            }),
        }
    }

    /// Gives back the frame whose buffer [`Producer::acquire_slice`] left reserved (consumers take
    /// it again); nothing when none is.
    pub fn give_back_reservation(&mut self) {
        self.control.unreserve();
    }

    /// Takes a free buffer if one is free now (as [`Producer::acquire`], without waiting).
    ///
    /// # Errors
    /// As [`Producer::acquire`], but never [`Error::Timeout`].
    pub fn try_acquire(&mut self) -> Result<Option<WriteFrame<'_>>> {
        self.control.check_fork()?;
        match self.control.try_acquire() {
            Some(claim) => self.start_write(claim).map(Some),
            None => Ok(None),
        }
    }

    /// Takes a free buffer other than the newest frame's, waiting as [`Producer::acquire`] for one
    /// (crate-private: a buffered tensor set's writer, whose readers of the newest generation
    /// never wait for it, and which may give the buffer back unpublished without taking the
    /// newest frame from its consumers).
    ///
    /// # Errors
    /// As [`Producer::acquire`].
    pub(crate) fn acquire_older(&mut self, timeout: Option<Duration>) -> Result<WriteFrame<'_>> {
        match self.control.acquire_keeping(self.wait, timeout, true)? {
            Some(claim) => self.start_write(claim),
            None => Err(Error::Timeout {
                what: "a free buffer other than the newest frame's",
                after: timeout.unwrap_or_default(),
            }),
        }
    }

    fn start_write(&mut self, claim: Claim) -> Result<WriteFrame<'_>> {
        let i = claim.index;
        // A host channel has no streams to order: the consumers' reads happen before this write
        // through their hold_mask clear, which `try_acquire` saw (docs/ARCHITECTURE.md).
        if let Side::Gpu(gpu) = &self.side {
            self.stream_used = true;
            let mut bits = claim.used;
            while bits != 0 {
                let c = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                // Almost always the oldest buffer's readers are done: their words say so, and no
                // driver call is needed.
                if self.control.released(c, i, claim.old_seq) {
                    continue;
                }
                let word = gpu.ready.device_ptr + layout::release_word_offset(c, i) as u64;
                // SAFETY: the word lies in the registered GPU words (c < consumers, i < buffers),
                // which stay registered until the producer's stream has drained (Drop order).
                if let Err(e) = unsafe { gpu.stream.wait_value_u32(word, claim.old_seq as u32) } {
                    // Give the buffer back with the readers it still has to wait for.
                    self.control.restore_used(i, bits | (1 << c));
                    self.control.abandon(i);
                    return Err(e);
                }
            }
        }
        Ok(WriteFrame {
            producer: self,
            index: i,
            done: false,
            lent: false,
        })
    }

    /// Takes a free buffer to lend out without the borrow of the producer, so that several can be
    /// out at once (crate-private: the remote lane's receiving bridge lends a few far buffers to
    /// the sending bridge ahead of the frames, which another process then writes over NIXL,
    /// outside any stream). Waits as [`Producer::acquire`] for a buffer (`Some(Duration::ZERO)`:
    /// only if one is free now); `Ok(None)` when none freed up in time.
    ///
    /// No stream is involved, at either end of the loan: the readers that last held the buffer
    /// may still be reading it on their GPUs, which [`LentFrame::is_free`] checks on the host
    /// (their release words; a reader that died has its words raised by the producer's watchdog
    /// within about 20 ms): the buffer is lent to a writer only once it says so. A resumed frame
    /// is published from the host ([`Producer::resume`]). If frames were handed out for writing
    /// on the producer's stream since it was last synchronised, it is synchronised first
    /// (`cuStreamSynchronize`), so that nothing enqueued there lands on a lent buffer.
    ///
    /// # Errors
    /// [`Error::Cuda`] naming `cuStreamSynchronize` (nothing is lent).
    #[cfg_attr(not(feature = "remote"), allow(dead_code))]
    pub(crate) fn lend(&mut self, timeout: Option<Duration>) -> Result<Option<LentFrame>> {
        if self.stream_used
            && let Side::Gpu(gpu) = &self.side
        {
            gpu.stream.synchronize()?;
            self.stream_used = false;
        }
        let claim = if timeout == Some(Duration::ZERO) {
            self.control.try_acquire()
        } else {
            self.control.acquire(self.wait, timeout)?
        };
        let Some(claim) = claim else { return Ok(None) };
        // A host channel's readers finished before `try_acquire` saw their holds cleared; a GPU
        // channel's may still read on their streams.
        let pending = match self.side {
            Side::Gpu(_) => claim.used,
            Side::Host(_) => 0,
        };
        let mut lent = LentFrame {
            control: self.control.clone(),
            index: claim.index,
            old_seq: claim.old_seq,
            pending,
            armed: true,
        };
        lent.is_free();
        Ok(Some(lent))
    }

    /// The address and length in bytes of pool buffer `index` in this process: the host pool's
    /// mapping, or the device buffer's `CUdeviceptr` (for registering a lent buffer with NIXL).
    #[cfg_attr(not(feature = "remote"), allow(dead_code))]
    pub(crate) fn buffer_address(&self, index: usize) -> (u64, usize) {
        let len = self.control.buffer_bytes() as usize;
        match &self.side {
            Side::Host(Some(pool)) => (pool.ptr(index) as u64, len),
            Side::Host(None) => (0, 0),
            Side::Gpu(gpu) => (gpu.buffers[index].device_ptr(), len),
        }
    }

    /// Turns a buffer lent by [`Producer::lend`] back into a [`WriteFrame`] of this producer, to
    /// publish it (or drop it to give it back unpublished). Its publish writes the ready word
    /// from the host (`WriteFrame::publish`): the bytes must be complete when it is called (the
    /// far WRITE completed), and nothing enqueued on the producer's stream may write them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `lent` came from another producer (it is given back to
    /// that one's channel, unpublished), or when its last readers have not finished with it
    /// ([`LentFrame::is_free`]: it should not have been written; it is given back, its readers
    /// still to be waited for).
    #[cfg_attr(not(feature = "remote"), allow(dead_code))]
    pub(crate) fn resume(&mut self, mut lent: LentFrame) -> Result<WriteFrame<'_>> {
        if !Arc::ptr_eq(&lent.control, &self.control) {
            return Err(Error::InvalidArgument(format!(
                "buffer {} was lent by another producer than that of channel {}",
                lent.index, self.name
            )));
        }
        if !lent.is_free() {
            return Err(Error::InvalidArgument(format!(
                "buffer {} of channel {} was resumed while its last readers still read it",
                lent.index, self.name
            )));
        }
        lent.armed = false;
        Ok(WriteFrame {
            producer: self,
            index: lent.index,
            done: false,
            lent: true,
        })
    }

    /// Marks the channel as one a bridge fills from another host (its header's `transport` word,
    /// shown by `cuda-ipc ls`): for the remote lane's receiving bridge.
    #[cfg_attr(not(feature = "remote"), allow(dead_code))]
    pub(crate) fn mark_bridged(&self) {
        self.control.set_bridged();
    }

    /// Counters of the channel and its consumers.
    pub fn stats(&self) -> ChannelStats {
        self.control.stats()
    }

    /// Closes the channel: consumers get [`ChannelError::Closed`] once they received what was
    /// published; waits up to `timeout` for their outstanding holds, forces the rest, then frees the
    /// pool and removes the control segment.
    ///
    /// # Errors
    /// CUDA errors from synchronising the producer's stream.
    pub fn close(mut self, timeout: Duration) -> Result<ShutdownReport> {
        self.closed = true;
        self.shutdown(timeout, false)
    }

    /// Closes the channel as [`Producer::close`] does, for a process that is exiting: waits up
    /// to `timeout` for the holds, every-frame cursors and release words of other processes'
    /// consumers only, and forces this process's own at once. Their threads release nothing
    /// any more (a binding's interpreter that is finalizing), so waiting for them would only
    /// hold the exit up by `timeout`.
    ///
    /// # Errors
    /// As [`Producer::close`].
    pub fn close_at_exit(mut self, timeout: Duration) -> Result<ShutdownReport> {
        self.closed = true;
        self.shutdown(timeout, true)
    }

    /// Closes the channel to consumers, as [`Producer::close`] does first (they get
    /// [`ChannelError::Closed`] once they received what was published; no frame can be
    /// published after this), and waits up to `timeout` for what `close` waits for: every
    /// every-frame consumer received every published frame and no consumer holds a buffer.
    /// Returns whether that is so. For callers that wait in slices (a binding checking for
    /// signals between them) before `close`; the pool stays until `close` (or the drop).
    pub fn wait_closing(&mut self, timeout: Duration) -> bool {
        if self.control.inherited() {
            // The parent's channel (`identity::fork`): nothing of this process's to wait for;
            // `close` then says why it cannot close.
            return true;
        }
        self.close_to_consumers();
        if self.withdraws_at_close {
            self.control.wait_released(timeout, 0)
        } else {
            self.control.wait_drained(timeout, 0)
        }
    }

    /// Waits up to `timeout` (`None`: no bound) until every consumer attached has taken the
    /// newest frame or a later one (crate-private: a tensor set's writer lets its readers take
    /// the last generation before its close withdraws it). Returns whether they all have; `false`
    /// at once in a forked child's copy, and once the frames are withdrawn
    /// ([`Control::close_withdrawing`]: none is taken any more).
    pub(crate) fn wait_taken(&self, timeout: Option<Duration>) -> bool {
        if self.control.inherited() {
            return false;
        }
        self.control.wait_taken(self.control.head(), timeout)
    }

    /// The channel's control segment (crate-private: a tensor set's [`Closer`] withdraws its
    /// frames from another thread, [`Control::close_withdrawing`], which the producer's own
    /// close then finds done).
    ///
    /// [`Closer`]: crate::tensorset::Closer
    pub(crate) fn control(&self) -> &Arc<Control> {
        &self.control
    }

    /// The first step of a close ([`Producer::close`], [`Producer::wait_closing`], the drop):
    /// marks the channel closed (consumers get [`ChannelError::Closed`] once nothing is left for
    /// them) and wakes every consumer; a memoryless channel's also withdraws every frame at once
    /// ([`Control::close_withdrawing`]: no hold is granted from here on). Returns the frame each
    /// buffer holds (the release words a GPU close waits for). Again and again, as the first.
    pub(crate) fn close_to_consumers(&mut self) -> Vec<u64> {
        if !self.withdraws_at_close {
            // The frame each buffer holds: consumers may take them until the close's wait
            // ends; the close is this producer's last step, so nothing is published after it.
            let frames = (0..self.control.buffers())
                .map(|i| self.control.frame_in(i))
                .collect();
            self.control.close();
            return frames;
        }
        // Made once, by this close or a `Closer` before it: the same frames either way.
        self.control.close_withdrawing()
    }

    /// The close of [`Producer::close`] (and the drop); `leave_own`: that of
    /// [`Producer::close_at_exit`].
    fn shutdown(&mut self, timeout: Duration, leave_own: bool) -> Result<ShutdownReport> {
        self.control.check_fork()?;
        // The frame each buffer holds, before the withdrawal: the release words to wait for.
        let seqs = self.close_to_consumers();
        // This process's consumers, not waited for when it exits (none attaches after the close
        // above). An identity that cannot be read leaves them all waited for.
        let own = match leave_own {
            true => ProcessIdentity::current().map_or(0, |me| self.control.consumers_of(&me)),
            false => 0,
        };
        let (forced, behind) = if self.withdraws_at_close {
            self.control.wait_released(timeout, own);
            self.control.withdraw_all()
        } else {
            self.control.drain(timeout, own)
        };
        if behind > 0 {
            tracing::warn!(
                "channel {}: {behind} every-frame consumers had not received every frame after \
                 {timeout:?}",
                self.name
            );
        }
        if forced > 0 {
            tracing::warn!(
                "channel {}: {forced} holds were still outstanding after {timeout:?} and were forced",
                self.name
            );
        }
        self.control.unlink();
        let gpu = match &self.side {
            Side::Host(pool) => {
                // No GPU work to wait for: every hold ended or was forced above.
                if let Some(pool) = pool {
                    pool.unlink();
                }
                return Ok(ShutdownReport {
                    forced_holds: forced,
                    consumers_behind: behind,
                });
            }
            Side::Gpu(gpu) => gpu,
        };
        // `None`: a timeout past what `Instant` can hold (`Duration::MAX`), which never runs out;
        // `Instant + Duration` would panic on it.
        let deadline = Instant::now().checked_add(timeout);
        // The pool is freed after this: first let the consumers' last kernels on each buffer
        // finish (their release words; a dead consumer's are raised by reclaiming its slot), then
        // our own work.
        for (i, &seq) in seqs.iter().enumerate() {
            // This process's consumers when it exits: their streams write no release word any
            // more (`leave_own`).
            let mut bits = self.control.take_used(i) & !own;
            while bits != 0 {
                let c = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                while !self.control.released(c, i, seq) && self.control.is_attached(c) {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        tracing::warn!(
                            "channel {}: consumer {c}'s GPU work on buffer {i} did not finish in {timeout:?}",
                            self.name
                        );
                        break;
                    }
                    self.control.reclaim_dead_consumers();
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
        let synced = gpu.stream.synchronize();
        // Our stream drained: every ready word it was to write is written. Let go of work that
        // consumers posted ahead for frames that will never come.
        self.control.close_gate(layout::GateState::Closed);
        synced?;
        Ok(ShutdownReport {
            forced_holds: forced,
            consumers_behind: behind,
        })
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        // A forked child's copy: the channel, its names and its consumers' holds are the
        // parent's (`identity::fork`).
        if self.control.inherited() {
            return;
        }
        if !self.closed
            && let Err(e) = self.shutdown(Duration::from_secs(5), false)
        {
            tracing::warn!("closing channel {}: {e}", self.name);
        }
    }
}

mod write_frame;

pub(crate) use write_frame::LentFrame;
pub use write_frame::WriteFrame;

#[cfg(test)]
mod tests;
