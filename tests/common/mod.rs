//! Two-process test support: the test binary re-executes itself as the child (CUDA does not survive
//! `fork()` without exec). The parent talks to the child over its stdin; the child answers with lines
//! on stdout that start with `@@ `.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Environment variable naming the child's role.
pub const ROLE: &str = "CUDA_IPC_TEST_ROLE";

/// The role of this process, when it was started as a child.
pub fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// A child process running one test function of this binary in a role.
pub struct Peer {
    pub child: Child,
    stdin: Option<ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Peer {
    /// Starts this test binary running only `test` (with `--exact`), with `ROLE=role` and extra env.
    pub fn spawn(test: &str, role: &str, env: &[(&str, &str)]) -> Peer {
        let exe = std::env::current_exe().expect("current_exe");
        let mut cmd = Command::new(exe);
        cmd.args([
            test,
            "--exact",
            "--nocapture",
            "--include-ignored",
            "--test-threads=1",
        ])
        .env(ROLE, role);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Peer::from_command(cmd)
    }

    /// As [`Peer::spawn`], but through `wrapper`, a command that runs the rest of its arguments
    /// (e.g. `["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]`); an empty wrapper
    /// starts the test binary directly.
    pub fn spawn_under(wrapper: &[&str], test: &str, role: &str, env: &[(&str, &str)]) -> Peer {
        let Some((program, wrapper_args)) = wrapper.split_first() else {
            return Peer::spawn(test, role, env);
        };
        let exe = std::env::current_exe().expect("current_exe");
        let mut cmd = Command::new(program);
        cmd.args(wrapper_args).arg(exe).args([
            test,
            "--exact",
            "--nocapture",
            "--include-ignored",
            "--test-threads=1",
        ]);
        cmd.env(ROLE, role);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Peer::from_command(cmd)
    }

    /// Starts any program as a peer that speaks the same `@@ ` line protocol.
    pub fn from_command(cmd: Command) -> Peer {
        Peer::try_from_command(cmd).unwrap_or_else(|f| panic!("spawning {:?}: {}", f.0, f.1))
    }

    /// [`Peer::from_command`], giving the command back with the error when it cannot start.
    pub fn try_from_command(mut cmd: Command) -> Result<Peer, Box<(Command, std::io::Error)>> {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => return Err(Box::new((cmd, e))),
        };
        let stdout: ChildStdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest prints "test NAME ... " without a newline before the test body runs, so
                // a message may follow other text on its line.
                if let Some(at) = line.find("@@ ") {
                    if tx.send(line[at + 3..].to_string()).is_err() {
                        break;
                    }
                } else {
                    println!("[child] {line}");
                }
            }
        });
        let stdin = child.stdin.take();
        Ok(Peer {
            child,
            stdin,
            lines: rx,
        })
    }

    /// Sends one line to the child.
    pub fn send(&mut self, line: &str) {
        let s = self.stdin.as_mut().expect("stdin open");
        writeln!(s, "{line}").expect("write to child");
        s.flush().expect("flush");
    }

    /// Receives the next `@@` line, failing the test after `timeout`.
    pub fn recv(&mut self, timeout: Duration) -> String {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => l,
            Err(_) => {
                let _ = self.child.kill();
                panic!("child sent nothing within {timeout:?}");
            }
        }
    }

    /// Receives the next line and checks it starts with `prefix`; returns the rest.
    pub fn expect(&mut self, prefix: &str, timeout: Duration) -> String {
        let l = self.recv(timeout);
        match l.strip_prefix(prefix) {
            Some(rest) => rest.trim().to_string(),
            None => {
                let _ = self.child.kill();
                panic!("expected {prefix:?} from child, got {l:?}")
            }
        }
    }

    /// Closes stdin and waits (bounded) for the child; panics unless it exited successfully.
    pub fn finish(mut self, timeout: Duration) {
        drop(self.stdin.take());
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                assert!(st.success(), "child failed: {st}");
                return;
            }
            if start.elapsed() > timeout {
                let _ = self.child.kill();
                panic!("child did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// In a child: the lines the parent sends.
pub fn parent_lines() -> impl Iterator<Item = String> {
    std::io::stdin().lines().map_while(Result::ok)
}

/// In a child: sends one line to the parent.
pub fn tell(line: impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "\n@@ {line}").unwrap();
    out.flush().unwrap();
}

/// The environment variable carrying the registry name to a child.
pub const REG: &str = "CUDA_IPC_TEST_REGISTRY";

/// A segment name unique to this process and call.
pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "cuda-ipc-test-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Unlinks the segment when dropped (ignoring "not found").
pub struct Unlink(pub String);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = cuda_ipc::raw::shm::Segment::unlink(&self.0);
    }
}

/// Plants a regular file at `path` holding `bytes`, of this user and mode 0600 as the library
/// makes its segments: what stands for one of ours (a creation abandoned half-way, one cut short,
/// foreign bytes under our name), not a file open to other users, which every opener refuses as
/// `ShmError::InsecureMode` and nothing replaces or removes. Made with the mode rather than changed
/// after (a `chmod` moves `st_ctime`, which the 2 s age rules read); a file already there is
/// truncated and must be of that mode too. Returned open for writing: `set_len` on it makes it
/// sparse, as `truncate -s` does.
pub fn plant(path: impl AsRef<std::path::Path>, bytes: &[u8]) -> std::fs::File {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let path = path.as_ref();
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .unwrap_or_else(|e| panic!("plant {}: {e}", path.display()));
    let mode = f.metadata().unwrap().permissions().mode() & 0o777;
    assert_eq!(
        mode,
        0o600,
        "{} was there with mode {mode:o}",
        path.display()
    );
    f.write_all(bytes).unwrap();
    f
}

