//! `cuda-ipc bridge send|recv` (feature `remote`) carrying a host channel between processes of
//! this machine over loopback TCP: frames checked at the far end, `ls` showing the far channel as
//! bridged with the transport UCX reported, both bridges ending when the near channel closes; a
//! wrong secret refused; NIXL missing reported as `Unsupported`, never an abort.
#![cfg(feature = "remote")]

mod common;
use common::bin;
use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer, inspect};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BYTES: usize = 4096;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn secret_file(tag: &str, text: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("cuda-ipc-bridge-test-{tag}-{}", std::process::id()));
    std::fs::write(&p, text).unwrap();
    // A secret file others may read is refused: 0600, as the README says.
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

fn bridge(args: &[&str]) -> Child {
    Command::new(bin())
        .arg("-v")
        .arg("bridge")
        .args(args)
        .env("UCX_TLS", "tcp,self,cuda_copy")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn wait(mut c: Child, limit: Duration) -> (Option<i32>, String) {
    let start = Instant::now();
    while c.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = c.kill();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = c.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout),
    )
}

#[test]
fn the_bridge_commands_carry_a_channel_and_ls_shows_it_bridged() {
    let near = format!("cli-lane-near-{}", std::process::id());
    let far = format!("cli-lane-far-{}", std::process::id());
    let secret = secret_file("ok", "s3cret\n");
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let s = secret.to_str().unwrap();
    let recv = bridge(&[
        "recv",
        "--channel",
        &far,
        "--listen",
        &listen,
        "--secret-file",
        s,
    ]);
    let mut tx = Producer::create_host(&near, &ChannelOptions::new(BYTES).buffers(3)).unwrap();
    let send = bridge(&[
        "send",
        "--channel",
        &near,
        "--connect",
        &listen,
        "--secret-file",
        s,
        "--once",
    ]);
    let start = Instant::now();
    let rx = loop {
        match Consumer::attach(&far, &ConsumerOptions::new()) {
            Ok(c) => break c,
            Err(e) => assert!(
                start.elapsed() < Duration::from_secs(30),
                "far channel: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    for i in 0..200u32 {
        let mut w = tx.acquire(Some(Duration::from_secs(30))).unwrap();
        let bytes: Vec<u8> = (0..BYTES)
            .map(|k| (k as u32 ^ i.wrapping_mul(7)) as u8)
            .collect();
        w.write_at(0, &bytes).unwrap();
        w.publish(&i.to_le_bytes()).unwrap();
        let f = rx.recv_timeout(Duration::from_secs(30)).unwrap();
        assert_eq!(f.metadata(), i.to_le_bytes());
        assert_eq!(f.to_vec().unwrap(), bytes, "frame {i}");
    }
    // The far channel is shown as bridged, with the transport UCX reported (after ~1 s of status).
    std::thread::sleep(Duration::from_millis(1200));
    let mut w = tx.acquire(Some(Duration::from_secs(30))).unwrap();
    w.write_at(0, &[0; 4]).unwrap();
    w.publish(b"last").unwrap();
    drop(rx.recv_timeout(Duration::from_secs(30)).unwrap());
    let ls = Command::new(bin()).args(["ls", &far]).output().unwrap();
    let text = String::from_utf8_lossy(&ls.stdout);
    assert!(
        text.contains("bridged over NIXL: filled from 127.0.0.1:"),
        "{text}"
    );
    assert!(text.contains("UCX tcp@lo (host)"), "{text}");
    let json = Command::new(bin())
        .args(["ls", &far, "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let ch = &v["channels"][0];
    assert_eq!(ch["bridge"]["role"], "recv", "{v}");
    assert_eq!(ch["bridge"]["alive"], true);
    // Closing the near channel closes the far one and ends both bridges.
    tx.close(Duration::from_secs(10)).unwrap();
    match rx.recv_timeout(Duration::from_secs(30)) {
        Err(Error::Channel(cuda_ipc::channel::ChannelError::Closed)) => {}
        other => panic!("expected ChannelClosed, got {other:?}"),
    }
    drop(rx);
    let (code, out) = wait(send, Duration::from_secs(30));
    assert_eq!(code, Some(0), "{out}");
    let (code, out) = wait(recv, Duration::from_secs(30));
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("lane (recv): UCX transport tcp@lo (host)"),
        "{out}"
    );
    assert!(!out.contains("s3cret"), "the secret is never logged");
    assert!(inspect::inspect(&far).is_err(), "the far channel is gone");
    let _ = std::fs::remove_file(secret);
}

#[test]
fn a_wrong_secret_is_refused_on_both_sides() {
    let far = format!("cli-lane-far-bad-{}", std::process::id());
    let near = format!("cli-lane-near-bad-{}", std::process::id());
    let good = secret_file("good", "right");
    let bad = secret_file("bad", "wrong");
    let listen = format!("127.0.0.1:{}", free_port());
    let recv = bridge(&[
        "recv",
        "--channel",
        &far,
        "--listen",
        &listen,
        "--secret-file",
        good.to_str().unwrap(),
    ]);
    let _tx = Producer::create_host(&near, &ChannelOptions::new(BYTES)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let send = bridge(&[
        "send",
        "--channel",
        &near,
        "--connect",
        &listen,
        "--secret-file",
        bad.to_str().unwrap(),
    ]);
    let (code, out) = wait(send, Duration::from_secs(30));
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("wrong secret"), "{out}");
    assert!(!out.contains("right"), "{out}");
    assert!(
        inspect::inspect(&far).is_err(),
        "no far channel for a refused peer"
    );
    let mut recv = recv;
    let _ = recv.kill();
    let (_, out) = wait(recv, Duration::from_secs(5));
    assert!(out.contains("wrong secret"), "{out}");
    for f in [good, bad] {
        let _ = std::fs::remove_file(f);
    }
}

#[test]
fn without_nixl_the_bridge_says_what_is_missing_and_how_to_install_it() {
    let secret = secret_file("none", "x");
    let out = Command::new(bin())
        .args([
            "bridge",
            "recv",
            "--channel",
            "cli-lane-nonixl",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--secret-file", secret.to_str().unwrap()])
        .env("LD_LIBRARY_PATH", "")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("not supported here"), "{err}");
    assert!(err.contains("libnixl_capi.so"), "{err}");
    assert!(err.contains("pip install --no-deps nixl-cu13"), "{err}");
    let _ = std::fs::remove_file(secret);
}
