//! The scan ([`scan`]): every registry, channel, host pool, tensor set, quota ledger and
//! per-process file of the scope looked at, each by its layer's own rule, into one [`Scan`].
//!
//! Owns: the order of the look and what each kind's look lists (leftovers, kept objects with a
//! note, problems); the leftovers' shapes shared with the removal stay in the parent.

use super::{
    BRIDGE_PREFIX, LeftoverKind, RegistryKey, Scan, Scope, Skipped, Target, bridge_dead,
    consumer_leftover, holder_leftover, holders, leftover, problem,
};
use crate::channel::inspect as channel_inspect;
use crate::error::{Error, Result};
use crate::identity;
use crate::ipc::fdpass;
use crate::quota::{self, QuotaLedger};
use crate::registry::inspect as registry_inspect;
use crate::shm::SHM_DIR;
use crate::shm::versioned::Creation;
use crate::tensorset::{self, inspect as tensorset_inspect, reclaim::Part};

/// Lists what dead processes left in `scope`, by the layers' own rules; changes nothing.
///
/// A registry, channel or quota ledger that cannot be read is a [`Problem`](super::Problem)
/// (unless it is a creation abandoned half-way: then it is that leftover; a creation that may
/// still finish, younger than 2 s or its creator running, is kept, with why; one gone since it
/// was listed is not reported), judged by the rule its creators replace one by (a registry's or
/// channel's only after its inspection failed: one finished meanwhile is inspected again, once).
/// Other users' objects are passed over, listed in [`Scan::skipped`], never a problem, whether
/// the scope names them or not: those [`others`] lists (a named registry, channel or tensor set
/// of another user is not inspected: a tensor set only when no part of it is this user's), and
/// a quota ledger whose open says it is another user's (`ShmError::WrongOwner`: whose a ledger
/// is, a group ledger's included, takes its open). Per-process files are this user's only,
/// everyone's for root.
///
/// # Errors
/// [`Error::Os`] when `/dev/shm` cannot be listed (for the registries and channels of
/// [`Scope::everything`]).
pub fn scan(scope: &Scope) -> Result<Scan> {
    let mut s = Scan::default();
    // First, so that what is another user's is passed over as the listings of everything pass
    // over theirs, never inspected (which would only fail, `WrongOwner`).
    let skipped = others(scope)?;
    let theirs = |name: &str| skipped.iter().any(|k| k.name == name);
    let mut registries = match &scope.registries {
        Some(r) => r.clone(),
        None => registry_inspect::list_registries()?,
    };
    registries.retain(|r| !theirs(r));
    let mut channels = match &scope.channels {
        Some(c) => c.clone(),
        None => channel_inspect::list_channels()?,
    };
    channels.retain(|c| !theirs(&channel_inspect::segment_name(c)));
    for r in &registries {
        scan_registry(r, &mut s);
    }
    for c in &channels {
        scan_channel(c, &mut s);
    }
    scan_host_pools(scope.channels.as_deref(), &mut s);
    let mut sets = match &scope.tensor_sets {
        Some(t) => t.clone(),
        None => tensorset_inspect::list_tensor_sets()?,
    };
    // A set is another user's when every part that stands is theirs (one of this user's among
    // them, it is scanned, and their part is its problem: not the set's owner's making).
    sets.retain(|t| {
        let standing: Vec<String> = SET_PREFIXES
            .iter()
            .map(|p| format!("{p}{t}"))
            .filter(|n| std::fs::symlink_metadata(format!("{SHM_DIR}/{n}")).is_ok())
            .collect();
        standing.is_empty() || !standing.iter().all(|n| theirs(n))
    });
    for t in &sets {
        scan_tensor_set(t, &mut s);
    }
    scan_quota(scope.quota_ledgers.as_deref(), &mut s);
    if scope.process_files {
        scan_process_files(&mut s);
    }
    // The quota ledgers' (the scan's own) beside the listing's, in one order.
    s.skipped.extend(skipped);
    s.skipped.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(s)
}

/// The prefixes of a tensor set's parts' segment names, in the order [`others`] lists them.
const SET_PREFIXES: [&str; 4] = [
    tensorset::MANIFEST_PREFIX,
    tensorset::GENERATION_PREFIX,
    tensorset::DATA_PREFIX,
    tensorset::HOLDERS_PREFIX,
];

