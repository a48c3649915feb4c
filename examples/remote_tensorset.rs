//! Tensor sets across hosts (`--features remote`): a trainer publishes its weights as a tensor set,
//! the tensor-set bridges mirror each new generation over NVIDIA NIXL into a tensor set of the
//! same layout on the engines' host, and the engines read it with the ordinary
//! `TensorSetReader`. Here the "engines' host" is a second process of this machine (the bridges
//! talk over loopback TCP); across hosts run `cuda-ipc bridge recv --tensorset NAME` there and
//! `cuda-ipc bridge send --tensorset NAME` beside the trainer.
//!
//! The trainer (this process) writes `--generations` generations (each layer's tensors filled
//! with the generation number; with `--changed-only` one layer changes per generation) and runs
//! the sending bridge on a thread; the engines process runs the receiving bridge on a thread and
//! `--engines` reader threads, each checking every byte of every generation it takes against the
//! generation's content fingerprint (a mix of two generations would fail). Prints generations
//! mirrored and bytes written.
//!
//! ```text
//! UCX_TLS=tcp,self,cuda_copy cargo run -p cuda-ipc-examples --features remote \
//!     --example remote_tensorset -- [--generations 20] [--layers 8] [--engines 2] [--changed-only]
//! ```
//! Host memory at both ends (no GPU needed). Needs NIXL's libraries on LD_LIBRARY_PATH
//! (`pip install --no-deps nixl-cu13`).

mod common;

use common::Res;
use common::args::Argv;
use cuda_ipc::remote::report::UcxLog;
use cuda_ipc::remote::tensorset::{recv, send};
use cuda_ipc::remote::wire::Secret;
use cuda_ipc::tensorset::{
    DType, GenerationMode, Held, ReaderOptions, TensorSetError, TensorSetOptions, TensorSetReader,
    TensorSetWriter, TensorSpec,
};
use std::io::{BufRead as _, Write as _};
use std::net::TcpListener;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: remote_tensorset [--generations 20] [--layers 8] [--engines 2] \
    [--changed-only]";
const ROLE: &str = "CUDA_IPC_EXAMPLE_ROLE";
const WAIT: Duration = Duration::from_secs(30);

/// The model: per layer a weight matrix and a bias.
fn specs(layers: usize) -> Vec<TensorSpec> {
    (0..layers)
        .flat_map(|l| {
            [
                TensorSpec::new(format!("layers.{l}.w"), DType::BF16, &[512, 256]),
                TensorSpec::new(format!("layers.{l}.b"), DType::F32, &[256]),
            ]
        })
        .collect()
}

/// The value every byte of tensor `i` holds in generation `g` (`changed`: one layer per
/// generation changes, layer `g % layers`).
fn value(changed: bool, layers: usize, i: usize, g: u64) -> u8 {
    let layer = i / 2;
    let v = if !changed || g <= 1 {
        g
    } else {
        (2..=g)
            .rev()
            .find(|x| (*x as usize) % layers == layer)
            .unwrap_or(1)
    };
    (v as u8).wrapping_mul(7).wrapping_add(i as u8)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("remote_tensorset: {e}");
        std::process::exit(1);
    }
}

fn run() -> Res<()> {
    let (mut gens, mut layers, mut engines, mut changed) = (20u64, 8usize, 2usize, false);
    let mut a = Argv::from_env();
    while let Some(k) = a.flag() {
        match k.as_str() {
            "--generations" => gens = a.parse(&k)?,
            "--layers" => layers = a.parse(&k)?,
            "--engines" => engines = a.parse(&k)?,
            "--changed-only" => changed = true,
            x => return Err(format!("unknown flag {x:?}; {USAGE}").into()),
        }
    }
    let set = format!("example-weights-{}", std::process::id());
    match std::env::var(ROLE).as_deref() {
        Ok("engines") => engines_host(&std::env::var("FAR")?, layers, engines, changed),
        _ => trainer(&set, gens, layers, engines, changed),
    }
}

fn secret() -> Res<Secret> {
    Ok(Secret::new(
        b"example secret, use a file of 0600 in production".to_vec(),
    )?)
}

/// The engines' host: the receiving bridge on a thread, `engines` readers checking every byte.
fn engines_host(far: &str, layers: usize, engines: usize, changed: bool) -> Res<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    let opts = recv::RecvOptions::new(far, secret()?);
    let bridge = std::thread::spawn(move || -> Result<u64, String> {
        let mut totals = recv::Totals::default();
        let s = |e: cuda_ipc::Error| e.to_string();
        match recv::serve(&opts, &listener, &AtomicBool::new(false), &mut totals).map_err(s)? {
            recv::Ended::Closed(w) => {
                // Let the engines finish the last generation, then close the far set.
                std::thread::sleep(Duration::from_millis(300));
                w.close(WAIT).map_err(s)?;
            }
            other => return Err(format!("the receiving bridge ended: {other:?}")),
        }
        Ok(totals.generations)
    });
    let n = 2 * layers;
    let readers: Vec<_> = (0..engines)
        .map(|e| {
            let far = far.to_string();
            std::thread::spawn(move || -> Result<u64, String> {
                let start = Instant::now();
                let r = loop {
                    match TensorSetReader::open_host(&far, &ReaderOptions::new()) {
                        Ok(r) => break r,
                        Err(_) if start.elapsed() < WAIT => {
                            std::thread::sleep(Duration::from_millis(10))
                        }
                        Err(e) => return Err(e.to_string()),
                    }
                };
                let (mut far_gen, mut checked) = (0, 0u64);
                loop {
                    match r.wait_newer(far_gen, Some(WAIT)) {
                        Ok(h) => {
                            far_gen = h.generation();
                            check(&h, changed, layers, n).map_err(|e| e.to_string())?;
                            checked += 1;
                        }
                        Err(cuda_ipc::Error::TensorSet(TensorSetError::Closed(_))) => break,
                        Err(err) => return Err(format!("engine {e}: {err}")),
                    }
                }
                println!("engine {e}: checked {checked} generations, every byte");
                Ok(checked)
            })
        })
        .collect();
    for r in readers {
        r.join().map_err(|_| "an engine panicked")??;
    }
    let g = bridge.join().map_err(|_| "the bridge panicked")??;
    println!("engines' host: {g} generations published");
    Ok(())
}