/// Re-executes this test binary running only `test` (exact name) as a child with `role`.
pub fn spawn_child(test: &str, role: &str, registry: &str, env: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(REG, registry)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child")
}

/// Waits for a child and returns its stdout; panics when it failed.
pub fn finish(child: Child) -> String {
    let out = child.wait_with_output().expect("wait child");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child failed: {:?}\n{text}",
        out.status
    );
    text
}

/// The value after `key=` in a child's output.
pub fn value(out: &str, key: &str) -> u64 {
    let pat = format!("{key}=");
    out.split_whitespace()
        .find_map(|w| w.strip_prefix(&pat))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in child output:\n{out}"))
}

/// The default device's primary context; fails the test plainly without a GPU.
pub fn ctx() -> std::sync::Arc<cuda_ipc::driver::Context> {
    cuda_ipc::driver::Context::default_device().expect("a CUDA GPU is needed for this test")
}

/// An 8-byte device counter set to zero (for the kernels' mismatch counts).
/// Polls `s` until idle; `None` when it is still busy after `limit` (never blocks on it, so a
/// wedged stream fails the test instead of hanging it).
pub fn drains_within(s: &cuda_ipc::driver::Stream, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if s.is_idle().unwrap() {
            return Some(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

pub fn zeroed_counter(
    ctx: &std::sync::Arc<cuda_ipc::driver::Context>,
) -> cuda_ipc::driver::DeviceBuffer {
    use cuda_ipc::driver::DeviceMemory;
    let c = cuda_ipc::driver::DeviceBuffer::new(ctx, 8).unwrap();
    c.copy_from_host(0, &[0u8; 8]).unwrap();
    c
}

/// The first 8 bytes of `buf` as a little-endian `u64` (synchronous copy).
pub fn read_u64(buf: &impl cuda_ipc::driver::DeviceMemory) -> u64 {
    let mut b = [0u8; 8];
    buf.copy_to_host(0, &mut b).unwrap();
    u64::from_le_bytes(b)
}

/// Whether `unshare` with `args` can run here: `Err(reason)` when the kernel or the environment
/// forbids it (`EPERM`: no privileges, or namespaces disabled) or `unshare` is not installed; any
/// other failure panics, so a broken setup is not mistaken for a skip.
pub fn unshare_works(args: &[&str]) -> Result<(), String> {
    let out = match Command::new("unshare").args(args).arg("true").output() {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err("the unshare program is not installed".to_string());
        }
        Err(e) => panic!("running unshare {args:?}: {e}"),
    };
    if out.status.success() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    if text.contains("Operation not permitted") || text.contains("Permission denied") {
        return Err(format!(
            "unshare {args:?} is not permitted here: {}",
            text.trim()
        ));
    }
    panic!("unshare {args:?} failed: {}: {}", out.status, text.trim());
}

/// Takes the sizing lock a creator holds on its new segment until its pages are reserved
/// (`raw::shm::SIZING_LOCK_OFFSET`), on `f`, open for writing, until `f` is closed.
pub fn hold_sizing_lock(f: &std::fs::File) {
    use std::os::fd::AsRawFd;
    // SAFETY: `flock` is a plain C struct of integers; all-zero is a valid value.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_WRLCK as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = cuda_ipc::raw::shm::SIZING_LOCK_OFFSET;
    l.l_len = 1;
    // SAFETY: `f` is open for writing; `l` is a valid flock that outlives the call.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &l) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
}

// ---------------------------------------------------------------- forked children

/// Forks; the child runs `child` (which returns what it found wrong, if anything) and ends with
/// `_exit`, running nothing else of this process. Returns what the child found wrong.
pub fn forked(child: impl FnOnce() -> Vec<String>) -> Vec<String> {
    // SAFETY: the caller runs in a process of its own with one test thread (`Peer::spawn`), and
    // the child touches only objects whose calls and drops refuse or return before taking a lock
    // or making a driver call there (`cuda_ipc::identity::ForkEpoch`).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let wrong = child();
        for w in &wrong {
            eprintln!("forked child: {w}");
        }
        // SAFETY: ends the child at once: no destructor or exit handler of the parent's runs.
        unsafe { libc::_exit(i32::from(!wrong.is_empty())) };
    }
    let mut status = 0;
    // SAFETY: waits for the child made above; `status` is a valid out pointer.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(r, pid, "waitpid");
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        Vec::new()
    } else {
        vec![format!(
            "the child ended with status {status:#x} (its stderr says why)"
        )]
    }
}

/// What the child's exit does to its copy of `x`, which it shares nothing with in memory: drops
/// it, leaving the parent's binding (never dropped in the child, which ends with `_exit`).
pub fn drop_copy<T>(x: &T) {
    // SAFETY: called only in a forked child that ends with `_exit` without dropping `x` itself,
    // so the copy is the only one dropped in this process.
    drop(unsafe { std::ptr::read(x) });
}

/// The child's copy of `x`, to consume (`close`): as [`drop_copy`].
pub fn take_copy<T>(x: &T) -> T {
    // SAFETY: as in `drop_copy`.
    unsafe { std::ptr::read(x) }
}

/// `what` was refused with `Error::ForkedChild`, else a line saying what it gave.
pub fn refused<T>(what: &str, r: cuda_ipc::Result<T>, wrong: &mut Vec<String>) {
    match r {
        Err(cuda_ipc::Error::ForkedChild { .. }) => {}
        Err(e) => wrong.push(format!("{what}: {e} (not ForkedChild)")),
        Ok(_) => wrong.push(format!("{what}: succeeded in a forked child")),
    }
}
