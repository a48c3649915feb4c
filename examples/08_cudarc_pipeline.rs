//! A cudarc program on both ends of a channel (`--features cudarc`): the producer process fills
//! every frame with its own cudarc-launched kernel, the consumer process (this binary re-executed:
//! CUDA does not survive `fork()` without `exec`) checks every word of every frame with a
//! cudarc-launched kernel. Both load the crate's PTX through cudarc (`CudaContext::load_module`).
//!
//! Two routes for the memory, both shown:
//! - the frames are the channel's own buffers, which cudarc only views (`cudarc_interop::slice`),
//!   launched on the channel's streams wrapped for cudarc (`cudarc_interop::stream`);
//! - a header block is allocated by cudarc itself (`CudaStream::alloc_zeros`) while an exportable
//!   pool is the device's current pool (`MemPool::make_device_current`), exported with
//!   `cudarc_interop::export` and read by the consumer through its token.
//!
//! Prints frames/s and `OK` with 0 mismatches; exits non-zero on any mismatch.
//!
//! ```text
//! cargo run --release -p cuda-ipc-examples --features cudarc --example 08_cudarc_pipeline --
//!     [--frames 1000] [--memory auto|legacy|vmm|pool]
//! ```

mod common;

use common::args::{Argv, memory_kind};
use common::child::Child;
use common::{FrameMeta, Res, wait_drained};
use cuda_ipc::Error as IpcError;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, MemoryKind, Producer};
use cuda_ipc::cudarc_interop;
use cuda_ipc::ipc::{ImportedBuffer, MemPool};
use cuda_ipc::raw::kernels::PTX;
use cuda_ipc::token::Token;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use std::sync::Arc;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: 08_cudarc_pipeline [--frames 1000] [--memory auto|legacy|vmm|pool]";

const WIDTH: u64 = 1920;
const HEIGHT: u64 = 1080;
const FRAME_BYTES: usize = (WIDTH * HEIGHT * 4) as usize;
/// Words of the header block cudarc allocates from the exportable pool.
const HEADER_WORDS: usize = 1 << 16;
/// The fill seed of the header block.
const HEADER_SEED: u32 = 0xC0DA;

struct Args {
    frames: u64,
    memory: MemoryKind,
    /// Consumer role: channel name and the header's token in hex.
    role: Option<(String, String)>,
}

