//! `cuda-ipc bridge send|recv` (feature `remote`) carrying a host channel between processes of
//! this machine over loopback TCP: frames checked at the far end, `ls` showing the far channel as
//! bridged with the transport UCX reported, both bridges ending when the near channel closes, and
//! files planted at the name UCX's log once had left untouched; a wrong secret refused; NIXL
//! missing reported as `Unsupported`, never an abort.
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

/// A folder of this test's alone (mode 0700; `mkdir` fails on a name someone else made first, so
/// nothing here is written into a folder another user planted).
fn private_dir(tag: &str) -> PathBuf {
    use std::os::unix::fs::DirBuilderExt as _;
    let d = std::env::temp_dir().join(format!("cuda-ipc-bridge-test-{tag}-{}", std::process::id()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&d)
        .unwrap_or_else(|e| panic!("{}: {e}", d.display()));
    d
}

fn secret_file(tag: &str, text: &str) -> PathBuf {
    let p = private_dir(tag).join("secret");
    // A secret file others may read is refused: 0600, as docs/guide.md says.
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&p)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    p
}

/// Removes a secret file and its private folder.
fn remove_secret(p: PathBuf) {
    if let Some(d) = p.parent() {
        let _ = std::fs::remove_file(&p);
        let _ = std::fs::remove_dir(d);
    }
}

/// Starts `cuda-ipc bridge ARGS` with the temp folder `tmp` (where its UCX log's private folder
/// goes: a bridge killed leaves it there).
fn bridge(args: &[&str], tmp: &std::path::Path) -> Child {
    Command::new(bin())
        .arg("-v")
        .arg("bridge")
        .args(args)
        .env("TMPDIR", tmp)
        .env("UCX_TLS", "tcp,self,cuda_copy")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// What was planted at the bridge's old UCX log name.
enum Plant {
    /// A symlink to this file (a root bridge once wrote its log through it).
    Link(PathBuf),
    /// A file open to all, holding `planted` (the bridge once logged into it and read it back).
    File,
}

/// Starts `cuda-ipc bridge ARGS` with `TMPDIR=tmp` through a shell that first plants `plant` at
/// the name the bridge's UCX log had before (`cuda-ipc-bridge-CHANNEL-PID.ucx.log` in the temp
/// folder, PID the shell's own, which `exec` keeps: the name another user could predict).
fn bridge_planted(args: &[&str], channel: &str, tmp: &std::path::Path, plant: &Plant) -> Child {
    let at = "\"$TMPDIR/cuda-ipc-bridge-$CH-$$.ucx.log\"";
    let script = match plant {
        Plant::Link(_) => format!("ln -s \"$VICTIM\" {at} && exec \"$@\""),
        Plant::File => format!("printf planted > {at} && chmod 666 {at} && exec \"$@\""),
    };
    let victim = match plant {
        Plant::Link(v) => v.clone(),
        Plant::File => PathBuf::new(),
    };
    Command::new("sh")
        .args(["-c", &script, "sh"])
        .arg(bin())
        .arg("-v")
        .arg("bridge")
        .args(args)
        .env("TMPDIR", tmp)
        .env("CH", channel)
        .env("VICTIM", victim)
        .env("UCX_TLS", "tcp,self,cuda_copy")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Checks UCX's transport as a bridge reported it (`TRANSPORTS@DEVICES`): TCP on the loopback
/// interface, with UCX's CUDA transports (`cuda_copy`, `cuda_ipc`, device `cuda`) named beside
/// them only where a GPU is present (UCX loads them there whatever the memory).
fn assert_transport(summary: &str) {
    let (transports, devices) = summary.split_once('@').expect(summary);
    let transports: Vec<&str> = transports.split(',').collect();
    let devices: Vec<&str> = devices.split(',').collect();
    assert!(
        transports.contains(&"tcp") && devices.contains(&"lo"),
        "{summary}"
    );
    for t in &transports {
        assert!(["tcp", "cuda_copy", "cuda_ipc"].contains(t), "{summary}");
    }
    for d in &devices {
        assert!(["lo", "cuda"].contains(d), "{summary}");
    }
}

/// The word after `before` in `text`, up to `after`.
fn word_between<'t>(text: &'t str, before: &str, after: &str) -> &'t str {
    let from = text
        .find(before)
        .unwrap_or_else(|| panic!("{before:?} in {text}"))
        + before.len();
    let rest = &text[from..];
    &rest[..rest
        .find(after)
        .unwrap_or_else(|| panic!("{after:?} in {rest}"))]
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
    // The temp folder of both bridges, where another user planted a link to a file of root's
    // (mode 0600) and a file open to all at the names UCX's log had before.
    use std::os::unix::fs::PermissionsExt as _;
    let tmp = private_dir("tmp");
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let victim = secret_file("victim", "root's own\n");
    let recv = bridge_planted(
        &[
            "recv",
            "--channel",
            &far,
            "--listen",
            &listen,
            "--secret-file",
            s,
        ],
        &far,
        &tmp,
        &Plant::Link(victim.clone()),
    );
    let mut tx = Producer::create_host(&near, &ChannelOptions::new(BYTES).buffers(3)).unwrap();
    let send = bridge_planted(
        &[
            "send",
            "--channel",
            &near,
            "--connect",
            &listen,
            "--secret-file",
            s,
            "--once",
        ],
        &near,
        &tmp,
        &Plant::File,
    );
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
    assert_transport(word_between(&text, "; UCX ", " (host)"));
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
    assert_transport(word_between(&out, "lane (recv): UCX transport ", " (host)"));
    assert!(!out.contains("s3cret"), "the secret is never logged");
    assert!(inspect::inspect(&far).is_err(), "the far channel is gone");
    // What was planted is untouched: the link's target keeps its bytes and mode, the planted file
    // its bytes; the bridges logged into private folders of their own, gone now. Nothing else of
    // theirs is in the temp folder.
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "root's own\n");
    let mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let mut left: Vec<String> = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left.len(), 2, "{left:?}");
    for name in &left {
        let p = tmp.join(name);
        let m = std::fs::symlink_metadata(&p).unwrap();
        if m.file_type().is_symlink() {
            assert!(
                name.starts_with(&format!("cuda-ipc-bridge-{far}-")),
                "{name}"
            );
            assert_eq!(std::fs::read_link(&p).unwrap(), victim);
        } else {
            assert!(
                name.starts_with(&format!("cuda-ipc-bridge-{near}-")),
                "{name}"
            );
            assert_eq!(std::fs::read_to_string(&p).unwrap(), "planted");
        }
    }
    for name in &left {
        let _ = std::fs::remove_file(tmp.join(name));
    }
    let _ = std::fs::remove_dir(&tmp);
    remove_secret(victim);
    remove_secret(secret);
}

