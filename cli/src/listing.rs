//! What `ls`, `watch`, `metrics`, `state` and `tui` look at: the registries and channels to
//! inspect ([`targets`]), their snapshots ([`collect`], a [`Listing`] with its JSON form), and the
//! rates between two refreshes ([`Rates`]). Shared by the commands; imports none of them.

use cuda_ipc::channel::inspect::{self as channel_inspect, ChannelSnapshot};
use cuda_ipc::registry::inspect::{self as registry_inspect, RegistrySnapshot};
use cuda_ipc::tensorset::inspect::{self as tensorset_inspect, TensorSetSnapshot};
use cuda_ipc::tensorset::reclaim as tensorset_reclaim;
use serde::{Serialize, Serializer};
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::error::Error;
use std::time::{Duration, Instant};

/// Everything `ls` found.
///
/// Its JSON form (`--json`) is the library's `serde` form of each snapshot (the
/// `cuda-ipc/serde` feature), with the few keys only this tool knows added ([`RegistryView`],
/// [`ChannelView`]).
#[derive(Debug, Default, Serialize)]
pub struct Listing {
    /// Registry segments.
    pub registries: Vec<RegistryView>,
    /// Channel control segments.
    pub channels: Vec<ChannelView>,
    /// Tensor sets (their manifests, with the generation channels' readers).
    pub tensor_sets: Vec<TensorSetView>,
    /// Segments that could not be read, with why.
    pub errors: Vec<SegmentError>,
    /// Objects listed but gone before they were read: closed normally meanwhile (no problem).
    pub closed_meanwhile: Vec<Closed>,
    /// Tensor sets of which parts stand but no manifest: leftovers of a writer killed half-way, or
    /// a set being made or closed right now.
    pub sets_without_manifest: Vec<SetWithoutManifest>,
    /// Host pool names (`cuda-ipc.hp.NAME`) without their channel's control segment, and those
    /// that are no pool `gc` may judge (a FIFO, a file that is not a pool, ...) whatever stands
    /// beside them: each blocks a host producer's creation of that channel.
    pub host_pools: Vec<HostPoolView>,
}

/// A host pool name of this user that `ls` shows on its own line ([`Listing::host_pools`]), with
/// what `gc` makes of it (the library's judgement, [`channel_inspect::host_pool`]).
///
/// JSON: `channel`, `segment`, `bytes`, `age_s`, `with_channel` (whether a control segment
/// stands beside it), `gc` (`removes`, `keeps` or `cannot judge`) and `why`.
#[derive(Debug)]
pub struct HostPoolView(pub channel_inspect::HostPoolEntry);

impl HostPoolView {
    /// What `gc` does with it (`removes`, `keeps`, `cannot judge`) and why: the same words in the
    /// text and JSON forms.
    pub fn gc(&self) -> (&'static str, String) {
        use channel_inspect::PoolJudgement;
        match &self.0.judgement {
            PoolJudgement::Stale(why) => ("removes", why.to_string()),
            PoolJudgement::Kept(why) => ("keeps", why.clone()),
            PoolJudgement::Unjudged(e) => ("cannot judge", e.to_string()),
            _ => ("keeps", "not judged by this version".to_string()),
        }
    }

    /// Whether it is something `gc` removes or cannot judge (exit status 1).
    pub fn has_problems(&self) -> bool {
        self.gc().0 != "keeps"
    }
}

impl Serialize for HostPoolView {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let p = &self.0;
        let (gc, why) = self.gc();
        serde_json::json!({
            "channel": p.channel,
            "segment": p.segment,
            "bytes": p.bytes,
            "age_s": p.age_secs,
            "with_channel": p.with_channel,
            "gc": gc,
            "why": why,
        })
        .serialize(s)
    }
}

/// The parts of a tensor set that stand without its manifest, each with what `gc` makes of it
/// (the library's judgement, [`tensorset_reclaim::parts_without_manifest`]).
///
/// JSON: `name`, `parts` (each `part` (`generation channel`, `host data`, `holders`),
/// `segment`, `bytes`, `age_s`, `young` (younger than 2 s: the judgement depends on its age),
/// `gc` (`removes`, `keeps` or `cannot judge`) and `why`).
#[derive(Debug)]
pub struct SetWithoutManifest {
    /// The set's name.
    pub name: String,
    /// The parts that stand.
    pub parts: Vec<tensorset_reclaim::PartWithoutManifest>,
}

