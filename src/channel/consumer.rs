//! The consuming end: [`Consumer`] (its imports of the pool, its stream, registration and join
//! event, made at attach or, for a memoryless channel, at their first need, with the watchdog that
//! drains its stream when the producer dies), the [`Frame`] it receives and releases
//! (`consumer/frame.rs`), and the receives it [`posts`](Consumer::post) ahead ([`Posted`],
//! `consumer/posted.rs`).

#[cfg(doc)]
use super::MemoryKind;
use super::control::Control;
use super::handoff::Metadata;
use super::host::HostPool;
use super::layout::{self, Delivery};
use super::options::{HOST_NO_GPU, LIVENESS_CHECK};
use super::watchdog::Watchdog;
use super::{ChannelError, ChannelStats, ConsumerOptions, SegmentFault, WaitStrategy};
use crate::driver::{Context, Device, DeviceMemory, Event, HostRegistration, Stream};
use crate::error::{Error, Result};
use crate::ipc::ImportedBuffer;
use crate::token::{Token, TokenKind};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

mod frame;
mod posted;

pub use frame::Frame;
pub(crate) use frame::FrameHold;
pub use posted::{MAX_POSTED_AHEAD, Posted, PostedFrame};

/// The consuming end of a channel: imports the pool once and receives frames. Several threads
/// may receive from one consumer at once: each frame goes to one of them.
pub struct Consumer {
    // Drop order: the stream is drained and the slot freed (in Drop) first; then the side:
    // imports go, then the watchdog stops and the stream goes, the GPU words are unregistered,
    // then the context (or the host pool is unmapped); then the segment is unmapped (the
    // watchdog held it too; the registration lies in it). With receives posted ahead for frames not yet published,
    // Drop hands the GPU imports to a thread that waits for them instead, which drops them in the
    // same order and the segment last.
    /// Host or GPU, decided once where the consumer attaches.
    side: Side,
    control: Arc<Control>,
    slot: usize,
    wait: WaitStrategy,
    /// The sequence number of the last receive posted (0: none); locked while posting, so posts
    /// from several threads enqueue in sequence order.
    posted: Mutex<u64>,
    /// Held around each attempt to take a frame (`recv`, `try_recv`, a posted receive's wait),
    /// never across a wait: receives from several threads take one frame each, never the same
    /// one twice (`Control::take_or_closed` says why).
    taking: Mutex<()>,
}

/// What a consumer holds of the pool: either side, never half of one.
enum Side {
    /// Imports of a device pool.
    Gpu {
        /// Shared only with the thread that waits for receives posted ahead (Drop).
        imports: Arc<GpuImports>,
    },
    /// The mapping of a host pool ([`MemoryKind::Host`]); `None` on a memoryless channel
    /// ([`Consumer::attach_memoryless`]).
    Host(Option<HostPool>),
}

/// A consumer's GPU side.
struct GpuImports {
    // Drop order: imports before the stream, the registration before the context.
    buffers: Vec<ImportedBuffer>,
    /// The stream, the registration and the join event: made at attach where the channel has
    /// buffers; on a memoryless channel (a tensor set's generation channel) at their first need
    /// ([`GpuImports::objects`]), since a reader that only holds complete generations and
    /// releases them from the host needs none of them, and their driver calls (about 0.3 ms)
    /// would run beside the reader's mapping, which they slow.
    objects: OnceLock<GpuObjects>,
    /// Held while `objects` are made, so two threads never make them twice.
    making: Mutex<()>,
    ctx: Arc<Context>,
}

/// The GPU objects of a consumer ([`GpuImports::objects`]).
struct GpuObjects {
    /// Marks a dead producer's frames ready, so this consumer's stream drains: started with the
    /// stream, the only thing of this consumer's that waits on the producer's ready words (a
    /// memoryless channel's consumer that never made one has no thread to spare on it).
    _watchdog: Watchdog,
    /// Orders the consumer's stream with other streams ([`Frame::ready_on`],
    /// [`Frame::release_after`]); locked from record to wait, so frames released from two threads
    /// never cross their records.
    join: Mutex<Event>,
    stream: Stream,
    /// The GPU words' registration.
    ready: HostRegistration,
}

