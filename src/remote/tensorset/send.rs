//! The sending bridge of a tensor set, on the near set's host: a
//! [`TensorSetReader`] of the near set that WRITEs each new generation into the far buffer the
//! receiving bridge names.

use super::{Span, chunks, runs};
use crate::error::{Error, Result};
use crate::remote::link::Link;
use crate::remote::nixl::{Lane, Place, Region, Target, Write, pause};
use crate::remote::report::{self, Path, Role, Status};
use crate::remote::wire::{self, FarRegion, Msg, Secret, SetMsg, SetNote, WireLayout};
use crate::remote::{LaneOptions, RemoteError};
use crate::tensorset::{Held, ReaderOptions, TensorSetError, TensorSetReader};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How a tensor set's sending bridge runs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SendOptions {
    /// The near set (on this host) whose generations are mirrored.
    pub set: String,
    /// The receiving bridge's control address, `HOST:PORT`.
    pub connect: String,
    /// The shared secret the receiving bridge expects.
    pub secret: Secret,
    /// Write only the tensors whose content digest differs from the generation the far set mirrors
    /// (default `false`: every generation whole). The digests are the tensors' content digests
    /// ([`crate::tensorset::Held::tensor_digests`]): on a GPU set one kernel over the held
    /// generation on the bridge's stream (a read of every byte at the device's memory
    /// bandwidth, nothing copied to the host), on a host set computed on the host.
    pub changed_only: bool,
    /// Largest WRITE in bytes; default [`super::DEFAULT_CHUNK`] (64 MiB).
    pub chunk: u64,
    /// WRITEs in flight at once (at least 1); default [`super::DEFAULT_IN_FLIGHT`].
    pub in_flight: usize,
    /// Fail at the session's first WRITE, before the generation's bulk, when UCX does not reach
    /// the far memory GPU-direct (it said `host-staged`, or nothing this parser knows) while
    /// either end is device memory; default `false` (the path is reported either way).
    pub require_gpu_direct: bool,
    /// Timeouts and periods.
    pub lane: LaneOptions,
}

impl SendOptions {
    /// Options for mirroring `set` to `connect` with `secret`: whole generations, 64 MiB WRITEs,
    /// 8 in flight, default timeouts.
    pub fn new(set: &str, connect: &str, secret: Secret) -> SendOptions {
        SendOptions {
            set: set.to_string(),
            connect: connect.to_string(),
            secret,
            changed_only: false,
            chunk: super::DEFAULT_CHUNK,
            in_flight: super::DEFAULT_IN_FLIGHT,
            require_gpu_direct: false,
            lane: LaneOptions::default(),
        }
    }
}

/// How a sending bridge's session ended without an error.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ended {
    /// The near writer closed the set; the receiving bridge was told.
    Closed,
    /// The near writer died; the receiving bridge was told (the far set keeps its newest
    /// generation).
    WriterGone,
    /// `stop` was set (whatever the session was doing then).
    Stopped,
}

/// What a bridge carried, kept across its sessions (pass the same one to each
/// [`serve`]): counts for logs and tests, and what the changed-only mode compares with.
#[derive(Clone, Debug, Default)]
pub struct Totals {
    /// Generations mirrored (published on the far side).
    pub generations: u64,
    /// Bytes WRITten.
    pub bytes: u64,
    /// The near generation last mirrored, which the next session may resume from (0: none, or
    /// nothing to resume from: the near set ended, closed or was replaced).
    pub mirrored: u64,
    /// What UCX reported of the transport it chose, once seen.
    pub transport: Option<report::Transport>,
    /// The content digest of each tensor of near generation `mirrored` (changed-only mode).
    digests: Vec<crate::tensorset::content::TensorDigest>,
    /// The content fingerprint of near generation `mirrored`.
    content: [u8; 32],
    /// The near set's incarnation ([`TensorSetReader::incarnation`]) that `mirrored` counts in: a
    /// near writer that replaced the one mirrored numbers its generations from 1 again.
    incarnation: u64,
}

