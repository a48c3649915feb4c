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

use crate::error::{OsError, Result};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};

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
    /// creator and participant entries, the host pool's producer).
    ///
    /// Each store is `Relaxed`: the caller publishes the words with its own `Release` (an init
    /// stamp, a seal word, a fence) and names that pairing where it calls this.
    pub(crate) fn store_words(&self, words: &[crate::sync::AtomicU64; 4]) {
        for (a, w) in words.iter().zip(self.to_words()) {
            // Relaxed: published by the caller's Release store or fence (see above).
            a.store(w, crate::sync::Ordering::Relaxed);
        }
    }

    /// Reads an identity that [`store_words`](Self::store_words) wrote.
    ///
    /// Each load is `Relaxed`: the caller orders them after the `Acquire` load that pairs with the
    /// writer's publication, or validates the copy afterwards (a re-check after a fence).
    pub(crate) fn load_words(words: &[crate::sync::AtomicU64; 4]) -> Self {
        // Relaxed: ordered or validated by the caller (see above).
        Self::from_words(std::array::from_fn(|i| {
            words[i].load(crate::sync::Ordering::Relaxed)
        }))
    }
}

/// What this module keeps about the calling process, behind a lock a forked child can take over.
#[derive(Default)]
struct State {
    /// The cached identity (reset in a forked child by the pid check in `current`).
    identity: Option<ProcessIdentity>,
    /// The liveness file's path, for the atexit handler.
    path: Option<CString>,
}

static STATE: ForkSafeLock<State> = ForkSafeLock::new();

/// Set by the atexit handler before it removes the liveness file, so the keeper thread (which runs
/// on while `exit` calls the handlers) does not make the file again.
// Release store in `remove_liveness_file_at_exit`; Acquire load in `keep_liveness_file`.
static EXITING: AtomicBool = AtomicBool::new(false);

/// A spin lock that knows which process took it. A `fork` copies a lock that another thread of the
/// parent held; that thread does not exist in the child, so a `std::sync::Mutex` would stay locked
/// there for good. Here a child finds the parent's pid as the holder, takes the lock over, and
/// starts from a fresh `T::default()` (the parent's value, possibly half-updated at the fork, is
/// leaked, never dropped). Held for microseconds (a file creation at most).
struct ForkSafeLock<T> {
    /// Pid of the process holding the lock, 0 when free.
    // Acquire on taking (pairs with the Release store in the guard's drop), Release on freeing.
    holder: AtomicU32,
    value: std::cell::UnsafeCell<Option<T>>,
}

// SAFETY: the value is only reached through a guard, and `holder` lets one thread at a time hold
// one (a forked child's takeover happens when no other thread of the child can hold it: the
// holder pid is another process's).
unsafe impl<T: Send> Sync for ForkSafeLock<T> {}

impl<T: Default> ForkSafeLock<T> {
    const fn new() -> Self {
        Self {
            holder: AtomicU32::new(0),
            value: std::cell::UnsafeCell::new(None),
        }
    }

    fn lock(&self) -> ForkSafeGuard<'_, T> {
        loop {
            if let Some(g) = self.try_lock() {
                return g;
            }
            std::thread::yield_now();
        }
    }

    fn try_lock(&self) -> Option<ForkSafeGuard<'_, T>> {
        let me = std::process::id();
        match self
            .holder
            .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
        {
            Ok(_) => {}
            Err(held) if held != me => {
                // Held by a thread of the process we were forked from: it does not run here.
                self.holder
                    .compare_exchange(held, me, Ordering::Acquire, Ordering::Relaxed)
                    .ok()?;
                // SAFETY: we hold the lock now; the value the parent left is forgotten, not
                // dropped (it may be half-updated).
                unsafe { std::ptr::write(self.value.get(), None) };
            }
            Err(_) => return None, // another thread of this process holds it
        }
        Some(ForkSafeGuard { lock: self })
    }
}

struct ForkSafeGuard<'a, T: Default> {
    lock: &'a ForkSafeLock<T>,
}

