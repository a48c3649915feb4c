//! The sending bridge, on the producer's host: a [`Consumer`] of the near channel that WRITEs each
//! frame it receives into a far buffer the receiving bridge credited.

use super::link::Link;
use super::nixl::{Lane, Place, Region, Target, Write};
use super::report::{self, Role, Status};
use super::wire::{self, FrameNote, MAX_CREDITS, Msg, POSTING_AFTER, Secret};
use super::{LaneOptions, RemoteError};
use crate::channel::inspect;
use crate::channel::{Consumer, ConsumerOptions, Delivery, Frame, WaitStrategy};
use crate::driver::DeviceMemory as _;
use crate::error::{Error, Result};
use crate::identity::Liveness;
use std::collections::VecDeque;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How a sending bridge runs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SendOptions {
    /// The near channel (on this host) whose frames are sent.
    pub channel: String,
    /// The receiving bridge's control address, `HOST:PORT`.
    pub connect: String,
    /// The shared secret the receiving bridge expects.
    pub secret: Secret,
    /// The bridge's delivery policy as a consumer of the near channel: every frame (the near
    /// producer waits for the far consumers, end to end) or the latest (frames the lane cannot
    /// carry in time are dropped on this host). Default every frame.
    pub delivery: Delivery,
    /// Timeouts and periods.
    pub lane: LaneOptions,
}

impl SendOptions {
    /// Options for sending `channel` to `connect` with `secret`, every frame, default timeouts.
    pub fn new(channel: &str, connect: &str, secret: Secret) -> SendOptions {
        SendOptions {
            channel: channel.to_string(),
            connect: connect.to_string(),
            secret,
            delivery: Delivery::EveryFrame,
            lane: LaneOptions::default(),
        }
    }
}

/// How a sending bridge's session ended without an error.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ended {
    /// The near producer closed the channel; the far channel was told to close.
    Closed,
    /// The near producer died; the far bridge was told.
    ProducerGone,
    /// `stop` was set.
    Stopped,
}

/// What a session carried, for logs and tests.
#[derive(Clone, Debug, Default)]
pub struct Totals {
    /// Frames written to the far side.
    pub frames: u64,
    /// What UCX reported of the transport it chose, once seen.
    pub transport: Option<report::Transport>,
}

/// Connects to the receiving bridge (every address `connect` resolves to, each within
/// [`LaneOptions::connect_timeout`]).
///
/// # Errors
/// [`Error::InvalidArgument`] when `connect` does not resolve; [`RemoteError::Link`] when no
/// address accepted the connection.
pub fn connect(connect: &str, lane: &LaneOptions) -> Result<TcpStream> {
    let addrs: Vec<_> = connect
        .to_socket_addrs()
        .map_err(|e| Error::InvalidArgument(format!("lane address {connect}: {e}")))?
        .collect();
    let mut last = format!("{connect} resolves to no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, lane.connect_timeout) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = format!("connecting to {a}: {e}"),
        }
    }
    Err(RemoteError::Link(last).into())
}

