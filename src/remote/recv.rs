//! The receiving bridge, on the consumers' host: the far channel's [`Producer`], whose buffers the
//! sending bridge WRITEs into; it publishes each one when the WRITE's notification arrives.

use super::link::Link;
use super::nixl::{Lane, Place, Region};
use super::report::{self, Role, Status};
use super::send::unexpected;
use super::wire::{self, FrameNote, Msg, Secret, Session};
use super::{LaneOptions, RemoteError};
use crate::channel::{ChannelOptions, LentFrame, Producer};
use crate::driver::{Context, Device};
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

/// How a receiving bridge runs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RecvOptions {
    /// The far channel this bridge creates and keeps filled (on this host).
    pub channel: String,
    /// The secret a sending bridge must present.
    pub secret: Secret,
    /// The far pool's memory: [`Place::Host`] (a host channel, no GPU) or
    /// [`Place::Device`] (device memory of that CUDA device).
    pub place: Place,
    /// Buffers in the far pool; `None`: as many as the near pool has.
    pub buffers: Option<usize>,
    /// Most consumers of the far channel; default 8.
    pub max_consumers: usize,
    /// How many far buffers the bridge lends the sending bridge ahead of the frames (credits
    /// outstanding at once); default 2, at most one less than the far pool's buffers (and at
    /// least 1). The sending bridge keeps one WRITE in flight per credit; two hide the credit's
    /// round trip behind the WRITE before it; each one more is a far buffer its consumers cannot
    /// hold meanwhile.
    pub credits: usize,
    /// Timeouts and periods.
    pub lane: LaneOptions,
}

impl RecvOptions {
    /// Options for channel `channel` in host memory, checked against `secret`.
    pub fn new(channel: &str, secret: Secret) -> RecvOptions {
        RecvOptions {
            channel: channel.to_string(),
            secret,
            place: Place::Host,
            buffers: None,
            max_consumers: 8,
            credits: 2,
            lane: LaneOptions::default(),
        }
    }
}

/// `Ok` when `buffers` (a far pool's count, `None`: the near pool's) can make a channel: 1 to
/// [`crate::channel::MAX_BUFFERS`].
///
/// # Errors
/// [`Error::InvalidArgument`] naming the count and the bounds.
pub fn check_buffers(buffers: Option<usize>) -> Result<()> {
    let most = crate::channel::MAX_BUFFERS;
    match buffers {
        Some(b) if !(1..=most).contains(&b) => Err(Error::InvalidArgument(format!(
            "a far channel of {b} buffers: a channel takes 1 to {most}"
        ))),
        _ => Ok(()),
    }
}

/// How a receiving bridge's session ended.
#[derive(Debug)]
#[non_exhaustive]
pub enum Ended {
    /// The near producer closed its channel; the far channel was closed (its consumers get
    /// [`ChannelError::Closed`](crate::channel::ChannelError::Closed) once they received every
    /// frame). Holds what [`Producer::close`]
    /// reported, or its error.
    Closed(Result<crate::channel::ShutdownReport>),
    /// The near producer, the sending bridge or the link died, or the lane failed. `producer` is
    /// the far channel's producer, still open: end the process without dropping it
    /// (`std::process::exit`) and far consumers get
    /// [`ChannelError::ProducerGone`](crate::channel::ChannelError::ProducerGone) within the
    /// liveness
    /// period; dropping it closes the channel instead
    /// ([`ChannelError::Closed`](crate::channel::ChannelError::Closed)). A restarted
    /// bridge replaces the dead producer's segments.
    Lost {
        /// The far producer.
        producer: Box<Producer>,
        /// What happened.
        reason: String,
    },
    /// `stop` was set; the producer is handed back as for [`Ended::Lost`].
    Stopped(Box<Producer>),
}