impl<T: Default> std::ops::Deref for ForkSafeGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock, so no other reference to the value exists.
        unsafe { (*self.lock.value.get()).get_or_insert_with(T::default) }
    }
}

impl<T: Default> std::ops::DerefMut for ForkSafeGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as for `deref`; `&mut self` makes this the only reference through the guard.
        unsafe { (*self.lock.value.get()).get_or_insert_with(T::default) }
    }
}

impl<T: Default> Drop for ForkSafeGuard<'_, T> {
    fn drop(&mut self) {
        // Release: pairs with the Acquire of the next `try_lock`.
        self.lock.holder.store(0, Ordering::Release);
    }
}
/// The descriptor holding this process's liveness lock; -1 when none.
// Release store in `hold_liveness_lock` after the lock is taken; Acquire load in `current`.
static LOCK_FD: AtomicI32 = AtomicI32::new(-1);
/// The pid that made the liveness file (the atexit handler removes it only in that process).
static LOCK_OWNER: AtomicI32 = AtomicI32::new(0);

/// Creates (or, after an `exec` that kept pid and start time, reuses) this process's liveness
/// file and takes its lock.
fn hold_liveness_lock(id: &ProcessIdentity, state: &mut State) -> Result<()> {
    let path = id.liveness_path();
    // Something else under our name is refused with what it is; it is never removed (it may be
    // another user's, and only we and root could remove ours from the sticky /dev/shm).
    let in_the_way = |call: &'static str, what: String| -> crate::Error {
        OsError::io(
            call,
            path.as_str(),
            std::io::Error::other(format!(
                "{what} holds this process's liveness file name; remove it (nothing of this \
                 process made it) and start again"
            )),
        )
        .into()
    };
    let fd = match open_live_file(&path, true) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(in_the_way("open", "a symbolic link".into()));
        }
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
            return Err(in_the_way("open", "a socket".into()));
        }
        Err(e) if e.raw_os_error() == Some(libc::EISDIR) => {
            return Err(in_the_way("open", "a directory".into()));
        }
        Err(e) => return Err(OsError::io("open", path.as_str(), e).into()),
    };
    // The file must be ours and a plain file: another user could have made one under our name.
    let st = rustix::fs::fstat(&fd).map_err(|e| OsError::new("fstat", path.as_str(), e))?;
    let euid = rustix::process::geteuid().as_raw();
    let ft = rustix::fs::FileType::from_raw_mode(st.st_mode);
    if ft != rustix::fs::FileType::RegularFile {
        return Err(in_the_way("fstat", format!("a {ft:?}")));
    }
    if st.st_uid != euid {
        return Err(in_the_way(
            "fstat",
            format!(
                "a file of uid {} (this process runs as uid {euid})",
                st.st_uid
            ),
        ));
    }
    // Readable by everyone, so processes of other users (root's `cuda-ipc gc`, a group-shared
    // channel's consumers) can test the lock; the file holds no data.
    let _ = rustix::fs::fchmod(&fd, rustix::fs::Mode::from_raw_mode(0o644));
    match set_lock(&fd) {
        Ok(()) => {}
        Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
            return Err(in_the_way(
                "fcntl(F_OFD_SETLK)",
                "a file another process holds a lock on".into(),
            ));
        }
        Err(e) => return Err(OsError::io("fcntl(F_OFD_SETLK)", path.as_str(), e).into()),
    }
    // The name must still stand for the file we locked (nobody removed it in between: `cuda-ipc
    // gc` leaves files younger than 5 s alone, and the sticky /dev/shm lets only us and root
    // remove ours).
    let now =
        rustix::fs::lstat(path.as_str()).map_err(|e| OsError::new("lstat", path.as_str(), e))?;
    if now.st_ino != st.st_ino || now.st_dev != st.st_dev {
        return Err(OsError::io(
            "lstat",
            path,
            std::io::Error::other("the liveness file was replaced while it was being locked"),
        )
        .into());
    }
    let raw = fd.as_raw_fd();
    std::mem::forget(fd); // kept open for the life of the process: it holds the lock
    let old = LOCK_FD.swap(raw, Ordering::AcqRel);
    if old >= 0 && old != raw {
        // SAFETY: `old` was this module's own descriptor (a stale one left by a fork: the child's
        // copy); nothing else uses it once `LOCK_FD` no longer names it.
        drop(unsafe { OwnedFd::from_raw_fd(old) });
    }
    LOCK_OWNER.store(id.pid as i32, Ordering::Relaxed);
    if let Ok(c) = CString::new(path) {
        state.path = Some(c);
    }
    register_process_hooks();
    start_keeper(id.pid);
    Ok(())
}

