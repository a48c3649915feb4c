//! The cost of a reader's switch of its stable addresses to a new generation
//! (`TensorSetReader::switch_stable`, docs/ARCHITECTURE.md "Tensor sets"): a buffered VMM tensor
//! set (B = 2) of the Llama-3-8B shape (291 bf16 tensors at 256-byte offsets, one allocation of
//! 15.0 GiB per buffer), written by this process, read by a fresh child process opened with
//! `ReaderOptions::stable_addresses(true)`.
//!
//! The parent publishes generation after generation (nothing written: the bytes do not change
//! what a switch costs) and sends each number to the child over its stdin; the child takes it
//! (`wait_newer`), switches to it and answers with one JSON line: the call's wall time measured
//! around it (`wall_us`), the crate's own figures (`switch_us`: the whole call, the wait for the
//! context included; `remap_us`: `cuMemRetainAllocationHandle`, `cuMemUnmap`, `cuMemMap`,
//! `cuMemSetAccess` read-only, `cuMemRelease` alone) and whether it remapped. The buffers
//! alternate, so every switch but the first (which maps into an empty range and is reported
//! apart) unmaps one generation and maps the other. The parent prints one JSON object: medians,
//! minimum and maximum over `--switches N` (default and at least 20) switches, and every figure;
//! with `--out DIR` it also writes `DIR/tensorset_stable_switch.json`.
//!
//! ```text
//! cargo build --release -p cuda-ipc-bench --example tensorset_stable_switch
//! target/release/examples/tensorset_stable_switch [--quick] [--switches N] [--bytes N]
//!     [--device D] [--out DIR]
//! ```
//! `--quick`: 64 MiB per buffer; `--bytes N`: one bf16 tensor of N bytes per buffer. Every wait
//! is bounded (a child that does not answer within 60 s is killed and the run fails).

use cuda_ipc::driver::Device;
use cuda_ipc::tensorset::{
    DType, GenerationMode, ReaderOptions, TensorSetOptions, TensorSetReader, TensorSetWriter,
    TensorSpec,
};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The longest any one wait (a child's answer, a generation's buffer) may take.
const STEP: Duration = Duration::from_secs(60);

/// The shapes of Llama-3-8B's 291 tensors (bf16), as `floor/tensorset_floor.rs` has them.
fn llama_shapes() -> Vec<Vec<i64>> {
    let mut v = vec![vec![128_256, 4096]];
    for _ in 0..32 {
        v.extend([
            vec![4096, 4096],
            vec![1024, 4096],
            vec![1024, 4096],
            vec![4096, 4096],
            vec![14_336, 4096],
            vec![14_336, 4096],
            vec![4096, 14_336],
            vec![4096],
            vec![4096],
        ]);
    }
    v.push(vec![4096]);
    v.push(vec![128_256, 4096]);
    v
}

#[derive(Debug)]
struct Opts {
    switches: usize,
    /// One bf16 tensor of these bytes per buffer; 0: the Llama shape.
    bytes: u64,
    device: usize,
    out: Option<std::path::PathBuf>,
}

const USAGE: &str = "usage: tensorset_stable_switch [--quick] [--switches N (>= 20)] [--bytes N] \
                     [--device D] [--out DIR]";

fn parse(args: &[String]) -> Res<Opts> {
    let mut o = Opts {
        switches: 20,
        bytes: 0,
        device: 0,
        out: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{a} needs a value\n{USAGE}"))
        };
        match a.as_str() {
            "--quick" => o.bytes = 64 << 20,
            "--switches" => o.switches = value()?.parse()?,
            "--bytes" => o.bytes = value()?.parse()?,
            "--device" => o.device = value()?.parse()?,
            "--out" => o.out = Some(value()?.into()),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {a}\n{USAGE}").into()),
        }
    }
    if o.switches < 20 {
        return Err(format!("--switches {} is under 20\n{USAGE}", o.switches).into());
    }
    if o.bytes % 2 == 1 {
        return Err(format!(
            "--bytes {} is not a whole number of bf16s\n{USAGE}",
            o.bytes
        )
        .into());
    }
    Ok(o)
}

fn specs(bytes: u64) -> Vec<TensorSpec> {
    if bytes > 0 {
        return vec![TensorSpec::new("w", DType::BF16, &[(bytes / 2) as i64])];
    }
    llama_shapes()
        .iter()
        .enumerate()
        .map(|(i, s)| TensorSpec::new(format!("t{i}"), DType::BF16, s))
        .collect()
}

fn median(v: &[u64]) -> u64 {
    let mut s = v.to_vec();
    s.sort_unstable();
    s.get(s.len() / 2).copied().unwrap_or(0)
}