/// Runs one session: connects ([`connect`]), proves the secret and checks the receiving bridge's
/// proof ([`wire::handshake_send`], whole within [`LaneOptions::handshake_timeout`]), attaches to
/// the near channel, creates the NIXL agent, exchanges metadata (sealed, as every later message),
/// and then sends frames until the near channel ends,
/// `stop` is set, or the link fails. Detaches from the near channel before returning, so a bridge
/// that lost its link never holds the near producer back; call again to resume (a restarted
/// receiving bridge accepts the new session; the near producer keeps running).
///
/// # Errors
/// As [`connect`]; [`RemoteError::Refused`] (wrong secret, other protocol version, a receiving
/// bridge busy with another sender or refusing the geometry, one that failed to prove the secret)
/// and [`RemoteError::Protocol`]; [`Error::Timeout`] for a handshake over
/// [`LaneOptions::handshake_timeout`] (or the metadata step after it); the errors of
/// [`Consumer::attach`]; [`Error::Unsupported`] when NIXL is not installed; [`RemoteError::Nixl`] from NIXL calls; [`RemoteError::Link`] when
/// the link is lost mid-session.
pub fn serve(opts: &SendOptions, stop: &AtomicBool, totals: &mut Totals) -> Result<Ended> {
    super::nixl::probe()?;
    let hs = opts.lane.handshake_timeout;
    let mut stream = connect(&opts.connect, &opts.lane)?;
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| opts.connect.clone());
    let mut session = wire::handshake_send(&mut stream, &opts.secret, Instant::now() + hs)?;
    // The next near frame is waited for as the lane's other polls are: without a pause for
    // `spin`, then asleep on the channel's futex.
    let consumer = Consumer::attach(
        &opts.channel,
        &ConsumerOptions::new()
            .delivery(opts.delivery)
            .wait(WaitStrategy::SpinThenBlock(opts.lane.spin)),
    )?;
    // Its slot's `transport` word: this consumer sends its frames to another host.
    consumer.mark_bridged();
    let place = if consumer.is_host() {
        Place::Host
    } else {
        Place::Device(consumer.context()?.device().ordinal() as u32)
    };
    // UCX's CUDA transports work in the thread's current context: the consumer's (the device's
    // primary context) is current for the whole session, NIXL's backend creation included; it is
    // left after the lane (declared before it) is gone.
    let gpu_ctx = consumer.context().ok().cloned();
    let _current = gpu_ctx.as_ref().map(|c| c.enter()).transpose()?;
    let (buffers, buffer_bytes) = geometry(&opts.channel)?;
    let agent = format!("cuda-ipc-send-{}-{}", std::process::id(), opts.channel);
    if let Ok(a) = stream.local_addr() {
        super::check_binding(a.ip());
    }
    let mut lane = Lane::new(&agent)?;
    session.send(
        &mut stream,
        &Msg::Channel {
            buffers,
            buffer_bytes,
            kind: place.code().0,
            agent: agent.clone(),
        },
    )?;
    let (remote, credits) = match session.recv(&mut stream, hs, "the far channel's metadata")? {
        Msg::Ready {
            agent: _,
            buffer_bytes: far,
            credits,
            md,
        } => {
            if far < buffer_bytes {
                return Err(RemoteError::Protocol(format!(
                    "far buffers of {} cannot take frames of {}",
                    crate::error::bytes(far),
                    crate::error::bytes(buffer_bytes)
                ))
                .into());
            }
            if credits == 0 || credits > MAX_CREDITS {
                return Err(RemoteError::Protocol(format!(
                    "{credits} credits outstanding (1 to {MAX_CREDITS} allowed)"
                ))
                .into());
            }
            (lane.load_remote(&md)?, credits as usize)
        }
        Msg::Refused { reason } => return Err(RemoteError::refused(reason).into()),
        m => return Err(unexpected(&m, "the far channel's metadata")),
    };
    tracing::info!(
        "lane: sending channel {} ({buffers} buffers of {}, {place:?}) to {peer} (NIXL agent \
         {remote})",
        opts.channel,
        crate::error::bytes(buffer_bytes)
    );
    let mut link = Link::start(stream, session, &opts.lane)?;
    let mut status = Status::new(Role::Send, &opts.channel, &peer, place);
    status.write();
    let mut credits = Credits {
        queue: VecDeque::with_capacity(credits),
        most: credits,
    };
    let r = pump(
        opts,
        stop,
        &consumer,
        &mut lane,
        &mut link,
        &remote,
        place,
        &mut credits,
        totals,
        &mut status,
    );
    lane.forget_remote(&remote);
    status.remove();
    r
}

/// What waiting for the next near frame gave (a stack value of one loop turn, never stored: the
/// frame's size is no cost).
#[allow(clippy::large_enum_variant)]
enum Got<'c> {
    Frame(Frame<'c>),
    End(Ended),
}

/// The far buffers credited and not yet written, oldest first (the order they are written in).
struct Credits {
    queue: VecDeque<(u32, Target)>,
    /// How many the receiving bridge keeps outstanding at most ([`Msg::Ready`]).
    most: usize,
}