/// Runs one session: connects, proves the secret and checks the receiving bridge's
/// ([`wire::handshake_send`]), opens the near set ([`TensorSetReader::open_auto`]), creates the
/// NIXL agent and registers every allocation of every near buffer once, sends the layout, and then
/// mirrors each newest near generation (see the module doc of `remote::tensorset`) until the near
/// set ends, `stop` is set, or the link fails. Call again to resume: the next session starts with
/// the newest near generation (whole, unless the far set still mirrors
/// [`Totals::mirrored`] and [`SendOptions::changed_only`] is on).
///
/// # Errors
/// As the lane's `send::connect` and handshake ([`RemoteError::Refused`]: wrong secret, a far set
/// of another layout, a busy bridge); the reader's open errors; [`Error::Unsupported`] when NIXL
/// is not installed; [`RemoteError::Nixl`]; [`RemoteError::Refused`] when
/// [`SendOptions::require_gpu_direct`] is on and the path is not GPU-direct (the receiving
/// bridge is told); [`RemoteError::Link`] when the link is lost; [`Error::Timeout`] for a WRITE
/// over [`LaneOptions::write_timeout`].
pub fn serve(opts: &SendOptions, stop: &AtomicBool, totals: &mut Totals) -> Result<Ended> {
    serve_with_changes(opts, stop, totals, None)
}

/// Which tensors changed between two near generations, as the application knows it: called with
/// (`base`, `near`), the generation the far set mirrors and the one about to be sent (`near` >
/// `base`; the generations between were skipped), it returns the indices of the tensors that
/// differ (`None`: unknown, then [`SendOptions::changed_only`] decides: digests, or the whole
/// generation).
pub type Changes<'a> = &'a mut dyn FnMut(u64, u64) -> Option<Vec<usize>>;