/// Waits on `listener` for a sending bridge that proves the secret and names a channel geometry
/// this bridge can serve (others are refused and logged, and waiting goes on), then creates the far
/// channel with that geometry, registers its buffers with NIXL as it acquires them, and publishes
/// the frames written into them, until the session ends (see [`Ended`]). Accepts one session; a
/// lost session ends the call.
///
/// Connections are greeted concurrently, each on a thread of its own with one deadline for its
/// whole handshake and geometry ([`LaneOptions::handshake_timeout`]), so a slow or silent peer
/// never delays another; beyond [`MAX_HANDSHAKES`] connections in their handshake, new ones are
/// closed at once. A peer that connects while a session runs is told at once that the bridge is
/// busy.
///
/// # Errors
/// [`Error::InvalidArgument`] when [`RecvOptions::buffers`] is 0 or over
/// [`crate::channel::MAX_BUFFERS`] (checked first: no far channel could be made for any peer);
/// [`Error::Unsupported`] when NIXL is not installed; the errors of
/// [`Device::get`] and [`Device::primary_context`] for [`Place::Device`] (before any peer);
/// [`Error::Timeout`] when `stop` was set while waiting; [`RemoteError::Link`] when the listener
/// fails. A peer refused (wrong secret, another version, a geometry out of bounds: 0 or over
/// [`crate::channel::MAX_BUFFERS`] buffers, 0 or over [`wire::MAX_BUFFER_BYTES`] bytes each, a far
/// pool larger than this host's memory, an unknown memory kind), one that fails its handshake, and
/// one whose far channel cannot be made (too large to allocate, a quota) is told why and logged,
/// and the next one awaited; a live producer already serving the name
/// ([`crate::channel::ChannelError::AlreadyExists`]) is told and returned. Once the far channel
/// exists, every failure is [`Ended::Lost`], and a NIXL agent that cannot be made is told to the
/// peer and returned as [`RemoteError::Refused`].
pub fn serve(
    opts: &RecvOptions,
    listener: &TcpListener,
    stop: &AtomicBool,
    frames: &mut u64,
) -> Result<Ended> {
    check_buffers(opts.buffers)?;
    super::nixl::probe()?;
    // UCX's CUDA transports work in the thread's current context: the far pool's (the device's
    // primary context) is current for the whole session, NIXL's backend creation included; it is
    // left after the lane (declared before it, so dropped after it) is gone.
    let gpu_ctx: Option<std::sync::Arc<Context>> = match opts.place {
        Place::Host => None,
        Place::Device(d) => Some(Device::get(d as usize).and_then(|dev| dev.primary_context())?),
    };
    let _current = gpu_ctx.as_ref().map(|c| c.enter()).transpose()?;
    let door = Door::open(listener, &opts.secret, opts.lane.handshake_timeout)?;
    // Until a peer that proved the secret names a channel this bridge can make, a failed peer is
    // logged and the next one awaited.
    let (mut stream, peer, mut session, producer, kind, far_buffers, buffer_bytes) = loop {
        if stop.load(Ordering::Relaxed) {
            return Err(Error::Timeout {
                what: "a sending bridge (stopped)",
                after: Duration::ZERO,
            });
        }
        door.admit();
        let Some(mut a) = door.next(Duration::from_millis(20)) else {
            continue;
        };
        let (buffers, buffer_bytes, kind) = match &a.first {
            Msg::Channel {
                buffers,
                buffer_bytes,
                kind,
                ..
            } => (*buffers, *buffer_bytes, *kind),
            m => {
                let why = unexpected(m, "the near channel").to_string();
                tracing::warn!("lane: refused {}: {why}", a.peer);
                let _ = a.session.send(&mut a.stream, &Msg::Refused { reason: why });
                continue;
            }
        };
        let refuse = |a: &mut Arrival, why: &str| {
            tracing::warn!("lane: refused {}: {why}", a.peer);
            let reason = why.to_string();
            let _ = a.session.send(&mut a.stream, &Msg::Refused { reason });
        };
        let g = match wire::check_geometry(buffers, buffer_bytes, kind) {
            Ok(g) => g,
            Err(e) => {
                refuse(&mut a, &e.to_string());
                continue;
            }
        };
        let far_buffers = opts.buffers.unwrap_or(g.buffers);
        if let Err(why) = fits(opts.place, far_buffers, g.buffer_bytes) {
            refuse(&mut a, &why);
            continue;
        }
        let copts = ChannelOptions::new(g.buffer_bytes)
            .buffers(far_buffers)
            .max_consumers(opts.max_consumers);
        let producer = match &gpu_ctx {
            None => Producer::create_host(&opts.channel, &copts),
            // Legacy memory where the device has legacy IPC: UCX's `cuda_ipc` transport maps
            // legacy handles of far buffers and WRITEs into them GPU to GPU, while VMM far
            // buffers are host-staged (measured on an H200: 15 frames/s of 4K frames against
            // some 18,000; docs/gpu-verification.md, run AF). Elsewhere `Auto` (VMM). The far
            // channel's own consumers are then legacy importers: one whose pid equals this
            // bridge's in another pid namespace gets `Error::NotImportable`.
            Some(ctx) => match Producer::create(
                ctx,
                &opts.channel,
                &copts.clone().memory(crate::channel::MemoryKind::Legacy),
            ) {
                Err(Error::Unsupported { .. }) => Producer::create(
                    ctx,
                    &opts.channel,
                    &copts.clone().memory(crate::channel::MemoryKind::Auto),
                ),
                made => made,
            },
        };
        match producer {
            Ok(p) => {
                break (
                    a.stream,
                    a.peer,
                    a.session,
                    Box::new(p),
                    g.kind,
                    far_buffers,
                    g.buffer_bytes,
                );
            }
            Err(e @ Error::Channel(crate::channel::ChannelError::AlreadyExists { .. })) => {
                let why = format!("the far channel: {e}");
                let _ = a.session.send(
                    &mut a.stream,
                    &Msg::Refused {
                        reason: why.clone(),
                    },
                );
                return Err(RemoteError::Refused(why).into());
            }
            Err(e) => refuse(&mut a, &format!("the far channel: {e}")),
        }
    };
    let mut producer = producer;
    let refuse = |stream: &mut TcpStream, session: &mut Session, why: String| -> Error {
        let _ = session.send(
            stream,
            &Msg::Refused {
                reason: why.clone(),
            },
        );
        RemoteError::Refused(why).into()
    };
    // The header's `transport` word: a bridge fills this channel (`cuda-ipc ls` shows it; the
    // status file says over what).
    producer.mark_bridged();
    let near = Place::from_code(kind, 0).unwrap_or(Place::Host);
    let agent = format!("cuda-ipc-recv-{}-{}", std::process::id(), opts.channel);
    if let Ok(a) = listener.local_addr() {
        super::check_binding(a.ip());
    }
    let mut lane = match Lane::new(&agent) {
        Ok(l) => l,
        Err(e) => {
            return Err(refuse(
                &mut stream,
                &mut session,
                format!("NIXL on the far host: {e}"),
            ));
        }
    };
    let lost = |producer, reason: String| {
        tracing::error!("lane: channel {}: {reason}", opts.channel);
        Ok(Ended::Lost { producer, reason })
    };
    let md = match lane.local_md() {
        Ok(md) => md,
        Err(e) => return lost(producer, e.to_string()),
    };
    let credits = opts
        .credits
        .min(far_buffers.saturating_sub(1))
        .clamp(1, wire::MAX_CREDITS as usize);
    if let Err(e) = session.send(
        &mut stream,
        &Msg::Ready {
            agent: agent.clone(),
            buffer_bytes: buffer_bytes as u64,
            credits: credits as u32,
            md,
        },
    ) {
        return lost(producer, e.to_string());
    }
    tracing::info!(
        "lane: receiving into channel {} ({:?}) from {peer}",
        opts.channel,
        opts.place
    );
    let mut link = match Link::start(stream, session, &opts.lane) {
        Ok(l) => l,
        Err(e) => return lost(producer, e.to_string()),
    };
    let mut status = Status::new(Role::Recv, &opts.channel, &peer, opts.place);
    status.write();
    let r = pump(
        opts,
        &door,
        stop,
        &mut producer,
        &mut lane,
        &mut link,
        near,
        credits,
        frames,
        &mut status,
    );
    drop(link);
    drop(lane);
    status.remove();
    match r {
        Ok(Outcome::Upstream { closed: true, .. }) => {
            tracing::info!(
                "lane: the near channel was closed; closing {}",
                opts.channel
            );
            // Closing withdraws frames latest-only consumers have not taken: give the far
            // consumers (bounded) the time to reach the last frame first.
            let deadline = Instant::now() + opts.lane.handshake_timeout.min(Duration::from_secs(1));
            while Instant::now() < deadline && producer.stats().consumers.iter().any(|c| c.lag > 0)
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(Ended::Closed(producer.close(Duration::from_secs(5))))
        }
        Ok(Outcome::Upstream {
            closed: false,
            reason,
            ..
        }) => lost(producer, reason),
        Ok(Outcome::Stopped) => Ok(Ended::Stopped(producer)),
        Err(e) => lost(producer, e.to_string()),
    }
}

