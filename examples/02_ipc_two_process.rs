//! Two processes, one buffer: A exports a device buffer and an interprocess event, B imports both,
//! waits on A's work on its own stream, checks every element, and writes a reply that A verifies.
//! Each process has its own CUDA context; no byte crosses through the host.
//!
//! ```text
//! cargo run --release -p cuda-ipc-examples --example 02_ipc_two_process [-- --mib 64]
//! ```
//! A re-executes this binary as B (CUDA does not survive `fork()` without exec) and sends B the two
//! tokens as hex lines on its stdin.

mod common;

use common::{Res, read_u64, zeroed_counter};
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory, Stream};
use cuda_ipc::ipc::{ImportedBuffer, IpcEvent};
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::token::Token;
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

const SEED: u32 = 0xA11CE;
const REPLY: u32 = 0xB0B;

fn main() {
    if let Err(e) = run() {
        eprintln!("02_ipc_two_process: {e}");
        std::process::exit(1);
    }
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--consumer") {
        return consumer();
    }
    let mib: usize = match args.iter().position(|a| a == "--mib") {
        Some(i) => args.get(i + 1).ok_or("--mib needs a value")?.parse()?,
        None => 64,
    };
    producer(mib << 20)
}

fn producer(bytes: usize) -> Res<()> {
    let ctx = Context::default_device()?;
    let dev = ctx.device();
    println!(
        "A (pid {}): {} {} , own context",
        std::process::id(),
        dev.name()?,
        dev.uuid()
    );
    let kernels = Kernels::load(&ctx)?;
    let stream = Stream::new(&ctx)?;
    let buf = DeviceBuffer::new(&ctx, bytes)?;
    let ready = IpcEvent::new(&ctx)?;

    let mut child = Command::new(std::env::current_exe()?)
        .arg("--consumer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut to_b = child.stdin.take().ok_or("no stdin")?;
    let mut from_b = std::io::BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    writeln!(to_b, "{}", buf.export()?.to_hex())?;
    writeln!(to_b, "{}", ready.export()?.to_hex())?;
    to_b.flush()?;
    println!("A: sent buffer token ({bytes} bytes) and event token");
    // Wait until B has imported both, then queue the work: 20 ms of GPU time before the fill, so
    // the fill is still running when B's stream starts waiting on the event.
    let line = from_b.next().ok_or("B exited before it was ready")??;
    println!("  {line}");
    kernels.spin(20_000_000, &stream)?;
    kernels.fill_pattern(&buf, SEED, &stream)?;
    ready.record(&stream)?;
    let t0 = Instant::now();
    writeln!(to_b, "go")?;
    to_b.flush()?;
    println!(
        "A: fill queued and event recorded; still in flight: {}",
        !ready.is_complete()?
    );

    let mut verdict = String::new();
    for line in from_b {
        let line = line?;
        println!("  {line}");
        if line.starts_with("B: replied") {
            verdict = line;
        }
    }
    let status = child.wait()?;
    if !status.success() || verdict.is_empty() {
        return Err(format!("B failed ({status})").into());
    }
    // B wrote pattern(REPLY) and synchronised before it replied; check it here.
    let counter = zeroed_counter(&ctx)?;
    kernels.check_pattern(&buf, REPLY, &counter, &stream)?;
    stream.synchronize()?;
    let bad = read_u64(&counter)?;
    println!(
        "A: B's reply checked, {bad} mismatched words of {}; round trip {:.1} ms",
        bytes / 4,
        t0.elapsed().as_secs_f64() * 1e3
    );
    if bad != 0 {
        return Err("reply mismatch".into());
    }
    println!("OK");
    Ok(())
}

fn consumer() -> Res<()> {
    let stdin = std::io::stdin();
    let next_line = || -> Res<String> {
        let mut l = String::new();
        if stdin.lock().read_line(&mut l)? == 0 {
            return Err("A closed the pipe".into());
        }
        Ok(l)
    };
    let (buf_tok, ev_tok) = (
        Token::from_hex(&next_line()?)?,
        Token::from_hex(&next_line()?)?,
    );
    let t = Instant::now();
    // Import on the device A named, by UUID, in this process's own context.
    let buf = ImportedBuffer::open(&buf_tok)?;
    let ready = IpcEvent::open(&ev_tok)?;
    let ctx = buf.context().clone();
    let import_ms = t.elapsed().as_secs_f64() * 1e3;
    let kernels = Kernels::load(&ctx)?;
    let stream = Stream::new(&ctx)?;
    // Zeroed before B waits on A's event: the zeroing waits for the whole context.
    let counter = zeroed_counter(&ctx)?;
    println!(
        "B (pid {}): imported {} bytes and the event in {import_ms:.2} ms, own context; ready",
        std::process::id(),
        buf.len()
    );
    std::io::stdout().flush()?;
    if next_line()?.trim() != "go" {
        return Err("expected go from A".into());
    }
    let in_flight = !ready.is_complete()?;
    stream.wait_event(&ready)?; // no host wait: B's stream waits for A's fill
    kernels.check_pattern(&buf, SEED, &counter, &stream)?;
    kernels.fill_pattern(&buf, REPLY, &stream)?;
    stream.synchronize()?;
    let bad = read_u64(&counter)?;
    println!("B: A's fill was in flight when B's stream started waiting: {in_flight}");
    println!("B: checked {} words, {bad} mismatched", buf.len() / 4);
    if bad != 0 {
        return Err(format!("{bad} words did not match A's pattern").into());
    }
    println!("B: replied with pattern {REPLY:#x}");
    Ok(())
}
