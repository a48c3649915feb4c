//! The benchmark suite of `docs/benchmarks.md`: the channel's hand-off latency and throughput, zero
//! copy across frame sizes, import and registry costs, beside a floor built from the crate's lower
//! layers, a bare floor built from raw driver and futex calls only, and the physical limits (a
//! cross-process futex or spinning ping-pong, a device-to-device copy of the same frame), all
//! measured in one run.
//!
//! ```text
//! cargo run --release -p cuda-ipc-bench --example bench_suite -- --out DIR [--quick]
//!     [--only handoff,import,handoff/bare_floor,...] [--commit SHA]
//! ```
//!
//! Writes `DIR/bench_suite.json` (every number with its unit, the GPU, the driver, the date, the
//! commit) and `DIR/bench_suite.csv`. The Python baselines in `bench/` write beside them and
//! `bench/report.py` merges everything; `bench/run.sh` runs it all.
//!
//! Every measurement runs in child processes that re-execute this binary (`--role NAME key=value
//! ...`), never `fork()` alone: each process has its own CUDA context, as in a real pipeline. The
//! parent bounds every child with a deadline and kills it past that; children die with their parent
//! (`PR_SET_PDEATHSIG`) and stop waiting when a peer is gone.

// The examples' helpers (the shared clock, the frame metadata), included by path: one definition
// for both members.
#[path = "../../examples/common/mod.rs"]
mod common;

mod bare;
mod clock;
mod handoff;
mod import;
mod kv;
mod limits;
mod peer;
mod plan;
mod posted;
mod records;
mod throughput;

use serde_json::{Value, json};
use std::error::Error;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The error type of the suite: every failure becomes a message for the report.
pub type Res<T> = Result<T, Box<dyn Error>>;

/// How long any single wait of a case may take before it counts as a hang.
pub const STEP: Duration = Duration::from_secs(10);

/// 4K RGBA: 3840 × 2160 pixels × 4 bytes.
pub const WIDTH: u64 = 3840;
/// 4K RGBA height in pixels.
pub const HEIGHT: u64 = 2160;
/// Bytes of one 4K RGBA frame (33,177,600).
pub const FRAME_BYTES: usize = (WIDTH * HEIGHT * 4) as usize;

struct Options {
    out: PathBuf,
    quick: bool,
    budget_s: u64,
    only: Vec<String>,
    commit: Option<String>,
}

const USAGE: &str = "usage: bench_suite --out DIR [--quick] [--budget S] [--only GROUP|CASE,...] [--commit SHA]
  --out DIR      where bench_suite.json and bench_suite.csv go (created if missing)
  --quick        a smoke test of every group with few frames (under a minute)
  --budget S     stop starting cases after S seconds (default 240, quick 50); each case is bounded too
  --only LIST    run only these groups: env, registry, limits, handoff, throughput, zerocopy, import;
                 or cases by id or id prefix, e.g. handoff/bare_floor (the bare floor's four cases)
  --commit SHA   the commit to record (default: $CUDA_IPC_GIT_COMMIT at build or run time, then git)";

fn parse_options(argv: &[String]) -> Res<Options> {
    let mut o = Options {
        out: PathBuf::new(),
        quick: false,
        budget_s: 0,
        only: Vec::new(),
        commit: None,
    };
    let mut it = argv.iter();
    let mut out = None;
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{a} needs a value\n{USAGE}"))
        };
        match a.as_str() {
            "--out" => out = Some(PathBuf::from(value()?)),
            "--quick" => o.quick = true,
            "--budget" => o.budget_s = value()?.parse()?,
            "--only" => o.only = value()?.split(',').map(|s| s.trim().to_string()).collect(),
            "--commit" => o.commit = Some(value()?.clone()),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            x => return Err(format!("unknown argument {x:?}\n{USAGE}").into()),
        }
    }
    o.out = out.ok_or(format!("--out DIR is required\n{USAGE}"))?;
    if o.budget_s == 0 {
        o.budget_s = if o.quick { 50 } else { 240 };
    }
    let all = plan::plan(o.quick, &[]);
    for g in &o.only {
        if !all.iter().any(|c| plan::selects(g, c)) {
            return Err(format!(
                "{g:?} is neither a group ({}) nor a case (e.g. handoff/bare_floor)",
                plan::GROUPS.join(", ")
            )
            .into());
        }
    }
    Ok(o)
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.first().map(String::as_str) == Some("--role") {
        let role = argv.get(1).cloned().unwrap_or_default();
        let code = match run_role(&role, &argv[2.min(argv.len())..]) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("bench_suite --role {role}: {e}");
                1
            }
        };
        std::process::exit(code);
    }
    let code = match parse_options(&argv).and_then(|o| orchestrate(&o)) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("bench_suite: {e}");
            2
        }
    };
    std::process::exit(code);
}

