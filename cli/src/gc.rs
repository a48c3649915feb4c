//! `gc`: remove what dead processes left, never what a live one holds; printing over the library's
//! one rule set ([`cuda_ipc::cleanup`]).
//!
//! The dry run prints the library's [`scan`](cleanup::scan); the real run prints what
//! [`remove`](cleanup::remove) of that scan's leftovers removed (each checked again right before
//! it goes), so `gc --dry-run` lists exactly what `gc` then removes. The rules are the library's:
//! registries' dead records, participants, locks and corrupt slots (the registry's own recovery)
//! and creations abandoned half-way; channels of dead producers with their host pools, dead
//! consumers' slots on a live producer's channel, abandoned creations; tensor sets of dead
//! writers (manifest, generation channel, host data), dead readers' slots, dead holders' slots
//! in a set's holders segment (counted in a line of their own), abandoned creations;
//! and without a NAME the
//! reservations of dead holders in the quota ledgers (never a ledger itself; other users' ledgers
//! are skipped with a note), and the liveness files, fd server sockets and bridge status files
//! that killed processes left (a normal exit removes them).

use crate::Outcome;
use crate::listing::targets;
use cuda_ipc::cleanup::{self, Problem, Scope};
use std::error::Error;

/// Prints a problem on stderr, or, for another user's quota ledger, a note on stdout (theirs to
/// clean, as their channels are); returns whether it was a problem. `doing`: what failed
/// (`cannot read`, `cannot remove`).
fn report(p: &Problem, doing: &str) -> bool {
    if let Some(name) = p.subject.strip_prefix("quota ledger ")
        && let Some(s) = crate::quota::skipped(name, &p.error)
    {
        out!("quota ledger {name}: {}", s.note);
        return false;
    }
    eprintln!("cuda-ipc: {}: {doing}: {}", p.subject, p.error);
    true
}

/// Prints how many dead holders' slots in tensor sets' holders segments `verb` (`freed`, `would
/// free`), when there are any.
fn holder_slots(verb: &str, leftovers: &[cleanup::Leftover]) {
    let n = leftovers
        .iter()
        .filter(|l| l.kind == cleanup::LeftoverKind::TensorSetHolder)
        .count();
    if n > 0 {
        let s = if n == 1 { "" } else { "s" };
        out!("{verb} {n} dead holder slot{s}");
    }
}

/// `cuda-ipc gc [NAME] [--dry-run]`.
pub fn run(name: Option<&str>, dry_run: bool) -> Result<Outcome, Box<dyn Error>> {
    let scope = match name {
        None => Scope::everything(),
        Some(_) => {
            let t = targets(name)?;
            Scope::only(t.registries, t.channels).with_tensor_sets(t.tensor_sets)
        }
    };
    let scan = cleanup::scan(&scope)?;
    let mut failed = false;
    for k in &scan.kept {
        out!("kept {k}");
    }
    for p in &scan.problems {
        failed |= report(p, "cannot read");
    }
    let done = if dry_run {
        for l in &scan.leftovers {
            out!("would remove {l}");
        }
        holder_slots("would free", &scan.leftovers);
        scan.leftovers.len()
    } else {
        let r = cleanup::remove(&scan.leftovers);
        for l in &r.removed {
            out!("removed {l}");
        }
        for (l, why) in &r.kept {
            tracing::info!("kept {l}: {why}");
            if l.kind == cleanup::LeftoverKind::Channel {
                out!("kept channel {}: {why}", l.object);
            }
            if l.kind == cleanup::LeftoverKind::TensorSet {
                out!("kept tensorset {}: {why}", l.object);
            }
        }
        for p in &r.problems {
            failed |= report(p, "cannot remove");
        }
        holder_slots("freed", &r.removed);
        r.removed.len()
    };
    if done == 0 {
        out!("nothing to remove");
    }
    Ok(if failed {
        Outcome::Problems
    } else {
        Outcome::Ok
    })
}