/// The child: opens the set with stable addresses, then per line `G` from stdin takes generation
/// `G`, switches to it and prints one JSON line.
fn child(name: &str, device: usize) -> Res<()> {
    let ctx = Device::get(device)?.primary_context()?;
    let opts = ReaderOptions::new().stable_addresses(true);
    let r = TensorSetReader::open(&ctx, name, &opts)?;
    let first = r.stable_ptr(0)?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{}",
        json!({"ready": true, "read_only": r.is_read_only()})
    )?;
    out.flush()?;
    let mut last = 0;
    for line in std::io::stdin().lines() {
        let want: u64 = line?.trim().parse()?;
        let held = r.wait_newer(last, Some(STEP))?;
        if held.generation() != want {
            return Err(format!("took generation {} for {want}", held.generation()).into());
        }
        let t = Instant::now();
        let s = r.switch_stable(held)?;
        let wall = t.elapsed().as_micros() as u64;
        if r.stable_ptr(0)? != first {
            return Err("a stable address moved".into());
        }
        last = want;
        let line = json!({
            "generation": s.generation, "remapped": s.remapped, "wall_us": wall,
            "switch_us": s.micros, "remap_us": s.remap_micros,
        });
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    Ok(())
}

/// The child's next stdout line as JSON, within `STEP`.
fn answer(lines: &mpsc::Receiver<String>, child: &mut Child) -> Res<Value> {
    match lines.recv_timeout(STEP) {
        Ok(l) => Ok(serde_json::from_str(&l)?),
        Err(_) => {
            let _ = child.kill();
            Err("the child did not answer within 60 s".into())
        }
    }
}

fn parent(o: &Opts) -> Res<()> {
    let ctx = Device::get(o.device)?.primary_context()?;
    let name = format!("stable-switch-{}", std::process::id());
    let sopts = TensorSetOptions::new().mode(GenerationMode::Buffered(2));
    let mut w = TensorSetWriter::create(&ctx, &name, &specs(o.bytes), &sopts)?;
    let bytes = w.layout().allocations().iter().sum::<u64>();
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--child", &name, &o.device.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let ready = answer(&lines, &mut child)?;
    let mut rows = Vec::new();
    for _ in 0..=o.switches {
        let u = w.begin(Some(STEP))?;
        let g = u.commit()?;
        writeln!(stdin, "{g}")?;
        stdin.flush()?;
        let a = answer(&lines, &mut child)?;
        if a["generation"] != json!(g) || a["remapped"] != json!(true) {
            let _ = child.kill();
            return Err(format!("generation {g}: the child answered {a}").into());
        }
        rows.push(a);
    }
    drop(stdin);
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("the child failed: {status}").into());
    }
    w.close(STEP)?;
    let first = rows.remove(0);
    let col = |k: &str| -> Vec<u64> { rows.iter().filter_map(|r| r[k].as_u64()).collect() };
    let (wall, switch, remap) = (col("wall_us"), col("switch_us"), col("remap_us"));
    let report = json!({
        "bench": "tensorset_stable_switch",
        "device": Device::get(o.device)?.name()?,
        "buffers": 2,
        "allocations_per_buffer": 1,
        "bytes_per_buffer": bytes,
        "tensors": specs(o.bytes).len(),
        "read_only": ready["read_only"],
        "switches": rows.len(),
        "wall_us_median": median(&wall),
        "switch_us_median": median(&switch),
        "remap_us_median": median(&remap),
        "switch_us_min": switch.iter().min(),
        "switch_us_max": switch.iter().max(),
        "first_switch": first,
        "wall_us": wall,
        "switch_us": switch,
        "remap_us": remap,
    });
    println!("{report}");
    if let Some(dir) = &o.out {
        std::fs::create_dir_all(dir)?;
        std::fs::write(
            dir.join("tensorset_stable_switch.json"),
            serde_json::to_string_pretty(&report)?,
        )?;
    }
    Ok(())
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let r = if argv.first().map(String::as_str) == Some("--child") {
        (|| -> Res<()> {
            let [_, name, device] = argv.as_slice() else {
                return Err("--child NAME DEVICE".into());
            };
            child(name, device.parse()?)
        })()
    } else {
        parse(&argv).and_then(|o| parent(&o))
    };
    if let Err(e) = r {
        eprintln!("tensorset_stable_switch: {e}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(v: &[&str]) -> Res<Opts> {
        parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn the_default_is_the_llama_shape_in_twenty_switches() {
        let o = a(&[]).unwrap();
        assert_eq!((o.switches, o.bytes), (20, 0));
        let s = specs(0);
        assert_eq!(s.len(), 291);
        let quick = a(&["--quick", "--switches", "30"]).unwrap();
        assert_eq!((quick.switches, quick.bytes), (30, 64 << 20));
        assert_eq!(specs(quick.bytes).len(), 1);
    }

    #[test]
    fn too_few_switches_and_odd_bytes_are_refused() {
        assert!(a(&["--switches", "5"]).is_err());
        assert!(a(&["--bytes", "3"]).is_err());
        assert!(a(&["--frobnicate"]).is_err());
    }

    #[test]
    fn the_median_is_the_middle_value() {
        assert_eq!(median(&[5, 1, 9]), 5);
        assert_eq!(median(&[]), 0);
    }
}
