//! `ls` and `watch`: what registries and channels exist in `/dev/shm` and who holds what.

use crate::Outcome;
use comfy_table::{Table, presets};
use cuda_ipc::channel::inspect::{self as channel_inspect, BufferState, ChannelSnapshot};
use cuda_ipc::channel::{ConsumerState, Delivery, ProducerState, UnknownCode};
use cuda_ipc::identity::Liveness;
use cuda_ipc::registry::inspect::{self as registry_inspect, RegistrySnapshot};
use cuda_ipc::token::TokenKind;
use serde::{Serialize, Serializer};
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::error::Error;
use std::io::IsTerminal;
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
    /// Segments that could not be read, with why.
    pub errors: Vec<SegmentError>,
}

/// A segment that could not be inspected.
#[derive(Debug, Serialize)]
pub struct SegmentError {
    /// `registry` or `channel`.
    pub kind: &'static str,
    /// The registry's segment name or the channel name.
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
    /// Whether anything here is a problem (exit status 1).
    pub fn has_problems(&self) -> bool {
        !self.errors.is_empty()
            || self.registries.iter().any(|r| r.snapshot.has_leftovers())
            || self.channels.iter().any(|c| c.snapshot.has_leftovers())
    }
}

pub(crate) fn liveness(l: Liveness) -> &'static str {
    match l {
        Liveness::Alive => "alive",
        Liveness::Dead => "dead",
        _ => "unknown",
    }
}

/// A consumer's delivery policy as shown: a code this build does not know is shown as
/// `unknown(N)`, never as one of the policies.
pub(crate) fn delivery_name(d: Result<Delivery, UnknownCode>) -> String {
    match d {
        Ok(Delivery::EveryFrame) => "every-frame".to_string(),
        Ok(Delivery::LatestOnly) => "latest-only".to_string(),
        Ok(other) => format!("{other:?}"),
        Err(e) => format!("unknown({})", e.code),
    }
}

/// A consumer slot's state as shown; an unknown code is shown as `unknown(N)`.
pub(crate) fn consumer_state_name(s: Result<ConsumerState, UnknownCode>) -> String {
    match s {
        Ok(ConsumerState::Active) => "attached".to_string(),
        Ok(ConsumerState::Claiming) => "attaching".to_string(),
        Ok(other) => format!("{other:?}").to_lowercase(),
        Err(e) => format!("unknown({})", e.code),
    }
}

/// The producer's state as shown; an unknown code is shown as `unknown(N)`.
pub(crate) fn producer_state_name(s: Result<ProducerState, UnknownCode>) -> String {
    match s {
        Ok(ProducerState::Open) => "open".to_string(),
        Ok(ProducerState::Closed) => "closed".to_string(),
        Ok(other) => format!("{other:?}").to_lowercase(),
        Err(e) => format!("unknown({})", e.code),
    }
}

/// The registries and channels to look at: all, or those `name` names.
pub(crate) struct Targets {
    pub registries: Vec<String>,
    pub channels: Vec<String>,
}

/// Finds the registries and channels in `/dev/shm`, or the ones `name` names (a registry's
/// segment name, a channel name, or a channel's segment name `cuda-ipc.ch.NAME`).
pub(crate) fn targets(name: Option<&str>) -> Result<Targets, Box<dyn Error>> {
    let mut registries = registry_inspect::list_registries()?;
    let mut channels = channel_inspect::list_channels()?;
    if let Some(n) = name {
        let chan = n.strip_prefix(channel_inspect::SEGMENT_PREFIX).unwrap_or(n);
        registries.retain(|r| r == n);
        channels.retain(|c| c == chan);
        // A segment that exists but was not listed (another user's, or not a registry): inspected
        // anyway, so the error says why (owner, magic) instead of "no such name".
        let exists = |seg: &str| {
            !seg.contains('/')
                // Whatever it is (a FIFO, a directory): inspection names it without opening it
                // in a way that could block.
                && std::fs::symlink_metadata(format!("{}/{seg}", cuda_ipc::raw::shm::SHM_DIR)).is_ok()
        };
        if registries.is_empty() && channels.is_empty() {
            if exists(&channel_inspect::segment_name(chan)) {
                channels.push(chan.to_string());
            } else if n == chan && exists(n) {
                registries.push(n.to_string());
            }
        }
        if registries.is_empty() && channels.is_empty() {
            return Err(format!(
                "no registry or channel named {n:?} in {}",
                cuda_ipc::raw::shm::SHM_DIR
            )
            .into());
        }
    }
    Ok(Targets {
        registries,
        channels,
    })
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
            Err(e) => l.errors.push(SegmentError {
                kind: "registry",
                name: r.clone(),
                error: e.to_string(),
            }),
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
            Err(e) => l.errors.push(SegmentError {
                kind: "channel",
                name: c.clone(),
                error: e.to_string(),
            }),
        }
    }
    l
}

