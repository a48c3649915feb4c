//! The consuming end: [`Consumer`] (its imports of the pool, the watchdog that drains its stream
//! when the producer dies) and the [`Frame`] it receives and releases.

#[cfg(doc)]
use super::MemoryKind;
use super::control::Control;
use super::handoff::Metadata;
use super::host::HostPool;
use super::layout;
use super::options::{HOST_NO_GPU, LIVENESS_CHECK, no_host_bytes};
use super::{ChannelError, ChannelStats, ConsumerOptions, WaitStrategy};
use crate::driver::{Context, Device, DeviceMemory, Event, HostRegistration, Stream};
use crate::error::{Error, Result};
use crate::ffi::sys;
use crate::ipc::{ImportedBuffer, IpcEvent};
use crate::token::{TOKEN_LEN, Token, TokenKind};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

    fn deliver(&self, i: usize, seq: u64, metadata: Metadata) -> Result<Frame<'_>> {
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
    /// Inline: a frame allocates nothing.
    metadata: Metadata,
}

impl std::fmt::Debug for Frame<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frame")
            .field("seq", &self.seq)
            .field("index", &self.index)
            .field("metadata_len", &self.metadata.as_slice().len())
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
        let pool = self.consumer.host.as_ref().ok_or_else(no_host_bytes)?;
        let src = pool.range(self.index, offset, dst.len())?;
        // SAFETY: `src..src + dst.len()` lies in this frame's buffer (checked by `range`), which
        // the producer does not write while this frame holds it; `dst` is ordinary memory of this
        // process, so the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
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
        self.metadata.as_slice()
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