/// How often the keeper thread looks whether this process's liveness file is still there.
const KEEPER_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// Starts (once per process id: threads do not survive `fork`) a thread that, every
/// [`KEEPER_EVERY`], checks that this process's liveness file is still the file it locked, and makes
/// and locks it again when someone removed or replaced it (root cleaning /dev/shm by hand). Until
/// then, other pid namespaces read this process as dead; the thread keeps that window short.
fn start_keeper(pid: u32) {
    static KEEPER_PID: AtomicI32 = AtomicI32::new(0);
    // Relaxed: only decides which thread starts the keeper; nothing is published through it.
    if KEEPER_PID.swap(pid as i32, Ordering::Relaxed) == pid as i32 {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("cuda-ipc-liveness".into())
        .spawn(move || {
            loop {
                std::thread::sleep(KEEPER_EVERY);
                if std::process::id() != pid {
                    return;
                }
                keep_liveness_file();
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(
            "cannot start the liveness keeper thread ({e}): a removed liveness file is not made again"
        );
    }
}

/// One look of the keeper: the name must still stand for the locked file.
fn keep_liveness_file() {
    // Acquire: pairs with the Release (AcqRel) swap in `hold_liveness_lock`.
    let fd = LOCK_FD.load(Ordering::Acquire);
    if fd < 0 {
        return;
    }
    let mut state = STATE.lock();
    // Acquire: pairs with the Release store in the atexit handler: once it runs, the file it
    // removes stays removed.
    if EXITING.load(Ordering::Acquire) {
        return;
    }
    let Some(id) = state.identity else {
        return;
    };
    // SAFETY: `fd` is this module's lock descriptor, kept open for the life of the process (the
    // STATE lock held here serialises it against its replacement in `hold_liveness_lock`).
    let mine = rustix::fs::fstat(unsafe { rustix::fd::BorrowedFd::borrow_raw(fd) });
    let now = rustix::fs::lstat(id.liveness_path().as_str());
    let same =
        matches!((&mine, &now), (Ok(a), Ok(b)) if a.st_ino == b.st_ino && a.st_dev == b.st_dev);
    if same {
        return;
    }
    match hold_liveness_lock(&id, &mut state) {
        Ok(()) => tracing::warn!(
            "this process's liveness file {} was removed or replaced; made and locked again",
            id.liveness_path()
        ),
        // The next look tries again.
        Err(e) => {
            tracing::warn!("this process's liveness file is gone and cannot be made again: {e}")
        }
    }
}

fn register_process_hooks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: both handlers are `extern "C"` functions with no arguments that only touch
        // atomics and make async-signal-safe calls (`close`, `getpid`, `unlink`); registering them
        // has no other precondition.
        unsafe {
            libc::pthread_atfork(None, None, Some(after_fork_in_child));
            libc::atexit(remove_liveness_file_at_exit);
        }
    });
}

/// In a child made by `fork()`: close the inherited lock descriptor, so the lock dies with the
/// parent, not with the last of its children. The parent's open file description (and lock) stays.
extern "C" fn after_fork_in_child() {
    let fd = LOCK_FD.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        // SAFETY: `fd` is the inherited copy of this module's lock descriptor; closing it is
        // async-signal-safe and leaves the parent's open file description untouched.
        unsafe { libc::close(fd) };
    }
}

