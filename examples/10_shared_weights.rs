//! Shared weights: one writer process publishes a model-shaped tensor set (bf16 layers, fp32
//! norms) and updates every tensor in each generation; N reader processes map it once, read-only,
//! and check every generation they take with a kernel on their own stream (each tensor filled with
//! a pattern of its generation). Prints the driver imports per reader open, the generations seen,
//! the mismatches, and exits non-zero on any. `--host` runs the same protocol in shared host
//! memory, without a GPU (bytes checked on the CPU).
//!
//! ```text
//! cargo run --release -p cuda-ipc-examples --example 10_shared_weights -- [--generations 200]
//!     [--readers 2] [--layers 8] [--buffered] [--memory vmm|pool|legacy|auto] [--host]
//! ```

mod common;

use common::Res;
use common::args::{Argv, memory_kind};
use common::child::Child;
use common::{read_u64, zeroed_counter};
use cuda_ipc::Error as IpcError;
use cuda_ipc::channel::MemoryKind;
use cuda_ipc::driver::Context;
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::tensorset::{
    DType, GenerationMode, Held, ReaderOptions, TensorSetError, TensorSetOptions, TensorSetReader,
    TensorSetWriter, TensorSpec,
};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: 10_shared_weights [--generations 200] [--readers 2] [--layers 8]
    [--buffered] [--memory vmm|pool|legacy|auto] [--host]";

struct Args {
    generations: u64,
    readers: usize,
    layers: usize,
    buffered: bool,
    memory: MemoryKind,
    host: bool,
    reader_of: Option<(String, String)>,
    /// A reader's expected layout fingerprint (hex), passed by the writer.
    expect_layout: Option<String>,
}

