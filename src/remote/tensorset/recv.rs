//! The receiving bridge of a tensor set, on the far readers' host: the far set's
//! [`TensorSetWriter`], whose back buffer the sending bridge WRITEs into; it publishes a
//! generation once every byte of it has landed.

use super::{runs, subtract};
use crate::channel::MemoryKind;
use crate::driver::{Context, Device};
use crate::error::{Error, Result};
use crate::remote::link::Link;
use crate::remote::nixl::{Lane, Place, Region, pause};
use crate::remote::recv::{Arrival, Door};
use crate::remote::report::{self, Role, Status};
use crate::remote::wire::{self, FarRegion, Msg, Secret, SetMsg, SetNote};
use crate::remote::{LaneOptions, RemoteError};
use crate::tensorset::{
    GenerationMode, Layout, TensorSetError, TensorSetOptions, TensorSetWriter, TensorSpec,
};
use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How a tensor set's receiving bridge runs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RecvOptions {
    /// The far set this bridge creates (with the sender's layout) and keeps mirrored.
    pub set: String,
    /// The secret a sending bridge must present.
    pub secret: Secret,
    /// The far set's memory: [`Place::Host`] (a host set, no GPU) or [`Place::Device`].
    pub place: Place,
    /// The far set's device memory kind; `None` (default): legacy memory where the device has
    /// legacy IPC (UCX's `cuda_ipc` transport WRITEs into it GPU to GPU; VMM targets were seen
    /// host-staged, docs/gpu-verification.md), else `Auto`. Ignored for host sets.
    pub memory: Option<MemoryKind>,
    /// Buffers of the far set (2 to 16; default 2): far readers of the newest generation never
    /// wait for the bridge, which writes the oldest buffer no reader holds.
    pub buffers: usize,
    /// Most far readers at once (1 to 64); default 64.
    pub max_readers: usize,
    /// Timeouts and periods.
    pub lane: LaneOptions,
}

impl RecvOptions {
    /// Options for far set `set` in host memory, double-buffered, checked against `secret`.
    pub fn new(set: &str, secret: Secret) -> RecvOptions {
        RecvOptions {
            set: set.to_string(),
            secret,
            place: Place::Host,
            memory: None,
            buffers: 2,
            max_readers: 64,
            lane: LaneOptions::default(),
        }
    }
}

/// How a receiving bridge ended.
#[derive(Debug)]
#[non_exhaustive]
pub enum Ended {
    /// The near writer closed its set: the far set's writer is handed back (dropping it closes
    /// the far set: from then on its readers get [`TensorSetError::Closed`]; what they hold
    /// stays readable until the close's wait ends).
    Closed(Box<TensorSetWriter>),
    /// `stop` was set; the far set's writer, if one was made, is handed back. End the process
    /// without dropping it and far readers see [`TensorSetError::WriterGone`] (keeping what they
    /// hold); drop it to close the set.
    Stopped(Option<Box<TensorSetWriter>>),
}

/// What a receiving bridge carried, for logs and tests.
#[derive(Clone, Debug, Default)]
pub struct Totals {
    /// Far generations published.
    pub generations: u64,
    /// Sessions that ended with their generation abandoned (a link lost mid generation).
    pub abandoned: u64,
    /// Sending bridges served.
    pub sessions: u64,
    /// Far buffers brought up to the newest generation ahead of the next changed-only one, while
    /// the link was idle (the next generation then waits only for its WRITEs).
    pub prefilled: u64,
}