/// Every byte of held generation `h` is what its near generation (the content's first 8 bytes)
/// wrote.
fn check(h: &Held<'_>, changed: bool, layers: usize, n: usize) -> Res<()> {
    let g = u64::from_le_bytes(h.content()[..8].try_into()?);
    for i in 0..n {
        let want = value(changed, layers, i, g);
        if let Some(k) = h.read_tensor(i)?.iter().position(|&b| b != want) {
            return Err(format!("generation {g}, tensor {i}, byte {k}: not {want}").into());
        }
    }
    Ok(())
}

/// The trainer: the near set, the sending bridge on a thread, and the engines' host started.
fn trainer(set: &str, gens: u64, layers: usize, engines: usize, changed: bool) -> Res<()> {
    // UCX bound to the loopback interface, its protocol report in a private folder (what
    // `cuda-ipc bridge` does for itself).
    let log = UcxLog::create()?;
    let env = cuda_ipc::remote::environment("127.0.0.1".parse()?, Some(&log));
    let far = format!("{set}-far");
    let exe = std::env::current_exe()?;
    let mut child = std::process::Command::new(&exe)
        .args(std::env::args_os().skip(1))
        .envs(env.clone())
        .env(ROLE, "engines")
        .env("FAR", &far)
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut out = std::io::BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    let port = out
        .next()
        .ok_or("the engines' host said nothing")??
        .strip_prefix("port ")
        .ok_or("no port")?
        .to_string();
    std::thread::spawn(move || {
        for l in out.map_while(Result::ok) {
            println!("{l}");
        }
    });
    // This process's own NIXL agent reads the same environment: set it before the bridge starts
    // (no other thread runs yet).
    for (k, v) in env {
        // SAFETY: single-threaded at this point (the output thread above reads a pipe only).
        unsafe { std::env::set_var(k, v) };
    }
    let specs = specs(layers);
    let mut w = TensorSetWriter::create_host(
        set,
        &specs,
        &TensorSetOptions::new().mode(GenerationMode::Buffered(2)),
    )?;
    let mut opts = send::SendOptions::new(set, &format!("127.0.0.1:{port}"), secret()?);
    opts.changed_only = changed;
    let bridge = std::thread::spawn(move || -> Result<send::Totals, String> {
        let mut totals = send::Totals::default();
        // Consecutive failures end the bridge after 30 s without a generation mirrored.
        let mut progress = (0u64, Instant::now());
        loop {
            if totals.generations != progress.0 {
                progress = (totals.generations, Instant::now());
            }
            if progress.1.elapsed() > Duration::from_secs(30) {
                return Err("the sending bridge mirrored nothing for 30 s".into());
            }
            match send::serve(&opts, &AtomicBool::new(false), &mut totals) {
                Ok(send::Ended::Closed) => return Ok(totals),
                Ok(other) => return Err(format!("the sending bridge ended: {other:?}")),
                // Refusals that trying again cannot change (a wrong secret, another layout) and
                // a missing NIXL end the bridge; a lost link or a busy far bridge is retried, as
                // `cuda-ipc bridge send` does: the next session resumes where this one stopped.
                Err(e @ cuda_ipc::Error::Remote(cuda_ipc::remote::RemoteError::Refused(_)))
                | Err(e @ cuda_ipc::Error::Unsupported { .. }) => return Err(e.to_string()),
                Err(e) => {
                    eprintln!("sending bridge: {e}; again");
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    });
    // The bridge's status file appears once its session runs (`cuda-ipc ls` reads it).
    let status = cuda_ipc::remote::report::status_path(
        &cuda_ipc::remote::report::tensorset_status_name(set),
    );
    let start = Instant::now();
    while !status.exists() {
        if start.elapsed() > WAIT {
            return Err("the sending bridge did not start".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let start = Instant::now();
    for g in 1..=gens {
        let mut u = w.begin(Some(WAIT))?;
        for (i, s) in specs.iter().enumerate() {
            let bytes = s.shape.iter().product::<i64>() as usize * usize::from(s.dtype.bits / 8);
            u.write_tensor(i, &vec![value(changed, layers, i, g); bytes])?;
        }
        let mut content = [0u8; 32];
        content[..8].copy_from_slice(&g.to_le_bytes());
        u.commit_with_content(content)?;
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    w.close(WAIT)?;
    let t = bridge.join().map_err(|_| "the bridge panicked")??;
    let status = child.wait()?;
    println!(
        "trainer: {gens} generations of {} bytes in {:.2?}; {} mirrored, {} bytes written{}; \
         {engines} engines; UCX {}",
        w_bytes(&specs),
        start.elapsed(),
        t.generations,
        t.bytes,
        if changed {
            " (changed tensors only)"
        } else {
            ""
        },
        t.transport.map_or("unknown".into(), |t| t.summary())
    );
    if !status.success() {
        return Err(format!("the engines' host failed: {status}").into());
    }
    drop(log);
    Ok(())
}

fn w_bytes(specs: &[TensorSpec]) -> u64 {
    cuda_ipc::tensorset::Layout::new(specs).map_or(0, |l| l.bytes_per_buffer())
}