/// Other users' objects that [`scan`] of `scope` passes over, sorted by name: with every registry
/// of the scope ([`Scope::everything`]), the registries of other users (not shared with a group
/// of this process) whose magic this process can read; with every channel, other users' channel
/// segments and host pools; with every tensor set, other users' parts of sets; with the
/// per-process files, those of killed processes of another uid (root removes everyone's: none).
/// Under a segment's name, whatever of theirs stands there counts (a FIFO, a directory, a
/// symbolic link: listed by what it is, as its opener would name it).
/// Where the scope names them ([`Scope::only`]), the same of the objects named, by the same
/// rules: a named registry that is another user's file (not shared with a group of this process;
/// its magic is not read: the name was given as a registry's), the named channels' control
/// segments and host pools and the named tensor sets' parts that are other users' files.
/// Another user's quota ledger is not here: whose a ledger is takes its open (a group ledger of
/// a group of this process is this user's to clean), and [`scan`] adds each it meets to
/// [`Scan::skipped`]. Nothing is judged beyond what the listings read (names, owners, a
/// registry's magic, the liveness of a per-process file's process), nothing is changed. For
/// `cuda-ipc gc`, which says what it left, and `cuda-ipc ls`, which says the same of what `gc`
/// would leave.
///
/// # Errors
/// [`Error::Os`] when `/dev/shm` cannot be listed.
///
/// # Examples
/// ```
/// use cuda_ipc::cleanup::{self, Scope};
/// for s in cleanup::others(&Scope::everything())? {
///     println!("skipped {} ({}) of uid {}", s.name, s.what, s.uid);
/// }
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub fn others(scope: &Scope) -> Result<Vec<Skipped>> {
    let segment = |name: String, uid, what| Skipped {
        name,
        uid,
        what,
        dead: false,
        owner: None,
    };
    let mut out = Vec::new();
    match &scope.registries {
        None => out.extend(
            registry_inspect::list_other_users_registries()?
                .into_iter()
                .map(|(n, uid)| segment(n, uid, "registry")),
        ),
        Some(named) => out.extend(named.iter().filter_map(|r| {
            registry_inspect::other_users_registry(r).map(|uid| segment(r.clone(), uid, "registry"))
        })),
    }
    let mut kinds: Vec<(&str, &'static str)> = Vec::new();
    // The segments of the objects named: (segment name, what it is).
    let mut named: Vec<(String, &'static str)> = Vec::new();
    match &scope.channels {
        None => {
            kinds.push((channel_inspect::SEGMENT_PREFIX, "channel segment"));
            kinds.push((channel_inspect::POOL_PREFIX, "host pool"));
        }
        Some(channels) => {
            for c in channels {
                named.push((channel_inspect::segment_name(c), "channel segment"));
                named.push((channel_inspect::pool_segment_name(c), "host pool"));
            }
        }
    }
    match &scope.tensor_sets {
        None => kinds.extend(SET_PREFIXES.map(|p| (p, "tensor set part"))),
        Some(sets) => {
            for t in sets {
                named.extend(SET_PREFIXES.map(|p| (format!("{p}{t}"), "tensor set part")));
            }
        }
    }
    if !kinds.is_empty() {
        for (n, uid, kind) in crate::shm::list_other_users_names()? {
            if let Some((_, what)) = kinds
                .iter()
                .find(|(p, _)| n.strip_prefix(p).is_some_and(|rest| !rest.is_empty()))
            {
                // What stands there, when it is no segment (a FIFO, a directory, a link).
                out.push(segment(n, uid, kind.unwrap_or(what)));
            }
        }
    }
    for (n, what) in named {
        if let Some((uid, kind)) = crate::shm::other_users_name(&n) {
            out.push(segment(n, uid, kind.unwrap_or(what)));
        }
    }
    if scope.process_files {
        let dead = |name: String, uid, what, owner| Skipped {
            name,
            uid,
            what,
            dead: true,
            owner,
        };
        // As the scan lists them; an error is the scan's problem already.
        if let Ok(files) = fdpass::stale_socket_files() {
            out.extend(
                files
                    .into_iter()
                    .filter(|f| !ours(f.uid))
                    .map(|f| dead(f.name, f.uid, "fd server socket", Some(f.identity))),
            );
        }
        if let Ok(files) = identity::stale_liveness_files() {
            out.extend(
                files
                    .into_iter()
                    .filter(|f| !ours(f.uid))
                    .map(|f| dead(f.name, f.uid, "liveness file", Some(f.identity))),
            );
        }
        out.extend(
            stale_bridge_status_files()
                .into_iter()
                .filter(|(_, uid)| !ours(*uid))
                .map(|(c, uid)| {
                    dead(
                        format!("{BRIDGE_PREFIX}{c}"),
                        uid,
                        "bridge status file",
                        None,
                    )
                }),
        );
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    // A name given twice (as a registry's and a channel's segment name, or a set twice) once.
    out.dedup_by(|a, b| a.name == b.name);
    Ok(out)
}

/// What the scan makes of an object its inspection could not read, by its layer's judgement of a
/// creation (taken only after a failed inspection, without waiting: [`unreadable`]).
enum Unread {
    /// A creation abandoned half-way: a leftover, for the caller to list, with why.
    Abandoned(&'static str),
    /// Finished since the inspection looked: inspect it again (once).
    LookAgain,
    /// Said here: kept (a creation that may still be finished), nothing (gone meanwhile), or a
    /// problem (the inspection's error).
    Said,
}

/// [`Unread`] of `subject` (`registry NAME`, `channel NAME`) whose inspection failed with `e`,
/// by `judged`; `first`: whether this was the first inspection (a second one that fails is a
/// problem, whatever the judge says meanwhile).
fn unreadable(
    subject: String,
    e: Error,
    judged: Result<Creation>,
    first: bool,
    s: &mut Scan,
) -> Unread {
    match judged {
        Ok(Creation::Abandoned(why)) => return Unread::Abandoned(why),
        // Young, or its creator may still finish it: not a problem (a `gc` beside a process
        // creating it must not fail).
        Ok(Creation::UnderWay(why)) => s.kept.push(format!("{subject}: {why}")),
        Ok(Creation::Finished) if first => return Unread::LookAgain,
        // Gone meanwhile (closed by its owner): nothing to report.
        Err(j) if super::is_gone(&j) => {}
        Ok(Creation::Finished) | Err(_) => s.unread(subject, e),
    }
    Unread::Said
}

fn scan_registry(r: &str, s: &mut Scan) {
    let mut first = true;
    let snap = loop {
        let e = match registry_inspect::inspect(r) {
            Ok(snap) => break snap,
            Err(e) => e,
        };
        // A creation abandoned half-way goes, by the rule `open_or_create` replaces it by; one
        // under way is kept; anything else is a problem, and kept.
        let judged = registry_inspect::judge_creation(r);
        match unreadable(format!("registry {r}"), e, judged, first, s) {
            Unread::Abandoned(why) => s.leftovers.push(leftover(
                LeftoverKind::RegistryCreation,
                r,
                None,
                None,
                format!("registry {r}: segment {SHM_DIR}/{r}: {why}"),
                Target::RegistrySegment,
            )),
            Unread::LookAgain => {
                first = false;
                continue;
            }
            Unread::Said => {}
        }
        return;
    };
    let dead = identity::Liveness::Dead;
    for x in snap.records.iter().filter(|x| x.owner_liveness == dead) {
        let rec = &x.record;
        s.leftovers.push(leftover(
            LeftoverKind::RegistryRecord,
            r,
            Some(rec.owner),
            Some(rec.owner_uid),
            format!(
                "registry {r}: record {:?} (seq {}, slot {}) of dead {}",
                rec.name, rec.seq, rec.slot, rec.owner
            ),
            Target::RegistryItem(RegistryKey::Record {
                slot: rec.slot,
                seq: rec.seq,
            }),
        ));
    }
    for l in snap.locked_slots.iter().filter(|l| l.writer_dead) {
        s.leftovers.push(leftover(
            LeftoverKind::RegistryLock,
            r,
            l.writer,
            None,
            format!(
                "registry {r}: slot {} lock of dead pid {}{}",
                l.slot,
                l.writer_pid,
                if l.writing {
                    " and its half-written record"
                } else {
                    ""
                }
            ),
            Target::RegistryItem(RegistryKey::Lock { slot: l.slot }),
        ));
    }
    for (slot, why) in &snap.corrupt_slots {
        s.leftovers.push(leftover(
            LeftoverKind::RegistryCorruptSlot,
            r,
            None,
            None,
            format!("registry {r}: corrupt slot {slot} ({why})"),
            Target::RegistryItem(RegistryKey::Corrupt { slot: *slot }),
        ));
    }
    for p in snap.participants.iter().filter(|p| p.dead) {
        s.leftovers.push(leftover(
            LeftoverKind::RegistryParticipant,
            r,
            Some(p.identity),
            None,
            format!(
                "registry {r}: participant entry {} of dead {}",
                p.index, p.identity
            ),
            Target::RegistryItem(RegistryKey::Participant { index: p.index }),
        ));
    }
}

fn scan_channel(c: &str, s: &mut Scan) {
    let mut first = true;
    let snap = loop {
        let e = match channel_inspect::inspect(c) {
            Ok(snap) => break snap,
            Err(e) => e,
        };
        // As for a registry, by the rule a new producer replaces a segment by.
        let judged = channel_inspect::judge_creation(c);
        match unreadable(format!("channel {c}"), e, judged, first, s) {
            Unread::Abandoned(why) => s.leftovers.push(leftover(
                LeftoverKind::ChannelCreation,
                c,
                None,
                None,
                format!(
                    "channel {c}: segment {SHM_DIR}/{}: {why}",
                    channel_inspect::segment_name(c)
                ),
                Target::ChannelCreation,
            )),
            Unread::LookAgain => {
                first = false;
                continue;
            }
            Unread::Said => {}
        }
        return;
    };
    use identity::Liveness::{Dead, Unknown};
    if snap.producer_liveness == Unknown {
        s.kept.push(format!(
            "channel {c}: whether its producer ({}) runs cannot be told from here (its liveness \
             file cannot be read and its pid is not of this pid namespace)",
            snap.producer
        ));
    }
    for x in snap.consumers.iter().filter(|x| x.liveness == Unknown) {
        s.kept.push(format!(
            "channel {c}: consumer slot {} ({}): whether it runs cannot be told from here",
            x.index, x.identity
        ));
    }
    if snap.producer_liveness != Dead {
        // A live producer: only the slots (and holds) of dead consumers go.
        for x in snap.consumers.iter().filter(|x| x.liveness == Dead) {
            s.leftovers.push(consumer_leftover(c, x));
        }
        return;
    }
    let attached = if snap.consumers.is_empty() {
        "attached".to_string()
    } else {
        format!(
            "attached ({})",
            snap.consumers
                .iter()
                .map(|x| format!("{} {}", x.identity, liveness_word(x.liveness)))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    s.leftovers.push(leftover(
        LeftoverKind::Channel,
        c,
        Some(snap.producer),
        None,
        format!(
            "channel {c}: segment {SHM_DIR}/{} ({} bytes) of dead producer {}, {} consumers {attached}",
            snap.segment,
            snap.segment_bytes,
            snap.producer,
            snap.consumers.len(),
        ),
        Target::ChannelSegment,
    ));
}

fn liveness_word(l: identity::Liveness) -> &'static str {
    match l {
        identity::Liveness::Alive => "alive",
        identity::Liveness::Dead => "dead",
        _ => "unknown",
    }
}

/// Host pool names of this user (with `named`, only those of the channels named), each by the
/// rule a new host producer replaces what stands there by ([`channel_inspect::host_pools`]): a
/// dead producer's pool or an abandoned creation (whether its channel segment is still there or
/// not) is a leftover; one that may still be finished is kept, with why, when no channel segment
/// speaks for it; anything else under such a name (a file that is not a pool, a FIFO, a
/// directory, a link, a pool of another version, one open to other users) blocks a host
/// producer's creation: a problem, never removed.
fn scan_host_pools(named: Option<&[String]>, s: &mut Scan) {
    let pools = match channel_inspect::host_pools() {
        Ok(p) => p,
        Err(e) => {
            s.unread("host pools".into(), e);
            return;
        }
    };
    for p in pools {
        let c = p.channel;
        if named.is_some_and(|n| !n.contains(&c)) {
            continue;
        }
        match p.judgement {
            channel_inspect::PoolJudgement::Stale(why) => s.leftovers.push(leftover(
                LeftoverKind::HostPool,
                &c,
                None,
                Some(rustix::process::geteuid().as_raw()),
                format!("host pool {SHM_DIR}/{} of channel {c}: {why}", p.segment),
                Target::HostPool,
            )),
            // Its channel's own judgement speaks for it (a live producer's pool).
            channel_inspect::PoolJudgement::Kept(_) if p.with_channel => {}
            channel_inspect::PoolJudgement::Kept(why) => s.kept.push(format!(
                "host pool {SHM_DIR}/{} of channel {c} (no control segment): {why}",
                p.segment
            )),
            channel_inspect::PoolJudgement::Unjudged(e) => {
                s.unread(format!("host pool of channel {c}"), e)
            }
        }
    }
}

/// A tensor set's parts left by a dead writer or an abandoned creation, and dead readers of a
/// live writer's set.
fn scan_tensor_set(t: &str, s: &mut Scan) {
    // Each part on its own: what cannot be judged is a problem and kept, the others go by their
    // own rule. Parts standing without the manifest are judged once, with why those kept are
    // (a creation that may be under way, a live writer's or holder's), which they say as a
    // registry's or channel's creation under way does.
    let judged = match tensorset::reclaim::parts_without_manifest(t) {
        Ok(standing) if !standing.is_empty() => {
            let (mut stale, mut unjudged) = (Vec::new(), Vec::new());
            for p in standing {
                match p.judgement {
                    tensorset::reclaim::Judgement::Stale(part) => stale.push(part),
                    tensorset::reclaim::Judgement::Kept(why) => s.kept.push(format!(
                        "tensorset {t}: {} {SHM_DIR}/{} ({}, {} s old): {why}",
                        p.part.word(),
                        p.segment,
                        crate::error::bytes(p.bytes),
                        p.age_secs
                    )),
                    tensorset::reclaim::Judgement::Unjudged(e) => unjudged.push((p.part, e)),
                }
            }
            Ok((stale, unjudged))
        }
        // The manifest stands, or nothing does.
        _ => tensorset::reclaim::judged_parts(t).map(|p| (p.stale, p.unjudged)),
    };
    let (parts, unjudged) = match judged {
        Ok(p) => p,
        Err(e) => {
            s.unread(format!("tensorset {t}"), e);
            return;
        }
    };
    let holders_unjudged = unjudged.iter().any(|(p, _)| *p == Part::Holders);
    for (_, e) in unjudged {
        s.unread(format!("tensorset {t}"), e);
    }
    let writer_dead = parts
        .iter()
        .any(|p| p.part == Part::Manifest && p.writer.is_some());
    for p in &parts {
        let (kind, whose) = match p.writer {
            Some(w) => (LeftoverKind::TensorSet, format!(" of dead writer {w}")),
            None => (LeftoverKind::TensorSetCreation, String::new()),
        };
        s.leftovers.push(leftover(
            kind,
            t,
            p.writer,
            Some(rustix::process::geteuid().as_raw()),
            format!(
                "tensorset {t}: {} {SHM_DIR}/{} ({}){whose}: {}",
                p.part.word(),
                p.segment,
                crate::error::bytes(p.bytes),
                p.why
            ),
            Target::TensorSetPart(p.part),
        ));
    }
    // (A holders segment that could not be judged is a problem already.)
    if !holders_unjudged && !parts.iter().any(|p| p.part == Part::Holders) {
        holders::scan(t, s);
    }
    if writer_dead {
        return;
    }
    // A live writer (or none readable): only dead readers' slots go.
    if let Ok(snap) = tensorset_inspect::inspect(t) {
        for r in snap
            .readers
            .iter()
            .filter(|r| r.liveness == identity::Liveness::Dead)
        {
            s.leftovers.push(leftover(
                LeftoverKind::TensorSetReader,
                t,
                Some(r.identity),
                None,
                format!(
                    "tensorset {t}: reader slot {} of dead pid {} ({}), holding generations {:?}",
                    r.slot, r.identity.pid, r.identity, r.held
                ),
                Target::TensorSetReader,
            ));
        }
    }
}

/// The quota ledgers `named` (`None`: every one in `/dev/shm`): a creation abandoned half-way is
/// a leftover, one that may still finish is kept with why; of a ready ledger, the dead holders'
/// reservations are the leftovers; another user's ledger (`ShmError::WrongOwner` from its open:
/// the judgement of a creation says so of a group ledger of another member too, which a member
/// of its group opens) is passed over, into [`Scan::skipped`].
fn scan_quota(named: Option<&[String]>, s: &mut Scan) {
    let names = match named {
        Some(n) => n.to_vec(),
        None => match quota::list_ledgers() {
            Ok(n) => n,
            Err(e) => {
                s.unread("quota ledgers".into(), e);
                return;
            }
        },
    };
    for name in names {
        if !name.starts_with(quota::LEDGER_PREFIX) {
            s.problems.push(problem(
                format!("quota ledger {name}"),
                Error::InvalidArgument(format!(
                    "{name:?} is not a quota ledger's name (`{}…`)",
                    quota::LEDGER_PREFIX
                )),
            ));
            continue;
        }
        // Judged first, by the rule a creator replaces one by: an unstamped creation would cost
        // the opener its 1 s wait for a stamp. Anything that is no creation of ours (a ready
        // ledger, another member's group ledger, a foreign file) is opened, and its error, if
        // any, is the problem.
        match quota::judge_creation(&name) {
            Ok(quota::Creation::Abandoned { why, creator, .. }) => {
                s.leftovers.push(leftover(
                    LeftoverKind::QuotaCreation,
                    &name,
                    creator,
                    Some(rustix::process::geteuid().as_raw()),
                    format!("quota ledger {name}: segment {SHM_DIR}/{name}: {why}"),
                    Target::QuotaCreation,
                ));
                continue;
            }
            Ok(quota::Creation::Sizing) => {
                s.kept.push(format!(
                    "quota ledger {name}: {}",
                    crate::shm::versioned::UNDER_WAY_UNSIZED
                ));
                continue;
            }
            Ok(quota::Creation::Unfinished(why)) => {
                s.kept.push(format!("quota ledger {name}: {why}"));
                continue;
            }
            // Gone meanwhile: nothing to report.
            Err(e) if super::is_gone(&e) => continue,
            Ok(quota::Creation::Finished) | Err(_) => {}
        }
        match QuotaLedger::open_named(&name).and_then(|l| l.dead_holders(false)) {
            Ok(dead) => {
                for h in &dead {
                    match &h.left_in {
                        // Its host memory stands, and this gc does not remove it (not named,
                        // another user's, kept): `remove` would keep the entry, so it is kept
                        // here too, and a dry run says what the run does.
                        Some(seg) if !s.leftovers.iter().any(|l| l.removes_segment(seg)) => {
                            s.kept.push(format!(
                                "quota ledger {name}: the reservation of {} of dead {}: \
                                 its host memory is still in {SHM_DIR}/{seg}, which this gc does \
                                 not remove (`cuda-ipc gc` of its channel or tensor set, by the \
                                 segment's owner, removes it, then frees the reservation)",
                                crate::error::bytes(h.bytes),
                                h.identity
                            ));
                        }
                        _ => s.leftovers.push(holder_leftover(&name, h)),
                    }
                }
            }
            Err(e) if another_users_ledger(&name, &e, s) => {}
            Err(e) => s.unread(format!("quota ledger {name}"), e),
        }
    }
}

/// Whether `e`, met judging or opening quota ledger `name`, says it is another user's (a group
/// ledger of a group this process is not in included: `ShmError::WrongOwner`; a file planted
/// under another user's ledger name: `QuotaError::Planted`); if so, it is passed over, into
/// [`Scan::skipped`], theirs to clean.
fn another_users_ledger(name: &str, e: &Error, s: &mut Scan) -> bool {
    let owner = match e {
        Error::Shm(crate::shm::ShmError::WrongOwner { owner, .. }) => owner,
        // A file planted under another user's ledger name is theirs to have removed (by root);
        // under this user's (or seen by root) it stays a problem, which says what to do.
        Error::Quota(quota::QuotaError::Planted { uid, owner, .. }) if !ours(*uid) => owner,
        _ => return false,
    };
    s.skipped.push(Skipped {
        name: name.to_string(),
        uid: *owner,
        what: "quota ledger",
        dead: false,
        owner: None,
    });
    true
}

/// Whether a file of `uid` is ours to remove: this user's, or anyone's for root.
fn ours(uid: u32) -> bool {
    let me = rustix::process::geteuid();
    me.is_root() || me.as_raw() == uid
}

fn scan_process_files(s: &mut Scan) {
    // Sockets first: their staleness is read through the liveness files.
    match fdpass::stale_socket_files() {
        Ok(files) => s
            .leftovers
            .extend(files.into_iter().filter(|f| ours(f.uid)).map(|f| {
                leftover(
                    LeftoverKind::FdSocket,
                    &f.name.clone(),
                    Some(f.identity),
                    Some(f.uid),
                    format!(
                        "fd server socket {SHM_DIR}/{} of dead {}",
                        f.name, f.identity
                    ),
                    Target::Socket(f),
                )
            })),
        Err(e) => s.unread("fd server sockets".into(), e),
    }
    match identity::stale_liveness_files() {
        Ok(files) => s
            .leftovers
            .extend(files.into_iter().filter(|f| ours(f.uid)).map(|f| {
                leftover(
                    LeftoverKind::LivenessFile,
                    &f.name.clone(),
                    Some(f.identity),
                    Some(f.uid),
                    format!("liveness file {SHM_DIR}/{} of dead {}", f.name, f.identity),
                    Target::Liveness(f),
                )
            })),
        Err(e) => s.unread("liveness files".into(), e),
    }
    // Under a liveness file's name but no liveness file (another user's data, a link): a problem,
    // never removed, root's `gc` included.
    match identity::not_liveness_files() {
        Ok(files) => {
            for f in files.into_iter().filter(|f| ours(f.uid)) {
                s.problems.push(problem(
                    format!("liveness file {SHM_DIR}/{}", f.name),
                    Error::InvalidArgument(format!(
                        "{SHM_DIR}/{} is no liveness file: {} of uid {} stands under the name \
                         (a liveness file is empty, of mode 0644); left as it is",
                        f.name, f.what, f.uid
                    )),
                ));
            }
        }
        Err(e) => s.unread("liveness files".into(), e),
    }
    // Kept for their age, by the rule above: said, so a `gc` right after a kill does not look as
    // if it missed them.
    match identity::young_free_liveness_files() {
        Ok(files) => s
            .kept
            .extend(files.into_iter().filter(|f| ours(f.uid)).map(|f| {
            format!(
                "liveness file {SHM_DIR}/{} of {}: its lock is free, but it is younger than {} s \
                 (a starting process's lock is free too); removed once older, if it stays free",
                f.name,
                f.identity,
                identity::LIVENESS_FILE_GRACE.as_secs()
            )
        })),
        Err(e) => s.unread("liveness files".into(), e),
    }
    for (c, uid) in stale_bridge_status_files() {
        if ours(uid) {
            s.leftovers.push(leftover(
                LeftoverKind::BridgeStatus,
                &c,
                None,
                Some(uid),
                format!("bridge status {SHM_DIR}/{BRIDGE_PREFIX}{c} of a dead bridge"),
                Target::Bridge,
            ));
        }
    }
}

/// Status files of dead bridges, as (channel, owner uid). A bridge's temporary file
/// (`NAME.tmp-lane-PID`) is not a status file.
fn stale_bridge_status_files() -> Vec<(String, u32)> {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    let mut v: Vec<(String, u32)> = dir
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            let c = name.strip_prefix(BRIDGE_PREFIX)?.to_string();
            let m = e.metadata().ok()?;
            if c.contains(".tmp-lane-") || !m.is_file() {
                return None;
            }
            bridge_dead(&c)?.then_some((c, m.uid()))
        })
        .collect();
    v.sort();
    v
}
