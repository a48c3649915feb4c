//! A three-stage video chain, three processes, two channels, zero copies:
//!
//! ```text
//! filter ──channel A──▶ transform ──channel B──▶ analysis
//! ```
//!
//! - `filter` (this process) produces channel A: it fills 4K RGBA frames (3840 × 2160 × 4 bytes)
//!   with `fill_pattern(seed = frame index)`;
//! - `transform` consumes A and produces B in one CUDA context: for each frame it takes a B buffer
//!   and writes `B = A ^ 0x5A5A5A5A` on B's producer stream, ordered after A's frame is ready and
//!   before A's frame is released, with two plain events between its two streams;
//! - `analysis` consumes B and counts the words that differ from `pattern(index) ^ 0x5A5A5A5A`.
//!
//! The frame index travels in the metadata (its first 8 bytes, little-endian). Every consumer takes
//! every frame (back-pressure). Shutdown runs down the chain: filter closes A; transform gets
//! `ChannelError::Closed` from A and closes B; analysis gets `ChannelError::Closed` from B.
//!
//! The filter re-executes this binary as the other two stages, prints the throughput of each stage
//! and the analysis mismatch count, and exits non-zero on any mismatch, missing or reordered frame,
//! or failed stage.
//!
//! ```text
//! cargo run --release -p cuda-ipc-examples --example 06_video_chain -- [--frames 2000]
//! ```

mod common;

use common::args::Argv;
use common::child::Child;
use common::{Arrivals, FrameMeta, Res, field, field_u64, read_u64, wait_drained, zeroed_counter};
use cuda_ipc::Error as IpcError;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Delivery, Producer};
use cuda_ipc::driver::{Context, Event};
use cuda_ipc::raw::kernels::Kernels;
use std::time::{Duration, Instant};

const WIDTH: u64 = 3840;
const HEIGHT: u64 = 2160;
const FRAME_BYTES: usize = (WIDTH * HEIGHT * 4) as usize;
/// The transform's XOR key.
const KEY: u32 = 0x5A5A_5A5A;

/// How long a stage may take to start (CUDA init, PTX JIT, attach) and print its ready line.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a consumer waits for its first frame (the later stages start one after the other).
const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a consumer waits for each later frame.
const FRAME_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a producer waits for a free buffer.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a producer waits for its consumers to take the last frames before it closes.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long `Producer::close` waits for outstanding holds.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the filter waits for each stage to exit once it closed channel A.
const EXIT_TIMEOUT: Duration = Duration::from_secs(120);

enum Role {
    Filter,
    Transform { a: String, b: String },
    Analysis { b: String },
}

struct Args {
    frames: u64,
    role: Role,
}

fn parse() -> Res<Args> {
    let mut a = Args {
        frames: 2000,
        role: Role::Filter,
    };
    let mut args = Argv::from_env();
    while let Some(k) = args.flag() {
        match k.as_str() {
            "--frames" => a.frames = args.parse(&k)?,
            // The roles the filter starts its children in.
            "--transform" => {
                let (from, to) = (args.value(&k)?, args.value(&k)?);
                a.role = Role::Transform { a: from, b: to };
            }
            "--analysis" => a.role = Role::Analysis { b: args.value(&k)? },
            "-h" | "--help" => {
                println!("usage: 06_video_chain [--frames N]");
                std::process::exit(0);
            }
            x => return Err(format!("unknown argument {x:?} (--frames N)").into()),
        }
    }
    if a.frames == 0 {
        return Err("--frames must be at least 1".into());
    }
    Ok(a)
}

fn main() {
    common::warn_if_unoptimised();
    let r = parse().and_then(|a| match &a.role {
        Role::Filter => filter(a.frames),
        Role::Transform { a: from, b: to } => transform(a.frames, from, to),
        Role::Analysis { b } => analysis(a.frames, b),
    });
    if let Err(e) = r {
        eprintln!("06_video_chain: {e}");
        std::process::exit(1);
    }
}

/// Frame metadata: the frame index, little-endian (read back with `FrameMeta::index_of`).
fn meta(index: u64) -> [u8; 8] {
    index.to_le_bytes()
}

