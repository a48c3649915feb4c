//! The main job: one producer process streams 4K RGBA frames (3840 × 2160 × 4 bytes) through a pool
//! of 4 device buffers to two consumer processes, zero copies, each process in its own CUDA context.
//! The producer fills every frame with a kernel; each consumer checks every word of every frame it
//! receives with its own kernel. Prints frames/s and the hand-off latency (publish → frame ready in
//! the consumer), and exits non-zero on any mismatch.
//!
//! ```text
//! cargo run --release --example pipeline -- [--frames 10000] [--consumers 2]
//!     [--delivery every|latest] [--wait spin-then-block|spin|block] [--memory auto|legacy|vmm|pool]
//! ```

mod common;

use common::{FrameMeta, now_ns};
use cuda_ipc::Error as IpcError;
use cuda_ipc::channel::{
    ChannelOptions, Consumer, ConsumerOptions, Delivery, MemoryKind, Producer, WaitStrategy,
};
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory};
use cuda_ipc::kernels::Kernels;
use std::error::Error;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: pipeline [--frames 10000] [--consumers 2] [--delivery every|latest]
    [--wait spin-then-block|spin|block] [--memory auto|legacy|vmm]";

const WIDTH: u64 = 3840;
const HEIGHT: u64 = 2160;
const FRAME_BYTES: usize = (WIDTH * HEIGHT * 4) as usize;

struct Args {
    frames: u64,
    consumers: usize,
    delivery: Delivery,
    wait: WaitStrategy,
    wait_name: String,
    memory: MemoryKind,
    role: Option<(String, String)>,
}

fn parse() -> Result<Args, Box<dyn Error>> {
    let mut a = Args {
        frames: 10_000,
        consumers: 2,
        delivery: Delivery::EveryFrame,
        wait: WaitStrategy::default(),
        wait_name: "spin-then-block".into(),
        memory: MemoryKind::Auto,
        role: None,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--frames" => a.frames = v()?.parse()?,
            "--consumers" => a.consumers = v()?.parse()?,
            "--delivery" => {
                a.delivery = match v()?.as_str() {
                    "every" => Delivery::EveryFrame,
                    "latest" => Delivery::LatestOnly,
                    x => return Err(format!("unknown delivery {x:?} (every|latest)").into()),
                }
            }
            "--wait" => {
                let w = v()?.clone();
                a.wait = match w.as_str() {
                    "spin-then-block" => WaitStrategy::default(),
                    "spin" => WaitStrategy::Spin,
                    "block" => WaitStrategy::Block,
                    x => return Err(format!("unknown wait {x:?}").into()),
                };
                a.wait_name = w;
            }
            "--memory" => {
                a.memory = match v()?.as_str() {
                    "auto" => MemoryKind::Auto,
                    "legacy" => MemoryKind::Legacy,
                    "vmm" => MemoryKind::Vmm,
                    "pool" => MemoryKind::Pool,
                    x => return Err(format!("unknown memory {x:?} (auto|legacy|vmm|pool)").into()),
                }
            }
            "--consumer-of" => {
                let ch = v()?.clone();
                a.role = Some((ch, it.next().ok_or("missing index")?.clone()));
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            x => return Err(format!("unknown argument {x:?}\n{USAGE}").into()),
        }
    }
    Ok(a)
}

fn main() {
    let r = parse().and_then(|a| match &a.role {
        Some((ch, idx)) => consumer(&a, ch, idx),
        None => producer(&a),
    });
    if let Err(e) = r {
        eprintln!("pipeline: {e}");
        std::process::exit(1);
    }
}

fn meta(index: u64, stamp_ns: u64) -> [u8; FrameMeta::LEN] {
    FrameMeta {
        index,
        width: WIDTH,
        height: HEIGHT,
        stamp_ns,
    }
    .encode()
}