/// The most connections a receiving bridge greets at once (each on a thread of its own, for at
/// most [`LaneOptions::handshake_timeout`]); more are closed at once.
pub const MAX_HANDSHAKES: usize = 256;

/// Whether a far pool of `buffers` × `buffer_bytes` fits this host: in host memory, at most the
/// machine's physical memory (device memory is left to the allocation, whose failure is told to
/// the peer).
pub(super) fn fits(
    place: Place,
    buffers: usize,
    buffer_bytes: usize,
) -> std::result::Result<(), String> {
    let pool = (buffers as u128) * (buffer_bytes.next_multiple_of(4096) as u128);
    if place == Place::Host {
        // SAFETY: `sysconf` reads a system constant; no pointers.
        let (pages, page) = unsafe {
            (
                libc::sysconf(libc::_SC_PHYS_PAGES),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        let memory = (pages.max(0) as u128) * (page.max(0) as u128);
        if memory > 0 && pool > memory {
            return Err(format!(
                "a far pool of {buffers} buffers of {buffer_bytes} bytes ({pool} bytes) is larger \
                 than this host's memory ({memory} bytes)"
            ));
        }
    }
    Ok(())
}

/// A sending bridge that proved the secret, and its first sealed message (a channel's geometry,
/// a tensor set's layout: not yet checked).
pub(super) struct Arrival {
    pub(super) stream: TcpStream,
    pub(super) peer: String,
    pub(super) session: Session,
    pub(super) first: Msg,
}

/// The listener and the connections in their handshake: each is greeted on a thread of its own
/// against one deadline, and those that finish it come out of [`Door::next`].
pub(super) struct Door<'l> {
    listener: &'l TcpListener,
    secret: Secret,
    handshake: Duration,
    tx: mpsc::Sender<Arrival>,
    rx: mpsc::Receiver<Arrival>,
    /// Connections in their handshake: a count only (each thread lowers it as it ends), read to
    /// bound the threads; no other memory is published through it, so it is `Relaxed`.
    greeting: Arc<AtomicUsize>,
}

/// Lowers the count of connections in their handshake when a greeting thread ends, however.
struct Greeting(Arc<AtomicUsize>);

impl Drop for Greeting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<'l> Door<'l> {
    /// Greets connections on `listener` (made non-blocking) with `secret`, each handshake and
    /// first message within `handshake`.
    pub(super) fn open(
        listener: &'l TcpListener,
        secret: &Secret,
        handshake: Duration,
    ) -> Result<Door<'l>> {
        listener
            .set_nonblocking(true)
            .map_err(|e| RemoteError::Link(format!("listening: {e}")))?;
        let (tx, rx) = mpsc::channel();
        Ok(Door {
            listener,
            secret: secret.clone(),
            handshake,
            tx,
            rx,
            greeting: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Takes every connection waiting on the listener and greets each on a thread of its own;
    /// beyond [`MAX_HANDSHAKES`] in their handshake, a new one is closed at once.
    pub(super) fn admit(&self) {
        loop {
            let (s, addr) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // A connection reset before it was taken, or out of descriptors: logged, and
                    // the next turn tries again.
                    tracing::warn!("lane: accepting a connection: {e}");
                    return;
                }
            };
            if self.greeting.load(Ordering::Relaxed) >= MAX_HANDSHAKES {
                tracing::warn!(
                    "lane: closed {addr} at once: {MAX_HANDSHAKES} connections are in their \
                     handshake"
                );
                continue; // dropped: closed
            }
            self.greeting.fetch_add(1, Ordering::Relaxed);
            let guard = Greeting(self.greeting.clone());
            let secret = self.secret.clone();
            let tx = self.tx.clone();
            let deadline = Instant::now() + self.handshake;
            let spawned = std::thread::Builder::new()
                .name("lane-handshake".into())
                .stack_size(128 * 1024)
                .spawn(move || {
                    let _guard = guard;
                    match greet(s, addr, &secret, deadline) {
                        // The bridge took another sender (or returned) meanwhile: this one's
                        // connection closes here.
                        Ok(a) => drop(tx.send(a)),
                        Err(e @ Error::Remote(RemoteError::Refused(_))) => {
                            tracing::warn!("lane: refused {addr}: {e}");
                        }
                        Err(e) => tracing::warn!("lane: {addr} failed its handshake: {e}"),
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!("lane: closed {addr}: starting its handshake thread: {e}");
            }
        }
    }

    /// The next sender that finished its handshake, waiting up to `wait`.
    pub(super) fn next(&self, wait: Duration) -> Option<Arrival> {
        self.rx.recv_timeout(wait).ok()
    }

    /// Refuses every connection waiting on the listener with a `Refused` message saying the bridge
    /// serves another sender (their hello is not read, each write is bounded), and every sender
    /// that finished its handshake meanwhile (sealed).
    pub(super) fn turn_away(&self, channel: &str) {
        let reason = format!(
            "{}this bridge already serves a sender for {channel}",
            super::BUSY
        );
        while let Ok((mut s, addr)) = self.listener.accept() {
            let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = wire::send(
                &mut s,
                &Msg::Refused {
                    reason: reason.clone(),
                },
            );
            tracing::warn!("lane: turned away {addr}: a session for {channel} is running");
        }
        while let Ok(mut a) = self.rx.try_recv() {
            let _ = a.stream.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = a.session.send(
                &mut a.stream,
                &Msg::Refused {
                    reason: reason.clone(),
                },
            );
            tracing::warn!(
                "lane: turned away {}: a session for {channel} is running",
                a.peer
            );
        }
    }
}

/// Greets one connection: the handshake ([`wire::handshake_recv`]) and the sender's first
/// message (its channel's geometry, its tensor set's layout), all by `deadline`.
fn greet(
    mut s: TcpStream,
    addr: std::net::SocketAddr,
    secret: &Secret,
    deadline: Instant,
) -> Result<Arrival> {
    s.set_nonblocking(false)
        .map_err(|e| RemoteError::Link(format!("{addr}: {e}")))?;
    let _ = s.set_nodelay(true);
    let mut session = wire::handshake_recv(&mut s, secret, deadline)?;
    let left = deadline.saturating_duration_since(Instant::now());
    let first = session.recv(&mut s, left, "the sending bridge's first message")?;
    Ok(Arrival {
        stream: s,
        peer: addr.to_string(),
        session,
        first,
    })
}

enum Outcome {
    Upstream { closed: bool, reason: String },
    Stopped,
}

/// A far buffer lent to the sending bridge (credited), and its registered region.
struct Credited {
    frame: LentFrame,
    region: Region,
    /// Its WRITE's notification, once it came (it is published once every buffer credited
    /// before it is).
    note: Option<FrameNote>,
}

/// Records notification `n` for the credited buffer it names (the oldest credited one with that
/// index still waiting: a buffer is credited again only once published).
///
/// # Errors
/// [`RemoteError::Protocol`] for a buffer not credited (or notified twice) and for a frame longer
/// than its buffer.
fn note_arrived(lent: &mut VecDeque<Credited>, n: FrameNote) -> Result<()> {
    let Some(c) = lent
        .iter_mut()
        .find(|c| c.note.is_none() && c.frame.index() == n.index as usize)
    else {
        return Err(RemoteError::Protocol(format!(
            "a frame's notification for buffer {}, which is not credited",
            n.index
        ))
        .into());
    };
    if n.len > c.region.len as u64 {
        return Err(RemoteError::Protocol(format!(
            "a frame of {} for buffer {} of {}",
            crate::error::bytes(n.len),
            n.index,
            crate::error::bytes(c.region.len)
        ))
        .into());
    }
    c.note = Some(n);
    Ok(())
}

/// The oldest credited buffer, with its notification, once it came: buffers are published in the
/// order they were credited (the order the sender wrote them in), whatever order their WRITEs
/// completed in.
fn next_in_order(lent: &mut VecDeque<Credited>) -> Option<(LentFrame, FrameNote)> {
    lent.front()?.note.as_ref()?;
    let c = lent.pop_front()?;
    Some((c.frame, c.note?))
}

/// What the pump knows of the sending bridge's WRITEs and of the session's end.
struct Flow {
    /// A WRITE was announced ([`Msg::Posting`]) at this instant and its notification has not come.
    posted: Option<Instant>,
    /// The last notification, credit or announcement: the pump polls without a pause for
    /// [`LaneOptions::spin`] (at least twice [`wire::POSTING_AFTER`]) after it.
    hot: Instant,
    /// The sender's end of the session, told while frames were still on their way, and when.
    ending: Option<(Outcome, u64, Instant)>,
}

/// Takes one control message: `Ok(Some)` ends the session now.
fn on_message(m: Msg, flow: &mut Flow, session: u64) -> Result<Option<Outcome>> {
    match m {
        Msg::Posting { .. } => {
            flow.posted = Some(Instant::now());
            flow.hot = Instant::now();
            Ok(None)
        }
        Msg::Upstream {
            closed,
            sent,
            reason,
        } => {
            let o = Outcome::Upstream { closed, reason };
            if sent <= session {
                // Nothing on its way: the credited buffers are given back unwritten.
                return Ok(Some(o));
            }
            flow.ending = Some((o, sent, Instant::now()));
            Ok(None)
        }
        m => Err(unexpected(&m, "an upstream message")),
    }
}

#[allow(clippy::too_many_arguments)]
fn pump(
    opts: &RecvOptions,
    door: &Door<'_>,
    stop: &AtomicBool,
    producer: &mut Producer,
    lane: &mut Lane,
    link: &mut Link,
    near: Place,
    credits: usize,
    frames: &mut u64,
    status: &mut Status,
) -> Result<Outcome> {
    let mut reported = false;
    let mut last_status = Instant::now();
    // Frames published in this session (what the sender's `sent` counts).
    let mut session = 0u64;
    // Credited far buffers, oldest first: the sender writes them in this order. Dropped on
    // return, they go back to the far pool unpublished.
    let mut lent: VecDeque<Credited> = VecDeque::with_capacity(credits);
    // Far buffers taken to lend whose last readers may still read them on their GPUs, oldest
    // first: credited once free.
    let mut freeing: VecDeque<LentFrame> = VecDeque::with_capacity(credits);
    let hot_for = opts.lane.spin.max(2 * wire::POSTING_AFTER);
    let mut flow = Flow {
        posted: None,
        hot: Instant::now(),
        ending: None,
    };
    let mut naps = 0u32;
    let mut next_turn_away = Instant::now();
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(Outcome::Stopped);
        }
        // 0. Peers that connect while this session runs are told at once (every 100 ms) that the
        // bridge is busy, instead of waiting in the listen backlog for a handshake timeout.
        if Instant::now() >= next_turn_away {
            next_turn_away = Instant::now() + Duration::from_millis(100);
            door.turn_away(&format!("channel {}", opts.channel));
        }
        // 1. Control messages.
        while flow.ending.is_none() {
            let Some(m) = link.next(Duration::ZERO)? else {
                break;
            };
            if let Some(o) = on_message(m, &mut flow, session)? {
                return Ok(o);
            }
        }
        if let Some((_, _, since)) = &flow.ending
            && since.elapsed() > opts.lane.write_timeout
        {
            return Err(
                RemoteError::Protocol("the last frame's notification never came".into()).into(),
            );
        }
        // 2. Notifications. WRITEs in flight at once may complete, and so notify, in any
        // order; the frames are published in the order their buffers were credited (the order
        // the sender wrote them in, its frames' order).
        if !lent.is_empty() {
            for (_, text) in lane.take_notifications()? {
                note_arrived(&mut lent, FrameNote::decode(&text)?)?;
                flow.posted = None;
                flow.hot = Instant::now();
                naps = 0;
            }
            while let Some((frame, n)) = next_in_order(&mut lent) {
                producer.resume(frame)?.publish(&n.meta)?;
                *frames += 1;
                session += 1;
                if let Some((_, sent, _)) = &flow.ending
                    && session >= *sent
                    && let Some((o, _, _)) = flow.ending.take()
                {
                    return Ok(o);
                }
                if !reported || last_status.elapsed() > Duration::from_secs(1) {
                    if !reported {
                        reported = true;
                        if let Some(t) = report::from_ucx_log(near, opts.place) {
                            t.log("recv");
                            status.transport = Some(t);
                        }
                    }
                    status.frames = *frames;
                    status.write();
                    last_status = Instant::now();
                }
            }
        } else if flow.ending.is_some() {
            return Err(RemoteError::Protocol(format!(
                "the sender counts more frames than it had credits for ({session} published)"
            ))
            .into());
        }
        // 3. Credits: far buffers lent ahead, up to `credits`. A buffer is taken (`lend`) and
        // credited once its last readers finished with it on their GPUs (its release words,
        // read on the host: no stream is synchronised). With none taken, wait for one (the far
        // consumers hold every buffer: back-pressure), bounded so that control messages are
        // read meanwhile.
        while flow.ending.is_none() && lent.len() + freeing.len() < credits {
            let wait = if lent.is_empty() && freeing.is_empty() {
                Duration::from_millis(50)
            } else {
                Duration::ZERO
            };
            match producer.lend(Some(wait))? {
                Some(l) => freeing.push_back(l),
                None => break,
            }
        }
        // Credited in the order taken (the order they are published in).
        while flow.ending.is_none() && freeing.front_mut().is_some_and(|l| l.is_free()) {
            let Some(frame) = freeing.pop_front() else {
                break;
            };
            let index = frame.index() as u32;
            let (addr, len) = producer.buffer_address(frame.index());
            let region = Region {
                addr,
                len,
                place: opts.place,
            };
            // The far peer writes it only while lent (a credit names one lent buffer, free of
            // readers); consumers read it only once published. SAFETY: a buffer of the
            // producer's pool, mapped until the producer drops, after the lane (`serve` drops
            // the lane first).
            let fresh = unsafe { lane.register(index, region)? };
            let md = if fresh { lane.local_md()? } else { Vec::new() };
            let (kind, device) = opts.place.code();
            link.send(&Msg::Credit {
                index,
                addr: region.addr,
                len: region.len as u64,
                kind,
                device,
                md,
            })?;
            lent.push_back(Credited {
                frame,
                region,
                note: None,
            });
            flow.hot = Instant::now();
        }
        // 4. Pace the polls: without a pause while a WRITE was announced or the lane was busy
        // lately (UCX's TCP transport moves data only while both ends poll); then waiting on the
        // control connection (an announced WRITE ends the wait at once), up to a nap that grows
        // from 50 us to 1 ms, so that an idle lane costs no core.
        if lent.is_empty() && freeing.is_empty() {
            continue; // the lend above waited
        }
        let posted = flow
            .posted
            .is_some_and(|t| t.elapsed() < opts.lane.write_timeout);
        if posted || flow.hot.elapsed() < hot_for || flow.ending.is_some() {
            std::hint::spin_loop();
            continue;
        }
        naps = naps.saturating_add(1);
        let nap = Duration::from_micros(50u64 << naps.min(5).saturating_sub(1))
            .min(Duration::from_millis(1));
        if let Some(m) = link.next(nap)?
            && let Some(o) = on_message(m, &mut flow, session)?
        {
            return Ok(o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::{Consumer, ConsumerOptions};

    fn note(index: u32, seq: u64) -> FrameNote {
        FrameNote {
            index,
            seq,
            len: 64,
            meta: seq.to_le_bytes().to_vec(),
        }
    }

    #[test]
    fn notifications_in_any_order_publish_in_credit_order_and_strays_are_refused() {
        let ch = format!("recv-order-unit-{}", std::process::id());
        let mut tx = Producer::create_host(&ch, &ChannelOptions::new(64).buffers(4)).unwrap();
        let rx = Consumer::attach(&ch, &ConsumerOptions::new()).unwrap();
        let mut lent = VecDeque::new();
        for _ in 0..3 {
            let frame = tx.lend(Some(Duration::ZERO)).unwrap().unwrap();
            let (addr, len) = tx.buffer_address(frame.index());
            lent.push_back(Credited {
                frame,
                region: Region {
                    addr,
                    len,
                    place: Place::Host,
                },
                note: None,
            });
        }
        let idx: Vec<u32> = lent.iter().map(|c| c.frame.index() as u32).collect();
        // The third WRITE completes first, then the first: only the first is published.
        note_arrived(&mut lent, note(idx[2], 3)).unwrap();
        assert!(next_in_order(&mut lent).is_none(), "the first credit waits");
        note_arrived(&mut lent, note(idx[0], 1)).unwrap();
        let (f, n) = next_in_order(&mut lent).unwrap();
        assert_eq!((f.index() as u32, n.seq), (idx[0], 1));
        tx.resume(f).unwrap().publish(&n.meta).unwrap();
        assert!(
            next_in_order(&mut lent).is_none(),
            "the second has not come"
        );
        // A notification for a buffer not credited, or twice for one, breaks the protocol.
        let stray = (0..4u32).find(|i| !idx.contains(i)).unwrap();
        assert!(matches!(
            note_arrived(&mut lent, note(stray, 9)),
            Err(Error::Remote(RemoteError::Protocol(_)))
        ));
        assert!(note_arrived(&mut lent, note(idx[2], 3)).is_err());
        let mut long = note(idx[1], 2);
        long.len = 65;
        assert!(note_arrived(&mut lent, long).is_err());
        note_arrived(&mut lent, note(idx[1], 2)).unwrap();
        for want in [2u64, 3] {
            let (f, n) = next_in_order(&mut lent).unwrap();
            assert_eq!(n.seq, want);
            tx.resume(f).unwrap().publish(&n.meta).unwrap();
        }
        // The consumer sees the frames in the sender's order.
        for want in 1u64..=3 {
            let f = rx.recv_timeout(Duration::from_secs(1)).unwrap();
            assert_eq!(f.metadata(), &want.to_le_bytes()[..]);
        }
    }
}
