//! This process's side of liveness: the fork-safe lock around what the module keeps about the
//! process, the liveness file it makes and locks, the keeper thread that makes it again when
//! someone removed it, the `fork`/`exit` hooks, and the lock test (`F_OFD_GETLK`) other
//! processes' files get. No `/proc` here (`super::proc`), no listing of others' files
//! (`super::files`).

use super::ProcessIdentity;
use crate::error::{OsError, Result};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};

/// What this module keeps about the calling process, behind a lock a forked child can take over.
#[derive(Default)]
pub(super) struct State {
    /// The cached identity (reset in a forked child by the pid check in `current`).
    pub(super) identity: Option<ProcessIdentity>,
    /// The liveness file's path, for the atexit handler.
    path: Option<CString>,
}

pub(super) static STATE: ForkSafeLock<State> = ForkSafeLock::new();

/// Set by the atexit handler before it removes the liveness file, so the keeper thread (which runs
/// on while `exit` calls the handlers) does not make the file again.
// Release store in `remove_liveness_file_at_exit`; Acquire load in `keep_liveness_file`.
static EXITING: AtomicBool = AtomicBool::new(false);

/// A spin lock that knows which process took it. A `fork` copies a lock that another thread of the
/// parent held; that thread does not exist in the child, so a `std::sync::Mutex` would stay locked
/// there for good. Here a child finds the parent's pid as the holder, takes the lock over, and
/// starts from a fresh `T::default()` (the parent's value, possibly half-updated at the fork, is
/// leaked, never dropped). Held for microseconds (a file creation at most).
pub(super) struct ForkSafeLock<T> {
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

    pub(super) fn lock(&self) -> ForkSafeGuard<'_, T> {
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

pub(super) struct ForkSafeGuard<'a, T: Default> {
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
pub(super) static LOCK_FD: AtomicI32 = AtomicI32::new(-1);
/// The pid that made the liveness file (the atexit handler removes it only in that process).
static LOCK_OWNER: AtomicI32 = AtomicI32::new(0);

/// Creates (or, after an `exec` that kept pid and start time, reuses) this process's liveness
/// file and takes its lock.
pub(super) fn hold_liveness_lock(id: &ProcessIdentity, state: &mut State) -> Result<()> {
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
    let euid = rustix::process::geteuid().as_raw();
    let fd = match open_live_file(&path, true) {
        Ok(fd) => fd,
        // Whatever the errno (`ELOOP` for a link, `ENXIO` for a socket, `EISDIR`; `EACCES` for
        // another user's file, or where the kernel's `protected_symlinks`, `protected_fifos` or
        // `protected_regular` refuse what another user planted in the sticky /dev/shm), what
        // stands under the name says why, when something does.
        Err(e) => {
            return Err(match rustix::fs::lstat(path.as_str()) {
                Ok(st) if !ours_to_use(&st, euid) => in_the_way("open", in_the_way_text(&st, euid)),
                _ => OsError::io("open", path.as_str(), e).into(),
            });
        }
    };
    // The file must be ours and a plain file: another user could have made one under our name.
    let st = rustix::fs::fstat(&fd).map_err(|e| OsError::new("fstat", path.as_str(), e))?;
    if !ours_to_use(&st, euid) {
        return Err(in_the_way("fstat", in_the_way_text(&st, euid)));
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

/// Whether `st` (of what stands under this process's liveness file name) is a file it may use as
/// its own: a regular file of `euid`.
fn ours_to_use(st: &rustix::fs::Stat, euid: u32) -> bool {
    rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile
        && st.st_uid == euid
}

/// What `st` is, in words, for the error of a process whose liveness file name it holds: `a
/// symbolic link`, `a FIFO`, `a directory`, `a socket`, `a file of uid 1000 (this process runs as
/// uid 0)`, ...
fn in_the_way_text(st: &rustix::fs::Stat, euid: u32) -> String {
    use rustix::fs::FileType as T;
    let what = match T::from_raw_mode(st.st_mode) {
        T::Symlink => "a symbolic link",
        T::Fifo => "a FIFO",
        T::Directory => "a directory",
        T::Socket => "a socket",
        T::CharacterDevice => "a character device",
        T::BlockDevice => "a block device",
        T::RegularFile => "a file",
        _ => "a special file",
    };
    if st.st_uid == euid {
        what.to_string()
    } else {
        format!(
            "{what} of uid {} (this process runs as uid {euid})",
            st.st_uid
        )
    }
}

/// How often the keeper thread looks whether this process's liveness file is still there.
pub(super) const KEEPER_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

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
pub(super) enum LockState {
    Held,
    Free,
    Missing,
    /// A regular file under the name whose owner is neither the recorded uid nor root: ignored.
    NotOwned,
    Unreadable,
}

/// Tests the liveness lock of `id`; with `uid`, a file owned by anyone but `uid` or root is
/// [`LockState::NotOwned`] and its lock is not asked.
pub(super) fn probe_lock(id: &ProcessIdentity, uid: Option<u32>) -> LockState {
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
pub(super) fn open_live_file(path: &str, create: bool) -> std::io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC);
    if create {
        o.write(true).create(true).mode(0o644);
    }
    Ok(OwnedFd::from(o.open(path)?))
}

pub(super) fn lock_request(kind: libc::c_short) -> libc::flock {
    // SAFETY: `flock` is a plain C struct of integers; all-zero is a valid value.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = 0;
    l.l_len = 1;
    l.l_pid = 0; // required to be 0 for open-file-description locks
    l
}

pub(super) fn set_lock(fd: &OwnedFd) -> std::io::Result<()> {
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
pub(super) fn test_lock(fd: &OwnedFd) -> std::io::Result<bool> {
    let mut l = lock_request(libc::F_RDLCK as libc::c_short);
    // SAFETY: `fd` is an open descriptor; `l` is a valid `flock` the kernel overwrites in place.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_GETLK, &mut l) };
    if r == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(l.l_type == libc::F_WRLCK as libc::c_short)
}

/// The raw descriptor of this process's liveness lock, if it holds one (for tests).
pub fn liveness_lock_fd() -> Option<RawFd> {
    let fd = LOCK_FD.load(Ordering::Acquire);
    (fd >= 0).then_some(fd)
}