/// Takes a credit message into `credits` (its metadata loaded when it carries some); anything
/// else, a credit over the agreed count, or one naming a buffer already credited, breaks the
/// protocol.
fn take_credit(m: Msg, lane: &mut Lane, credits: &mut Credits) -> Result<()> {
    match m {
        Msg::Credit {
            index,
            addr,
            len,
            kind,
            device,
            md,
        } if credits.queue.len() < credits.most
            && !credits.queue.iter().any(|(i, _)| *i == index) =>
        {
            if !md.is_empty() {
                lane.load_remote(&md)?;
            }
            let Some(place) = Place::from_code(kind, device) else {
                return Err(RemoteError::Protocol(format!("memory kind {kind}")).into());
            };
            credits
                .queue
                .push_back((index, Target { addr, len, place }));
            Ok(())
        }
        m => Err(unexpected(
            &m,
            &format!("a credit for another buffer (at most {})", credits.most),
        )),
    }
}

/// The WRITEs in flight, oldest first, each with the near frame it reads (held, so the near
/// producer stays off the buffer, until the WRITE completed).
struct Flight<'c> {
    queue: VecDeque<(Frame<'c>, Write)>,
    /// When the last WRITE completed: one posted more than [`POSTING_AFTER`] later, with none in
    /// flight, is announced.
    last_done: Option<Instant>,
}

/// What the pump reports as it goes.
struct Report<'a> {
    place: Place,
    totals: &'a mut Totals,
    status: &'a mut Status,
    last_status: Instant,
}

impl Report<'_> {
    /// Counts a completed WRITE (its frame is already dropped); the first one reads UCX's report
    /// of the transport, and the status file is rewritten at most once a second.
    fn done(&mut self, target: Place) {
        self.totals.frames += 1;
        if self.totals.frames == 1 {
            // UCX printed its choice for the WRITE when it made it: read it once.
            self.totals.transport = report::from_ucx_log(self.place, target);
            match &self.totals.transport {
                Some(t) => {
                    t.log("send");
                    self.status.transport = Some(t.clone());
                }
                None => tracing::info!(
                    "lane (send): no UCX protocol report to read (UCX_PROTO_INFO=y and \
                     UCX_LOG_FILE make one)"
                ),
            }
        }
        if self.totals.frames == 1 || self.last_status.elapsed() > Duration::from_secs(1) {
            self.status.frames = self.totals.frames;
            self.status.write();
            self.last_status = Instant::now();
        }
    }
}

/// Retires the WRITEs in flight that completed, oldest first, dropping their frames (which
/// releases the near buffers); with `all`, waits for every one (polling without a pause: the
/// transfers advance only while polled).
fn retire(
    lane: &mut Lane,
    flight: &mut Flight<'_>,
    report: &mut Report<'_>,
    target: Place,
    timeout: Duration,
    all: bool,
) -> Result<()> {
    while let Some((_, w)) = flight.queue.front_mut() {
        if !lane.poll(w, timeout)? {
            if all {
                std::hint::spin_loop();
                continue;
            }
            break;
        }
        // Completed: the WRITE read the buffer for the last time.
        drop(flight.queue.pop_front());
        flight.last_done = Some(Instant::now());
        report.done(target);
    }
    Ok(())
}

/// The lane's state for the pump's helpers.
struct Pump<'p, 'c> {
    opts: &'p SendOptions,
    stop: &'p AtomicBool,
    consumer: &'c Consumer,
    lane: &'p mut Lane,
    link: &'p mut Link,
    credits: &'p mut Credits,
    flight: Flight<'c>,
    report: Report<'p>,
    /// The memory kind of the far buffers (for the transport report).
    far: Place,
}

