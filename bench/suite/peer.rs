//! Child processes (this binary re-executed with `--role`), bounded by deadlines, and the small
//! shared-memory segment through which a case's processes pace each other.

use crate::Res;
use cuda_ipc::raw::shm::{Segment, SegmentOptions};
use serde_json::Value;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The environment variable that tells a child its parent's pid.
const PARENT_ENV: &str = "CUDA_IPC_BENCH_PARENT";

/// A running child: its stdout lines arrive through a reader thread; its stderr is copied to ours
/// (prefixed with its name) and the last lines kept for error messages.
pub struct Peer {
    name: String,
    // Drop order: the child is killed and reaped (in Drop) before stdin closes.
    child: Child,
    lines: Receiver<String>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    stdin: Option<ChildStdin>,
    exited: bool,
}

impl Peer {
    /// Starts this binary as `--role ROLE key=value...`. Its stdin is a pipe that closes when this
    /// process dies.
    pub fn spawn(name: &str, role: &str, args: &[(String, String)]) -> Res<Peer> {
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.arg("--role").arg(role);
        for (k, v) in args {
            cmd.arg(format!("{k}={v}"));
        }
        cmd.env(PARENT_ENV, std::process::id().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting {name} (--role {role}): {e}"))?;
        let out = child.stdout.take().ok_or("child without stdout")?;
        let stdin = child.stdin.take();
        let err = child.stderr.take().ok_or("child without stderr")?;
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let tail = stderr_tail.clone();
        let tag = name.to_string();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("  [{tag}] {l}");
                let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
                if t.len() == 8 {
                    t.pop_front();
                }
                t.push_back(l);
            }
        });
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(Peer {
            name: name.to_string(),
            child,
            lines: rx,
            stderr_tail,
            stdin,
            exited: false,
        })
    }

    /// Waits up to `timeout` for a stdout line starting with `prefix` and returns the rest of it.
    /// Other lines are copied to stderr. Kills the child at the deadline.
    ///
    /// Errors: the deadline passed, or the child exited first (with its exit status).
    pub fn expect(&mut self, prefix: &str, timeout: Duration) -> Res<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok(l) => match l.strip_prefix(prefix) {
                    Some(rest) => return Ok(rest.trim().to_string()),
                    None => eprintln!("  [{}] {l}", self.name),
                },
                Err(RecvTimeoutError::Timeout) => {
                    if Instant::now() >= deadline {
                        self.kill();
                        return Err(format!(
                            "{}: no {prefix:?} line within {timeout:?}; killed it",
                            self.name
                        )
                        .into());
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let st = self.wait_exit(Duration::from_secs(5));
                    // Let the stderr reader catch up with the child's last words.
                    std::thread::sleep(Duration::from_millis(50));
                    return Err(format!(
                        "{} ended ({st}) before printing {prefix:?}{}",
                        self.name,
                        self.last_words()
                    )
                    .into());
                }
            }
        }
    }

    /// Waits for the child's `RESULT` JSON line.
    pub fn result(&mut self, timeout: Duration) -> Res<Value> {
        let s = self.expect("RESULT ", timeout)?;
        serde_json::from_str(&s).map_err(|e| format!("{}: bad RESULT line: {e}", self.name).into())
    }

    /// Waits up to `timeout` for the child to exit (killing it then) and describes how it ended.
    pub fn wait_exit(&mut self, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => {
                    self.exited = true;
                    return st.to_string();
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Ok(None) => {
                    self.kill();
                    return format!("still running after {timeout:?}; killed");
                }
                Err(e) => return format!("wait failed: {e}"),
            }
        }
    }

    /// Waits for a clean exit; an error when it failed or had to be killed.
    pub fn finish(&mut self, timeout: Duration) -> Res<()> {
        let st = self.wait_exit(timeout);
        if st == "exit status: 0" {
            Ok(())
        } else {
            Err(format!("{} ended badly: {st}{}", self.name, self.last_words()).into())
        }
    }

    /// Whether the child still runs.
    pub fn alive(&mut self) -> bool {
        if self.exited {
            return false;
        }
        match self.child.try_wait() {
            Ok(None) => true,
            Ok(Some(_)) => {
                self.exited = true;
                false
            }
            Err(_) => false,
        }
    }

    /// The child's last stderr lines, for error messages (empty when it printed none).
    fn last_words(&self) -> String {
        let t = self.stderr_tail.lock().unwrap_or_else(|p| p.into_inner());
        if t.is_empty() {
            String::new()
        } else {
            format!(
                "; its stderr ended with: {}",
                Vec::from(t.clone()).join(" | ")
            )
        }
    }

    /// Closes the child's stdin (a child blocked reading it sees end of file).
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// The child's name in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn kill(&mut self) {
        if !self.exited {
            // The child is ours (spawned above); SIGKILL then reap it.
            let _ = self.child.kill();
            let _ = self.child.wait();
            self.exited = true;
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if self.alive() {
            self.kill();
        }
    }
}

