//! Tensor sets across hosts, measured (`--features remote`; binary
//! target/release/examples/tensorset_remote): the tensor-set bridges mirroring a set of the
//! Llama-3-8B shape (291 bf16 tensors, 15.0 GiB) between two processes of this machine, beside
//! raw NIXL WRITEs of the same bytes (the set's own memory as the source, the same 64 MiB pieces,
//! 8 in flight, one notification each) into a far buffer of the same kind, in the same run. For
//! each transport (`--tls default`: UCX's choice, `cuda_ipc` between GPUs of a host; `--tls tcp`:
//! `UCX_TLS=tcp,self,cuda_copy`; both by default) and each of `--runs` runs: the raw figure, one
//! whole generations mirrored (after one unmeasured into the far set's other buffer, as raw
//! NIXL's figure is its second round), an empty generation (the fixed cost of a generation: the
//! control round trips, the far side's `begin` and publication; the second of two, since the
//! first fills its buffer with the whole generation before it), and generations with 1 % of the
//! bytes changed (tensors at random, told by the writer, `send::serve_with_changes`; with
//! `--digests`, found by the sending bridge itself from the tensors' content digests,
//! `SendOptions::changed_only`, computed on the GPU for device sets; the near set is then
//! written in place).
//! Also the time of the digests of the whole set (`Held::tensor_digests`, three times, median).
//! A generation is timed from its near commit, once the writer's own writes are done (its
//! stream drained before the commit), until a far reader has it usable: woken, and its stream
//! past the generation's ready word (on a GPU set). Prints a table of medians and ratios, and one JSON
//! line.
//!
//! ```text
//! tensorset_remote [--memory device|host] [--device 0] [--runs 3] [--tls both|default|tcp]
//!                  [--changed-gens 3] [--whole 2] [--quick] [--digests]
//! ```
//! Run each run in a process of its own (`--runs 1`, three times) where the far side is on the
//! same host: UCX's `cuda_ipc` transport keeps the far processes' memory it wrote to mapped for
//! the life of the writing process (its remote cache is process-wide), so the far buffers of
//! earlier runs stay allocated and three 15 GiB runs do not fit one H200.
//! `--quick`: a 256 MiB set of 64 tensors (with `--memory host`, no GPU is needed). Needs NIXL's
//! libraries on LD_LIBRARY_PATH.

use cuda_ipc::driver::{Device, DeviceMemory as _};
use cuda_ipc::remote::nixl::{Lane, Place, Region, Target};
use cuda_ipc::remote::report::UcxLog;
use cuda_ipc::remote::tensorset::{recv, send};
use cuda_ipc::remote::wire::Secret;
use cuda_ipc::tensorset::{
    DType, GenerationMode, Layout, ReaderOptions, TensorSetOptions, TensorSetReader,
    TensorSetWriter, TensorSpec,
};
use std::collections::HashMap;
use std::error::Error;
use std::io::{BufRead as _, Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn Error>>;

const ROLE: &str = "TSR_ROLE";
const CHUNK: u64 = 64 << 20;
const IN_FLIGHT: usize = 8;
const STEP: Duration = Duration::from_secs(300);

#[derive(Clone, Debug)]
struct Opts {
    device: bool,
    ordinal: u32,
    runs: usize,
    tls: Vec<String>,
    changed_gens: usize,
    quick: bool,
    digests: bool,
    /// Whole generations measured per run (after one unmeasured into the far set's other buffer).
    whole: usize,
}

fn opts() -> Res<Opts> {
    let mut o = Opts {
        device: true,
        ordinal: 0,
        runs: 3,
        tls: vec!["default".into(), "tcp".into()],
        changed_gens: 3,
        quick: false,
        digests: false,
        whole: 2,
    };
    let mut a = std::env::args().skip(1);
    while let Some(k) = a.next() {
        let mut v = || a.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--memory" => o.device = v()? == "device",
            "--device" => o.ordinal = v()?.parse()?,
            "--runs" => o.runs = v()?.parse()?,
            "--changed-gens" => o.changed_gens = v()?.parse::<usize>()?.max(1),
            "--tls" => {
                o.tls = match v()?.as_str() {
                    "both" => vec!["default".into(), "tcp".into()],
                    t @ ("default" | "tcp") => vec![t.to_string()],
                    t => return Err(format!("--tls {t}: both, default or tcp").into()),
                }
            }
            "--quick" => o.quick = true,
            "--digests" => o.digests = true,
            "--whole" => o.whole = v()?.parse::<usize>()?.max(1),
            x => return Err(format!("unknown flag {x}").into()),
        }
    }
    Ok(o)
}