/// Stage 1 and the top process: produces channel A, starts the other two stages.
fn filter(frames: u64) -> Res<()> {
    let ctx = Context::default_device()?;
    let kernels = Kernels::load(&ctx)?;
    let pid = std::process::id();
    let (name_a, name_b) = (
        format!("video-chain-{pid}-a"),
        format!("video-chain-{pid}-b"),
    );
    let mut tx = Producer::create(&ctx, &name_a, &ChannelOptions::new(FRAME_BYTES))?;
    println!(
        "filter (pid {pid}): {} {}; {frames} frames of {WIDTH}x{HEIGHT} RGBA ({FRAME_BYTES} bytes), pools of 4, every-frame delivery",
        ctx.device().name()?,
        ctx.device().uuid(),
    );
    let n = frames.to_string();
    // Start order matters: B exists once the transform is ready, and the analysis must be attached
    // to B before the first frame enters the chain (consumers get frames published after attach).
    // Each stage is this binary re-executed (CUDA does not survive `fork()`); a `Child` is killed
    // when dropped, so an early error of the filter leaves no stage behind.
    let mut transform = Child::spawn(
        "transform",
        &["--transform", &name_a, &name_b, "--frames", &n],
    )?;
    println!("  {}", transform.line(READY_TIMEOUT)?);
    let mut analysis = Child::spawn("analysis", &["--analysis", &name_b, "--frames", &n])?;
    println!("  {}", analysis.line(READY_TIMEOUT)?);

    let start = Instant::now();
    for i in 0..frames {
        // A stage that exited early: stop now rather than run into acquire timeouts.
        if i % 16 == 0 && (transform.exited() || analysis.exited()) {
            return Err(format!("a stage exited after {i} frames (its error is above)").into());
        }
        let wf = tx.acquire(Some(ACQUIRE_TIMEOUT))?;
        kernels.fill_pattern(wf.buffer()?, i as u32, wf.stream()?)?;
        wf.publish(&meta(i))?;
    }
    tx.stream()?.synchronize()?;
    let secs = start.elapsed().as_secs_f64();
    let drained = wait_drained(&tx, DRAIN_TIMEOUT);
    let published = tx.stats().published;
    let report = tx.close(CLOSE_TIMEOUT)?;
    println!(
        "filter: published={published} frames in {secs:.2} s = {:.0} frames/s, {:.1} GB/s; forced holds at close {}",
        frames as f64 / secs,
        frames as f64 * FRAME_BYTES as f64 / secs / 1e9,
        report.forced_holds
    );

    let mut failed = Vec::new();
    let mut analysis_summary = None;
    for stage in [&mut transform, &mut analysis] {
        let (ok, lines) = stage.finish(EXIT_TIMEOUT)?;
        let ok = ok && !lines.iter().any(|l| l.contains("FAIL"));
        for l in &lines {
            println!("  {l}");
            if stage.name() == "analysis"
                && l.starts_with("analysis")
                && field(l, "mismatches=").is_some()
            {
                analysis_summary = Some(l.clone());
            }
        }
        if !ok {
            failed.push(stage.name().to_string());
        }
    }
    if !drained {
        return Err(format!("channel A was not drained within {DRAIN_TIMEOUT:?}").into());
    }
    if !failed.is_empty() {
        return Err(format!("stage(s) failed: {}", failed.join(", ")).into());
    }
    let summary = analysis_summary.ok_or("the analysis printed no summary")?;
    let received = field_u64(&summary, "received=")?;
    let mismatches = field_u64(&summary, "mismatches=")?;
    if received != frames || mismatches != 0 {
        return Err(format!(
            "analysis received {received} of {frames} frames with {mismatches} mismatched words"
        )
        .into());
    }
    println!(
        "OK: {frames} frames through filter -> transform -> analysis, every word checked, analysis mismatches={mismatches}"
    );
    Ok(())
}

