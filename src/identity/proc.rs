//! The one reader of `/proc` in this crate: `/proc/PID/stat` lines (state, start time, the pid
//! `/proc` counts), whether `/proc` is of the caller's pid namespace and hides other users'
//! processes (`hidepid`), and the kernel's boot id. Nothing of the rest of the module.

use crate::error::{OsError, Result};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The inode number of the caller's pid namespace, 0 when `/proc/self/ns/pid` cannot be read.
/// Cached per process once read (emptied in forked children): a process never changes its own pid
/// namespace (`unshare` and `setns` change only its children's).
pub fn own_pid_ns() -> u32 {
    let pid = std::process::id();
    // Relaxed: a cache of a value any thread can compute again.
    let c = OWN_PID_NS.load(Ordering::Relaxed);
    if c != 0 && (c >> 32) as u32 == pid {
        return c as u32;
    }
    let ns = std::fs::metadata("/proc/self/ns/pid")
        .ok()
        .and_then(|m| u32::try_from(std::os::unix::fs::MetadataExt::ino(&m)).ok())
        .unwrap_or(0);
    // A 0 (no `/proc` of this process to read) is not kept: it may be readable later.
    if ns != 0 {
        forget_in_forked_children();
        OWN_PID_NS.store((u64::from(pid) << 32) | u64::from(ns), Ordering::Relaxed);
    }
    ns
}

/// [`own_pid_ns`]'s answer: (pid << 32) | namespace inode, 0 when not read yet. One word, and
/// emptied in every forked child ([`forget_after_fork`]), as [`OWN_NAMESPACE`] is: a child forked
/// into a new pid namespace may have its parent's pid number.
static OWN_PID_NS: AtomicU64 = AtomicU64::new(0);

/// Registers [`forget_after_fork`] once per process, before anything is cached.
fn forget_in_forked_children() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        // SAFETY: `forget_after_fork` is an `extern "C"` function without arguments that only
        // stores atomics (async-signal-safe); registering it has no other precondition.
        unsafe { libc::pthread_atfork(None, None, Some(forget_after_fork)) };
    });
}

/// [`proc_is_own_namespace`]'s answer: (pid << 1) | answer, 0 when not asked yet. One word, so a
/// forked child never waits on a lock its parent held; emptied in every forked child
/// ([`forget_after_fork`]): a child forked into a new pid namespace may have its parent's pid
/// number (two pid-1 processes) and another answer.
static OWN_NAMESPACE: AtomicU64 = AtomicU64::new(0);

/// Whether `/proc` counts pids as the caller's own pid namespace does (its `self` entry has the
/// pid `getpid()` returns). Cached per process (see [`OWN_NAMESPACE`]).
pub(super) fn proc_is_own_namespace() -> bool {
    let pid = std::process::id();
    // Relaxed: a cache of a value any thread can compute again.
    let c = OWN_NAMESPACE.load(Ordering::Relaxed);
    if c != 0 && (c >> 1) as u32 == pid {
        return c & 1 == 1;
    }
    let v = proc_stat("self").ok().and_then(|s| s.pid) == Some(pid);
    // Before the cache is filled: a child forked after this empties it.
    forget_in_forked_children();
    OWN_NAMESPACE.store((u64::from(pid) << 1) | u64::from(v), Ordering::Relaxed);
    v
}

/// In a child made by `fork()`: empties what this module caches per process (one atomic store,
/// async-signal-safe).
extern "C" fn forget_after_fork() {
    OWN_NAMESPACE.store(0, Ordering::Relaxed);
    OWN_PID_NS.store(0, Ordering::Relaxed);
}

/// Whether `/proc` hides processes of other users (`hidepid=` other than `0`/`off`: `1`, `2`,
/// `noaccess`, `invisible`, `ptraceable`): from the `/proc` line of `/proc/self/mountinfo`, read
/// once per process. A missing `/proc/PID` then says nothing about another user's process.
pub(super) fn proc_hides_processes() -> bool {
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

/// The start time of `pid` in clock ticks since boot, `Ok(None)` when no such process exists.
pub(crate) fn start_time_of(pid: u32) -> Result<Option<u64>> {
    Ok(stat_of(pid)?.map(|(_, t)| t))
}

/// The state letter (field 3: `R`, `S`, `Z` for a zombie, ...) and start time of `pid`, `Ok(None)`
/// when no such process exists or its stat line cannot be parsed.
pub(super) fn stat_of(pid: u32) -> Result<Option<(char, u64)>> {
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
pub(super) struct ProcStat {
    /// Field 1, the pid as `/proc` counts it (its mount's pid namespace).
    pub(super) pid: Option<u32>,
    /// Field 3, the state letter (`R`, `S`, `Z` for a zombie, ...).
    pub(super) state: Option<char>,
    /// Field 22, the start time in clock ticks since boot.
    pub(super) start_time: Option<u64>,
}

/// Reads and parses `/proc/<who>/stat` (`who`: a pid, or `self`): the one place this crate reads
/// a stat line (its own identity, whether `/proc` is of its pid namespace, another process's
/// liveness). The read's error is returned as it is; callers decide what a missing process means.
pub(super) fn proc_stat(who: impl std::fmt::Display) -> std::io::Result<ProcStat> {
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

    /// A forked child starts with nothing cached of its parent's pid namespace, neither the
    /// `/proc` answer nor the namespace's inode (a child forked into a new pid namespace may have
    /// the parent's pid number and other answers).
    #[test]
    fn a_forked_child_forgets_the_cached_namespace_answer() {
        let _ = proc_is_own_namespace();
        assert_ne!(OWN_NAMESPACE.load(Ordering::Relaxed), 0);
        let ns = own_pid_ns();
        assert_ne!(ns, 0, "this test needs /proc/self/ns/pid");
        assert_eq!(OWN_PID_NS.load(Ordering::Relaxed) as u32, ns);
        assert_eq!(own_pid_ns(), ns, "the cached answer is the read one");
        // SAFETY: the child only loads atomics and calls `_exit`, both async-signal-safe.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "{}", std::io::Error::last_os_error());
        if pid == 0 {
            let kept = OWN_NAMESPACE.load(Ordering::Relaxed) != 0
                || OWN_PID_NS.load(Ordering::Relaxed) != 0;
            let code = i32::from(kept);
            // SAFETY: ends the forked child at once, running no destructors or handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: `pid` is this process's child; `status` a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child kept its parent's answer (status {status})"
        );
    }

    #[test]
    fn hidepid_is_read_from_procs_super_options() {
        assert!(hides_in_options("proc proc rw,hidepid=2,gid=10"));
        assert!(hides_in_options("proc proc rw,hidepid=invisible"));
        assert!(!hides_in_options("proc proc rw,hidepid=0"));
        assert!(!hides_in_options("proc proc rw,hidepid=off"));
        assert!(!hides_in_options("proc proc rw"));
        assert!(!hides_in_options("proc"));
    }

    #[test]
    fn stat_parsing_survives_odd_command_names() {
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
