//! Tensor sets across hosts with device sets (feature `remote`, a CUDA GPU): the near set's writer
//! and the sending bridge in one process, the receiving bridge in another, far readers in the
//! test process checking every byte of every generation on the GPU (the `check_pattern` kernel
//! against the pattern the generation's content names). Over UCX's own choice (`cuda_ipc`
//! between the processes' GPUs) and forced TCP (`UCX_TLS=tcp,self,cuda_copy`): 50 generations
//! whole, 50 changed-only (digests), and the sending bridge killed mid generation (a new one
//! resumes; the far set never shows a mix). Ignored without a GPU, as the other GPU tests.
#![cfg(feature = "remote")]

mod common;

use common::{Peer, ctx, parent_lines, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::remote::nixl::Place;
use cuda_ipc::remote::report::UcxLog;
use cuda_ipc::remote::tensorset::{recv, send};
use cuda_ipc::remote::wire::Secret;
use cuda_ipc::tensorset::{
    DType, GenerationMode, ReaderOptions, TensorSetError, TensorSetOptions, TensorSetReader,
    TensorSetWriter, TensorSpec, reclaim,
};
use std::net::TcpListener;
use std::process::Command;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
const SECRET: &str = "gpu tensor-set bridge test";

/// 16 tensors, `mib` MiB in all, sizes multiples of 4 bytes and not of 256.
fn specs(mib: usize) -> Vec<TensorSpec> {
    let words = mib * (1 << 20) / 4 / 16;
    (0..16)
        .map(|i| TensorSpec::new(format!("w{i}"), DType::F32, &[(words - 3 * i) as i64]))
        .collect()
}

/// The version of tensor `t` (of `n`) in generation `g`: `g`, or (changed) the last generation
/// that wrote it (generation 1 writes all, `g >= 2` tensor `g % n`).
fn version(changed: bool, n: usize, t: usize, g: u64) -> u64 {
    if !changed || g <= 1 {
        return g;
    }
    (2..=g).rev().find(|x| (*x as usize) % n == t).unwrap_or(1)
}

fn seed(v: u64, t: usize) -> u32 {
    (v as u32).wrapping_mul(1000).wrapping_add(t as u32)
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"))
}

fn secret() -> Secret {
    Secret::new(SECRET.as_bytes().to_vec()).unwrap()
}

const CHILD: &str = "child";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn child() {
    let Some(r) = role() else { return };
    match r.as_str() {
        // The trainer: the near device set and its sending bridge (a thread). One generation per
        // "gen" line; `GENS=0`: one every 2 ms until killed.
        "near" => {
            let c = ctx();
            let k = Kernels::load(&c).unwrap();
            let changed = std::env::var("CHANGED").is_ok();
            let specs = specs(env("MIB").parse().unwrap());
            let n = specs.len();
            let mut w = TensorSetWriter::create(
                &c,
                &env("NEAR"),
                &specs,
                &TensorSetOptions::new().mode(GenerationMode::Buffered(2)),
            )
            .unwrap();
            let mut opts = send::SendOptions::new(&env("NEAR"), &env("ADDR"), secret());
            opts.changed_only = changed;
            opts.lane.write_timeout = T;
            std::thread::spawn(move || {
                let mut totals = send::Totals::default();
                loop {
                    match send::serve(&opts, &AtomicBool::new(false), &mut totals) {
                        Ok(e) => {
                            // UCX's report of the WRITEs' path: `gpu-direct` over cuda_ipc,
                            // `host-staged` over TCP.
                            let path = totals.transport.as_ref().map_or("none", |t| t.path.word());
                            tell(format!(
                                "ended {e:?} {} {} {path}",
                                totals.generations, totals.bytes
                            ));
                            return;
                        }
                        Err(e) => {
                            tell(format!("error {e}"));
                            std::thread::sleep(Duration::from_millis(200));
                        }
                    }
                }
            });
            tell("ready");
            let free = env("GENS") == "0";
            let mut lines = parent_lines();
            let mut g = 0u64;
            loop {
                if !free && lines.next().as_deref() != Some("gen") {
                    break;
                }
                g += 1;
                let mut u = w.begin(Some(T)).unwrap();
                for t in 0..n {
                    let v = version(changed, n, t, g);
                    if v == g {
                        k.fill_pattern(
                            &u.device_tensor(t).unwrap(),
                            seed(v, t),
                            u.stream().unwrap(),
                        )
                        .unwrap();
                    }
                }
                let mut content = [0u8; 32];
                content[..8].copy_from_slice(&g.to_le_bytes());
                if changed && g > 1 {
                    // The tensors not rewritten come from the previous generation's buffer.
                    let keep: Vec<usize> =
                        (0..n).filter(|&t| version(changed, n, t, g) != g).collect();
                    let layout = cuda_ipc::tensorset::Layout::new(&specs).unwrap();
                    let ranges: Vec<(usize, u64, u64)> = keep
                        .iter()
                        .map(|&t| (0, layout.tensors()[t].offset, layout.tensors()[t].bytes))
                        .collect();
                    u.copy_ranges_from_previous(&ranges).unwrap();
                }
                u.commit_with_content(content).unwrap();
                if free {
                    std::thread::sleep(Duration::from_millis(2));
                } else {
                    tell(format!("committed {g}"));
                }
            }
            w.close(T).unwrap();
            std::thread::sleep(Duration::from_secs(2));
        }
        "recv" => {
            let listener = TcpListener::bind(format!("127.0.0.1:{}", env("PORT"))).unwrap();
            tell(format!("port {}", listener.local_addr().unwrap().port()));
            let mut opts = recv::RecvOptions::new(&env("FAR"), secret());
            opts.place = Place::Device(0);
            opts.lane.write_timeout = T;
            let mut totals = recv::Totals::default();
            match recv::serve(&opts, &listener, &AtomicBool::new(false), &mut totals) {
                Ok(recv::Ended::Closed(w)) => {
                    tell(format!(
                        "closed {} prefilled {} abandoned {}",
                        totals.generations, totals.prefilled, totals.abandoned
                    ));
                    let _ = parent_lines().next();
                    drop(w);
                }
                other => panic!("{other:?}"),
            }
        }
        other => panic!("unknown role {other}"),
    }
}

thread_local! {
    static SPAWNED: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    static LOGS: std::cell::RefCell<Vec<UcxLog>> = const { std::cell::RefCell::new(Vec::new()) };
}

struct Reap(Vec<String>);

impl Drop for Reap {
    fn drop(&mut self) {
        for pid in SPAWNED.take() {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        std::thread::sleep(Duration::from_millis(200));
        drop(LOGS.take());
        for s in &self.0 {
            let _ = reclaim::remove_stale(s);
        }
    }
}

fn spawn(tls: &str, role: &str, vars: &[(&str, String)]) -> Peer {
    let log = UcxLog::create().unwrap();
    let mut all: Vec<(String, String)> =
        cuda_ipc::remote::environment("127.0.0.1".parse().unwrap(), Some(&log))
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string_lossy().into_owned()))
            .collect();
    LOGS.with_borrow_mut(|v| v.push(log));
    if tls == "tcp" {
        all.push(("UCX_TLS".into(), "tcp,self,cuda_copy".into()));
    }
    all.extend(vars.iter().map(|(k, v)| (k.to_string(), v.clone())));
    let refs: Vec<(&str, &str)> = all.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let p = Peer::spawn(CHILD, role, &refs);
    SPAWNED.with_borrow_mut(|v| v.push(p.child.id()));
    p
}