#[test]
fn a_wrong_secret_is_refused_on_both_sides() {
    let far = format!("cli-lane-far-bad-{}", std::process::id());
    let near = format!("cli-lane-near-bad-{}", std::process::id());
    let good = secret_file("good", "right");
    let bad = secret_file("bad", "wrong");
    let listen = format!("127.0.0.1:{}", free_port());
    let tmp = private_dir("tmp-bad");
    let recv = bridge(
        &[
            "recv",
            "--channel",
            &far,
            "--listen",
            &listen,
            "--secret-file",
            good.to_str().unwrap(),
        ],
        &tmp,
    );
    let _tx = Producer::create_host(&near, &ChannelOptions::new(BYTES)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let send = bridge(
        &[
            "send",
            "--channel",
            &near,
            "--connect",
            &listen,
            "--secret-file",
            bad.to_str().unwrap(),
        ],
        &tmp,
    );
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
        remove_secret(f);
    }
    // The killed bridge's UCX log folder, in this test's own temp folder.
    let _ = std::fs::remove_dir_all(&tmp);
}

/// A far channel no peer could be served with is refused before anything listens (it was refused
/// to each peer in turn while the bridge listened on), NIXL or not.
#[test]
fn bridge_recv_refuses_a_buffer_count_no_channel_takes_before_it_listens() {
    let secret = secret_file("bufs", "x");
    let most = cuda_ipc::channel::MAX_BUFFERS;
    for bad in [
        "0".to_string(),
        (most + 1).to_string(),
        "18446744073709551615".to_string(),
    ] {
        let out = Command::new(bin())
            .args([
                "bridge",
                "recv",
                "--channel",
                "cli-lane-bufs",
                "--listen",
                "127.0.0.1:0",
            ])
            .args(["--buffers", &bad, "--secret-file", secret.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "--buffers {bad}: {err}");
        assert!(
            err.contains(&format!("a far channel of {bad} buffers")),
            "{err}"
        );
        assert!(err.contains(&format!("1 to {most}")), "{err}");
        assert!(!err.contains("listening"), "{err}");
    }
    remove_secret(secret);
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
    remove_secret(secret);
}

#[test]
fn the_bridge_commands_mirror_a_tensor_set_and_ls_shows_it_bridged() {
    use cuda_ipc::tensorset::{
        DType, GenerationMode, ReaderOptions, TensorSetOptions, TensorSetReader, TensorSetWriter,
        TensorSpec,
    };
    let near = format!("cli-tsb-near-{}", std::process::id());
    let far = format!("cli-tsb-far-{}", std::process::id());
    let secret = secret_file("ts", "ts s3cret\n");
    let listen = format!("127.0.0.1:{}", free_port());
    let s = secret.to_str().unwrap();
    let tmp = private_dir("tstmp");
    let specs = [
        TensorSpec::new("w", DType::F32, &[1000, 3]),
        TensorSpec::new("b", DType::U8, &[77]),
    ];
    let mut w = TensorSetWriter::create_host(
        &near,
        &specs,
        &TensorSetOptions::new().mode(GenerationMode::Buffered(2)),
    )
    .unwrap();
    let recv = bridge(
        &[
            "recv",
            "--tensorset",
            &far,
            "--listen",
            &listen,
            "--secret-file",
            s,
        ],
        &tmp,
    );
    let send = bridge(
        &[
            "send",
            "--tensorset",
            &near,
            "--connect",
            &listen,
            "--secret-file",
            s,
            "--changed-only",
            "--once",
        ],
        &tmp,
    );
    let start = Instant::now();
    let r = loop {
        match TensorSetReader::open_host(&far, &ReaderOptions::new()) {
            Ok(r) => break r,
            Err(e) => assert!(start.elapsed() < Duration::from_secs(30), "far set: {e}"),
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut far_gen = 0;
    for g in 1..=20u8 {
        let mut u = w.begin(Some(Duration::from_secs(30))).unwrap();
        u.write_tensor(0, &vec![g; 12_000]).unwrap();
        u.write_tensor(1, &[g / 2; 77]).unwrap();
        let mut c = [0u8; 32];
        c[0] = g;
        u.commit_with_content(c).unwrap();
        // Each generation reaches the far set whole (the bridge may skip one that was overtaken).
        loop {
            let h = r
                .wait_newer(far_gen, Some(Duration::from_secs(30)))
                .unwrap();
            far_gen = h.generation();
            let seen = h.content()[0];
            assert_eq!(h.read_tensor(0).unwrap(), vec![seen; 12_000]);
            assert_eq!(h.read_tensor(1).unwrap(), vec![seen / 2; 77]);
            if seen == g {
                break;
            }
        }
    }
    // A second sender while the first one's session runs is told the bridge is busy and keeps
    // trying (a busy bridge may only not have seen yet that a sender it served is gone).
    let mut second = bridge(
        &[
            "send",
            "--tensorset",
            &near,
            "--connect",
            &listen,
            "--secret-file",
            s,
        ],
        &tmp,
    );
    std::thread::sleep(Duration::from_millis(2000));
    let still = second.try_wait().unwrap().is_none();
    let _ = second.kill();
    let (_, out) = wait(second, Duration::from_secs(10));
    assert!(still, "the second sender gave up: {out}");
    assert!(out.contains("busy"), "{out}");
    std::thread::sleep(Duration::from_millis(300));
    let json = Command::new(bin())
        .args(["ls", &far, "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let t = &v["tensor_sets"][0];
    assert_eq!(t["bridge"]["role"], "recv", "{v}");
    assert_eq!(t["bridge"]["object"], "tensorset", "{v}");
    assert_eq!(t["bridge"]["alive"], true, "{v}");
    let ls = Command::new(bin()).args(["ls", &near]).output().unwrap();
    let text = String::from_utf8_lossy(&ls.stdout);
    assert!(
        text.contains("bridged over NIXL: carried to 127.0.0.1:"),
        "{text}"
    );
    assert!(text.contains("generations"), "{text}");
    // Closing the near set ends both bridges; the far set is closed.
    drop(r);
    w.close(Duration::from_secs(10)).unwrap();
    let (code, out) = wait(send, Duration::from_secs(30));
    assert_eq!(code, Some(0), "{out}");
    let (code, out) = wait(recv, Duration::from_secs(30));
    assert_eq!(code, Some(0), "{out}");
    assert!(!out.contains("s3cret"), "the secret is never logged");
    assert!(TensorSetReader::open_host(&far, &ReaderOptions::new()).is_err());
    remove_secret(secret);
    let _ = std::fs::remove_dir_all(&tmp);
}
