//! The main job: one producer process streams 4K RGBA frames (3840 × 2160 × 4 bytes) through a pool
//! of 4 device buffers to two consumer processes, zero copies, each process in its own CUDA context.
//! The producer fills every frame with a kernel; each consumer checks every word of every frame it
//! receives with its own kernel. Prints frames/s and the hand-off latency (publish → frame ready in
//! the consumer), and exits non-zero on any mismatch.
//!
//! ```text
//! cargo run --release -p cuda-ipc-examples --example 05_pipeline -- [--frames 10000]
//!     [--consumers 2] [--delivery every|latest] [--wait spin-then-block|spin|block]
//!     [--memory auto|legacy|vmm|pool]
//! ```

mod common;

use common::args::{Argv, memory_kind};
use common::child::Child;
use common::{FrameMeta, Res, now_ns, percentile_us, read_u64, zeroed_counter};
use cuda_ipc::Error as IpcError;
use cuda_ipc::channel::{
    ChannelOptions, Consumer, ConsumerOptions, Delivery, MemoryKind, Producer, WaitStrategy,
};
use cuda_ipc::driver::{Context, DeviceMemory};
use cuda_ipc::raw::kernels::Kernels;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: 05_pipeline [--frames 10000] [--consumers 2] [--delivery every|latest]
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

fn parse() -> Res<Args> {
    let mut a = Args {
        frames: 10_000,
        consumers: 2,
        delivery: Delivery::EveryFrame,
        wait: WaitStrategy::default(),
        wait_name: "spin-then-block".into(),
        memory: MemoryKind::Auto,
        role: None,
    };
    let mut args = Argv::from_env();
    while let Some(k) = args.flag() {
        match k.as_str() {
            "--frames" => a.frames = args.parse(&k)?,
            "--consumers" => a.consumers = args.parse(&k)?,
            "--delivery" => {
                a.delivery = match args.value(&k)?.as_str() {
                    "every" => Delivery::EveryFrame,
                    "latest" => Delivery::LatestOnly,
                    x => return Err(format!("unknown delivery {x:?} (every|latest)").into()),
                }
            }
            "--wait" => {
                let w = args.value(&k)?;
                a.wait = match w.as_str() {
                    "spin-then-block" => WaitStrategy::default(),
                    "spin" => WaitStrategy::Spin,
                    "block" => WaitStrategy::Block,
                    x => return Err(format!("unknown wait {x:?}").into()),
                };
                a.wait_name = w;
            }
            "--memory" => a.memory = memory_kind(&args.value(&k)?)?,
            "--consumer-of" => {
                let ch = args.value(&k)?;
                a.role = Some((ch, args.value_or("missing index")?));
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
    common::warn_if_unoptimised();
    let r = parse().and_then(|a| match &a.role {
        Some((ch, idx)) => consumer(&a, ch, idx),
        None => producer(&a),
    });
    if let Err(e) = r {
        eprintln!("05_pipeline: {e}");
        std::process::exit(1);
    }
}

fn producer(a: &Args) -> Res<()> {
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
    let delivery = if a.delivery == Delivery::LatestOnly {
        "latest"
    } else {
        "every"
    };
    let mut children = Vec::new();
    for k in 0..a.consumers {
        let index = k.to_string();
        let args = [
            "--consumer-of",
            &name,
            &index,
            "--delivery",
            delivery,
            "--wait",
            &a.wait_name,
        ];
        children.push(Child::spawn(&format!("consumer {k}"), &args)?);
    }
    for c in &children {
        let l = c.recv(Duration::from_secs(60))?;
        println!("  {l}");
    }
    let start = Instant::now();
    let mut acquire_wait = Duration::ZERO;
    for i in 0..a.frames {
        let t = Instant::now();
        let frame = tx.acquire(Some(Duration::from_secs(10)))?;
        acquire_wait += t.elapsed();
        kernels.fill_pattern(frame.buffer()?, i as u32, frame.stream()?)?;
        frame.publish(&FrameMeta::now(i, WIDTH, HEIGHT).encode())?;
    }
    tx.stream()?.synchronize()?;
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
    for c in &mut children {
        let (ok, lines) = c.wait()?;
        for l in lines {
            println!("  {l}");
            if l.contains("FAIL") {
                failed = true;
            }
        }
        failed |= !ok;
    }
    if failed {
        return Err("a consumer failed".into());
    }
    println!("OK: every received frame checked, zero mismatches");
    Ok(())
}

fn consumer(a: &Args, channel: &str, idx: &str) -> Res<()> {
    let rx = Consumer::attach(
        channel,
        &ConsumerOptions::new().delivery(a.delivery).wait(a.wait),
    )?;
    let ctx = rx.context()?.clone();
    let kernels = Kernels::load(&ctx)?;
    let counter = zeroed_counter(&ctx)?;
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
            Err(IpcError::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => return Err(e.into()),
        };
        let ready = now_ns();
        let m = FrameMeta::decode(frame.metadata()).ok_or("short frame metadata")?;
        let index = m.index;
        lat.push(ready.saturating_sub(m.stamp_ns));
        if m.width != WIDTH || m.height != HEIGHT || frame.buffer()?.len() != FRAME_BYTES {
            return Err("wrong frame shape in metadata".into());
        }
        if last.is_some_and(|l| index <= l)
            || (a.delivery == Delivery::EveryFrame && index != last.map_or(index, |l| l + 1))
        {
            out_of_order += 1;
        }
        last = Some(index);
        kernels.check_pattern(frame.buffer()?, index as u32, &counter, frame.stream()?)?;
        received += 1;
        drop(frame); // release, ordered after the check on our stream
    }
    rx.stream()?.synchronize()?;
    let secs = start.elapsed().as_secs_f64();
    let bad = read_u64(&counter)?;
    lat.sort_unstable();
    let pct = |p: f64| percentile_us(&lat, p);
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
