//! One read-only dataset in device memory, shared by several simulation processes with zero
//! copies: the owner allocates it once, fills it, and hands each simulation a token; every
//! simulation maps the same memory into its own CUDA context instead of loading its own copy.
//!
//! The owner fills `--mib M` MiB with `fill_pattern(seed = 42)` and computes the 64-bit sum of its
//! 32-bit words with `Kernels::sum` on the GPU (summing 1 GiB of the pattern on the host would be
//! slow). It starts `--sims S` simulations, passing the buffer's token as hex on their command line;
//! each imports it with `ImportedBuffer::open`, then `--rounds R` times sums the whole dataset and
//! counts the words that differ from the pattern (`check_pattern`), and prints its sum, mismatch
//! count, time per round and the import time. The owner checks that every simulation's sum equals
//! its own and that no word mismatched, keeps the buffer allocated until every simulation has
//! exited (an importer's mapping is undefined once the exporter frees the memory), and exits
//! non-zero on any failure.
//!
//! Read-only is a convention here, not a protection: legacy CUDA IPC (`cuIpcOpenMemHandle`) has no
//! read-only mapping, so an importer could write the dataset, and every other process would see it.
//! The simulations only read. Importers can reach only what the owner shares: the one allocation
//! the token names (allocate shared data apart from private data).
//!
//! ```text
//! cargo run --release --example shared_dataset -- [--mib 1024] [--sims 4] [--rounds 10]
//! ```

use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory, Stream};
use cuda_ipc::ipc::ImportedBuffer;
use cuda_ipc::kernels::Kernels;
use cuda_ipc::token::Token;
use std::error::Error;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// The dataset's pattern seed.
const SEED: u32 = 42;
/// How long each simulation may run, start-up (CUDA init, PTX JIT, import) included.
const SIM_TIMEOUT: Duration = Duration::from_secs(300);

type Res<T> = Result<T, Box<dyn Error>>;

struct Args {
    mib: usize,
    sims: usize,
    rounds: u32,
    /// `--sim K TOKEN`: run as simulation K on the dataset the token names.
    sim: Option<(usize, String)>,
}

fn parse() -> Res<Args> {
    let mut a = Args {
        mib: 1024,
        sims: 4,
        rounds: 10,
        sim: None,
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
            "--mib" => a.mib = v()?.parse()?,
            "--sims" => a.sims = v()?.parse()?,
            "--rounds" => a.rounds = v()?.parse()?,
            "--sim" => {
                let k = v()?.parse()?;
                a.sim = Some((k, v()?));
            }
            x => {
                return Err(
                    format!("unknown argument {x:?} (--mib M, --sims S, --rounds R)").into(),
                );
            }
        }
    }
    if a.mib == 0 || a.sims == 0 || a.rounds == 0 {
        return Err("--mib, --sims and --rounds must be at least 1".into());
    }
    Ok(a)
}

fn main() {
    let r = parse().and_then(|a| match &a.sim {
        Some((k, token)) => simulation(&a, *k, token),
        None => owner(&a),
    });
    if let Err(e) = r {
        eprintln!("shared_dataset: {e}");
        std::process::exit(1);
    }
}