/// Waits on `listener` for sending bridges, one session at a time (others are told the bridge is
/// busy), and mirrors their set into far set [`RecvOptions::set`], created with the first
/// sender's layout. A lost session (the link, the sending bridge) abandons the generation under
/// way (never published: far readers keep the newest whole generation) and the next sender is
/// awaited; a sender whose layout differs from the far set's is refused (both fingerprints
/// named) and the next awaited. Returns when the near writer closes its set or `stop` is set.
///
/// # Errors
/// [`Error::Unsupported`] when NIXL is not installed; the errors of [`Device::get`] and
/// [`Device::primary_context`] for [`Place::Device`]; [`RecvOptions`] out of bounds
/// ([`Error::InvalidArgument`]); [`TensorSetError::AlreadyExists`] when a live writer has the
/// far set's name (the sender is told); [`RemoteError::Link`] when the listener fails.
pub fn serve(
    opts: &RecvOptions,
    listener: &TcpListener,
    stop: &AtomicBool,
    totals: &mut Totals,
) -> Result<Ended> {
    crate::remote::nixl::probe()?;
    if !(2..=crate::channel::MAX_BUFFERS).contains(&opts.buffers) {
        return Err(Error::InvalidArgument(format!(
            "a far tensor set takes 2 to {} buffers, got {}",
            crate::channel::MAX_BUFFERS,
            opts.buffers
        )));
    }
    let ctx: Option<Arc<Context>> = match opts.place {
        Place::Host => None,
        Place::Device(d) => Some(Device::get(d as usize).and_then(|dev| dev.primary_context())?),
    };
    // UCX's CUDA transports work in the thread's current context: the far set's, throughout.
    let _current = ctx.as_ref().map(|c| c.enter()).transpose()?;
    let door = Door::open(listener, &opts.secret, opts.lane.handshake_timeout)?;
    if let Ok(a) = listener.local_addr() {
        crate::remote::check_binding(a.ip());
    }
    let mut writer: Option<Box<TensorSetWriter>> = None;
    // The near generation the far set's newest generation mirrors (0: none, or unknown).
    let mut mirrored = 0u64;
    // What each far buffer holds, across sessions (the far set outlives them).
    let mut holdings = Holdings::default();
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(Ended::Stopped(writer));
        }
        door.admit();
        let Some(mut a) = door.next(Duration::from_millis(20)) else {
            continue;
        };
        let (near_kind, agent, layout) = match accept(&mut a, opts, &ctx, &mut writer) {
            Ok(x) => x,
            Err(e @ Error::TensorSet(TensorSetError::AlreadyExists { .. })) => {
                refuse(&mut a, &format!("the far set: {e}"));
                return Err(e);
            }
            Err(e) => {
                refuse(&mut a, &e.to_string());
                continue;
            }
        };
        let Some(w) = writer.as_deref_mut() else {
            continue;
        };
        totals.sessions += 1;
        let mut s = Session {
            opts,
            stop,
            door: &door,
            writer: w,
            layout,
            sender: agent,
            mirrored: &mut mirrored,
            holdings: &mut holdings,
            totals,
        };
        match s.run(a, near_kind) {
            Ok(SessionEnd::Closed) => {
                let w = writer
                    .take()
                    .ok_or_else(|| Error::InvalidArgument("no writer".into()))?;
                return Ok(Ended::Closed(w));
            }
            Ok(SessionEnd::Stopped) => return Ok(Ended::Stopped(writer)),
            Ok(SessionEnd::Next(why)) => {
                tracing::warn!(
                    "tensor-set bridge: set {}: {why}; awaiting the next sender",
                    opts.set
                );
            }
            Err(e) => {
                tracing::error!(
                    "tensor-set bridge: set {}: session lost: {e}; awaiting the next sender",
                    opts.set
                );
            }
        }
    }
}

fn refuse(a: &mut Arrival, why: &str) {
    tracing::warn!("tensor-set bridge: refused {}: {why}", a.peer);
    let _ = a.session.send(
        &mut a.stream,
        &Msg::Refused {
            reason: why.to_string(),
        },
    );
}

