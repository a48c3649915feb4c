//! The removal ([`remove`]): what a scan listed, each checked again right before it goes, by the
//! layer that owns it, reported as removed, kept (with why) or a problem.
//!
//! Owns: the dispatch of each leftover to its layer's removal and the report.

use super::{
    BRIDGE_PREFIX, Leftover, LeftoverKind, RegistryKey, Removal, Target, bridge_dead,
    consumer_leftover, holder_leftover, holders, leftover,
};
use crate::channel;
use crate::error::Result;
use crate::identity;
use crate::ipc::fdpass;
use crate::quota::{self, QuotaLedger};
use crate::registry::{self, Reclaimed, Registry, RegistryOptions};
use crate::shm::SHM_DIR;
use crate::tensorset::{self, inspect as tensorset_inspect};

/// Removes what a [`scan`](super::scan()) listed, each checked again right before it goes by the same rule (a
/// registry's and a ledger's items by their own recovery under their own locks; a channel, pool
/// or segment, an abandoned creation included, only while its name still stands for what was
/// judged), and reports what went.
///
/// Leftovers are taken in the order given, grouped per registry and per ledger (whose recovery
/// frees every dead item at once: what it freed beside the ones listed is reported too). A channel
/// whose producer died goes before its host pool, and the ledgers' dead holders after everything
/// else (a dead holder of host memory is freed only once its segment is gone).
pub fn remove(leftovers: &[Leftover]) -> Removal {
    let mut out = Removal::default();
    let mut done_registries: Vec<&str> = Vec::new();
    let mut done_ledgers: Vec<&str> = Vec::new();
    let mut done_held: Vec<&str> = Vec::new();
    // A ledger's dead holders last: a dead holder of host memory keeps its entry while its segment
    // is in /dev/shm, so its bytes are freed only after the segments listed beside it are gone.
    let (holders, rest): (Vec<&Leftover>, Vec<&Leftover>) = leftovers
        .iter()
        .partition(|l| matches!(l.target, Target::QuotaHolder { .. }));
    for l in rest.into_iter().chain(holders) {
        match &l.target {
            Target::RegistryItem(_) => {
                if !done_registries.contains(&l.object.as_str()) {
                    done_registries.push(&l.object);
                    reclaim_registry(&l.object, leftovers, &mut out);
                }
            }
            Target::QuotaHolder { .. } => {
                if !done_ledgers.contains(&l.object.as_str()) {
                    done_ledgers.push(&l.object);
                    reclaim_ledger(&l.object, leftovers, &mut out);
                }
            }
            Target::QuotaCreation => one(
                l,
                quota::remove_abandoned(&l.object).map(|r| r.is_some()),
                &mut out,
            ),
            Target::RegistrySegment => {
                one(
                    l,
                    registry::remove_abandoned(&l.object).map(|r| r.is_some()),
                    &mut out,
                );
            }
            Target::ChannelCreation => one(
                l,
                channel::reclaim::remove_abandoned(&l.object).map(|r| r.is_some()),
                &mut out,
            ),
            Target::ChannelSegment => match channel::reclaim::remove_stale_control(&l.object) {
                Ok(Some(_)) => out.removed.push(l.clone()),
                Ok(None) => out
                    .kept
                    .push((l.clone(), "a new producer took it over meanwhile")),
                Err(e) => out.failed(format!("channel {}", l.object), e, [l]),
            },
            Target::ChannelConsumer { index } => {
                match channel::reclaim::release_dead_consumers(&l.object) {
                    Ok(freed) => {
                        for x in &freed {
                            let f = consumer_leftover(&l.object, x);
                            if !out.removed.contains(&f) {
                                out.removed.push(f);
                            }
                        }
                        if !freed.iter().any(|x| x.index as u32 == *index)
                            && !out.removed.contains(l)
                        {
                            out.kept.push((l.clone(), "gone or no longer dead"));
                        }
                    }
                    Err(e) => out.failed(format!("channel {}", l.object), e, [l]),
                }
            }
            Target::HostPool => one(
                l,
                channel::reclaim::remove_stale_host_pool(&l.object).map(|r| r.is_some()),
                &mut out,
            ),
            Target::TensorSetPart(p) => one(
                l,
                tensorset::reclaim::remove_part(&l.object, *p).map(|r| r.is_some()),
                &mut out,
            ),
            Target::TensorSetReader => one(
                l,
                tensorset::reclaim::release_dead_readers(&l.object).map(|_| {
                    // Freed when its slot is no longer the dead reader's.
                    tensorset_inspect::inspect(&l.object).map_or(true, |snap| {
                        !snap.readers.iter().any(|r| Some(r.identity) == l.owner)
                    })
                }),
                &mut out,
            ),
            Target::TensorSetHolder { .. } => {
                if !done_held.contains(&l.object.as_str()) {
                    done_held.push(&l.object);
                    holders::free(&l.object, leftovers, &mut out);
                }
            }
            Target::Socket(f) => one(l, fdpass::remove_stale_socket_file(f), &mut out),
            Target::Liveness(f) => one(l, identity::remove_stale_liveness_file(f), &mut out),
            Target::Bridge => {
                let r = if bridge_dead(&l.object) == Some(true) {
                    let path = format!("{SHM_DIR}/{BRIDGE_PREFIX}{}", l.object);
                    match std::fs::remove_file(&path) {
                        Ok(()) => Ok(true),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
                        Err(e) => Err(crate::error::OsError::io("unlink", path, e).into()),
                    }
                } else {
                    Ok(false)
                };
                one(l, r, &mut out);
            }
        }
    }
    out
}

