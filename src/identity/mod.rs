//! Process identity: who exported a handle or holds a registry entry, in a form that survives pid
//! reuse and is right across pid namespaces.
//!
//! Owns: [`ProcessIdentity`] (pid + process start time + boot id + pid namespace), the liveness
//! lock every process holds while it runs, and the liveness check. It reads `/proc` and
//! `/proc/sys/kernel/random/boot_id` and keeps one file in `/dev/shm`; it never touches CUDA or the
//! segments' contents.
//!
//! # Liveness across pid namespaces
//! Containers of one pod share `/dev/shm` but not pid numbers, so a pid written by one namespace
//! means nothing in another's `/proc`. Every process that takes its identity
//! ([`ProcessIdentity::current`]) therefore creates the liveness file
//! `/dev/shm/cuda-ipc.live.<pid ns>.<pid>.<start time>` (mode 0644, empty) and holds an
//! open-file-description lock (`F_OFD_SETLK`, write lock on byte 0) on it for as long as it runs.
//! The kernel drops the lock when the last descriptor of that open file description closes, i.e.
//! when the process exits or is killed. Any process that can see the file (any namespace sharing
//! `/dev/shm`) asks with `F_OFD_GETLK` whether the lock is still held:
//! - held → [`Liveness::Alive`]; free → [`Liveness::Dead`];
//! - no file: the process exited normally (it removes its file at exit) or `cuda-ipc gc` removed a
//!   dead one's file → [`Liveness::Dead`];
//! - the file cannot be opened (permissions) → [`Liveness::Unknown`], which every caller treats as
//!   alive.
//!
//! # What a neighbour cannot forge
//! `/dev/shm` is world-writable, so once a process has exited anyone may make a file under its
//! liveness name and lock it. Two rules keep such a file from keeping a dead process "alive":
//! - in the caller's own pid namespace, with `/proc` mounted for it, `/proc` decides before any
//!   lock is asked: no such pid, a zombie, or another start time (the pid reused) →
//!   [`Liveness::Dead`], whatever any lock says; the same pid with the same start time →
//!   [`Liveness::Alive`]. Only where `/proc` cannot tell (it hides other users' processes,
//!   `hidepid`, or a read fails) is the lock asked;
//! - a liveness file counts only when its owner is the uid recorded beside the identity (or root):
//!   every segment of this crate records the uid of each process it names (the registry's creator,
//!   participants and record owners; a channel's producer and consumers; a host pool's producer),
//!   and its readers ask [`ProcessIdentity::liveness_as`] with that uid. A file of anyone else under
//!   the name is ignored, as if there were none. [`ProcessIdentity::liveness`], for identities
//!   without a recorded uid (a token's exporter, a quota reservation), still counts a lock of any
//!   owner in another pid namespace.
//!
//! The descriptor is opened `O_CLOEXEC`, so an `exec`ed program does not inherit the lock. A child
//! made with `fork()` without `exec` would inherit the descriptor and keep its parent "alive": a
//! `pthread_atfork` child handler closes the child's copy (the parent's lock stays, since the parent
//! still holds the open file description), and the child takes an identity and a file of its own
//! the first time it asks.
//!
//! Files: `lock` (the fork-safe lock around this process's state, the liveness file it makes and
//! locks, the keeper thread and the process hooks, and the lock test other processes' files get),
//! `files` (the liveness files of other processes: which are stale, their removal), `proc` (the one
//! reader of `/proc`: stat lines, pid namespaces, `hidepid`, the boot id). `lock` and `files` build
//! on [`ProcessIdentity`] here; `files` uses `lock` and `proc`, and neither of those names `files`.
//! Tests that kill their own children remove those children's files through
//! [`crate::raw::identity`].

pub(crate) mod files;
mod fork;
pub(crate) mod lock;
mod proc;

