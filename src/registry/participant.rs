//! Participant entries: how a process claims one, how lock words name their holder through it, and
//! how anyone decides whether that holder is dead.
//!
//! Lock words (the slots' `writer`, the header's `table_lock`) hold a *lock name*: the claim
//! generation of the holder's participant entry and the entry's index. The entry holds the
//! holder's full [`ProcessIdentity`] (pid, start time, boot id, pid namespace), so every liveness
//! decision goes through [`ProcessIdentity::liveness`], which is right across pid namespaces. A
//! lock name whose entry has since been freed or claimed again names a claim that ended: its
//! holder is dead (a live holder releases its locks before it frees its entry).
//!
//! An entry's `owner` word is the claim itself: pid | claim generation << 22 | pid namespace << 32,
//! taken by one compare-exchange from 0. So even a claim whose claimer died before it wrote its
//! identity names a pid and a namespace, and is freed only when no live process of that pid and
//! namespace holds a liveness lock (see [`claimer_liveness`]).
//!
//! | step | store | pairs with |
//! | --- | --- | --- |
//! | claim | `owner` CAS 0 → owner word (Acquire) | the Release that freed the entry |
//! | | `fence(Release)`, identity words (Relaxed) | `entry_state`'s Acquire fence and re-check of `owner` (SYNC POINT claim) |
//! | seal | `lock_name` store (Release) | `entry_state`'s Acquire load of `lock_name` (SYNC POINT seal) |
//! | free | `owner` CAS owner word → 0 (Release) | the next claimer's Acquire CAS |
//!
//! The functions here work on one entry; the [`Registry`] methods at the end apply them to a
//! handle's table: claim an entry, copy one, tell whether a lock's holder runs, free the entries of
//! dead processes, list the live participants.

use super::layout::{OWNER_GEN_MASK, OWNER_PID_BITS, Participant};
use super::{ReclaimReport, Reclaimed, Registry};
use crate::identity::{LIVE_PREFIX, Liveness, ProcessIdentity};
use crate::sync::{Ordering, fence};

/// Attempts at a consistent copy of an entry before it is reported as changing.
const COPY_ATTEMPTS: u32 = 8;

/// The owner word of a claim by `id` with claim generation `claim`; `None` when the pid does not fit
/// its 22 bits (never on Linux, whose pids stay below `PID_MAX_LIMIT` = 2^22).
pub(crate) fn owner_word(id: &ProcessIdentity, claim: u64) -> Option<u64> {
    if id.pid == 0 || id.pid >= 1 << OWNER_PID_BITS {
        return None;
    }
    Some(
        u64::from(id.pid)
            | ((claim << OWNER_PID_BITS) & OWNER_GEN_MASK)
            | (u64::from(id.pid_ns) << 32),
    )
}

/// The lock name of the claim with generation `claim` of entry `index`: `claim << 32 | index + 1`.
/// Never 0.
pub(crate) fn lock_name(claim: u64, index: u32) -> u64 {
    ((claim & 0xffff_ffff) << 32) | (u64::from(index) + 1)
}

/// The entry index a lock name points to, `None` for 0 or a name beyond `participants`.
pub(crate) fn index_of(name: u64, participants: u32) -> Option<u32> {
    let i = (name & 0xffff_ffff) as u32;
    (i != 0 && i <= participants).then(|| i - 1)
}

/// Whether `name` is the lock name of the claim `owner` of entry `index` (same generation bits).
fn seals(owner: u64, name: u64, index: u32) -> bool {
    let gen_bits = (owner & OWNER_GEN_MASK) >> OWNER_PID_BITS;
    name & 0xffff_ffff == u64::from(index) + 1 && (name >> 32) & 0x3ff == gen_bits
}

/// The pid and pid namespace an owner word names.
pub(crate) fn claimer_of(owner: u64) -> (u32, u32) {
    (
        (owner & ((1 << OWNER_PID_BITS) - 1)) as u32,
        (owner >> 32) as u32,
    )
}

/// A participant entry, copied consistently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EntryState {
    /// Nobody holds it.
    Free,
    /// Held and sealed: `name` is the lock name its holder writes, `identity` the holder, `uid`
    /// its effective uid.
    Held {
        owner: u64,
        name: u64,
        identity: ProcessIdentity,
        uid: u32,
    },
    /// Claimed but not sealed: a claim in progress, or one whose claimer died half-way. Only the
    /// claimer's pid and namespace (in `owner`) are known.
    Claiming { owner: u64 },
    /// It changed during every copy attempt: someone is claiming or freeing it right now.
    Changing,
}