/// Runs one child role and prints its `RESULT` line.
fn run_role(role: &str, args: &[String]) -> Res<()> {
    peer::guard_parent()?;
    let kv = kv::Kv::parse(args)?;
    let result = match role {
        "env" => env_info()?,
        "handoff" => handoff::run_case(&kv)?,
        "handoff-consumer" => handoff::consumer(&kv)?,
        "posted" => posted::run_case(&kv)?,
        "posted-consumer" => posted::consumer(&kv)?,
        "throughput" => throughput::run_case(&kv)?,
        "throughput-consumer" => throughput::consumer(&kv)?,
        "import" => import::run_case(&kv)?,
        "import-exporter" => import::exporter(&kv)?,
        "d2d" => limits::d2d_case(&kv)?,
        "pingpong-peer" => limits::pingpong_peer(&kv)?,
        other => return Err(format!("unknown role {other:?}").into()),
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "RESULT {result}")?;
    out.flush()?;
    Ok(())
}

/// The GPU and host this run is on (a child role: the orchestrator itself never touches CUDA).
fn env_info() -> Res<Value> {
    use cuda_ipc::driver::{Context, driver_version};
    let ctx = Context::default_device()?;
    let dev = ctx.device();
    let (_, total) = ctx.memory_info()?;
    let cuda = driver_version()?;
    let nvrm = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|s| {
            let line = s.lines().next()?.to_string();
            let v = line
                .split_whitespace()
                .find(|w| {
                    w.chars().filter(|c| *c == '.').count() >= 1 && w.starts_with(char::is_numeric)
                })?
                .to_string();
            Some(v)
        });
    Ok(json!({
        "gpu_name": dev.name()?,
        "gpu_uuid": dev.uuid().to_string(),
        "gpu_memory_bytes": total,
        "cuda_driver_api_version": format!("{}.{}", cuda / 1000, (cuda % 1000) / 10),
        "nvidia_driver_version": nvrm,
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_string()).ok(),
    }))
}

