//! Quotas across processes: a per-device budget of pool memory in a POSIX shared-memory segment,
//! the *quota ledger*, that every producer which opts in ([`crate::channel::ChannelOptions::quota`])
//! reserves its pool from at create and returns to at close, drop or death.
//!
//! Owns: [`QuotaLedger`] (create, open, set the budget, reserve, inspect), [`Reservation`] (bytes
//! held until dropped), [`QuotaScope`] (whose budget: this user's, or a named group's),
//! [`LedgerSnapshot`] and [`Holder`] (what tools show), [`abandoned`] and [`remove_abandoned`] (a
//! creation abandoned half-way, by the rule a creator replaces it by, for `cuda-ipc gc`),
//! [`QuotaError`] (this layer's error, with [`QuotaError::OverQuota`] naming who holds how much).
//! Built on `shm` (the segment and its versioned create/open protocol) and `identity` (holders and
//! their liveness). Never calls CUDA: a device is named by its UUID ([`crate::driver::Uuid`], the
//! type only).
//!
//! Who creates a ledger, its mode, and who may change the budget:
//! - the ledger of a device is created by whoever sets its budget first
//!   ([`QuotaLedger::set_budget`], the command line's `cuda-ipc quota set`); a producer never
//!   creates one, it only opens it (no ledger: [`crate::Error::Shm`] `NotFound`, naming the
//!   segment);
//! - per user (`/dev/shm/cuda-ipc.quota.u<uid>.<device>`): mode `0600`, only that user's
//!   processes open it;
//! - per group (`/dev/shm/cuda-ipc.quota.g<gid>.<device>`): mode `0660`, group set to the named
//!   group (the creator must be a member); every member's processes reserve from it;
//! - the budget is changed only by the segment's owner (its creator's uid)
//!   ([`QuotaError::NotBudgetOwner`] for a group member who is not; the library opens no other
//!   user's segment, root's processes included, so root removes another user's ledger by hand,
//!   `rm /dev/shm/NAME`). Group members can write the segment's bytes, so
//!   among them this holds as far as they use this crate: the quota is advisory, and memory
//!   allocated outside the crate (or by producers that do not opt in) is not counted.
//!
//! How it stays right when processes race or die:
//! - every change happens under the ledger lock: an open-file-description record lock
//!   (`F_OFD_SETLK`) on one byte of the segment file, which the kernel releases when its holder
//!   dies, whatever its pid namespace. Two producers racing for the last bytes are serialised by
//!   it, so exactly one wins. (Not a pthread mutex in shared memory: those park threads in
//!   per-process tables and are not robust across namespaces.)
//! - an entry is written in two steps, `WRITING` then the fields then `HELD` (`Release`); a holder
//!   of the lock killed between them leaves `WRITING`, which the next locker frees (its
//!   reservation was never returned to anyone): the repair;
//! - dead holders are reclaimed at every reserve and every inspection: each `HELD` entry's
//!   [`crate::identity::ProcessIdentity::liveness_as`] with the holder's recorded uid (`/proc` in
//!   one's own pid namespace, else a liveness file of that uid or root; `Unknown` counts as alive), so a killed producer's bytes come back at the next look, not after a timeout;
//! - but host memory does not go with its process: an entry records the `/dev/shm` segment that
//!   holds its bytes ([`Reservation::record_memory`]: its inode and a hash of its name), and a
//!   dead holder's entry stays, its bytes counted, while that segment stands (`cuda-ipc gc`
//!   removes it, then frees the entry; a successor that makes a segment of the same name is not
//!   counted against it: [`QuotaLedger::reserve_for`]).
//!
//! Files: `layout` (the byte layout), `scope` (whose budget, the segment name), `segment` (one
//! open ledger: its lock, repair, reclaim, and the judgement of a leftover under its name),
//! `ledger` (the public calls), `snapshot` (what tools see), `error`. `ledger` builds on
//! `segment`, which builds on `scope` and `snapshot`; none of those names `ledger`. The test
//! points of a reservation are under [`crate::raw::quota_test_hooks`].

mod error;
pub(crate) mod layout;
pub(crate) mod ledger;
mod scope;
mod segment;
mod snapshot;

pub use error::{HeldBy, QuotaError};
pub use layout::UNLIMITED;
pub(crate) use ledger::reserve_in;
pub use ledger::{QuotaLedger, Reservation, abandoned, list_ledgers, remove_abandoned};
pub use scope::{LEDGER_PREFIX, QuotaScope};
pub(crate) use segment::{Creation, judge_creation};
pub use snapshot::{Holder, LedgerSnapshot};