/// At normal exit: remove the liveness file, so no file is left per process. (A killed process
/// leaves its file; its lock is free, so it reads as dead, and `cuda-ipc gc` removes it.)
extern "C" fn remove_liveness_file_at_exit() {
    // SAFETY: getpid has no preconditions.
    if unsafe { libc::getpid() } != LOCK_OWNER.load(Ordering::Relaxed) {
        return; // a forked child exiting: the file is its parent's
    }
    // Release: pairs with the keeper's Acquire load; it makes no file after this.
    EXITING.store(true, Ordering::Release);
    // The keeper or a `current` may hold the lock for a moment; never wait long in exit.
    for _ in 0..1000 {
        if let Some(state) = STATE.try_lock() {
            if let Some(p) = state.path.as_ref() {
                // SAFETY: `p` is a NUL-terminated path owned by the static state.
                unsafe { libc::unlink(p.as_ptr()) };
            }
            return;
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

/// What the lock of a liveness file says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LockState {
    Held,
    Free,
    Missing,
    /// A regular file under the name whose owner is neither the recorded uid nor root: ignored.
    NotOwned,
    Unreadable,
}

/// Tests the liveness lock of `id`; with `uid`, a file owned by anyone but `uid` or root is
/// [`LockState::NotOwned`] and its lock is not asked.
fn probe_lock(id: &ProcessIdentity, uid: Option<u32>) -> LockState {
    let path = id.liveness_path();
    let fd = match open_live_file(&path, false) {
        Ok(fd) => fd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return LockState::Missing,
        Err(_) => return LockState::Unreadable,
    };
    match rustix::fs::fstat(&fd) {
        Ok(st)
            if rustix::fs::FileType::from_raw_mode(st.st_mode)
                == rustix::fs::FileType::RegularFile =>
        {
            if uid.is_some_and(|u| st.st_uid != u && st.st_uid != 0) {
                return LockState::NotOwned;
            }
        }
        _ => return LockState::Unreadable,
    }
    match test_lock(&fd) {
        Ok(true) => LockState::Held,
        Ok(false) => LockState::Free,
        Err(_) => LockState::Unreadable,
    }
}

/// Opens a liveness file: never through a symbolic link, never blocking (a FIFO planted under the
/// name), close-on-exec; `create` makes it (read-write) when missing.
fn open_live_file(path: &str, create: bool) -> std::io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC);
    if create {
        o.write(true).create(true).mode(0o644);
    }
    Ok(OwnedFd::from(o.open(path)?))
}

fn lock_request(kind: libc::c_short) -> libc::flock {
    // SAFETY: `flock` is a plain C struct of integers; all-zero is a valid value.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = 0;
    l.l_len = 1;
    l.l_pid = 0; // required to be 0 for open-file-description locks
    l
}

