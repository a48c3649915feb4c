//! Preprocessing → inference across two processes, with the tensor's shape and dtype in the frame
//! metadata: the consumer refuses frames whose header it does not expect instead of misreading
//! their bytes.
//!
//! The preprocessing process (this one) produces frames holding f32 planar tensors of shape
//! `[3, 1080, 1920]` (R, G and B planes scaled to 0..1): for frame `index` it fills an RGBA8 staging
//! buffer of 1920 × 1080 pixels with `fill_pattern(seed = index)` and converts it with
//! `rgba_to_planar` straight into the channel's buffer, both on the producer's stream. The metadata
//! is a small fixed header, little-endian:
//!
//! ```text
//! bytes 0..4    magic b"TNSR"
//! bytes 4..8    dtype (u32; 1 = f32)
//! bytes 8..12   ndim (u32, at most 4)
//! bytes 12..16  zero
//! bytes 16..48  shape (4 × u64; dimensions past ndim are zero)
//! bytes 48..56  frame index (u64)
//! ```
//!
//! The inference process parses and validates the header (magic, dtype, shape, and that the shape
//! fills the buffer exactly), and stands in for a model: it copies 64 pixels spread over the frame
//! (8 runs of 8, moving with the frame index) of each of the 3 planes to the host and compares them
//! with the value computed on the host from `kernels::pattern(index, pixel)`, exactly as the kernel
//! does (`byte * (1/255)`, byte `c` of the little-endian word of the pixel). It prints frames/s and
//! the mismatch count; the preprocessing process exits non-zero on any mismatch, refused header,
//! missing frame or failure.
//!
//! ```text
//! cargo run --release -p cuda-ipc-examples --example 07_preprocess_inference -- [--frames 1000]
//! ```

mod common;

use common::args::Argv;
use common::child::Child;
use common::{Arrivals, Res, field, field_u64, wait_drained};
use cuda_ipc::Error as IpcError;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Delivery, Producer};
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory};
use cuda_ipc::raw::kernels::{Kernels, pattern};
use std::time::{Duration, Instant};

const WIDTH: u64 = 1920;
const HEIGHT: u64 = 1080;
const NPIX: u64 = WIDTH * HEIGHT;
/// The tensor every frame must hold.
const SHAPE: [u64; 3] = [3, HEIGHT, WIDTH];
const TENSOR_BYTES: usize = (3 * NPIX * 4) as usize;

const MAGIC: [u8; 4] = *b"TNSR";
const DTYPE_F32: u32 = 1;
const MAX_DIMS: usize = 4;
const HEADER_BYTES: usize = 56;

/// Pixels checked per frame: `RUNS` runs of `RUN` consecutive pixels, spread over the frame.
const RUNS: u64 = 8;
const RUN: u64 = 8;

/// How long the inference process may take to start (CUDA init, PTX JIT, attach).
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the inference process waits for the first frame, and for each later one.
const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(120);
const FRAME_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the producer waits for a free buffer.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the producer waits for the consumer to take the last frames before it closes.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the producer waits for the inference process to exit after the channel closed.
const EXIT_TIMEOUT: Duration = Duration::from_secs(60);

struct Args {
    frames: u64,
    /// `--inference CHANNEL`: run as the inference process.
    inference: Option<String>,
}