/// Checks a sender's hello and makes (or keeps) the far set of its layout: (the near memory
/// kind, the sender's agent, the layout).
fn accept(
    a: &mut Arrival,
    opts: &RecvOptions,
    ctx: &Option<Arc<Context>>,
    writer: &mut Option<Box<TensorSetWriter>>,
) -> Result<(u8, String, Arc<Layout>)> {
    let (kind, agent, wl) = match &a.first {
        Msg::Set(SetMsg::Hello {
            kind,
            agent,
            layout,
            ..
        }) => (*kind, agent.clone(), layout),
        m => return Err(wire::unexpected_msg(m, "a tensor set's layout")),
    };
    if kind > 1 {
        return Err(RemoteError::Protocol(format!("near memory kind {kind}")).into());
    }
    let layout = wl.to_layout()?;
    if let Some(w) = writer.as_deref() {
        if w.layout().fingerprint() != layout.fingerprint() {
            let hex = |f: [u8; 32]| {
                f[..8]
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            };
            return Err(RemoteError::Refused(format!(
                "layout mismatch: the near set's layout (fingerprint {}…, {} tensors) differs from \
                 far set {}'s (fingerprint {}…, {} tensors)",
                hex(layout.fingerprint()),
                layout.len(),
                opts.set,
                hex(w.layout().fingerprint()),
                w.layout().len()
            ))
            .into());
        }
        return Ok((kind, agent, Arc::new(w.layout().clone())));
    }
    // The far set is made by `TensorSetWriter::create` (tensors in order, aligned): a near layout
    // over given allocations is refused rather than mirrored into another shape.
    let specs: Vec<TensorSpec> = wl.tensors.iter().map(|(s, _, _)| s.clone()).collect();
    if Layout::new(&specs)?.fingerprint() != layout.fingerprint() {
        return Err(RemoteError::Refused(format!(
            "the near set's layout is not one `TensorSetWriter::create` makes (a set over given \
             allocations); the far set {} cannot take its shape",
            opts.set
        ))
        .into());
    }
    let bytes = usize::try_from(layout.bytes_per_buffer()).map_err(|_| {
        RemoteError::Protocol(format!("{} bytes per buffer", layout.bytes_per_buffer()))
    })?;
    crate::remote::recv::fits(opts.place, opts.buffers, bytes).map_err(RemoteError::Refused)?;
    let topts = TensorSetOptions::new()
        .mode(GenerationMode::Buffered(opts.buffers))
        .max_readers(opts.max_readers);
    let w = match ctx {
        None => TensorSetWriter::create_host(&opts.set, &specs, &topts)?,
        Some(ctx) => match opts.memory {
            Some(k) => TensorSetWriter::create(ctx, &opts.set, &specs, &topts.memory(k))?,
            None => match TensorSetWriter::create(
                ctx,
                &opts.set,
                &specs,
                &topts.clone().memory(MemoryKind::Legacy),
            ) {
                Err(Error::Unsupported { .. }) => TensorSetWriter::create(
                    ctx,
                    &opts.set,
                    &specs,
                    &topts.memory(MemoryKind::Auto),
                )?,
                made => made?,
            },
        },
    };
    tracing::info!(
        "tensor-set bridge: made far set {} ({} tensors, {} per buffer, {} buffers)",
        opts.set,
        w.layout().len(),
        crate::error::bytes(w.layout().bytes_per_buffer()),
        opts.buffers
    );
    let l = Arc::new(w.layout().clone());
    *writer = Some(Box::new(w));
    Ok((kind, agent, l))
}

enum SessionEnd {
    /// The near writer closed its set.
    Closed,
    /// `stop` was set.
    Stopped,
    /// The sender went (its writer died, it left): wait for the next one.
    Next(String),
}

struct Session<'a> {
    opts: &'a RecvOptions,
    stop: &'a AtomicBool,
    door: &'a Door<'a>,
    writer: &'a mut TensorSetWriter,
    layout: Arc<Layout>,
    /// The sending bridge's NIXL agent: notifications of any other are not this session's.
    sender: String,
    mirrored: &'a mut u64,
    holdings: &'a mut Holdings,
    totals: &'a mut Totals,
}

/// The first wait on the link while a far buffer waits for its readers to be brought up to date
/// ([`Session::prefill`]); it doubles up to [`PREFILL_POLL_MAX`] while they hold it.
const PREFILL_POLL_MIN: Duration = Duration::from_micros(200);
/// The longest wait on the link between tries of [`Session::prefill`].
const PREFILL_POLL_MAX: Duration = Duration::from_millis(20);