fn set_lock(fd: &OwnedFd) -> std::io::Result<()> {
    let l = lock_request(libc::F_WRLCK as libc::c_short);
    // SAFETY: `fd` is an open descriptor; `l` is a valid, initialised `flock` that outlives the call.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &l) };
    if r == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `true` when another open file description holds a *write* lock on byte 0.
///
/// Asked as a read lock: only a write lock conflicts with it, and only the file's owner (or root)
/// can take one, since the file is 0644 and a write lock needs a descriptor open for writing. A read
/// lock that another user takes on the file (waiting for the owner to die) must not make a dead
/// process look alive.
fn test_lock(fd: &OwnedFd) -> std::io::Result<bool> {
    let mut l = lock_request(libc::F_RDLCK as libc::c_short);
    // SAFETY: `fd` is an open descriptor; `l` is a valid `flock` the kernel overwrites in place.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_GETLK, &mut l) };
    if r == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(l.l_type == libc::F_WRLCK as libc::c_short)
}

/// The inode number of the caller's pid namespace, 0 when `/proc/self/ns/pid` cannot be read.
pub fn own_pid_ns() -> u32 {
    std::fs::metadata("/proc/self/ns/pid")
        .ok()
        .and_then(|m| u32::try_from(std::os::unix::fs::MetadataExt::ino(&m)).ok())
        .unwrap_or(0)
}

/// Whether `/proc` counts pids as the caller's own pid namespace does (its `self` entry has the
/// pid `getpid()` returns). Cached per process id.
fn proc_is_own_namespace() -> bool {
    // (pid << 1) | answer, 0 when not asked yet: one word, so a forked child never waits on a
    // lock its parent held. Relaxed: a cache of a value any thread can compute again.
    static CACHE: AtomicU64 = AtomicU64::new(0);
    let pid = std::process::id();
    let c = CACHE.load(Ordering::Relaxed);
    if c != 0 && (c >> 1) as u32 == pid {
        return c & 1 == 1;
    }
    let v = proc_stat("self").ok().and_then(|s| s.pid) == Some(pid);
    CACHE.store((u64::from(pid) << 1) | u64::from(v), Ordering::Relaxed);
    v
}

/// Whether `/proc` hides processes of other users (`hidepid=` other than `0`/`off`: `1`, `2`,
/// `noaccess`, `invisible`, `ptraceable`): from the `/proc` line of `/proc/self/mountinfo`, read
/// once per process. A missing `/proc/PID` then says nothing about another user's process.
fn proc_hides_processes() -> bool {
    static HIDES: OnceLock<bool> = OnceLock::new();
    *HIDES.get_or_init(|| {
        let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
            return false;
        };
        // Fields: id parent major:minor root mount-point options ... - fstype source super-options.
        // The last line for /proc is the mount that is visible.
        text.lines()
            .rev()
            .filter(|l| l.split(' ').nth(4) == Some("/proc"))
            .filter_map(|l| l.split_once(" - "))
            .find(|(_, tail)| tail.starts_with("proc "))
            .is_some_and(|(_, tail)| hides_in_options(tail))
    })
}

/// Whether the super options after a mountinfo line's ` - ` (`proc proc rw,hidepid=2`) hide pids.
fn hides_in_options(tail: &str) -> bool {
    tail.split(' ')
        .nth(2)
        .unwrap_or("")
        .split(',')
        .filter_map(|o| o.strip_prefix("hidepid="))
        .any(|v| !matches!(v, "0" | "off"))
}

/// A liveness file found in `/dev/shm` by [`stale_liveness_files`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LivenessFile {
    /// The file's name in `/dev/shm`.
    pub name: String,
    /// The identity it stands for (boot id: this boot's).
    pub identity: ProcessIdentity,
    /// Owner uid of the file.
    pub uid: u32,
}

