//! `ls` and `watch`: what registries and channels exist in `/dev/shm` and who holds what.

use crate::Outcome;
use comfy_table::{Table, presets};
use cuda_ipc::channel::inspect::{self as channel_inspect, BufferState, ChannelSnapshot};
use cuda_ipc::channel::{ConsumerState, Delivery, ProducerState, UnknownCode};
use cuda_ipc::identity::Liveness;
use cuda_ipc::registry::inspect::{self as registry_inspect, RegistrySnapshot};
use serde::Serialize;
use std::collections::HashMap;
use std::error::Error;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// Everything `ls` found.
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

/// One registry.
#[derive(Debug, Serialize)]
pub struct RegistryView {
    /// Segment name (`/dev/shm/NAME`).
    pub name: String,
    /// Segment size in bytes.
    pub segment_bytes: u64,
    /// Slots (most records at once).
    pub capacity: u32,
    /// Participant entries.
    pub participant_capacity: u32,
    /// The latest sequence number handed out.
    pub last_seq: u64,
    /// Pid of the creator.
    pub creator_pid: u32,
    /// Published records.
    pub records: Vec<RecordView>,
    /// Processes that have the registry open (dead ones included).
    pub participants: Vec<ParticipantView>,
    /// Slots whose writer lock is held.
    pub locked_slots: Vec<LockedSlotView>,
    /// Slots with nonsensical bytes.
    pub corrupt_slots: Vec<CorruptSlotView>,
    /// Whether `gc` would free something here.
    pub leftovers: bool,
    /// Publishes per second since the previous refresh (`watch` only).
    pub publishes_per_s: Option<f64>,
}

/// One record.
#[derive(Debug, Serialize)]
pub struct RecordView {
    /// Record name.
    pub name: String,
    /// The publisher's kind tag.
    pub kind: u32,
    /// Sequence number.
    pub seq: u64,
    /// Slot index.
    pub slot: u32,
    /// Pid of the publisher.
    pub owner_pid: u32,
    /// `alive`, `dead` or `unknown`.
    pub owner: &'static str,
    /// Token length in bytes.
    pub token_bytes: usize,
    /// Metadata length in bytes.
    pub metadata_bytes: usize,
}

/// One participant entry.
#[derive(Debug, Serialize)]
pub struct ParticipantView {
    /// Entry index.
    pub index: u32,
    /// Its pid.
    pub pid: u32,
    /// Whether its process still runs.
    pub alive: bool,
}

/// A slot whose writer lock is held.
#[derive(Debug, Serialize)]
pub struct LockedSlotView {
    /// Slot index.
    pub slot: u32,
    /// Pid of the lock holder.
    pub writer_pid: u32,
    /// Whether the holder still runs.
    pub writer_alive: bool,
    /// Whether a write is open.
    pub writing: bool,
}

/// A slot whose bytes make no sense.
#[derive(Debug, Serialize)]
pub struct CorruptSlotView {
    /// Slot index.
    pub slot: u32,
    /// Why.
    pub reason: String,
}

/// One channel.
#[derive(Debug, Serialize)]
pub struct ChannelView {
    /// Channel name.
    pub name: String,
    /// Segment name (`/dev/shm/cuda-ipc.ch.NAME`).
    pub segment: String,
    /// Segment size in bytes.
    pub segment_bytes: u64,
    /// Bytes per buffer.
    pub buffer_bytes: u64,
    /// Most consumers at once.
    pub consumer_capacity: usize,
    /// Producer pid.
    pub producer_pid: u32,
    /// `alive`, `dead` or `unknown`.
    pub producer: &'static str,
    /// Whether the producer closed the channel.
    pub closed: bool,
    /// `open`, `closed`, or `unknown(N)` for a producer state code this build does not know.
    pub state: String,
    /// Latest sequence number.
    pub head: u64,
    /// Frames published.
    pub published: u64,
    /// Holds released by force (dead consumers, shutdown).
    pub forced_releases: u64,
    /// The pool.
    pub buffers: Vec<BufferView>,
    /// Attached consumers.
    pub consumers: Vec<ConsumerView>,
    /// Whether dead processes left something here.
    pub leftovers: bool,
    /// Frames per second since the previous refresh (`watch` only).
    pub frames_per_s: Option<f64>,
}

/// One buffer of the pool.
#[derive(Debug, Serialize)]
pub struct BufferView {
    /// Pool index.
    pub index: usize,
    /// `empty`, `writing` or `frame`.
    pub state: &'static str,
    /// Sequence number of its frame.
    pub seq: Option<u64>,
    /// Consumer slots holding it.
    pub holders: Vec<usize>,
    /// Bytes of the buffer (from its memory token; the pool's buffer size when it does not
    /// decode).
    pub bytes: u64,
    /// Metadata bytes of its frame.
    pub metadata_bytes: u32,
    /// UUID of the device holding it (`host` for a host-memory pool), when its token decodes.
    pub device: Option<String>,
}