/// As [`serve`], with `changes`: a writer in the same process that knows which tensors it changed
/// (a trainer updating some layers) says so, and only those are written, without the digests'
/// read of the whole set. A wrong answer
/// leaves the far set with stale tensors: the far side trusts it as it trusts the layout.
///
/// # Errors
/// As [`serve`].
pub fn serve_with_changes(
    opts: &SendOptions,
    stop: &AtomicBool,
    totals: &mut Totals,
    changes: Option<Changes<'_>>,
) -> Result<Ended> {
    crate::remote::nixl::probe()?;
    let hs = opts.lane.handshake_timeout;
    let mut stream = crate::remote::send::connect(&opts.connect, &opts.lane)?;
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| opts.connect.clone());
    let mut session = wire::handshake_send(&mut stream, &opts.secret, Instant::now() + hs)?;
    let reader = TensorSetReader::open_auto(&opts.set, &ReaderOptions::new())?;
    let place = match reader.stream() {
        Ok(s) => Place::Device(s.context().device().ordinal() as u32),
        Err(_) => Place::Host,
    };
    // UCX's CUDA transports work in the thread's current context: the reader's, for the whole
    // session; left after the lane (declared after it, so dropped before it) is gone.
    let ctx = reader.stream().ok().map(|s| s.context().clone());
    let _current = ctx.as_ref().map(|c| c.enter()).transpose()?;
    let layout = reader.layout().clone();
    let allocs = layout.allocations().len();
    if let Ok(a) = stream.local_addr() {
        crate::remote::check_binding(a.ip());
    }
    let agent = format!(
        "cuda-ipc-tsend-{}-{}-{:016x}",
        std::process::id(),
        opts.set,
        session_tag()?
    );
    let mut lane = Lane::new(&agent)?;
    for b in 0..reader.buffers() {
        for a in 0..allocs {
            let Some((addr, len)) = reader.allocation_span(b, a) else {
                continue;
            };
            let region = Region {
                addr,
                len: len as usize,
                place,
            };
            // SAFETY: the reader maps every buffer for its life (it outlives the lane: a `serve`
            // local declared before it); NIXL only reads it, in WRITEs of a generation this
            // bridge holds (the near writer stays off the buffer until the hold goes).
            unsafe { lane.register(key(b, a, allocs), region) }.map_err(|e| match (place, e) {
                // The near set's device memory is an import of its writer's: say so, as UCX may
                // refuse to register some kinds of imported memory.
                (Place::Device(_), Error::Remote(RemoteError::Nixl { call, reason })) => {
                    Error::from(RemoteError::Nixl {
                        call,
                        reason: format!(
                            "{reason} (registering allocation {a} of buffer {b} of tensor set {}, \
                             an import of its writer's device memory; UCX may not register \
                             imports of this memory kind: try the writer with another one, e.g. \
                             MemoryKind::Legacy or MemoryKind::Pool)",
                            opts.set
                        ),
                    })
                }
                (_, e) => e,
            })?;
        }
    }
    let hello = SetMsg::Hello {
        set: opts.set.clone(),
        kind: place.code().0,
        agent: agent.clone(),
        layout: WireLayout::of(&layout),
    };
    let hello = Msg::Set(hello);
    if hello.encode().len() + wire::MAC_LEN > wire::MAX_MESSAGE {
        return Err(Error::InvalidArgument(format!(
            "the layout of tensor set {} takes more than the {}-byte message limit of the lane",
            opts.set,
            wire::MAX_MESSAGE
        )));
    }
    session.send(&mut stream, &hello)?;
    let far = match session.recv(&mut stream, hs, "the far set's registrations")? {
        Msg::Set(SetMsg::Ready {
            agent: _,
            kind,
            device,
            buffers,
            regions,
            mirrored,
            md,
        }) => {
            let Some(fplace) = Place::from_code(kind, device) else {
                return Err(RemoteError::Protocol(format!("far memory kind {kind}")).into());
            };
            if buffers == 0 || regions.len() != buffers as usize * allocs {
                return Err(RemoteError::Protocol(format!(
                    "{} far regions for {buffers} buffers of {allocs} allocations",
                    regions.len()
                ))
                .into());
            }
            if regions
                .iter()
                .enumerate()
                .any(|(i, r)| r.len < layout.allocations()[i % allocs])
            {
                return Err(RemoteError::Protocol("a far allocation is too small".into()).into());
            }
            Far {
                remote: lane.load_remote(&md)?,
                place: fplace,
                regions,
                allocs,
                mirrored,
            }
        }
        Msg::Refused { reason } => return Err(RemoteError::refused(reason).into()),
        m => return Err(wire::unexpected_msg(&m, "the far set's registrations")),
    };
    tracing::info!(
        "tensor-set bridge: sending set {} ({} tensors, {} per generation, {place:?}) to {peer} \
         (NIXL agent {})",
        opts.set,
        layout.len(),
        crate::error::bytes(layout.bytes_per_buffer()),
        far.remote
    );
    let mut link = Link::start(stream, session, &opts.lane)?;
    let mut status = Status::new(
        Role::Send,
        &report::tensorset_status_name(&opts.set),
        &peer,
        place,
    );
    status.object = "tensorset";
    status.frames = totals.generations;
    status.write();
    let mut s = Sender {
        opts,
        stop,
        reader: &reader,
        lane: &mut lane,
        link: &mut link,
        far: &far,
        place,
        totals,
        status: &mut status,
        first_write: true,
        note_tag: session_tag()?,
        changes,
    };
    let r = s.run();
    lane.forget_remote(&far.remote);
    status.remove();
    match r {
        // A stop asked for ends the session as asked, wherever it was (waiting for the far side's
        // word, or in a generation's WRITEs, whose far generation is then never published).
        Err(e) if stop.load(Ordering::Relaxed) => {
            tracing::info!("tensor-set sending bridge: stopped ({e})");
            Ok(Ended::Stopped)
        }
        r => r,
    }
}

/// The NIXL key of allocation `a` of buffer `b`.
fn key(b: usize, a: usize, allocs: usize) -> u32 {
    (b * allocs + a) as u32
}

/// A random tag (`getrandom`).
fn session_tag() -> Result<u64> {
    let n = wire::nonce()?;
    Ok(u64::from_le_bytes(n[..8].try_into().unwrap_or_default()))
}

/// What the receiving bridge announced.
struct Far {
    remote: String,
    place: Place,
    regions: Vec<FarRegion>,
    allocs: usize,
    /// The near generation its newest far generation mirrors (0: none).
    mirrored: u64,
}

struct Sender<'a, 'c> {
    opts: &'a SendOptions,
    stop: &'a AtomicBool,
    reader: &'a TensorSetReader,
    lane: &'a mut Lane,
    link: &'a mut Link,
    far: &'a Far,
    place: Place,
    totals: &'a mut Totals,
    status: &'a mut Status,
    /// The session's first WRITE goes alone, and the transport is judged after it.
    first_write: bool,
    note_tag: u64,
    changes: Option<&'a mut (dyn FnMut(u64, u64) -> Option<Vec<usize>> + 'c)>,
}