pub(crate) use files::parse_file_name;
pub use files::{
    LIVENESS_FILE_GRACE, LivenessFile, NotLivenessFile, not_liveness_files,
    remove_stale_liveness_file, stale_liveness_files, young_free_liveness_files,
};
pub use fork::ForkEpoch;
pub use proc::own_pid_ns;
pub(crate) use proc::start_time_of;
pub(crate) use proc::{boot_id, parse_uuid_text, proc_has_pid};

use crate::error::{OsError, Result};
use lock::{LOCK_FD, LockState, STATE, hold_liveness_lock, probe_lock};
use proc::{proc_hides_processes, proc_is_own_namespace, proc_stat, stat_of};
use std::sync::atomic::Ordering;

/// Where the liveness files live (the directory of POSIX shared memory).
const LIVE_DIR: &str = "/dev/shm";
/// Prefix of a liveness file's name.
pub const LIVE_PREFIX: &str = "cuda-ipc.live.";

/// Who a process is: pid, start time, boot id and pid namespace.
///
/// A pid alone is reused by the kernel; the start time (field 22 of `/proc/PID/stat`, in clock ticks
/// since boot) tells a reused pid apart, and the boot id (`/proc/sys/kernel/random/boot_id`, 16 bytes)
/// tells a record written before a reboot (e.g. in a persisted token) apart from a live process. The
/// pid namespace (the inode number of `/proc/PID/ns/pid`) says which namespace the pid is counted
/// in: two containers each have a pid 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ProcessIdentity {
    /// Process id, as the kernel reports it in the process's own pid namespace (`getpid()`).
    pub pid: u32,
    /// Process start time in clock ticks since boot (`/proc/PID/stat` field 22); the same number in
    /// every pid namespace.
    pub start_time: u64,
    /// The kernel's boot id, as 16 raw bytes.
    pub boot_id: [u8; 16],
    /// Inode number of the process's pid namespace (`stat /proc/self/ns/pid`); 0 when unknown.
    #[cfg_attr(feature = "serde", serde(default))]
    pub pid_ns: u32,
}

/// What [`ProcessIdentity::liveness`] found.
///
/// With the `serde` feature it serialises as a lower-case word: `"alive"`, `"dead"`, `"unknown"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(rename_all = "lowercase")
)]
#[non_exhaustive]
pub enum Liveness {
    /// The process runs: in this pid namespace, `/proc` shows the same pid with the same start
    /// time; elsewhere its liveness lock is held (on a file of its recorded uid, or root's, where
    /// one is recorded).
    Alive,
    /// The process is gone: no such pid, a different start time (pid reused) or a zombie in this
    /// pid namespace; its liveness lock free, its file removed or of another owner elsewhere; or
    /// another boot.
    Dead,
    /// It could not be told (e.g. another namespace's liveness file that this user may not open, or
    /// `/proc` hidden by `hidepid`); callers treat this as alive.
    Unknown,
}

/// The `serde` form of a [`ProcessIdentity`] inside the inspection snapshots
/// (`registry::inspect`, `channel::inspect`; `cuda-ipc ls --json`): `pid`, `start_time` and
/// `pid_ns`, without the boot id. `/dev/shm` does not survive a reboot, so every process a segment
/// names ran under this boot. Tokens keep the full form of the derive.
#[cfg(feature = "serde")]
pub(crate) mod snapshot_json {
    use super::ProcessIdentity;
    use serde::{Serialize, Serializer};

    #[derive(Serialize)]
    struct Json {
        pid: u32,
        start_time: u64,
        pid_ns: u32,
    }

    impl From<&ProcessIdentity> for Json {
        fn from(id: &ProcessIdentity) -> Self {
            Json {
                pid: id.pid,
                start_time: id.start_time,
                pid_ns: id.pid_ns,
            }
        }
    }

    /// For `serialize_with` on a `ProcessIdentity` field (and `flatten` to inline it).
    pub(crate) fn identity<S: Serializer>(id: &ProcessIdentity, s: S) -> Result<S::Ok, S::Error> {
        Json::from(id).serialize(s)
    }