fn parse() -> Res<Args> {
    let mut a = Args {
        frames: 1000,
        inference: None,
    };
    let mut args = Argv::from_env();
    while let Some(k) = args.flag() {
        match k.as_str() {
            "--frames" => a.frames = args.parse(&k)?,
            "--inference" => a.inference = Some(args.value(&k)?),
            "-h" | "--help" => {
                println!("usage: 07_preprocess_inference [--frames N]");
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
    let r = parse().and_then(|a| match &a.inference {
        Some(channel) => inference(a.frames, channel),
        None => preprocess(a.frames),
    });
    if let Err(e) = r {
        eprintln!("07_preprocess_inference: {e}");
        std::process::exit(1);
    }
}

/// The tensor header carried in a frame's metadata.
#[derive(Debug, PartialEq, Eq)]
struct TensorHeader {
    dtype: u32,
    shape: Vec<u64>,
    index: u64,
}

impl TensorHeader {
    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut m = [0u8; HEADER_BYTES];
        m[0..4].copy_from_slice(&MAGIC);
        m[4..8].copy_from_slice(&self.dtype.to_le_bytes());
        m[8..12].copy_from_slice(&(self.shape.len() as u32).to_le_bytes());
        for (d, n) in self.shape.iter().enumerate() {
            m[16 + 8 * d..24 + 8 * d].copy_from_slice(&n.to_le_bytes());
        }
        m[48..56].copy_from_slice(&self.index.to_le_bytes());
        m
    }

    /// Parses a header written by [`TensorHeader::encode`]; refuses anything malformed.
    fn decode(m: &[u8]) -> Res<TensorHeader> {
        if m.len() != HEADER_BYTES {
            return Err(format!(
                "metadata is {} bytes, a tensor header {HEADER_BYTES}",
                m.len()
            )
            .into());
        }
        if m[0..4] != MAGIC {
            return Err(format!("metadata magic {:?} is not b\"TNSR\"", &m[0..4]).into());
        }
        let u32_at = |o: usize| u32::from_le_bytes([m[o], m[o + 1], m[o + 2], m[o + 3]]);
        let u64_at = |o: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&m[o..o + 8]);
            u64::from_le_bytes(b)
        };
        let ndim = u32_at(8) as usize;
        if ndim == 0 || ndim > MAX_DIMS || u32_at(12) != 0 {
            return Err(format!("bad tensor header: ndim {ndim}, reserved {}", u32_at(12)).into());
        }
        if (ndim..MAX_DIMS).any(|d| u64_at(16 + 8 * d) != 0) {
            return Err("bad tensor header: dimensions past ndim are not zero".into());
        }
        Ok(TensorHeader {
            dtype: u32_at(4),
            shape: (0..ndim).map(|d| u64_at(16 + 8 * d)).collect(),
            index: u64_at(48),
        })
    }

    /// Refuses a tensor this model cannot take: another dtype or shape, or one that does not fill
    /// the `buffer_bytes` of the frame exactly.
    fn validate(&self, buffer_bytes: usize) -> Res<()> {
        if self.dtype != DTYPE_F32 {
            return Err(format!(
                "frame {}: dtype code {} refused, the model takes f32 (code {DTYPE_F32})",
                self.index, self.dtype
            )
            .into());
        }
        if self.shape != SHAPE {
            return Err(format!(
                "frame {}: shape {:?} refused, the model takes {SHAPE:?}",
                self.index, self.shape
            )
            .into());
        }
        let bytes = self.shape.iter().product::<u64>() * 4;
        if bytes != buffer_bytes as u64 {
            return Err(format!(
                "frame {}: a tensor of {bytes} bytes in a buffer of {buffer_bytes}",
                self.index
            )
            .into());
        }
        Ok(())
    }
}

/// The value `rgba_to_planar_f32` writes for plane `c` of pixel `i` of a staging buffer filled with
/// `fill_pattern(seed)`: byte `c` of the little-endian word `pattern(seed, i)`, times `1.0f / 255.0f`
/// (the kernel multiplies by the reciprocal; one rounding, as here).
fn expected(seed: u32, i: u64, c: usize) -> f32 {
    f32::from(pattern(seed, i).to_le_bytes()[c]) * (1.0f32 / 255.0f32)
}

/// The first pixel of run `r` of frame `index`: one run in each eighth of the frame, at a place
/// that moves with the frame index.
fn run_start(index: u64, r: u64) -> u64 {
    let part = NPIX / RUNS;
    r * part + (index.wrapping_mul(7919) + r * 104_729) % (part - RUN)
}

