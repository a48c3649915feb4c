//! One read-only dataset in device memory, shared by several simulation processes with zero
//! copies: the owner publishes it once as a tensor set, and every simulation maps the same memory
//! into its own CUDA context instead of loading its own copy.
//!
//! The owner creates a `TensorSetWriter` (VMM memory, in place) holding `--mib M` MiB as a few
//! `u32` tensors (`shard.0`, ...), fills each with `fill_pattern(seed = 42)` on the writer's stream,
//! computes the 64-bit sum of all the words with `Kernels::sum` (summing 1 GiB of the pattern on
//! the host would be slow) and commits generation 1. It starts `--sims S` simulations, passing the
//! set's name on their command line; each opens it with `TensorSetReader::open_auto`, holds the
//! generation, then `--rounds R` times sums the whole dataset and counts the words that differ
//! from the pattern (`check_pattern`) on the reader's own stream, and prints its sum, mismatch
//! count, time per round, the open time and the driver imports the open made (`imports()`). The
//! owner checks that every simulation's sum equals its own and that no word mismatched, keeps the
//! set until every simulation has exited, closes it, and exits non-zero on any failure.
//!
//! Read-only is enforced, not a convention: the readers map the VMM allocation read-only
//! (`cuMemSetAccess` with read access only, `TensorSetReader::is_read_only`, printed by each
//! simulation). A stray PyTorch or Rust write into it faults that reader's context (a CUDA error in
//! that process, which must then be restarted); the owner and the other simulations go on, and the
//! dataset is unchanged. Readers can reach only what the owner shares: the set's own allocations
//! (allocate shared data apart from private data).
//!
//! ```text
//! cargo run --release -p cuda-ipc-examples --example 03_shared_dataset --
//!     [--mib 1024] [--sims 4] [--rounds 10]
//! ```

mod common;

use common::args::Argv;
use common::child::Child;
use common::{Res, field, read_u64, zeroed_counter};
use cuda_ipc::channel::MemoryKind;
use cuda_ipc::driver::{Context, DeviceMemory};
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::tensorset::{
    DType, GenerationMode, ReaderOptions, TensorSetOptions, TensorSetReader, TensorSetWriter,
    TensorSpec,
};
use std::time::{Duration, Instant};

/// The dataset's pattern seed.
const SEED: u32 = 42;
/// How long each simulation may run, start-up (CUDA init, PTX JIT, open) included.
const SIM_TIMEOUT: Duration = Duration::from_secs(300);
/// The dataset is split in at most this many tensors.
const SHARDS: usize = 4;

struct Args {
    mib: usize,
    sims: usize,
    rounds: u32,
    /// `--sim K SET`: run as simulation K on tensor set SET.
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
    common::warn_if_unoptimised();
    let r = parse().and_then(|a| match &a.sim {
        Some((k, set)) => simulation(&a, *k, set),
        None => owner(&a),
    });
    if let Err(e) = r {
        eprintln!("03_shared_dataset: {e}");
        std::process::exit(1);
    }
}

/// `--mib M` MiB of `u32` words as `min(M, SHARDS)` tensors, the last one taking the remainder.
fn specs(mib: usize) -> Res<Vec<TensorSpec>> {
    let words = i64::try_from(mib << 18)?;
    let n = mib.min(SHARDS) as i64;
    Ok((0..n)
        .map(|s| {
            let len = if s == n - 1 {
                words - (n - 1) * (words / n)
            } else {
                words / n
            };
            TensorSpec::new(format!("shard.{s}"), DType::U32, &[len])
        })
        .collect())
}

fn owner(a: &Args) -> Res<()> {
    let name = format!("dataset-{}", std::process::id());
    let ctx = Context::default_device()?;
    let kernels = Kernels::load(&ctx)?;
    let opts = TensorSetOptions::new()
        .memory(MemoryKind::Vmm)
        .mode(GenerationMode::InPlace);
    let mut set = TensorSetWriter::create(&ctx, &name, &specs(a.mib)?, &opts)?;
    let shards = set.layout().len();
    let sum = zeroed_counter(&ctx)?;
    let t = Instant::now();
    let update = set.begin(Some(Duration::from_secs(30)))?;
    for s in 0..shards {
        let tensor = update.device_tensor(s)?;
        kernels.fill_pattern(&tensor, SEED, update.stream()?)?;
        kernels.sum(&tensor, &sum, update.stream()?)?;
    }
    let generation = update.commit()?;
    set.stream()?.synchronize()?;
    let expected = read_u64(&sum)?;
    println!(
        "owner (pid {}): {} {}; dataset of {} MiB in {shards} u32 tensors (set {name}, generation {generation}) filled and summed in {:.1} ms: sum={expected:#018x}",
        std::process::id(),
        ctx.device().name()?,
        ctx.device().uuid(),
        a.mib,
        t.elapsed().as_secs_f64() * 1e3
    );

    let rounds = a.rounds.to_string();
    let mut sims = Vec::with_capacity(a.sims);
    for k in 0..a.sims {
        let id = k.to_string();
        let args = ["--sim", &id, &name, "--rounds", &rounds];
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
    // Every simulation has exited (and released the generation): only now is the set closed.
    drop(sims);
    set.close(Duration::from_secs(10))?;
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

fn simulation(a: &Args, k: usize, set: &str) -> Res<()> {
    let t = Instant::now();
    // In the primary context of the device that holds the set (found by UUID), mapped read-only.
    let data = TensorSetReader::open_auto(set, &ReaderOptions::new().read_only(true))?;
    let open_ms = t.elapsed().as_secs_f64() * 1e3;
    // Held for every round: an in-place writer does not rewrite it meanwhile.
    let held = data.wait_newer(0, Some(Duration::from_secs(30)))?;
    let stream = data.stream()?;
    let ctx = stream.context().clone();
    let kernels = Kernels::load(&ctx)?;
    let sum = zeroed_counter(&ctx)?;
    let mismatches = zeroed_counter(&ctx)?;
    let shards = data.layout().len();
    let bytes: usize = (0..shards)
        .map(|s| held.device_tensor(s).map(|t| t.len()))
        .sum::<Result<_, _>>()?;
    // The counters accumulate; each round's result is the difference from the previous reading.
    let (mut last_sum, mut last_bad) = (0u64, 0u64);
    let mut first = None::<u64>;
    let mut inconsistent = 0u32;
    let mut total_bad = 0u64;
    let t = Instant::now();
    for _ in 0..a.rounds {
        for s in 0..shards {
            let tensor = held.device_tensor(s)?;
            kernels.sum(&tensor, &sum, stream)?;
            kernels.check_pattern(&tensor, SEED, &mismatches, stream)?;
        }
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
    let generation = held.generation();
    // The release is ordered after this stream's rounds.
    drop(held);
    let got = first.ok_or("no rounds")?;
    let ok = total_bad == 0 && inconsistent == 0;
    println!(
        "sim {k} (pid {}): {} sum={got:#018x} mismatches={total_bad} over {} rounds of generation {generation} ({inconsistent} rounds disagreed); {:.2} ms/round, {:.1} GB/s read; open {open_ms:.2} ms, {} driver imports, read-only {}",
        std::process::id(),
        if ok { "OK" } else { "FAIL" },
        a.rounds,
        secs * 1e3 / f64::from(a.rounds),
        2.0 * f64::from(a.rounds) * bytes as f64 / secs / 1e9,
        data.imports(),
        data.is_read_only(),
    );
    if !ok {
        return Err(format!("sim {k}: check failed").into());
    }
    Ok(())
}