impl<'c> Pump<'_, 'c> {
    fn retire(&mut self, all: bool) -> Result<()> {
        retire(
            self.lane,
            &mut self.flight,
            &mut self.report,
            self.far,
            self.opts.lane.write_timeout,
            all,
        )
    }

    /// Ends the session upstream: the WRITEs in flight complete first, so that `sent` counts
    /// every frame whose notification is on its way.
    fn upstream(&mut self, closed: bool, reason: &str) -> Result<Ended> {
        self.retire(true)?;
        upstream(self.link, closed, reason, self.report.totals.frames)
    }

    /// Waits for the next near frame and its bytes (on the host: NIXL knows no stream; credits
    /// that arrive meanwhile are kept, and WRITEs in flight are polled and retired).
    fn wait_frame(&mut self) -> Result<Got<'c>> {
        let bytes = self.opts.lane.write_timeout;
        loop {
            if self.stop.load(Ordering::Relaxed) {
                self.retire(true)?;
                return Ok(Got::End(Ended::Stopped));
            }
            while let Some(m) = self.link.next(Duration::ZERO)? {
                take_credit(m, self.lane, self.credits)?;
            }
            // With WRITEs in flight, only a frame published already: they are polled between.
            let busy = !self.flight.queue.is_empty();
            if busy {
                self.retire(false)?;
            }
            let wait = if busy {
                Duration::ZERO
            } else {
                Duration::from_millis(50)
            };
            match self.consumer.recv_host_ordered(wait, bytes) {
                Ok(f) => return Ok(Got::Frame(f)),
                Err(Error::Timeout { .. }) => {
                    if busy {
                        std::hint::spin_loop();
                    }
                }
                Err(Error::Channel(crate::channel::ChannelError::ProducerGone { pid })) => {
                    let why = format!("the near producer (pid {pid}) died");
                    return self.upstream(false, &why).map(Got::End);
                }
                Err(Error::Channel(crate::channel::ChannelError::Closed)) => {
                    let why = "the near producer closed the channel";
                    return self.upstream(true, why).map(Got::End);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits until a far buffer is credited (the receiving bridge lent it), polling and retiring
    /// the WRITEs in flight meanwhile; while the far side waits for its consumers, notices a near
    /// producer that died.
    fn wait_credit(&mut self) -> Result<Option<Ended>> {
        let period = self.opts.lane.heartbeat;
        // `checked_add`: a heartbeat too long for `Instant` (`Duration::MAX`) never comes due,
        // where `+` would panic.
        let mut next_check = Instant::now().checked_add(period);
        while self.credits.queue.is_empty() {
            if self.stop.load(Ordering::Relaxed) {
                self.retire(true)?;
                return Ok(Some(Ended::Stopped));
            }
            let busy = !self.flight.queue.is_empty();
            if busy {
                self.retire(false)?;
            }
            let wait = if busy { Duration::ZERO } else { period };
            if let Some(m) = self.link.next(wait)? {
                take_credit(m, self.lane, self.credits)?;
                continue;
            }
            if next_check.is_some_and(|at| Instant::now() >= at) {
                next_check = Instant::now().checked_add(period);
                if let Ok(s) = inspect::inspect(&self.opts.channel)
                    && s.producer_liveness == Liveness::Dead
                {
                    return self.upstream(false, "the near producer died").map(Some);
                }
            }
        }
        Ok(None)
    }
}

#[allow(clippy::too_many_arguments)]
fn pump(
    opts: &SendOptions,
    stop: &AtomicBool,
    consumer: &Consumer,
    lane: &mut Lane,
    link: &mut Link,
    remote: &str,
    place: Place,
    credits: &mut Credits,
    totals: &mut Totals,
    status: &mut Status,
) -> Result<Ended> {
    let most = credits.most;
    let mut p = Pump {
        opts,
        stop,
        consumer,
        lane,
        link,
        credits,
        flight: Flight {
            queue: VecDeque::with_capacity(most),
            last_done: None,
        },
        report: Report {
            place,
            totals,
            status,
            last_status: Instant::now(),
        },
        far: place,
    };
    // Every frame: the next frame is taken (and its bytes awaited) while the far side still
    // publishes the last one, so only the WRITE waits for a credit (with two or more outstanding,
    // usually none). Latest only: the credit first, then the newest frame, so no older frame is
    // held while the far side is busy. Up to one WRITE per credit is in flight at once.
    let r = frames(&mut p, remote, place);
    if r.is_err() {
        // A failed session still waits (bounded) for the WRITEs it posted before their frames go
        // back to the near producer: a far peer still listening could otherwise publish a frame
        // whose buffer was overwritten under the transfer.
        if let Err(e) = p.retire(true) {
            tracing::debug!("lane: WRITEs in flight at a failed session's end: {e}");
        }
    }
    r
}

/// The pump's loop: frames until the session ends ([`pump`]).
fn frames(p: &mut Pump<'_, '_>, remote: &str, place: Place) -> Result<Ended> {
    let opts = p.opts;
    let early = opts.delivery == Delivery::EveryFrame;
    loop {
        p.retire(false)?;
        let mut frame = None;
        if early {
            match p.wait_frame()? {
                Got::Frame(f) => frame = Some(f),
                Got::End(e) => return Ok(e),
            }
        }
        if let Some(e) = p.wait_credit()? {
            return Ok(e);
        }
        let frame = match frame {
            Some(f) => f,
            None => match p.wait_frame()? {
                Got::Frame(f) => f,
                Got::End(e) => return Ok(e),
            },
        };
        let Some((tindex, target)) = p.credits.queue.pop_front() else {
            continue; // not reached: `wait_credit` returned with a credit
        };
        p.far = target.place;
        let region = match place {
            Place::Host => Region {
                addr: frame.as_ptr()? as u64,
                len: frame.len(),
                place,
            },
            Place::Device(_) => Region {
                addr: frame.buffer()?.device_ptr(),
                len: frame.len(),
                place,
            },
        };
        let index = frame.index() as u32;
        // The producer stays off the buffer while the frame is held; the WRITE completes before
        // the frame is dropped (`retire`).
        // SAFETY: the frame's buffer in the consumer's mapping (host pool or import), kept until
        // the consumer drops, after the lane (a `serve` local).
        unsafe { p.lane.register(index, region) }.map_err(|e| match (place, e) {
            // The source of a device lane is an import of the near producer's pool: say so, as
            // UCX may refuse to register some kinds of imported memory.
            (Place::Device(_), Error::Remote(RemoteError::Nixl { call, reason })) => {
                RemoteError::Nixl {
                    call,
                    reason: format!(
                        "{reason} (registering buffer {index} of channel {}, an import of its \
                         producer's device pool; UCX may not register imports of this memory \
                         kind: try the producer with another one, e.g. MemoryKind::Vmm)",
                        opts.channel
                    ),
                }
                .into()
            }
            (_, e) => e,
        })?;
        let note = FrameNote {
            index: tindex,
            seq: frame.seq(),
            len: frame.len() as u64,
            meta: frame.metadata().to_vec(),
        };
        // After an idle spell the receiving bridge may have stopped polling: announced, it polls
        // without a pause from now until the notification (a TCP transfer advances only while
        // both ends poll). WRITEs closer together go unannounced: it still polls after the last
        // notification. The announcement goes once the WRITE is posted, overlapping it.
        let announce = p.flight.queue.is_empty()
            && p.flight
                .last_done
                .is_none_or(|t| t.elapsed() > POSTING_AFTER);
        let w = p.lane.post(
            index,
            frame.len(),
            (tindex, target),
            remote,
            note.encode().as_bytes(),
        )?;
        p.flight.queue.push_back((frame, w));
        if announce {
            p.link.send(&Msg::Posting { index: tindex })?;
        }
    }
}

fn upstream(link: &Link, closed: bool, reason: &str, sent: u64) -> Result<Ended> {
    tracing::info!("lane: {reason} after {sent} frames; telling the receiving bridge");
    link.send(&Msg::Upstream {
        closed,
        sent,
        reason: reason.to_string(),
    })?;
    // Give the message time to leave before the connection is shut.
    std::thread::sleep(Duration::from_millis(50));
    Ok(if closed {
        Ended::Closed
    } else {
        Ended::ProducerGone
    })
}

fn geometry(channel: &str) -> Result<(u32, u64)> {
    let s = inspect::inspect(channel)?;
    Ok((s.buffers.len() as u32, s.buffer_bytes))
}

pub(super) fn unexpected(m: &Msg, wanted: &str) -> Error {
    wire::unexpected_msg(m, wanted)
}