/// Reads the `u64` at the start of `counter` (the caller synchronised the stream that wrote it).
fn read_u64(counter: &impl DeviceMemory) -> Res<u64> {
    let mut b = [0u8; 8];
    counter.copy_to_host(0, &mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// A zeroed 8-byte device counter. The zeroing copy runs on the legacy default stream, which our
/// non-blocking streams do not wait for, so wait for it here.
fn zeroed_counter(ctx: &std::sync::Arc<Context>) -> Res<DeviceBuffer> {
    let c = DeviceBuffer::new(ctx, 8)?;
    c.copy_from_host(0, &[0; 8])?;
    ctx.synchronize()?;
    Ok(c)
}

/// The value of `key=value` in a summary line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .map(|v| v.trim_end_matches([',', ';']))
}

/// A simulation this process started: this binary re-executed (CUDA does not survive `fork()`),
/// its stdout read line by line on a thread. Dropping it kills the child if it still runs.
struct Sim {
    index: usize,
    child: Child,
    lines: Receiver<String>,
}

impl Sim {
    fn spawn(index: usize, args: &[&str]) -> Res<Sim> {
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
        Ok(Sim {
            index,
            child,
            lines,
        })
    }

    /// Waits until `deadline` for the simulation to exit (then kills it); returns whether it
    /// exited successfully and the lines it printed.
    fn finish(&mut self, deadline: Instant) -> Res<(bool, Vec<String>)> {
        let mut lines = Vec::new();
        let ok = loop {
            if let Some(st) = self.child.try_wait()? {
                break st.success();
            }
            if Instant::now() >= deadline {
                self.child.kill()?;
                self.child.wait()?;
                lines.push(format!(
                    "sim {}: FAIL did not exit within {SIM_TIMEOUT:?}; killed",
                    self.index
                ));
                break false;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        // The child has exited, so its stdout reaches end of file and the reader ends.
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(5)) {
            lines.push(l);
        }
        Ok((ok, lines))
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn owner(a: &Args) -> Res<()> {
    let bytes = a.mib << 20;
    let ctx = Context::default_device()?;
    let kernels = Kernels::load(&ctx)?;
    let stream = Stream::new(&ctx)?;
    // The dataset is an allocation of its own: an importer maps the whole allocation.
    let data = DeviceBuffer::new(&ctx, bytes)?;
    let sum = zeroed_counter(&ctx)?;
    let t = Instant::now();
    kernels.fill_pattern(&data, SEED, &stream)?;
    kernels.sum(&data, &sum, &stream)?;
    stream.synchronize()?;
    let expected = read_u64(&sum)?;
    println!(
        "owner (pid {}): {} {}; dataset of {} MiB filled and summed in {:.1} ms: sum={expected:#018x}",
        std::process::id(),
        ctx.device().name()?,
        ctx.device().uuid(),
        a.mib,
        t.elapsed().as_secs_f64() * 1e3
    );
    let token = data.export()?.to_hex();

    let rounds = a.rounds.to_string();
    let mut sims = Vec::with_capacity(a.sims);
    for k in 0..a.sims {
        let id = k.to_string();
        sims.push(Sim::spawn(k, &["--sim", &id, &token, "--rounds", &rounds])?);
    }
    let deadline = Instant::now() + SIM_TIMEOUT;
    let mut failures = Vec::new();
    for s in &mut sims {
        let (ok, lines) = s.finish(deadline)?;
        let mut checked = false;
        for l in &lines {
            println!("  {l}");
            if let (Some(got), Some(bad)) = (field(l, "sum="), field(l, "mismatches=")) {
                let got = u64::from_str_radix(got.trim_start_matches("0x"), 16)?;
                let bad: u64 = bad.parse()?;
                checked = got == expected && bad == 0;
            }
        }
        if !ok || !checked {
            failures.push(s.index.to_string());
        }
    }
    // Every simulation has exited: only now may the dataset be freed.
    drop(sims);
    drop(data);
    if !failures.is_empty() {
        return Err(format!(
            "simulation(s) {} failed or disagreed with the owner's sum {expected:#018x}",
            failures.join(", ")
        )
        .into());
    }
    println!(
        "OK: {} simulations each read the one {} MiB dataset {} times: every sum equals the owner's, zero mismatched words",
        a.sims, a.mib, a.rounds
    );
    Ok(())
}

fn simulation(a: &Args, k: usize, token_hex: &str) -> Res<()> {
    let token = Token::from_hex(token_hex)?;
    let t = Instant::now();
    // In the primary context of the device that holds the dataset (found by UUID).
    let data = ImportedBuffer::open(&token)?;
    let import_ms = t.elapsed().as_secs_f64() * 1e3;
    let ctx = data.context().clone();
    let kernels = Kernels::load(&ctx)?;
    let stream = Stream::new(&ctx)?;
    let sum = zeroed_counter(&ctx)?;
    let mismatches = zeroed_counter(&ctx)?;
    // The counters accumulate; each round's result is the difference from the previous reading.
    let (mut last_sum, mut last_bad) = (0u64, 0u64);
    let mut first = None::<u64>;
    let mut inconsistent = 0u32;
    let mut total_bad = 0u64;
    let t = Instant::now();
    for _ in 0..a.rounds {
        kernels.sum(&data, &sum, &stream)?;
        kernels.check_pattern(&data, SEED, &mismatches, &stream)?;
        stream.synchronize()?;
        let (s, b) = (read_u64(&sum)?, read_u64(&mismatches)?);
        let round_sum = s.wrapping_sub(last_sum);
        total_bad += b.wrapping_sub(last_bad);
        (last_sum, last_bad) = (s, b);
        if *first.get_or_insert(round_sum) != round_sum {
            inconsistent += 1;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let got = first.ok_or("no rounds")?;
    let ok = total_bad == 0 && inconsistent == 0;
    println!(
        "sim {k} (pid {}): {} sum={got:#018x} mismatches={total_bad} over {} rounds ({inconsistent} rounds disagreed); {:.2} ms/round, {:.1} GB/s read; import {import_ms:.2} ms",
        std::process::id(),
        if ok { "OK" } else { "FAIL" },
        a.rounds,
        secs * 1e3 / f64::from(a.rounds),
        2.0 * f64::from(a.rounds) * data.len() as f64 / secs / 1e9,
    );
    if !ok {
        return Err(format!("sim {k}: check failed").into());
    }
    Ok(())
}