impl GpuImports {
    /// The consumer's stream, registration, join event and watchdog, made now if they were not
    /// (`cuStreamCreate`, `cuMemHostRegister` of `control`'s GPU words, `cuEventCreate`, the
    /// watchdog's thread, which keeps `control` mapped while it runs). `control` is the
    /// consumer's own, whose mapping outlives these imports (the consumer's field order; the
    /// posted-receive thread drops the imports first).
    ///
    /// # Errors
    /// CUDA errors from those calls (nothing is kept then: the next call tries again).
    fn objects(&self, control: &Arc<Control>) -> Result<&GpuObjects> {
        if let Some(o) = self.objects.get() {
            return Ok(o);
        }
        let _making = self.making.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(o) = self.objects.get() {
            return Ok(o);
        }
        let stream = Stream::new(&self.ctx)?;
        let (page, len) = control.gpu_words();
        // SAFETY: the GPU words lie in the control segment's mapping, which the consumer keeps
        // until these imports (and the registration in them) have dropped (see above).
        let ready = unsafe { HostRegistration::new(&self.ctx, page, len)? };
        let join = Mutex::new(Event::new(&self.ctx)?);
        let watched = control.clone();
        let watchdog = Watchdog::start(
            "cuda-ipc-watchdog",
            "a dead producer is noticed at recv",
            move || {
                if watched.producer_gone().is_err() {
                    watched.force_ready();
                    return false;
                }
                true
            },
        );
        Ok(self.objects.get_or_init(|| GpuObjects {
            _watchdog: watchdog,
            join,
            stream,
            ready,
        }))
    }
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
    /// [`ChannelError::ProducerGone`] when the producer is dead; CUDA errors from imports. For a
    /// host channel, shared-memory errors for what is under the pool's name (`NotASegment`,
    /// `Sparse`, `WrongOwner`, `InsecureMode`, `TooSmall`), [`ChannelError::BadSegment`] for a pool
    /// that is missing or does not match the channel, [`ChannelError::Closed`] for a pool that is
    /// gone because the producer closed the channel meanwhile, [`ChannelError::Superseded`] for a
    /// pool made again since.
    pub fn attach(name: &str, opts: &ConsumerOptions) -> Result<Consumer> {
        let control = Control::open_with(name, opts.group_access)?;
        let mem = control.buffer_token(0);
        let token = Token::from_bytes(&mem)?;
        if token.kind == TokenKind::HostMemory {
            return Self::attach_host(control, name, opts);
        }
        let device = Device::by_uuid(token.device)?;
        Self::attach_with(
            control,
            &device.primary_context()?,
            opts,
            &mut Duration::default(),
        )
    }

    /// Attaches to channel `name` in `ctx` (which may be on another device than the pool's). A host
    /// channel is attached as by [`Consumer::attach`], without using `ctx`.
    ///
    /// # Errors
    /// As [`Consumer::attach`].
    pub fn attach_in(ctx: &Arc<Context>, name: &str, opts: &ConsumerOptions) -> Result<Consumer> {
        let control = Control::open_with(name, opts.group_access)?;
        let mem = control.buffer_token(0);
        if Token::from_bytes(&mem)?.kind == TokenKind::HostMemory {
            return Self::attach_host(control, name, opts);
        }
        Self::attach_with(control, ctx, opts, &mut Duration::default())
    }

    fn attach_host(control: Control, name: &str, opts: &ConsumerOptions) -> Result<Consumer> {
        control.producer_gone()?;
        let tokens = (0..control.buffers())
            .map(|i| Token::from_bytes(&control.buffer_token(i)))
            .collect::<Result<Vec<_>>>()?;
        let pool = HostPool::open(name, opts.group_access, &tokens, control.buffer_bytes())
            .map_err(|e| match e {
                // The producer closed the channel (and unlinked its pool) since its control
                // segment was opened: a close, not a damaged segment.
                Error::Channel(ChannelError::BadSegment(SegmentFault::PoolMissing { .. }))
                    if control.is_closed() =>
                {
                    Error::Channel(ChannelError::Closed)
                }
                e => e,
            })?;
        // No release words: the producer waits on nothing but the hold masks.
        let slot = control.attach(opts.delivery)?;
        Ok(Consumer {
            side: Side::Host(Some(pool)),
            control: Arc::new(control),
            slot,
            wait: opts.wait,
            posted: Mutex::new(0),
            taking: Mutex::new(()),
        })
    }