impl Sender<'_, '_> {
    fn run(&mut self) -> Result<Ended> {
        // The far set mirrors what this bridge last mirrored: changed-only may start from there.
        // Otherwise (a new bridge, a far set made again, a near writer that ended meanwhile) the
        // first generation goes whole.
        // ... and only the same near set: a writer that replaced the mirrored one (its
        // generations numbered from 1 again, perhaps with the same content labels) starts whole.
        let incarnation = self.reader.incarnation();
        let resume = self.far.mirrored != 0
            && self.far.mirrored == self.totals.mirrored
            && self.totals.incarnation == incarnation;
        self.totals.incarnation = incarnation;
        if !resume {
            self.totals.digests.clear();
            self.totals.mirrored = 0;
        }
        let mut base = self.totals.mirrored;
        let mut last = 0u64;
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(Ended::Stopped);
            }
            self.check_link()?;
            // The newest generation past `last`, held only once there is one: a hold of the
            // generation already mirrored, kept while waiting (as a `current()` would be), would
            // stall an in-place writer, whose update waits on the GPU for every hold's release.
            let held = match self.reader.wait_newer(last, Some(self.opts.lane.heartbeat)) {
                Ok(h) => h,
                Err(Error::Timeout { .. }) => continue,
                Err(e) => return self.near_ended(e),
            };
            last = held.generation();
            if base != 0 && base == held.generation() && held.content() == self.totals.content {
                continue; // the far set has it already
            }
            self.generation(&held, base)?;
            base = held.generation();
        }
    }

    /// The near set ended (or failed): the receiving bridge is told, and the session ends.
    fn near_ended(&mut self, e: Error) -> Result<Ended> {
        // A near writer that comes next numbers its generations anew: nothing to resume from.
        self.totals.mirrored = 0;
        self.totals.digests.clear();
        let (closed, ended) = match &e {
            Error::TensorSet(TensorSetError::Closed(_)) => (true, Ended::Closed),
            Error::TensorSet(TensorSetError::WriterGone { .. }) => (false, Ended::WriterGone),
            _ => return Err(e),
        };
        tracing::info!("tensor-set bridge: {e}; telling the receiving bridge");
        self.link.send(&Msg::Upstream {
            closed,
            sent: self.totals.generations,
            reason: e.to_string(),
        })?;
        std::thread::sleep(Duration::from_millis(50));
        Ok(ended)
    }

    /// Refusals and errors the receiving bridge sent, and a lost link.
    fn check_link(&mut self) -> Result<()> {
        match self.link.next(Duration::ZERO)? {
            None => Ok(()),
            Some(Msg::Refused { reason }) => Err(RemoteError::refused(reason).into()),
            Some(m) => Err(wire::unexpected_msg(&m, "nothing (between generations)")),
        }
    }

    /// Waits for the receiving bridge's next message, polling NIXL meanwhile.
    fn expect(&mut self, what: &str) -> Result<SetMsg> {
        let start = Instant::now();
        let mut naps = 0;
        loop {
            if let Some(m) = self.link.next(Duration::ZERO)? {
                return match m {
                    Msg::Set(m) => Ok(m),
                    Msg::Refused { reason } => Err(RemoteError::refused(reason).into()),
                    m => Err(wire::unexpected_msg(&m, what)),
                };
            }
            if self.stop.load(Ordering::Relaxed) {
                return Err(RemoteError::Link("stopped".into()).into());
            }
            pause(start, self.opts.lane.spin, &mut naps);
            if naps > 0 {
                // Past the spin: block on the control connection for a while instead.
                if let Some(m) = self.link.next(Duration::from_millis(1))? {
                    return match m {
                        Msg::Set(m) => Ok(m),
                        Msg::Refused { reason } => Err(RemoteError::refused(reason).into()),
                        m => Err(wire::unexpected_msg(&m, what)),
                    };
                }
            }
        }
    }

    /// Mirrors the held near generation `held`; `base` is the near generation the far set mirrors
    /// now (0: none).
    fn generation(&mut self, held: &Held<'_>, base: u64) -> Result<()> {
        let layout = self.reader.layout();
        let near = held.generation();
        if self.place != Place::Host {
            // NIXL reads the memory from the host's side: the generation's ready word first.
            held.stream()?.synchronize()?;
        }
        let n = layout.len();
        let mut chosen = vec![true; n];
        let mut all = true;
        let told = match self.changes.as_mut() {
            Some(f) if base != 0 && self.totals.mirrored == base => f(base, near),
            _ => None,
        };
        if let Some(list) = told {
            all = false;
            chosen = vec![false; n];
            for i in list {
                let Some(c) = chosen.get_mut(i) else {
                    return Err(Error::InvalidArgument(format!("changed tensor {i} of {n}")));
                };
                *c = true;
            }
            // The digests no longer describe the generation the far set will mirror.
            self.totals.digests.clear();
        } else if self.opts.changed_only {
            let d = held.tensor_digests()?;
            if base != 0 && self.totals.digests.len() == n && self.totals.mirrored == base {
                all = false;
                for (i, c) in chosen.iter_mut().enumerate() {
                    *c = d[i] != self.totals.digests[i];
                }
            }
            self.totals.digests = d;
        }
        let tensors = if all {
            Vec::new()
        } else {
            (0..n as u32).filter(|&i| chosen[i as usize]).collect()
        };
        self.link.send(&Msg::Set(SetMsg::Begin {
            near,
            content: held.content(),
            base: if all { 0 } else { base },
            all,
            tensors,
        }))?;
        let buffer = match self.expect("the far buffer")? {
            SetMsg::Buffer { near: g, buffer } if g == near => buffer as usize,
            m => return Err(wire::unexpected_msg(&Msg::Set(m), "the far buffer")),
        };
        let far_buffers = self.far.regions.len() / self.far.allocs;
        if buffer >= far_buffers {
            return Err(
                RemoteError::Protocol(format!("far buffer {buffer} of {far_buffers}")).into(),
            );
        }
        let pieces = chunks(&runs(layout, &chosen), self.opts.chunk);
        let (writes, bytes) = self.write_all(held.buffer(), buffer, near, &pieces)?;
        self.link.send(&Msg::Set(SetMsg::Done {
            near,
            writes,
            bytes,
        }))?;
        match self.expect("the far generation's publication")? {
            SetMsg::Published { near: g, far } if g == near => {
                tracing::debug!(
                    "tensor-set bridge: near generation {near} is far generation {far}"
                );
            }
            m => {
                return Err(wire::unexpected_msg(
                    &Msg::Set(m),
                    "the far generation's publication",
                ));
            }
        }
        self.totals.generations += 1;
        self.totals.bytes += bytes;
        self.totals.mirrored = near;
        self.totals.content = held.content();
        self.status.frames = self.totals.generations;
        self.status.write();
        Ok(())
    }

    /// WRITEs `pieces` of near buffer `nb` into far buffer `fb`, up to
    /// [`SendOptions::in_flight`] at once; returns (WRITEs, bytes).
    fn write_all(
        &mut self,
        nb: usize,
        fb: usize,
        near: u64,
        pieces: &[Span],
    ) -> Result<(u32, u64)> {
        let allocs = self.far.allocs;
        let most = self.opts.in_flight.max(1);
        let timeout = self.opts.lane.write_timeout;
        // Never more in flight than pieces: `in_flight` may be any count (`usize::MAX`).
        let mut flight: VecDeque<Write> = VecDeque::with_capacity(most.min(pieces.len()));
        let mut bytes = 0u64;
        let r = (|| -> Result<()> {
            for (index, &(a, off, len)) in pieces.iter().enumerate() {
                while flight.len() >= most {
                    self.retire(&mut flight, timeout)?;
                }
                let fr = self.far.regions[fb * allocs + a];
                let Some(addr) = fr.addr.checked_add(off) else {
                    return Err(RemoteError::Protocol(format!(
                        "far allocation {a} at {:#x} ends past the address space",
                        fr.addr
                    ))
                    .into());
                };
                let target = Target {
                    addr,
                    // `off + len` lies in the allocation, whose far region is at least as long
                    // (checked at `Ready`).
                    len: fr.len.saturating_sub(off),
                    place: self.far.place,
                };
                let note = SetNote {
                    session: self.note_tag,
                    near,
                    index: index as u32,
                };
                let w = self.lane.post_range(
                    key(nb, a, allocs),
                    off,
                    len as usize,
                    target,
                    &self.far.remote,
                    note.encode().as_bytes(),
                )?;
                flight.push_back(w);
                bytes += len;
                if self.first_write {
                    self.first_write = false;
                    while !flight.is_empty() {
                        self.retire(&mut flight, timeout)?;
                    }
                    self.judge_transport()?;
                }
            }
            while !flight.is_empty() {
                self.retire(&mut flight, timeout)?;
            }
            Ok(())
        })();
        if r.is_err() {
            // The near buffer is let go only after the WRITEs that read it are done (bounded).
            let until = Instant::now() + timeout;
            for mut w in flight {
                while Instant::now() < until && !self.lane.poll(&mut w, timeout).unwrap_or(true) {
                    std::hint::spin_loop();
                }
            }
        }
        r.map(|()| (pieces.len() as u32, bytes))
    }

    /// Polls the oldest WRITE in flight; drops it once complete.
    fn retire(&mut self, flight: &mut VecDeque<Write>, timeout: Duration) -> Result<()> {
        if let Some(w) = flight.front_mut() {
            if self.lane.poll(w, timeout)? {
                flight.pop_front();
            } else {
                std::hint::spin_loop();
            }
        }
        Ok(())
    }

    /// Reads UCX's report of the session's first WRITE; with
    /// [`SendOptions::require_gpu_direct`], refuses a path that is not GPU-direct.
    fn judge_transport(&mut self) -> Result<()> {
        let t = report::from_ucx_log(self.place, self.far.place);
        match &t {
            Some(t) => t.log("tensor-set send"),
            None => tracing::info!(
                "tensor-set bridge: no UCX protocol report to read (UCX_PROTO_INFO=y and \
                 UCX_LOG_FILE make one)"
            ),
        }
        self.status.transport = t.clone();
        self.status.write();
        if self.totals.transport.is_none() {
            self.totals.transport = t.clone();
        }
        if let Some(why) = gpu_direct_refusal(
            self.opts.require_gpu_direct,
            self.place,
            self.far.place,
            t.as_ref(),
        ) {
            let _ = self.link.send(&Msg::Refused {
                reason: why.clone(),
            });
            std::thread::sleep(Duration::from_millis(50));
            return Err(RemoteError::Refused(why).into());
        }
        Ok(())
    }
}

