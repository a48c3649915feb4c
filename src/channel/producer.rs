//! The producing end: [`Producer`] (its pool of exportable buffers, the control segment it creates,
//! close and shutdown) and the [`WriteFrame`] it hands out.

#[cfg(doc)]
use super::ChannelError;
use super::control::{self, Control};
use super::host::HostPool;
use super::layout;
use super::options::{HOST_NO_GPU, LIVENESS_CHECK, check_options, no_host_bytes, reserve_quota};
use super::{ChannelOptions, ChannelStats, META_BYTES, MemoryKind, WaitStrategy};
use crate::driver::{Context, DeviceBuffer, DeviceMemory, Event, HostRegistration, Stream, Uuid};
use crate::error::{Error, Result};
use crate::ffi::sys;
use crate::identity::{Liveness, ProcessIdentity};
use crate::ipc::{IpcEvent, MemPool, PoolBuffer, VmmBuffer};
use crate::quota::Reservation;
use crate::shm::SegmentOptions;
use crate::token::{TOKEN_LEN, Token};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a producer waiting for a consumer's GPU work polls its release event before sleeping
/// between polls.
const SPIN: Duration = Duration::from_micros(50);

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
    /// The pool's bytes held from a shared budget ([`ChannelOptions::quota`]); last, so they
    /// return after the pool is freed.
    _quota: Option<Reservation>,
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
    /// [`ChannelError::OverQuota`] past the producer's own cap ([`ChannelOptions::quota_bytes`]);
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
    /// [`ChannelError::OverQuota`] past the producer's own cap; with [`ChannelOptions::quota`],
    /// [`crate::quota::QuotaError::OverQuota`] past the shared budget of host memory and the
    /// ledger's errors, as for [`Producer::create`]; [`ChannelError::AlreadyExists`] when a live
    /// producer serves `name`; [`Error::InvalidArgument`] for zero-size buffers, counts out of
    /// range or a bad name;
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
        check_options(opts)?;
        if opts.buffer_bytes == 0 {
            return Err(Error::InvalidArgument(
                "a host pool needs buffers of at least 1 byte".into(),
            ));
        }
        control::validate_channel_name(name)?;
        let quota = reserve_quota(opts, Uuid([0; 16]))?;
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
            _quota: quota,
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
        let quota = reserve_quota(opts, ctx.device().uuid())?;
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
            _quota: quota,
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
        let pool = self.producer.host.as_ref().ok_or_else(no_host_bytes)?;
        pool.range(self.index, offset, n)
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