    /// For `serialize_with` on an `Option<ProcessIdentity>` field: the same, or `null`.
    pub(crate) fn optional<S: Serializer>(
        id: &Option<ProcessIdentity>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        id.as_ref().map(Json::from).serialize(s)
    }
}

impl std::fmt::Display for ProcessIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.pid_ns != 0 && self.pid_ns != own_pid_ns() {
            write!(f, "pid {} in pid namespace {}", self.pid, self.pid_ns)
        } else {
            write!(f, "pid {}", self.pid)
        }
    }
}

impl ProcessIdentity {
    /// The identity of the calling process, computed once and cached; the first call also creates
    /// and locks this process's liveness file (see the [module docs](self)).
    ///
    /// # Errors
    /// [`crate::Error::Os`] when `/proc/self/stat` or the boot id cannot be read, or when the
    /// liveness file cannot be made and locked (`/dev/shm` missing or out of inodes, or a file of
    /// that name owned by another user or not a regular file).
    pub fn current() -> Result<Self> {
        // The pid changes across fork(); fork without exec is not supported with CUDA, but a forked
        // registry-only child must not reuse its parent's identity (or its liveness lock).
        let pid = std::process::id();
        let mut state = STATE.lock();
        if let Some(id) = state.identity
            && id.pid == pid
            && LOCK_FD.load(Ordering::Acquire) >= 0
        {
            return Ok(id);
        }
        let id = Self::read_self()?;
        hold_liveness_lock(&id, &mut state)?;
        state.identity = Some(id);
        Ok(id)
    }

    /// Whether this identity is the calling process's. An identity of another pid is answered at
    /// once, without making this process's identity (its `/proc` reads and liveness file, which
    /// [`current`](Self::current) makes on its first call); one of this pid (this process, or one
    /// of another pid namespace with the same number) is compared with `current()`.
    ///
    /// # Errors
    /// As [`current`](Self::current), only when the pids are equal.
    pub fn is_current(&self) -> Result<bool> {
        if self.pid != std::process::id() {
            return Ok(false);
        }
        Ok(*self == Self::current()?)
    }

    fn read_self() -> Result<Self> {
        let path = "/proc/self/stat";
        let stat = proc_stat("self").map_err(|e| OsError::io("read", path, e))?;
        let start_time = stat.start_time.ok_or_else(|| {
            OsError::io(
                "read",
                path,
                std::io::Error::new(std::io::ErrorKind::InvalidData, "no start time field"),
            )
        })?;
        Ok(Self {
            pid: std::process::id(),
            start_time,
            boot_id: boot_id()?,
            pid_ns: own_pid_ns(),
        })
    }

    /// Whether the process this identity names is still running, when no uid was recorded for it
    /// (a token's exporter): `/proc` in this pid namespace, else the liveness lock, whoever owns its
    /// file; see the [module docs](self). Prefer [`liveness_as`](Self::liveness_as) wherever the
    /// process's uid is known: a lock another user forged under the name does not count there.
    ///
    /// Costs a few system calls (open, `fcntl`, close): callers check on slow paths only (a wait
    /// that sleeps or timed out), never per frame.
    pub fn liveness(&self) -> Liveness {
        self.liveness_checked(None)
    }

    /// Whether the process this identity names, run by the user `uid` (the effective uid recorded
    /// beside the identity in a segment), is still running: `/proc` in this pid namespace (pid
    /// gone, zombie or another start time → [`Liveness::Dead`], whatever any lock says), else the
    /// liveness lock, counted only when its file belongs to `uid` or to root (a file of another
    /// owner under the name is ignored, as if there were none). See the [module docs](self).
    ///
    /// Costs as [`liveness`](Self::liveness): slow paths only.
    pub fn liveness_as(&self, uid: u32) -> Liveness {
        self.liveness_checked(Some(uid))
    }

