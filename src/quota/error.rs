//! The quota layer's own error: what the ledger's layout and budget report. What its segment
//! reports (missing, another user's, not a file, sparse, too small) is [`crate::Error::Shm`].

use crate::driver::Uuid;

/// A reservation's holder as an error message names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldBy {
    /// The holder's pid, in its own pid namespace.
    pub pid: u32,
    /// The holder's pid namespace inode (0 when unknown).
    pub pid_ns: u32,
    /// The holder's effective uid.
    pub uid: u32,
    /// Bytes it holds.
    pub bytes: u64,
    /// For a dead holder whose host memory is still in `/dev/shm`: that segment's name (its bytes
    /// stay counted until it is removed, e.g. by `cuda-ipc gc`). `None` for a live holder.
    pub left_in: Option<String>,
}

impl std::fmt::Display for HeldBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pid {} (uid {}, pid ns {}) holds {}",
            self.pid,
            self.uid,
            self.pid_ns,
            crate::error::bytes(self.bytes)
        )?;
        if let Some(seg) = &self.left_in {
            write!(
                f,
                " (dead; its memory stays in /dev/shm/{seg} until uid {}'s `cuda-ipc gc` removes \
                 it)",
                self.uid
            )?;
        }
        Ok(())
    }
}

/// The dead holders a refused reservation would have replaced, for its message: nothing when none.
fn replaced_text(r: &[HeldBy]) -> String {
    if r.is_empty() {
        return String::new();
    }
    let each = r
        .iter()
        .map(|h| {
            format!(
                "{} of dead pid {} in /dev/shm/{}",
                crate::error::bytes(h.bytes),
                h.pid,
                h.left_in.as_deref().unwrap_or("?")
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    format!(" (not counted, since this reservation's segment replaces it: {each})")
}

/// A device as messages name it: `host memory` for the all-zero UUID, else the UUID.
fn device_text(d: &Uuid) -> String {
    if d.0 == [0; 16] {
        "host memory".to_string()
    } else {
        d.to_string()
    }
}

/// Lists holders for a message: "pid 7 (...) holds 10 bytes; pid 9 ..." or "nobody".
fn holders_text(h: &[HeldBy]) -> String {
    if h.is_empty() {
        return "nobody holds any".into();
    }
    h.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

/// What a quota ledger reports.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum QuotaError {
    /// A reservation would take the device's budget past its limit. Not the per-producer cap
    /// `ChannelOptions::quota_bytes` (that is `ChannelError::PoolOverCap`): this budget is shared
    /// by
    /// every producer of the user or group.
    #[error(
        "over quota on {}: asked {}, budget {}, {used} in use: {}{}",
        device_text(.device),
        crate::error::bytes(.asked),
        crate::error::bytes(.budget),
        holders_text(.holders),
        replaced_text(.replaced)
    )]
    OverQuota {
        /// The device whose budget it is (all zeros: host memory).
        device: Uuid,
        /// Bytes asked for.
        asked: u64,
        /// The budget in bytes.
        budget: u64,
        /// Bytes reserved by live holders when it was refused.
        used: u64,
        /// Who holds them.
        holders: Vec<HeldBy>,
        /// Dead holders whose host memory lies under the name this reservation's segment was to
        /// take (a restart under a crashed producer's or writer's name): not counted in `used`,
        /// since making that segment replaces their memory; their `left_in` names it.
        replaced: Vec<HeldBy>,
    },
    /// Every entry of the ledger is held: by live holders, and by dead ones whose host memory is
    /// still in `/dev/shm` (`cuda-ipc gc` removes it, then frees their entries).
    #[error(
        "quota ledger {name} has no free entry ({entries} reservations held: by live processes, \
         and by dead ones whose host memory is still in /dev/shm, which `cuda-ipc gc` frees)"
    )]
    Full {
        /// The segment's name.
        name: String,
        /// Its number of entries.
        entries: u32,
    },
    /// The segment under the ledger's name is not a ledger this build can read: another
    /// program's file, a truncated or garbled ledger, or a creation that never finished.
    #[error("{name} is not a usable quota ledger: {reason}")]
    BadSegment {
        /// The segment's name.
        name: String,
        /// What was found, in words.
        reason: String,
    },
    /// A ledger of another layout version.
    #[error(
        "quota ledger {name} has layout version {found}; this build reads version {supported} \
         (a build of another version made it: `cuda-ipc quota remove` removes it, then set the \
         budget again)"
    )]
    VersionMismatch {
        /// The segment's name.
        name: String,
        /// The version found.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// Only the ledger's owner (its creator's uid) may change the budget (root, where it may open
    /// the ledger, too: the library opens no other user's segment, so root removes another
    /// user's ledger by hand).
    #[error(
        "only uid {owner} (the ledger's owner) may change the budget of {name}; this is uid {ours} \
         (as root, `rm /dev/shm/{name}` removes it)"
    )]
    NotBudgetOwner {
        /// The segment's name.
        name: String,
        /// The owner's uid.
        owner: u32,
        /// Our effective uid.
        ours: u32,
    },
    /// No budget is set for the scope and device a producer asked to reserve from
    /// ([`crate::channel::ChannelOptions::quota`]): its ledger does not exist.
    #[error(
        "no budget is set in quota ledger {name} (set one first: `cuda-ipc quota set`, \
         QuotaLedger::set_budget, or cuda_ipc.set_quota in Python)"
    )]
    NoBudget {
        /// The ledger's segment name.
        name: String,
    },
    /// A file under a user's ledger name that another uid owns: another user made it there
    /// (the names are predictable), and it blocks that user's budget until it is removed. Never
    /// read and never removed by the library; root can remove it (`rm /dev/shm/NAME`).
    #[error(
        "quota ledger {name} is the budget of uid {uid} by its name, but uid {owner} owns the \
         file: another user planted it there, and it blocks that budget until removed (as root: \
         rm /dev/shm/{name})"
    )]
    Planted {
        /// The segment's name.
        name: String,
        /// The uid the name says the ledger is for.
        uid: u32,
        /// The uid that owns the file.
        owner: u32,
    },
    /// No group of that name, or this process is not a member of it.
    #[error("group {group}: {reason}")]
    BadGroup {
        /// The group named.
        group: String,
        /// Why it cannot be used.
        reason: String,
    },
}