/// One consumer.
#[derive(Debug, Serialize)]
pub struct ConsumerView {
    /// Consumer slot index.
    pub index: usize,
    /// Its pid.
    pub pid: u32,
    /// `alive`, `dead` or `unknown`.
    pub process: &'static str,
    /// Attached (`false` while still claiming its slot).
    pub attached: bool,
    /// `attached`, `attaching`, or `unknown(N)` for a slot state code this build does not know.
    pub state: String,
    /// `every-frame`, `latest-only`, or `unknown(N)` for a policy code this build does not know.
    pub delivery: String,
    /// Last sequence number received or skipped.
    pub cursor: u64,
    /// Frames published it has not received yet.
    pub lag: u64,
    /// Frames received.
    pub received: u64,
    /// Frames skipped.
    pub dropped: u64,
    /// Buffers it holds.
    pub holds: Vec<usize>,
    /// Frames received per second since the previous refresh (`watch` only).
    pub received_per_s: Option<f64>,
    #[serde(skip)]
    generation: u64,
}

impl Listing {
    /// Whether anything here is a problem (exit status 1).
    pub fn has_problems(&self) -> bool {
        !self.errors.is_empty()
            || self.registries.iter().any(|r| r.leftovers)
            || self.channels.iter().any(|c| c.leftovers)
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

fn registry_view(s: RegistrySnapshot) -> RegistryView {
    RegistryView {
        leftovers: s.has_leftovers(),
        name: s.name,
        segment_bytes: s.segment_bytes,
        capacity: s.capacity,
        participant_capacity: s.participant_capacity,
        last_seq: s.last_seq,
        creator_pid: s.creator_pid,
        records: s
            .records
            .into_iter()
            .map(|r| RecordView {
                owner: liveness(r.owner_liveness),
                name: r.record.name,
                kind: r.record.kind,
                seq: r.record.seq,
                slot: r.record.slot,
                owner_pid: r.record.owner.pid,
                token_bytes: r.record.token.len(),
                metadata_bytes: r.record.metadata.len(),
            })
            .collect(),
        participants: s
            .participants
            .iter()
            .map(|p| ParticipantView {
                index: p.index,
                pid: p.identity.pid,
                alive: !p.dead,
            })
            .collect(),
        locked_slots: s
            .locked_slots
            .iter()
            .map(|l| LockedSlotView {
                slot: l.slot,
                writer_pid: l.writer_pid,
                writer_alive: !l.writer_dead,
                writing: l.writing,
            })
            .collect(),
        corrupt_slots: s
            .corrupt_slots
            .into_iter()
            .map(|(slot, reason)| CorruptSlotView { slot, reason })
            .collect(),
        publishes_per_s: None,
    }
}

fn channel_view(s: ChannelSnapshot) -> ChannelView {
    ChannelView {
        leftovers: s.has_leftovers(),
        producer: liveness(s.producer_liveness),
        producer_pid: s.producer.pid,
        buffers: s
            .buffers
            .iter()
            .map(|b| BufferView {
                index: b.index,
                state: match b.state {
                    BufferState::Empty => "empty",
                    BufferState::Writing => "writing",
                    _ => "frame",
                },
                seq: match b.state {
                    BufferState::Frame(s) => Some(s),
                    _ => None,
                },
                holders: (0..64).filter(|k| b.hold_mask & (1u64 << k) != 0).collect(),
                bytes: b.memory.map_or(s.buffer_bytes, |t| t.len),
                metadata_bytes: b.meta_len,
                device: b.memory.map(|t| {
                    if t.kind == cuda_ipc::token::TokenKind::HostMemory {
                        "host".to_string()
                    } else {
                        t.device.to_string()
                    }
                }),
            })
            .collect(),
        consumers: s
            .consumers
            .into_iter()
            .map(|c| ConsumerView {
                index: c.index,
                pid: c.identity.pid,
                process: liveness(c.liveness),
                attached: c.attached,
                state: consumer_state_name(c.state),
                delivery: delivery_name(c.delivery),
                cursor: c.cursor,
                lag: c.lag,
                received: c.received,
                dropped: c.dropped,
                holds: c.holds,
                received_per_s: None,
                generation: c.generation,
            })
            .collect(),
        name: s.name,
        segment: s.segment,
        segment_bytes: s.segment_bytes,
        buffer_bytes: s.buffer_bytes,
        consumer_capacity: s.consumer_capacity,
        closed: s.closed,
        state: producer_state_name(s.producer_state),
        head: s.head,
        published: s.published,
        forced_releases: s.forced_releases,
        frames_per_s: None,
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
            Ok(s) => l.registries.push(registry_view(s)),
            Err(e) => l.errors.push(SegmentError {
                kind: "registry",
                name: r.clone(),
                error: e.to_string(),
            }),
        }
    }
    for c in &t.channels {
        match channel_inspect::inspect(c) {
            Ok(s) => l.channels.push(channel_view(s)),
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
    for r in &l.registries {
        out.push_str(&format!(
            "registry {}: {} of {} slots used, {} participants, last seq {}, {}{}\n",
            r.name,
            r.records.len(),
            r.capacity,
            r.participants.len(),
            r.last_seq,
            bytes(r.segment_bytes),
            if rates {
                format!(", {} publishes/s", rate(r.publishes_per_s))
            } else {
                String::new()
            }
        ));
        if !r.records.is_empty() {
            let mut t = table(&[
                "RECORD", "KIND", "SEQ", "OWNER", "PROCESS", "TOKEN", "META", "SLOT",
            ]);
            for x in &r.records {
                t.add_row(vec![
                    x.name.clone(),
                    x.kind.to_string(),
                    x.seq.to_string(),
                    x.owner_pid.to_string(),
                    x.owner.to_string(),
                    bytes(x.token_bytes as u64),
                    bytes(x.metadata_bytes as u64),
                    x.slot.to_string(),
                ]);
            }
            out.push_str(&indent(&t));
            out.push('\n');
        }
        if !r.participants.is_empty() {
            let ps: Vec<String> = r
                .participants
                .iter()
                .map(|p| format!("{} {}", p.pid, if p.alive { "alive" } else { "dead" }))
                .collect();
            out.push_str(&format!("  participants: {}\n", ps.join(", ")));
        }
        for s in &r.locked_slots {
            out.push_str(&format!(
                "  slot {} locked by pid {} ({}{})\n",
                s.slot,
                s.writer_pid,
                if s.writer_alive { "alive" } else { "dead" },
                if s.writing { ", write open" } else { "" }
            ));
        }
        for s in &r.corrupt_slots {
            out.push_str(&format!("  corrupt: {}\n", s.reason));
        }
        if r.leftovers {
            out.push_str("  problem: dead processes left records or entries here; `cuda-ipc gc` removes them\n");
        }
    }
    for c in &l.channels {
        out.push_str(&format!(
            "channel {}: producer {} {}, {}, head {}, published {}, {} × {} buffers, {} of {} consumers, forced releases {}{}\n",
            c.name,
            c.producer_pid,
            c.producer,
            c.state,
            c.head,
            c.published,
            c.buffers.len(),
            bytes(c.buffer_bytes),
            c.consumers.len(),
            c.consumer_capacity,
            c.forced_releases,
            if rates {
                format!(", {} frames/s", rate(c.frames_per_s))
            } else {
                String::new()
            }
        ));
        let mut t = table(&[
            "BUFFER", "STATE", "SEQ", "HOLDERS", "BYTES", "META", "DEVICE",
        ]);
        for b in &c.buffers {
            t.add_row(vec![
                b.index.to_string(),
                b.state.to_string(),
                b.seq.map_or_else(|| "-".to_string(), |s| s.to_string()),
                list(&b.holders),
                bytes(b.bytes),
                bytes(u64::from(b.metadata_bytes)),
                b.device.clone().unwrap_or_else(|| "-".to_string()),
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
            for x in &c.consumers {
                let mut row = vec![
                    format!(
                        "{}{}",
                        x.index,
                        match x.state.as_str() {
                            "attached" => String::new(),
                            other => format!(" ({other})"),
                        }
                    ),
                    x.pid.to_string(),
                    x.process.to_string(),
                    x.delivery.to_string(),
                    x.cursor.to_string(),
                    x.lag.to_string(),
                    x.received.to_string(),
                    x.dropped.to_string(),
                    list(&x.holds),
                ];
                if rates {
                    row.push(rate(x.received_per_s));
                }
                t.add_row(row);
            }
            out.push_str(&indent(&t));
            out.push('\n');
        }
        if c.producer == "dead" {
            out.push_str("  problem: the producer is dead; `cuda-ipc gc` removes this segment\n");
        } else if c.leftovers {
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

/// `cuda-ipc ls [NAME] [--json]`.
pub fn run_ls(name: Option<&str>, json: bool) -> Result<Outcome, Box<dyn Error>> {
    let l = collect(&targets(name)?);
    if json {
        out!("{}", serde_json::to_string_pretty(&l)?);
    } else {
        out_nonl!("{}", render(&l, false));
    }
    Ok(outcome(&l))
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

fn add_rates(l: &mut Listing, prev: &mut Previous, now: Instant) {
    let dt = prev.at.map(|t| now - t);
    let mut next = Previous {
        at: Some(now),
        ..Default::default()
    };
    for r in &mut l.registries {
        r.publishes_per_s = per_s(r.last_seq, prev.registry_seq.get(&r.name), dt);
        next.registry_seq.insert(r.name.clone(), r.last_seq);
    }
    for c in &mut l.channels {
        c.frames_per_s = per_s(c.head, prev.channel_head.get(&c.name), dt);
        next.channel_head.insert(c.name.clone(), c.head);
        for x in &mut c.consumers {
            let key = (c.name.clone(), x.index, x.pid, x.generation);
            x.received_per_s = per_s(x.received, prev.consumer_received.get(&key), dt);
            next.consumer_received.insert(key, x.received);
        }
    }
    *prev = next;
}

/// `cuda-ipc watch [NAME] [--interval MS] [--count N] [--json]`.
pub fn run_watch(
    name: Option<&str>,
    interval_ms: u64,
    count: Option<u64>,
    json: bool,
) -> Result<Outcome, Box<dyn Error>> {
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
