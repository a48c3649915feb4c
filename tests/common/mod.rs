//! Two-process test support: the test binary re-executes itself as the child (CUDA does not survive
//! `fork()` without exec). The parent talks to the child over its stdin; the child answers with lines
//! on stdout that start with `@@ `.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
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
        cmd.args([test, "--exact", "--nocapture", "--include-ignored", "--test-threads=1"])
            .env(ROLE, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn child");
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
        Peer { child, stdin, lines: rx }
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
