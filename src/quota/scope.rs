//! Whose budget a ledger is ([`QuotaScope`]: this user's or a named group's) and the segment name
//! that follows from it.

use super::error::QuotaError;
use super::layout::{SCOPE_GROUP, SCOPE_USER};
use crate::driver::Uuid;
use crate::error::{OsError, Result};

/// The prefix of every ledger's segment name: `cuda-ipc.quota.u<uid>.<device hex>` (a user's) or
/// `cuda-ipc.quota.g<gid>.<device hex>` (a group's), in `/dev/shm` ([`QuotaScope::segment_name`]).
pub const LEDGER_PREFIX: &str = "cuda-ipc.quota.";

/// Whose budget a ledger is: this user's, or a group's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub enum QuotaScope {
    /// The ledger of one uid: mode `0600`, only that user's processes reserve from it.
    User(u32),
    /// The ledger of one group (gid): mode `0660`, every member's processes reserve from it.
    Group(u32),
}

impl QuotaScope {
    /// The scope of this process's effective uid.
    pub fn user() -> QuotaScope {
        QuotaScope::User(rustix::process::geteuid().as_raw())
    }

    /// The scope of the group `name` (a group name, or a numeric gid), of which this process must
    /// be a member (its effective gid or one of its supplementary groups), or be root.
    ///
    /// # Errors
    /// [`QuotaError::BadGroup`] when no such group exists or this process is not a member.
    pub fn group(name: &str) -> Result<QuotaScope> {
        let gid = match name.parse::<u32>() {
            Ok(g) => g,
            Err(_) => gid_of(name)?.ok_or_else(|| QuotaError::BadGroup {
                group: name.to_string(),
                reason: "no such group".into(),
            })?,
        };
        let member = rustix::process::getegid().as_raw() == gid
            || rustix::process::geteuid().is_root()
            || rustix::process::getgroups()
                .map(|g| g.iter().any(|x| x.as_raw() == gid))
                .unwrap_or(false);
        if !member {
            return Err(QuotaError::BadGroup {
                group: name.to_string(),
                reason: format!("this process (uid {}) is not a member of gid {gid}", {
                    rustix::process::geteuid().as_raw()
                }),
            }
            .into());
        }
        Ok(QuotaScope::Group(gid))
    }

    /// The ledger's segment name for `device`: `cuda-ipc.quota.u<uid>.<uuid hex>` or
    /// `cuda-ipc.quota.g<gid>.<uuid hex>` (32 lower-case hex digits; all zeros for host memory).
    pub fn segment_name(&self, device: Uuid) -> String {
        let hex: String = device.0.iter().map(|b| format!("{b:02x}")).collect();
        match self {
            QuotaScope::User(u) => format!("{LEDGER_PREFIX}u{u}.{hex}"),
            QuotaScope::Group(g) => format!("{LEDGER_PREFIX}g{g}.{hex}"),
        }
    }

    pub(super) fn words(&self) -> (u32, u32) {
        match *self {
            QuotaScope::User(u) => (SCOPE_USER, u),
            QuotaScope::Group(g) => (SCOPE_GROUP, g),
        }
    }
}

impl std::fmt::Display for QuotaScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuotaScope::User(u) => write!(f, "uid {u}"),
            QuotaScope::Group(g) => write!(f, "gid {g}"),
        }
    }
}

/// The uid a user ledger's segment name is for (`cuda-ipc.quota.u<uid>.<hex>`); `None` for a
/// group's or another name.
pub(super) fn user_of_name(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(LEDGER_PREFIX)?.strip_prefix('u')?;
    let (uid, _) = rest.split_once('.')?;
    if uid.is_empty() || !uid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    uid.parse().ok()
}

/// [`QuotaError::Planted`] when a file stands under user ledger `name` that another uid than
/// the name's owns (looked at with `lstat`: nothing is opened, so a FIFO cannot block); `Ok`
/// otherwise, whatever else stands there (the open judges it).
pub(super) fn check_planted(name: &str) -> Result<()> {
    let Some(uid) = user_of_name(name) else {
        return Ok(());
    };
    let path = format!("{}/{name}", crate::shm::SHM_DIR);
    match rustix::fs::lstat(path.as_str()) {
        Ok(st) if st.st_uid != uid => Err(QuotaError::Planted {
            name: name.to_string(),
            uid,
            owner: st.st_uid,
        }
        .into()),
        _ => Ok(()),
    }
}

/// The gid of group `name` (`getgrnam_r`), `None` when there is none.
fn gid_of(name: &str) -> Result<Option<u32>> {
    let bad = |reason: &str| QuotaError::BadGroup {
        group: name.to_string(),
        reason: reason.to_string(),
    };
    let cname = std::ffi::CString::new(name).map_err(|_| bad("a name with a NUL byte"))?;
    let mut len = 4096usize;
    loop {
        let mut buf = vec![0 as libc::c_char; len];
        // SAFETY: `group` is a plain C struct of pointers and integers; all-zero is valid.
        let mut grp: libc::group = unsafe { std::mem::zeroed() };
        let mut out: *mut libc::group = std::ptr::null_mut();
        // SAFETY: `cname` is NUL-terminated; `grp`, `buf` (of `len` bytes) and `out` are valid for
        // writes and outlive the call; the strings it stores point into `buf`, read by nobody.
        let r =
            unsafe { libc::getgrnam_r(cname.as_ptr(), &mut grp, buf.as_mut_ptr(), len, &mut out) };
        if r == libc::ERANGE && len < 1 << 20 {
            len *= 4;
            continue;
        }
        if r != 0 {
            return Err(
                OsError::io("getgrnam_r", name, std::io::Error::from_raw_os_error(r)).into(),
            );
        }
        return Ok((!out.is_null()).then_some(grp.gr_gid));
    }
}