/// `1234 B`, `31.6 MiB`.
pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

fn rate(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"))
}

fn list(v: &[usize]) -> String {
    if v.is_empty() {
        "-".to_string()
    } else {
        v.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(presets::NOTHING);
    t.set_header(header.iter().map(|h| h.to_string()));
    t
}

fn indent(t: &Table) -> String {
    t.lines()
        .map(|l| format!("  {}", l.strip_prefix(' ').unwrap_or(&l).trim_end()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The human-readable form of a listing; `rates` adds the rate columns.
pub fn render(l: &Listing, rates: bool) -> String {
    let mut out = String::new();
    if l.registries.is_empty() && l.channels.is_empty() && l.errors.is_empty() {
        out.push_str("no cuda-ipc registries or channels in /dev/shm\n");
    }
    for RegistryView {
        snapshot: r,
        publishes_per_s,
    } in &l.registries
    {
        out.push_str(&format!(
            "registry {}: {} of {} slots used, {} participants, last seq {}, {}{}\n",
            r.name,
            r.records.len(),
            r.capacity,
            r.participants.len(),
            r.last_seq,
            bytes(r.segment_bytes),
            if rates {
                format!(", {} publishes/s", rate(*publishes_per_s))
            } else {
                String::new()
            }
        ));
        if !r.records.is_empty() {
            let mut t = table(&[
                "RECORD", "KIND", "SEQ", "OWNER", "PROCESS", "TOKEN", "META", "SLOT",
            ]);
            for x in &r.records {
                let rec = &x.record;
                t.add_row(vec![
                    rec.name.clone(),
                    rec.kind.to_string(),
                    rec.seq.to_string(),
                    rec.owner.pid.to_string(),
                    liveness(x.owner_liveness).to_string(),
                    bytes(rec.token.len() as u64),
                    bytes(rec.metadata.len() as u64),
                    rec.slot.to_string(),
                ]);
            }
            out.push_str(&indent(&t));
            out.push('\n');
        }
        if !r.participants.is_empty() {
            let ps: Vec<String> = r
                .participants
                .iter()
                .map(|p| {
                    format!(
                        "{} {}",
                        p.identity.pid,
                        if p.dead { "dead" } else { "alive" }
                    )
                })
                .collect();
            out.push_str(&format!("  participants: {}\n", ps.join(", ")));
        }
        for s in &r.locked_slots {
            out.push_str(&format!(
                "  slot {} locked by pid {} ({}{})\n",
                s.slot,
                s.writer_pid,
                if s.writer_dead { "dead" } else { "alive" },
                if s.writing { ", write open" } else { "" }
            ));
        }
        for (_, reason) in &r.corrupt_slots {
            out.push_str(&format!("  corrupt: {reason}\n"));
        }
        if r.has_leftovers() {
            out.push_str("  problem: dead processes left records or entries here; `cuda-ipc gc` removes them\n");
        }
    }
    for ChannelView {
        snapshot: c,
        frames_per_s,
        received_per_s,
        bridge,
    } in &l.channels
    {
        out.push_str(&format!(
            "channel {}: producer {} {}, {}, head {}, published {}, {} × {} buffers, {} of {} consumers, forced releases {}{}\n",
            c.name,
            c.producer.pid,
            liveness(c.producer_liveness),
            producer_state_name(c.producer_state),
            c.head,
            c.published,
            c.buffers.len(),
            bytes(c.buffer_bytes),
            c.consumers.len(),
            c.consumer_capacity,
            c.forced_releases,
            if rates {
                format!(", {} frames/s", rate(*frames_per_s))
            } else {
                String::new()
            }
        ));
        if let Some(b) = bridge {
            out.push_str(&crate::bridge::describe(b));
        }
        let mut t = table(&[
            "BUFFER", "STATE", "SEQ", "HOLDERS", "BYTES", "META", "DEVICE",
        ]);
        for b in &c.buffers {
            let (state, seq) = match b.state {
                BufferState::Empty => ("empty", None),
                BufferState::Writing => ("writing", None),
                BufferState::Frame(s) => ("frame", Some(s)),
                _ => ("unknown", None),
            };
            let holders: Vec<usize> = (0..64).filter(|k| b.hold_mask & (1u64 << k) != 0).collect();
            t.add_row(vec![
                b.index.to_string(),
                state.to_string(),
                seq.map_or_else(|| "-".to_string(), |s| s.to_string()),
                list(&holders),
                // The pool's buffer size when the token does not decode.
                bytes(b.memory.map_or(c.buffer_bytes, |t| t.len)),
                bytes(u64::from(b.meta_len)),
                b.memory.map_or_else(
                    || "-".to_string(),
                    |t| match t.kind {
                        TokenKind::HostMemory => "host".to_string(),
                        _ => t.device.to_string(),
                    },
                ),
            ]);
        }
        out.push_str(&indent(&t));
        out.push('\n');
        if !c.consumers.is_empty() {
            let mut h = vec![
                "CONSUMER", "PID", "PROCESS", "DELIVERY", "CURSOR", "LAG", "RECEIVED", "DROPPED",
                "HOLDS",
            ];
            if rates {
                h.push("RECV/S");
            }
            let mut t = table(&h);
            for (k, x) in c.consumers.iter().enumerate() {
                let mut row = vec![
                    format!(
                        "{}{}",
                        x.index,
                        match consumer_state_name(x.state).as_str() {
                            "attached" => String::new(),
                            other => format!(" ({other})"),
                        }
                    ),
                    x.identity.pid.to_string(),
                    liveness(x.liveness).to_string(),
                    delivery_name(x.delivery),
                    x.cursor.to_string(),
                    x.lag.to_string(),
                    x.received.to_string(),
                    x.dropped.to_string(),
                    list(&x.holds),
                ];
                if rates {
                    row.push(rate(received_per_s.get(k).copied().flatten()));
                }
                t.add_row(row);
            }
            out.push_str(&indent(&t));
            out.push('\n');
        }
        if c.producer_liveness == Liveness::Dead {
            out.push_str("  problem: the producer is dead; `cuda-ipc gc` removes this segment\n");
        } else if c.has_leftovers() {
            out.push_str("  problem: dead consumers are attached; `cuda-ipc gc` frees their slots and holds\n");
        }
    }
    for e in &l.errors {
        out.push_str(&format!(
            "{} {}: cannot read: {}\n",
            e.kind, e.name, e.error
        ));
    }
    out
}

fn outcome(l: &Listing) -> Outcome {
    if l.has_problems() {
        Outcome::Problems
    } else {
        Outcome::Ok
    }
}

/// `cuda-ipc ls [NAME] [--json]`: the listing, then (without a NAME) the quota budgets with
/// their holders (other users' ledgers skipped with a note) and the GPUs through NVML with the
/// participants on them (JSON: `quotas`, `quota_errors`, `quota_skipped`, `gpu` and
/// `gpu_processes` beside the listing's keys).
pub fn run_ls(name: Option<&str>, json: bool) -> Result<Outcome, Box<dyn Error>> {
    let l = collect(&targets(name)?);
    // Other users' ledgers are skipped with a note, as their channels are not listed.
    let crate::quota::Ledgers {
        snapshots: quotas,
        errors: quota_errors,
        skipped: quota_skipped,
    } = if name.is_none() {
        crate::quota::collect_all()
    } else {
        Default::default()
    };
    // The GPUs (NVML), without a NAME only: `ls NAME` stays about that segment.
    let gpu = name.is_none().then(|| {
        let g = crate::gpu::query();
        let m = crate::gpu::match_processes(
            g.gpus(),
            &crate::state::participants(&l),
            crate::gpu::own_pid_ns(),
            crate::gpu::proc_facts,
        );
        (g, m)
    });
    if json {
        let mut v = serde_json::to_value(&l)?;
        if let Some(m) = v.as_object_mut() {
            m.insert("quotas".into(), serde_json::to_value(&quotas)?);
            m.insert(
                "quota_errors".into(),
                quota_errors
                    .iter()
                    .map(|(n, e)| serde_json::json!({"name": n, "error": e}))
                    .collect(),
            );
            m.insert(
                "quota_skipped".into(),
                serde_json::to_value(&quota_skipped)?,
            );
            if let Some((g, mat)) = &gpu {
                m.insert("gpu".into(), serde_json::to_value(g)?);
                m.insert("gpu_processes".into(), serde_json::to_value(mat)?);
            }
        }
        out!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        out_nonl!(
            "{}{}{}{}",
            render(&l, false),
            crate::quota::render(&quotas, &quota_errors),
            crate::quota::render_skipped(&quota_skipped),
            gpu.as_ref()
                .map(|(g, m)| crate::gpu::render(g, m))
                .unwrap_or_default()
        );
    }
    Ok(if quota_errors.is_empty() {
        outcome(&l)
    } else {
        Outcome::Problems
    })
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

/// `cuda-ipc watch [NAME] [--interval MS] [--count N] [--json] [--plain]`: the live view
/// (`crate::tui`) on a terminal; the refreshed lines (`--plain`, and whenever stdout is not a
/// terminal) or JSON lines otherwise.
pub fn run_watch(
    name: Option<&str>,
    interval_ms: u64,
    count: Option<u64>,
    json: bool,
    plain: bool,
) -> Result<Outcome, Box<dyn Error>> {
    if !json && !plain && std::io::stdout().is_terminal() {
        return crate::tui::run(name, interval_ms, count);
    }
    let interval = Duration::from_millis(interval_ms);
    let clear = !json && std::io::stdout().is_terminal();
    let mut prev = Previous::default();
    let mut n = 0u64;
    let mut next_at = Instant::now();
    loop {
        let now = Instant::now();
        // A name that disappears (its producer closed) is reported each refresh, not fatal.
        let mut l = match targets(name) {
            Ok(t) => collect(&t),
            Err(e) => Listing {
                errors: vec![SegmentError {
                    kind: "segment",
                    name: name.unwrap_or_default().to_string(),
                    error: e.to_string(),
                }],
                ..Default::default()
            },
        };
        add_rates(&mut l, &mut prev, now);
        let last = outcome(&l);
        // Through `out_nonl!`, so a reader that went away (`watch | head`) ends the command with
        // status 141, as for `ls`.
        if json {
            out_nonl!("{}\n", serde_json::to_string(&l)?);
        } else {
            let sep = if clear {
                "\x1b[2J\x1b[H"
            } else if n > 0 {
                "\n"
            } else {
                ""
            };
            out_nonl!(
                "{sep}every {interval_ms} ms, refresh {}\n{}",
                n + 1,
                render(&l, true)
            );
        }
        n += 1;
        if count.is_some_and(|c| n >= c) {
            return Ok(last);
        }
        next_at += interval;
        let wait = next_at.saturating_duration_since(Instant::now());
        if wait.is_zero() {
            next_at = Instant::now();
        }
        std::thread::sleep(wait);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_read_like_people_write_them() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(3840 * 2160 * 4), "31.6 MiB");
        assert_eq!(bytes(1 << 40), "1.0 TiB");
    }

    #[test]
    fn unknown_policy_and_state_codes_are_shown_as_unknown_never_as_a_known_one() {
        assert_eq!(delivery_name(Ok(Delivery::EveryFrame)), "every-frame");
        assert_eq!(delivery_name(Ok(Delivery::LatestOnly)), "latest-only");
        assert_eq!(delivery_name(Delivery::from_wire(7)), "unknown(7)");
        assert_eq!(delivery_name(Delivery::from_wire(1)), "latest-only");
        assert_eq!(consumer_state_name(ConsumerState::from_wire(2)), "attached");
        assert_eq!(
            consumer_state_name(ConsumerState::from_wire(1)),
            "attaching"
        );
        assert_eq!(
            consumer_state_name(ConsumerState::from_wire(9)),
            "unknown(9)"
        );
        assert_eq!(producer_state_name(ProducerState::from_wire(0)), "open");
        assert_eq!(producer_state_name(ProducerState::from_wire(1)), "closed");
        assert_eq!(
            producer_state_name(ProducerState::from_wire(5)),
            "unknown(5)"
        );
    }

    #[test]
    fn the_tables_use_the_words_of_the_json_form() {
        let word = |v: serde_json::Value| v.as_str().unwrap().to_string();
        for l in [Liveness::Alive, Liveness::Dead, Liveness::Unknown] {
            assert_eq!(liveness(l), word(serde_json::json!(l)));
        }
        for d in [Delivery::EveryFrame, Delivery::LatestOnly] {
            assert_eq!(delivery_name(Ok(d)), word(serde_json::json!(d)));
        }
        for c in [ConsumerState::Claiming, ConsumerState::Active] {
            assert_eq!(consumer_state_name(Ok(c)), word(serde_json::json!(c)));
        }
        for p in [ProducerState::Open, ProducerState::Closed] {
            assert_eq!(producer_state_name(Ok(p)), word(serde_json::json!(p)));
        }
    }

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