impl SetWithoutManifest {
    /// What `gc` does with `p` (`removes`, `keeps`, `cannot judge`) and why: the same words in the
    /// text and JSON forms.
    pub fn gc(p: &tensorset_reclaim::PartWithoutManifest) -> (&'static str, String) {
        use tensorset_reclaim::Judgement;
        match &p.judgement {
            Judgement::Stale(s) => ("removes", s.why.to_string()),
            Judgement::Kept(why) => ("keeps", why.to_string()),
            Judgement::Unjudged(e) => ("cannot judge", e.to_string()),
            _ => ("keeps", "not judged by this version".to_string()),
        }
    }

    /// Whether a part is something `gc` removes or cannot judge (exit status 1).
    pub fn has_problems(&self) -> bool {
        self.parts.iter().any(|p| Self::gc(p).0 != "keeps")
    }
}

impl Serialize for SetWithoutManifest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        serde_json::json!({
            "name": self.name,
            "parts": self.parts.iter().map(|p| {
                let (gc, why) = Self::gc(p);
                serde_json::json!({
                    "part": p.part.word(),
                    "segment": p.segment,
                    "bytes": p.bytes,
                    "age_s": p.age_secs,
                    "young": p.young,
                    "gc": gc,
                    "why": why,
                })
            }).collect::<Vec<_>>(),
        })
        .serialize(s)
    }
}

/// An object that was listed, then gone (nothing under its name) when it was read: its owner
/// closed it in between. Not a problem.
#[derive(Debug, Serialize)]
pub struct Closed {
    /// `registry`, `channel`, `tensorset` or `host pool`.
    pub kind: &'static str,
    /// Its name, as for [`SegmentError::name`].
    pub name: String,
}

/// A segment that could not be inspected.
#[derive(Debug, Serialize)]
pub struct SegmentError {
    /// `registry`, `channel`, `tensorset` (or `segment`: a NAME that names nothing any more).
    pub kind: &'static str,
    /// The registry's segment name, the channel name or the set name.
    pub name: String,
    /// What went wrong.
    pub error: String,
}

/// One registry, and its publish rate.
///
/// JSON: the snapshot's own form plus `leftovers` ([`RegistrySnapshot::has_leftovers`], a
/// method, not a field) and `publishes_per_s`.
#[derive(Debug)]
pub struct RegistryView {
    /// What the registry holds.
    pub snapshot: RegistrySnapshot,
    /// Publishes per second since the previous refresh (`watch` only).
    pub publishes_per_s: Option<f64>,
}

/// One channel, and its rates.
///
/// JSON: the snapshot's own form plus `leftovers` ([`ChannelSnapshot::has_leftovers`]),
/// `frames_per_s`, and `received_per_s` in each consumer's object.
#[derive(Debug)]
pub struct ChannelView {
    /// The channel's state.
    pub snapshot: ChannelSnapshot,
    /// Frames per second since the previous refresh (`watch` only).
    pub frames_per_s: Option<f64>,
    /// Frames received per second since the previous refresh by each consumer of
    /// `snapshot.consumers`, in that order (`watch` only).
    pub received_per_s: Vec<Option<f64>>,
    /// The remote lane's bridge of this channel, when one wrote its status file.
    pub bridge: Option<crate::bridge::BridgeStatus>,
}

// The one adapter between the snapshots and `--json`. The rates are this tool's (`watch` measures
// them between two refreshes; no snapshot has them), `leftovers` is a method: they are added to
// the snapshot's JSON value. A `Value` object writes its keys in sorted order (JSON objects have
// none).
fn snapshot_json<T: Serialize, E: serde::ser::Error>(
    snapshot: &T,
    add: impl FnOnce(&mut Map<String, Value>),
) -> Result<Value, E> {
    let mut v = serde_json::to_value(snapshot).map_err(E::custom)?;
    if let Some(m) = v.as_object_mut() {
        add(m);
    }
    Ok(v)
}

