//! A Rust consumer for Python producers (`python/examples/torch_producer.py`) and for the
//! `python_producer` example: attaches to channel `--channel NAME` (waiting up to
//! `--attach-timeout` seconds for it to appear), receives frames until the producer closes the
//! channel, and checks every 32-bit word of each frame on the GPU against the `fill_pattern` kernel's
//! pattern with the frame index (the metadata's first u64, see `FrameMeta`) as seed. Prints one
//! line `rust consumer: OK|FAIL frames=N mismatched_words=W out_of_order=O ...` and exits non-zero
//! on a mismatch, a frame out of order, or fewer than `--frames` frames.
//!
//! `--cost` measures instead what receiving costs this process per frame: each `try_recv` that
//! returns a frame, and the frame's drop (the release), timed together, with no work on the frame;
//! polls that find nothing are not counted. Prints `cost_ns p50=... p90=... mean=...` (ns), the
//! Rust side of the Python consumer's per-frame cost benchmark (`bench/consumer_cost.py`).
//!
//! ```text
//! cargo run --release -p cuda-ipc-examples --example rust_consumer -- --channel NAME
//!     [--frames 0] [--cost] [--delivery every|latest] [--attach-timeout 60]
//! ```

mod common;

use common::args::Argv;
use common::{FrameMeta, Res, read_u64, zeroed_counter};
use cuda_ipc::channel::{ChannelError, Consumer, ConsumerOptions, Delivery};
use cuda_ipc::raw::kernels::Kernels;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: rust_consumer --channel NAME [--frames 0] [--cost] \
    [--delivery every|latest] [--attach-timeout 60] (seconds)";

struct Args {
    channel: String,
    frames: u64,
    cost: bool,
    delivery: Delivery,
    attach_timeout: Duration,
}

fn parse() -> Res<Args> {
    let mut a = Args {
        channel: String::new(),
        frames: 0,
        cost: false,
        delivery: Delivery::EveryFrame,
        attach_timeout: Duration::from_secs(60),
    };
    let mut args = Argv::from_env();
    while let Some(k) = args.flag() {
        match k.as_str() {
            "--channel" => a.channel = args.value(&k)?,
            "--frames" => a.frames = args.parse(&k)?,
            "--cost" => a.cost = true,
            "--delivery" => {
                a.delivery = match args.value(&k)?.as_str() {
                    "every" => Delivery::EveryFrame,
                    "latest" => Delivery::LatestOnly,
                    d => return Err(format!("--delivery every|latest, not {d:?}").into()),
                }
            }
            "--attach-timeout" => a.attach_timeout = Duration::from_secs(args.parse(&k)?),
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
    Ok(a)
}

fn main() {
    common::warn_if_unoptimised();
    if let Err(e) = parse().and_then(|a| run(&a)) {
        eprintln!("rust consumer: FAIL {e}");
        std::process::exit(1);
    }
}

fn attach(a: &Args) -> Res<Consumer> {
    let opts = ConsumerOptions::new().delivery(a.delivery);
    let start = Instant::now();
    loop {
        match Consumer::attach(&a.channel, &opts) {
            Ok(c) => return Ok(c),
            Err(cuda_ipc::Error::Channel(ChannelError::NotFound(_)))
                if start.elapsed() < a.attach_timeout =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn run(a: &Args) -> Res<()> {
    let rx = attach(a)?;
    println!(
        "rust consumer (pid {}): attached to {}",
        std::process::id(),
        a.channel
    );
    if a.cost {
        return cost(&rx);
    }
    let kernels = Kernels::load(rx.context()?)?;
    let counter = zeroed_counter(rx.context()?)?;
    let (mut frames, mut out_of_order, mut last) = (0u64, 0u64, None::<u64>);
    let start = Instant::now();
    loop {
        let frame = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(f) => f,
            Err(cuda_ipc::Error::Channel(ChannelError::Closed)) => break,
            Err(e) => return Err(e.into()),
        };
        let index = FrameMeta::index_of(frame.metadata())?;
        let in_order = match (a.delivery, last) {
            (_, None) => true,
            (Delivery::EveryFrame, Some(l)) => index == l + 1,
            (_, Some(l)) => index > l,
        };
        out_of_order += u64::from(!in_order);
        last = Some(index);
        kernels.check_pattern(frame.buffer()?, index as u32, &counter, frame.stream()?)?;
        frames += 1;
    }
    rx.stream()?.synchronize()?;
    let bad = read_u64(&counter)?;
    let secs = start.elapsed().as_secs_f64();
    let missing = a.frames.saturating_sub(frames);
    let ok = bad == 0 && out_of_order == 0 && missing == 0 && frames > 0;
    println!(
        "rust consumer: {} frames={frames} mismatched_words={bad} out_of_order={out_of_order} \
         missing={missing} frames_per_s={:.0} last_index={}",
        if ok { "OK" } else { "FAIL" },
        frames as f64 / secs,
        last.map_or(-1, |l| l as i64)
    );
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

/// Per-frame cost of a successful `try_recv` and the release, in ns, until the channel closes.
fn cost(rx: &Consumer) -> Res<()> {
    let mut ns: Vec<u64> = Vec::with_capacity(1 << 16);
    loop {
        let t = Instant::now();
        match rx.try_recv() {
            Ok(Some(f)) => {
                drop(f);
                ns.push(t.elapsed().as_nanos() as u64);
            }
            Ok(None) => std::hint::spin_loop(),
            Err(cuda_ipc::Error::Channel(ChannelError::Closed)) => break,
            Err(e) => return Err(e.into()),
        }
    }
    rx.stream()?.synchronize()?;
    if ns.is_empty() {
        return Err("no frame received".into());
    }
    let mean = ns.iter().sum::<u64>() as f64 / ns.len() as f64;
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize];
    println!(
        "rust consumer: OK frames={} cost_ns p50={} p90={} mean={mean:.0}",
        ns.len(),
        at(0.5),
        at(0.9)
    );
    Ok(())
}
