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
//! `Error::ChannelClosed` from A and closes B; analysis gets `Error::ChannelClosed` from B.
//!
//! The filter re-executes this binary as the other two stages, prints the throughput of each stage
//! and the analysis mismatch count, and exits non-zero on any mismatch, missing or reordered frame,
//! or failed stage.
//!
//! ```text
//! cargo run --release --example video_chain -- [--frames 2000]
//! ```

use cuda_ipc::Error as IpcError;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Delivery, Producer};
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory, Event};
use cuda_ipc::kernels::Kernels;
use std::error::Error;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
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

type Res<T> = Result<T, Box<dyn Error>>;

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
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(k) = it.next() {
        let mut v = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{k} needs a value"))
        };
        match k.as_str() {
            "--frames" => a.frames = v()?.parse()?,
            // The roles the filter starts its children in.
            "--transform" => {
                let (from, to) = (v()?, v()?);
                a.role = Role::Transform { a: from, b: to };
            }
            "--analysis" => a.role = Role::Analysis { b: v()? },
            x => return Err(format!("unknown argument {x:?} (--frames N)").into()),
        }
    }
    if a.frames == 0 {
        return Err("--frames must be at least 1".into());
    }
    Ok(a)
}

fn main() {
    let r = parse().and_then(|a| match &a.role {
        Role::Filter => filter(a.frames),
        Role::Transform { a: from, b: to } => transform(a.frames, from, to),
        Role::Analysis { b } => analysis(a.frames, b),
    });
    if let Err(e) = r {
        eprintln!("video_chain: {e}");
        std::process::exit(1);
    }
}

/// Frame metadata: the frame index, little-endian.
fn meta(index: u64) -> [u8; 8] {
    index.to_le_bytes()
}

fn meta_index(m: &[u8]) -> Res<u64> {
    let b: [u8; 8] = m
        .get(..8)
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| format!("metadata of {} bytes has no frame index", m.len()))?;
    Ok(u64::from_le_bytes(b))
}

/// Waits (bounded) until every consumer of `tx` has taken every published frame and released it.
/// `Producer::close` only waits for frames consumers hold, not for those they have yet to take, and
/// frees the pool right after; so a producer that ends calls this first. Returns false on timeout.
fn wait_drained(tx: &Producer, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        let s = tx.stats();
        if s.consumers.iter().all(|c| c.lag == 0 && c.in_flight == 0) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The value of `key=value` in a summary line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .map(|v| v.trim_end_matches([',', ';']))
}

/// A stage this process started: this binary re-executed (CUDA does not survive `fork()`), with
/// its stdout read line by line on a thread. Dropping it kills the child if it still runs, so an
/// early error of the filter leaves no stage behind.
struct Stage {
    name: &'static str,
    child: Child,
    lines: Receiver<String>,
}

impl Stage {
    fn spawn(name: &'static str, args: &[&str]) -> Res<Stage> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(args)
            .stdout(Stdio::piped())
            .spawn()?;
        let out = child.stdout.take().ok_or("no stdout")?;
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(Stage { name, child, lines })
    }

