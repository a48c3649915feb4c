//! A Rust producer for Python consumers (`python/examples/torch_consumer.py`): creates channel
//! `--channel NAME` with a pool of 4 buffers of width × height × 4 bytes, waits until
//! `--consumers N` consumers have attached, then publishes `--frames` frames, each filled on the GPU
//! by the `fill_pattern` kernel with the frame index as seed, with metadata (index, width, height,
//! publish time in ns of CLOCK_MONOTONIC; four little-endian u64). Closes the channel, waits for
//! the consumers' holds, and exits non-zero when a hold had to be forced.
//!
//! ```text
//! cargo run --release -p cuda-ipc-examples --example python_producer -- --channel NAME
//!     [--frames 2000] [--consumers 1] [--width 3840] [--height 2160] [--attach-timeout 120]
//!     [--memory auto|legacy|vmm|pool]
//! ```
//! `--memory` picks the kind of exportable memory the pool is made of (`ChannelOptions::memory`;
//! the Python consumer imports VMM and pool buffers through fds fetched from this process).
//! `scripts/python-consumer-demo.sh` runs it with the Python consumer.

mod common;

use common::args::{Argv, memory_kind};
use common::{FrameMeta, Res};
use cuda_ipc::channel::{ChannelOptions, MemoryKind, Producer};
use cuda_ipc::driver::Context;
use cuda_ipc::raw::kernels::Kernels;
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

fn parse() -> Res<Args> {
    let mut a = Args {
        channel: String::new(),
        frames: 2000,
        consumers: 1,
        width: 3840,
        height: 2160,
        attach_timeout: Duration::from_secs(120),
        memory: MemoryKind::Auto,
    };
    let mut args = Argv::from_env();
    while let Some(k) = args.flag() {
        match k.as_str() {
            "--channel" => a.channel = args.value(&k)?,
            "--frames" => a.frames = args.parse(&k)?,
            "--consumers" => a.consumers = args.parse(&k)?,
            "--width" => a.width = args.parse(&k)?,
            "--height" => a.height = args.parse(&k)?,
            "--attach-timeout" => a.attach_timeout = Duration::from_secs(args.parse(&k)?),
            "--memory" => a.memory = memory_kind(&args.value(&k)?)?,
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
    common::warn_if_unoptimised();
    if let Err(e) = parse().and_then(|a| run(&a)) {
        eprintln!("python_producer: {e}");
        std::process::exit(1);
    }
}

fn run(a: &Args) -> Res<()> {
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
        kernels.fill_pattern(frame.buffer()?, i as u32, frame.stream()?)?;
        // Stamped in ns of CLOCK_MONOTONIC, the clock `time.clock_gettime_ns` reads in Python.
        frame.publish(&FrameMeta::now(i, a.width, a.height).encode())?;
    }
    tx.stream()?.synchronize()?;
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