/// Llama-3-8B's 291 tensors (bf16), as `floor/tensorset_floor.rs` has them; `quick`: 64 tensors
/// of 4 MiB.
fn specs(quick: bool) -> Vec<TensorSpec> {
    let shapes: Vec<Vec<i64>> = if quick {
        vec![vec![1024, 2048]; 64]
    } else {
        let mut v = vec![vec![128_256, 4096]];
        for _ in 0..32 {
            v.extend([
                vec![4096, 4096],
                vec![1024, 4096],
                vec![1024, 4096],
                vec![4096, 4096],
                vec![14_336, 4096],
                vec![14_336, 4096],
                vec![4096, 14_336],
                vec![4096],
                vec![4096],
            ]);
        }
        v.push(vec![4096]);
        v.push(vec![128_256, 4096]);
        v
    };
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| TensorSpec::new(format!("t{i}"), DType::BF16, s))
        .collect()
}

fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("tensorset_remote: {e}");
        std::process::exit(1);
    }
}

fn run() -> Res<()> {
    let o = opts()?;
    match std::env::var(ROLE).as_deref() {
        Ok("near") => near(&o),
        Ok("far") => far(&o),
        Ok("raw") => raw_target(&o),
        _ => top(&o),
    }
}

/// Starts this binary in `role` with `env`, its stdout piped.
fn child(
    role: &str,
    env: &[(String, String)],
) -> Res<(
    std::process::Child,
    std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
)> {
    let mut c = std::process::Command::new(std::env::current_exe()?)
        .args(std::env::args_os().skip(1))
        .envs(env.iter().cloned())
        .env(ROLE, role)
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let out = std::io::BufReader::new(c.stdout.take().ok_or("no stdout")?).lines();
    Ok((c, out))
}

fn next_line(l: &mut std::io::Lines<std::io::BufReader<std::process::ChildStdout>>) -> Res<String> {
    Ok(l.next().ok_or("a child ended early")??)
}

/// One near process per transport (UCX reads its environment once per process), then the table.
fn top(o: &Opts) -> Res<()> {
    let layout = Layout::new(&specs(o.quick))?;
    let bytes = layout.bytes_per_buffer();
    println!(
        "tensor-set mirroring: {} tensors, {:.2} GiB per generation, {} memory, {} runs",
        layout.len(),
        bytes as f64 / (1u64 << 30) as f64,
        if o.device { "device" } else { "host" },
        o.runs
    );
    println!(
        "changed tensors {}",
        if o.digests {
            "found by the sending bridge's content digests"
        } else {
            "told by the writer"
        }
    );
    println!(
        "{:<8} {:>10} {:>10} {:>7} {:>10} {:>12} {:>12} {:>12} {:>6}",
        "tls", "raw GB/s", "set GB/s", "ratio", "fixed ms", "1% bytes", "1% ms", "1% / bound", "ok"
    );
    let mut digest_ms = Vec::new();
    for tls in &o.tls {
        let log = UcxLog::create()?;
        let mut env: Vec<(String, String)> =
            cuda_ipc::remote::environment("127.0.0.1".parse()?, Some(&log))
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string_lossy().into_owned()))
                .collect();
        if tls == "tcp" {
            env.push(("UCX_TLS".into(), "tcp,self,cuda_copy".into()));
        }
        let (mut c, mut out) = child("near", &env)?;
        let line = next_line(&mut out)?;
        c.wait()?;
        let v: serde_json::Value = serde_json::from_str(&line)?;
        let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        // Each 1 % generation against its own bound: 1.5 × its bytes at raw NIXL's bandwidth,
        // plus the fixed cost (an empty generation's time); the median of the ratios.
        let fixed_ms = f("fixed_ms");
        let mut ratios: Vec<f64> = v["changed_pairs"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
                    .map(|(b, ms)| ms / (1.5 * b / (f("raw_gbps") * 1e9) * 1e3 + fixed_ms))
                    .collect()
            })
            .unwrap_or_default();
        let over = median(&mut ratios);
        println!(
            "{:<8} {:>10.2} {:>10.2} {:>6.1}% {:>10.2} {:>12.0} {:>12.2} {:>12.2} {:>6}",
            tls,
            f("raw_gbps"),
            f("set_gbps"),
            100.0 * f("set_gbps") / f("raw_gbps"),
            fixed_ms,
            f("changed_bytes"),
            f("changed_ms"),
            over,
            if f("set_gbps") >= 0.9 * f("raw_gbps") && over <= 1.0 {
                "yes"
            } else {
                "NO"
            }
        );
        println!(
            "{}",
            serde_json::json!({"tls": tls, "figures": v, "transport": v["transport"]})
        );
        digest_ms.push(f("digest_ms"));
        drop(log);
    }
    println!(
        "content digests of the whole set (one kernel on a device set): {:.2} ms",
        median(&mut digest_ms)
    );
    Ok(())
}

