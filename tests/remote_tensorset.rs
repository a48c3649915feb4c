//! Tensor sets across hosts (feature `remote`) between processes of this machine over loopback TCP
//! (`UCX_TLS=tcp,self,cuda_copy`, UCX bound to `lo`), with host-memory sets: the real near
//! `TensorSetWriter`, the two tensor-set bridges over NIXL, and ordinary `TensorSetReader`s of the
//! far set. Every far generation's bytes are checked against the near generation its content
//! fingerprint names (so a mix of two generations fails), whole and changed-only; kill -9 of
//! either bridge mid-stream, with the outcomes promised (far readers keep the last whole
//! generation, a new bridge resumes); a far set of another layout and a wrong secret refused.
//!
//! Needs NIXL's C API library (`libnixl_capi.so`) on the loader's path, as tests/remote_lane.rs.
#![cfg(feature = "remote")]

mod common;

use common::{Peer, parent_lines, role, tell};
use cuda_ipc::Error;
use cuda_ipc::remote::report::UcxLog;
use cuda_ipc::remote::tensorset::{recv, send};
use cuda_ipc::remote::wire::Secret;
use cuda_ipc::tensorset::{
    DType, GenerationMode, Held, ReaderOptions, TensorSetError, TensorSetOptions, TensorSetReader,
    TensorSetWriter, TensorSpec, reclaim,
};
use std::net::TcpListener;
use std::process::Command;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

const ANSWER: Duration = Duration::from_secs(30);
const SECRET: &str = "tensor-set bridge test secret";

/// The near set's tensors (`SIZE=big`: about 12 MiB, so a generation takes a while on loopback
/// TCP; else about 70 KiB). Sizes are not multiples of the 256-byte alignment, so runs carry gaps.
fn specs(size: &str, extra: bool) -> Vec<TensorSpec> {
    let k = if size == "big" { 256 } else { 1 };
    let mut v = vec![
        TensorSpec::new("embed", DType::F32, &[k * 1000, 7]),
        TensorSpec::new("layer.0.w", DType::BF16, &[k * 3000, 3]),
        TensorSpec::new("layer.0.b", DType::F32, &[33]),
        TensorSpec::new("layer.1.w", DType::BF16, &[k * 3000, 3]),
        TensorSpec::new("layer.1.b", DType::F32, &[33]),
        TensorSpec::new("empty", DType::F32, &[0]),
        TensorSpec::new("head", DType::U8, &[k * 5000 + 1]),
    ];
    if extra {
        v.push(TensorSpec::new("extra", DType::U8, &[10]));
    }
    v
}

/// The version of tensor `i` (of `n`) in near generation `g`: `g` in whole mode; in changed mode
/// generation 1 writes every tensor and generation `g >= 2` only tensor `g % n`.
fn version(changed: bool, n: usize, i: usize, g: u64) -> u64 {
    if !changed || g <= 1 {
        return g;
    }
    (2..=g).rev().find(|x| (*x as usize) % n == i).unwrap_or(1)
}

