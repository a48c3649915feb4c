//! The registry alone, no GPU: a named shared-memory table of records (a name, a kind tag, token
//! bytes, metadata), each with a sequence number, that processes publish, read and wait for, and
//! that knows which of its participants are alive. Channels are built on the same pieces; here
//! the registry carries a token by hand.
//!
//! This process creates registry `cuda-ipc-example-registry-PID` and starts itself again as a
//! publisher (CUDA does not survive `fork()`, so every example re-executes its binary). The
//! publisher opens the registry and publishes record `frames` with a [`Token`] in its 144-byte
//! wire form, the record any transport can carry, and some metadata. This process waits for it
//! (`wait_for`: it sleeps on the registry's futex until a publish wakes it), decodes the token and
//! lists the live participants: both processes.
//!
//! Then the publisher ends without closing its registry handle, as a crash would. Its record stays,
//! but its owner now reads as dead, and `reclaim_dead` frees the record and the participant entry
//! the publisher left. Prints each step and `OK`; exits non-zero when anything differs.
//!
//! ```text
//! cargo run -p cuda-ipc-examples --example 01_registry
//! ```
//!
//! The bytes of the segment are laid out in docs/registry-layout.md; `cuda-ipc ls` shows a
//! registry while it exists.

use cuda_ipc::driver::Uuid;
use cuda_ipc::identity::{Liveness, ProcessIdentity};
use cuda_ipc::registry::{Registry, RegistryOptions};
use cuda_ipc::token::{Token, TokenKind};
use std::error::Error;
use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

type Res<T> = Result<T, Box<dyn Error>>;

/// The record the publisher publishes.
const RECORD: &str = "frames";
/// The record's kind tag: the registry stores it and never interprets it.
const KIND: u32 = 1;

fn main() {
    if let Err(e) = run() {
        eprintln!("01_registry: {e}");
        std::process::exit(1);
    }
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    if let [_, role, name] = &args[..]
        && role == "--publisher"
    {
        return publisher(name);
    }
    let name = format!("cuda-ipc-example-registry-{}", std::process::id());
    let reg = Registry::create(&name, &RegistryOptions::new().capacity(8))?;
    // From here on the segment exists: remove its name however `owner` ends.
    let result = owner(&reg);
    Registry::unlink(&name)?;
    result
}

/// The process that creates the registry, reads what the publisher published, and watches the
/// publisher die.
fn owner(reg: &Registry) -> Res<()> {
    println!(
        "registry {}: {} slots; this process is {}",
        reg.name(),
        reg.capacity(),
        reg.identity()
    );
    let mut publisher = Publisher::start(reg.name())?;

    // Sleeps on the registry's futex word until a publish of `frames` wakes it (0: any sequence
    // number), at most 10 s.
    let rec = reg.wait_for(RECORD, 0, Duration::from_secs(10))?;
    let token = Token::from_bytes(&rec.token)?;
    println!(
        "record {:?} seq={} kind={} slot={}: {} token bytes, {:?} metadata, owner {}",
        rec.name,
        rec.seq,
        rec.kind,
        rec.slot,
        rec.token.len(),
        String::from_utf8_lossy(&rec.metadata),
        rec.owner
    );
    println!(
        "token: {:?}, {} bytes at offset {}, exported by {}",
        token.kind, token.len, token.offset, token.exporter
    );
    if token.exporter != rec.owner || rec.kind != KIND {
        return Err("the token or the record is not what the publisher wrote".into());
    }

    // Every process that has the registry open holds a participant entry.
    let alive = reg.participants();
    for p in &alive {
        println!("participant {p}: {:?}", p.liveness());
    }
    if !alive.contains(&reg.identity()) || !alive.contains(&rec.owner) {
        return Err(format!("expected this process and the publisher, found {alive:?}").into());
    }

    publisher.end()?;
    let rec = reg.get(RECORD)?.ok_or("the record is gone")?;
    let liveness = rec.owner_liveness();
    println!(
        "publisher ended without closing: record seq={} still there, its owner {liveness:?}",
        rec.seq
    );
    if liveness != Liveness::Dead {
        return Err(format!("the ended publisher reads as {liveness:?}").into());
    }

    let freed = reg.reclaim_dead()?;
    println!(
        "reclaim_dead: freed {} record(s) and {} participant entr(ies) of dead processes",
        freed.records, freed.participants
    );
    if freed.records != 1 || freed.participants != 1 || reg.get(RECORD)?.is_some() {
        return Err(format!("reclaim_dead freed {freed:?}, expected one of each").into());
    }
    if reg.participants() != [reg.identity()] {
        return Err("a participant other than this process is left".into());
    }
    println!("OK");
    Ok(())
}

/// The publisher: opens the registry, publishes `frames`, and, once the owner says so, ends
/// without dropping its handle.
fn publisher(name: &str) -> Res<()> {
    let reg = Registry::open(name, &RegistryOptions::new())?;
    // A token as `DeviceBuffer::export` makes one, here of the kind that needs no GPU. It names no
    // real buffer: the registry stores token bytes and never looks inside them.
    let token = Token {
        kind: TokenKind::HostMemory,
        handle: [0; 64],
        offset: 0,
        len: 1 << 20,
        device: Uuid([0; 16]),
        exporter: ProcessIdentity::current()?,
        export_id: 0,
    };
    let seq = reg.publish(RECORD, KIND, &token.to_bytes(), b"1 MiB, u8")?;
    println!(
        "publisher {}: published {RECORD:?} seq={seq}",
        reg.identity()
    );
    // Waits for the owner's word (or for its end: stdin closes).
    let _ = std::io::stdin().lock().read_line(&mut String::new());
    // Exits without running `Drop`: the participant entry and the record stay behind, as after a
    // crash. (Unlike SIGKILL, this still removes the process's liveness file in /dev/shm.)
    std::process::exit(0);
}

/// The publisher process, killed if this process returns early.
struct Publisher(Child);

impl Publisher {
    /// Starts this binary as the publisher of registry `name`.
    fn start(name: &str) -> Res<Publisher> {
        let child = Command::new(std::env::current_exe()?)
            .args(["--publisher", name])
            .stdin(Stdio::piped())
            .spawn()?;
        Ok(Publisher(child))
    }

    /// Tells the publisher to end and waits for it. Errors when it failed.
    fn end(&mut self) -> Res<()> {
        writeln!(self.0.stdin.take().ok_or("no stdin")?, "end")?;
        let status = self.0.wait()?;
        if !status.success() {
            return Err(format!("the publisher failed: {status}").into());
        }
        Ok(())
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
