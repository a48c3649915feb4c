//! The process identity's liveness file across a process's life: a `fork` taken while another
//! thread holds the identity's lock does not hang the child, and a normal exit leaves no liveness
//! file behind even when exit handlers run long after ours. Runs without a GPU.

use cuda_ipc::identity::ProcessIdentity;
use std::process::Command;
use std::time::Duration;

const ROLE: &str = "CUDA_IPC_TEST_IDENTITY_ROLE";

extern "C" fn slow_exit_handler() {
    // Runs after the crate's own handler (registered before it): the keeper thread would have
    // made the liveness file again meanwhile, were it not told the process is exiting.
    std::thread::sleep(Duration::from_millis(700));
}

#[test]
fn a_normal_exit_leaves_no_liveness_file_even_with_slow_exit_handlers_after_ours() {
    if std::env::var(ROLE).as_deref() == Ok("slow-exit") {
        // SAFETY: `slow_exit_handler` is an `extern "C"` function without arguments.
        unsafe { libc::atexit(slow_exit_handler) };
        let me = ProcessIdentity::current().unwrap();
        println!("@@ {}", me.liveness_path());
        std::process::exit(0);
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "a_normal_exit_leaves_no_liveness_file_even_with_slow_exit_handlers_after_ours",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "slow-exit")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let path = text
        .lines()
        .find_map(|l| l.split("@@ ").nth(1))
        .unwrap_or_else(|| panic!("{text}"))
        .trim()
        .to_string();
    assert!(
        std::fs::symlink_metadata(&path).is_err(),
        "{path} was left behind (or made again during exit)"
    );
}

#[test]
fn a_fork_while_another_thread_takes_the_identity_never_hangs_the_child() {
    let _ = ProcessIdentity::current().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = ProcessIdentity::current().unwrap();
            }
        })
    };
    let mut hung = 0;
    for _ in 0..100 {
        // SAFETY: the child only calls async-signal-safe functions and the crate's identity
        // (which is built to be called after a fork), then `_exit`s; it never returns here.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: alarm and _exit are async-signal-safe; the alarm kills a hung child.
            unsafe { libc::alarm(3) };
            let ok = ProcessIdentity::current().is_ok_and(|id| id.pid != 0);
            // SAFETY: as above.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        // Its identity, read while it is a zombie at the latest (before it is reaped), to remove
        // the liveness file its `_exit` leaves (no exit handlers run).
        let child = start_time_of(pid as u32).map(|start_time| ProcessIdentity {
            pid: pid as u32,
            start_time,
            ..ProcessIdentity::current().unwrap()
        });
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        if let Some(id) = child {
            let _ = cuda_ipc::raw::identity::remove_liveness_file_if_free(&id);
        }
        if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
            hung += 1;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    busy.join().unwrap();
    assert_eq!(
        hung, 0,
        "children that hung or failed taking their identity"
    );
}

/// Field 22 of `/proc/PID/stat` (start time in clock ticks), counted after the command name.
fn start_time_of(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..]
        .split_ascii_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

#[test]
fn proc_outvotes_a_lock_held_under_a_dead_pids_liveness_name_in_its_own_pid_namespace() {
    use cuda_ipc::identity::Liveness;
    use std::os::fd::AsRawFd;
    // A process that has exited (reaped: its pid is gone from /proc).
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    let start = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s[s.rfind(')')? + 1..]
                .split_ascii_whitespace()
                .nth(19)?
                .parse::<u64>()
                .ok()
        })
        .unwrap_or(1);
    child.wait().unwrap();
    let dead = ProcessIdentity {
        pid,
        start_time: start,
        ..ProcessIdentity::current().unwrap()
    };
    // A helper of the same user (this process) makes a file under its liveness name and holds the
    // write lock a live process would hold.
    let path = dead.liveness_path();
    let _ = std::fs::remove_file(&path);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .unwrap();
    // SAFETY: `flock` is a plain C struct of integers; all-zero is a valid value.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_WRLCK as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_len = 1;
    // SAFETY: `f` is open; `l` is a valid flock that outlives the call.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &l) };
    assert_eq!(r, 0);
    let uid = rustix::process::geteuid().as_raw();
    // /proc of our own pid namespace says the pid is gone: dead, whatever the lock says, with or
    // without the recorded uid (the file is that uid's own).
    assert_eq!(dead.liveness_as(uid), Liveness::Dead);
    assert_eq!(dead.liveness(), Liveness::Dead);
    // The same for a pid that runs with another start time (the pid reused): the lock under the
    // name is never asked.
    let reused = ProcessIdentity {
        pid: std::process::id(),
        ..dead
    };
    let reused_path = reused.liveness_path();
    let _ = std::fs::remove_file(&reused_path);
    let g = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&reused_path)
        .unwrap();
    // SAFETY: as above.
    let r = unsafe { libc::fcntl(g.as_raw_fd(), libc::F_OFD_SETLK, &l) };
    assert_eq!(r, 0);
    assert_eq!(reused.liveness_as(uid), Liveness::Dead);
    drop((f, g));
    std::fs::remove_file(&path).unwrap();
    std::fs::remove_file(&reused_path).unwrap();
}

/// A symbolic link, a FIFO or a directory planted under the liveness file name of a process about
/// to take its identity (its first use of the crate) makes that fail with an error saying what
/// stands there, and nothing of it is followed, read or removed. The FIFO was "a Fifo"; where
/// the kernel's `protected_symlinks` refuses the open of a link another user planted (`EACCES`),
/// the error was only "Permission denied": what stands there is now read with `lstat` whatever
/// the errno (`tests/two_users.rs` has another user's file, whose open is `EACCES` too).
#[test]
fn what_stands_under_a_starting_processs_liveness_file_name_is_named_in_its_error() {
    if std::env::var(ROLE).as_deref() == Ok("planted") {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        match ProcessIdentity::current() {
            Ok(_) => println!("@@ ok"),
            Err(e) => println!("@@ {e}"),
        }
        return;
    }
    for (kind, words) in [
        ("link", "a symbolic link"),
        ("fifo", "a FIFO"),
        ("dir", "a directory"),
    ] {
        use std::io::{BufRead, Write};
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "what_stands_under_a_starting_processs_liveness_file_name_is_named_in_its_error",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, "planted")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let t = std::time::Instant::now();
        let start_time = loop {
            if let Some(s) = start_time_of(pid) {
                break s;
            }
            assert!(t.elapsed() < Duration::from_secs(5));
        };
        let path = ProcessIdentity {
            pid,
            start_time,
            ..ProcessIdentity::current().unwrap()
        }
        .liveness_path();
        match kind {
            "link" => std::os::unix::fs::symlink("/nonexistent", &path).unwrap(),
            "fifo" => {
                let c = std::ffi::CString::new(path.clone()).unwrap();
                // SAFETY: `c` is a valid NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            }
            _ => std::fs::create_dir(&path).unwrap(),
        }
        writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
        // Read to the end, so the child's last lines find a reader.
        let lines: Vec<String> = std::io::BufReader::new(child.stdout.take().unwrap())
            .lines()
            .map_while(Result::ok)
            .collect();
        let said = lines
            .iter()
            .find_map(|l| l.split("@@ ").nth(1).map(str::to_string))
            .unwrap_or_default();
        child.wait().unwrap();
        let there = std::fs::symlink_metadata(&path).is_ok();
        let _ = std::fs::remove_dir(&path);
        let _ = std::fs::remove_file(&path);
        assert!(there, "{kind}: removed");
        assert!(
            said.contains(&format!(
                "{words} holds this process's liveness file name; remove it"
            )),
            "{kind}: {said}"
        );
    }
}