/// One tensor set.
///
/// JSON: `name`, `writer` (pid), `writer_liveness`, `memory`, `buffered`, `buffers`,
/// `allocations`, `tensors`, `bytes`, `generation` (null where `channel_problem` is set), `readers` (each `slot`, `pid`, `liveness`,
/// `held`), `holds`, `holders` (each `slot`, `role`, `pid`, `liveness`, `since_ms`: who serves the
/// set's fds), `live_holders`, `whole_generation` (what a reader opened after the writer's death
/// reads), `data_problem` (why a host set's data segment cannot be used, as a reader's open
/// finds it, or null), `channel_problem` (why the generation channel could not be read, or null: then
/// `generation`, `readers` and `holds` say nothing), `fingerprint` (hex), `leftovers`, `bridge` (a
/// tensor-set bridge's status, or null).
#[derive(Debug)]
pub struct TensorSetView {
    /// The set's state.
    pub snapshot: TensorSetSnapshot,
    /// The tensor-set bridge of this set (either end), when one wrote its status file.
    pub bridge: Option<crate::bridge::BridgeStatus>,
}

impl TensorSetView {
    /// Whether a dead writer or dead readers left something `gc` removes (a dead writer's set
    /// that a live holder serves is kept, attachable: not a leftover).
    pub fn has_leftovers(&self) -> bool {
        let s = &self.snapshot;
        (s.writer_liveness == cuda_ipc::identity::Liveness::Dead && s.live_holders() == 0)
            || s.readers
                .iter()
                .any(|r| r.liveness == cuda_ipc::identity::Liveness::Dead)
    }
}

impl Serialize for TensorSetView {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let t = &self.snapshot;
        let live = |l| crate::text::liveness(l);
        serde_json::json!({
            "name": t.name,
            "writer": t.writer.pid,
            "writer_liveness": live(t.writer_liveness),
            "memory": t.memory,
            "buffered": t.buffered,
            "buffers": t.buffers,
            "allocations": t.allocations,
            "tensors": t.tensors,
            "bytes": t.bytes,
            // Not known where the generation channel could not be read.
            "generation": t.channel_problem.is_none().then_some(t.generation),
            "readers": t.readers.iter().map(|r| serde_json::json!({
                "slot": r.slot,
                "pid": r.identity.pid,
                "liveness": live(r.liveness),
                "held": r.held,
            })).collect::<Vec<_>>(),
            "holds": t.holds,
            "holders": t.holders.iter().map(|h| serde_json::json!({
                "slot": h.slot,
                "role": h.role.word(),
                "pid": h.identity.pid,
                "liveness": live(h.liveness),
                "since_ms": h.since_ms,
            })).collect::<Vec<_>>(),
            "live_holders": t.live_holders(),
            "whole_generation": t.whole_generation,
            "channel_problem": t.channel_problem,
            "data_problem": t.data_problem,
            "fingerprint": t.fingerprint.iter().map(|b| format!("{b:02x}")).collect::<String>(),
            "leftovers": self.has_leftovers(),
            "bridge": self.bridge,
        })
        .serialize(s)
    }
}

impl Serialize for RegistryView {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        snapshot_json(&self.snapshot, |m| {
            m.insert("leftovers".into(), self.snapshot.has_leftovers().into());
            m.insert("publishes_per_s".into(), self.publishes_per_s.into());
        })?
        .serialize(s)
    }
}

impl Serialize for ChannelView {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        snapshot_json(&self.snapshot, |m| {
            m.insert("leftovers".into(), self.snapshot.has_leftovers().into());
            m.insert("frames_per_s".into(), self.frames_per_s.into());
            m.insert(
                "bridge".into(),
                serde_json::to_value(&self.bridge).unwrap_or(Value::Null),
            );
            if let Some(Value::Array(cs)) = m.get_mut("consumers") {
                for (c, r) in cs.iter_mut().zip(&self.received_per_s) {
                    if let Some(c) = c.as_object_mut() {
                        c.insert("received_per_s".into(), (*r).into());
                    }
                }
            }
        })?
        .serialize(s)
    }
}

impl Listing {
    /// Whether nothing was found: no object, no segment that could not be read, none closed
    /// meanwhile, no part of a set or host pool standing alone.
    pub fn is_empty(&self) -> bool {
        self.registries.is_empty()
            && self.channels.is_empty()
            && self.tensor_sets.is_empty()
            && self.errors.is_empty()
            && self.closed_meanwhile.is_empty()
            && self.sets_without_manifest.is_empty()
            && self.host_pools.is_empty()
    }

