//! What the command line's two test binaries over real segments share (`cli`, `cli_gc`): output
//! helpers, unique names, segments removed on drop, and the child processes (the test binary
//! re-executed with [`ROLE`] set, running its `child` test only, which calls [`child_role`]).
#![allow(dead_code)] // Each test binary uses a part of it.

use crate::common::bin;
use cuda_ipc::channel::Delivery;
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::raw::channel::testing::{ControlConsumer, ControlProducer};
use cuda_ipc::raw::shm::Segment;
use cuda_ipc::registry::{Registry, RegistryOptions};
use cuda_ipc::token::{TOKEN_LEN, Token, TokenKind};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Environment variable naming a child's role (`registry-orphan`, `registry-live`,
/// `channel-orphan`, `channel-consumer-orphan`) and the segment it works on (`CUDA_IPC_CLI_TEST_NAME`).
pub const ROLE: &str = "CUDA_IPC_CLI_TEST_ROLE";
pub const NAME: &str = "CUDA_IPC_CLI_TEST_NAME";

pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

pub fn code(o: &Output) -> i32 {
    o.status.code().expect("exited, not killed")
}

pub fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(o)))
}

/// A name unique to this test and process.
pub fn unique(tag: &str) -> String {
    format!("cuda-ipc-cli-test-{tag}-{}", std::process::id())
}

/// Removes a segment when dropped, so a failing test leaves nothing behind.
pub struct Unlink(pub String);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = Segment::unlink(&self.0);
    }
}

pub fn token(i: u8) -> [u8; TOKEN_LEN] {
    Token {
        kind: TokenKind::LegacyMemory,
        handle: [i; 64],
        offset: 0,
        len: 1 << 20,
        device: cuda_ipc::driver::Uuid([0xab; 16]),
        export_id: 0,
        exporter: ProcessIdentity::current().unwrap(),
    }
    .to_bytes()
}

/// A child running one role; waits for its `ready` line.
pub struct ChildRole(pub Child);

impl ChildRole {
    pub fn start(role: &str, name: &str) -> ChildRole {
        ChildRole::start_under(&[], role, name)
    }

    /// [`ChildRole::start`] run by `wrapper` (a command and its arguments, e.g. `unshare --pid
    /// --fork --mount-proc --kill-child`, which then runs this test binary); none: directly.
    pub fn start_under(wrapper: &[&str], role: &str, name: &str) -> ChildRole {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        let mut child = cmd
            .args(["child", "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env(NAME, name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child");
        let out = child.stdout.take().unwrap();
        let mut lines = BufReader::new(out).lines();
        loop {
            match lines.next() {
                Some(Ok(l)) if l.ends_with("@@ ready") => break,
                Some(Ok(_)) => continue,
                _ => panic!("child {role} ended before it was ready"),
            }
        }
        ChildRole(child)
    }

    /// Waits for a child that exits by itself.
    pub fn wait(mut self) {
        let st = self.0.wait().unwrap();
        assert!(st.success(), "child failed: {st}");
    }

    /// Kills a child that waits (SIGKILL) and reaps it.
    pub fn kill(mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for ChildRole {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn inspect_consumers(name: &str) -> usize {
    cuda_ipc::channel::inspect::inspect(name)
        .unwrap()
        .consumers
        .len()
}

/// Runs `cuda-ipc args` (optionally under `unshare --pid --fork --mount-proc`), failing the test
/// when it runs longer than 20 s: a hang is a bug.
pub fn cuda_ipc_bounded(args: &[&str], other_pid_namespace: bool) -> Output {
    let mut cmd = if other_pid_namespace {
        let mut c = Command::new("unshare");
        c.args(["--pid", "--fork", "--mount-proc"]).arg(bin());
        c
    } else {
        Command::new(bin())
    };
    let mut child = cmd
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run cuda-ipc");
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("cuda-ipc {args:?} hung (killed after 20 s)");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

pub fn unshare_works() -> bool {
    let ok = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        println!("skipped: `unshare --pid --fork --mount-proc` is not allowed here (needs root)");
    }
    ok
}

/// Something that is not a segment, planted under a name in /dev/shm and removed on drop.
pub struct Planted(pub String);

impl Drop for Planted {
    fn drop(&mut self) {
        let p = format!("/dev/shm/{}", self.0);
        let _ = std::fs::remove_dir(&p);
        let _ = std::fs::remove_file(&p);
    }
}

pub fn driver_present() -> bool {
    ["/proc/driver/nvidia/version"]
        .iter()
        .any(|p| std::path::Path::new(p).exists())
        || std::env::var_os("CUDA_IPC_TEST_ASSUME_DRIVER").is_some()
}

/// The child side of the two-process tests, run by each binary's `child` test. Run without
/// [`ROLE`] (as in every test run) it has nothing to do.
pub fn child_role() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let name = std::env::var(NAME).unwrap();
    match role.as_str() {
        // Joins the registry, publishes, and exits without leaving (like a crash).
        "registry-orphan" => {
            let reg = Registry::open(&name, &RegistryOptions::new()).unwrap();
            reg.publish("orphan", 7, b"token of the dead", b"meta")
                .unwrap();
            println!("@@ ready");
            std::mem::forget(reg);
            std::process::exit(0);
        }
        // Joins, publishes, and stays until killed.
        "registry-live" => {
            let reg = Registry::open(&name, &RegistryOptions::new()).unwrap();
            reg.publish("keeper", 8, b"token of the living", b"")
                .unwrap();
            println!("@@ ready");
            std::thread::sleep(Duration::from_secs(120));
            drop(reg);
        }
        // Creates a channel, publishes one frame, and exits without closing it.
        "channel-orphan" => {
            let tx = ControlProducer::create(&name, 1 << 20, 4, &[token(1)]).unwrap();
            let (i, _) = tx.try_acquire().unwrap();
            tx.publish(i, b"last words").unwrap();
            println!("@@ ready");
            std::process::exit(0);
        }
        // Creates a host-memory channel (its pool a segment of its own), publishes one frame,
        // and exits without closing it.
        "host-channel-orphan" => {
            let opts = cuda_ipc::channel::ChannelOptions::new(4096).buffers(2);
            let mut tx = cuda_ipc::channel::Producer::create_host(&name, &opts).unwrap();
            tx.acquire(None).unwrap().publish(b"last words").unwrap();
            println!("@@ ready");
            std::process::exit(0);
        }
        // Attaches to a channel, takes the next frame (holding its buffer), and exits without
        // releasing or detaching.
        "channel-consumer-orphan" => {
            let rx = ControlConsumer::attach(&name, Delivery::EveryFrame).unwrap();
            println!("@@ ready");
            // Nothing more on stdout: the parent stopped reading it.
            rx.take(Some(Duration::from_secs(10))).unwrap().unwrap();
            std::process::exit(0);
        }
        // Creates a channel, publishes one frame, and stays until killed.
        "channel-live" => {
            let tx = ControlProducer::create(&name, 1 << 20, 4, &[token(1)]).unwrap();
            let (i, _) = tx.try_acquire().unwrap();
            tx.publish(i, b"alive").unwrap();
            // And an fd on offer, as a VMM producer has: its server socket is left by a kill.
            let memfd =
                rustix::fs::memfd_create("gc-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
            let export = cuda_ipc::ipc::fdpass::FdExport::new(memfd).unwrap();
            println!("@@ ready");
            std::thread::sleep(Duration::from_secs(120));
            drop((tx, export));
        }
        other => panic!("unknown role {other}"),
    }
}