    /// Attaches to the memoryless channel `name` under `prefix` (crate-private: a tensor set's
    /// generation channel, see `Producer::create_memoryless`): imports nothing. In `ctx` (the
    /// consumer's stream waits on the ready words, frames release on it, the watchdog closes a
    /// dead producer's gate, as for every GPU channel; all of them made at their first need, not
    /// here), or on the host with `None`. The frames of such a consumer have no buffer: only their
    /// sequence number, index and metadata mean anything.
    ///
    /// Adds to `gpu_time` the wall-clock time spent making the consumer's GPU objects (its
    /// stream, the registration of the GPU words, the join event and the watchdog thread), which
    /// a memoryless channel's attach does not make.
    ///
    /// # Errors
    /// As [`Consumer::attach`]; [`ChannelError::BadSegment`] when the channel has buffer memory.
    pub(crate) fn attach_memoryless(
        ctx: Option<&Arc<Context>>,
        prefix: &str,
        name: &str,
        opts: &ConsumerOptions,
        gpu_time: &mut Duration,
    ) -> Result<Consumer> {
        let control = Control::open_in(prefix, name, opts.group_access, super::control::INIT_WAIT)?;
        if control.buffer_bytes() != 0 {
            return Err(ChannelError::BadSegment(SegmentFault::BufferLen {
                index: 0,
                len: control.buffer_bytes() as usize,
                expected: 0,
            })
            .into());
        }
        let Some(ctx) = ctx else {
            control.producer_gone()?;
            let slot = control.attach(opts.delivery)?;
            return Ok(Consumer {
                side: Side::Host(None),
                control: Arc::new(control),
                slot,
                wait: opts.wait,
                posted: Mutex::new(0),
                taking: Mutex::new(()),
            });
        };
        Self::attach_with(control, ctx, opts, gpu_time)
    }

    /// Attaches in `ctx`; adds the time spent making GPU objects to `gpu_time` (see
    /// [`Consumer::attach_memoryless`]).
    fn attach_with(
        control: Control,
        ctx: &Arc<Context>,
        opts: &ConsumerOptions,
        gpu_time: &mut Duration,
    ) -> Result<Consumer> {
        control.producer_gone()?;
        let started = Instant::now();
        let mut buffers = Vec::new();
        // A memoryless channel (`attach_memoryless`, which checked it) has nothing to import.
        let imported = if control.buffer_bytes() == 0 {
            0
        } else {
            control.buffers()
        };
        for i in 0..imported {
            let mem = control.buffer_token(i);
            let b = ImportedBuffer::open_in(ctx, &Token::from_bytes(&mem)?)?;
            if b.len() as u64 != control.buffer_bytes() {
                return Err(ChannelError::BadSegment(SegmentFault::BufferLen {
                    index: i,
                    len: b.len(),
                    expected: control.buffer_bytes(),
                })
                .into());
            }
            buffers.push(b);
        }
        let imports = GpuImports {
            buffers,
            objects: OnceLock::new(),
            making: Mutex::new(()),
            ctx: ctx.clone(),
        };
        let control = Arc::new(control);
        if imported > 0 {
            // A channel with buffers: its frames are read on the stream (`Frame::view`), made
            // now with the watchdog. A memoryless one makes them at their first need
            // (`GpuImports::objects`).
            imports.objects(&control)?;
        }
        *gpu_time += started.elapsed();
        let slot = control.attach(opts.delivery)?;
        Ok(Consumer {
            side: Side::Gpu {
                imports: Arc::new(imports),
            },
            control,
            slot,
            wait: opts.wait,
            posted: Mutex::new(0),
            taking: Mutex::new(()),
        })
    }

    fn gpu(&self) -> Result<&GpuImports> {
        self.imports()
            .ok_or_else(|| Error::InvalidArgument(HOST_NO_GPU.into()))
    }

    /// The GPU side; `None` on a host channel.
    fn imports(&self) -> Option<&GpuImports> {
        match &self.side {
            Side::Gpu { imports, .. } => Some(imports),
            Side::Host(_) => None,
        }
    }

