//! The remote lane (`--features remote`): a producer's channel carried by the two bridges over
//! NVIDIA NIXL to a channel that a consumer process attaches to with the ordinary
//! `Consumer::attach`. Here all of it runs on one machine (the bridges talk over loopback TCP, UCX
//! picks its transport: `UCX_TLS=tcp,cuda_copy` forces the network path); across hosts run
//! `cuda-ipc bridge recv` on the consumers' host and `cuda-ipc bridge send` on the producer's.
//!
//! Every frame is filled with a pattern (a kernel on device memory, the CPU on host memory) and
//! checked at the far end (a kernel, or the CPU); prints frames/s, the hand-off latency (publish on
//! the near host → frame received on the far one) and the transport UCX reported. `--raw` runs the
//! floor instead: a bare NIXL WRITE + notification loop of the same sizes between two processes
//! (stamp, fill, WRITE, wait for completion; no channel, no credits).
//!
//! ```text
//! cargo run --release -p cuda-ipc-examples --features remote --example remote_pipeline -- \
//!     [--frames 1000] [--bytes N | --4k] [--memory host|device] [--delivery every|latest]
//!     [--pool auto|legacy|vmm|pool] [--pace-us 0] [--spin-us N] [--credits N] [--in-process]
//!     [--no-check] [--no-fill] [--raw]
//! ```
//! `--pool` picks the near pool's device memory (the far one is the default, legacy where it can
//! be): which kinds UCX registers for a GPU-direct path shows in the transport it reports.
//! `--pace-us N` publishes (or, with `--raw`, WRITEs) one frame every N µs: the hand-off latency
//! without frames queueing behind each other; 0 runs as fast as the lane goes (frames/s).
//! `--spin-us N` is how long the bridges and the far consumer poll without a pause after a frame
//! (`LaneOptions::spin`, the consumer's `WaitStrategy::SpinThenBlock`); by default the lane's
//! default (2 ms) or twice the pace, whichever is longer, so that a paced lane stays as hot
//! between frames as the raw loop, whose target polls without a pause throughout.
//! `--no-check` leaves the far frames unchecked (received and released untouched, as the raw
//! loop's target leaves its buffer): the benchmark's like-for-like lane; `--credits N` sets how
//! many far buffers the receiving bridge lends ahead (`RecvOptions::credits`); `--no-fill` leaves
//! the frames unfilled at the source too (the producer and the raw initiator): the transfer alone.
//! `--in-process` runs each bridge as a thread of the process at its end (`send::serve` in the
//! producer's, `recv::serve` in the far consumer's) instead of a process of its own: on a GPU that
//! time-slices between processes (no MPS), the bridge's transfers then share the context of the
//! process beside it, and each end's GPU work is one process's.
//!
//! Needs NIXL's libraries on LD_LIBRARY_PATH (`pip install --no-deps nixl-cu13`).

mod common;

use common::args::{Argv, memory_kind};
use common::child::Child;
use common::{FrameMeta, Res, now_ns, percentile_us, read_u64, zeroed_counter};
use cuda_ipc::Error as IpcError;
use cuda_ipc::channel::{
    ChannelOptions, Consumer, ConsumerOptions, Delivery, MemoryKind, Producer, WaitStrategy,
};
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory, Stream};
use cuda_ipc::raw::kernels::{Kernels, pattern};
use cuda_ipc::remote::nixl::{Lane, Place, Region, Target};
use cuda_ipc::remote::report::UcxLog;
use cuda_ipc::remote::wire::Secret;
use cuda_ipc::remote::{LaneOptions, recv, send};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: remote_pipeline [--frames 1000] [--bytes N | --4k] \
    [--memory host|device] [--pool auto|legacy|vmm|pool] [--delivery every|latest] [--pace-us 0] \
    [--spin-us N] [--credits N] [--in-process] [--no-check] [--no-fill] [--raw]";
const SECRET: &str = "remote_pipeline example secret";
const LONG: Duration = Duration::from_secs(120);

