//! A Rust producer for Python consumers (`python/examples/torch_consumer.py`): creates channel
//! `--channel NAME` with a pool of 4 buffers of width × height × 4 bytes, waits until
//! `--consumers N` consumers have attached, then publishes `--frames` frames, each filled on the GPU
//! by the `fill_pattern` kernel with the frame index as seed, with metadata (index, width, height,
//! publish time in ns of CLOCK_MONOTONIC; four little-endian u64). Closes the channel, waits for
//! the consumers' holds, and exits non-zero when a hold had to be forced.
//!
//! ```text
//! cargo run --release --example python_producer -- --channel NAME [--frames 2000]
//!     [--consumers 1] [--width 3840] [--height 2160] [--attach-timeout 120]
//!     [--memory auto|legacy|vmm|pool]
//! ```
//! `--memory` picks the kind of exportable memory the pool is made of (`ChannelOptions::memory`;
//! the Python consumer imports VMM and pool buffers through fds fetched from this process).
//! `scripts/python-consumer-demo.sh` runs it with the Python consumer.

use cuda_ipc::channel::{ChannelOptions, MemoryKind, Producer};
use cuda_ipc::driver::Context;
use cuda_ipc::kernels::Kernels;
use std::error::Error;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: python_producer --channel NAME [--frames 2000] [--consumers 1]
    [--width 3840] [--height 2160] [--attach-timeout 120] (seconds) [--memory auto|legacy|vmm|pool]";

struct Args {
    channel: String,
    frames: u64,
    consumers: usize,
    width: u64,
    height: u64,
    attach_timeout: Duration,
    memory: MemoryKind,
}

fn parse() -> Result<Args, Box<dyn Error>> {
    let mut a = Args {
        channel: String::new(),
        frames: 2000,
        consumers: 1,
        width: 3840,
        height: 2160,
        attach_timeout: Duration::from_secs(120),
        memory: MemoryKind::Auto,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--channel" => a.channel = v()?.clone(),
            "--frames" => a.frames = v()?.parse()?,
            "--consumers" => a.consumers = v()?.parse()?,
            "--width" => a.width = v()?.parse()?,
            "--height" => a.height = v()?.parse()?,
            "--attach-timeout" => a.attach_timeout = Duration::from_secs(v()?.parse()?),
            "--memory" => {
                a.memory = match v()?.as_str() {
                    "auto" => MemoryKind::Auto,
                    "legacy" => MemoryKind::Legacy,
                    "vmm" => MemoryKind::Vmm,
                    "pool" => MemoryKind::Pool,
                    x => return Err(format!("unknown memory {x:?} (auto|legacy|vmm|pool)").into()),
                }
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            x => return Err(format!("unknown argument {x:?}\n{USAGE}").into()),
        }
    }
    if a.channel.is_empty() {
        return Err(format!("--channel NAME is needed\n{USAGE}").into());
    }
    if a.width == 0 || a.height == 0 {
        return Err("--width and --height must be positive".into());
    }
    Ok(a)
}

fn main() {
    if let Err(e) = parse().and_then(|a| run(&a)) {
        eprintln!("python_producer: {e}");
        std::process::exit(1);
    }
}

/// CLOCK_MONOTONIC in ns: the clock Python's `time.clock_gettime_ns(CLOCK_MONOTONIC)` reads.
fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn meta(index: u64, width: u64, height: u64, stamp: u64) -> [u8; 32] {
    let mut m = [0u8; 32];
    for (k, w) in [index, width, height, stamp].into_iter().enumerate() {
        m[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    m
}

fn run(a: &Args) -> Result<(), Box<dyn Error>> {
    let frame_bytes = usize::try_from(a.width * a.height * 4)?;
    let ctx = Context::default_device()?;
    let kernels = Kernels::load(&ctx)?;
    let opts = ChannelOptions::new(frame_bytes).buffers(4).memory(a.memory);
    let mut tx = Producer::create(&ctx, &a.channel, &opts)?;
    println!(
        "producer (pid {}): {} {}; channel {}: {} frames of {}x{} RGBA ({frame_bytes} bytes), pool of 4 ({:?} memory); waiting for {} consumer(s)",
        std::process::id(),
        ctx.device().name()?,
        ctx.device().uuid(),
        a.channel,
        a.frames,
        a.width,
        a.height,
        tx.memory_kind(),
        a.consumers
    );
    let waited = Instant::now();
    while tx.stats().consumers.len() < a.consumers {
        if waited.elapsed() > a.attach_timeout {
            return Err(format!(
                "only {} of {} consumers attached within {:?}",
                tx.stats().consumers.len(),
                a.consumers,
                a.attach_timeout
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    println!(
        "producer: {} consumer(s) attached after {:.1} s",
        a.consumers,
        waited.elapsed().as_secs_f64()
    );
    let start = Instant::now();
    let mut acquire_wait = Duration::ZERO;
    for i in 0..a.frames {
        let t = Instant::now();
        let frame = tx.acquire(Some(Duration::from_secs(30)))?;
        acquire_wait += t.elapsed();
        kernels.fill_pattern(frame.buffer(), i as u32, frame.stream())?;
        frame.publish(&meta(i, a.width, a.height, now_ns()))?;
    }
    tx.stream().synchronize()?;
    let secs = start.elapsed().as_secs_f64();
    let stats = tx.stats();
    let report = tx.close(Duration::from_secs(30))?;
    println!(
        "producer: published {} frames in {secs:.2} s = {:.0} frames/s, {:.1} GB/s; waited for free buffers {:.2} s; forced holds at close {}",
        stats.published,
        a.frames as f64 / secs,
        a.frames as f64 * frame_bytes as f64 / secs / 1e9,
        acquire_wait.as_secs_f64(),
        report.forced_holds
    );
    for c in &stats.consumers {
        println!(
            "producer: consumer {} (pid {}): received {}, dropped {}, lag {}",
            c.index, c.pid, c.received, c.dropped, c.lag
        );
    }
    if report.forced_holds > 0 {
        return Err(format!("{} holds had to be forced at close", report.forced_holds).into());
    }
    Ok(())
}