    /// The consumer's stream: frames are ready on it, enqueue the work that reads them here.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel ([`MemoryKind::Host`]), which has no stream
    /// (formerly a panic); CUDA errors where the stream is made now (crate-private memoryless
    /// channels make it at its first need); [`Error::ForkedChild`] in a process forked from the
    /// one that attached.
    pub fn stream(&self) -> Result<&Stream> {
        self.control.check_fork()?;
        Ok(&self.gpu_objects()?.stream)
    }

    /// Whether the consumer's stream (with its registration and join event) has been made: at
    /// attach on a channel with buffers, at its first need on a memoryless one; `false` on a
    /// host channel.
    pub(crate) fn has_stream(&self) -> bool {
        self.imports().is_some_and(|g| g.objects.get().is_some())
    }

    /// The GPU objects, made now if they were not.
    fn gpu_objects(&self) -> Result<&GpuObjects> {
        self.gpu()?.objects(&self.control)
    }

    /// The consumer's context.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel ([`MemoryKind::Host`]), which has no context
    /// (formerly a panic); [`Error::ForkedChild`] in a process forked from the one that attached.
    pub fn context(&self) -> Result<&Arc<Context>> {
        self.control.check_fork()?;
        Ok(&self.gpu()?.ctx)
    }

    /// The control segment's creation generation (crate-private: a tensor set's reader checks its
    /// generation channel against the manifest) and its buffer count.
    pub(crate) fn control_generation(&self) -> (u64, usize) {
        (self.control.generation(), self.control.buffers())
    }

    /// The producer's pid as its slot records it (crate-private: errors that name it).
    pub(crate) fn producer_pid(&self) -> u32 {
        self.control.producer().pid
    }

    /// Whether the channel's producer is alive, asked now: not closed and its process not dead.
    pub(crate) fn producer_alive(&self) -> bool {
        !self.control.is_closed() && self.control.producer_gone().is_ok()
    }

    /// Whether the channel's pool is host memory ([`MemoryKind::Host`]).
    pub fn is_host(&self) -> bool {
        matches!(self.side, Side::Host(_))
    }