/// What each far buffer holds, so that a changed-only generation copies into its buffer only the
/// tensors that buffer lacks: those another generation wrote since the buffer's own (a buffer of
/// generation g−2, written again for g, lacks g−1's changes, not the whole set). Far generation
/// numbers come from one writer, so they order every write, across sessions too.
#[derive(Debug, Default)]
struct Holdings {
    /// Per far buffer: the far generation whose bytes it holds whole; `None` when unknown (never
    /// written by this bridge, or an update begun there and not committed).
    buffers: Vec<Option<u64>>,
    /// Per tensor: the far generation that last wrote it over the wire (0: none yet).
    written: Vec<u64>,
}

impl Holdings {
    /// Sized for `buffers` buffers of `tensors` tensors; everything unknown on a change of shape.
    fn fit(&mut self, buffers: usize, tensors: usize) {
        if self.buffers.len() != buffers || self.written.len() != tensors {
            self.buffers = vec![None; buffers];
            self.written = vec![0; tensors];
        }
    }

    /// The tensors to copy from the newest generation into `buffer` for a generation that WRITEs
    /// the `chosen` ones: the others that `buffer` does not hold as they are now.
    fn lacking(&self, buffer: usize, chosen: &[bool]) -> Vec<bool> {
        let held = self.buffers.get(buffer).copied().flatten();
        chosen
            .iter()
            .enumerate()
            .map(|(t, &c)| {
                !c && match held {
                    None => true,
                    Some(h) => self.written.get(t).is_none_or(|&w| w > h),
                }
            })
            .collect()
    }

    /// `buffer` was brought up to far generation `far` (everything it lacked copied from it).
    fn filled(&mut self, buffer: usize, far: u64) {
        if let Some(b) = self.buffers.get_mut(buffer) {
            *b = Some(far);
        }
    }

    /// An update began in `buffer`: its bytes are unknown until the commit.
    fn begun(&mut self, buffer: usize) {
        if let Some(b) = self.buffers.get_mut(buffer) {
            *b = None;
        }
    }

    /// Far generation `far` was committed from `buffer`, the `chosen` tensors written over the
    /// wire, the rest filled from the newest generation.
    fn committed(&mut self, buffer: usize, far: u64, chosen: &[bool]) {
        if let Some(b) = self.buffers.get_mut(buffer) {
            *b = Some(far);
        }
        for (w, &c) in self.written.iter_mut().zip(chosen) {
            if c {
                *w = far;
            }
        }
    }
}