#[derive(Clone)]
struct Args {
    frames: u64,
    bytes: usize,
    device: bool,
    delivery: Delivery,
    raw: bool,
    /// Microseconds between frames (0: as fast as the lane goes); a paced run measures the
    /// hand-off latency without queueing.
    pace_us: u64,
    /// Microseconds the bridges and the far consumer poll without a pause after a frame; `None`:
    /// the lane's default or twice the pace, whichever is longer.
    spin_us: Option<u64>,
    /// The far consumer checks each frame's bytes (default); `--no-check` takes and releases
    /// them untouched, as the raw loop's target does (for the benchmark).
    check: bool,
    /// The producer (and the raw loop's initiator) fills each frame (default); `--no-fill`
    /// publishes (writes) the buffers as they are: what the transfer alone costs. Implies
    /// `--no-check`.
    fill: bool,
    /// Far buffers the receiving bridge lends ahead (`RecvOptions::credits`); `None`: its default.
    credits: Option<usize>,
    /// The bridges run as threads of the producer's and the far consumer's processes
    /// (`--in-process`), not as processes of their own.
    in_process: bool,
    /// The near pool's kind of device memory (`--pool auto|legacy|vmm|pool`).
    pool: MemoryKind,
    pool_word: String,
    /// (role, value): `recv FAR`, `send NEAR:PORT`, `consumer FAR`, `raw-target` .
    role: Option<(String, String)>,
}