    /// The next line the stage prints, waiting at most `timeout`.
    fn line(&self, timeout: Duration) -> Res<String> {
        self.lines.recv_timeout(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => {
                format!("{} printed nothing within {timeout:?}", self.name).into()
            }
            RecvTimeoutError::Disconnected => {
                format!("{} exited early (its error is above)", self.name).into()
            }
        })
    }

    /// Whether the stage has already exited (it must not before its channel closes).
    fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)) | Err(_))
    }

    /// Waits up to `timeout` for the stage to exit (then kills it); returns whether it succeeded
    /// and the lines it printed since the last [`Stage::line`].
    fn finish(&mut self, timeout: Duration) -> Res<(bool, Vec<String>)> {
        let deadline = Instant::now() + timeout;
        let mut rest = Vec::new();
        let ok = loop {
            if let Some(st) = self.child.try_wait()? {
                break st.success();
            }
            if Instant::now() >= deadline {
                self.child.kill()?;
                self.child.wait()?;
                rest.push(format!(
                    "{}: FAIL did not exit within {timeout:?}; killed",
                    self.name
                ));
                break false;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        // The child has exited, so its stdout reaches end of file: the reader ends.
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(5)) {
            rest.push(l);
        }
        Ok((ok && !rest.iter().any(|l| l.contains("FAIL")), rest))
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
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
    let mut transform = Stage::spawn(
        "transform",
        &["--transform", &name_a, &name_b, "--frames", &n],
    )?;
    println!("  {}", transform.line(READY_TIMEOUT)?);
    let mut analysis = Stage::spawn("analysis", &["--analysis", &name_b, "--frames", &n])?;
    println!("  {}", analysis.line(READY_TIMEOUT)?);

    let start = Instant::now();
    for i in 0..frames {
        // A stage that exited early: stop now rather than run into acquire timeouts.
        if i % 16 == 0 && (transform.exited() || analysis.exited()) {
            return Err(format!("a stage exited after {i} frames (its error is above)").into());
        }
        let wf = tx.acquire(Some(ACQUIRE_TIMEOUT))?;
        kernels.fill_pattern(wf.buffer(), i as u32, wf.stream())?;
        wf.publish(&meta(i))?;
    }
    tx.stream().synchronize()?;
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
        for l in &lines {
            println!("  {l}");
            if stage.name == "analysis"
                && l.starts_with("analysis")
                && field(l, "mismatches=").is_some()
            {
                analysis_summary = Some(l.clone());
            }
        }
        if !ok {
            failed.push(stage.name);
        }
    }
    if !drained {
        return Err(format!("channel A was not drained within {DRAIN_TIMEOUT:?}").into());
    }
    if !failed.is_empty() {
        return Err(format!("stage(s) failed: {}", failed.join(", ")).into());
    }
    let summary = analysis_summary.ok_or("the analysis printed no summary")?;
    let received: u64 = field(&summary, "received=")
        .ok_or("no received=")?
        .parse()?;
    let mismatches: u64 = field(&summary, "mismatches=")
        .ok_or("no mismatches=")?
        .parse()?;
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
    let ctx = rx.context().clone();
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
    let mut received = 0u64;
    let mut out_of_order = 0u64;
    let mut next = 0u64;
    let mut start = None::<Instant>;
    loop {
        let timeout = if start.is_none() {
            FIRST_FRAME_TIMEOUT
        } else {
            FRAME_TIMEOUT
        };
        let frame = match rx.recv_timeout(timeout) {
            Ok(f) => f,
            Err(IpcError::ChannelClosed) => break,
            Err(e) => return Err(e.into()),
        };
        start.get_or_insert_with(Instant::now);
        let m = frame.metadata().to_vec();
        let index = meta_index(&m)?;
        if index != next {
            out_of_order += 1;
        }
        next = index + 1;
        // The acquire made B's producer stream wait until the analysis released this B buffer.
        let wf = tx.acquire(Some(ACQUIRE_TIMEOUT))?;
        // ...and now also until A's frame is ready (the consumer stream waits on A's event).
        a_ready.record(frame.stream())?;
        wf.stream().wait_event(&a_ready)?;
        kernels.xor(frame.buffer(), wf.buffer(), KEY, wf.stream())?;
        // A's frame is released (on drop) on the consumer stream: after the XOR read it.
        b_written.record(wf.stream())?;
        frame.stream().wait_event(&b_written)?;
        drop(frame);
        // B's event is recorded on the producer stream, after the XOR.
        wf.publish(&m)?;
        received += 1;
    }
    tx.stream().synchronize()?;
    let secs = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    let drained = wait_drained(&tx, DRAIN_TIMEOUT);
    let report = tx.close(CLOSE_TIMEOUT)?;
    rx.stream().synchronize()?;
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
    let ctx = rx.context().clone();
    let kernels = Kernels::load(&ctx)?;
    let counter = DeviceBuffer::new(&ctx, 8)?;
    counter.copy_from_host(0, &[0; 8])?;
    // The zeroing copy runs on the legacy default stream; our stream is non-blocking: wait for it.
    ctx.synchronize()?;
    println!("analysis (pid {}): attached to B", std::process::id());
    let mut received = 0u64;
    let mut out_of_order = 0u64;
    let mut next = 0u64;
    let mut start = None::<Instant>;
    loop {
        let timeout = if start.is_none() {
            FIRST_FRAME_TIMEOUT
        } else {
            FRAME_TIMEOUT
        };
        let frame = match rx.recv_timeout(timeout) {
            Ok(f) => f,
            Err(IpcError::ChannelClosed) => break,
            Err(e) => return Err(e.into()),
        };
        start.get_or_insert_with(Instant::now);
        let index = meta_index(frame.metadata())?;
        if index != next {
            out_of_order += 1;
        }
        next = index + 1;
        kernels.check_pattern_xor(frame.buffer(), index as u32, KEY, &counter, frame.stream())?;
        received += 1;
        drop(frame); // released after the check, on our stream
    }
    rx.stream().synchronize()?;
    let secs = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    let mut b = [0u8; 8];
    counter.copy_to_host(0, &mut b)?;
    let bad = u64::from_le_bytes(b);
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
