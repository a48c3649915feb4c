//! A host-memory channel between two CPU processes, no GPU needed: this process is the producer and
//! starts itself again as the consumer; every frame's bytes are checked.
//!
//! `cargo run -p cuda-ipc-examples --example 04_host_pipeline -- --frames N [--bytes B]` prints
//! frames/s and `OK`.

use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
use std::error::Error;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn Error>>;

/// Byte `k` of frame `seq`.
fn pattern(seq: u64, k: usize) -> u8 {
    (seq as u8).wrapping_mul(37) ^ (k as u8)
}

fn consumer(name: &str) -> Res<()> {
    let rx = Consumer::attach(name, &ConsumerOptions::new())?;
    println!("attached");
    let mut buf = Vec::new();
    let mut n = 0u64;
    loop {
        let f = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(f) => f,
            Err(cuda_ipc::Error::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => return Err(e.into()),
        };
        buf.resize(f.len(), 0);
        // A copy out of the shared pool: the frame's bytes are never borrowed as a `&[u8]`.
        f.read_at(0, &mut buf)?;
        if let Some(k) = (0..buf.len()).find(|&k| buf[k] != pattern(f.seq(), k)) {
            return Err(format!("frame {} byte {k} is wrong", f.seq()).into());
        }
        n += 1;
    }
    println!("received {n}");
    Ok(())
}

fn main() {
    // The error's Display text (what failed and how), not the Debug form `?` out of main prints.
    if let Err(e) = run() {
        eprintln!("host_pipeline: {e}");
        std::process::exit(1);
    }
}

fn run() -> Res<()> {
    let mut args = std::env::args().skip(1);
    let (mut frames, mut bytes, mut role) = (1000u64, 64 << 10, None);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--frames" => frames = args.next().ok_or("--frames needs a value")?.parse()?,
            "--bytes" => bytes = args.next().ok_or("--bytes needs a value")?.parse()?,
            "--consumer" => role = Some(args.next().ok_or("--consumer needs a name")?),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    if let Some(name) = role {
        return consumer(&name);
    }
    // First, in the process the user started: a rate measured without optimisation misleads.
    if cfg!(debug_assertions) {
        eprintln!("built without optimisation: rates are ~50x lower; run with --release");
    }
    let name = format!("host-pipeline-{}", std::process::id());
    let mut tx = Producer::create_host(&name, &ChannelOptions::new(bytes).buffers(4))?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--consumer", &name])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    if lines.next().transpose()?.as_deref() != Some("attached") {
        return Err("the consumer did not attach".into());
    }
    let mut data = vec![0u8; bytes];
    let start = Instant::now();
    for seq in 1..=frames {
        for (k, b) in data.iter_mut().enumerate() {
            *b = pattern(seq, k);
        }
        let mut w = tx.acquire(Some(Duration::from_secs(30)))?;
        w.write_at(0, &data)?;
        w.publish(&seq.to_le_bytes())?;
    }
    let report = tx.close(Duration::from_secs(30))?;
    let secs = start.elapsed().as_secs_f64();
    let last = lines.next().transpose()?.unwrap_or_default();
    if !child.wait()?.success() || last != format!("received {frames}") {
        return Err(format!("the consumer failed ({last:?})").into());
    }
    if report.forced_holds != 0 {
        return Err(format!("{} holds were forced at close", report.forced_holds).into());
    }
    println!(
        "{frames} frames of {bytes} bytes in {secs:.3} s: {:.0} frames/s, {:.2} GB/s",
        frames as f64 / secs,
        frames as f64 * bytes as f64 / secs / 1e9
    );
    println!("OK");
    Ok(())
}