/// Why a session that asked for GPU-direct must stop, given UCX's report `t` of its first WRITE
/// from memory `near` to memory `far`: device memory at either end reached otherwise
/// (host-staged, or a report this parser does not know, or none). `None`: go on (not required,
/// host memory at both ends, or GPU-direct).
fn gpu_direct_refusal(
    require: bool,
    near: Place,
    far: Place,
    t: Option<&report::Transport>,
) -> Option<String> {
    let path = t.map_or(Path::Unknown, |t| t.path);
    let device = near != Place::Host || far != Place::Host;
    (require && device && path != Path::GpuDirect).then(|| {
        format!(
            "GPU-direct was required, but UCX reaches the far memory {} ({}): check UCX_TLS \
             (cuda_ipc, rc_mlx5, gdr_copy) and UCX_NET_DEVICES",
            path.word(),
            t.map_or("no protocol report".into(), |t| t.summary())
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_required_gpu_direct_path_refuses_a_staged_or_unknown_device_path_only() {
        let put = "| remote memory write by ucp_put* from cuda/GPU0 to cuda |";
        let staged = format!("{put}\n| 0..inf | pipeline | cuda_copy/cuda, tcp/lo |");
        let direct = format!("{put}\n| 0..inf | zero-copy | cuda_ipc/cuda |");
        let d = Place::Device(0);
        let t = |s: &str, a, b| report::Transport::parse(s, a, b);
        let why = gpu_direct_refusal(true, d, d, Some(&t(&staged, d, d))).unwrap();
        assert!(why.contains("host-staged") && why.contains("tcp"), "{why}");
        assert!(
            gpu_direct_refusal(true, d, d, None)
                .unwrap()
                .contains("unknown")
        );
        assert_eq!(
            gpu_direct_refusal(true, d, d, Some(&t(&direct, d, d))),
            None
        );
        // Not asked for, or host memory at both ends: nothing to refuse.
        assert_eq!(
            gpu_direct_refusal(false, d, d, Some(&t(&staged, d, d))),
            None
        );
        let host = t("| 0..inf | zero-copy | tcp/lo |", Place::Host, Place::Host);
        assert_eq!(
            gpu_direct_refusal(true, Place::Host, Place::Host, Some(&host)),
            None
        );
        // Host memory near, device far, staged: refused.
        assert!(
            gpu_direct_refusal(true, Place::Host, d, Some(&t(&staged, Place::Host, d))).is_some()
        );
    }
}