/// The transports a test runs over: UCX's own choice and forced TCP, or only the one named by
/// `CUDA_IPC_TEST_TLS` (`default` or `tcp`), to run one of them alone (with UCX's debug log).
fn transports() -> Vec<&'static str> {
    match std::env::var("CUDA_IPC_TEST_TLS").as_deref() {
        Ok("default") => vec!["default"],
        Ok("tcp") => vec!["tcp"],
        _ => vec!["default", "tcp"],
    }
}

fn open_far(far: &str) -> TensorSetReader {
    let start = Instant::now();
    loop {
        match TensorSetReader::open(&ctx(), far, &ReaderOptions::new()) {
            Ok(r) => return r,
            Err(e) if start.elapsed() > T => panic!("far set {far}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Checks held far generation `h` on the GPU; returns (near generation, mismatched words).
fn check_gpu(
    k: &Kernels,
    h: &cuda_ipc::tensorset::Held<'_>,
    changed: bool,
    n: usize,
) -> (u64, u64) {
    let c = ctx();
    let bad = zeroed_counter(&c);
    let g = u64::from_le_bytes(h.content()[..8].try_into().unwrap());
    let s = h.stream().unwrap();
    for t in 0..n {
        k.check_pattern(
            &h.device_tensor(t).unwrap(),
            seed(version(changed, n, t, g), t),
            &bad,
            s,
        )
        .unwrap();
    }
    s.synchronize().unwrap();
    (g, read_u64(&bad))
}

fn fifty(tls: &str, changed: bool) {
    cuda_ipc::remote::nixl::probe().expect("NIXL on LD_LIBRARY_PATH");
    let tag = format!("{tls}-{}-{}", u8::from(changed), std::process::id());
    let (near, far) = (format!("tsg-near-{tag}"), format!("tsg-far-{tag}"));
    let _reap = Reap(vec![near.clone(), far.clone()]);
    let mut rcv = spawn(tls, "recv", &[("FAR", far.clone()), ("PORT", "0".into())]);
    let port = rcv.expect("port", T);
    let mut vars = vec![
        ("NEAR", near.clone()),
        ("ADDR", format!("127.0.0.1:{port}")),
        ("MIB", "64".to_string()),
        ("GENS", "50".to_string()),
    ];
    if changed {
        vars.push(("CHANGED", "1".into()));
    }
    let mut w = spawn(tls, "near", &vars);
    w.expect("ready", T);
    let r = open_far(&far);
    let k = Kernels::load(&ctx()).unwrap();
    let n = r.layout().len();
    let mut far_gen = 0;
    for g in 1..=50u64 {
        w.send("gen");
        w.expect(&format!("committed {g}"), T);
        // Lockstep: every near generation reaches the far set, checked whole on the GPU.
        loop {
            let h = r.wait_newer(far_gen, Some(T)).unwrap();
            far_gen = h.generation();
            let (near_g, bad) = check_gpu(&k, &h, changed, n);
            assert_eq!(
                bad, 0,
                "{tls}: far generation {far_gen} (near {near_g}): {bad} words differ"
            );
            if near_g == g {
                break;
            }
        }
    }
    w.send("end");
    let said = w.expect("ended", T);
    assert!(said.starts_with("Closed"), "{said}");
    // The transport report judged the WRITEs themselves (UCX's log flushed before it is read).
    let path = if tls == "tcp" {
        "host-staged"
    } else {
        "gpu-direct"
    };
    assert!(said.ends_with(path), "{tls}: the WRITEs' path: {said}");
    let said = rcv.expect("closed", T);
    assert!(
        said.ends_with(" abandoned 0"),
        "no generation abandoned: {said}"
    );
    if changed {
        // Lockstep: the far reader lets each generation go before the next is written, so the
        // receiving bridge brings the next buffer up to date in between (every far generation
        // was checked whole on the GPU above).
        let prefilled: u64 = said
            .split(' ')
            .nth(2)
            .and_then(|x| x.parse().ok())
            .unwrap_or(0);
        assert!(prefilled >= 10, "{tls}: far buffers prefilled: {said}");
    }
    drop(r);
    rcv.send("done");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn device_sets_mirror_fifty_generations_checked_on_the_gpu_over_cuda_ipc() {
    fifty("default", false);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn device_sets_mirror_fifty_generations_checked_on_the_gpu_over_forced_tcp() {
    fifty("tcp", false);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn device_sets_mirror_changed_tensors_only_checked_on_the_gpu_over_both_transports() {
    fifty("default", true);
    fifty("tcp", true);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn killing_the_sending_bridge_mid_generation_leaves_whole_generations_on_the_gpu() {
    cuda_ipc::remote::nixl::probe().expect("NIXL on LD_LIBRARY_PATH");
    for tls in transports() {
        let Streaming {
            far,
            port,
            vars,
            mut rcv,
            w,
            mut r,
            k,
            n,
            first: (g1, f1),
            _reap,
        } = streaming(tls, "kill");
        // Mid generation: 1 GiB generations back to back.
        std::thread::sleep(Duration::from_millis(300));
        Command::new("kill")
            .args(["-9", &w.child.id().to_string()])
            .status()
            .unwrap();
        // The last whole generation stays readable, whole.
        if let Ok(Some(h)) = r.current() {
            assert_eq!(check_gpu(&k, &h, false, n).1, 0, "{tls}: after the kill");
        }
        // Over UCX's TCP transport, UCX 1.23 aborts the receiving bridge's process once the
        // sender is gone mid-WRITE (a software PUT's completion, sent back to the dead sender,
        // fails, and UCX treats that as fatal: docs/remote.md, "When a bridge dies"). What a
        // supervisor does, the test does: a new receiving bridge on the same port; far readers
        // get `WriterGone`, keep what they hold, and open the set it makes again.
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut aborted = false;
        while Instant::now() < deadline {
            if rcv.child.try_wait().unwrap().is_some() {
                aborted = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            !aborted || tls == "tcp",
            "{tls}: the receiving bridge died with the sending one"
        );
        if aborted {
            eprintln!("{tls}: the receiving bridge was aborted by UCX; a new one is started");
            rcv = spawn(
                tls,
                "recv",
                &[("FAR", far.clone()), ("PORT", port.to_string())],
            );
            assert_eq!(rcv.expect("port", T), port);
        }
        // A new trainer process (a new writer and bridge) resumes into the far set.
        let mut w2 = spawn(tls, "near", &vars);
        w2.expect("ready", T);
        let h = if aborted {
            match r.wait_newer(f1, Some(T)) {
                Err(Error::TensorSet(TensorSetError::WriterGone { .. })) => {}
                other => panic!("{tls}: after the receiving bridge's death: {other:?}"),
            }
            drop(r);
            r = open_far(&far);
            r.wait_newer(0, Some(T)).unwrap()
        } else {
            r.wait_newer(f1, Some(T)).unwrap()
        };
        let (g2, bad) = check_gpu(&k, &h, false, n);
        assert_eq!(bad, 0, "{tls}: resumed generation");
        assert!(aborted || h.generation() > f1, "{tls}: {g1} then {g2}");
        drop(h);
        drop(r);
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn stopping_then_killing_the_receiving_bridge_leaves_whole_generations_and_the_trainer_goes_on() {
    cuda_ipc::remote::nixl::probe().expect("NIXL on LD_LIBRARY_PATH");
    for tls in transports() {
        let Streaming {
            far,
            port,
            mut rcv,
            mut w,
            mut r,
            k,
            n,
            first: (_, f1),
            _reap,
            ..
        } = streaming(tls, "rkill");
        // Stopped past the link timeout (500 ms) mid generation, then continued: the session is
        // lost on both sides, the generation under way is never published, and the trainer's
        // bridge (a thread of the trainer, retrying) connects again.
        std::thread::sleep(Duration::from_millis(300));
        signal(&rcv, "-STOP");
        std::thread::sleep(Duration::from_millis(1500));
        if let Ok(Some(h)) = r.current() {
            assert_eq!(check_gpu(&k, &h, false, n).1, 0, "{tls}: while stopped");
        }
        signal(&rcv, "-CONT");
        let h = r.wait_newer(f1, Some(T)).unwrap();
        assert_eq!(check_gpu(&k, &h, false, n).1, 0, "{tls}: after the stop");
        let f2 = h.generation();
        drop(h);
        // Killed mid generation: far readers learn it (`WriterGone`), the trainer goes on, and a
        // new receiving bridge on the same port makes the far set again, which readers reopen.
        std::thread::sleep(Duration::from_millis(300));
        signal(&rcv, "-KILL");
        match r.wait_newer(f2, Some(T)) {
            Err(Error::TensorSet(TensorSetError::WriterGone { .. })) => {}
            Ok(h) => {
                // Published just before the kill: whole, and the next wait says it.
                assert_eq!(check_gpu(&k, &h, false, n).1, 0, "{tls}: the last one");
                let g = h.generation();
                drop(h);
                assert!(matches!(
                    r.wait_newer(g, Some(T)),
                    Err(Error::TensorSet(TensorSetError::WriterGone { .. }))
                ));
            }
            Err(e) => panic!("{tls}: after the receiving bridge's kill: {e}"),
        }
        drop(r);
        assert!(
            w.child.try_wait().unwrap().is_none(),
            "{tls}: the trainer died with the far bridge"
        );
        // Its port is free once it has exited (a killed process with a CUDA context takes a
        // while to go), as a supervisor's restart finds it.
        let _ = rcv.child.wait();
        rcv = spawn(
            tls,
            "recv",
            &[("FAR", far.clone()), ("PORT", port.to_string())],
        );
        assert_eq!(rcv.expect("port", T), port);
        r = open_far(&far);
        let h = r.wait_newer(0, Some(T)).unwrap();
        assert_eq!(check_gpu(&k, &h, false, n).1, 0, "{tls}: after the restart");
        drop(h);
        drop(r);
        assert!(
            w.child.try_wait().unwrap().is_none(),
            "{tls}: the trainer died"
        );
    }
}

/// A receiving bridge, a free-running trainer (1 GiB generations back to back; its sending
/// bridge a thread of it) and a far reader that has checked the first far generation on the GPU.
struct Streaming {
    far: String,
    port: String,
    /// The trainer's environment, for a new trainer.
    vars: Vec<(&'static str, String)>,
    rcv: Peer,
    w: Peer,
    r: TensorSetReader,
    k: Kernels,
    n: usize,
    /// The first far generation checked: (near generation, far generation).
    first: (u64, u64),
    _reap: Reap,
}

fn streaming(tls: &str, what: &str) -> Streaming {
    let tag = format!("{what}-{tls}-{}", std::process::id());
    let (near, far) = (format!("tsg-near-{tag}"), format!("tsg-far-{tag}"));
    let _reap = Reap(vec![near.clone(), far.clone()]);
    let mut rcv = spawn(tls, "recv", &[("FAR", far.clone()), ("PORT", "0".into())]);
    let port = rcv.expect("port", T);
    let vars = vec![
        ("NEAR", near),
        ("ADDR", format!("127.0.0.1:{port}")),
        ("MIB", "1024".to_string()),
        ("GENS", "0".to_string()),
    ];
    let mut w = spawn(tls, "near", &vars);
    w.expect("ready", T);
    let r = open_far(&far);
    let k = Kernels::load(&ctx()).unwrap();
    let n = r.layout().len();
    let h = r.wait_newer(0, Some(T)).unwrap();
    let (g, bad) = check_gpu(&k, &h, false, n);
    assert_eq!(bad, 0, "{tls}: the first far generation");
    let first = (g, h.generation());
    drop(h);
    Streaming {
        far,
        port,
        vars,
        rcv,
        w,
        r,
        k,
        n,
        first,
        _reap,
    }
}

fn signal(p: &Peer, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &p.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig}");
}