/// Stage 2: consumes A, produces B, both in the one context of the consumer.
fn transform(frames: u64, name_a: &str, name_b: &str) -> Res<()> {
    let rx = Consumer::attach(
        name_a,
        &ConsumerOptions::new().delivery(Delivery::EveryFrame),
    )?;
    let ctx = rx.context()?.clone();
    let kernels = Kernels::load(&ctx)?;
    let mut tx = Producer::create(&ctx, name_b, &ChannelOptions::new(FRAME_BYTES))?;
    // `a_ready`: recorded on the consumer stream, which waits on A's frame event; `b_written`:
    // recorded on the producer stream after the XOR, so A's frame is released only after the read.
    let a_ready = Event::new(&ctx)?;
    let b_written = Event::new(&ctx)?;
    println!(
        "transform (pid {}): attached to A, created B, one context for both",
        std::process::id()
    );
    let mut arrivals = Arrivals::default();
    loop {
        let timeout = arrivals.timeout(FIRST_FRAME_TIMEOUT, FRAME_TIMEOUT);
        let frame = match rx.recv_timeout(timeout) {
            Ok(f) => f,
            Err(IpcError::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => return Err(e.into()),
        };
        let m = frame.metadata().to_vec();
        arrivals.arrived(FrameMeta::index_of(&m)?);
        // The acquire made B's producer stream wait until the analysis released this B buffer.
        let wf = tx.acquire(Some(ACQUIRE_TIMEOUT))?;
        // ...and now also until A's frame is ready (the consumer stream waits on A's event).
        a_ready.record(frame.stream()?)?;
        wf.stream()?.wait_event(&a_ready)?;
        kernels.xor(frame.buffer()?, wf.buffer()?, KEY, wf.stream()?)?;
        // A's frame is released (on drop) on the consumer stream: after the XOR read it.
        b_written.record(wf.stream()?)?;
        frame.stream()?.wait_event(&b_written)?;
        drop(frame);
        // B's event is recorded on the producer stream, after the XOR.
        wf.publish(&m)?;
    }
    tx.stream()?.synchronize()?;
    let secs = arrivals.secs();
    let Arrivals {
        received,
        out_of_order,
        ..
    } = arrivals;
    let drained = wait_drained(&tx, DRAIN_TIMEOUT);
    let report = tx.close(CLOSE_TIMEOUT)?;
    rx.stream()?.synchronize()?;
    let ok = drained && received == frames && out_of_order == 0;
    println!(
        "transform: {} received={received} of {frames} frames, {:.0} frames/s, {:.1} GB/s read+written; out of order {out_of_order}; B drained {drained}, forced holds {}",
        if ok { "OK" } else { "FAIL" },
        received as f64 / secs.max(1e-9),
        2.0 * received as f64 * FRAME_BYTES as f64 / secs.max(1e-9) / 1e9,
        report.forced_holds
    );
    if !ok {
        return Err("transform check failed".into());
    }
    Ok(())
}

/// Stage 3: consumes B, checks every word of every frame.
fn analysis(frames: u64, name_b: &str) -> Res<()> {
    let rx = Consumer::attach(
        name_b,
        &ConsumerOptions::new().delivery(Delivery::EveryFrame),
    )?;
    let ctx = rx.context()?.clone();
    let kernels = Kernels::load(&ctx)?;
    let counter = zeroed_counter(&ctx)?;
    println!("analysis (pid {}): attached to B", std::process::id());
    let mut arrivals = Arrivals::default();
    loop {
        let timeout = arrivals.timeout(FIRST_FRAME_TIMEOUT, FRAME_TIMEOUT);
        let frame = match rx.recv_timeout(timeout) {
            Ok(f) => f,
            Err(IpcError::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => return Err(e.into()),
        };
        let index = FrameMeta::index_of(frame.metadata())?;
        arrivals.arrived(index);
        kernels.check_pattern_xor(
            frame.buffer()?,
            index as u32,
            KEY,
            &counter,
            frame.stream()?,
        )?;
        drop(frame); // released after the check, on our stream
    }
    rx.stream()?.synchronize()?;
    let secs = arrivals.secs();
    let Arrivals {
        received,
        out_of_order,
        ..
    } = arrivals;
    let bad = read_u64(&counter)?;
    let ok = bad == 0 && received == frames && out_of_order == 0;
    println!(
        "analysis: {} received={received} of {frames} frames, {:.0} frames/s, {:.1} GB/s checked; mismatches={bad} words; out of order {out_of_order}",
        if ok { "OK" } else { "FAIL" },
        received as f64 / secs.max(1e-9),
        received as f64 * FRAME_BYTES as f64 / secs.max(1e-9) / 1e9,
    );
    if !ok {
        return Err("analysis check failed".into());
    }
    Ok(())
}
