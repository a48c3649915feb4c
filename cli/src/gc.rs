//! `gc`: remove what dead processes left, never what a live one holds.
//!
//! Registries: records and participant entries of dead processes, locks of dead writers and corrupt
//! slots, freed by [`Registry::reclaim_dead`] (the registry's own recovery). Channels: the control
//! segment of a channel whose producer died ([`channel_inspect::remove_stale`]), and on a live
//! producer's channel the slots and holds of dead consumers
//! ([`channel_inspect::release_dead_consumers`], what the producer itself does when it next needs a
//! buffer). A registry segment itself is removed only when it is a creation abandoned half-way
//! ([`registry_inspect::remove_abandoned`]): a live process may open a finished one at any moment.
//! Without a NAME, also the reservations of dead holders in the quota ledgers (never a ledger
//! itself; other users' ledgers are skipped with a note), and the liveness files and fd server
//! sockets that killed processes left in `/dev/shm` (a normal exit removes them).

use crate::Outcome;
use crate::ls::{liveness, targets};
use cuda_ipc::channel::inspect::{self as channel_inspect, ConsumerSnapshot};
use cuda_ipc::identity::{self, Liveness};
use cuda_ipc::ipc::fdpass;
use cuda_ipc::registry::inspect::{self as registry_inspect, RegistrySnapshot};
use cuda_ipc::registry::{Registry, RegistryOptions};
use std::error::Error;

/// What dead processes left in a registry, one line each.
fn registry_leftovers(s: &RegistrySnapshot) -> Vec<String> {
    let mut out = Vec::new();
    for r in &s.records {
        if r.owner_liveness == Liveness::Dead {
            out.push(format!(
                "record {:?} (seq {}, slot {}) of dead {}",
                r.record.name, r.record.seq, r.record.slot, r.record.owner
            ));
        }
    }
    for l in &s.locked_slots {
        if l.writer_dead {
            out.push(format!(
                "slot {} lock of dead pid {}{}",
                l.slot,
                l.writer_pid,
                if l.writing {
                    " and its half-written record"
                } else {
                    ""
                }
            ));
        }
    }
    for (slot, why) in &s.corrupt_slots {
        out.push(format!("corrupt slot {slot} ({why})"));
    }
    for p in &s.participants {
        if p.dead {
            out.push(format!(
                "participant entry {} of dead {}",
                p.index, p.identity
            ));
        }
    }
    out
}

/// Frees the reservations of dead holders in every quota ledger (what the next reserve or look
/// would do anyway); with `dry_run`, only says which. The ledgers themselves stay: a budget is
/// removed only by its owner (`cuda-ipc quota remove`). Other users' ledgers are skipped with a
/// note, as their channels are.
fn quota_holders(dry_run: bool, verb: &str, fail: &mut impl FnMut(String)) -> usize {
    let names = match cuda_ipc::quota::list_ledgers() {
        Ok(n) => n,
        Err(e) => {
            fail(format!("quota ledgers: cannot list: {e}"));
            return 0;
        }
    };
    let mut n = 0;
    for name in names {
        match cuda_ipc::quota::QuotaLedger::open_named(&name).and_then(|l| l.dead_holders(!dry_run))
        {
            Ok(dead) => {
                for h in &dead {
                    out!(
                        "{verb} quota ledger {name}: reservation of {} bytes of dead {}",
                        h.bytes,
                        h.identity
                    );
                }
                n += dead.len();
            }
            Err(e) => match crate::quota::skipped(&name, &e) {
                // Another user's: theirs to clean, as their channels are; no problem.
                Some(s) => out!("quota ledger {name}: {}", s.note),
                None => fail(format!("quota ledger {name}: cannot read: {e}")),
            },
        }
    }
    n
}

/// Removes one leftover after checking it again; `Ok(false)` when it is gone or no longer stale.
type Removal = Box<dyn Fn() -> cuda_ipc::Result<bool>>;