impl Session<'_> {
    fn run(&mut self, a: Arrival, near_kind: u8) -> Result<SessionEnd> {
        let Arrival {
            mut stream,
            peer,
            mut session,
            ..
        } = a;
        let allocs = self.layout.allocations().len();
        let buffers = self.writer.buffers();
        let place = self.opts.place;
        let agent = format!(
            "cuda-ipc-trecv-{}-{}-{}",
            std::process::id(),
            self.opts.set,
            self.totals.sessions
        );
        // A NIXL agent per session: when the session ends it goes, with its registrations, so
        // nothing of a lost sender lands in the far set afterwards.
        let mut lane = match Lane::new(&agent) {
            Ok(l) => l,
            Err(e) => {
                let why = format!("NIXL on the far host: {e}");
                let _ = session.send(
                    &mut stream,
                    &Msg::Refused {
                        reason: why.clone(),
                    },
                );
                return Err(RemoteError::Refused(why).into());
            }
        };
        let mut regions = Vec::with_capacity(buffers * allocs);
        for b in 0..buffers {
            for x in 0..allocs {
                let (addr, len) = self.writer.allocation_span(b, x).ok_or_else(|| {
                    Error::InvalidArgument(format!("allocation {x} of buffer {b}"))
                })?;
                // SAFETY: the far set's memory lives as long as the writer, which outlives this
                // session's lane; NIXL writes a buffer only between `begin` (the bridge's update
                // of it, no reader holding it) and the publication, as the session orders it.
                unsafe {
                    lane.register(
                        (b * allocs + x) as u32,
                        Region {
                            addr,
                            len: len as usize,
                            place,
                        },
                    )
                }?;
                regions.push(FarRegion { addr, len });
            }
        }
        let (kind, device) = place.code();
        session.send(
            &mut stream,
            &Msg::Set(SetMsg::Ready {
                agent: agent.clone(),
                kind,
                device,
                buffers: buffers as u32,
                regions,
                mirrored: *self.mirrored,
                md: lane.local_md()?,
            }),
        )?;
        tracing::info!(
            "tensor-set bridge: receiving set {} ({place:?}; near memory {}) from {peer}",
            self.opts.set,
            if near_kind == 0 { "host" } else { "device" }
        );
        let mut link = Link::start(stream, session, &self.opts.lane)?;
        let mut status = Status::new(
            Role::Recv,
            &report::tensorset_status_name(&self.opts.set),
            &peer,
            place,
        );
        status.object = "tensorset";
        status.frames = self.totals.generations;
        status.write();
        let near = Place::from_code(near_kind, 0).unwrap_or(Place::Host);
        let r = self.generations(&mut lane, &mut link, &mut status, near);
        drop(link);
        drop(lane);
        status.remove();
        r
    }

    /// Serves generations until the session ends.
    fn generations(
        &mut self,
        lane: &mut Lane,
        link: &mut Link,
        status: &mut Status,
        near_place: Place,
    ) -> Result<SessionEnd> {
        let mut next_turn_away = Instant::now();
        // While a far buffer waits to be brought up to the newest generation (after a
        // changed-only one): how long the link is polled before the next try.
        let mut prefill: Option<Duration> = None;
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(SessionEnd::Stopped);
            }
            if Instant::now() >= next_turn_away {
                next_turn_away = Instant::now() + Duration::from_millis(100);
                self.door
                    .turn_away(&format!("tensor set {}", self.opts.set));
            }
            if let Some(step) = prefill {
                prefill = (!self.prefill()?).then(|| (step * 2).min(PREFILL_POLL_MAX));
            }
            // Notifications of this session come only after a `Buffer` (drained there); polled
            // here too so that stale ones do not pile up.
            let _ = lane.take_notifications()?;
            let wait = prefill.map_or(self.opts.lane.heartbeat, |s| {
                s.min(self.opts.lane.heartbeat)
            });
            let Some(m) = link.next(wait)? else {
                continue;
            };
            match m {
                Msg::Set(SetMsg::Begin {
                    near,
                    content,
                    base,
                    all,
                    tensors,
                }) => {
                    let r = self.generation(lane, link, near, content, base, all, &tensors);
                    match r {
                        Ok(far) => {
                            if status.transport.is_none() {
                                // What UCX printed on this side, once the first WRITEs landed.
                                status.transport =
                                    report::from_ucx_log(near_place, self.opts.place);
                                if let Some(t) = &status.transport {
                                    t.log("tensor-set recv");
                                }
                            }
                            status.frames = self.totals.generations;
                            status.write();
                            link.send(&Msg::Set(SetMsg::Published { near, far }))?;
                            // A sender of changed-only generations: the next buffer is brought
                            // up to date now, off the next generation's path.
                            prefill = (!all).then_some(PREFILL_POLL_MIN);
                        }
                        Err(e) => {
                            self.totals.abandoned += 1;
                            return Err(e);
                        }
                    }
                }
                Msg::Upstream { closed, reason, .. } => {
                    return Ok(if closed {
                        SessionEnd::Closed
                    } else {
                        SessionEnd::Next(reason)
                    });
                }
                Msg::Refused { reason } => return Ok(SessionEnd::Next(reason)),
                m => return Err(wire::unexpected_msg(&m, "a generation's start")),
            }
        }
    }

    /// Ahead of the next changed-only generation, while the link is idle: takes the buffer the
    /// next generation is written into if no far reader holds it now (never waiting), copies into
    /// it on the far side what it lacks from the newest generation (`cuMemcpyDtoDAsync_v2` on the
    /// far set's stream, after its readers' release words; a host set at once), and gives it back
    /// unpublished: it then holds the newest generation's bytes, which [`Holdings`] records, and
    /// the next generation written there waits only for its own WRITEs (its `begin` drains the
    /// stream before the sender is told the buffer). Returns `false` while far readers hold
    /// every buffer it could take (try again later), `true` once done or when there is nothing
    /// to do (nothing published yet, nothing lacking).
    fn prefill(&mut self) -> Result<bool> {
        let n = self.layout.len();
        if self.writer.generation() == 0 {
            return Ok(true);
        }
        self.holdings.fit(self.writer.buffers(), n);
        let newest = self.writer.generation();
        // Never the newest generation's buffer: given back unpublished, it would be gone from far
        // readers until the next generation (a reader holding every other buffer lets the
        // channel hand out the newest one).
        let mut update = match self.writer.begin_behind_newest(Some(Duration::ZERO)) {
            Ok(u) => u,
            Err(Error::Timeout { .. }) => return Ok(false),
            Err(e) => return Err(e),
        };
        let buffer = update.buffer();
        let lacking = self.holdings.lacking(buffer, &vec![false; n]);
        if !lacking.contains(&true) {
            // Given back untouched: it holds what it held.
            return Ok(true);
        }
        self.holdings.begun(buffer);
        update.copy_ranges_from_previous(&runs(&self.layout, &lacking))?;
        // Dropped unpublished: the buffer is free again, no reader ever sees it; its copies are
        // ordered on the stream before anything the next update enqueues.
        drop(update);
        self.holdings.filled(buffer, newest);
        self.totals.prefilled += 1;
        Ok(true)
    }

    /// One generation: a far buffer, the unwritten tensors filled from the newest generation, the
    /// WRITEs awaited, then the publication. Returns the far generation. An error (the update
    /// dropped unpublished) abandons it.
    #[allow(clippy::too_many_arguments)]
    fn generation(
        &mut self,
        lane: &mut Lane,
        link: &mut Link,
        near: u64,
        content: [u8; 32],
        base: u64,
        all: bool,
        tensors: &[u32],
    ) -> Result<u64> {
        let n = self.layout.len();
        let mut chosen = vec![all; n];
        if !all {
            if base == 0 || base != *self.mirrored || self.writer.generation() == 0 {
                return Err(RemoteError::Protocol(format!(
                    "a changed-only generation against near generation {base}, while the far set \
                     mirrors {}",
                    *self.mirrored
                ))
                .into());
            }
            for &t in tensors {
                let Some(c) = chosen.get_mut(t as usize) else {
                    return Err(RemoteError::Protocol(format!("tensor {t} of {n}")).into());
                };
                *c = true;
            }
        }
        let heartbeat = self.opts.lane.heartbeat;
        let stop = self.stop;
        self.holdings.fit(self.writer.buffers(), n);
        let mut update = loop {
            if stop.load(Ordering::Relaxed) {
                return Err(RemoteError::Link("stopped".into()).into());
            }
            // Never the newest far generation's buffer: a generation abandoned there (the link
            // lost mid-WRITE) would take the last whole generation from far readers.
            match self.writer.begin_behind_newest(Some(heartbeat)) {
                Ok(u) => break u,
                Err(Error::Timeout { .. }) => {
                    // Far readers hold every buffer: the link is checked meanwhile.
                    if let Some(m) = link.next(Duration::ZERO)? {
                        return Err(wire::unexpected_msg(
                            &m,
                            "nothing (a far buffer is awaited)",
                        ));
                    }
                }
                Err(e) => return Err(e),
            }
        };
        let buffer = update.buffer();
        // Only what this buffer lacks (the tensors written since its own generation).
        let lacking = (!all).then(|| self.holdings.lacking(buffer, &chosen));
        self.holdings.begun(buffer);
        if let Ok(s) = update.stream() {
            // NIXL writes from the host's side: the far readers' release words first (the
            // stream waits for them).
            s.synchronize()?;
        }
        if let Some(lacking) = lacking {
            // On the stream, beside the WRITEs (other bytes): before the publication, which is
            // ordered after the stream's work.
            // Never a byte a WRITE writes (aliasing tensors, gaps inside a WRITE's run).
            let fill = subtract(&runs(&self.layout, &lacking), &runs(&self.layout, &chosen));
            update.copy_ranges_from_previous(&fill)?;
        }
        link.send(&Msg::Set(SetMsg::Buffer {
            near,
            buffer: buffer as u32,
        }))?;
        let mut seen: HashSet<u32> = HashSet::new();
        let mut done: Option<(u32, Instant)> = None;
        let start = Instant::now();
        let mut naps = 0u32;
        loop {
            for (from, text) in lane.take_notifications()? {
                if from != self.sender {
                    continue;
                }
                let note = SetNote::decode(&text)?;
                if note.near == near {
                    seen.insert(note.index);
                    naps = 0;
                }
            }
            if let Some((writes, at)) = done {
                if seen.len() as u64 >= u64::from(writes) {
                    if seen.iter().any(|&i| i >= writes) {
                        return Err(RemoteError::Protocol(format!(
                            "a notification of a WRITE past the {writes} announced"
                        ))
                        .into());
                    }
                    break;
                }
                if at.elapsed() > self.opts.lane.write_timeout {
                    return Err(Error::Timeout {
                        what: "the notifications of a generation's WRITEs",
                        after: at.elapsed(),
                    });
                }
            }
            match link.next(Duration::ZERO)? {
                Some(Msg::Set(SetMsg::Done {
                    near: g, writes, ..
                })) if g == near && done.is_none() => done = Some((writes, Instant::now())),
                Some(m) => return Err(wire::unexpected_msg(&m, "a generation's WRITEs")),
                None => pause(
                    start,
                    self.opts.lane.spin.max(Duration::from_millis(1)),
                    &mut naps,
                ),
            }
            if self.stop.load(Ordering::Relaxed) {
                return Err(RemoteError::Link("stopped".into()).into());
            }
        }
        // Every byte landed: publish.
        let far = update.commit_with_content(content)?;
        self.holdings.committed(buffer, far, &chosen);
        *self.mirrored = near;
        self.totals.generations += 1;
        Ok(far)
    }
}

