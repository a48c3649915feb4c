//! `ls` and `watch`: what registries and channels exist in `/dev/shm` and who holds what, as
//! tables or JSON lines (the listing itself is [`crate::listing`]).

use crate::Outcome;
use crate::listing::{ChannelView, Listing, Rates, RegistryView, SegmentError, collect, targets};
use crate::text::{bytes, consumer_state_name, delivery_name, liveness, producer_state_name};
use comfy_table::{Table, presets};
use cuda_ipc::channel::inspect::BufferState;
use cuda_ipc::identity::Liveness;
use cuda_ipc::token::TokenKind;
use std::error::Error;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

fn rate(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"))
}

/// A list of indices (consumer slots, buffers) as the tables show it: `#0,#2`, `-` for none. The
/// `#` keeps a lone index from reading as a count (`HOLDS 0` read as "holds nothing").
fn list(v: &[usize]) -> String {
    if v.is_empty() {
        "-".to_string()
    } else {
        v.iter()
            .map(|x| format!("#{x}"))
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
    if l.is_empty() {
        out.push_str("no cuda-ipc registries, channels or tensor sets in /dev/shm\n");
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
            "BUFFER",
            "STATE",
            "SEQ",
            "HELD BY CONSUMERS",
            "BYTES",
            "META",
            "DEVICE",
        ]);
        for b in &c.buffers {
            let (state, seq) = match b.state {
                BufferState::Empty => ("empty", None),
                // The producer took it while consumers still hold its frame: a pool of one buffer
                // reserved (docs/channel-layout.md), waiting for those holds to end.
                BufferState::Writing if b.hold_mask != 0 => ("reserved", None),
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
                "CONSUMER",
                "PID",
                "PROCESS",
                "DELIVERY",
                "CURSOR",
                "LAG",
                "RECEIVED",
                "DROPPED",
                "HOLDS BUFFERS",
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
        if let Some(p) = &c.pool_problem {
            out.push_str(&format!(
                "  problem: its host pool cannot be used ({p}); a consumer's attach fails\n"
            ));
        }
        if c.producer_liveness == Liveness::Dead {
            out.push_str("  problem: the producer is dead; `cuda-ipc gc` removes this segment\n");
        } else if c.has_leftovers() {
            out.push_str("  problem: dead consumers are attached; `cuda-ipc gc` frees their slots and holds\n");
        }
    }
    for v in &l.tensor_sets {
        let t = &v.snapshot;
        out.push_str(&format!(
            "tensorset {}: gen {}, {} buffers, {} tensors, {}, {} readers, {} holds, writer {} {}, {}{}\n",
            t.name,
            if t.channel_problem.is_some() {
                "?".to_string()
            } else {
                t.generation.to_string()
            },
            t.buffers,
            t.tensors,
            bytes(t.bytes),
            t.readers.len(),
            t.holds,
            t.writer.pid,
            liveness(t.writer_liveness),
            t.memory,
            if t.buffered { ", buffered" } else { ", in place" },
        ));
        if let Some(b) = &v.bridge {
            out.push_str(&crate::bridge::describe(b));
        }
        if !t.holders.is_empty() {
            let who: Vec<String> = t
                .holders
                .iter()
                .map(|h| {
                    format!(
                        "{} pid {} {}",
                        h.role.word(),
                        h.identity.pid,
                        liveness(h.liveness)
                    )
                })
                .collect();
            out.push_str(&format!(
                "  served by: {} ({} live holders besides the writer)\n",
                who.join(", "),
                t.live_holders()
            ));
        }
        if t.writer_liveness == Liveness::Dead && t.live_holders() > 0 {
            out.push_str(&format!(
                "  the writer is dead; held (its device memory pinned), new readers attach to {}\n",
                match t.whole_generation {
                    Some(g) => format!("generation {g}, the last whole one"),
                    None => "nothing: no generation is whole".to_string(),
                }
            ));
        } else if t.writer_liveness == Liveness::Dead {
            out.push_str("  problem: the writer is dead; `cuda-ipc gc` removes this set\n");
        } else if let Some(p) = &t.channel_problem {
            out.push_str(&format!(
                "  problem: its generation channel cannot be read ({p}); the generation, readers \
                 and holds above are not known\n"
            ));
        } else if v.has_leftovers() {
            out.push_str(
                "  problem: dead readers are attached; `cuda-ipc gc` frees their slots and holds\n",
            );
        }
        if let Some(p) = &t.data_problem {
            out.push_str(&format!(
                "  problem: its host data segment cannot be used ({p}); a reader's open fails\n"
            ));
        }
    }
    for m in &l.sets_without_manifest {
        out.push_str(&format!(
            "tensorset {}: no manifest ({}/{}{}): parts left of a set without one\n",
            m.name,
            cuda_ipc::raw::shm::SHM_DIR,
            cuda_ipc::tensorset::MANIFEST_PREFIX,
            m.name
        ));
        for p in &m.parts {
            let (gc, why) = crate::listing::SetWithoutManifest::gc(p);
            out.push_str(&format!(
                "  {} {}/{} ({}, {} s old): `cuda-ipc gc` {}: {why}\n",
                p.part.word(),
                cuda_ipc::raw::shm::SHM_DIR,
                p.segment,
                bytes(p.bytes),
                p.age_secs,
                match gc {
                    "removes" => "removes it",
                    "keeps" if p.young => "keeps it for now",
                    "keeps" => "keeps it",
                    _ => "cannot judge it (kept, reported)",
                },
            ));
        }
    }
    for v in &l.host_pools {
        let p = &v.0;
        let (gc, why) = v.gc();
        out.push_str(&format!(
            "host pool {}/{} of channel {} ({}, {} s old){}: `cuda-ipc gc` {}: {why}\n",
            cuda_ipc::raw::shm::SHM_DIR,
            p.segment,
            p.channel,
            bytes(p.bytes),
            p.age_secs,
            if p.with_channel {
                ""
            } else {
                ", no control segment"
            },
            match gc {
                "removes" => "removes it",
                "keeps" => "keeps it",
                _ => "cannot judge it (kept, reported)",
            },
        ));
    }
    for e in &l.errors {
        out.push_str(&format!(
            "{} {}: cannot read: {}\n",
            e.kind, e.name, e.error
        ));
    }
    for c in &l.closed_meanwhile {
        out.push_str(&format!(
            "{} {}: closed meanwhile (gone between listing and reading)\n",
            c.kind, c.name
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

/// What `ls` shows besides the listing, without a NAME: the quota budgets (other users' ledgers
/// skipped with a note), other users' objects, which `gc` leaves to them (`crate::others`: the
/// lines `gc` prints of them), and the GPUs through NVML with the participants on them. With a
/// NAME, all empty (`ls NAME` stays about what it names), but for the quota ledger it names
/// (`crate::names`): that ledger's budget and holders.
struct Extras {
    /// `ls LEDGER` of a name that names a quota ledger and nothing else: the listing (empty) is
    /// not shown, only the ledger.
    ledger_alone: bool,
    quotas: crate::quota::Ledgers,
    /// Other users' objects, left out of the listing and by `gc` (none with a NAME).
    others: Vec<cuda_ipc::cleanup::Skipped>,
    gpu: Option<(crate::gpu::GpuState, crate::gpu::Matching)>,
}

impl Extras {
    /// `ledger`: the quota ledger the NAME names (`Targets::ledger`).
    fn collect(name: Option<&str>, ledger: Option<&str>, l: &Listing) -> Extras {
        let quotas = match (name, ledger) {
            (None, _) => crate::quota::collect_all(),
            (Some(_), Some(n)) => crate::quota::collect_named(Some(n)),
            (Some(_), None) => Default::default(),
        };
        // What `gc` without a NAME passes over (`/dev/shm` unreadable: `targets` said so).
        let others = match name {
            None => cuda_ipc::cleanup::others(&cuda_ipc::cleanup::Scope::everything())
                .unwrap_or_default(),
            Some(_) => Vec::new(),
        };
        let gpu = name.is_none().then(|| {
            let g = crate::gpu::query();
            let m = crate::gpu::match_processes(
                g.gpus(),
                &crate::state::participants(l),
                crate::gpu::own_pid_ns(),
                crate::gpu::proc_facts,
            );
            (g, m)
        });
        Extras {
            ledger_alone: ledger.is_some() && l.is_empty(),
            quotas,
            others,
            gpu,
        }
    }

    /// The exit status: problems in the listing or a ledger that could not be read.
    fn outcome(&self, l: &Listing) -> Outcome {
        if self.quotas.errors.is_empty() {
            outcome(l)
        } else {
            Outcome::Problems
        }
    }

    fn text(&self, l: &Listing) -> String {
        format!(
            "{}{}{}{}{}",
            if self.ledger_alone {
                String::new()
            } else {
                render(l, false)
            },
            crate::others::lines(&self.others, crate::others::LS),
            crate::quota::render(&self.quotas.snapshots, &self.quotas.errors),
            crate::quota::render_skipped(&self.quotas.skipped),
            self.gpu
                .as_ref()
                .map(|(g, m)| crate::gpu::render(g, m))
                .unwrap_or_default()
        )
    }
}

/// The one JSON document of `ls --json`, and of each line of `watch --json` (docs/cli.md): the
/// listing's keys (`registries`, `channels`, `tensor_sets`, `errors`; the rate keys `null` in
/// `ls` and on `watch`'s first line), then `skipped` (other users' objects, which `gc` leaves to
/// them: `crate::others`), `quotas`, `quota_errors`, `quota_skipped`, `gpu` and `gpu_processes`
/// (the last two `null` with a NAME).
fn document(l: &Listing, x: &Extras) -> Result<serde_json::Value, Box<dyn Error>> {
    let mut v = serde_json::to_value(l)?;
    if let Some(m) = v.as_object_mut() {
        m.insert("skipped".into(), crate::others::json(&x.others));
        m.insert("quotas".into(), serde_json::to_value(&x.quotas.snapshots)?);
        m.insert(
            "quota_errors".into(),
            x.quotas
                .errors
                .iter()
                .map(|(n, e)| serde_json::json!({"name": n, "error": e}))
                .collect(),
        );
        m.insert(
            "quota_skipped".into(),
            serde_json::to_value(&x.quotas.skipped)?,
        );
        let (g, mat) = match &x.gpu {
            Some((g, mat)) => (serde_json::to_value(g)?, serde_json::to_value(mat)?),
            None => (serde_json::Value::Null, serde_json::Value::Null),
        };
        m.insert("gpu".into(), g);
        m.insert("gpu_processes".into(), mat);
    }
    Ok(v)
}

/// `cuda-ipc ls [NAME] [--json]`: the listing, then (without a NAME) the quota budgets with
/// their holders (other users' ledgers skipped with a note) and the GPUs through NVML with the
/// participants on them ([`document`] for `--json`).
pub fn run_ls(name: Option<&str>, json: bool) -> Result<Outcome, Box<dyn Error>> {
    let t = targets(name)?;
    let l = collect(&t);
    let x = Extras::collect(name, t.ledger.as_deref(), &l);
    if json {
        out!("{}", serde_json::to_string_pretty(&document(&l, &x)?)?);
    } else {
        out_nonl!("{}", x.text(&l));
    }
    Ok(x.outcome(&l))
}

/// `cuda-ipc watch [NAME] [--interval MS] [--count N] [--json] [--plain]`: the live view
/// (`crate::tui`) on a terminal; the refreshed lines (`--plain`, and whenever stdout is not a
/// terminal) or JSON lines otherwise: each line `ls --json`'s document ([`document`]), with the
/// rates since the previous refresh.
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
    let mut rates = Rates::default();
    let mut n = 0u64;
    let mut next_at = Instant::now();
    loop {
        let now = Instant::now();
        // A name that disappears (its producer closed) is reported each refresh, not fatal.
        let (mut l, ledger) = match targets(name) {
            Ok(t) => (collect(&t), t.ledger),
            Err(e) => (
                Listing {
                    errors: vec![SegmentError {
                        kind: "segment",
                        name: name.unwrap_or_default().to_string(),
                        error: e.to_string(),
                    }],
                    ..Default::default()
                },
                None,
            ),
        };
        rates.add(&mut l, now);
        let x = Extras::collect(name, ledger.as_deref(), &l);
        let last = x.outcome(&l);
        // Through `out_nonl!`, so a reader that went away (`watch | head`) ends the command with
        // status 141, as for `ls`. JSON: `ls --json`'s document, one per line (JSON Lines).
        if json {
            out_nonl!("{}\n", serde_json::to_string(&document(&l, &x)?)?);
        } else {
            let sep = if clear {
                "\x1b[2J\x1b[H"
            } else if n > 0 {
                "\n"
            } else {
                ""
            };
            // The quota lines too, as `ls`, the live view, `--json` and `metrics` show them.
            out_nonl!(
                "{sep}every {interval_ms} ms, refresh {}\n{}{}",
                n + 1,
                render(&l, true),
                crate::quota::render(&x.quotas.snapshots, &x.quotas.errors)
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
