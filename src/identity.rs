//! Process identity: who exported a handle or holds a registry entry, in a form that survives pid reuse.
//!
//! Owns: [`ProcessIdentity`] (pid + process start time + boot id) and the liveness check. It reads
//! `/proc` and `/proc/sys/kernel/random/boot_id`; it never touches CUDA or shared memory.

use crate::error::{OsError, Result};
use std::sync::OnceLock;

/// Who a process is: pid, start time and boot id.
///
/// A pid alone is reused by the kernel; the start time (field 22 of `/proc/PID/stat`, in clock ticks
/// since boot) tells a reused pid apart, and the boot id (`/proc/sys/kernel/random/boot_id`, 16 bytes)
/// tells a record written before a reboot (e.g. in a persisted token) apart from a live process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ProcessIdentity {
    /// Process id, as the kernel reports it in this pid namespace.
    pub pid: u32,
    /// Process start time in clock ticks since boot (`/proc/PID/stat` field 22).
    pub start_time: u64,
    /// The kernel's boot id, as 16 raw bytes.
    pub boot_id: [u8; 16],
}

/// What [`ProcessIdentity::liveness`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Liveness {
    /// The process runs: same pid, same start time, same boot.
    Alive,
    /// The process is gone: no such pid, a different start time (pid reused), or another boot.
    Dead,
    /// It could not be told (e.g. `/proc` hidden by `hidepid`); callers treat this as alive.
    Unknown,
}

impl ProcessIdentity {
    /// The identity of the calling process, computed once and cached.
    ///
    /// # Errors
    /// [`crate::Error::Os`] when `/proc/self/stat` or the boot id cannot be read.
    pub fn current() -> Result<Self> {
        static CURRENT: OnceLock<std::result::Result<ProcessIdentity, String>> = OnceLock::new();
        // The pid changes across fork(); fork without exec is not supported with CUDA, but a forked
        // registry-only child must not reuse its parent's identity.
        let pid = std::process::id();
        let cached = CURRENT.get_or_init(|| Self::read(pid).map_err(|e| e.to_string()));
        match cached {
            Ok(id) if id.pid == pid => Ok(*id),
            Ok(_) => Self::read(pid),
            Err(_) => Self::read(pid),
        }
    }

    fn read(pid: u32) -> Result<Self> {
        Ok(Self {
            pid,
            start_time: start_time_of(pid)?.ok_or_else(|| {
                OsError::io(
                    "read",
                    format!("/proc/{pid}/stat"),
                    std::io::Error::from(std::io::ErrorKind::NotFound),
                )
            })?,
            boot_id: boot_id()?,
        })
    }

    /// Whether the process this identity names is still running.
    ///
    /// Compares the boot id, then the start time in `/proc/PID/stat`; a missing pid, a different
    /// start time (the pid was reused) or a zombie (it exited and its parent has not reaped it yet)
    /// means the process is dead.
    pub fn liveness(&self) -> Liveness {
        match boot_id() {
            Ok(b) if b != self.boot_id => return Liveness::Dead,
            Ok(_) => {}
            Err(_) => return Liveness::Unknown,
        }
        if self.pid == 0 || self.pid > i32::MAX as u32 {
            return Liveness::Dead;
        }
        match stat_of(self.pid) {
            Ok(Some((state, t))) if t == self.start_time && !matches!(state, 'Z' | 'X') => {
                Liveness::Alive
            }
            Ok(Some(_)) | Ok(None) => Liveness::Dead,
            Err(_) => Liveness::Unknown,
        }
    }

    /// `liveness() != Dead`: the conservative answer (unknown counts as alive).
    pub fn is_alive(&self) -> bool {
        self.liveness() != Liveness::Dead
    }
}

/// The start time of `pid` in clock ticks since boot, `Ok(None)` when no such process exists.
pub(crate) fn start_time_of(pid: u32) -> Result<Option<u64>> {
    Ok(stat_of(pid)?.map(|(_, t)| t))
}

/// The state letter (field 3: `R`, `S`, `Z` for a zombie, ...) and start time of `pid`, `Ok(None)`
/// when no such process exists or its stat line cannot be parsed.
fn stat_of(pid: u32) -> Result<Option<(char, u64)>> {
    let path = format!("/proc/{pid}/stat");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        // ESRCH: the process exited between the directory lookup and the read.
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Ok(None),
        Err(e) => return Err(OsError::io("read", path, e).into()),
    };
    Ok(parse_state(&text).zip(parse_start_time(&text)))
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
pub(crate) fn parse_start_time(stat: &str) -> Option<u64> {
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

    #[test]
    fn current_process_is_alive() {
        let me = ProcessIdentity::current().unwrap();
        assert_eq!(me.pid, std::process::id());
        assert_eq!(me.liveness(), Liveness::Alive);
    }

    #[test]
    fn reused_pid_with_other_start_time_is_dead() {
        let mut me = ProcessIdentity::current().unwrap();
        me.start_time += 1;
        assert_eq!(me.liveness(), Liveness::Dead);
    }

    #[test]
    fn other_boot_is_dead() {
        let mut me = ProcessIdentity::current().unwrap();
        me.boot_id[0] ^= 0xff;
        assert_eq!(me.liveness(), Liveness::Dead);
    }

    #[test]
    fn exited_child_is_dead() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = start_time_of(pid).unwrap();
        child.wait().unwrap();
        let id = ProcessIdentity {
            pid,
            start_time: start.unwrap_or(1),
            boot_id: boot_id().unwrap(),
        };
        assert_eq!(id.liveness(), Liveness::Dead);
    }

    #[test]
    fn an_unreaped_zombie_is_dead() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = start_time_of(pid).unwrap().unwrap();
        let id = ProcessIdentity {
            pid,
            start_time: start,
            boot_id: boot_id().unwrap(),
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
    fn stat_parsing_survives_odd_command_names() {
        let line = "42 (a) b (c) R 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 10";
        assert_eq!(parse_start_time(line), Some(98765));
        assert_eq!(parse_state(line), Some('R'));
        assert_eq!(parse_start_time("garbage"), None);
    }
}
