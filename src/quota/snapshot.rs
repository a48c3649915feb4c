//! What tools see of a ledger: [`LedgerSnapshot`] and its [`Holder`]s.

use super::scope::QuotaScope;
use crate::driver::Uuid;
use crate::identity::{Liveness, ProcessIdentity};

/// One reservation as [`QuotaLedger::snapshot`](super::QuotaLedger::snapshot) saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Holder {
    /// The process holding it.
    #[cfg_attr(
        feature = "serde",
        serde(serialize_with = "crate::identity::snapshot_json::identity")
    )]
    pub identity: ProcessIdentity,
    /// The holder's effective uid.
    pub uid: u32,
    /// Bytes held.
    pub bytes: u64,
    /// Its liveness when the snapshot was made (`Unknown` counts as alive and is kept).
    pub liveness: Liveness,
    /// For a dead holder of host memory: the `/dev/shm` name of its segment, which still holds
    /// the bytes (a killed process's host memory does not go with it), so its entry is kept and
    /// its bytes counted until that segment is removed (`cuda-ipc gc`, or a successor of the same
    /// name replacing it). `None` for every other holder.
    pub left_in: Option<String>,
}

/// A ledger's state, copied under its lock after dead holders were reclaimed (those whose memory
/// is gone).
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct LedgerSnapshot {
    /// The segment's name in `/dev/shm`.
    pub name: String,
    /// The device whose budget it is (all zeros: host memory). Serialises as the device's UUID
    /// text (`GPU-…`), or `"host"` for host memory (as the text form and the metrics say).
    #[cfg_attr(feature = "serde", serde(serialize_with = "uuid_text"))]
    pub device: Uuid,
    /// Whose budget.
    pub scope: QuotaScope,
    /// The segment's owner uid (who may change the budget, with root).
    pub owner_uid: u32,
    /// The segment's permission bits (`0o600`, `0o660`).
    pub mode: u32,
    /// The budget in bytes; `None`: unlimited.
    pub budget: Option<u64>,
    /// Bytes held by the holders below.
    pub used: u64,
    /// The live (or unknown) holders, and the dead ones whose host memory is still in
    /// `/dev/shm` ([`Holder::left_in`]).
    pub holders: Vec<Holder>,
    /// Dead holders whose entries this snapshot freed.
    pub reclaimed: u32,
}

#[cfg(feature = "serde")]
fn uuid_text<S: serde::Serializer>(u: &Uuid, s: S) -> std::result::Result<S::Ok, S::Error> {
    if u.0 == [0; 16] {
        return s.serialize_str("host");
    }
    s.collect_str(u)
}

#[cfg(all(test, feature = "serde"))]
mod tests {
    use super::*;

    #[test]
    fn a_host_ledgers_device_serialises_as_host_and_a_gpus_as_its_uuid() {
        let snap = |device: Uuid| LedgerSnapshot {
            name: "cuda-ipc.quota.u0.x".into(),
            device,
            scope: QuotaScope::User(0),
            owner_uid: 0,
            mode: 0o600,
            budget: None,
            used: 0,
            holders: Vec::new(),
            reclaimed: 0,
        };
        let json = |d| serde_json::to_value(snap(d)).unwrap()["device"].clone();
        assert_eq!(json(Uuid([0; 16])), "host");
        let gpu = Uuid([0xab; 16]);
        assert_eq!(json(gpu), gpu.to_string());
        assert!(gpu.to_string().starts_with("GPU-"));
    }
}