fn producer(a: &Args) -> Result<(), Box<dyn Error>> {
    let ctx = Context::default_device()?;
    println!(
        "producer (pid {}): {} {}; {} frames of {}x{} RGBA ({} bytes), pool of 4, {} consumers, delivery {:?}, wait {}",
        std::process::id(),
        ctx.device().name()?,
        ctx.device().uuid(),
        a.frames,
        WIDTH,
        HEIGHT,
        FRAME_BYTES,
        a.consumers,
        a.delivery,
        a.wait_name
    );
    let kernels = Kernels::load(&ctx)?;
    let name = format!("pipeline-{}", std::process::id());
    let opts = ChannelOptions::new(FRAME_BYTES)
        .buffers(4)
        .wait(a.wait)
        .memory(a.memory);
    let mut tx = Producer::create(&ctx, &name, &opts)?;
    println!("producer: pool memory {:?}", tx.memory_kind());
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for k in 0..a.consumers {
        let mut cmd = Command::new(&exe);
        cmd.args(["--consumer-of", &name, &k.to_string()]);
        cmd.args([
            "--delivery",
            if a.delivery == Delivery::LatestOnly {
                "latest"
            } else {
                "every"
            },
        ]);
        cmd.args(["--wait", &a.wait_name]);
        children.push(cmd.stdout(Stdio::piped()).spawn()?);
    }
    let mut readers = Vec::new();
    for c in &mut children {
        let out = c.stdout.take().ok_or("no stdout")?;
        let (tx_line, rx_line) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx_line.send(l);
            }
        });
        readers.push(rx_line);
    }
    for r in &readers {
        let l = r.recv_timeout(Duration::from_secs(60))?;
        println!("  {l}");
    }
    let start = Instant::now();
    let mut acquire_wait = Duration::ZERO;
    for i in 0..a.frames {
        let t = Instant::now();
        let frame = tx.acquire(Some(Duration::from_secs(10)))?;
        acquire_wait += t.elapsed();
        kernels.fill_pattern(frame.buffer(), i as u32, frame.stream())?;
        frame.publish(&meta(i, now_ns()))?;
    }
    tx.stream().synchronize()?;
    let secs = start.elapsed().as_secs_f64();
    let stats = tx.stats();
    let report = tx.close(Duration::from_secs(10))?;
    println!(
        "producer: published {} frames in {secs:.2} s = {:.0} frames/s, {:.1} GB/s; waited for free buffers {:.2} s; forced holds at close {}",
        stats.published,
        a.frames as f64 / secs,
        a.frames as f64 * FRAME_BYTES as f64 / secs / 1e9,
        acquire_wait.as_secs_f64(),
        report.forced_holds
    );
    let mut failed = false;
    for (c, r) in children.iter_mut().zip(&readers) {
        let st = c.wait()?;
        while let Ok(l) = r.recv_timeout(Duration::from_millis(200)) {
            println!("  {l}");
            if l.contains("FAIL") {
                failed = true;
            }
        }
        failed |= !st.success();
    }
    if failed {
        return Err("a consumer failed".into());
    }
    println!("OK: every received frame checked, zero mismatches");
    Ok(())
}

fn consumer(a: &Args, channel: &str, idx: &str) -> Result<(), Box<dyn Error>> {
    let rx = Consumer::attach(
        channel,
        &ConsumerOptions::new().delivery(a.delivery).wait(a.wait),
    )?;
    let ctx = rx.context().clone();
    let kernels = Kernels::load(&ctx)?;
    let counter = DeviceBuffer::new(&ctx, 8)?;
    counter.copy_from_host(0, &[0; 8])?;
    println!(
        "consumer {idx} (pid {}): attached, own context",
        std::process::id()
    );
    let mut lat = Vec::with_capacity(a.frames as usize);
    let mut received = 0u64;
    let mut last = None::<u64>;
    let mut out_of_order = 0u64;
    let start = Instant::now();
    loop {
        let frame = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(f) => f,
            Err(IpcError::ChannelClosed) => break,
            Err(e) => return Err(e.into()),
        };
        let ready = now_ns();
        let m = FrameMeta::decode(frame.metadata()).ok_or("short frame metadata")?;
        let index = m.index;
        lat.push(ready.saturating_sub(m.stamp_ns));
        if m.width != WIDTH || m.height != HEIGHT || frame.buffer().len() != FRAME_BYTES {
            return Err("wrong frame shape in metadata".into());
        }
        if last.is_some_and(|l| index <= l)
            || (a.delivery == Delivery::EveryFrame && index != last.map_or(index, |l| l + 1))
        {
            out_of_order += 1;
        }
        last = Some(index);
        kernels.check_pattern(frame.buffer(), index as u32, &counter, frame.stream())?;
        received += 1;
        drop(frame); // release, ordered after the check on our stream
    }
    rx.stream().synchronize()?;
    let secs = start.elapsed().as_secs_f64();
    let mut b = [0u8; 8];
    counter.copy_to_host(0, &mut b)?;
    let bad = u64::from_le_bytes(b);
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0) as f64
            / 1e3
    };
    let stats = rx.stats();
    let dropped = stats
        .consumers
        .iter()
        .find(|c| c.pid == std::process::id())
        .map_or(0, |c| c.dropped);
    let ok = bad == 0 && out_of_order == 0 && received > 0;
    println!(
        "consumer {idx}: {} received {received} frames ({:.0}/s), skipped {dropped}, mismatched words {bad}, out of order {out_of_order}; hand-off publish->ready p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        if ok { "OK" } else { "FAIL" },
        received as f64 / secs,
        pct(0.5),
        pct(0.99),
        pct(1.0)
    );
    if !ok {
        return Err("consumer check failed".into());
    }
    Ok(())
}