/// Copies entry `index` (`p`) consistently, seqlock-style: `owner` and `lock_name`, the identity,
/// then `owner` and `lock_name` again after an Acquire fence.
pub(crate) fn entry_state(p: &Participant, index: u32) -> EntryState {
    for _ in 0..COPY_ATTEMPTS {
        // Acquire: pairs with the Release of the CAS or store that made it (claim or free).
        let o1 = p.owner.load(Ordering::Acquire);
        if o1 == 0 {
            return EntryState::Free;
        }
        // SYNC POINT seal: Acquire, pairs with the claimer's Release store of `lock_name`; a sealed
        // name means the identity words below are the claimer's.
        let n1 = p.lock_name.load(Ordering::Acquire);
        // Relaxed loads: validated by the re-check below.
        let identity = ProcessIdentity::load_words(&p.identity);
        let uid = p.uid.load(Ordering::Relaxed);
        // SYNC POINT claim: Acquire fence, pairs with a new claimer's Release fence before its
        // identity stores: if any load above saw one of them, the loads below see its claim.
        fence(Ordering::Acquire);
        // Relaxed: ordered after the identity loads by the fence.
        let o2 = p.owner.load(Ordering::Relaxed);
        let n2 = p.lock_name.load(Ordering::Relaxed);
        if o1 != o2 || n1 != n2 {
            std::hint::spin_loop();
            continue;
        }
        return if seals(o1, n1, index) {
            EntryState::Held {
                owner: o1,
                name: n1,
                identity,
                uid,
            }
        } else {
            EntryState::Claiming { owner: o1 }
        };
    }
    EntryState::Changing
}

/// Whether the holder that lock name `name` names is alive, and who it is: the identity and uid
/// sealed in its entry decide ([`ProcessIdentity::liveness_as`]). A name whose entry is free, claimed again or
/// sealed with another name belongs to a claim that ended: [`Liveness::Dead`]. An entry changing
/// under every copy: [`Liveness::Unknown`].
pub(crate) fn holder_liveness(
    entry: impl Fn(u32) -> EntryState,
    name: u64,
    participants: u32,
) -> (Liveness, Option<ProcessIdentity>) {
    let Some(i) = index_of(name, participants) else {
        // Names no entry of this registry: no process of this protocol wrote it.
        return (Liveness::Dead, None);
    };
    match entry(i) {
        EntryState::Held {
            name: n,
            identity,
            uid,
            ..
        } if n == name => (identity.liveness_as(uid), Some(identity)),
        EntryState::Changing => (Liveness::Unknown, None),
        _ => (Liveness::Dead, None),
    }
}

/// Whether the claimer of an unsealed entry (pid and namespace from `owner`) may still run.
///
/// Every process that claims an entry holds a liveness lock on
/// `/dev/shm/cuda-ipc.live.<ns>.<pid>.<start time>` (it took its identity first). So the claimer is
/// dead when no such file of that namespace and pid is held ([`ProcessIdentity::liveness`] of each
/// candidate, boot id `boot`). In our own pid namespace, a pid that `/proc` still shows counts as
/// possibly alive even without a file (a pid reused by another process keeps the entry until it
/// exits: a leak, never a false death).
pub(crate) fn claimer_liveness(owner: u64, boot: [u8; 16]) -> Liveness {
    let (pid, pid_ns) = claimer_of(owner);
    if pid == 0 {
        return Liveness::Dead;
    }
    let prefix = format!("{LIVE_PREFIX}{pid_ns}.{pid}.");
    let Ok(dir) = std::fs::read_dir(crate::shm::SHM_DIR) else {
        return Liveness::Unknown;
    };
    let mut verdict = Liveness::Dead;
    for ent in dir.flatten() {
        let name = ent.file_name();
        let Some(start) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        let id = ProcessIdentity {
            pid,
            start_time: start,
            boot_id: boot,
            pid_ns,
        };
        match id.liveness() {
            Liveness::Dead => {}
            Liveness::Alive => return Liveness::Alive,
            _ => verdict = Liveness::Unknown,
        }
    }
    let probe = ProcessIdentity {
        pid,
        start_time: 0,
        boot_id: boot,
        pid_ns,
    };
    if verdict == Liveness::Dead
        && probe.in_own_pid_namespace()
        && crate::identity::proc_has_pid(pid)
    {
        return Liveness::Unknown;
    }
    verdict
}