fn parse() -> Res<Args> {
    let mut a = Args {
        generations: 200,
        readers: 2,
        layers: 8,
        buffered: false,
        memory: MemoryKind::Vmm,
        host: false,
        reader_of: None,
        expect_layout: None,
    };
    let mut args = Argv::from_env();
    while let Some(k) = args.flag() {
        match k.as_str() {
            "--generations" => a.generations = args.parse(&k)?,
            "--readers" => a.readers = args.parse(&k)?,
            "--layers" => a.layers = args.parse(&k)?,
            "--buffered" => a.buffered = true,
            "--memory" => a.memory = memory_kind(&args.value(&k)?)?,
            "--host" => a.host = true,
            "--expect-layout" => a.expect_layout = Some(args.value(&k)?),
            "--reader-of" => {
                let set = args.value(&k)?;
                a.reader_of = Some((set, args.value_or("missing index")?));
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

/// A model-shaped set: per layer a `d` × `d` bf16 weight and a `d` fp32 norm, then a 4`d` × `d`
/// head (`d` = 1024 on the GPU, 128 on the host, where the CPU writes and checks every byte).
fn specs(layers: usize, d: i64) -> Vec<TensorSpec> {
    let mut v = Vec::new();
    for l in 0..layers {
        v.push(TensorSpec::new(
            format!("layers.{l}.weight"),
            DType::BF16,
            &[d, d],
        ));
        v.push(TensorSpec::new(
            format!("layers.{l}.norm"),
            DType::F32,
            &[d],
        ));
    }
    v.push(TensorSpec::new("head.weight", DType::BF16, &[4 * d, d]));
    v
}

/// The pattern seed of tensor `t` in generation `g`.
fn seed(g: u64, t: usize) -> u32 {
    (g as u32).wrapping_mul(1024).wrapping_add(t as u32)
}

/// Byte `k` of tensor `t` in generation `g` of a host set.
fn host_byte(g: u64, t: usize, k: usize) -> u8 {
    (seed(g, t).wrapping_mul(2_654_435_761) >> 24) as u8 ^ (k as u8)
}

fn main() {
    common::warn_if_unoptimised();
    let r = parse().and_then(|a| match &a.reader_of {
        Some((set, idx)) => reader(&a, set, idx),
        None => writer(&a),
    });
    if let Err(e) = r {
        eprintln!("10_shared_weights: {e}");
        std::process::exit(1);
    }
}

fn writer(a: &Args) -> Res<()> {
    let name = format!("weights-{}", std::process::id());
    let mode = if a.buffered {
        GenerationMode::Buffered(2)
    } else {
        GenerationMode::InPlace
    };
    let opts = TensorSetOptions::new().mode(mode).memory(a.memory);
    let specs = specs(a.layers, if a.host { 128 } else { 1024 });
    let (mut w, gpu) = if a.host {
        (TensorSetWriter::create_host(&name, &specs, &opts)?, None)
    } else {
        let ctx = Context::default_device()?;
        let k = Kernels::load(&ctx)?;
        (
            TensorSetWriter::create(&ctx, &name, &specs, &opts)?,
            Some((ctx, k)),
        )
    };
    let layout = w.layout().clone();
    println!(
        "writer (pid {}): set {name}: {} tensors, {} bytes per buffer, memory {:?}, {:?}, layout {}",
        std::process::id(),
        layout.len(),
        layout.bytes_per_buffer(),
        w.memory_kind(),
        w.mode(),
        layout.fingerprint()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    // Generation 1 before the readers open, so each has something to map and check at once.
    let publish = |w: &mut TensorSetWriter| -> Res<u64> {
        let mut u = w.begin(Some(Duration::from_secs(30)))?;
        let g = u.generation();
        for (t, info) in layout.tensors().iter().enumerate() {
            match &gpu {
                Some((_, k)) => k.fill_pattern(&u.device_tensor(t)?, seed(g, t), u.stream()?)?,
                None => {
                    let bytes: Vec<u8> = (0..info.bytes as usize)
                        .map(|b| host_byte(g, t, b))
                        .collect();
                    u.write_tensor(t, &bytes)?;
                }
            }
        }
        Ok(u.commit()?)
    };
    publish(&mut w)?;
    let fp: String = layout
        .fingerprint()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut children = Vec::new();
    for i in 0..a.readers {
        let idx = i.to_string();
        let mut args = vec!["--reader-of", &name, &idx, "--expect-layout", &fp];
        if a.host {
            args.push("--host");
        }
        let c = Child::spawn(&format!("reader {i}"), &args)?;
        println!("  {}", c.line(Duration::from_secs(60))?);
        children.push(c);
    }
    let start = Instant::now();
    for _ in 1..a.generations {
        publish(&mut w)?;
    }
    if let Some((..)) = &gpu {
        w.stream()?.synchronize()?;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "writer: {} generations in {secs:.2} s ({:.0}/s, {:.1} GB/s written)",
        a.generations,
        a.generations as f64 / secs,
        a.generations as f64 * layout.bytes_per_buffer() as f64 / secs / 1e9
    );
    // Let readers take the last generation before the close withdraws it.
    std::thread::sleep(Duration::from_millis(300));
    w.close(Duration::from_secs(10))?;
    let mut failed = false;
    for c in &mut children {
        let (ok, lines) = c.finish(Duration::from_secs(60))?;
        for l in lines {
            println!("  {l}");
            failed |= l.contains("FAIL");
        }
        failed |= !ok;
    }
    if failed {
        return Err("a reader failed".into());
    }
    println!("OK: every generation a reader took was checked, zero mismatches");
    Ok(())
}

fn check_host(h: &Held<'_>, n: usize) -> Res<u64> {
    let mut bad = 0;
    for t in 0..n {
        for (k, b) in h.read_tensor(t)?.iter().enumerate() {
            if *b != host_byte(h.generation(), t, k) {
                bad += 1;
            }
        }
    }
    Ok(bad)
}

fn reader(a: &Args, set: &str, idx: &str) -> Res<()> {
    // The writer passes its layout fingerprint: a reader refuses any other set under the name.
    let fp = a
        .expect_layout
        .as_deref()
        .ok_or("missing --expect-layout")?;
    let mut expect = [0u8; 32];
    for (i, b) in expect.iter_mut().enumerate() {
        *b = u8::from_str_radix(fp.get(2 * i..2 * i + 2).ok_or("short fingerprint")?, 16)?;
    }
    let opts = ReaderOptions::new().expect_layout(expect);
    let t = Instant::now();
    let (r, gpu) = if a.host {
        (TensorSetReader::open_host(set, &opts)?, None)
    } else {
        let ctx = Context::default_device()?;
        let r = TensorSetReader::open(&ctx, set, &opts)?;
        let k = Kernels::load(&ctx)?;
        let bad = zeroed_counter(&ctx)?;
        (r, Some((k, bad)))
    };
    println!(
        "reader {idx} (pid {}): opened in {:.2} ms, {} driver imports, read-only {}",
        std::process::id(),
        t.elapsed().as_secs_f64() * 1e3,
        r.imports(),
        r.is_read_only()
    );
    let n = r.layout().len();
    let (mut seen, mut last, mut host_bad) = (0u64, 0u64, 0u64);
    loop {
        let h = match r.wait_newer(last, Some(Duration::from_secs(30))) {
            Ok(h) => h,
            Err(IpcError::TensorSet(TensorSetError::Closed(_))) => break,
            Err(e) => return Err(e.into()),
        };
        match &gpu {
            Some((k, bad)) => {
                for t in 0..n {
                    k.check_pattern(
                        &h.device_tensor(t)?,
                        seed(h.generation(), t),
                        bad,
                        h.stream()?,
                    )?;
                }
            }
            None => host_bad += check_host(&h, n)?,
        }
        last = h.generation();
        seen += 1;
        // Dropping `h` releases the generation after the check on this reader's stream.
    }
    let bad = match &gpu {
        Some((_, bad)) => {
            r.stream()?.synchronize()?;
            read_u64(bad)?
        }
        None => host_bad,
    };
    let ok = bad == 0 && seen > 0;
    println!(
        "reader {idx}: {} took {seen} generations (last {last}), mismatched {}: {bad}",
        if ok { "OK" } else { "FAIL" },
        if gpu.is_some() { "words" } else { "bytes" }
    );
    if !ok {
        return Err("reader check failed".into());
    }
    Ok(())
}