/// Byte `k` of tensor `i` at version `v`.
fn pattern(v: u64, i: usize, k: usize) -> u8 {
    (v.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ (k as u8).wrapping_mul(31) ^ (i as u8)
}

/// The content fingerprint the near writer commits: its generation in the first 8 bytes.
fn content(g: u64) -> [u8; 32] {
    let mut c = [0u8; 32];
    c[..8].copy_from_slice(&g.to_le_bytes());
    c[8] = 0xC5;
    c
}

/// Checks every byte of a far generation against the near generation its content names; returns
/// that near generation.
fn check(h: &Held<'_>, changed: bool, n: usize) -> u64 {
    let c = h.content();
    assert_eq!(
        c[8],
        0xC5,
        "far generation {} has no near content",
        h.generation()
    );
    let g = u64::from_le_bytes(c[..8].try_into().unwrap());
    for i in 0..n {
        let v = version(changed, n, i, g);
        let bytes = h.read_tensor(i).unwrap();
        let want: Vec<u8> = (0..bytes.len()).map(|k| pattern(v, i, k)).collect();
        if bytes != want {
            let k = bytes
                .iter()
                .zip(&want)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            panic!(
                "far generation {} (near {g}) tensor {i} byte {k}: a mix or a bad write",
                h.generation()
            );
        }
    }
    g
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"))
}

fn secret() -> Secret {
    Secret::new(SECRET.as_bytes().to_vec()).unwrap()
}

/// The child side of every test: the role names what to do.
#[test]
fn child() {
    let Some(r) = role() else { return };
    match r.as_str() {
        // The near writer: `GENS` generations after "go" (GENS=0: one every few ms until killed),
        // `PERIOD_MS` apart, then lingers and closes.
        "writer" => {
            let changed = std::env::var("CHANGED").is_ok();
            let specs = specs(&env("SIZE"), std::env::var("EXTRA").is_ok());
            let n = specs.len();
            let mut w = TensorSetWriter::create_host(
                &env("NEAR"),
                &specs,
                &TensorSetOptions::new().mode(GenerationMode::Buffered(3)),
            )
            .expect("near set");
            tell("ready");
            let mut lines = parent_lines();
            assert_eq!(lines.next().as_deref(), Some("go"));
            let gens: u64 = env("GENS").parse().unwrap();
            let period = Duration::from_millis(env("PERIOD_MS").parse().unwrap());
            let mut g = 0u64;
            while gens == 0 || g < gens {
                g += 1;
                let mut u = w.begin(Some(ANSWER)).expect("begin");
                for i in 0..n {
                    let v = version(changed, n, i, g);
                    let len = w_len(&specs, i);
                    let bytes: Vec<u8> = (0..len).map(|k| pattern(v, i, k)).collect();
                    u.write_tensor(i, &bytes).unwrap();
                }
                assert_eq!(u.commit_with_content(content(g)).unwrap(), g);
                std::thread::sleep(period);
            }
            tell(format!("wrote {g}"));
            // "close", or the parent gone.
            let _ = lines.next();
            w.close(ANSWER).unwrap();
        }
        "recv" => {
            let port = std::env::var("PORT").unwrap_or_else(|_| "0".into());
            let listener = TcpListener::bind(format!("127.0.0.1:{port}")).unwrap();
            tell(format!("port {}", listener.local_addr().unwrap().port()));
            let opts = recv::RecvOptions::new(&env("FAR"), secret());
            let mut totals = recv::Totals::default();
            match recv::serve(&opts, &listener, &AtomicBool::new(false), &mut totals) {
                Ok(recv::Ended::Closed(w)) => {
                    tell(format!(
                        "closed {} prefilled {}",
                        totals.generations, totals.prefilled
                    ));
                    // Far readers are done reading once the parent says so.
                    let _ = parent_lines().next();
                    drop(w);
                }
                Ok(other) => panic!("{other:?}"),
                Err(e) => panic!("recv bridge: {e}"),
            }
        }
        "send" => {
            let mut opts = send::SendOptions::new(
                &env("NEAR"),
                &env("ADDR"),
                Secret::new(env("SECRET").into_bytes()).unwrap(),
            );
            opts.changed_only = std::env::var("CHANGED").is_ok();
            // Small WRITEs, several in flight: many pieces per generation.
            opts.chunk = 16 * 1024;
            opts.in_flight = std::env::var("IN_FLIGHT").map_or(4, |v| v.parse().unwrap());
            let mut totals = send::Totals::default();
            let once = std::env::var("ONCE").is_ok();
            loop {
                match send::serve(&opts, &AtomicBool::new(false), &mut totals) {
                    Ok(send::Ended::Closed) => {
                        let t = totals.transport.clone().expect("UCX's transport report");
                        // Judged from UCX's table of the WRITE itself, not only the others.
                        let put = t.lines.iter().any(|l| l.contains("remote memory write"));
                        tell(format!(
                            "closed {} {} {} {} {put}",
                            totals.generations,
                            totals.bytes,
                            t.summary(),
                            t.path.word()
                        ));
                        return;
                    }
                    Ok(other) => panic!("{other:?}"),
                    Err(e) => {
                        tell(format!("error {e}"));
                        if once {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn w_len(specs: &[TensorSpec], i: usize) -> usize {
    let s = &specs[i];
    let elems: i64 = s.shape.iter().product();
    elems as usize * (s.dtype.bits as usize / 8) * s.dtype.lanes as usize
}

fn ucx_env() -> Vec<(String, String)> {
    let log = UcxLog::create().unwrap();
    let mut v: Vec<(String, String)> =
        cuda_ipc::remote::environment("127.0.0.1".parse().unwrap(), Some(&log))
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string_lossy().into_owned()))
            .collect();
    LOGS.with_borrow_mut(|v| v.push(log));
    v.push(("UCX_TLS".into(), "tcp,self,cuda_copy".into()));
    v
}

thread_local! {
    static SPAWNED: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    static LOGS: std::cell::RefCell<Vec<UcxLog>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Ends a test's children (kill -9) and removes what dead writers left under its set names.
struct Reap(Vec<String>);

impl Drop for Reap {
    fn drop(&mut self) {
        let exe = std::env::current_exe().unwrap();
        for pid in SPAWNED.take() {
            let ours = std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|e| e == exe);
            let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |s| s.contains(") Z "));
            if ours && !zombie {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
        std::thread::sleep(Duration::from_millis(100));
        drop(LOGS.take());
        for s in &self.0 {
            let _ = reclaim::remove_stale(s);
            let name = cuda_ipc::remote::report::tensorset_status_name(s);
            let _ = std::fs::remove_file(cuda_ipc::remote::report::status_path(&name));
        }
    }
}

fn spawn(role: &str, vars: &[(&str, String)]) -> Peer {
    let mut all: Vec<(String, String)> = ucx_env();
    all.extend(vars.iter().map(|(k, v)| (k.to_string(), v.clone())));
    let refs: Vec<(&str, &str)> = all.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let p = Peer::spawn("child", role, &refs);
    SPAWNED.with_borrow_mut(|v| v.push(p.child.id()));
    p
}

fn names(tag: &str) -> (String, String) {
    (
        format!("tsb-near-{tag}-{}", std::process::id()),
        format!("tsb-far-{tag}-{}", std::process::id()),
    )
}

fn start_recv(far: &str, port: u16) -> (Peer, u16) {
    let mut r = spawn("recv", &[("FAR", far.into()), ("PORT", port.to_string())]);
    let port: u16 = r.expect("port", ANSWER).parse().unwrap();
    (r, port)
}

fn start_send(near: &str, port: u16, extra: &[(&str, String)]) -> Peer {
    let mut v = vec![
        ("NEAR", near.to_string()),
        ("ADDR", format!("127.0.0.1:{port}")),
        ("SECRET", SECRET.to_string()),
    ];
    v.extend(extra.iter().cloned());
    spawn("send", &v)
}

fn start_writer(near: &str, gens: u64, period_ms: u64, extra: &[(&str, String)]) -> Peer {
    let mut v = vec![
        ("NEAR", near.to_string()),
        ("GENS", gens.to_string()),
        ("PERIOD_MS", period_ms.to_string()),
        ("SIZE", "small".to_string()),
    ];
    v.extend(extra.iter().cloned());
    let mut w = spawn("writer", &v);
    w.expect("ready", ANSWER);
    w
}

/// Opens the far set once it exists (host set, no GPU).
fn open_far(far: &str) -> TensorSetReader {
    let start = Instant::now();
    loop {
        match TensorSetReader::open_host(far, &ReaderOptions::new()) {
            Ok(r) => return r,
            Err(e) if start.elapsed() > ANSWER => panic!("far set {far}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Reads far generations until one mirrors near generation `last`, checking each; returns how
/// many distinct far generations were checked.
fn follow(r: &TensorSetReader, changed: bool, n: usize, last: u64) -> u64 {
    let mut seen = 0;
    let mut far = 0;
    loop {
        let h = r
            .wait_newer(far, Some(ANSWER))
            .expect("a newer far generation");
        far = h.generation();
        seen += 1;
        if check(&h, changed, n) == last {
            return seen;
        }
    }
}

/// Mirrors `gens` near generations; returns (generations mirrored, bytes written, the sending
/// bridge's last words, far buffers prefilled by the receiving bridge).
fn bridge(tag: &str, gens: u64, changed: bool) -> (u64, u64, String, u64) {
    bridge_with(tag, gens, changed, &[])
}

/// As [`bridge`], with `send` added to the sending bridge's environment.
fn bridge_with(
    tag: &str,
    gens: u64,
    changed: bool,
    send: &[(&str, String)],
) -> (u64, u64, String, u64) {
    cuda_ipc::remote::nixl::probe().expect("NIXL (libnixl_capi.so) must be on LD_LIBRARY_PATH");
    let (near, far) = names(tag);
    let _reap = Reap(vec![near.clone(), far.clone()]);
    let flag = |on: bool| {
        if on {
            vec![("CHANGED", "1".to_string())]
        } else {
            vec![]
        }
    };
    let (mut rcv, port) = start_recv(&far, 0);
    let mut w = start_writer(&near, gens, 15, &flag(changed));
    let mut extra = flag(changed);
    extra.extend(send.iter().cloned());
    let mut snd = start_send(&near, port, &extra);
    // The far set exists once the bridges met: the near generations start then.
    let r = open_far(&far);
    w.send("go");
    let n = specs("small", false).len();
    let seen = follow(&r, changed, n, gens);
    assert!(seen >= 2, "several far generations checked, got {seen}");
    w.expect(&format!("wrote {gens}"), ANSWER);
    w.send("close");
    let said = snd.expect("closed", ANSWER);
    let words: Vec<String> = said.split(' ').map(String::from).collect();
    let mirrored: u64 = words[0].parse().unwrap();
    let bytes: u64 = words[1].parse().unwrap();
    assert!(mirrored >= seen, "{said}");
    assert_eq!(words[3], "host", "host memory at both ends: {said}");
    assert_eq!(
        words[4], "true",
        "UCX's table of the WRITE was read: {said}"
    );
    assert!(
        words[2].contains("tcp") && words[2].contains("lo"),
        "{said}"
    );
    let prefilled: u64 = rcv
        .expect(&format!("closed {mirrored} prefilled"), ANSWER)
        .parse()
        .unwrap();
    drop(r);
    rcv.send("done");
    (mirrored, bytes, said, prefilled)
}

#[test]
fn fifty_generations_are_mirrored_whole_with_every_far_byte_checked() {
    let (mirrored, bytes, _, prefilled) = bridge("whole", 50, false);
    // Whole generations leave nothing to bring up to date ahead of the next.
    assert_eq!(prefilled, 0);
    let per = cuda_ipc::tensorset::Layout::new(&specs("small", false))
        .unwrap()
        .bytes_per_buffer();
    // Whole generations: every tensor's bytes (the gaps between them included) each time.
    assert!(
        bytes >= mirrored * (per - 256 * 8),
        "{bytes} bytes for {mirrored} generations"
    );
}

#[test]
fn any_count_of_writes_in_flight_is_taken_as_at_most_the_pieces_of_a_generation() {
    // `SendOptions::in_flight` of `usize::MAX` (a command line's `--in-flight`): never a queue
    // of that many reserved.
    let (mirrored, _, said, _) = bridge_with(
        "inflight",
        50,
        false,
        &[("IN_FLIGHT", usize::MAX.to_string())],
    );
    assert!(mirrored >= 2, "{said}");
}

#[test]
fn changed_only_mirrors_the_changed_tensors_and_fills_the_rest_on_the_far_side() {
    let (mirrored, bytes, said, prefilled) = bridge("changed", 50, true);
    // The writer pauses between generations and the far reader lets each go once checked: the
    // receiving bridge brings the next buffer up to date in those pauses (every far generation
    // above was checked whole, so those buffers held exactly the newest generation).
    assert!(
        prefilled >= mirrored / 2,
        "{prefilled} of {mirrored} buffers prefilled"
    );
    let per = cuda_ipc::tensorset::Layout::new(&specs("small", false))
        .unwrap()
        .bytes_per_buffer();
    // The first generation whole, then one tensor of seven (or two, where the bridge skipped
    // one): well under half of whole generations.
    assert!(
        bytes < per + (mirrored - 1) * per / 2,
        "{bytes} bytes for {mirrored} generations of {per}: {said}"
    );
}

/// A far reader that checks every generation it can take (a mix would fail `check`) until told.
fn watcher(far: String, stop: std::sync::Arc<AtomicBool>) -> std::thread::JoinHandle<(u64, u64)> {
    std::thread::spawn(move || {
        let n = specs("big", false).len();
        let mut r = open_far(&far);
        let (mut far_gen, mut checked, mut last_near) = (0u64, 0u64, 0u64);
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let got = match r.wait_newer(far_gen, Some(Duration::from_millis(100))) {
                Ok(h) => {
                    far_gen = h.generation();
                    last_near = check(&h, false, n);
                    checked += 1;
                    None
                }
                Err(e) => Some(e),
            };
            match got {
                None | Some(Error::Timeout { .. }) => {}
                Some(Error::TensorSet(TensorSetError::WriterGone { .. })) => {
                    // The receiving bridge died: what this reader holds stays whole; a new one
                    // makes the set again.
                    if let Ok(Some(h)) = r.current() {
                        check(&h, false, n);
                    }
                    drop(r);
                    std::thread::sleep(Duration::from_millis(50));
                    r = open_far(&far);
                    far_gen = 0;
                }
                Some(e) => panic!("far reader: {e}"),
            }
        }
        (checked, last_near)
    })
}

/// Waits until the watcher's far set mirrors a near generation past `after` (read through a
/// reader of its own).
fn far_passes(far: &str, after: u64) -> u64 {
    let n = specs("big", false).len();
    let start = Instant::now();
    loop {
        if let Ok(r) = TensorSetReader::open_host(far, &ReaderOptions::new())
            && let Ok(Some(h)) = r.current()
        {
            let g = check(&h, false, n);
            if g > after {
                return g;
            }
        }
        assert!(
            start.elapsed() < ANSWER,
            "the far set stayed at or before near generation {after}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn killing_either_bridge_mid_stream_leaves_whole_generations_and_new_bridges_resume() {
    cuda_ipc::remote::nixl::probe().expect("NIXL (libnixl_capi.so) must be on LD_LIBRARY_PATH");
    let (near, far) = names("kill");
    let _reap = Reap(vec![near.clone(), far.clone()]);
    let big = [("SIZE", "big".to_string())];
    let (rcv, port) = start_recv(&far, 0);
    let mut w = spawn(
        "writer",
        &[
            ("NEAR", near.clone()),
            ("GENS", "0".into()),
            ("PERIOD_MS", "2".into()),
            ("SIZE", "big".into()),
        ],
    );
    w.expect("ready", ANSWER);
    w.send("go");
    let snd = start_send(&near, port, &big);
    let g1 = far_passes(&far, 0);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let watch = watcher(far.clone(), stop.clone());
    // Kill the sending bridge while it streams (12 MiB generations, one after another).
    std::thread::sleep(Duration::from_millis(150));
    kill9(&snd);
    std::thread::sleep(Duration::from_millis(300));
    let snd2 = start_send(&near, port, &big);
    let g2 = far_passes(&far, g1);
    // Kill the receiving bridge: far readers keep what they hold; a new one on the same port
    // makes the far set again and the sending bridge (retrying) resumes into it.
    std::thread::sleep(Duration::from_millis(150));
    kill9(&rcv);
    std::thread::sleep(Duration::from_millis(300));
    let (_rcv2, _) = start_recv(&far, port);
    let g3 = far_passes(&far, g2);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (checked, last) = watch
        .join()
        .expect("the far reader saw only whole generations");
    assert!(checked >= 1, "checked {checked} far generations");
    assert!(last >= g2 && g3 > g2 && g2 > g1, "{g1} {g2} {g3} {last}");
    drop(snd2);
}

#[test]
fn stopping_either_bridge_past_the_link_timeout_abandons_the_generation_and_the_pair_resumes() {
    cuda_ipc::remote::nixl::probe().expect("NIXL (libnixl_capi.so) must be on LD_LIBRARY_PATH");
    let (near, far) = names("stop");
    let _reap = Reap(vec![near.clone(), far.clone()]);
    let big = [("SIZE", "big".to_string())];
    let (rcv, port) = start_recv(&far, 0);
    let mut w = spawn(
        "writer",
        &[
            ("NEAR", near.clone()),
            ("GENS", "0".into()),
            ("PERIOD_MS", "2".into()),
            ("SIZE", "big".into()),
        ],
    );
    w.expect("ready", ANSWER);
    w.send("go");
    let snd = start_send(&near, port, &big);
    let g1 = far_passes(&far, 0);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let watch = watcher(far.clone(), stop.clone());
    // SIGSTOP for longer than the link timeout (500 ms), then SIGCONT: first the sending bridge,
    // then the receiving one. Each time the session is lost mid-stream and a new one starts.
    let mut g = g1;
    for p in [&snd, &rcv] {
        std::thread::sleep(Duration::from_millis(150));
        signal(p, "-STOP");
        std::thread::sleep(Duration::from_millis(900));
        signal(p, "-CONT");
        g = far_passes(&far, g);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (checked, _) = watch
        .join()
        .expect("the far reader saw only whole generations");
    assert!(checked >= 2 && g > g1, "checked {checked}, {g1} -> {g}");
}

fn signal(p: &Peer, sig: &str) {
    let st = Command::new("kill")
        .args([sig, &p.child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

fn kill9(p: &Peer) {
    let st = Command::new("kill")
        .args(["-9", &p.child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn a_sender_of_another_layout_and_a_wrong_secret_are_refused() {
    cuda_ipc::remote::nixl::probe().expect("NIXL (libnixl_capi.so) must be on LD_LIBRARY_PATH");
    let (near, far) = names("refuse");
    let near2 = format!("{near}-2");
    let _reap = Reap(vec![near.clone(), near2.clone(), far.clone()]);
    let (_rcv, port) = start_recv(&far, 0);
    let mut w = start_writer(&near, 0, 20, &[]);
    w.send("go");
    // A wrong secret: told at once, nothing made.
    let mut bad = spawn(
        "send",
        &[
            ("NEAR", near.clone()),
            ("ADDR", format!("127.0.0.1:{port}")),
            ("SECRET", "another secret".into()),
            ("ONCE", "1".into()),
        ],
    );
    let e = bad.expect("error", ANSWER);
    assert!(e.contains("wrong secret"), "{e}");
    // The right one makes the far set with the near layout.
    let snd = start_send(&near, port, &[]);
    far_small_passes(&far, 1);
    kill9(&snd);
    // Another layout (one more tensor) into the same far set: refused, naming both.
    let mut w2 = start_writer(&near2, 0, 20, &[("EXTRA", "1".into())]);
    w2.send("go");
    let mut other = start_send(&near2, port, &[("ONCE", "1".to_string())]);
    let e = other.expect("error", ANSWER);
    assert!(
        e.contains("layout mismatch") && e.contains("fingerprint"),
        "{e}"
    );
}

fn far_small_passes(far: &str, after: u64) {
    let r = open_far(far);
    let n = specs("small", false).len();
    let h = r.wait_newer(0, Some(ANSWER)).unwrap();
    assert!(check(&h, false, n) >= after);
}

/// An in-place near writer (a trainer updating its weights where they lie) is never kept waiting
/// by an idle sending bridge: the bridge holds a near generation only while it mirrors it, not
/// while it waits for the next (a hold kept meanwhile stalled each in-place update until the
/// bridge's wait timed out, and on a GPU set livelocked it).
#[test]
fn an_idle_sending_bridge_holds_nothing_so_an_in_place_writer_updates_at_once() {
    cuda_ipc::remote::nixl::probe().expect("NIXL (libnixl_capi.so) must be on LD_LIBRARY_PATH");
    let (near, far) = names("inplace");
    let _reap = Reap(vec![near.clone(), far.clone()]);
    let specs = specs("small", false);
    let n = specs.len();
    let mut w = TensorSetWriter::create_host(
        &near,
        &specs,
        &TensorSetOptions::new().mode(GenerationMode::InPlace),
    )
    .expect("near set");
    let write = |w: &mut TensorSetWriter, g: u64, timeout: Duration| -> Result<u64, Error> {
        let mut u = w.begin(Some(timeout))?;
        for i in 0..n {
            let bytes: Vec<u8> = (0..w_len(&specs, i)).map(|k| pattern(g, i, k)).collect();
            u.write_tensor(i, &bytes)?;
        }
        u.commit_with_content(content(g))
    };
    assert_eq!(write(&mut w, 1, ANSWER).unwrap(), 1);
    let (_rcv, port) = start_recv(&far, 0);
    let _snd = start_send(&near, port, &[]);
    let r = open_far(&far);
    let mut far_gen = 0;
    for g in 1..=6u64 {
        // The far set mirrors near generation g (every byte checked).
        loop {
            let h = r
                .wait_newer(far_gen, Some(ANSWER))
                .expect("a far generation");
            far_gen = h.generation();
            if check(&h, false, n) == g {
                break;
            }
        }
        // The bridge is idle now (several of its 100 ms waits pass): the next in-place update
        // begins within 50 ms, since nothing holds the current generation.
        std::thread::sleep(Duration::from_millis(250));
        if g < 6 {
            let got = write(&mut w, g + 1, Duration::from_millis(50));
            assert_eq!(
                got.as_ref().ok(),
                Some(&(g + 1)),
                "generation {}: {got:?} (a hold left on generation {g})",
                g + 1
            );
        }
    }
    drop(r);
    w.close(ANSWER).unwrap();
}

/// A near writer replaced while the link is down (the trainer restarted: generations numbered
/// from 1 again, the same content labels) is mirrored whole: the far set never keeps the old
/// writer's bytes under the new writer's generation.
#[test]
fn a_near_writer_replaced_during_an_outage_is_mirrored_whole_not_taken_for_the_old_one() {
    cuda_ipc::remote::nixl::probe().expect("NIXL (libnixl_capi.so) must be on LD_LIBRARY_PATH");
    let (near, far) = names("replaced");
    let _reap = Reap(vec![near.clone(), far.clone()]);
    let specs = specs("small", false);
    let n = specs.len();
    // Writer `seed`'s generation 1: every tensor its own bytes, the label of generation 1.
    let bytes = |seed: u64, i: usize| -> Vec<u8> {
        (0..w_len(&specs, i)).map(|k| pattern(seed, i, k)).collect()
    };
    let create = |seed: u64| -> TensorSetWriter {
        let mut w = TensorSetWriter::create_host(
            &near,
            &specs,
            &TensorSetOptions::new().mode(GenerationMode::Buffered(2)),
        )
        .expect("near set");
        let mut u = w.begin(Some(ANSWER)).unwrap();
        for i in 0..n {
            u.write_tensor(i, &bytes(seed, i)).unwrap();
        }
        assert_eq!(u.commit_with_content(content(1)).unwrap(), 1);
        w
    };
    // The far set shows writer `seed`'s bytes within `within`.
    let shows = |seed: u64, within: Duration| -> bool {
        let start = Instant::now();
        while start.elapsed() < within {
            if let Ok(r) = TensorSetReader::open_host(&far, &ReaderOptions::new())
                && let Ok(Some(h)) = r.current()
                && (0..n).all(|i| h.read_tensor(i).unwrap() == bytes(seed, i))
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    };
    let a = create(1);
    let (rcv, port) = start_recv(&far, 0);
    let _snd = start_send(&near, port, &[]);
    assert!(
        shows(1, ANSWER),
        "the far set never showed writer A's generation 1"
    );
    // The link goes down (the receiving bridge stopped past the link timeout); the trainer is
    // replaced meanwhile: writer B, generation 1 again, other bytes, the same label.
    signal(&rcv, "-STOP");
    std::thread::sleep(Duration::from_millis(1000));
    a.close(ANSWER).unwrap();
    let b = create(2);
    signal(&rcv, "-CONT");
    assert!(
        shows(2, Duration::from_secs(20)),
        "the far set kept writer A's bytes under writer B's generation 1"
    );
    b.close(ANSWER).unwrap();
}

/// A far reader that holds an older generation for long must not let the receiving bridge's
/// prefill (after a changed-only generation) take the newest buffer and give it back
/// unpublished: the newest far generation would be gone until the next one arrives.
#[test]
fn prefill_never_takes_the_newest_generation_from_far_readers() {
    cuda_ipc::remote::nixl::probe().expect("NIXL (libnixl_capi.so) must be on LD_LIBRARY_PATH");
    let (near, far) = names("prefill-newest");
    let _reap = Reap(vec![near.clone(), far.clone()]);
    let changed = [("CHANGED", "1".to_string())];
    let (mut rcv, port) = start_recv(&far, 0);
    // Generation 1 (whole), then generation 2 (changed-only) a second later; then idle.
    let mut w = start_writer(&near, 2, 1000, &changed);
    let mut snd = start_send(&near, port, &changed);
    let r1 = open_far(&far);
    w.send("go");
    let n = specs("small", false).len();
    // A slow far reader holds far generation 1 (buffer 0 of 2) throughout.
    let h1 = r1.wait_newer(0, Some(ANSWER)).expect("far generation 1");
    assert_eq!(check(&h1, true, n), 1);
    // Near generation 2 is written (and mirrored) meanwhile; the writer then idles.
    w.expect("wrote 2", ANSWER);
    // Another far reader wants the newest generation: near generation 2's.
    let r2 = open_far(&far);
    let h2 = r2
        .wait_newer(0, Some(Duration::from_secs(5)))
        .expect("the newest far generation (near 2) stays available");
    assert_eq!(check(&h2, true, n), 2);
    drop(h2);
    drop(h1);
    w.send("close");
    snd.expect("closed", ANSWER);
    rcv.expect("closed", ANSWER);
    drop((r1, r2));
    rcv.send("done");
}