    /// Whether anything here is a problem (exit status 1).
    pub fn has_problems(&self) -> bool {
        !self.errors.is_empty()
            || self.registries.iter().any(|r| r.snapshot.has_leftovers())
            || self.channels.iter().any(|c| c.snapshot.has_leftovers())
            || self.tensor_sets.iter().any(TensorSetView::has_leftovers)
            || self
                .sets_without_manifest
                .iter()
                .any(SetWithoutManifest::has_problems)
            || self.host_pools.iter().any(HostPoolView::has_problems)
            || self
                .channels
                .iter()
                .any(|c| c.snapshot.pool_problem.is_some())
            || self
                .tensor_sets
                .iter()
                .any(|t| t.snapshot.data_problem.is_some())
            || self.tensor_sets.iter().any(|t| {
                t.snapshot.channel_problem.is_some()
                    && t.snapshot.writer_liveness != cuda_ipc::identity::Liveness::Dead
            })
    }
}

/// The registries, channels, tensor sets and quota ledger to look at: all, or those `name` names
/// (`crate::names`).
#[derive(Default)]
pub(crate) struct Targets {
    pub registries: Vec<String>,
    pub channels: Vec<String>,
    pub tensor_sets: Vec<String>,
    /// Channel names with a host pool name (`cuda-ipc.hp.NAME`), whatever stands there.
    pub host_pools: Vec<String>,
    /// The quota ledger (its segment name) a NAME names, if one stands there (`ls` shows it, `gc`
    /// scans it); `None` without a NAME: the ledgers are the quota module's to list.
    pub ledger: Option<String>,
}

/// Why [`targets`] found nothing for a NAME (the error it returns then, boxed: `downcast_ref`
/// tells the two apart).
#[derive(Debug)]
pub(crate) enum NoTarget {
    /// The NAME names nothing now (a typo, or an object not made yet): `no registry, channel or
    /// tensor set named …`, `nothing stands at …`.
    Nothing(String),
    /// The NAME is a process's own file, never an object: refused, saying what it is.
    Refused(String),
}

impl std::fmt::Display for NoTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoTarget::Nothing(s) | NoTarget::Refused(s) => f.write_str(s),
        }
    }
}

impl Error for NoTarget {}