/// The liveness files in `/dev/shm` whose lock is free: their processes were killed (a normal exit
/// removes the file). Files that are not regular files, whose lock cannot be tested, or that were
/// made less than 5 s ago (a process starting up locks its file right after making it) are left
/// out. For `cuda-ipc gc`; nothing is removed here.
///
/// # Errors
/// [`crate::Error::Os`] when `/dev/shm` cannot be listed.
pub fn stale_liveness_files() -> Result<Vec<LivenessFile>> {
    let boot = boot_id()?;
    let dir = std::fs::read_dir(LIVE_DIR).map_err(|e| OsError::io("opendir", LIVE_DIR, e))?;
    let mut out = Vec::new();
    for ent in dir.flatten() {
        let Some(name) = ent.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let Some(identity) = parse_file_name(LIVE_PREFIX, &name, boot) else {
            continue;
        };
        let path = format!("{LIVE_DIR}/{name}");
        let Ok(fd) = open_live_file(&path, false) else {
            continue;
        };
        let Ok(st) = rustix::fs::fstat(&fd) else {
            continue;
        };
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile
            || !old_enough(&st)
        {
            continue;
        }
        if matches!(test_lock(&fd), Ok(false)) {
            out.push(LivenessFile {
                name,
                identity,
                uid: st.st_uid,
            });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Removes a stale liveness file (see [`stale_liveness_files`]) after testing its lock once more.
/// Returns `false` when it was not removed: it is gone already, its lock is held again (never, for
/// a dead process; a guard against a mistaken name) or it is no longer a regular file.
///
/// # Errors
/// [`crate::Error::Os`] when `unlink` fails for a reason other than the file being gone.
pub fn remove_stale_liveness_file(file: &LivenessFile) -> Result<bool> {
    let path = format!("{LIVE_DIR}/{}", file.name);
    let Ok(fd) = open_live_file(&path, false) else {
        return Ok(false);
    };
    match rustix::fs::fstat(&fd) {
        Ok(st)
            if rustix::fs::FileType::from_raw_mode(st.st_mode)
                == rustix::fs::FileType::RegularFile
                && old_enough(&st) => {}
        _ => return Ok(false),
    }
    if !matches!(test_lock(&fd), Ok(false)) {
        return Ok(false);
    }
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(OsError::io("unlink", path, e).into()),
    }
}

/// A liveness file is taken for stale only this long after it was made (`st_ctime`): between
/// creating the file and locking it (microseconds), a starting process's lock is free too.
#[cfg(not(test))]
const STALE_AFTER_SECS: i64 = 5;
#[cfg(test)] // the unit tests wait for it
const STALE_AFTER_SECS: i64 = 1;

fn old_enough(st: &rustix::fs::Stat) -> bool {
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(i128::MAX);
    let ctime_ns = i128::from(st.st_ctime) * 1_000_000_000 + i128::from(st.st_ctime_nsec);
    now_ns - ctime_ns >= i128::from(STALE_AFTER_SECS) * 1_000_000_000
}

/// Parses `<prefix><ns>.<pid>.<start>` (the form of [`ProcessIdentity::file_name`]) into an
/// identity of boot `boot`; `None` for any other name.
pub(crate) fn parse_file_name(prefix: &str, name: &str, boot: [u8; 16]) -> Option<ProcessIdentity> {
    let rest = name.strip_prefix(prefix)?;
    let mut it = rest.split('.');
    let pid_ns = it.next()?.parse().ok()?;
    let pid = it.next()?.parse().ok()?;
    let start_time = it.next()?.parse().ok()?;
    if it.next().is_some() {
        return None;
    }
    Some(ProcessIdentity {
        pid,
        start_time,
        boot_id: boot,
        pid_ns,
    })
}

/// Removes the liveness file of `id` if its lock is free, whatever its age (for tests that kill
/// their own children: `cuda-ipc gc` leaves files younger than 5 s alone). `Ok(false)` when there
/// is no such file, it is not a regular file, or its lock is held.
///
/// # Errors
/// [`crate::Error::Os`] when `unlink` fails for a reason other than the file being gone.
#[doc(hidden)]
pub fn remove_liveness_file_if_free(id: &ProcessIdentity) -> Result<bool> {
    let path = id.liveness_path();
    if probe_lock(id, None) != LockState::Free {
        return Ok(false);
    }
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(OsError::io("unlink", path, e).into()),
    }
}

/// The raw descriptor of this process's liveness lock, if it holds one (for tests).
#[doc(hidden)]
pub fn liveness_lock_fd() -> Option<RawFd> {
    let fd = LOCK_FD.load(Ordering::Acquire);
    (fd >= 0).then_some(fd)
}

/// The start time of `pid` in clock ticks since boot, `Ok(None)` when no such process exists.
pub(crate) fn start_time_of(pid: u32) -> Result<Option<u64>> {
    Ok(stat_of(pid)?.map(|(_, t)| t))
}

/// The state letter (field 3: `R`, `S`, `Z` for a zombie, ...) and start time of `pid`, `Ok(None)`
/// when no such process exists or its stat line cannot be parsed.
fn stat_of(pid: u32) -> Result<Option<(char, u64)>> {
    match proc_stat(pid) {
        Ok(st) => Ok(st.state.zip(st.start_time)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        // ESRCH: the process exited between the directory lookup and the read.
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(None),
        Err(e) => Err(OsError::io("read", format!("/proc/{pid}/stat"), e).into()),
    }
}

/// What this crate reads of a `/proc/PID/stat` line; each field `None` when the line does not
/// have it in the expected form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ProcStat {
    /// Field 1, the pid as `/proc` counts it (its mount's pid namespace).
    pid: Option<u32>,
    /// Field 3, the state letter (`R`, `S`, `Z` for a zombie, ...).
    state: Option<char>,
    /// Field 22, the start time in clock ticks since boot.
    start_time: Option<u64>,
}

/// Reads and parses `/proc/<who>/stat` (`who`: a pid, or `self`): the one place this crate reads
/// a stat line (its own identity, whether `/proc` is of its pid namespace, another process's
/// liveness). The read's error is returned as it is; callers decide what a missing process means.
fn proc_stat(who: impl std::fmt::Display) -> std::io::Result<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{who}/stat"))?;
    Ok(parse_stat(&text))
}