/// Per-process files that killed processes left in `/dev/shm`: the fd server sockets
/// (`cuda-ipc.fd.*`) and the liveness files (`cuda-ipc.live.*`); a normal exit removes both. This
/// user's only, or everyone's for root. Returns how many were (or, with `dry_run`, would be)
/// removed.
fn process_files(dry_run: bool, verb: &str, fail: &mut impl FnMut(String)) -> usize {
    // (what it is, owner uid, removal); sockets first, since their staleness is read through the
    // liveness files.
    let mut found: Vec<(String, u32, Removal)> = Vec::new();
    match fdpass::stale_socket_files() {
        Ok(files) => found.extend(files.into_iter().map(|f| {
            let what = format!(
                "fd server socket /dev/shm/{} of dead {}",
                f.name, f.identity
            );
            let uid = f.uid;
            let remove: Removal = Box::new(move || fdpass::remove_stale_socket_file(&f));
            (what, uid, remove)
        })),
        Err(e) => fail(format!("fd server sockets: cannot list: {e}")),
    }
    match identity::stale_liveness_files() {
        Ok(files) => found.extend(files.into_iter().map(|f| {
            let what = format!("liveness file /dev/shm/{} of dead {}", f.name, f.identity);
            let uid = f.uid;
            let remove: Removal = Box::new(move || identity::remove_stale_liveness_file(&f));
            (what, uid, remove)
        })),
        Err(e) => fail(format!("liveness files: cannot list: {e}")),
    }
    // Host pools of dead producers whose channel segment is gone (or still there: `remove_stale`
    // takes the pool with it, so a dry run lists both).
    match channel_inspect::stale_host_pools() {
        Ok(pools) => found.extend(pools.into_iter().map(|(c, why)| {
            let what = format!(
                "host pool /dev/shm/{} of channel {c}: {why}",
                channel_inspect::pool_segment_name(&c)
            );
            let remove: Removal =
                Box::new(move || channel_inspect::remove_stale_host_pool(&c).map(|r| r.is_some()));
            (what, rustix::process::geteuid().as_raw(), remove)
        })),
        Err(e) => fail(format!("host pools: cannot list: {e}")),
    }
    // Status files of killed lane bridges.
    for (c, uid) in crate::bridge::stale_status_files() {
        let what = format!(
            "bridge status {} of a dead bridge",
            crate::bridge::status_path(&c).display()
        );
        let remove: Removal = Box::new(move || {
            crate::bridge::remove_stale_status(&c)
                .map_err(|e| cuda_ipc::OsError::io("unlink", c.clone(), e).into())
        });
        found.push((what, uid, remove));
    }
    let euid = rustix::process::geteuid();
    let mut n = 0;
    for (what, uid, remove) in found {
        if !euid.is_root() && uid != euid.as_raw() {
            continue;
        }
        if dry_run {
            out!("{verb} {what}");
            n += 1;
            continue;
        }
        match remove() {
            Ok(true) => {
                out!("{verb} {what}");
                n += 1;
            }
            // Gone meanwhile, or no longer stale: nothing to say.
            Ok(false) => {}
            Err(e) => fail(format!("{what}: cannot remove: {e}")),
        }
    }
    n
}