    fn liveness_checked(&self, uid: Option<u32>) -> Liveness {
        match boot_id() {
            Ok(b) if b != self.boot_id => return Liveness::Dead,
            Ok(_) => {}
            Err(_) => return Liveness::Unknown,
        }
        if self.pid == 0 || self.pid > i32::MAX as u32 {
            return Liveness::Dead;
        }
        // In our own pid namespace /proc decides first: a lock anyone may take on a file under a
        // dead process's name must not outvote the kernel's process table.
        let from_proc = self.proc_answers().then(|| self.proc_liveness(uid));
        match from_proc {
            Some(Liveness::Alive) => return Liveness::Alive,
            Some(Liveness::Dead) => return Liveness::Dead,
            _ => {}
        }
        match probe_lock(self, uid) {
            LockState::Held => Liveness::Alive,
            LockState::Free => Liveness::Dead,
            // /proc was asked and could not tell (hidden or unreadable): nor can a missing file.
            LockState::Missing | LockState::NotOwned if from_proc.is_some() => Liveness::Unknown,
            LockState::Missing | LockState::NotOwned => Liveness::Dead,
            LockState::Unreadable => Liveness::Unknown,
        }
    }

    /// `liveness() != Dead`: the conservative answer (unknown counts as alive).
    pub fn is_alive(&self) -> bool {
        self.liveness() != Liveness::Dead
    }

    /// Whether this identity's pid is counted in the caller's pid namespace (so `/proc/PID`,
    /// `pidfd_open(PID)` and `SO_PEERCRED` pids mean the same process). `false` when either
    /// namespace is unknown.
    pub fn in_own_pid_namespace(&self) -> bool {
        self.pid_ns != 0 && self.pid_ns == own_pid_ns()
    }

    /// Whether `/proc` of the caller can answer for this identity: same pid namespace, and `/proc`
    /// mounted for that namespace (after `unshare --pid` without `--mount-proc`, `/proc` still shows
    /// the parent namespace's numbers).
    fn proc_answers(&self) -> bool {
        self.in_own_pid_namespace() && proc_is_own_namespace()
    }

    /// What `/proc` says of this identity (asked only when [`proc_answers`](Self::proc_answers)):
    /// the same pid and start time, not a zombie → alive; a zombie or another start time → dead;
    /// no such pid → dead, unless `/proc` hides other users' processes (`hidepid`) and this one may
    /// be another user's (`uid`: the recorded uid, if any) → unknown; a read error → unknown.
    fn proc_liveness(&self, uid: Option<u32>) -> Liveness {
        match stat_of(self.pid) {
            Ok(Some((state, t))) if t == self.start_time && !matches!(state, 'Z' | 'X') => {
                Liveness::Alive
            }
            Ok(Some(_)) => Liveness::Dead,
            Ok(None) => {
                let euid = rustix::process::geteuid();
                if proc_hides_processes() && !euid.is_root() && uid != Some(euid.as_raw()) {
                    Liveness::Unknown
                } else {
                    Liveness::Dead
                }
            }
            Err(_) => Liveness::Unknown,
        }
    }

    /// The path of this process's liveness file:
    /// `/dev/shm/cuda-ipc.live.<pid ns>.<pid>.<start time>`.
    pub fn liveness_path(&self) -> String {
        format!("{LIVE_DIR}/{}", self.liveness_name())
    }

    /// The file name (in `/dev/shm`) of this process's liveness file.
    pub fn liveness_name(&self) -> String {
        self.file_name(LIVE_PREFIX)
    }

    /// The name of a per-process file in `/dev/shm`: `<prefix><pid ns>.<pid>.<start time>` in
    /// decimal (the liveness file, the fd server's socket). Unique per process and boot.
    pub(crate) fn file_name(&self, prefix: &str) -> String {
        format!("{prefix}{}.{}.{}", self.pid_ns, self.pid, self.start_time)
    }