    /// Waits for the next frame (by the delivery policy), without a timeout; still returns
    /// [`ChannelError::ProducerGone`] promptly when the producer dies.
    ///
    /// # Errors
    /// As [`Consumer::recv_timeout`], except [`Error::Timeout`]: a wait without a deadline never
    /// times out.
    pub fn recv(&self) -> Result<Frame<'_>> {
        // A wait without a deadline: the protocol's wait returns only with a frame or an error,
        // and should it ever come back empty, there is no timeout to report: wait again.
        loop {
            if let Some(frame) = self.recv_inner(None)? {
                return Ok(frame);
            }
        }
    }

    /// Waits up to `timeout` for the next frame.
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`ChannelError::ProducerGone`] when the producer died;
    /// [`ChannelError::Closed`]
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
        let taken = {
            let _one = self.taking.lock().unwrap_or_else(|p| p.into_inner());
            self.control.take_or_closed(self.slot)
        };
        match taken.map_err(|e| self.on_error(e))? {
            Some((i, seq, meta)) => self.deliver(i, seq, meta).map(Some),
            None => {
                self.control.producer_gone().map_err(|e| self.on_error(e))?;
                Ok(None)
            }
        }
    }

    /// Takes the newest frame whose sequence number is above `than`, whatever this consumer took
    /// before (crate-private: a tensor set reader's `current` and `wait_newer`), waiting up to
    /// `timeout` (`Some(Duration::ZERO)`: only one published already) by the consumer's wait
    /// strategy. Each attempt runs with `lock` held, and the guard is returned with the frame:
    /// the caller counts its holds under it, so a hold it takes and one it ends never cross.
    /// `Ok(None)` at the timeout.
    ///
    /// `held(counts, i)` says whether the caller already holds buffer `i` through another frame
    /// (by the counts under `lock`). A consumer's hold of a buffer is one bit, so taking a buffer
    /// it holds takes nothing new: when the stream wait of such a take fails, the frame is let go
    /// without its release, which would end the other frame's hold while it is still read (only
    /// a frame whose take set the bit releases it, under the lock).
    ///
    /// # Errors
    /// As [`Consumer::recv_timeout`], except the timeout.
    pub(crate) fn take_newer<'s, 'l, G>(
        &'s self,
        than: u64,
        timeout: Option<Duration>,
        lock: &'l Mutex<G>,
        held: impl FnOnce(&G, usize) -> bool,
    ) -> Result<Option<(Frame<'s>, std::sync::MutexGuard<'l, G>)>> {
        let control = &*self.control;
        let attempt = || -> Result<Option<_>> {
            let guard = lock.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(got) = control.try_take_newer(self.slot, than)? {
                return Ok(Some((got, guard)));
            }
            if control.is_closed() {
                // Seeing `closed` makes every publish visible: one more look is conclusive.
                return match control.try_take_newer(self.slot, than)? {
                    Some(got) => Ok(Some((got, guard))),
                    None => Err(Error::Channel(ChannelError::Closed)),
                };
            }
            Ok(None)
        };
        let got = if timeout == Some(Duration::ZERO) {
            attempt().and_then(|x| match x {
                Some(x) => Ok(Some(x)),
                None => control.producer_gone().map(|()| None),
            })
        } else {
            super::wait::wait_until(
                control.header().publish_wake(),
                self.wait,
                timeout,
                attempt,
                || {
                    control.producer_gone()?;
                    control.check_superseded()
                },
            )
        };
        match got {
            Ok(Some(((i, seq, meta), guard))) => {
                let (frame, waited) = self.deliver_parts(i, seq, meta);
                if let Err(e) = waited {
                    if held(&guard, i) {
                        // The hold bit is the other frame's, and so is the release: it writes the
                        // release word after its own work (same buffer, same sequence number: the
                        // producer cannot rewrite a held buffer). The frame owns no memory
                        // (its metadata is inline), so forgetting it leaks nothing.
                        std::mem::forget(frame);
                    } else {
                        // This take set the bit: its release ends it, under the lock.
                        drop(frame);
                    }
                    return Err(e);
                }
                Ok(Some((frame, guard)))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(self.on_error(e)),
        }
    }

    fn recv_inner(&self, timeout: Option<Duration>) -> Result<Option<Frame<'_>>> {
        let taken = self
            .control
            .take(self.slot, self.wait, timeout, &self.taking);
        match taken {
            Ok(Some((i, seq, meta))) => self.deliver(i, seq, meta).map(Some),
            Ok(None) => Ok(None),
            Err(e) => Err(self.on_error(e)),
        }
    }

    /// When the producer died, frames it published may still wait for a write that will never
    /// finish: mark them ready so this consumer's stream drains.
    fn on_error(&self, e: Error) -> Error {
        if !self.is_host() && matches!(e, Error::Channel(ChannelError::ProducerGone { .. })) {
            self.control.force_ready();
        }
        e
    }

    fn deliver(&self, i: usize, seq: u64, metadata: Metadata) -> Result<Frame<'_>> {
        let (frame, waited) = self.deliver_parts(i, seq, metadata);
        // On an error the frame's Drop releases the hold.
        waited?;
        Ok(frame)
    }

    /// The frame taken from buffer `i`, and whether the consumer's stream was made to wait for
    /// it (always `Ok` on a host channel); the caller decides what a failed wait releases.
    fn deliver_parts(&self, i: usize, seq: u64, metadata: Metadata) -> (Frame<'_>, Result<()>) {
        let frame = Frame {
            consumer: self,
            index: i,
            seq,
            metadata,
            host_ordered: false,
        };
        let Some(gpu) = self.imports() else {
            // A host channel: the Acquire load of the buffer's seq in `try_take` already ordered
            // the producer's writes before this frame's reads.
            self.control.took();
            return (frame, Ok(()));
        };
        let objects = match gpu.objects.get() {
            Some(o) => o,
            // No stream yet (a memoryless channel's consumer) and the producer's stream has
            // written the frame's ready word: its work is done and visible, as a stream wait on
            // the word would have found; nothing to enqueue, and the frame's release is written
            // from the host (`release_frame`) unless a stream is made meanwhile.
            None if self.control.frame_written(i, seq) == Some(true) => {
                self.control.took();
                return (frame, Ok(()));
            }
            None => {
                // This consumer's watchdog starts with its stream, now: a producer that died
                // before has its gate closed here, so that the frame reads as cut short
                // (`Frame::written`) rather than as still being written.
                if self.control.producer_gone().is_err() {
                    self.control.force_ready();
                }
                match gpu.objects(&self.control) {
                    Ok(o) => o,
                    Err(e) => {
                        self.control.took();
                        return (frame, Err(e));
                    }
                }
            }
        };
        // If this fails the caller releases the hold (`deliver`: the frame's Drop). The stream
        // waits on the buffer's ready word, which the producer's stream writes after its work; if
        // the producer dies first, the consumer (or its watchdog) closes the gate, raising the
        // word, so the stream drains (`Control::force_ready`).
        // SAFETY: the word lies in the registered GPU words (i < buffers), which stay registered
        // and mapped until this consumer's stream has drained (Drop of Consumer).
        let waited = unsafe {
            objects.stream.wait_value_u32(
                objects.ready.device_ptr + layout::ready_word_offset(i) as u64,
                seq as u32,
            )
        };
        // The cursor moved: announced after the stream's wait, off the hand-off's path.
        self.control.took();
        (frame, waited)
    }

    /// Counters of the channel and its consumers.
    pub fn stats(&self) -> ChannelStats {
        self.control.stats()
    }

    /// Waits up to `timeout` for the next frame, as [`Consumer::recv_timeout`] (`Duration::ZERO`:
    /// only one published already), then up to `bytes` for its bytes, ordered on the
    /// host instead of the consumer's stream (crate-private: the remote lane's sending bridge,
    /// whose reader of the frame is a NIXL transfer that no stream orders). On a GPU channel the
    /// calling thread waits until the buffer's ready word shows the frame (the producer's stream
    /// wrote it after its work on the buffer, with a memory barrier), and dropping the frame
    /// writes its release word from the host: the caller must have finished every read of the
    /// buffer, on the GPU too, before it drops the frame. Nothing is enqueued on the consumer's
    /// stream, and the frame's [`Frame::release_after`] does not order the release.
    ///
    /// # Errors
    /// As [`Consumer::recv_timeout`]; [`ChannelError::ProducerGone`] when the producer died before
    /// its
    /// stream finished the frame (the gate was closed for it: the bytes may be partial);
    /// [`Error::Timeout`] also when the frame was taken but its bytes were not ready within
    /// `bytes` (the frame is released).
    #[cfg_attr(not(feature = "remote"), allow(dead_code))]
    pub(crate) fn recv_host_ordered(
        &self,
        timeout: Duration,
        bytes: Duration,
    ) -> Result<Frame<'_>> {
        let taken = self
            .control
            .take(self.slot, self.wait, Some(timeout), &self.taking);
        let (i, seq, metadata) = match taken {
            Ok(Some(x)) => x,
            Ok(None) => {
                return Err(Error::Timeout {
                    what: "a frame",
                    after: timeout,
                });
            }
            Err(e) => return Err(self.on_error(e)),
        };
        self.control.took();
        // Dropped on an error below: releases the hold (from the host).
        let frame = Frame {
            consumer: self,
            index: i,
            seq,
            metadata,
            host_ordered: true,
        };
        if self.is_host() {
            // A host channel: the Acquire load of the buffer's seq in `try_take` ordered the
            // producer's writes before this frame's reads.
            return Ok(frame);
        }
        let start = Instant::now();
        let mut naps = 0u32;
        let mut next_check = start + LIVENESS_CHECK;
        loop {
            match self.control.frame_written(i, seq) {
                Some(true) => return Ok(frame),
                // Raised by the gate closed for a dead producer: the bytes may be partial.
                Some(false) => {
                    let pid = self.control.producer().pid;
                    return Err(ChannelError::ProducerGone { pid }.into());
                }
                None => {}
            }
            if start.elapsed() >= bytes {
                return Err(Error::Timeout {
                    what: "a frame's bytes (its ready word)",
                    after: start.elapsed(),
                });
            }
            // The producer's work on the frame is usually microseconds: spin briefly, then nap
            // (20 us, growing to 200 us). A dead producer's gate is closed within about 20 ms
            // (by this consumer's watchdog, or here where it has none), which ends the wait.
            if Instant::now() >= next_check {
                if self.control.producer_gone().is_err() {
                    self.control.force_ready();
                }
                next_check = Instant::now() + LIVENESS_CHECK;
            }
            if start.elapsed() < Duration::from_micros(200) {
                std::hint::spin_loop();
            } else {
                naps = naps.saturating_add(1);
                std::thread::sleep(Duration::from_micros(u64::from(naps.min(10)) * 20));
            }
        }
    }

    /// Marks this consumer as a bridge sending its frames to another host (its slot's `transport`
    /// word, shown by `cuda-ipc ls`): for the remote lane's sending bridge.
    #[cfg_attr(not(feature = "remote"), allow(dead_code))]
    pub(crate) fn mark_bridged(&self) {
        self.control.set_consumer_bridged(self.slot);
    }

    /// The device address, in this consumer's context, of the channel's gate words: two `u32`,
    /// the gate's state ([`GateState`](super::inspect::GateState) code: 0 open, 1 closed, 2 producer gone) and its
    /// end (the low 32 bits of the sequence number of the last frame published when the gate
    /// closed). Work posted ahead ([`Consumer::post`]) for frame `s` reads them after its stream
    /// waited: the frame came when the state is 0 or `(int32_t)(s - end) <= 0`; otherwise the
    /// stream was let go because the channel closed or its producer died, and the buffer holds
    /// nothing of frame `s`. Read them with volatile loads (host memory the driver maps).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel; [`Error::ForkedChild`] in a process forked
    /// from the one that attached.
    pub fn gate_device_ptr(&self) -> Result<u64> {
        self.control.check_fork()?;
        let gpu = self.imports().ok_or_else(|| {
            Error::InvalidArgument("a host channel has no gate words on a GPU".into())
        })?;
        Ok(gpu.objects(&self.control)?.ready.device_ptr + layout::GATE_STATE_OFFSET as u64)
    }

    /// Waits for this consumer's stream to drain, closing a dead producer's gate meanwhile (the
    /// watchdog does it too; this does not rely on it).
    fn drain_stream(gpu: &GpuImports, control: &Control) {
        let Some(objects) = gpu.objects.get() else {
            // No stream was made: nothing of this consumer's was enqueued.
            return;
        };
        let mut next_check = Instant::now();
        loop {
            match objects.stream.is_idle() {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!("querying the consumer stream before detaching failed: {e}");
                    break;
                }
            }
            if Instant::now() >= next_check {
                if control.producer_gone().is_err() {
                    control.force_ready();
                }
                next_check = Instant::now() + LIVENESS_CHECK;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        // A forked child's copy: the slot, its holds and its release words are the parent's
        // consumer's (`identity::fork`).
        if self.control.inherited() {
            return;
        }
        let Side::Gpu { imports, .. } = &self.side else {
            // A host channel: no GPU work can still read the pool; frames borrowed this consumer,
            // so all were dropped (their holds ended) before this.
            self.control.detach(self.slot);
            return;
        };
        // Detaching lets the producer overwrite the buffers without waiting for this consumer's
        // release words: let the work that reads them finish first.
        let posted = *self.posted.lock().unwrap_or_else(|p| p.into_inner());
        if posted <= self.control.head() || self.control.producer_gone().is_err() {
            Self::drain_stream(imports, &self.control);
            self.control.detach(self.slot);
            return;
        }
        // Receives posted for frames not published yet: the stream drains only when they come (or
        // the channel closes, or the producer dies), which may be never. Stop holding the producer
        // back (latest-only: it no longer waits for this consumer's cursor; this consumer takes
        // nothing more, so no write waits on its release words) and let a thread wait for the
        // stream, keeping the slot (its release words are this stream's) and the imports with the
        // registration: the thread's references are the last, dropped in order there.
        self.control.set_policy(self.slot, Delivery::LatestOnly);
        let gpu = imports.clone();
        let control = self.control.clone();
        let slot = self.slot;
        let orphan = std::thread::Builder::new()
            .name("cuda-ipc-posted".into())
            .spawn(move || {
                Self::drain_stream(&gpu, &control);
                control.detach(slot);
                // Order: the stream, imports and registration, then the mapping.
                drop(gpu);
                drop(control);
            });
        if let Err(e) = orphan {
            tracing::warn!("no thread to wait for receives posted ahead ({e}); waiting here");
            Self::drain_stream(imports, &self.control);
            self.control.detach(self.slot);
        }
    }
}