/// Runs every planned case in its own child process, merges the results and writes the files
/// (after every case, so a run stopped from outside still leaves what it measured). Returns whether
/// every case succeeded.
fn orchestrate(o: &Options) -> Res<bool> {
    std::fs::create_dir_all(&o.out).map_err(|e| format!("creating {}: {e}", o.out.display()))?;
    let started = Instant::now();
    let budget = Duration::from_secs(o.budget_s);
    let cases = plan::plan(o.quick, &o.only);
    let mut run = Run {
        records: Vec::new(),
        infos: serde_json::Map::new(),
        errors: Vec::new(),
        env: Value::Null,
    };
    eprintln!(
        "bench_suite: {} cases{}, budget {} s, results into {}",
        cases.len(),
        if o.quick { " (quick)" } else { "" },
        o.budget_s,
        o.out.display()
    );
    for (n, case) in cases.iter().enumerate() {
        let tag = format!("[{}/{}] {}", n + 1, cases.len(), case.id);
        let left = budget.saturating_sub(started.elapsed());
        if left < Duration::from_secs(5) {
            eprintln!(
                "{tag} SKIPPED: the run's budget of {} s is spent",
                o.budget_s
            );
            run.errors.push(
                json!({"case": case.id, "error": "skipped: the run's time budget was spent"}),
            );
            continue;
        }
        let timeout = Duration::from_secs(case.timeout_s).min(left);
        let t = Instant::now();
        eprintln!("{tag} ...");
        let r = match &case.kind {
            plan::Kind::Child { role, args } => peer::run_case(&case.id, role, args, timeout),
            plan::Kind::Registry { iters } => limits::registry(*iters),
            plan::Kind::PingPong { mode, iters } => limits::pingpong(mode, *iters, timeout),
        };
        let secs = t.elapsed().as_secs_f64();
        match r {
            Ok(v) => {
                if case.id == "env" {
                    run.env = v.clone();
                }
                if let Some(rs) = v.get("records").and_then(Value::as_array) {
                    run.records.extend(rs.iter().cloned());
                }
                if let Some(info) = v.get("info") {
                    run.infos.insert(case.id.clone(), info.clone());
                }
                match v.get("error").and_then(Value::as_str) {
                    Some(e) => {
                        eprintln!("{tag} FAILED ({secs:.1} s): {e}");
                        run.errors.push(json!({"case": case.id, "error": e}));
                    }
                    None => eprintln!("{tag} ok ({secs:.1} s)"),
                }
            }
            Err(e) => {
                eprintln!("{tag} FAILED ({secs:.1} s): {e}");
                run.errors
                    .push(json!({"case": case.id, "error": e.to_string()}));
            }
        }
        run.write(o, started, false)?;
    }
    run.write(o, started, true)?;
    Ok(run.errors.is_empty())
}

/// What a run has gathered so far.
struct Run {
    records: Vec<Value>,
    infos: serde_json::Map<String, Value>,
    errors: Vec<Value>,
    env: Value,
}

impl Run {
    fn write(&self, o: &Options, started: Instant, done: bool) -> Res<()> {
        let doc = json!({
            "suite": "cuda-ipc bench_suite",
            "schema": 1,
            "complete": done,
            "date_utc": records::utc_now(),
            "commit": commit(o),
            "quick": o.quick,
            "env": self.env,
            "frame": {"width_px": WIDTH, "height_px": HEIGHT, "bytes_per_pixel": 4, "bytes": FRAME_BYTES, "ring": 4},
            "wall_s": started.elapsed().as_secs_f64(),
            "records": self.records,
            "info": self.infos,
            "errors": self.errors,
        });
        let json_path = o.out.join("bench_suite.json");
        std::fs::write(&json_path, serde_json::to_string_pretty(&doc)?)
            .map_err(|e| format!("writing {}: {e}", json_path.display()))?;
        let csv_path = o.out.join("bench_suite.csv");
        std::fs::write(&csv_path, records::to_csv(&self.records))
            .map_err(|e| format!("writing {}: {e}", csv_path.display()))?;
        if done {
            eprintln!(
                "bench_suite: {} records, {} failed cases, {:.1} s; wrote {} and {}",
                self.records.len(),
                self.errors.len(),
                started.elapsed().as_secs_f64(),
                json_path.display(),
                csv_path.display()
            );
        }
        Ok(())
    }
}

/// The commit to record: `--commit`, `$CUDA_IPC_GIT_COMMIT` at run time or at build time, then
/// `git rev-parse HEAD` in the working directory.
fn commit(o: &Options) -> Option<String> {
    if let Some(c) = &o.commit {
        return Some(c.clone());
    }
    if let Ok(c) = std::env::var("CUDA_IPC_GIT_COMMIT")
        && !c.is_empty()
    {
        return Some(c);
    }
    if let Some(c) = option_env!("CUDA_IPC_GIT_COMMIT") {
        return Some(c.to_string());
    }
    let out = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !s.is_empty()).then_some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn only_takes_groups_and_cases_and_names_the_unknown() {
        let o = parse_options(&args(&["--out", "x", "--only", "handoff/bare_floor,env"])).unwrap();
        assert_eq!(o.only, ["handoff/bare_floor", "env"]);
        assert!(parse_options(&args(&["--out", "x", "--only", "handoff"])).is_ok());
        let e = parse_options(&args(&["--out", "x", "--only", "handoff/bare"]))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("\"handoff/bare\" is neither a group"), "{e}");
    }
}