/// `cuda-ipc gc [NAME] [--dry-run]`.
pub fn run(name: Option<&str>, dry_run: bool) -> Result<Outcome, Box<dyn Error>> {
    let t = targets(name)?;
    let verb = if dry_run { "would remove" } else { "removed" };
    let mut removed = 0usize;
    let mut failed = false;
    let mut fail = |what: String| {
        eprintln!("cuda-ipc: {what}");
        failed = true;
    };
    for r in &t.registries {
        let before = match registry_inspect::inspect(r) {
            Ok(s) => s,
            Err(e) => {
                // A creation abandoned half-way goes, by the library's rule (the one
                // `open_or_create` replaces it by); anything else is reported and kept.
                let found = if dry_run {
                    registry_inspect::abandoned(r)
                } else {
                    registry_inspect::remove_abandoned(r)
                };
                match found {
                    Ok(Some(why)) => {
                        out!("{verb} registry {r}: segment /dev/shm/{r}: {why}");
                        removed += 1;
                    }
                    _ => fail(format!("registry {r}: cannot read: {e}")),
                }
                continue;
            }
        };
        let lines = registry_leftovers(&before);
        if lines.is_empty() {
            continue;
        }
        if dry_run {
            for l in &lines {
                out!("{verb} registry {r}: {l}");
            }
            removed += lines.len();
            continue;
        }
        // Joining the registry (one participant entry, freed again on drop) to run its own
        // recovery: it frees only what dead processes hold.
        let rep =
            // With group access, as `inspect` reads it: a registry shared with our group is
            // reclaimed as it is listed.
            match Registry::open(r, &RegistryOptions::new().group_access(true))
                .and_then(|reg| reg.reclaim_dead())
            {
                Ok(rep) => rep,
                Err(e) => {
                    fail(format!("registry {r}: cannot reclaim: {e}"));
                    continue;
                }
            };
        let after = registry_inspect::inspect(r).ok();
        // Report each leftover that is gone now (the same record, slot or entry may have been
        // reused by a live process meanwhile: compare the whole identity).
        let gone_lines = match &after {
            Some(a) => registry_leftovers(&before)
                .into_iter()
                .filter(|l| !registry_leftovers(a).contains(l))
                .collect::<Vec<_>>(),
            None => lines,
        };
        for l in &gone_lines {
            out!("{verb} registry {r}: {l}");
        }
        removed += gone_lines.len();
        tracing::info!(
            registry = %r,
            records = rep.records,
            half_written = rep.half_written,
            participants = rep.participants,
            "reclaimed"
        );
    }
    for c in &t.channels {
        let snap = match channel_inspect::inspect(c) {
            Ok(s) => s,
            Err(e) => {
                // A creation abandoned half-way (a producer killed while creating it) goes, by
                // the rule a new producer replaces it by; anything else is reported and kept.
                let what = format!(
                    "channel {c}: segment /dev/shm/{}",
                    channel_inspect::segment_name(c)
                );
                let found = if dry_run {
                    channel_inspect::abandoned(c)
                } else {
                    channel_inspect::remove_abandoned(c)
                };
                match found {
                    Ok(Some(why)) => {
                        out!("{verb} {what}: {why}");
                        removed += 1;
                    }
                    _ => fail(format!("channel {c}: cannot read: {e}")),
                }
                continue;
            }
        };
        if snap.producer_liveness == Liveness::Unknown {
            out!(
                "kept channel {c}: whether its producer ({}) runs cannot be told from here (its \
                 liveness file cannot be read and its pid is not of this pid namespace)",
                snap.producer
            );
        }
        for x in snap
            .consumers
            .iter()
            .filter(|x| x.liveness == Liveness::Unknown)
        {
            out!(
                "kept channel {c}: consumer slot {} ({}): whether it runs cannot be told from here",
                x.index,
                x.identity
            );
        }
        if snap.producer_liveness != Liveness::Dead {
            // A live producer: only the slots (and holds) of dead consumers go.
            let dead = |x: &ConsumerSnapshot| {
                format!(
                    "channel {c}: consumer slot {} of dead {}{}",
                    x.index,
                    x.identity,
                    if x.holds.is_empty() {
                        String::new()
                    } else {
                        format!(" and its holds on buffers {:?}", x.holds)
                    }
                )
            };
            if dry_run {
                for x in snap
                    .consumers
                    .iter()
                    .filter(|x| x.liveness == Liveness::Dead)
                {
                    out!("{verb} {}", dead(x));
                    removed += 1;
                }
                continue;
            }
            match channel_inspect::release_dead_consumers(c) {
                Ok(freed) => {
                    for x in &freed {
                        out!("{verb} {}", dead(x));
                    }
                    removed += freed.len();
                }
                Err(e) => fail(format!("channel {c}: cannot release dead consumers: {e}")),
            }
            continue;
        }
        let what = format!(
            "channel {c}: segment /dev/shm/{} ({} bytes) of dead producer {}, {} consumers {}",
            snap.segment,
            snap.segment_bytes,
            snap.producer,
            snap.consumers.len(),
            if snap.consumers.is_empty() {
                "attached".to_string()
            } else {
                format!(
                    "attached ({})",
                    snap.consumers
                        .iter()
                        .map(|x| format!("{} {}", x.identity, liveness(x.liveness)))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        );
        if dry_run {
            out!("{verb} {what}");
            removed += 1;
            continue;
        }
        // A host channel's pool goes with it: said, as the dry run lists it (among the host
        // pools of dead producers).
        let pool = std::path::PathBuf::from("/dev/shm").join(channel_inspect::pool_segment_name(c));
        let had_pool = std::fs::symlink_metadata(&pool).is_ok();
        match channel_inspect::remove_stale(c) {
            Ok(Some(_)) => {
                out!("{verb} {what}");
                removed += 1;
                if had_pool && std::fs::symlink_metadata(&pool).is_err() {
                    out!(
                        "{verb} host pool {} of channel {c}, with its channel",
                        pool.display()
                    );
                    removed += 1;
                }
            }
            Ok(None) => out!("kept channel {c}: a new producer took it over meanwhile"),
            Err(e) => fail(format!("channel {c}: cannot remove: {e}")),
        }
    }
    if name.is_none() {
        removed += quota_holders(dry_run, verb, &mut fail);
        removed += process_files(dry_run, verb, &mut fail);
    }
    if removed == 0 {
        out!("nothing to remove");
    }
    Ok(if failed {
        Outcome::Problems
    } else {
        Outcome::Ok
    })
}