#[cfg(test)]
mod tests {
    use super::Holdings;

    #[test]
    fn a_buffer_lacks_only_what_was_written_since_its_own_generation() {
        let mut h = Holdings::default();
        h.fit(2, 4);
        // Nothing known: a changed-only generation copies every tensor it does not write.
        assert_eq!(
            h.lacking(0, &[true, false, false, false]),
            [false, true, true, true]
        );
        // Far generation 1, whole, in buffer 0; generation 2 in buffer 1 writes tensor 1.
        h.begun(0);
        h.committed(0, 1, &[true; 4]);
        assert_eq!(
            h.lacking(1, &[false, true, false, false]),
            [true, false, true, true]
        );
        h.begun(1);
        h.committed(1, 2, &[false, true, false, false]);
        // Generation 3 in buffer 0 writes tensor 3: buffer 0 (generation 1) lacks tensor 1 only.
        assert_eq!(
            h.lacking(0, &[false, false, false, true]),
            [false, true, false, false]
        );
        h.begun(0);
        h.committed(0, 3, &[false, false, false, true]);
        // Generation 4 in buffer 1 (generation 2) writes nothing: it lacks tensor 3 only.
        assert_eq!(h.lacking(1, &[false; 4]), [false, false, false, true]);
        // An update begun and never committed leaves its buffer unknown: everything is copied.
        h.begun(1);
        assert_eq!(
            h.lacking(1, &[false, true, false, false]),
            [true, false, true, true]
        );
        // Brought up to generation 3 ahead of time (everything it lacked copied from it): it
        // lacks nothing for a generation that writes tensor 0 only.
        h.filled(1, 3);
        assert_eq!(h.lacking(1, &[true, false, false, false]), [false; 4]);
        // A change of shape forgets everything.
        h.committed(1, 4, &[false; 4]);
        h.fit(3, 4);
        assert_eq!(h.lacking(1, &[false; 4]), [true; 4]);
    }
}
