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
//! cargo run --release -p cuda-ipc-examples --example 03_shared_dataset --
//!     [--mib 1024] [--sims 4] [--rounds 10]
//! ```

mod common;

use common::args::Argv;
use common::child::Child;
use common::{Res, field, read_u64, zeroed_counter};
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory, Stream};
use cuda_ipc::ipc::ImportedBuffer;
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::token::Token;
use std::time::{Duration, Instant};

/// The dataset's pattern seed.
const SEED: u32 = 42;
/// How long each simulation may run, start-up (CUDA init, PTX JIT, import) included.
const SIM_TIMEOUT: Duration = Duration::from_secs(300);

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
    let mut args = Argv::from_env();
    while let Some(k) = args.flag() {
        match k.as_str() {
            "--mib" => a.mib = args.parse(&k)?,
            "--sims" => a.sims = args.parse(&k)?,
            "--rounds" => a.rounds = args.parse(&k)?,
            "--sim" => {
                let index = args.parse(&k)?;
                a.sim = Some((index, args.value(&k)?));
            }
            "-h" | "--help" => {
                println!("usage: 03_shared_dataset [--mib M] [--sims S] [--rounds R]");
                std::process::exit(0);
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
        eprintln!("03_shared_dataset: {e}");
        std::process::exit(1);
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
        let args = ["--sim", &id, &token, "--rounds", &rounds];
        sims.push(Child::spawn(&format!("sim {k}"), &args)?);
    }
    let deadline = Instant::now() + SIM_TIMEOUT;
    let mut failures = Vec::new();
    for (k, s) in sims.iter_mut().enumerate() {
        let (ok, lines) = s.finish_by(deadline, SIM_TIMEOUT)?;
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
            failures.push(k.to_string());
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
