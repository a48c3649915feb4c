//! `gc`: remove what dead processes left, never what a live one holds; printing over the library's
//! one rule set ([`cuda_ipc::cleanup`]).
//!
//! The dry run prints the library's [`scan`](cleanup::scan); the real run prints what
//! [`remove`](cleanup::remove) of that scan's leftovers removed (each checked again right before
//! it goes), so `gc --dry-run` lists exactly what `gc` then removes. The rules are the library's:
//! registries' dead records, participants, locks and corrupt slots (the registry's own recovery)
//! and creations abandoned half-way (the registry magic, never stamped, its recorded creator
//! dead: a file without the magic under a NAME is no registry, a problem, never removed);
//! channels of dead producers with their host pools, dead
//! consumers' slots on a live producer's channel, abandoned creations (a registry's or channel's
//! creation that may still finish, younger than 2 s or its creator running, is kept with a line
//! saying why, no problem); tensor sets of dead
//! writers (manifest, generation channel, host data), dead readers' slots, dead holders' slots
//! in a set's holders segment (counted in a line of their own), abandoned creations;
//! the reservations of dead holders in the quota ledgers and the ledgers' creations abandoned
//! half-way (never a ready ledger itself, nor one whose creation may still finish, which is kept
//! with a line saying why): every ledger without a NAME, the one a NAME of a ledger
//! (`cuda-ipc.quota.…`) names (`crate::names`: what every NAME names); and without a NAME the
//! liveness files, fd server sockets and bridge status files that killed processes left (a normal exit removes them). Other users'
//! objects it passes over, named or not (their segments, never judged; their killed processes'
//! files, for a user other than root) are said, a line per uid (`crate::others`), and their
//! quota ledgers a line each (`crate::quota::skipped_of`), root's `gc` included: theirs to
//! clean, no problem. One rule, the library's (`Scan::skipped`).

use crate::Outcome;
use crate::listing::targets;
use cuda_ipc::cleanup::{self, Problem, Scope};
use std::error::Error;

/// What one run did, for `--json` (docs/cli.md); the text form prints the same as it goes.
#[derive(Default)]
struct Doc {
    kept: Vec<serde_json::Value>,
    leftovers: Vec<serde_json::Value>,
    removed: Vec<serde_json::Value>,
    skipped: Vec<crate::quota::Skipped>,
    others: serde_json::Value,
    problems: Vec<serde_json::Value>,
}

/// A leftover's JSON form: `kind` (the kind's name in snake case, e.g. `channel_consumer`),
/// `object`, `pid` of the dead owner (or `null`), `uid` (or `null`) and `what` (the text line).
fn leftover_json(l: &cleanup::Leftover) -> serde_json::Value {
    let mut kind = String::new();
    for (i, c) in format!("{:?}", l.kind).chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            kind.push('_');
        }
        kind.push(c.to_ascii_lowercase());
    }
    serde_json::json!({
        "kind": kind,
        "object": l.object,
        "pid": l.owner.map(|o| o.pid),
        "uid": l.uid,
        "what": l.what,
    })
}

/// Reports a problem (on stderr, or into `doc` with `--json`). `doing`: what failed (`cannot
/// read`, `cannot remove`). Another user's object is none: the scan passes it over
/// (`Scan::skipped`).
fn report(p: &Problem, doing: &str, doc: Option<&mut Doc>) {
    match doc {
        Some(d) => d.problems.push(serde_json::json!({
            "subject": p.subject,
            "doing": doing,
            "error": p.error.to_string(),
        })),
        None => eprintln!("cuda-ipc: {}: {doing}: {}", p.subject, p.error),
    }
}

/// Prints how many dead holders' slots in tensor sets' holders segments `verb` (`freed`, `would
/// free`), when there are any.
fn holder_slots(verb: &str, leftovers: &[cleanup::Leftover]) {
    let n = leftovers
        .iter()
        .filter(|l| l.kind == cleanup::LeftoverKind::TensorSetHolder)
        .count();
    if n > 0 {
        out!("{verb} {}", crate::text::plural(n, "dead holder slot"));
    }
}

