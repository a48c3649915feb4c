//! The receiving bridge, on the consumers' host: the far channel's [`Producer`], whose buffers the
//! sending bridge WRITEs into; it publishes each one when the WRITE's notification arrives.

use super::link::Link;
use super::nixl::{Lane, Place, Region};
use super::report::{self, Role, Status};
use super::send::unexpected;
use super::wire::{self, FrameNote, Msg, PROTOCOL_VERSION, Secret};
use super::{LaneOptions, RemoteError};
use crate::channel::{ChannelOptions, LentFrame, Producer};
use crate::driver::{Context, Device};
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
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

/// How a receiving bridge's session ended.
#[derive(Debug)]
#[non_exhaustive]
pub enum Ended {
    /// The near producer closed its channel; the far channel was closed (its consumers get
    /// [`ChannelError::Closed`] once they received every frame). Holds what [`Producer::close`]
    /// reported, or its error.
    Closed(Result<crate::channel::ShutdownReport>),
    /// The near producer, the sending bridge or the link died, or the lane failed. `producer` is
    /// the far channel's producer, still open: end the process without dropping it
    /// (`std::process::exit`) and far consumers get [`ChannelError::ProducerGone`] within the liveness
    /// period; dropping it closes the channel instead ([`ChannelError::Closed`]). A restarted
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

/// Waits on `listener` for a sending bridge that presents the secret (others are refused and
/// logged, and waiting goes on), then creates the far channel with the near channel's geometry,
/// registers its buffers with NIXL as it acquires them, and publishes the frames written into
/// them, until the session ends (see [`Ended`]). Accepts one session; a lost session ends the
/// call.
///
/// # Errors
/// Before the far channel exists: the errors of [`Producer::create_host`] and
/// [`Producer::create`] (a live producer already serving the name is
/// [`crate::channel::ChannelError::AlreadyExists`]); [`Error::Unsupported`] when NIXL is not
/// installed (checked first); [`Error::Timeout`] when `stop` was set while waiting; a refused
/// peer or one that fails its handshake (each step bounded by [`LaneOptions::handshake_timeout`])
/// is logged and the next one awaited. Once the far channel exists, every failure is
/// [`Ended::Lost`], and a NIXL agent that cannot be made is told to the peer and returned as
/// [`RemoteError::Refused`].
pub fn serve(
    opts: &RecvOptions,
    listener: &TcpListener,
    stop: &AtomicBool,
    frames: &mut u64,
) -> Result<Ended> {
    super::nixl::probe()?;
    let hs = opts.lane.handshake_timeout;
    // Until a peer that presented the secret names its channel, a failed peer is logged and
    // the next one awaited.
    let (mut stream, peer, buffers, buffer_bytes, kind) = loop {
        if stop.load(Ordering::Relaxed) {
            return Err(Error::Timeout {
                what: "a sending bridge (stopped)",
                after: Duration::ZERO,
            });
        }
        let (mut s, peer) = match accept(listener, opts, hs) {
            Ok(Some(x)) => x,
            Ok(None) => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => {
                tracing::warn!("lane: refused a peer: {e}");
                continue;
            }
        };
        match wire::recv(&mut s, hs, "the near channel's geometry") {
            Ok(Msg::Channel {
                buffers,
                buffer_bytes,
                kind,
                agent: _,
            }) => break (s, peer, buffers, buffer_bytes, kind),
            Ok(m) => tracing::warn!("lane: {peer}: {}", unexpected(&m, "the near channel")),
            Err(e) => tracing::warn!("lane: {peer} left before naming its channel: {e}"),
        }
    };
    let refuse = |stream: &mut TcpStream, why: String| -> Error {
        let _ = wire::send(
            stream,
            &Msg::Refused {
                reason: why.clone(),
            },
        );
        RemoteError::Refused(why).into()
    };
    let Ok(buffer_bytes) = usize::try_from(buffer_bytes) else {
        return Err(refuse(
            &mut stream,
            format!("buffers of {buffer_bytes} bytes"),
        ));
    };
    let far_buffers = opts.buffers.unwrap_or(buffers as usize);
    let mut copts = ChannelOptions::new(buffer_bytes)
        .buffers(far_buffers)
        .max_consumers(opts.max_consumers);
    // UCX's CUDA transports work in the thread's current context: the far pool's (the device's
    // primary context) is current for the whole session, NIXL's backend creation included; it is
    // left after the lane (declared before it, so dropped after it) is gone.
    let gpu_ctx: Option<std::sync::Arc<Context>> = match opts.place {
        Place::Host => None,
        Place::Device(d) => match Device::get(d as usize).and_then(|dev| dev.primary_context()) {
            Ok(c) => Some(c),
            Err(e) => return Err(refuse(&mut stream, format!("device {d}: {e}"))),
        },
    };
    let _current = gpu_ctx.as_ref().map(|c| c.enter()).transpose()?;
    let producer = match &gpu_ctx {
        None => Producer::create_host(&opts.channel, &copts),
        Some(ctx) => {
            copts = copts.memory(crate::channel::MemoryKind::Auto);
            Producer::create(ctx, &opts.channel, &copts)
        }
    };
    let mut producer = match producer {
        Ok(p) => Box::new(p),
        Err(e) => return Err(refuse(&mut stream, format!("the far channel: {e}"))),
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
        Err(e) => return Err(refuse(&mut stream, format!("NIXL on the far host: {e}"))),
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
    if let Err(e) = wire::send(
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
    let mut link = match Link::start(stream, &opts.lane) {
        Ok(l) => l,
        Err(e) => return lost(producer, e.to_string()),
    };
    let mut status = Status::new(Role::Recv, &opts.channel, &peer, opts.place);
    status.write();
    let r = pump(
        opts,
        listener,
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

/// Refuses every connection waiting on `listener` (nonblocking) with a `Refused` message saying
/// the bridge serves another sender; the peer's hello is not read, and each write is bounded.
fn turn_away(listener: &TcpListener, channel: &str) {
    if listener.set_nonblocking(true).is_err() {
        return;
    }
    while let Ok((mut s, addr)) = listener.accept() {
        let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
        let reason = format!("busy: this bridge already serves a sender for channel {channel}");
        let _ = wire::send(&mut s, &Msg::Refused { reason });
        tracing::warn!("lane: turned away {addr}: a session for channel {channel} is running");
    }
}

/// Accepts one connection if one waits and runs the handshake: `Ok(None)` when none waits,
/// `Ok(Some)` for a peer that presented the secret and our version, `Err` for one refused.
fn accept(
    listener: &TcpListener,
    opts: &RecvOptions,
    hs: Duration,
) -> Result<Option<(TcpStream, String)>> {
    listener
        .set_nonblocking(true)
        .map_err(|e| RemoteError::Link(format!("listening: {e}")))?;
    let (mut s, addr) = match listener.accept() {
        Ok(x) => x,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
        Err(e) => return Err(RemoteError::Link(format!("accepting: {e}")).into()),
    };
    s.set_nonblocking(false)
        .map_err(|e| RemoteError::Link(format!("{addr}: {e}")))?;
    let _ = s.set_nodelay(true);
    let _ = s.set_write_timeout(Some(hs));
    match wire::recv(&mut s, hs, "the peer's hello")? {
        Msg::Hello { version, secret } => {
            if !opts.secret.matches(&secret) {
                let _ = wire::send(
                    &mut s,
                    &Msg::Refused {
                        reason: "wrong secret".into(),
                    },
                );
                return Err(
                    RemoteError::Refused(format!("{addr} presented a wrong secret")).into(),
                );
            }
            if version != PROTOCOL_VERSION {
                let why =
                    format!("protocol version {version}; this bridge speaks {PROTOCOL_VERSION}");
                let _ = wire::send(
                    &mut s,
                    &Msg::Refused {
                        reason: why.clone(),
                    },
                );
                return Err(RemoteError::Refused(format!("{addr}: {why}")).into());
            }
        }
        m => return Err(unexpected(&m, "a hello")),
    }
    wire::send(
        &mut s,
        &Msg::Welcome {
            version: PROTOCOL_VERSION,
        },
    )?;
    Ok(Some((s, addr.to_string())))
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
            "a frame of {} bytes for buffer {} of {} bytes",
            n.len, n.index, c.region.len
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
    listener: &TcpListener,
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
            turn_away(listener, &opts.channel);
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