/// Finds the registries, channels and tensor sets in `/dev/shm`, or those `name` names by the
/// command line's one rule (`crate::names`): an own name names the registry, channel, tensor set
/// and quota ledger of that name, never read for a prefix; `/dev/shm/FILE` the one object FILE
/// belongs to. A process's own file (`cuda-ipc.live.…`, `cuda-ipc.fd.…`, `cuda-ipc.br.…`) is
/// refused, saying what it is ([`NoTarget::Refused`]); a NAME that names nothing is
/// [`NoTarget::Nothing`].
pub(crate) fn targets(name: Option<&str>) -> Result<Targets, Box<dyn Error>> {
    use crate::names::{FileOf, Name, file_of};
    let mut registries = registry_inspect::list_registries()?;
    let mut channels = channel_inspect::list_channels()?;
    // Every name with a part of a set (a part without its manifest is listed as unreadable:
    // what a writer killed half-way left, for `gc`).
    let mut tensor_sets = tensorset_inspect::list_tensor_sets()?;
    let mut host_pools = channel_inspect::list_host_pools()?;
    let Some(arg) = name else {
        return Ok(Targets {
            registries,
            channels,
            tensor_sets,
            host_pools,
            ledger: None,
        });
    };
    // Whatever stands there (a FIFO, a directory): inspection names it without opening it in a
    // way that could block.
    let exists = |seg: &str| {
        !seg.contains('/')
            && std::fs::symlink_metadata(format!("{}/{seg}", cuda_ipc::raw::shm::SHM_DIR)).is_ok()
    };
    // The names to look for, of each kind.
    let (reg, chan, set, ledger) = match crate::names::parse(arg) {
        Name::Own(n) => (Some(n), Some(n), Some(n), Some(n)),
        // A file that holds a registry is that registry, whatever its name.
        Name::File(f) if registries.iter().any(|r| r == f) => (Some(f), None, None, None),
        Name::File(f) => match file_of(f) {
            FileOf::Channel(c) => (None, Some(c), None, None),
            FileOf::Set(s) => (None, None, Some(s), None),
            FileOf::Ledger => (None, None, None, Some(f)),
            FileOf::Process(what) => {
                return Err(NoTarget::Refused(crate::names::process_file(f, what)).into());
            }
            FileOf::Registry => (Some(f), None, None, None),
        },
    };
    registries.retain(|r| Some(r.as_str()) == reg);
    channels.retain(|c| Some(c.as_str()) == chan);
    tensor_sets.retain(|t| Some(t.as_str()) == set);
    host_pools.retain(|c| Some(c.as_str()) == chan);
    // A segment that exists but was not listed (another user's, or not a registry): inspected
    // anyway, so the error says why (owner, magic) instead of "no such name".
    if let Some(chan) = chan {
        if channels.is_empty() && exists(&channel_inspect::segment_name(chan)) {
            channels.push(chan.to_string());
        }
        // A host pool name of another user's, or one that stands alone: shown (or passed over by
        // `gc`) as what blocks a host producer of that channel.
        if host_pools.is_empty() && exists(&channel_inspect::pool_segment_name(chan)) {
            host_pools.push(chan.to_string());
        }
    }
    // A registry's file that is by its name another kind's (a channel's control segment, a
    // ledger, a process's file) is taken for a registry only when it holds one (listed above).
    if let Some(reg) = reg
        && registries.is_empty()
        && channels.is_empty()
        && file_of(reg) == FileOf::Registry
        && exists(reg)
    {
        registries.push(reg.to_string());
    }
    if let Some(set) = set
        && tensor_sets.is_empty()
        && crate::names::SET_PARTS
            .iter()
            .any(|p| exists(&format!("{p}{set}")))
    {
        // Another user's set (any part of it, as `gc` without a NAME lists their parts): `gc`
        // passes it over, and `ls` inspects it, so the error names its owner.
        tensor_sets.push(set.to_string());
    }
    // A quota ledger's name, when something stands there that is no registry (whatever it is:
    // its reading says what, and a FIFO or another user's file is never removed).
    let ledger = ledger
        .filter(|l| file_of(l) == FileOf::Ledger && exists(l) && !registries.iter().any(|r| r == l))
        .map(str::to_string);
    if registries.is_empty()
        && channels.is_empty()
        && tensor_sets.is_empty()
        && host_pools.is_empty()
        && ledger.is_none()
    {
        if let Name::Own(n) = crate::names::parse(arg)
            && let FileOf::Process(what) = file_of(n)
            && exists(n)
        {
            return Err(NoTarget::Refused(crate::names::process_file(n, what)).into());
        }
        return Err(NoTarget::Nothing(match crate::names::parse(arg) {
            Name::Own(n) => {
                // A ledger's name that names none says so too (`gc` and `ls` take ledgers' names).
                let ledger = if file_of(n) == FileOf::Ledger {
                    ", nor a quota ledger"
                } else {
                    ""
                };
                format!(
                    "no registry, channel or tensor set named {n:?} in {}{ledger}",
                    cuda_ipc::raw::shm::SHM_DIR
                )
            }
            Name::File(_) => format!("nothing stands at {arg}"),
        })
        .into());
    }
    Ok(Targets {
        registries,
        channels,
        tensor_sets,
        host_pools,
        ledger,
    })
}

impl Listing {
    /// Records that `kind` `name` could not be inspected: an error, unless nothing stands under
    /// its name any more ([`cuda_ipc::cleanup::is_gone`]: closed between the listing and the
    /// reading, [`Listing::closed_meanwhile`]).
    fn unreadable(&mut self, kind: &'static str, name: &str, e: cuda_ipc::Error) {
        let name = name.to_string();
        if cuda_ipc::cleanup::is_gone(&e) {
            self.closed_meanwhile.push(Closed { kind, name });
        } else {
            self.errors.push(SegmentError {
                kind,
                name,
                error: e.to_string(),
            });
        }
    }
}