/// Runs one case as a child (`--role ROLE args`), bounded by `timeout`, and returns its result.
pub fn run_case(id: &str, role: &str, args: &[(String, String)], timeout: Duration) -> Res<Value> {
    let mut p = Peer::spawn(id, role, args)?;
    let v = p.result(timeout)?;
    p.finish(Duration::from_secs(30))?;
    Ok(v)
}

fn parent_pid() -> Option<i32> {
    static P: OnceLock<Option<i32>> = OnceLock::new();
    *P.get_or_init(|| std::env::var(PARENT_ENV).ok()?.parse().ok())
}

/// In a child: dies with the parent (`PR_SET_PDEATHSIG`, SIGKILL), and exits at once when the
/// parent is already gone. Does nothing in the top process.
pub fn guard_parent() -> Res<()> {
    if parent_pid().is_none() {
        return Ok(());
    }
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
    if !parent_alive() {
        return Err("the parent process is already gone".into());
    }
    Ok(())
}

/// In a child: whether the parent that started it is still its parent.
pub fn parent_alive() -> bool {
    match parent_pid() {
        Some(p) => rustix::process::getppid().map(|q| q.as_raw_nonzero().get()) == Some(p),
        None => true,
    }
}

/// A 4 KiB shared-memory segment of a few atomic words through which a case's processes pace each
/// other (it carries no frame data). The creator unlinks it on drop.
pub struct Shared {
    seg: Segment,
    owner: bool,
}

impl Shared {
    const LEN: usize = 4096;

    /// Creates `cuda-ipc-bench-PID-TAG` (zeroed).
    pub fn create(tag: &str) -> Res<Shared> {
        let name = format!("cuda-ipc-bench-{}-{tag}", std::process::id());
        let seg = Segment::create(&name, Self::LEN, &SegmentOptions::new())?;
        Ok(Shared { seg, owner: true })
    }

    /// Opens a segment another process created.
    pub fn open(name: &str) -> Res<Shared> {
        let seg = Segment::open_with_min_len(name, Self::LEN)?;
        Ok(Shared { seg, owner: false })
    }

    /// The segment's name.
    pub fn name(&self) -> &str {
        self.seg.name()
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= Self::LEN);
        // The mapping is page-aligned and at least LEN bytes (checked at open), so `off` (a
        // multiple of 8 below LEN - 8) is an aligned 8-byte word inside it.
        // SAFETY: in bounds and aligned (above); every process accesses these words atomically
        // only; the reference lives no longer than `self`, which keeps the mapping.
        unsafe { &*(self.seg.as_ptr().add(off) as *const AtomicU64) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= Self::LEN);
        // SAFETY: as in `u64_at`, for an aligned 4-byte word.
        unsafe { &*(self.seg.as_ptr().add(off) as *const AtomicU32) }
    }

    /// Frames the consumer has finished with (it is back waiting once this reaches `i + 1`).
    pub fn ack(&self) -> &AtomicU64 {
        self.u64_at(0)
    }

    /// The floor's publish time (ns, CLOCK_MONOTONIC) of the latest frame.
    pub fn stamp(&self) -> &AtomicU64 {
        self.u64_at(8)
    }

    /// Frames whose `publish` call has returned (the zero-copy case's consumer waits on this to
    /// time a `recv` that does not wait).
    pub fn published(&self) -> &AtomicU64 {
        self.u64_at(16)
    }

    /// The floor's sequence number, also its futex word; and the ping-pong word.
    pub fn seq(&self) -> &AtomicU32 {
        self.u32_at(64)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if self.owner {
            let _ = Segment::unlink(self.seg.name());
        }
    }
}

/// Spins until `cond` holds, up to `timeout` (the waiter stays hot: no sleeping); about every
/// millisecond `alive` is asked whether the peer still runs. Errors name `what` when the deadline
/// passes or the peer is gone.
pub fn spin_until(
    what: &str,
    timeout: Duration,
    mut cond: impl FnMut() -> bool,
    mut alive: impl FnMut() -> bool,
) -> Res<()> {
    let start = Instant::now();
    let mut last = start;
    let mut turns = 0u32;
    loop {
        if cond() {
            return Ok(());
        }
        turns = turns.wrapping_add(1);
        if turns.is_multiple_of(256) {
            let now = Instant::now();
            if now - last >= Duration::from_millis(1) {
                last = now;
                if !alive() {
                    return Err(format!("the peer is gone while waiting for {what}").into());
                }
                if now - start >= timeout {
                    return Err(format!("no {what} within {timeout:?}").into());
                }
            }
        }
        std::hint::spin_loop();
    }
}