fn secret() -> Res<Secret> {
    Ok(Secret::new(b"tensorset_remote benchmark".to_vec())?)
}

/// The far side: the receiving bridge, and a reader that says when each generation arrived
/// (`got NEAR_GEN NOW_NS`).
fn far(o: &Opts) -> Res<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    let name = std::env::var("FAR")?;
    let mut ro = recv::RecvOptions::new(&name, secret()?);
    if o.device {
        ro.place = Place::Device(o.ordinal);
    }
    ro.lane.write_timeout = STEP;
    let n2 = name.clone();
    let device = o.device;
    std::thread::spawn(move || {
        let start = Instant::now();
        let r = loop {
            let opened = if device {
                TensorSetReader::open_auto(&n2, &ReaderOptions::new())
            } else {
                TensorSetReader::open_host(&n2, &ReaderOptions::new())
            };
            match opened {
                Ok(r) => break r,
                Err(_) if start.elapsed() < STEP => std::thread::sleep(Duration::from_millis(2)),
                Err(e) => panic!("far reader: {e}"),
            }
        };
        let mut g = 0;
        while let Ok(h) = r.wait_newer(g, Some(STEP)) {
            // Usable on the GPU: the reader's stream has passed the generation's ready word
            // (the far writer's fill of the tensors its buffer lacked is done).
            if let Ok(s) = h.stream() {
                let _ = s.synchronize();
            }
            let t = now_ns();
            g = h.generation();
            let near = u64::from_le_bytes(h.content()[..8].try_into().unwrap_or_default());
            println!("got {near} {t}");
            let _ = std::io::stdout().flush();
        }
    });
    let mut totals = recv::Totals::default();
    if let recv::Ended::Closed(w) =
        recv::serve(&ro, &listener, &AtomicBool::new(false), &mut totals)?
    {
        std::thread::sleep(Duration::from_millis(200));
        let _ = w.close(Duration::from_secs(5));
    }
    Ok(())
}

/// Memory of `len` bytes for the raw target: device (`cuMemAlloc`, as the far set's legacy
/// memory) or host.
enum Mem {
    Device(cuda_ipc::driver::DeviceBuffer),
    Host(Vec<u8>),
}

impl Mem {
    fn region(&mut self, ordinal: u32) -> Region {
        match self {
            Mem::Device(b) => Region {
                addr: b.device_ptr(),
                len: b.len(),
                place: Place::Device(ordinal),
            },
            Mem::Host(v) => Region {
                addr: v.as_mut_ptr() as u64,
                len: v.len(),
                place: Place::Host,
            },
        }
    }
}