    /// The identity as four 64-bit words, the form every shared-memory layout of this crate stores:
    /// `[pid | pid_ns << 32, start_time, boot_id[0..8] LE, boot_id[8..16] LE]`.
    pub fn to_words(&self) -> [u64; 4] {
        let (lo, hi) = self.boot_id.split_at(8);
        [
            u64::from(self.pid) | (u64::from(self.pid_ns) << 32),
            self.start_time,
            u64::from_le_bytes(lo.try_into().unwrap_or_default()),
            u64::from_le_bytes(hi.try_into().unwrap_or_default()),
        ]
    }

    /// The inverse of [`ProcessIdentity::to_words`].
    pub fn from_words(w: [u64; 4]) -> Self {
        let mut boot_id = [0u8; 16];
        boot_id[..8].copy_from_slice(&w[2].to_le_bytes());
        boot_id[8..].copy_from_slice(&w[3].to_le_bytes());
        Self {
            pid: w[0] as u32,
            pid_ns: (w[0] >> 32) as u32,
            start_time: w[1],
            boot_id,
        }
    }

    /// Stores the identity into four words of shared memory, in the [`to_words`](Self::to_words)
    /// form: the one place every segment layout of this crate writes an identity (the registry's
    /// creator and participant entries, the host pool's producer, a holder's entry).
    ///
    /// The start time and boot id are stored first, the pid word last with `Release`, so that a
    /// reader that sees the pid ([`load_words`](Self::load_words)) sees the rest of a first
    /// recording whole: a judge looking at a segment before its stamp never takes a creator for
    /// dead from a torn identity. The caller still publishes the words with its own `Release` (an
    /// init stamp, a seal word, a fence) and names that pairing where it calls this.
    pub(crate) fn store_words(&self, words: &[crate::sync::AtomicU64; 4]) {
        let w = self.to_words();
        for i in 1..4 {
            // Relaxed: published by the Release store of the pid word below.
            words[i].store(w[i], crate::sync::Ordering::Relaxed);
        }
        // SYNC POINT: identity recorded. Release, stored last: pairs with the Acquire load of the
        // pid word in `load_words`.
        words[0].store(w[0], crate::sync::Ordering::Release);
    }