impl Registry {
    /// Claims a free participant entry and seals it with this process's identity; returns its
    /// index, owner word and lock name.
    pub(super) fn claim_participant(&self) -> Option<(u32, u64, u64)> {
        for i in 0..self.participants {
            let p = self.participant_at(i);
            // Relaxed: only a hint for which entry to try.
            if p.owner.load(Ordering::Relaxed) != 0 {
                continue;
            }
            // Relaxed: a read-modify-write, so every attempt on this entry gets its own number;
            // that keeps owner words and lock names of successive claims apart.
            let claim = p.claims.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
            let owner = owner_word(&self.me, claim)?;
            // Acquire on success: pairs with the Release that freed the entry (the holder's drop or
            // a reclaim), so the previous claim's stores come before ours.
            if p.owner
                .compare_exchange(0, owner, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            // SYNC POINT claim: Release fence, pairs with the Acquire fence in `entry_state`: a
            // reader that copies any identity word below then sees this claim's owner word.
            fence(Ordering::Release);
            self.me.store_words(&p.identity);
            // Relaxed: sealed with the identity by the Release store of `lock_name` below.
            p.uid.store(self.uid, Ordering::Relaxed);
            let name = lock_name(claim, i);
            // SYNC POINT seal: Release, pairs with the Acquire load of `lock_name` in
            // `entry_state`; the identity above is complete for whoever sees this name.
            p.lock_name.store(name, Ordering::Release);
            return Some((i, owner, name));
        }
        None
    }

    /// Entry `i`, copied consistently.
    pub(super) fn entry(&self, i: u32) -> EntryState {
        entry_state(self.participant_at(i), i)
    }

    /// Whether the holder of lock name `name` runs, and who it is (see this module's docs).
    pub(super) fn holder_liveness(&self, name: u64) -> (Liveness, Option<ProcessIdentity>) {
        holder_liveness(|i| self.entry(i), name, self.participants)
    }

    /// `true` only when the holder of lock name `name` is dead ([`Liveness::Unknown`] is not).
    pub(super) fn holder_is_dead(&self, name: u64) -> bool {
        name != self.lock_name && self.holder_liveness(name).0 == Liveness::Dead
    }

    /// Whether the process behind entry `i` runs: the sealed identity decides, or for a claim that
    /// was never sealed, the claimer's pid and namespace.
    pub(super) fn entry_liveness(&self, state: &EntryState) -> Liveness {
        match state {
            EntryState::Free => Liveness::Dead,
            EntryState::Held { identity, uid, .. } => identity.liveness_as(*uid),
            EntryState::Claiming { owner } => claimer_liveness(*owner, self.me.boot_id),
            EntryState::Changing => Liveness::Unknown,
        }
    }

    /// Frees the entries of dead processes; counts those kept as unknown in `rep`.
    pub(super) fn reclaim_participants(
        &self,
        rep: &mut ReclaimReport,
        freed: &mut Vec<Reclaimed>,
    ) -> u32 {
        let mut n = 0;
        for i in 0..self.participants {
            if i == self.participant {
                continue;
            }
            let state = self.entry(i);
            let owner = match state {
                EntryState::Held { owner, .. } | EntryState::Claiming { owner } => owner,
                EntryState::Free | EntryState::Changing => continue,
            };
            match self.entry_liveness(&state) {
                Liveness::Dead => {
                    let p = self.participant_at(i);
                    // Release: pairs with the next claimer's Acquire compare-exchange. The owner
                    // word carries the claim's generation, so a newer claim is never freed here.
                    if p.owner
                        .compare_exchange(owner, 0, Ordering::Release, Ordering::Relaxed)
                        .is_ok()
                    {
                        n += 1;
                        freed.push(Reclaimed::Participant {
                            index: i,
                            pid: claimer_of(owner).0,
                        });
                    }
                }
                Liveness::Alive => {}
                _ => rep.kept_unknown += 1,
            }
        }
        n
    }

    /// Live participants (processes with this registry open), from the participant table: every
    /// sealed entry whose identity is not [`Liveness::Dead`], each process once.
    pub fn participants(&self) -> Vec<ProcessIdentity> {
        let mut out = Vec::new();
        for i in 0..self.participants {
            if let EntryState::Held { identity, uid, .. } = self.entry(i)
                && identity.liveness_as(uid) != Liveness::Dead
                && !out.contains(&identity)
            {
                out.push(identity);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_names_and_owner_words_round_trip() {
        let me = ProcessIdentity::current().unwrap();
        let o = owner_word(&me, 0x1234_5678).unwrap();
        assert_eq!(claimer_of(o), (me.pid, me.pid_ns));
        let n = lock_name(0x1234_5678, 7);
        assert_eq!(index_of(n, 8), Some(7));
        assert_eq!(index_of(n, 7), None);
        assert!(seals(o, n, 7));
        assert!(!seals(o, lock_name(0x1234_5679, 7), 7));
        assert!(!seals(o, n, 6));
        assert_eq!(index_of(0, 8), None);
    }

    #[test]
    fn a_claimer_without_a_liveness_file_in_another_namespace_is_dead() {
        let mut other = ProcessIdentity::current().unwrap();
        other.pid_ns = other.pid_ns.wrapping_add(3);
        let o = owner_word(&other, 1).unwrap();
        assert_eq!(claimer_liveness(o, other.boot_id), Liveness::Dead);
        let me = ProcessIdentity::current().unwrap();
        let o = owner_word(&me, 1).unwrap();
        assert_eq!(claimer_liveness(o, me.boot_id), Liveness::Alive);
    }
}