/// `cuda-ipc gc [NAME] [--dry-run] [--json]`. JSON (docs/cli.md): `dry_run`, `leftovers` (what
/// the scan found: what a dry run would remove), `removed` (empty on a dry run), `kept` (each
/// `what`, `why` and `leftover`, the last two `null` for what the scan kept), `quota_skipped`
/// (other users' quota ledgers passed over), `skipped` (their other objects passed over,
/// `crate::others`), `problems` (each `subject`, `doing`, `error`); exit status 1 when
/// `problems` is not empty (what was skipped is no problem, named or not).
pub fn run(name: Option<&str>, dry_run: bool, json: bool) -> Result<Outcome, Box<dyn Error>> {
    let scope = match name {
        None => Scope::everything(),
        // What the NAME names (`crate::names`), a quota ledger by the rules `gc` without a NAME
        // follows.
        Some(_) => {
            let t = targets(name)?;
            // The channels named, and those of which only a host pool name stands.
            let mut channels = t.channels;
            for c in t.host_pools {
                if !channels.contains(&c) {
                    channels.push(c);
                }
            }
            Scope::only(t.registries, channels)
                .with_tensor_sets(t.tensor_sets)
                .with_quota_ledgers(t.ledger.into_iter().collect())
        }
    };
    let scan = cleanup::scan(&scope)?;
    let mut doc = json.then(Doc::default);
    for k in &scan.kept {
        match &mut doc {
            // The line says why (whether its process runs cannot be told); no leftover was made.
            Some(d) => d
                .kept
                .push(serde_json::json!({"what": k, "why": null, "leftover": null})),
            None => out!("kept {k}"),
        }
    }
    // Other users' quota ledgers in their own words and key (as `ls` and `quota show` say them),
    // the rest a line per uid.
    let (ledgers, others): (Vec<_>, Vec<_>) = scan
        .skipped
        .iter()
        .cloned()
        .partition(|s| s.what == "quota ledger");
    let me = rustix::process::geteuid().as_raw();
    match &mut doc {
        Some(d) => d.others = crate::others::json(&others),
        None => out_nonl!("{}", crate::others::lines(&others, crate::others::GC)),
    }
    for l in &ledgers {
        let s = crate::quota::skipped_of(&l.name, l.uid, me);
        match &mut doc {
            Some(d) => d.skipped.push(s),
            None => out!("quota ledger {}: {}", s.name, s.note),
        }
    }
    for p in &scan.problems {
        report(p, "cannot read", doc.as_mut());
    }
    let mut failed = !scan.problems.is_empty();
    if let Some(d) = &mut doc {
        d.leftovers = scan.leftovers.iter().map(leftover_json).collect();
    }
    let done = if dry_run {
        if doc.is_none() {
            for l in &scan.leftovers {
                out!("would remove {l}");
            }
        }
        if doc.is_none() {
            holder_slots("would free", &scan.leftovers);
        }
        scan.leftovers.len()
    } else {
        let r = cleanup::remove(&scan.leftovers);
        match &mut doc {
            Some(d) => d.removed = r.removed.iter().map(leftover_json).collect(),
            None => {
                for l in &r.removed {
                    out!("removed {l}");
                }
            }
        }
        for (l, why) in &r.kept {
            tracing::info!("kept {l}: {why}");
            if let Some(d) = &mut doc {
                d.kept.push(
                    serde_json::json!({"what": l.what, "why": why, "leftover": leftover_json(l)}),
                );
                continue;
            }
            if l.kind == cleanup::LeftoverKind::Channel {
                out!("kept channel {}: {why}", l.object);
            }
            if l.kind == cleanup::LeftoverKind::TensorSet {
                out!("kept tensorset {}: {why}", l.object);
            }
            if l.kind == cleanup::LeftoverKind::QuotaHolder {
                out!("kept {l}: {why}");
            }
        }
        for p in &r.problems {
            report(p, "cannot remove", doc.as_mut());
        }
        failed |= !r.problems.is_empty();
        if doc.is_none() {
            holder_slots("freed", &r.removed);
        }
        r.removed.len()
    };
    match doc {
        Some(d) => {
            let v = serde_json::json!({
                "dry_run": dry_run,
                "leftovers": d.leftovers,
                "removed": d.removed,
                "kept": d.kept,
                "quota_skipped": d.skipped,
                "skipped": d.others,
                "problems": d.problems,
            });
            out!("{}", serde_json::to_string_pretty(&v)?);
        }
        None if done == 0 => out!("nothing to remove"),
        None => {}
    }
    Ok(if failed {
        Outcome::Problems
    } else {
        Outcome::Ok
    })
}