/// The fields of a `/proc/PID/stat` line that [`ProcStat`] keeps.
fn parse_stat(stat: &str) -> ProcStat {
    ProcStat {
        pid: stat
            .split_ascii_whitespace()
            .next()
            .and_then(|p| p.parse().ok()),
        state: parse_state(stat),
        start_time: parse_start_time(stat),
    }
}

/// Whether `/proc/PID` exists (a running process or a zombie, counted in the pid namespace `/proc`
/// was mounted for).
pub(crate) fn proc_has_pid(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Field 3 (the state letter) of a `/proc/PID/stat` line.
fn parse_state(stat: &str) -> Option<char> {
    stat[stat.rfind(')')? + 1..]
        .split_ascii_whitespace()
        .next()?
        .chars()
        .next()
}

/// Field 22 of a `/proc/PID/stat` line. The command name (field 2) is in parentheses and may hold
/// spaces and parentheses, so fields are counted after the last `)`.
fn parse_start_time(stat: &str) -> Option<u64> {
    let after = &stat[stat.rfind(')')? + 1..];
    // After ')' come field 3 (state) onwards; field 22 is the 20th of them.
    after.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// The kernel's boot id as 16 bytes (`/proc/sys/kernel/random/boot_id`, a UUID in text).
pub(crate) fn boot_id() -> Result<[u8; 16]> {
    static BOOT: OnceLock<std::result::Result<[u8; 16], String>> = OnceLock::new();
    let r = BOOT.get_or_init(|| {
        let path = "/proc/sys/kernel/random/boot_id";
        let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        parse_uuid_text(text.trim()).ok_or_else(|| format!("{path}: not a UUID: {text:?}"))
    });
    r.clone().map_err(|msg| {
        OsError::io(
            "read",
            "/proc/sys/kernel/random/boot_id",
            std::io::Error::other(msg),
        )
        .into()
    })
}

/// Parses `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (hyphens optional) into 16 bytes.
pub(crate) fn parse_uuid_text(s: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = s.bytes().filter(|b| *b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn hidepid_is_read_from_procs_super_options() {
        let _serial = serial();
        assert!(hides_in_options("proc proc rw,hidepid=2,gid=10"));
        assert!(hides_in_options("proc proc rw,hidepid=invisible"));
        assert!(!hides_in_options("proc proc rw,hidepid=0"));
        assert!(!hides_in_options("proc proc rw,hidepid=off"));
        assert!(!hides_in_options("proc proc rw"));
        assert!(!hides_in_options("proc"));
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

    #[test]
    fn stat_parsing_survives_odd_command_names() {
        let _serial = serial();
        let line = "42 (a) b (c) R 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 10";
        assert_eq!(parse_start_time(line), Some(98765));
        assert_eq!(
            parse_stat(line),
            ProcStat {
                pid: Some(42),
                state: Some('R'),
                start_time: Some(98765),
            }
        );
        let own = proc_stat("self").unwrap();
        assert_eq!(own.pid, Some(std::process::id()));
        assert!(own.state.is_some() && own.start_time.is_some());
        assert_eq!(parse_state(line), Some('R'));
        assert_eq!(parse_start_time("garbage"), None);
    }
}