/// Records the outcome of removing one leftover.
fn one(l: &Leftover, r: Result<bool>, out: &mut Removal) {
    match r {
        Ok(true) => out.removed.push(l.clone()),
        Ok(false) => out.kept.push((l.clone(), "gone or no longer stale")),
        Err(e) => out.failed(l.what.clone(), e, [l]),
    }
}

/// Runs registry `r`'s own recovery (joining it: one participant entry, freed again on drop) and
/// reports each item it freed, as the scan described it where the scan listed it.
fn reclaim_registry(r: &str, listed: &[Leftover], out: &mut Removal) {
    // With group access, as `inspect` reads it: a registry shared with our group is reclaimed
    // as it is listed.
    let freed = Registry::open(r, &RegistryOptions::new().group_access(true)).and_then(|reg| {
        let (_, mut freed) = reg.reclaim_dead_listed()?;
        freed.splice(0..0, reg.reclaimed_on_open().iter().cloned());
        Ok(freed)
    });
    let freed = match freed {
        Ok(f) => f,
        Err(e) => {
            out.failed(
                format!("registry {r}"),
                e,
                listed
                    .iter()
                    .filter(|l| l.object == r && matches!(l.target, Target::RegistryItem(_))),
            );
            return;
        }
    };
    let mut seen = Vec::new();
    for f in &freed {
        let key = match f {
            Reclaimed::Record { slot, seq, .. } => RegistryKey::Record {
                slot: *slot,
                seq: *seq,
            },
            Reclaimed::Lock { slot, .. } => RegistryKey::Lock { slot: *slot },
            Reclaimed::CorruptSlot { slot } => RegistryKey::Corrupt { slot: *slot },
            Reclaimed::Participant { index, .. } => RegistryKey::Participant { index: *index },
        };
        seen.push(key);
        let scanned = listed
            .iter()
            .find(|l| l.object == r && l.target == Target::RegistryItem(key));
        out.removed.push(match scanned {
            Some(l) => l.clone(),
            None => reclaimed_leftover(r, f, key),
        });
    }
    for l in listed.iter().filter(|l| l.object == r) {
        if let Target::RegistryItem(k) = l.target
            && !seen.contains(&k)
        {
            out.kept.push((l.clone(), "gone or no longer dead"));
        }
    }
}

/// A leftover for an item the registry's recovery freed that the scan had not listed (it died
/// meanwhile).
fn reclaimed_leftover(r: &str, f: &Reclaimed, key: RegistryKey) -> Leftover {
    let (kind, owner, what) = match f {
        Reclaimed::Record {
            slot,
            seq,
            name,
            owner,
        } => (
            LeftoverKind::RegistryRecord,
            Some(*owner),
            format!("record {name:?} (seq {seq}, slot {slot}) of dead {owner}"),
        ),
        Reclaimed::Lock {
            slot,
            writer_pid,
            dropped_record,
        } => (
            LeftoverKind::RegistryLock,
            None,
            format!(
                "slot {slot} lock of dead pid {writer_pid}{}",
                if *dropped_record {
                    " and its half-written record"
                } else {
                    ""
                }
            ),
        ),
        Reclaimed::Participant { index, pid } => (
            LeftoverKind::RegistryParticipant,
            None,
            format!("participant entry {index} of dead pid {pid}"),
        ),
        Reclaimed::CorruptSlot { slot } => (
            LeftoverKind::RegistryCorruptSlot,
            None,
            format!("corrupt slot {slot}"),
        ),
    };
    leftover(
        kind,
        r,
        owner,
        None,
        format!("registry {r}: {what}"),
        Target::RegistryItem(key),
    )
}

/// Frees the dead holders' reservations of ledger `name` (under its lock, by the rule every
/// reserve applies) and reports each.
fn reclaim_ledger(name: &str, listed: &[Leftover], out: &mut Removal) {
    match QuotaLedger::open_named(name).and_then(|l| l.dead_holders(true)) {
        Ok(dead) => {
            let (kept, freed): (Vec<_>, Vec<_>) = dead.iter().partition(|h| h.left_in.is_some());
            let freed: Vec<Leftover> = freed.iter().map(|h| holder_leftover(name, h)).collect();
            let kept: Vec<Leftover> = kept.iter().map(|h| holder_leftover(name, h)).collect();
            for l in listed.iter().filter(|l| l.object == name) {
                if matches!(l.target, Target::QuotaHolder { .. }) && !freed.contains(l) {
                    let why = if kept.contains(l) {
                        "its host memory is still in /dev/shm (its segment was not removed)"
                    } else {
                        "gone or no longer dead"
                    };
                    out.kept.push((l.clone(), why));
                }
            }
            out.removed.extend(freed);
        }
        Err(e) => out.failed(
            format!("quota ledger {name}"),
            e,
            listed
                .iter()
                .filter(|l| l.object == name && matches!(l.target, Target::QuotaHolder { .. })),
        ),
    }
}
