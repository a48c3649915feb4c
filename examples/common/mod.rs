//! Helpers shared by the examples (`mod common;`): the clock every process of a machine agrees on,
//! the frame metadata the producers publish, and the plumbing around the library calls: flags
//! ([`args`]), child processes ([`child`]), device counters, and the bookkeeping of a consumer.
//! The benchmark suite (`bench/suite`, another workspace member) includes this module by path for
//! its clock and frame metadata: use nothing here that `bench/Cargo.toml` does not depend on too.

// Each example uses a subset of these.
#![allow(dead_code)]

pub mod args;
pub mod child;

use cuda_ipc::channel::Producer;
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory};
use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What an example that prints a rate says first when it was built without optimisation.
pub const UNOPTIMISED: &str =
    "built without optimisation: rates are ~50x lower; run with --release";

/// Set in the environment of the examples' children ([`child::Child::spawn`]) and of a process
/// that starts itself again: they leave [`UNOPTIMISED`] to the process the user started.
pub const CHILD_ENV: &str = "CUDA_IPC_EXAMPLE_CHILD";

/// Prints [`UNOPTIMISED`] on stderr, first, in a build without optimisation (`debug_assertions`,
/// as `cargo run` without `--release` builds), unless this process is an example's child.
pub fn warn_if_unoptimised() {
    if cfg!(debug_assertions) && std::env::var_os(CHILD_ENV).is_none() {
        eprintln!("{UNOPTIMISED}");
    }
}

/// The examples' result: every failure becomes the message `main` prints before it exits 1.
pub type Res<T> = Result<T, Box<dyn Error>>;

/// CLOCK_MONOTONIC in ns: the same clock in every process of the machine, so a time taken in one
/// process can be compared with one taken in another.
pub fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// The metadata the examples publish with a frame: four little-endian u64 words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameMeta {
    /// Frame index (0, 1, ...); also the seed of the frame's fill pattern.
    pub index: u64,
    /// Width in pixels.
    pub width: u64,
    /// Height in pixels.
    pub height: u64,
    /// When the producer called `publish`, in ns of CLOCK_MONOTONIC ([`now_ns`]).
    pub stamp_ns: u64,
}

impl FrameMeta {
    /// Bytes of the encoded form.
    pub const LEN: usize = 32;

    /// The metadata of frame `index` of `width` × `height` pixels, stamped now ([`now_ns`]).
    pub fn now(index: u64, width: u64, height: u64) -> FrameMeta {
        FrameMeta {
            index,
            width,
            height,
            stamp_ns: now_ns(),
        }
    }

    /// The frame index alone: the first little-endian u64 of metadata `m` (of a [`FrameMeta`], or
    /// of metadata that holds only the index). Errors when `m` is shorter than 8 bytes.
    pub fn index_of(m: &[u8]) -> Res<u64> {
        let b: [u8; 8] = m
            .get(..8)
            .and_then(|s| s.try_into().ok())
            .ok_or_else(|| format!("metadata of {} bytes has no frame index", m.len()))?;
        Ok(u64::from_le_bytes(b))
    }

    /// The 32-byte encoding.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut m = [0u8; Self::LEN];
        for (k, w) in [self.index, self.width, self.height, self.stamp_ns]
            .iter()
            .enumerate()
        {
            m[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        m
    }

    /// Decodes metadata written by [`FrameMeta::encode`]; `None` when it is shorter than 32 bytes.
    pub fn decode(m: &[u8]) -> Option<FrameMeta> {
        let word = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(
                m.get(i * 8..i * 8 + 8)?.try_into().ok()?,
            ))
        };
        Some(FrameMeta {
            index: word(0)?,
            width: word(1)?,
            height: word(2)?,
            stamp_ns: word(3)?,
        })
    }
}

/// The value of `key=value` (`key` ends with `=`) in a summary line a child printed, without a
/// trailing `,` or `;`; `None` when the line has no such word.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .map(|v| v.trim_end_matches([',', ';']))
}

/// [`field`] as a number. Errors with `"no {key}"` when the line has none, or with the parse error.
pub fn field_u64(line: &str, key: &str) -> Res<u64> {
    Ok(field(line, key)
        .ok_or_else(|| format!("no {key}"))?
        .parse()?)
}

/// Waits (bounded) until every consumer of `tx` has taken every published frame and released it.
/// `Producer::close` only waits for frames consumers hold, not for those they have yet to take, and
/// frees the pool right after; so a producer that ends calls this first. Returns false when
/// `timeout` passed first.
pub fn wait_drained(tx: &Producer, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        let s = tx.stats();
        if s.consumers.iter().all(|c| c.lag == 0 && c.in_flight == 0) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A zeroed 8-byte device counter for the counting kernels (`Kernels::sum`, `check_pattern`). The
/// zeroing copy runs on the legacy default stream, which non-blocking streams do not wait for, so
/// this waits for it (`Context::synchronize`). Errors as `DeviceBuffer::new` and the copy do.
pub fn zeroed_counter(ctx: &Arc<Context>) -> Res<DeviceBuffer> {
    let c = DeviceBuffer::new(ctx, 8)?;
    c.copy_from_host(0, &[0; 8])?;
    ctx.synchronize()?;
    Ok(c)
}

/// The `u64` at the start of `counter` (the caller synchronised the stream that wrote it). Errors
/// as the copy to the host does.
pub fn read_u64(counter: &impl DeviceMemory) -> Res<u64> {
    let mut b = [0u8; 8];
    counter.copy_to_host(0, &mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// What a consumer that takes every frame counts: frames received, frames that were not the one
/// after the last, and the time since the first frame.
#[derive(Default)]
pub struct Arrivals {
    /// Frames received so far.
    pub received: u64,
    /// Frames whose index was not the last one's plus one (the first must be 0).
    pub out_of_order: u64,
    next: u64,
    start: Option<Instant>,
}

impl Arrivals {
    /// How long to wait for the next frame: `first` until one came, `later` after.
    pub fn timeout(&self, first: Duration, later: Duration) -> Duration {
        if self.start.is_none() { first } else { later }
    }

    /// Counts frame `index`; the first one starts the clock.
    pub fn arrived(&mut self, index: u64) {
        self.start.get_or_insert_with(Instant::now);
        if index != self.next {
            self.out_of_order += 1;
        }
        self.next = index + 1;
        self.received += 1;
    }

    /// Seconds since the first frame; 0 when none came.
    pub fn secs(&self) -> f64 {
        self.start.map_or(0.0, |s| s.elapsed().as_secs_f64())
    }
}

/// The `p` (0..=1) percentile of the latencies `sorted_ns` (ascending, in ns), in µs: the value at
/// rank `(len - 1) × p`, rounded down; 0 when there are none.
pub fn percentile_us(sorted_ns: &[u64], p: f64) -> f64 {
    sorted_ns
        .get(((sorted_ns.len() as f64 - 1.0) * p) as usize)
        .copied()
        .unwrap_or(0) as f64
        / 1e3
}