fn parse() -> Res<Args> {
    let mut a = Args {
        frames: 1000,
        bytes: 1 << 20,
        device: false,
        delivery: Delivery::EveryFrame,
        raw: false,
        pace_us: 0,
        spin_us: None,
        in_process: false,
        check: true,
        fill: true,
        credits: None,
        pool: MemoryKind::Auto,
        pool_word: "auto".into(),
        role: None,
    };
    let mut args = Argv::from_env();
    while let Some(k) = args.flag() {
        match k.as_str() {
            "--frames" => a.frames = args.parse(&k)?,
            "--bytes" => a.bytes = args.parse(&k)?,
            "--4k" => a.bytes = 3840 * 2160 * 4,
            "--memory" => {
                a.device = match args.value(&k)?.as_str() {
                    "host" => false,
                    "device" => true,
                    x => return Err(format!("unknown memory {x:?} (host|device)").into()),
                }
            }
            "--delivery" => {
                a.delivery = match args.value(&k)?.as_str() {
                    "every" => Delivery::EveryFrame,
                    "latest" => Delivery::LatestOnly,
                    x => return Err(format!("unknown delivery {x:?} (every|latest)").into()),
                }
            }
            "--raw" => a.raw = true,
            "--in-process" => a.in_process = true,
            "--no-check" => a.check = false,
            "--no-fill" => {
                a.fill = false;
                a.check = false;
            }
            "--credits" => a.credits = Some(args.parse(&k)?),
            "--pace-us" => a.pace_us = args.parse(&k)?,
            "--spin-us" => a.spin_us = Some(args.parse(&k)?),
            "--pool" => {
                a.pool_word = args.value(&k)?;
                a.pool = memory_kind(&a.pool_word)?;
            }
            "--role" => {
                let r = args.value(&k)?;
                a.role = Some((r, args.value_or("missing role value")?));
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            x => return Err(format!("unknown argument {x:?}\n{USAGE}").into()),
        }
    }
    if a.bytes == 0 || !a.bytes.is_multiple_of(4) {
        return Err("--bytes must be a positive multiple of 4".into());
    }
    Ok(a)
}

fn main() {
    common::warn_if_unoptimised();
    let r = parse().and_then(|a| match a.role.clone() {
        None if a.raw => raw_initiator(&a),
        None => producer(&a),
        Some((r, v)) => match r.as_str() {
            "recv" => bridge_recv(&a, &v),
            "send" => bridge_send(&a, &v),
            "consumer" => consumer(&a, &v),
            "raw-target" => raw_target(&a),
            x => Err(format!("unknown role {x}").into()),
        },
    });
    if let Err(e) = r {
        eprintln!("remote_pipeline: {e}");
        std::process::exit(1);
    }
}

/// Starts this process again with the environment of a lane on the loopback interface
/// (`cuda_ipc::remote::environment`: UCX bound to `lo`, its protocol report logged), once. UCX's
/// log goes into a private folder made for it (`UcxLog`: mode 0700, a fresh random name), never
/// to a name others could predict in the shared temp folder; the restarted process takes it over
/// (`None` when `UCX_LOG_FILE` was the user's own) and removes it when the role ends normally.
fn lane_environment() -> Res<Option<UcxLog>> {
    const READY: &str = "REMOTE_PIPELINE_ENV";
    if std::env::var_os(READY).is_some() {
        return Ok(UcxLog::adopt_from_env());
    }
    let log = match std::env::var_os("UCX_LOG_FILE") {
        Some(_) => None,
        None => Some(UcxLog::create()?),
    };
    let env = cuda_ipc::remote::environment("127.0.0.1".parse()?, log.as_ref());
    let err = std::process::Command::new(std::env::current_exe()?)
        .args(std::env::args_os().skip(1))
        .envs(env)
        .env(READY, "1")
        .env(common::CHILD_ENV, "1")
        .exec();
    Err(format!("exec: {err}").into())
}

/// Frames left out of the figures at the start (a tenth of them, at most 100): the lane's first
/// frames set up what later ones reuse (each pair of near and far buffers' transfer request,
/// UCX's mapping of each far buffer), which the raw loop, with one pair, does once.
fn warm_up(a: &Args) -> u64 {
    (a.frames / 10).min(100)
}

/// How long the bridges and the far consumer poll without a pause after a frame.
fn spin(a: &Args) -> Duration {
    match a.spin_us {
        Some(us) => Duration::from_micros(us),
        None => LaneOptions::default()
            .spin
            .max(Duration::from_micros(2 * a.pace_us)),
    }
}

fn memory_args(a: &Args) -> Vec<String> {
    let mut v = vec![
        "--spin-us".into(),
        spin(a).as_micros().to_string(),
        "--bytes".into(),
        a.bytes.to_string(),
        "--memory".into(),
        if a.device { "device" } else { "host" }.into(),
        "--frames".into(),
        a.frames.to_string(),
        "--delivery".into(),
        if a.delivery == Delivery::LatestOnly {
            "latest"
        } else {
            "every"
        }
        .into(),
    ];
    if a.in_process {
        v.push("--in-process".into());
    }
    if !a.check {
        v.push("--no-check".into());
    }
    if let Some(c) = a.credits {
        v.extend(["--credits".into(), c.to_string()]);
    }
    v
}

fn spawn(name: &str, a: &Args, role: &str, value: &str) -> Res<Child> {
    let mut args = memory_args(a);
    args.extend(["--role".into(), role.into(), value.into()]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Child::spawn(name, &refs)
}

/// Waits for the next slot of `--pace-us` (`next`, moved on by one period). A run behind its
/// schedule (the lane stalled, e.g. while UCX connected for the first WRITE) starts the schedule
/// again from now rather than catching up in a burst: a paced run measures the hand-off without
/// frames queueing behind each other.
fn pace(a: &Args, next: &mut Instant) {
    if a.pace_us > 0 {
        let now = Instant::now();
        if *next < now {
            *next = now;
        }
        let due = *next;
        *next += Duration::from_micros(a.pace_us);
        // Sleep to within 200 us of the slot, then spin (the pace costs no core).
        if let Some(d) = due.checked_duration_since(Instant::now() + Duration::from_micros(200)) {
            std::thread::sleep(d);
        }
        while Instant::now() < due {
            std::hint::spin_loop();
        }
    }
}

fn fill_host(w: &mut [u8], seed: u32) {
    for (i, c) in w.chunks_exact_mut(4).enumerate() {
        c.copy_from_slice(&pattern(seed, i as u64).to_le_bytes());
    }
}

fn producer(a: &Args) -> Res<()> {
    // The sending bridge in this process: the lane's environment before NIXL starts.
    let _log = if a.in_process {
        Some(lane_environment()?)
    } else {
        None
    };
    let near = format!("remote-near-{}", std::process::id());
    let far = format!("remote-far-{}", std::process::id());
    // In-process, the far consumer's process runs the receiving bridge and prints its port.
    let (recv, early) = if a.in_process {
        (None, Some(spawn("consumer", a, "consumer", &far)?))
    } else {
        (Some(spawn("recv bridge", a, "recv", &far)?), None)
    };
    let port = match (&recv, &early) {
        (Some(r), _) => r.line(LONG)?,
        (None, Some(c)) => c.line(LONG)?,
        (None, None) => return Err("no receiving bridge".into()),
    };
    let port = port
        .strip_prefix("port ")
        .ok_or("recv bridge: no port")?
        .to_string();
    let opts = ChannelOptions::new(a.bytes).buffers(4);
    let (mut tx, kernels) = if a.device {
        let ctx = Context::default_device()?;
        let k = Kernels::load(&ctx)?;
        let tx = Producer::create(&ctx, &near, &opts.memory(a.pool))?;
        println!("producer: near pool memory {:?}", tx.memory_kind());
        (tx, Some(k))
    } else {
        (Producer::create_host(&near, &opts)?, None)
    };
    let target = format!("{near}:{port}");
    let mut send = if a.in_process {
        let a = a.clone();
        Bridge::Thread(std::thread::spawn(move || {
            send_lines(&a, &target).map_err(|e| e.to_string())
        }))
    } else {
        Bridge::Process(spawn("send bridge", a, "send", &target)?)
    };
    let consumer = match early {
        Some(c) => c,
        None => spawn("consumer", a, "consumer", &far)?,
    };
    println!("consumer: {}", consumer.line(LONG)?);
    println!(
        "producer: {} frames of {} bytes in {} memory, delivery {:?}, over the lane to {far}",
        a.frames,
        a.bytes,
        if a.device { "device" } else { "host" },
        a.delivery
    );
    let mut host = vec![0u8; if a.device { 0 } else { a.bytes }];
    let start = Instant::now();
    let mut slot = start;
    for i in 0..a.frames {
        pace(a, &mut slot);
        let mut w = tx.acquire(Some(LONG))?;
        let meta = FrameMeta::now(i, a.bytes as u64, 1).encode();
        match &kernels {
            _ if !a.fill => {}
            Some(k) => k.fill_pattern(w.buffer()?, i as u32, w.stream()?)?,
            None => {
                fill_host(&mut host, i as u32);
                w.write_at(0, &host)?;
            }
        }
        w.publish(&meta)?;
    }
    let secs = start.elapsed().as_secs_f64();
    tx.close(LONG)?;
    let mut consumer = consumer;
    let (ok, lines) = consumer.wait()?;
    for l in &lines {
        println!("{l}");
    }
    let slines = match &mut send {
        Bridge::Process(c) => c.wait()?.1,
        Bridge::Thread(_) => match std::mem::replace(&mut send, Bridge::Done) {
            Bridge::Thread(t) => t
                .join()
                .map_err(|_| "the sending bridge's thread panicked")??,
            _ => Vec::new(),
        },
        Bridge::Done => Vec::new(),
    };
    for l in &slines {
        println!("send bridge: {l}");
    }
    if let Some(mut recv) = recv {
        let _ = recv.wait()?;
    }
    println!(
        "producer: published {} frames in {secs:.2} s = {:.0} frames/s",
        a.frames,
        a.frames as f64 / secs
    );
    if !ok || lines.iter().any(|l| l.contains("FAIL")) {
        return Err("the far consumer failed".into());
    }
    if a.check {
        println!("OK: every far frame checked");
    } else {
        println!("OK: every far frame received in order (bytes unchecked: --no-check)");
    }
    Ok(())
}

fn bridge_recv(a: &Args, far: &str) -> Res<()> {
    let _log = lane_environment()?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    recv_serve(a, far, &listener)
}

/// Runs the receiving bridge of far channel `far` on `listener` until its session ends; a lost
/// lane ends the process without dropping the far producer (its consumers see it gone).
fn recv_serve(a: &Args, far: &str, listener: &TcpListener) -> Res<()> {
    let mut opts = recv::RecvOptions::new(far, Secret::new(SECRET.into())?);
    opts.lane.spin = spin(a);
    if let Some(c) = a.credits {
        opts.credits = c;
    }
    opts.place = if a.device {
        Place::Device(0)
    } else {
        Place::Host
    };
    let mut frames = 0;
    match recv::serve(&opts, listener, &AtomicBool::new(false), &mut frames)? {
        recv::Ended::Closed(r) => {
            r?;
            Ok(())
        }
        recv::Ended::Lost { producer, reason } => {
            eprintln!("recv bridge: lane lost after {frames} frames: {reason}");
            let _keep = producer;
            std::process::exit(3)
        }
        _ => Err("recv bridge stopped".into()),
    }
}

/// The sending bridge, as a process of its own or a thread of the producer's.
enum Bridge {
    Process(Child),
    Thread(std::thread::JoinHandle<Result<Vec<String>, String>>),
    Done,
}

fn bridge_send(a: &Args, v: &str) -> Res<()> {
    let _log = lane_environment()?;
    for l in send_lines(a, v)? {
        println!("{l}");
    }
    Ok(())
}

/// Runs the sending bridge of near channel and port `v` (`NEAR:PORT`) until its session ends;
/// returns what it reports (how it ended, the transport UCX reported).
fn send_lines(a: &Args, v: &str) -> Res<Vec<String>> {
    let (near, port) = v.rsplit_once(':').ok_or("send: NEAR:PORT")?;
    let mut opts = send::SendOptions::new(
        near,
        &format!("127.0.0.1:{port}"),
        Secret::new(SECRET.into())?,
    );
    opts.lane.spin = spin(a);
    let mut totals = send::Totals::default();
    let end = send::serve(&opts, &AtomicBool::new(false), &mut totals)?;
    let (t, path) = totals
        .transport
        .as_ref()
        .map_or(("unknown".into(), "unknown"), |t| {
            (t.summary(), t.path.word())
        });
    let mut lines = vec![format!(
        "{end:?} after {} frames; UCX transport {t} ({path})",
        totals.frames
    )];
    if let Some(t) = &totals.transport {
        for l in &t.lines {
            lines.push(format!("  UCX: {l}"));
        }
    }
    Ok(lines)
}

fn consumer(a: &Args, far: &str) -> Res<()> {
    // In-process, this process runs the receiving bridge too (a thread), and prints its port.
    let _log = if a.in_process {
        Some(lane_environment()?)
    } else {
        None
    };
    let bridge = if a.in_process {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        println!("port {}", listener.local_addr()?.port());
        std::io::stdout().flush()?;
        let (a, far) = (a.clone(), far.to_string());
        Some(std::thread::spawn(move || {
            recv_serve(&a, &far, &listener).map_err(|e| e.to_string())
        }))
    } else {
        None
    };
    let start = Instant::now();
    let rx = loop {
        // Polling without a pause for a while after each frame, as the bridges do (and as the raw
        // loop's target does throughout).
        let o = ConsumerOptions::new()
            .delivery(a.delivery)
            .wait(WaitStrategy::SpinThenBlock(spin(a)));
        match Consumer::attach(far, &o) {
            Ok(c) => break c,
            Err(e) if start.elapsed() > LONG => return Err(e.into()),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    let gpu = if rx.is_host() {
        None
    } else {
        let ctx = rx.context()?.clone();
        Some((Kernels::load(&ctx)?, zeroed_counter(&ctx)?))
    };
    println!("attached to {far} (pid {})", std::process::id());
    std::io::stdout().flush()?;
    let (mut received, mut bad_host, mut out_of_order) = (0u64, 0u64, 0u64);
    let mut last: Option<u64> = None;
    let mut lat = Vec::with_capacity(a.frames as usize);
    let mut host = vec![0u8; if gpu.is_some() { 0 } else { a.bytes }];
    let mut expect = vec![0u8; host.len()];
    let mut t0 = None;
    loop {
        let f = match rx.recv_timeout(LONG) {
            Ok(f) => f,
            Err(IpcError::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => return Err(e.into()),
        };
        lat.push(
            now_ns().saturating_sub(FrameMeta::decode(f.metadata()).ok_or("metadata")?.stamp_ns),
        );
        if received == warm_up(a) {
            t0 = Some(Instant::now());
        }
        let m = FrameMeta::decode(f.metadata()).ok_or("metadata")?;
        if last.is_some_and(|l| m.index <= l)
            || (a.delivery == Delivery::EveryFrame && m.index != last.map_or(0, |l| l + 1))
        {
            out_of_order += 1;
        }
        last = Some(m.index);
        match &gpu {
            _ if !a.check => {}
            Some((k, counter)) => {
                k.check_pattern(f.buffer()?, m.index as u32, counter, f.stream()?)?
            }
            None => {
                f.read_at(0, &mut host)?;
                fill_host(&mut expect, m.index as u32);
                if host != expect {
                    bad_host += 1;
                }
            }
        }
        received += 1;
    }
    let bad = match &gpu {
        Some((_, counter)) => {
            rx.stream()?.synchronize()?;
            read_u64(counter)?
        }
        None => bad_host,
    };
    let secs = t0.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let steady = received.saturating_sub(warm_up(a));
    let mut lat = lat.split_off((warm_up(a) as usize).min(lat.len()));
    lat.sort_unstable();
    let ok = bad == 0 && out_of_order == 0 && received > 0;
    println!(
        "consumer: {}{} received {received} frames ({:.0} frames/s after the first {}), mismatches \
         {bad}, out of order {out_of_order}; hand-off publish->received p50 {:.1} us, p99 {:.1} us",
        if ok { "OK" } else { "FAIL" },
        if a.check { "" } else { " (bytes unchecked)" },
        steady as f64 / secs.max(1e-9),
        warm_up(a),
        percentile_us(&lat, 0.5),
        percentile_us(&lat, 0.99)
    );
    if let Some(b) = bridge {
        b.join()
            .map_err(|_| "the receiving bridge's thread panicked")??;
    }
    Ok(())
}

/// The raw floor's memory: one buffer of `bytes`, host or device.
enum Mem {
    Host(Vec<u8>),
    Device(DeviceBuffer, Kernels, Stream),
}

impl Mem {
    fn new(a: &Args) -> Res<Mem> {
        Ok(if a.device {
            let ctx = Context::default_device()?;
            Mem::Device(
                DeviceBuffer::new(&ctx, a.bytes)?,
                Kernels::load(&ctx)?,
                Stream::new(&ctx)?,
            )
        } else {
            Mem::Host(vec![0u8; a.bytes])
        })
    }
    fn region(&mut self) -> Region {
        match self {
            Mem::Host(v) => Region {
                addr: v.as_mut_ptr() as u64,
                len: v.len(),
                place: Place::Host,
            },
            Mem::Device(b, _, _) => Region {
                addr: b.device_ptr(),
                len: b.len(),
                place: Place::Device(0),
            },
        }
    }
}

fn send_bytes(s: &mut TcpStream, b: &[u8]) -> Res<()> {
    s.write_all(&(b.len() as u32).to_le_bytes())?;
    s.write_all(b)?;
    Ok(())
}

fn recv_bytes(s: &mut TcpStream) -> Res<Vec<u8>> {
    let mut n = [0u8; 4];
    s.read_exact(&mut n)?;
    // NIXL metadata is a few KiB: a longer message is refused, not allocated.
    let n = u32::from_le_bytes(n) as usize;
    if n > 1 << 20 {
        return Err(format!("a raw-floor message of {n} bytes (at most 1 MiB)").into());
    }
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

/// The raw floor, initiator: stamp, fill, WRITE with a notification, wait for completion.
fn raw_initiator(a: &Args) -> Res<()> {
    let _log = lane_environment()?;
    // UCX's CUDA transports work in the thread's current context.
    let ctx = if a.device {
        Some(Context::default_device()?)
    } else {
        None
    };
    let _current = ctx.as_ref().map(|c| c.enter()).transpose()?;
    let target = spawn("raw target", a, "raw-target", "-")?;
    let port: u16 = target
        .line(LONG)?
        .strip_prefix("port ")
        .ok_or("raw target: no port")?
        .parse()?;
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    let mut mem = Mem::new(a)?;
    let mut lane = Lane::new(&format!("raw-initiator-{}", std::process::id()))?;
    let region = mem.region();
    // SAFETY: `mem` outlives the lane (dropped after it below) and nothing else uses it.
    unsafe { lane.register(0, region)? };
    let md = recv_bytes(&mut s)?;
    let far = recv_bytes(&mut s)?;
    let remote = lane.load_remote(&md)?;
    let addr = u64::from_le_bytes(far[..8].try_into()?);
    let place = if far[8] == 1 {
        Place::Device(0)
    } else {
        Place::Host
    };
    let t = Target {
        addr,
        len: a.bytes as u64,
        place,
    };
    let start = Instant::now();
    let mut slot = start;
    for i in 0..a.frames {
        pace(a, &mut slot);
        let stamp = now_ns();
        match &mut mem {
            _ if !a.fill => {}
            Mem::Host(v) => fill_host(v, i as u32),
            Mem::Device(b, k, st) => {
                k.fill_pattern(b, i as u32, st)?;
                st.synchronize()?;
            }
        }
        let note = format!("raw {i} {stamp}");
        let l = LaneOptions::default();
        lane.write(
            0,
            a.bytes,
            (0, t),
            &remote,
            note.as_bytes(),
            l.write_timeout,
            // Polls its WRITE without a pause throughout, as the sending bridge does.
            l.write_timeout,
        )?;
    }
    let secs = start.elapsed().as_secs_f64();
    let (_, lines) = {
        let mut t = target;
        t.wait()?
    };
    for l in lines {
        println!("{l}");
    }
    println!(
        "raw initiator: {} WRITEs of {} bytes in {secs:.2} s = {:.0} frames/s",
        a.frames,
        a.bytes,
        a.frames as f64 / secs
    );
    drop(lane);
    drop(mem);
    Ok(())
}

/// The raw floor, target: one registered buffer; counts notifications and their latency.
fn raw_target(a: &Args) -> Res<()> {
    let _log = lane_environment()?;
    // UCX's CUDA transports work in the thread's current context.
    let ctx = if a.device {
        Some(Context::default_device()?)
    } else {
        None
    };
    let _current = ctx.as_ref().map(|c| c.enter()).transpose()?;
    let l = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", l.local_addr()?.port());
    std::io::stdout().flush()?;
    let (mut s, _) = l.accept()?;
    let mut mem = Mem::new(a)?;
    let mut lane = Lane::new(&format!("raw-target-{}", std::process::id()))?;
    let region = mem.region();
    // SAFETY: `mem` outlives the lane (dropped after it below); only the initiator writes it.
    unsafe { lane.register(0, region)? };
    send_bytes(&mut s, &lane.local_md()?)?;
    let mut far = region.addr.to_le_bytes().to_vec();
    far.push(u8::from(matches!(region.place, Place::Device(_))));
    send_bytes(&mut s, &far)?;
    let mut lat = Vec::with_capacity(a.frames as usize);
    let mut t0 = None;
    let deadline = Instant::now() + LONG;
    while (lat.len() as u64) < a.frames && Instant::now() < deadline {
        for (_, n) in lane.take_notifications()? {
            let now = now_ns();
            if lat.len() as u64 == warm_up(a) {
                t0 = Some(Instant::now());
            }
            let stamp: u64 = n
                .split(' ')
                .nth(2)
                .and_then(|x| x.parse().ok())
                .ok_or("note")?;
            lat.push(now.saturating_sub(stamp));
        }
        std::hint::spin_loop();
    }
    let secs = t0.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let n = lat.len();
    let steady = (n as u64).saturating_sub(warm_up(a));
    let mut lat = lat.split_off((warm_up(a) as usize).min(n));
    lat.sort_unstable();
    println!(
        "raw target: {} notifications of {} ({:.0} frames/s after the first {}); hand-off \
         stamp->notified p50 {:.1} us, p99 {:.1} us",
        n,
        a.frames,
        steady as f64 / secs.max(1e-9),
        warm_up(a),
        percentile_us(&lat, 0.5),
        percentile_us(&lat, 0.99)
    );
    drop(lane);
    drop(mem);
    Ok(())
}