fn preprocess(frames: u64) -> Res<()> {
    let ctx = Context::default_device()?;
    let kernels = Kernels::load(&ctx)?;
    let name = format!("preprocess-inference-{}", std::process::id());
    let mut tx = Producer::create(&ctx, &name, &ChannelOptions::new(TENSOR_BYTES))?;
    // The decoded image before preprocessing; reused for every frame (all its work is on the
    // producer's stream, so frame i + 1 overwrites it only after frame i was converted).
    let staging = DeviceBuffer::new(&ctx, (NPIX * 4) as usize)?;
    println!(
        "preprocess (pid {}): {} {}; {frames} frames of {WIDTH}x{HEIGHT} RGBA8 -> f32 tensors {SHAPE:?} ({TENSOR_BYTES} bytes), pool of 4",
        std::process::id(),
        ctx.device().name()?,
        ctx.device().uuid(),
    );
    let n = frames.to_string();
    let mut child = Child::spawn("inference", &["--inference", &name, "--frames", &n])?
        .called("the inference process");
    println!("  {}", child.line(READY_TIMEOUT)?);

    let start = Instant::now();
    for i in 0..frames {
        // The inference process exited early: stop now rather than run into acquire timeouts.
        if i % 16 == 0 && child.exited() {
            return Err(format!(
                "the inference process exited after {i} frames (its error is above)"
            )
            .into());
        }
        let wf = tx.acquire(Some(ACQUIRE_TIMEOUT))?;
        kernels.fill_pattern(&staging, i as u32, wf.stream()?)?;
        kernels.rgba_to_planar(&staging, wf.buffer()?, NPIX, wf.stream()?)?;
        let header = TensorHeader {
            dtype: DTYPE_F32,
            shape: SHAPE.to_vec(),
            index: i,
        };
        wf.publish(&header.encode())?;
    }
    tx.stream()?.synchronize()?;
    let secs = start.elapsed().as_secs_f64();
    let drained = wait_drained(&tx, DRAIN_TIMEOUT);
    let report = tx.close(CLOSE_TIMEOUT)?;
    println!(
        "preprocess: published {frames} tensors in {secs:.2} s = {:.0} frames/s; forced holds at close {}",
        frames as f64 / secs,
        report.forced_holds
    );
    let (ok, lines) = child.finish(EXIT_TIMEOUT)?;
    let mut summary = None;
    for l in lines {
        println!("  {l}");
        if field(&l, "mismatches=").is_some() {
            summary = Some(l);
        }
    }
    if !drained {
        return Err(format!("the channel was not drained within {DRAIN_TIMEOUT:?}").into());
    }
    if !ok {
        return Err("the inference process failed".into());
    }
    let summary = summary.ok_or("the inference process printed no summary")?;
    let received = field_u64(&summary, "received=")?;
    let mismatches = field_u64(&summary, "mismatches=")?;
    if received != frames || mismatches != 0 {
        return Err(format!(
            "inference received {received} of {frames} frames with {mismatches} mismatched values"
        )
        .into());
    }
    println!(
        "OK: {frames} tensors validated and sampled ({} values each), zero mismatches",
        3 * RUNS * RUN
    );
    Ok(())
}

fn inference(frames: u64, channel: &str) -> Res<()> {
    let rx = Consumer::attach(
        channel,
        &ConsumerOptions::new().delivery(Delivery::EveryFrame),
    )?;
    println!("inference (pid {}): attached", std::process::id());
    let mut host = vec![0u8; (RUN * 4) as usize];
    let mut mismatches = 0u64;
    let mut first_mismatch = None::<String>;
    let mut arrivals = Arrivals::default();
    loop {
        let timeout = arrivals.timeout(FIRST_FRAME_TIMEOUT, FRAME_TIMEOUT);
        let frame = match rx.recv_timeout(timeout) {
            Ok(f) => f,
            Err(IpcError::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => return Err(e.into()),
        };
        let header = TensorHeader::decode(frame.metadata())?;
        header.validate(frame.buffer()?.len())?;
        let index = header.index;
        arrivals.arrived(index);
        // "Inference": the frame is ready on our stream; copies to the host are ordered after the
        // legacy default stream only, so wait for our stream first.
        frame.stream()?.synchronize()?;
        for r in 0..RUNS {
            let first = run_start(index, r);
            for c in 0..3 {
                let offset = ((c as u64 * NPIX + first) * 4) as usize;
                frame.buffer()?.copy_to_host(offset, &mut host)?;
                for (k, b) in host.chunks_exact(4).enumerate() {
                    let got = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    let pixel = first + k as u64;
                    let want = expected(index as u32, pixel, c);
                    if got.to_bits() != want.to_bits() {
                        mismatches += 1;
                        first_mismatch.get_or_insert_with(|| {
                            format!("frame {index} plane {c} pixel {pixel}: got {got}, want {want}")
                        });
                    }
                }
            }
        }
        drop(frame); // the copies were synchronous: release it
    }
    let secs = arrivals.secs();
    let Arrivals {
        received,
        out_of_order,
        ..
    } = arrivals;
    let ok = mismatches == 0 && received == frames && out_of_order == 0;
    println!(
        "inference: {} received={received} of {frames} frames, {:.0} frames/s; mismatches={mismatches} of {} values checked; out of order {out_of_order}{}",
        if ok { "OK" } else { "FAIL" },
        received as f64 / secs.max(1e-9),
        received * 3 * RUNS * RUN,
        first_mismatch.map_or(String::new(), |m| format!("; first mismatch: {m}")),
    );
    if !ok {
        return Err("inference check failed".into());
    }
    Ok(())
}