    /// Reads an identity that [`store_words`](Self::store_words) wrote: the pid word first, with
    /// `Acquire`, then the rest. A pid of 0 means none recorded yet. Of an identity recorded
    /// again in place (a slot reused), the copy may still mix two: the caller validates it (a
    /// re-check after a fence), as before.
    pub(crate) fn load_words(words: &[crate::sync::AtomicU64; 4]) -> Self {
        // SYNC POINT: identity recorded. Acquire, loaded first: pairs with the Release store of
        // the pid word in `store_words`.
        let first = words[0].load(crate::sync::Ordering::Acquire);
        Self::from_words(std::array::from_fn(|i| {
            if i == 0 {
                first
            } else {
                // Relaxed: ordered after the Acquire load above (or validated by the caller).
                words[i].load(crate::sync::Ordering::Relaxed)
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lock::{KEEPER_EVERY, liveness_lock_fd, lock_request, open_live_file, set_lock};
    use proc::start_time_of;
    use std::ffi::CString;
    use std::os::fd::AsRawFd;

    /// Held by every test here: one of them removes this process's own liveness file, which the
    /// others look at.
    static OWN_FILE: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        OWN_FILE.lock().unwrap_or_else(|p| p.into_inner())
    }

    #[test]
    fn current_process_is_alive() {
        let _serial = serial();
        let me = ProcessIdentity::current().unwrap();
        assert_eq!(me.pid, std::process::id());
        assert_eq!(me.liveness(), Liveness::Alive);
    }

    #[test]
    fn reused_pid_with_other_start_time_is_dead() {
        let _serial = serial();
        let mut me = ProcessIdentity::current().unwrap();
        me.start_time += 1;
        assert_eq!(me.liveness(), Liveness::Dead);
    }

    #[test]
    fn other_boot_is_dead() {
        let _serial = serial();
        let mut me = ProcessIdentity::current().unwrap();
        me.boot_id[0] ^= 0xff;
        assert_eq!(me.liveness(), Liveness::Dead);
    }

    #[test]
    fn exited_child_is_dead() {
        let _serial = serial();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = start_time_of(pid).unwrap();
        child.wait().unwrap();
        let id = ProcessIdentity {
            pid,
            start_time: start.unwrap_or(1),
            boot_id: boot_id().unwrap(),
            pid_ns: own_pid_ns(),
        };
        assert_eq!(id.liveness(), Liveness::Dead);
    }

    #[test]
    fn an_unreaped_zombie_is_dead() {
        let _serial = serial();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = start_time_of(pid).unwrap().unwrap();
        let id = ProcessIdentity {
            pid,
            start_time: start,
            boot_id: boot_id().unwrap(),
            pid_ns: own_pid_ns(),
        };
        // Not reaped yet: wait until the kernel shows it as a zombie.
        let t = std::time::Instant::now();
        while stat_of(pid).unwrap().map(|(s, _)| s) != Some('Z') {
            assert!(t.elapsed() < std::time::Duration::from_secs(5));
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(id.liveness(), Liveness::Dead);
        child.wait().unwrap();
    }

    #[test]
    fn the_current_process_holds_its_liveness_lock() {
        let _serial = serial();
        let me = ProcessIdentity::current().unwrap();
        let path = me.liveness_path();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_file());
        assert!(liveness_lock_fd().is_some());
        assert_eq!(probe_lock(&me, None), LockState::Held);
        assert_eq!(me.pid_ns, own_pid_ns());
        assert_ne!(me.pid_ns, 0);
    }

    #[test]
    fn an_identity_of_another_namespace_without_a_liveness_file_is_dead() {
        let _serial = serial();
        // Same pid and start time as this process, counted in a namespace that is not ours: /proc
        // cannot answer for it, and no process holds a lock under that name.
        let mut other = ProcessIdentity::current().unwrap();
        other.pid_ns = other.pid_ns.wrapping_add(1);
        assert!(!other.in_own_pid_namespace());
        assert_eq!(other.liveness(), Liveness::Dead);
    }

    #[test]
    fn a_free_lock_reads_as_dead_and_a_held_one_as_alive_in_any_namespace() {
        let _serial = serial();
        let mut other = ProcessIdentity::current().unwrap();
        other.pid_ns = other.pid_ns.wrapping_add(7);
        other.start_time = other.start_time.wrapping_add(12345);
        let path = other.liveness_path();
        let _ = std::fs::remove_file(&path);
        // A file nobody locks: the process was killed.
        let fd = open_live_file(&path, true).unwrap();
        assert_eq!(other.liveness(), Liveness::Dead);
        // Just made: not stale yet (a starting process locks its file right after making it).
        let stale = stale_liveness_files().unwrap();
        assert!(!stale.iter().any(|f| f.identity == other), "{stale:?}");
        std::thread::sleep(std::time::Duration::from_millis(2100));
        let stale = stale_liveness_files().unwrap();
        assert!(stale.iter().any(|f| f.identity == other), "{stale:?}");
        // Held (by this test, standing in for a process of that namespace): alive.
        set_lock(&fd).unwrap();
        assert_eq!(other.liveness(), Liveness::Alive);
        let file = LivenessFile {
            name: other.liveness_name(),
            identity: other,
            uid: 0,
        };
        assert!(!remove_stale_liveness_file(&file).unwrap(), "held: kept");
        drop(fd);
        assert_eq!(other.liveness(), Liveness::Dead);
        assert!(remove_stale_liveness_file(&file).unwrap());
        assert!(std::fs::symlink_metadata(&path).is_err());
        assert_eq!(other.liveness(), Liveness::Dead, "no file: dead");
    }

    #[test]
    fn a_read_lock_another_user_takes_on_a_dead_processs_file_does_not_make_it_alive() {
        let _serial = serial();
        let mut other = ProcessIdentity::current().unwrap();
        other.pid_ns = other.pid_ns.wrapping_add(11);
        other.start_time = other.start_time.wrapping_add(999);
        let path = other.liveness_path();
        let _ = std::fs::remove_file(&path);
        let _made = open_live_file(&path, true).unwrap(); // its process died: no write lock
        // Anyone may open the 0644 file read-only and take a read lock, e.g. waiting with
        // F_OFD_SETLKW for the owner to die.
        let reader = open_live_file(&path, false).unwrap();
        let l = lock_request(libc::F_RDLCK as libc::c_short);
        // SAFETY: `reader` is open; `l` is a valid flock.
        let r = unsafe { libc::fcntl(reader.as_raw_fd(), libc::F_OFD_SETLK, &l) };
        assert_eq!(r, 0);
        assert_eq!(other.liveness(), Liveness::Dead);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_removed_liveness_file_of_a_running_process_is_made_and_locked_again() {
        let _serial = serial();
        let me = ProcessIdentity::current().unwrap();
        let path = me.liveness_path();
        std::fs::remove_file(&path).unwrap();
        let t = std::time::Instant::now();
        while probe_lock(&me, None) != LockState::Held {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(2),
                "not made again"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(t.elapsed() < 2 * KEEPER_EVERY + std::time::Duration::from_millis(200));
    }

    #[test]
    fn a_fifo_under_a_liveness_name_is_unknown_not_a_hang() {
        let _serial = serial();
        let mut other = ProcessIdentity::current().unwrap();
        other.pid_ns = other.pid_ns.wrapping_add(9);
        other.start_time = other.start_time.wrapping_add(777);
        let path = other.liveness_path();
        let _ = std::fs::remove_file(&path);
        let c = CString::new(path.clone()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(other.liveness(), Liveness::Unknown);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_lock_on_a_file_of_another_owner_is_ignored_where_a_uid_is_recorded() {
        let _serial = serial();
        // Another namespace's identity (so /proc cannot answer), its file made and locked here.
        let mut other = ProcessIdentity::current().unwrap();
        other.pid_ns = other.pid_ns.wrapping_add(13);
        other.start_time = other.start_time.wrapping_add(4242);
        let path = other.liveness_path();
        let _ = std::fs::remove_file(&path);
        let fd = open_live_file(&path, true).unwrap();
        set_lock(&fd).unwrap();
        let mine = rustix::process::geteuid().as_raw();
        assert_eq!(other.liveness(), Liveness::Alive, "any owner");
        assert_eq!(
            other.liveness_as(mine),
            Liveness::Alive,
            "the recorded uid's"
        );
        // Recorded as another user's process: a file of ours under its name is a forgery, unless
        // we are root (root's files count for everyone).
        let expected = if mine == 0 {
            Liveness::Alive
        } else {
            Liveness::Dead
        };
        assert_eq!(other.liveness_as(mine.wrapping_add(1)), expected);
        drop(fd);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn is_current_is_true_only_for_this_process_s_identity() {
        let me = ProcessIdentity::current().unwrap();
        assert!(me.is_current().unwrap());
        let other_pid = ProcessIdentity {
            pid: me.pid.wrapping_add(1),
            ..me
        };
        assert!(!other_pid.is_current().unwrap());
        // Same number, another process (another pid namespace's, or a reused pid).
        let same_pid = ProcessIdentity {
            start_time: me.start_time + 1,
            ..me
        };
        assert!(!same_pid.is_current().unwrap());
    }

    #[test]
    fn words_round_trip() {
        let _serial = serial();
        let me = ProcessIdentity::current().unwrap();
        assert_eq!(ProcessIdentity::from_words(me.to_words()), me);
        let words: [crate::sync::AtomicU64; 4] =
            std::array::from_fn(|_| crate::sync::AtomicU64::new(0));
        me.store_words(&words);
        assert_eq!(ProcessIdentity::load_words(&words), me);
        let raw: [u64; 4] = std::array::from_fn(|i| words[i].load(crate::sync::Ordering::Relaxed));
        assert_eq!(raw, me.to_words());
    }
}