/// The raw target: a far buffer of the set's bytes, registered; counts `n` notifications, then
/// says so over the socket.
fn raw_target(o: &Opts) -> Res<()> {
    let bytes = Layout::new(&specs(o.quick))?.bytes_per_buffer() as usize;
    let ctx = if o.device {
        Some(Device::get(o.ordinal as usize)?.primary_context()?)
    } else {
        None
    };
    let _cur = ctx.as_ref().map(|c| c.enter()).transpose()?;
    let mut mem = match &ctx {
        Some(c) => Mem::Device(cuda_ipc::driver::DeviceBuffer::new(c, bytes)?),
        None => Mem::Host(vec![0u8; bytes]),
    };
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    let (mut s, _) = listener.accept()?;
    let mut lane = Lane::new(&format!("tsr-raw-target-{}", std::process::id()))?;
    let region = mem.region(o.ordinal);
    // SAFETY: `mem` lives until the end of this function, after the lane (declared later, dropped
    // first); only NIXL writes it.
    unsafe { lane.register(0, region)? };
    let md = lane.local_md()?;
    s.write_all(&(md.len() as u64).to_le_bytes())?;
    s.write_all(&md)?;
    s.write_all(&region.addr.to_le_bytes())?;
    // UCX's TCP transport moves data only while both ends poll: the notifications are taken
    // throughout, the socket read without blocking.
    s.set_nonblocking(true)?;
    let (mut got, mut want, mut buf) = (0u64, None::<u64>, Vec::new());
    loop {
        got += lane.take_notifications()?.len() as u64;
        let mut b = [0u8; 8];
        match s.read(&mut b) {
            Ok(0) => return Ok(()),
            Ok(k) => buf.extend_from_slice(&b[..k]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return Ok(()),
        }
        if want.is_none() && buf.len() >= 8 {
            want = Some(u64::from_le_bytes(buf[..8].try_into()?));
            buf.drain(..8);
        }
        if let Some(n) = want
            && got >= n
        {
            got -= n;
            want = None;
            s.set_nonblocking(false)?;
            s.write_all(&[1])?;
            s.set_nonblocking(true)?;
        }
    }
}

/// The near side of one transport: the set, the raw floor, the bridges; prints one JSON line.
fn near(o: &Opts) -> Res<()> {
    let specs = specs(o.quick);
    let name = format!("tsr-near-{}", std::process::id());
    let far_name = format!("tsr-far-{}", std::process::id());
    let ctx = if o.device {
        Some(Device::get(o.ordinal as usize)?.primary_context()?)
    } else {
        None
    };
    // With `--digests` the near set is written in place, as a trainer's optimizer does, so that
    // the tensors a generation does not write keep their bytes and the digests find only the
    // ones it wrote (a double-buffered update starts from the bytes of two generations ago).
    let topts = TensorSetOptions::new().mode(if o.digests {
        GenerationMode::InPlace
    } else {
        GenerationMode::Buffered(2)
    });
    let mut w = match &ctx {
        Some(c) => TensorSetWriter::create(c, &name, &specs, &topts)?,
        None => TensorSetWriter::create_host(&name, &specs, &topts)?,
    };
    let layout = w.layout().clone();
    let bytes = layout.bytes_per_buffer();
    // Generation 1: every tensor written once.
    // Returns the generation and when it was committed (ns): the clock starts there, once the
    // writer's own update of its bytes is done (its stream drained), as mirroring starts.
    let fill = |w: &mut TensorSetWriter, g: u64, which: &[usize]| -> Res<(u64, u64)> {
        let mut u = w.begin(Some(STEP))?;
        for &i in which {
            match u.device_tensor(i) {
                Ok(t) => t.memset_u32_async(g as u32 * 0x0101_0101, u.stream()?)?,
                Err(_) => {
                    let len = layout.tensors()[i].bytes as usize;
                    u.write_tensor(i, &vec![g as u8; len])?;
                }
            }
        }
        let mut c = [0u8; 32];
        c[..8].copy_from_slice(&g.to_le_bytes());
        if let Ok(s) = u.stream() {
            s.synchronize()?;
        }
        let t0 = now_ns();
        Ok((u.commit_with_content(c)?, t0))
    };
    let all: Vec<usize> = (0..layout.len()).collect();
    let mut g = fill(&mut w, 1, &all)?.0;
    // The digests of the whole set, as the sending bridge's changed-only mode computes them.
    let digest_ms = {
        let r = if o.device {
            TensorSetReader::open_auto(&name, &ReaderOptions::new())?
        } else {
            TensorSetReader::open_host(&name, &ReaderOptions::new())?
        };
        let h = r.current()?.ok_or("no generation")?;
        let mut v = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            h.tensor_digests()?;
            v.push(t.elapsed().as_secs_f64() * 1e3);
        }
        median(&mut v)
    };
    let _cur = ctx.as_ref().map(|c| c.enter()).transpose()?;
    let (mut raw, mut full, mut fixed, mut changed) = (vec![], vec![], vec![], vec![]);
    let mut changed_bytes = 0u64;
    // (changed bytes, ms) of every 1 % generation: each is judged against its own bound.
    let mut changed_pairs: Vec<(u64, f64)> = Vec::new();
    let mut transport = String::from("unknown");
    let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ u64::from(std::process::id());
    // Progress on stderr, seconds since the set was written: where a bounded run stops shows.
    let start = Instant::now();
    let say = |what: &str| {
        eprintln!(
            "tensorset_remote: {:8.2} s {what}",
            start.elapsed().as_secs_f64()
        )
    };
    for run in 0..o.runs {
        say(&format!("run {run}: raw NIXL"));
        raw.push(raw_floor(o, &w, bytes)?);
        say(&format!(
            "run {run}: raw {:.2} GB/s; bridges",
            raw[raw.len() - 1]
        ));
        // The bridges of this run.
        let env: Vec<(String, String)> = vec![("FAR".into(), far_name.clone())];
        let (mut fc, mut fout) = child("far", &env)?;
        let port = next_line(&mut fout)?
            .strip_prefix("port ")
            .ok_or("no port")?
            .to_string();
        let told: Arc<Mutex<HashMap<u64, Option<Vec<usize>>>>> = Arc::default();
        let told2 = told.clone();
        let mut so = send::SendOptions::new(&name, &format!("127.0.0.1:{port}"), secret()?);
        so.lane.write_timeout = STEP;
        so.changed_only = o.digests;
        // With `--digests` the bridge is told nothing: its digests decide.
        let told_by_writer = !o.digests;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let bridge = std::thread::spawn(move || -> Result<send::Totals, String> {
            let mut totals = send::Totals::default();
            let mut changes = |base: u64, near: u64| -> Option<Vec<usize>> {
                let t = told2.lock().ok()?;
                let mut v = Vec::new();
                for x in base + 1..=near {
                    v.extend(t.get(&x)?.clone()?);
                }
                v.sort_unstable();
                v.dedup();
                Some(v)
            };
            let changes: Option<send::Changes<'_>> = told_by_writer.then_some(&mut changes);
            send::serve_with_changes(&so, &stop2, &mut totals, changes)
                .map_err(|e| e.to_string())?;
            Ok(totals)
        });
        // Waits for the far reader's word that near generation `g` arrived; returns ms since `t0`.
        let mut arrived = |g: u64, t0: u64| -> Res<f64> {
            loop {
                let l = next_line(&mut fout)?;
                let mut it = l.split(' ').skip(1);
                let (Some(a), Some(b)) = (it.next(), it.next()) else {
                    continue;
                };
                if a.parse::<u64>()? == g {
                    return Ok((b.parse::<u64>()?.saturating_sub(t0)) as f64 / 1e6);
                }
            }
        };
        // The newest generation, whole (the session's first: connection and registration are
        // before it, the transport probe of the first WRITE in it).
        arrived(g, 0)?;
        say(&format!("run {run}: first generation mirrored"));
        // Whole generations: the first into each far buffer (both are written once, as a
        // running bridge has: the WRITEs' requests made, UCX's mappings of the far buffer
        // opened) unmeasured, as raw NIXL's first round is; then WHOLE measured.
        for k in 0..1 + o.whole {
            told.lock().map_err(|_| "lock")?.insert(g + 1, None);
            // (Found by digests, a whole generation is one whose every tensor changed.)
            let t0;
            (g, t0) = fill(&mut w, g + 1, if o.digests { &all } else { &[0] })?;
            let ms = arrived(g, t0)?;
            if k > 0 {
                full.push(bytes as f64 / (ms / 1e3) / 1e9);
            }
            say(&format!(
                "run {run}: whole generation {:.2} GB/s{}",
                bytes as f64 / (ms / 1e3) / 1e9,
                if k == 0 {
                    " (warm-up, not counted)"
                } else {
                    ""
                }
            ));
        }
        // Empty generations: the fixed cost, the second one measured (the first fills its
        // buffer with the whole generation before it, which that buffer lacks).
        for k in 0..2 {
            told.lock().map_err(|_| "lock")?.insert(g + 1, Some(vec![]));
            let t0;
            (g, t0) = fill(&mut w, g + 1, &[])?;
            let ms = arrived(g, t0)?;
            if k == 1 {
                fixed.push(ms);
            }
            say(&format!(
                "run {run}: empty generation {ms:.2} ms{}",
                if k == 0 {
                    " (fills its buffer, not counted)"
                } else {
                    ""
                }
            ));
        }
        // 1 % of the bytes, tensors at random.
        for _ in 0..o.changed_gens {
            let mut pick = Vec::new();
            let mut sum = 0u64;
            while sum < bytes / 100 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let i = (rng % layout.len() as u64) as usize;
                if !pick.contains(&i) {
                    pick.push(i);
                    sum += layout.tensors()[i].bytes;
                }
            }
            changed_bytes = sum;
            told.lock()
                .map_err(|_| "lock")?
                .insert(g + 1, Some(pick.clone()));
            let t0;
            (g, t0) = fill(&mut w, g + 1, &pick)?;
            changed.push(arrived(g, t0)?);
            changed_pairs.push((sum, changed[changed.len() - 1]));
            say(&format!(
                "run {run}: {sum} changed bytes in {:.2} ms",
                changed[changed.len() - 1]
            ));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let t = bridge.join().map_err(|_| "the bridge panicked")??;
        if let Some(t) = t.transport {
            transport = format!("{} ({})", t.summary(), t.path.word());
        }
        let _ = fc.kill();
        let _ = fc.wait();
        let _ = cuda_ipc::tensorset::reclaim::remove_stale(&far_name);
    }
    println!(
        "{}",
        serde_json::json!({
            "bytes": bytes,
            "raw_gbps": median(&mut raw),
            "set_gbps": median(&mut full),
            "fixed_ms": median(&mut fixed),
            "changed_bytes": changed_bytes,
            "changed_ms": median(&mut changed),
            "transport": transport,
            "digest_ms": digest_ms,
            "raw_runs": raw, "set_runs": full, "fixed_runs": fixed, "changed_runs": changed,
            "changed_pairs": changed_pairs,
        })
    );
    drop(w);
    Ok(())
}