fn parse() -> Res<Args> {
    let mut a = Args {
        frames: 1000,
        memory: MemoryKind::Auto,
        role: None,
    };
    let mut args = Argv::from_env();
    while let Some(k) = args.flag() {
        match k.as_str() {
            "--frames" => a.frames = args.parse(&k)?,
            "--memory" => a.memory = memory_kind(&args.value(&k)?)?,
            "--consumer-of" => {
                let ch = args.value(&k)?;
                a.role = Some((ch, args.value_or("missing header token")?));
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
        Some((ch, token)) => consumer(ch, token),
        None => producer(&a),
    });
    if let Err(e) = r {
        eprintln!("08_cudarc_pipeline: {e}");
        std::process::exit(1);
    }
}

/// cudarc's errors as the examples' error.
fn dr(e: cudarc::driver::DriverError) -> Box<dyn std::error::Error> {
    format!("cudarc: {e:?}").into()
}

/// The fill and check kernels of the crate's PTX, loaded by cudarc.
fn kernels(cx: &Arc<CudaContext>) -> Res<(CudaFunction, CudaFunction)> {
    let m = cx.load_module(Ptx::from_src(PTX)).map_err(dr)?;
    Ok((
        m.load_function("fill_pattern").map_err(dr)?,
        m.load_function("check_pattern").map_err(dr)?,
    ))
}

/// One-dimensional grid-stride shape for `n` words (the kernels loop over the rest).
fn shape(n: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn producer(a: &Args) -> Res<()> {
    let cx = CudaContext::new(0).map_err(dr)?;
    let ctx = cudarc_interop::context(&cx)?;
    let (fill, _) = kernels(&cx)?;
    println!(
        "producer (pid {}): {} {}; {} frames of {}x{} ({} bytes), cudarc kernels",
        std::process::id(),
        ctx.device().name()?,
        ctx.device().uuid(),
        a.frames,
        WIDTH,
        HEIGHT,
        FRAME_BYTES
    );

    // Route 2: cudarc allocates, from an exportable pool made the device's current pool.
    let pool = MemPool::exportable(&ctx)?;
    let side: Arc<CudaStream> = cx.new_stream().map_err(dr)?;
    let current = pool.make_device_current()?;
    let mut header = side.alloc_zeros::<u32>(HEADER_WORDS).map_err(dr)?;
    // The allocation stays in the pool; later cuMemAllocAsync calls use the previous pool again.
    current.restore()?;
    let n = HEADER_WORDS as u64;
    let mut b = side.launch_builder(&fill);
    b.arg(&mut header).arg(&n).arg(&HEADER_SEED);
    // SAFETY: the arguments match `fill_pattern(unsigned*, unsigned long long, unsigned)`; the
    // slice holds `n` words and lives until after the stream finished (dropped at the end).
    unsafe { b.launch(shape(n)) }.map_err(dr)?;
    let export = cudarc_interop::export(&ctx, &header)?;
    println!(
        "producer: header from cudarc, exported as {:?}",
        export.kind()
    );
    let header_token = export.export()?.to_hex();

    // Route 1: the channel's buffers, viewed by cudarc.
    let name = format!("cudarc-pipeline-{}", std::process::id());
    let opts = ChannelOptions::new(FRAME_BYTES).buffers(4).memory(a.memory);
    let mut tx = Producer::create(&ctx, &name, &opts)?;
    println!("producer: pool memory {:?}", tx.memory_kind());
    let mut child = Child::spawn("consumer", &["--consumer-of", &name, &header_token])?;
    println!("  {}", child.line(Duration::from_secs(60))?);

    let words = (FRAME_BYTES / 4) as u64;
    let start = Instant::now();
    for i in 0..a.frames {
        let frame = tx.acquire(Some(Duration::from_secs(10)))?;
        {
            let stream = cudarc_interop::stream(&cx, frame.stream()?)?;
            let mut buf = cudarc_interop::slice::<u32, _>(&cx, frame.buffer()?)?;
            let mut view = buf.view_mut();
            let seed = i as u32;
            let mut b = stream.launch_builder(&fill);
            b.arg(&mut view).arg(&words).arg(&seed);
            // SAFETY: as above; the frame's buffer holds `words` words and is written only on the
            // frame's stream, before the publish below enqueues its ready word there.
            unsafe { b.launch(shape(words)) }.map_err(dr)?;
        }
        frame.publish(&FrameMeta::now(i, WIDTH, HEIGHT).encode())?;
    }
    tx.stream()?.synchronize()?;
    let secs = start.elapsed().as_secs_f64();
    if !wait_drained(&tx, Duration::from_secs(30)) {
        return Err("the consumer did not take every frame within 30 s".into());
    }
    let report = tx.close(Duration::from_secs(10))?;
    println!(
        "producer: published {} frames in {secs:.2} s = {:.0} frames/s, {:.1} GB/s; forced holds at close {}",
        a.frames,
        a.frames as f64 / secs,
        a.frames as f64 * FRAME_BYTES as f64 / secs / 1e9,
        report.forced_holds
    );
    // The consumer imported the header: it exits before the header is freed.
    let (ok, lines) = child.finish(Duration::from_secs(60))?;
    let mut failed = !ok;
    for l in lines {
        println!("  {l}");
        failed |= l.contains("FAIL");
    }
    drop(export);
    drop(header);
    side.synchronize().map_err(dr)?;
    drop(pool);
    if failed {
        return Err("the consumer failed".into());
    }
    println!("OK: every frame checked by a cudarc kernel in another process, 0 mismatches");
    Ok(())
}

fn consumer(channel: &str, header_hex: &str) -> Res<()> {
    let cx = CudaContext::new(0).map_err(dr)?;
    let ctx = cudarc_interop::context(&cx)?;
    let (_, check) = kernels(&cx)?;
    let own: Arc<CudaStream> = cx.new_stream().map_err(dr)?;
    let mut bad = own.alloc_zeros::<u64>(1).map_err(dr)?;
    own.synchronize().map_err(dr)?;

    // The header cudarc allocated in the producer, imported and checked by a cudarc kernel.
    let header = ImportedBuffer::open_in(&ctx, &Token::from_hex(header_hex)?)?;
    {
        let h = cudarc_interop::slice::<u32, _>(&cx, &header)?;
        let n = h.len() as u64;
        let mut b = own.launch_builder(&check);
        b.arg(&*h).arg(&n).arg(&HEADER_SEED).arg(&mut bad);
        // SAFETY: the arguments match `check_pattern(const unsigned*, ull, unsigned, ull*)`; both
        // buffers stay alive until the stream is synchronised below.
        unsafe { b.launch(shape(n)) }.map_err(dr)?;
        own.synchronize().map_err(dr)?;
    }
    let header_bad = own.clone_dtoh(&bad).map_err(dr)?[0];

    let rx = Consumer::attach_in(&ctx, channel, &ConsumerOptions::new())?;
    println!(
        "consumer (pid {}): attached, own context; header mismatches {header_bad}",
        std::process::id()
    );
    let mut received = 0u64;
    let mut out_of_order = 0u64;
    let mut start = None;
    loop {
        let frame = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(f) => f,
            Err(IpcError::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => return Err(e.into()),
        };
        start.get_or_insert_with(Instant::now);
        let index = FrameMeta::index_of(frame.metadata())?;
        if index != received {
            out_of_order += 1;
        }
        {
            let stream = cudarc_interop::stream(&cx, frame.stream()?)?;
            let buf = cudarc_interop::slice::<u32, _>(&cx, frame.buffer()?)?;
            let n = buf.len() as u64;
            let seed = index as u32;
            let mut b = stream.launch_builder(&check);
            b.arg(&*buf).arg(&n).arg(&seed).arg(&mut bad);
            // SAFETY: as above; the frame's buffer is valid until the frame drops, after the check
            // on the frame's stream (its release is recorded there after the kernel).
            unsafe { b.launch(shape(n)) }.map_err(dr)?;
        }
        received += 1;
        drop(frame);
    }
    rx.stream()?.synchronize()?;
    let secs = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    let mismatches = own.clone_dtoh(&bad).map_err(dr)?[0];
    drop(header);
    let ok = mismatches == 0 && out_of_order == 0 && received > 0;
    println!(
        "consumer: {} received {received} frames ({:.0} frames/s), mismatches {mismatches} (header {header_bad}), out of order {out_of_order}",
        if ok { "OK" } else { "FAIL" },
        received as f64 / secs.max(1e-9),
    );
    if !ok {
        return Err("consumer check failed".into());
    }
    Ok(())
}