/// Inspects every target.
pub(crate) fn collect(t: &Targets) -> Listing {
    let mut l = Listing::default();
    for r in &t.registries {
        match registry_inspect::inspect(r) {
            Ok(snapshot) => l.registries.push(RegistryView {
                snapshot,
                publishes_per_s: None,
            }),
            Err(e) => l.unreadable("registry", r, e),
        }
    }
    for c in &t.channels {
        match channel_inspect::inspect(c) {
            Ok(snapshot) => l.channels.push(ChannelView {
                frames_per_s: None,
                received_per_s: vec![None; snapshot.consumers.len()],
                bridge: crate::bridge::read(c),
                snapshot,
            }),
            Err(e) => l.unreadable("channel", c, e),
        }
    }
    for t in &t.tensor_sets {
        match tensorset_inspect::inspect(t) {
            Ok(snapshot) => l.tensor_sets.push(TensorSetView {
                bridge: crate::bridge::read(&format!("ts.{t}")),
                snapshot,
            }),
            // No manifest: the parts that stand without one, if any (else closed meanwhile).
            Err(e) if cuda_ipc::cleanup::is_gone(&e) => {
                match tensorset_reclaim::parts_without_manifest(t) {
                    Ok(parts) if !parts.is_empty() => {
                        l.sets_without_manifest.push(SetWithoutManifest {
                            name: t.clone(),
                            parts,
                        })
                    }
                    Ok(_) => l.unreadable("tensorset", t, e),
                    Err(e) => l.unreadable("tensorset", t, e),
                }
            }
            Err(e) => l.unreadable("tensorset", t, e),
        }
    }
    for c in &t.host_pools {
        let Some(p) = channel_inspect::host_pool(c) else {
            // Gone since it was listed (its producer closed); said only when it was all.
            if !t.channels.contains(c) {
                l.closed_meanwhile.push(Closed {
                    kind: "host pool",
                    name: c.clone(),
                });
            }
            continue;
        };
        // A pool beside its channel's segment is that channel's to speak for, unless it is
        // nothing `gc` may judge (then it blocks that channel's host producer: shown, where the
        // channel's own line does not say why already, `pool_problem`).
        let said = l
            .channels
            .iter()
            .any(|v| v.snapshot.name == *c && v.snapshot.pool_problem.is_some());
        if !p.with_channel
            || (!said && matches!(p.judgement, channel_inspect::PoolJudgement::Unjudged(_)))
        {
            l.host_pools.push(HostPoolView(p));
        }
    }
    l
}

/// What the previous refresh saw, for rates.
#[derive(Default)]
struct Previous {
    at: Option<Instant>,
    registry_seq: HashMap<String, u64>,
    channel_head: HashMap<String, u64>,
    /// (channel, slot, pid, generation) → received.
    consumer_received: HashMap<(String, usize, u32, u64), u64>,
}

fn per_s(now: u64, before: Option<&u64>, dt: Option<Duration>) -> Option<f64> {
    let (b, dt) = (before?, dt?);
    let secs = dt.as_secs_f64();
    (secs > 0.0 && now >= *b).then(|| (now - b) as f64 / secs)
}

/// The rates between refreshes, for `watch`'s live view: what the previous refresh saw.
#[derive(Default)]
pub struct Rates(Previous);

impl Rates {
    /// Fills `l`'s rates from the difference to the previous call, and remembers `l`.
    pub fn add(&mut self, l: &mut Listing, now: Instant) {
        add_rates(l, &mut self.0, now);
    }
}

fn add_rates(l: &mut Listing, prev: &mut Previous, now: Instant) {
    let dt = prev.at.map(|t| now - t);
    let mut next = Previous {
        at: Some(now),
        ..Default::default()
    };
    for r in &mut l.registries {
        let s = &r.snapshot;
        r.publishes_per_s = per_s(s.last_seq, prev.registry_seq.get(&s.name), dt);
        next.registry_seq.insert(s.name.clone(), s.last_seq);
    }
    for c in &mut l.channels {
        let s = &c.snapshot;
        c.frames_per_s = per_s(s.head, prev.channel_head.get(&s.name), dt);
        next.channel_head.insert(s.name.clone(), s.head);
        c.received_per_s = s
            .consumers
            .iter()
            .map(|x| {
                let key = (s.name.clone(), x.index, x.identity.pid, x.generation);
                let r = per_s(x.received, prev.consumer_received.get(&key), dt);
                next.consumer_received.insert(key, x.received);
                r
            })
            .collect();
    }
    *prev = next;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_come_from_differences_between_refreshes() {
        assert_eq!(per_s(10, None, Some(Duration::from_secs(1))), None);
        assert_eq!(
            per_s(30, Some(&10), Some(Duration::from_secs(2))),
            Some(10.0)
        );
        // A counter that went back (a new segment of the same name) gives no rate.
        assert_eq!(per_s(3, Some(&10), Some(Duration::from_secs(1))), None);
    }
}