/// Raw NIXL: the set's buffer 0 WRITTEN whole into a far buffer of a fresh target process, in
/// the bridge's pieces and depth, one notification each; GB/s from the first post to the target's
/// word that every notification arrived. The second of two rounds (the first connects).
fn raw_floor(o: &Opts, w: &TensorSetWriter, bytes: u64) -> Res<f64> {
    let (mut c, mut out) = child("raw", &[])?;
    let port = next_line(&mut out)?
        .strip_prefix("port ")
        .ok_or("no port")?
        .to_string();
    let mut s = TcpStream::connect(format!("127.0.0.1:{port}"))?;
    let mut n = [0u8; 8];
    s.read_exact(&mut n)?;
    let mut md = vec![0u8; u64::from_le_bytes(n) as usize];
    s.read_exact(&mut md)?;
    s.read_exact(&mut n)?;
    let far_addr = u64::from_le_bytes(n);
    let mut host = Vec::new();
    let (src, place) = match w.device_ptr(0, 0) {
        Ok(p) => (p, Place::Device(o.ordinal)),
        Err(_) => {
            host = vec![1u8; bytes as usize];
            (host.as_mut_ptr() as u64, Place::Host)
        }
    };
    let mut lane = Lane::new(&format!("tsr-raw-{}", std::process::id()))?;
    // SAFETY: the set's buffer 0 (tensor 0 sits at its first byte) or `host`, alive past the lane;
    // NIXL only reads it, and no generation is written meanwhile.
    unsafe {
        lane.register(
            0,
            Region {
                addr: src,
                len: bytes as usize,
                place,
            },
        )?
    };
    let remote = lane.load_remote(&md)?;
    let far_place = if o.device {
        Place::Device(o.ordinal)
    } else {
        Place::Host
    };
    let pieces: Vec<(u64, u64)> = (0..bytes.div_ceil(CHUNK))
        .map(|i| (i * CHUNK, CHUNK.min(bytes - i * CHUNK)))
        .collect();
    let mut best = 0.0;
    for _round in 0..2 {
        let start = Instant::now();
        let mut flight = std::collections::VecDeque::new();
        for (i, &(off, len)) in pieces.iter().enumerate() {
            while flight.len() >= IN_FLIGHT {
                let mut wr = flight.pop_front().ok_or("empty")?;
                while !lane.poll(&mut wr, STEP)? {}
            }
            let t = Target {
                addr: far_addr + off,
                len: bytes - off,
                place: far_place,
            };
            flight.push_back(lane.post_range(
                0,
                off,
                len as usize,
                t,
                &remote,
                format!("raw {i}").as_bytes(),
            )?);
        }
        while let Some(mut wr) = flight.pop_front() {
            while !lane.poll(&mut wr, STEP)? {}
        }
        s.write_all(&(pieces.len() as u64).to_le_bytes())?;
        let mut ok = [0u8; 1];
        s.read_exact(&mut ok)?;
        best = bytes as f64 / start.elapsed().as_secs_f64() / 1e9;
    }
    drop(s);
    drop(lane);
    drop(host);
    let _ = c.wait();
    Ok(best)
}
