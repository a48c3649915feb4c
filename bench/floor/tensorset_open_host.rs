//! The CPU part of a tensor-set attach, measured without a GPU: a host tensor set of the issue's
//! shapes (docs/benchmarks.md) opened again and again with `TensorSetReader::open_host`, each
//! open's `OpenTimings` (manifest open + decode, fingerprint, data segment, generation channel
//! join) recorded; prints the medians and the ranges as JSON.
//!
//! Shapes: `moe` (4,608 bf16 tensors of [512, 1024], named `experts.E.wK`, as
//! `bench/tensorset_attach.py`), `llama` (Llama-3-8B's 291 bf16 tensors and names). The tensors'
//! strides are 0 (each spans one element), so the manifest (names, dtypes, shapes, strides,
//! fingerprint) is the real one's while the host data segment stays a few pages; `--real-bytes`
//! lays the tensors out contiguously instead (the MoE shape then needs 4.5 GiB of `/dev/shm`).
//!
//! ```text
//! cargo build --release -p cuda-ipc-bench --example tensorset_open_host
//! target/release/examples/tensorset_open_host [--shape moe|llama|both] [--opens N] [--real-bytes]
//! ```

use cuda_ipc::tensorset::{
    DType, OpenTimings, ReaderOptions, TensorSetOptions, TensorSetReader, TensorSetWriter,
    TensorSpec,
};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// (name, shape) of the MoE shape's 4,608 tensors.
fn moe_shapes() -> Vec<(String, Vec<i64>)> {
    (0..4608)
        .map(|i| (format!("experts.{}.w{}", i / 3, i % 3), vec![512, 1024]))
        .collect()
}

/// (name, shape) of Llama-3-8B's 291 tensors.
fn llama_shapes() -> Vec<(String, Vec<i64>)> {
    let (h, kv, ff, vocab) = (4096, 1024, 14_336, 128_256);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![vocab, h])];
    for i in 0..32 {
        let p = format!("model.layers.{i}.");
        for (n, s) in [
            ("self_attn.q_proj.weight", vec![h, h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.o_proj.weight", vec![h, h]),
            ("mlp.gate_proj.weight", vec![ff, h]),
            ("mlp.up_proj.weight", vec![ff, h]),
            ("mlp.down_proj.weight", vec![h, ff]),
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
        ] {
            out.push((format!("{p}{n}"), s));
        }
    }
    out.push(("model.norm.weight".into(), vec![h]));
    out.push(("lm_head.weight".into(), vec![vocab, h]));
    out
}

fn specs(shapes: &[(String, Vec<i64>)], real_bytes: bool) -> Vec<TensorSpec> {
    shapes
        .iter()
        .map(|(n, s)| {
            if real_bytes {
                TensorSpec::new(n.clone(), DType::BF16, s)
            } else {
                TensorSpec::strided(n.clone(), DType::BF16, s, &vec![0; s.len()])
            }
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The phases of `t` in µs, by name.
fn phases(t: &OpenTimings) -> [(&'static str, f64); 9] {
    [
        ("manifest_us", us(t.manifest)),
        ("tables_us", us(t.tables)),
        ("fingerprint_us", us(t.fingerprint)),
        ("fd_fetch_us", us(t.fd_fetch)),
        ("map_us", us(t.map)),
        ("join_us", us(t.join)),
        ("join_gpu_us", us(t.join_gpu)),
        ("join_wait_us", us(t.join_wait)),
        ("total_us", us(t.total)),
    ]
}

fn run(shape: &str, opens: usize, real_bytes: bool) -> Res<Value> {
    let shapes = match shape {
        "moe" => moe_shapes(),
        "llama" => llama_shapes(),
        other => return Err(format!("no shape {other:?} (moe, llama)").into()),
    };
    let name = format!("tsopen-{shape}-{}", std::process::id());
    let writer =
        TensorSetWriter::create_host(&name, &specs(&shapes, real_bytes), &TensorSetOptions::new())?;
    // One open first (page cache, allocator warm-up), not counted.
    drop(TensorSetReader::open_host(&name, &ReaderOptions::new())?);
    let mut runs = Vec::with_capacity(opens);
    let mut wall = Vec::with_capacity(opens);
    for _ in 0..opens {
        let t = Instant::now();
        let r = TensorSetReader::open_host(&name, &ReaderOptions::new())?;
        wall.push(us(t.elapsed()));
        if r.layout().len() != shapes.len() {
            return Err(format!("{} tensors read back", r.layout().len()).into());
        }
        runs.push(r.open_timings());
    }
    writer.close(Duration::from_secs(5))?;
    let mut med = serde_json::Map::new();
    let mut range = serde_json::Map::new();
    for (i, (k, _)) in phases(&OpenTimings::default()).iter().enumerate() {
        let v: Vec<f64> = runs.iter().map(|t| phases(t)[i].1).collect();
        let (lo, hi) = v
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        med.insert((*k).into(), json!(median(v)));
        range.insert((*k).into(), json!([lo, hi]));
    }
    med.insert("open_host_wall_us".into(), json!(median(wall)));
    Ok(json!({
        "shape": shape,
        "tensors": shapes.len(),
        "real_bytes": real_bytes,
        "opens": opens,
        "median": Value::Object(med),
        "range": Value::Object(range),
    }))
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let r = (|| -> Res<()> {
        let (mut shape, mut opens, mut real) = ("both".to_string(), 20usize, false);
        let mut it = argv.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--shape" => shape = it.next().ok_or("--shape needs a value")?.clone(),
                "--opens" => opens = it.next().ok_or("--opens needs a value")?.parse()?,
                "--real-bytes" => real = true,
                other => {
                    return Err(format!(
                        "unknown argument {other:?}; usage: tensorset_open_host \
                         [--shape moe|llama|both] [--opens N] [--real-bytes]"
                    )
                    .into());
                }
            }
        }
        let shapes: Vec<&str> = if shape == "both" {
            vec!["llama", "moe"]
        } else {
            vec![shape.as_str()]
        };
        let out: Vec<Value> = shapes
            .iter()
            .map(|s| run(s, opens.max(1), real))
            .collect::<Res<_>>()?;
        println!("{}", serde_json::to_string_pretty(&out)?);
        Ok(())
    })();
    if let Err(e) = r {
        eprintln!("tensorset_open_host: {e}");
        std::process::exit(1);
    }
}
