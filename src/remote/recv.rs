//! The receiving bridge, on the consumers' host: the far channel's [`Producer`], whose buffers the
//! sending bridge WRITEs into; it publishes each one when the WRITE's notification arrives.

use super::link::Link;
use super::nixl::{Lane, Place, Region, pause};
use super::report::{self, Role, Status};
use super::send::unexpected;
use super::wire::{self, FrameNote, Msg, PROTOCOL_VERSION, Secret};
use super::{LaneOptions, RemoteError};
use crate::channel::{ChannelOptions, Producer};
use crate::driver::{Context, Device, DeviceMemory as _};
use crate::error::{Error, Result};
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
            lane: LaneOptions::default(),
        }
    }
}

/// How a receiving bridge's session ended.
#[derive(Debug)]
#[non_exhaustive]
pub enum Ended {
    /// The near producer closed its channel; the far channel was closed (its consumers get
    /// [`Error::ChannelClosed`] once they received every frame). Holds what [`Producer::close`]
    /// reported, or its error.
    Closed(Result<crate::channel::ShutdownReport>),
    /// The near producer, the sending bridge or the link died, or the lane failed. `producer` is
    /// the far channel's producer, still open: end the process without dropping it
    /// (`std::process::exit`) and far consumers get [`Error::ProducerGone`] within the liveness
    /// period; dropping it closes the channel instead ([`Error::ChannelClosed`]). A restarted
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
    let mut copts = ChannelOptions::new(buffer_bytes)
        .buffers(opts.buffers.unwrap_or(buffers as usize))
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
    if let Err(e) = wire::send(
        &mut stream,
        &Msg::Ready {
            agent: agent.clone(),
            buffer_bytes: buffer_bytes as u64,
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
        stop,
        &mut producer,
        &mut lane,
        &mut link,
        near,
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
    Upstream {
        closed: bool,
        sent: u64,
        reason: String,
    },
    Stopped,
}

fn control(link: &mut Link) -> Result<Option<Outcome>> {
    match link.next(Duration::ZERO)? {
        None => Ok(None),
        Some(m) => control_msg(m),
    }
}

/// An upstream message as the outcome it ends the session with; a posting hint that its
/// notification overtook is nothing; anything else breaks the protocol.
fn control_msg(m: Msg) -> Result<Option<Outcome>> {
    match m {
        Msg::Posting { .. } => Ok(None),
        Msg::Upstream {
            closed,
            sent,
            reason,
        } => Ok(Some(Outcome::Upstream {
            closed,
            sent,
            reason,
        })),
        m => Err(unexpected(&m, "an upstream message")),
    }
}

#[allow(clippy::too_many_arguments)]
fn pump(
    opts: &RecvOptions,
    stop: &AtomicBool,
    producer: &mut Producer,
    lane: &mut Lane,
    link: &mut Link,
    near: Place,
    frames: &mut u64,
    status: &mut Status,
) -> Result<Outcome> {
    let mut reported = false;
    let mut last_status = Instant::now();
    // Frames published in this session (what the sender's `sent` counts).
    let mut session = 0u64;
    loop {
        // 1. A free far buffer (waiting for far consumers, as any producer).
        let w = loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(Outcome::Stopped);
            }
            if let Some(o) = control(link)? {
                return Ok(o);
            }
            match producer.acquire(Some(Duration::from_millis(50))) {
                Ok(w) => break w,
                Err(Error::Timeout { .. }) => {}
                Err(e) => return Err(e),
            }
        };
        let index = w.index() as u32;
        let region = match opts.place {
            Place::Host => Region {
                addr: w.as_mut_ptr() as u64,
                len: w.len(),
                place: opts.place,
            },
            Place::Device(_) => Region {
                addr: w.buffer().device_ptr(),
                len: w.len(),
                place: opts.place,
            },
        };
        // SAFETY: the region is a buffer of the producer's pool, mapped until the producer is
        // dropped, which happens after the lane (`serve` drops the lane first); the far peer
        // writes it only while this bridge holds it acquired (a credit names one acquired
        // buffer), and consumers read it only after it is published.
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
        // 2. The WRITE's notification. An end told meanwhile waits for the frame still on its way
        // (the sender wrote `sent` frames; its notification may come after the message).
        let (mut waited, mut naps) = (Instant::now(), 0u32);
        let mut ending = None;
        let mut posted = false;
        let note = loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(Outcome::Stopped);
            }
            if ending.is_none() {
                let m = match link.next(Duration::ZERO)? {
                    Some(Msg::Posting { index: i }) if i == index => {
                        // The data is on its way: poll without a pause until it is here.
                        posted = true;
                        None
                    }
                    Some(m) => control_msg(m)?,
                    None => None,
                };
                match m {
                    Some(o @ Outcome::Upstream { sent, .. }) if sent <= session => {
                        // Nothing on its way: the credited buffer is given back unwritten.
                        return Ok(o);
                    }
                    Some(o @ Outcome::Stopped) => return Ok(o),
                    Some(o) => {
                        ending = Some(o);
                        waited = Instant::now();
                    }
                    None => {}
                }
            } else if waited.elapsed() > opts.lane.write_timeout {
                return Err(RemoteError::Protocol(
                    "the last frame's notification never came".into(),
                )
                .into());
            }
            let mut notes = lane.take_notifications()?;
            if notes.len() > 1 {
                return Err(RemoteError::Protocol(format!(
                    "{} notifications for one credit",
                    notes.len()
                ))
                .into());
            }
            if let Some((_, text)) = notes.pop() {
                let n = FrameNote::decode(&text)?;
                if n.index != index || n.len > region.len as u64 {
                    return Err(RemoteError::Protocol(format!(
                        "a frame of {} bytes for buffer {} where buffer {index} of {} bytes was \
                         credited",
                        n.len, n.index, region.len
                    ))
                    .into());
                }
                break n;
            }
            if posted {
                std::hint::spin_loop();
            } else {
                pause(waited, opts.lane.spin, &mut naps);
            }
        };
        w.publish(&note.meta)?;
        *frames += 1;
        session += 1;
        if let Some(o) = ending {
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
}
