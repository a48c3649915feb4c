//! When did a kernel start, in host time? The `stamp` kernel writes the GPU's `%globaltimer` (ns);
//! this module maps such stamps onto CLOCK_MONOTONIC.
//!
//! Method: the stamp kernel writes into pinned, device-mapped host memory
//! (`cuMemHostAlloc(CU_MEMHOSTALLOC_DEVICEMAP)`) while the host spins reading that word. For each
//! sample, with `t0` = host time just before the launch, `seen` = host time when the stamp `g`
//! appeared, and θ = globaltimer − CLOCK_MONOTONIC:
//! - the kernel started after the launch call began: `host(g) ≥ t0`, so θ ≤ g − t0;
//! - the write reached host memory before the host saw it: `host(g) ≤ seen`, so θ ≥ g − seen.
//!
//! Over a few hundred samples the tightest bounds are kept: `lo = max(g − seen)`, `hi = min(g − t0)`.
//! Times are converted with θ = lo, which can only place a kernel start *later* than it was (by
//! at most the one-way GPU→host write latency), so a kernel-start latency is never understated.
//! The width `hi − lo` is reported as the calibration's uncertainty. Calibrating at the start and
//! the end of a run gives the drift between the two clocks, which is interpolated linearly.
//!
//! Without pinned memory (should `cuMemHostAlloc` fail) the bracket is `[max(g − t1), min(g − t0)]`
//! with `t1` = after `cuStreamSynchronize`, and its midpoint is used.

use crate::Res;
use crate::common::now_ns;
use cuda_ipc::driver::{Context, DeviceMemory, Stream};
use cuda_ipc::raw::kernels::Kernels;
use cudarc::driver::sys;
use serde_json::{Value, json};
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::Arc;

/// Turns a `CUresult` into an error naming the call.
pub fn cu(call: &str, r: sys::CUresult) -> Res<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call} failed: {r:?}").into())
    }
}

/// A window of device memory: `len` bytes at `ptr` in `ctx` (a slice of a buffer, or the device
/// address of mapped host memory), for the kernels' `DeviceMemory` arguments.
pub struct View {
    /// Device address.
    pub ptr: u64,
    /// Bytes.
    pub len: usize,
    /// The context the address is valid in.
    pub ctx: Arc<Context>,
}

impl View {
    /// The 8-byte slot `k` of `mem`; an error when it lies outside.
    pub fn slot(mem: &impl DeviceMemory, k: usize) -> Res<View> {
        if (k + 1) * 8 > mem.len() {
            return Err(format!("slot {k} lies outside {} bytes", mem.len()).into());
        }
        Ok(View {
            ptr: mem.device_ptr() + 8 * k as u64,
            len: 8,
            ctx: mem.context().clone(),
        })
    }
}

impl DeviceMemory for View {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

/// Pinned, device-mapped host memory (`cuMemHostAlloc`), freed on drop.
struct Pinned {
    host: *mut c_void,
    dev: u64,
    ctx: Arc<Context>,
}

impl Pinned {
    fn new(ctx: &Arc<Context>, len: usize) -> Res<Pinned> {
        ctx.bind()?;
        let mut p = MaybeUninit::<*mut c_void>::uninit();
        // SAFETY: context bound; `p` is a valid out-pointer; the flag is a defined
        // CU_MEMHOSTALLOC value.
        cu("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(p.as_mut_ptr(), len, sys::CU_MEMHOSTALLOC_DEVICEMAP)
        })?;
        // SAFETY: written on success.
        let host = unsafe { p.assume_init() };
        let mut pinned = Pinned {
            host,
            dev: 0,
            ctx: ctx.clone(),
        };
        let mut d = MaybeUninit::<sys::CUdeviceptr>::uninit();
        // SAFETY: context bound; `host` came from cuMemHostAlloc with DEVICEMAP; flags must be 0.
        cu("cuMemHostGetDevicePointer_v2", unsafe {
            sys::cuMemHostGetDevicePointer_v2(d.as_mut_ptr(), host, 0)
        })?;
        // SAFETY: written on success.
        pinned.dev = unsafe { d.assume_init() };
        Ok(pinned)
    }

    fn word(&self) -> *mut u64 {
        self.host.cast()
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: `host` came from cuMemHostAlloc in this context and is freed once; the
            // stamp kernels that wrote it were synchronised before (calibration waits for each).
            let _ = unsafe { sys::cuMemFreeHost(self.host) };
        }
    }
}

/// One calibration: the bracket of θ = globaltimer − CLOCK_MONOTONIC, in ns.
#[derive(Clone, Copy, Debug)]
pub struct Calibration {
    /// Host time (ns) the calibration describes (middle of its samples).
    pub at_ns: u64,
    /// The estimate of θ used for conversions.
    pub theta: i128,
    /// Lower and upper bound of θ.
    pub lo: i128,
    /// Upper bound of θ.
    pub hi: i128,
    /// Samples kept.
    pub samples: usize,
    /// Largest common divisor of the stamps' differences: the timer's apparent resolution (ns).
    pub resolution_ns: u64,
    /// Whether the pinned-memory method was used (else the synchronise bracket).
    pub pinned: bool,
}

/// Maps `%globaltimer` stamps to host time.
pub struct GpuClock {
    // Drop order: the pinned memory is freed before the stream and the context go.
    pinned: Option<Pinned>,
    scratch: cuda_ipc::driver::DeviceBuffer,
    stream: Stream,
    kernels: Kernels,
    ctx: Arc<Context>,
    /// Why the pinned method is not used, if it is not.
    pub fallback_reason: Option<String>,
}

impl GpuClock {
    /// Prepares the pinned word and a stream of its own; falls back to the synchronise bracket
    /// when pinned, mapped memory cannot be had or a stamp never shows up in it.
    pub fn new(ctx: &Arc<Context>, kernels: &Kernels) -> Res<GpuClock> {
        let mut clock = GpuClock {
            pinned: None,
            scratch: cuda_ipc::driver::DeviceBuffer::new(ctx, 8)?,
            stream: Stream::new(ctx)?,
            kernels: kernels.clone(),
            ctx: ctx.clone(),
            fallback_reason: None,
        };
        match Pinned::new(ctx, 64) {
            Ok(p) => match clock.sample(Some(&p)) {
                Ok(_) => clock.pinned = Some(p),
                Err(e) => {
                    // A stamp may still be in flight: let it land before the memory goes.
                    let _ = clock.stream.synchronize();
                    clock.fallback_reason = Some(e.to_string());
                }
            },
            Err(e) => clock.fallback_reason = Some(e.to_string()),
        }
        Ok(clock)
    }

    /// One sample: (host time before the launch, the stamp, the upper host time): the time the
    /// stamp was seen in pinned memory, or the time `cuStreamSynchronize` returned.
    fn sample(&self, pinned: Option<&Pinned>) -> Res<(u64, u64, u64)> {
        match pinned {
            Some(p) => {
                let w = p.word();
                // SAFETY: `w` is the first 8 bytes of a live pinned allocation, 8-aligned; no
                // kernel writes it now (every earlier sample was synchronised).
                unsafe { std::ptr::write_volatile(w, 0) };
                let view = View {
                    ptr: p.dev,
                    len: 8,
                    ctx: self.ctx.clone(),
                };
                let t0 = now_ns();
                self.kernels.stamp(&view, &self.stream)?;
                let seen = loop {
                    // SAFETY: as above; the GPU writes the word once, a volatile read sees either
                    // 0 or the stamp.
                    let v = unsafe { std::ptr::read_volatile(w) };
                    if v != 0 {
                        break now_ns();
                    }
                    if now_ns() - t0 > 100_000_000 {
                        return Err(
                            "the stamp kernel's write to pinned host memory did not show \
                                    up within 100 ms"
                                .into(),
                        );
                    }
                    std::hint::spin_loop();
                };
                self.stream.synchronize()?;
                // SAFETY: as above; the kernel has finished.
                let g = unsafe { std::ptr::read_volatile(w) };
                Ok((t0, g, seen))
            }
            None => {
                let t0 = now_ns();
                self.kernels.stamp(&self.scratch, &self.stream)?;
                self.stream.synchronize()?;
                let t1 = now_ns();
                let mut b = [0u8; 8];
                self.scratch.copy_to_host(0, &mut b)?;
                Ok((t0, u64::from_le_bytes(b), t1))
            }
        }
    }

    /// Takes `n` samples (after a few discarded ones) and returns the bracket of θ.
    pub fn calibrate(&self, n: usize) -> Res<Calibration> {
        let mut lo = i128::MIN;
        let mut hi = i128::MAX;
        let mut stamps = Vec::with_capacity(n);
        let (first, mut last) = (now_ns(), 0);
        for k in 0..n + 8 {
            let (t0, g, upper_t) = self.sample(self.pinned.as_ref())?;
            last = upper_t;
            if k < 8 {
                continue; // warm-up
            }
            lo = lo.max(g as i128 - upper_t as i128);
            hi = hi.min(g as i128 - t0 as i128);
            stamps.push(g);
        }
        let resolution_ns = stamps.iter().map(|g| g.abs_diff(stamps[0])).fold(0, gcd);
        let pinned = self.pinned.is_some();
        Ok(Calibration {
            at_ns: first / 2 + last / 2,
            theta: if pinned { lo } else { lo + (hi - lo) / 2 },
            lo,
            hi,
            samples: n,
            resolution_ns,
            pinned,
        })
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// θ at host time `t`, interpolated between two calibrations.
fn theta_at(a: &Calibration, b: &Calibration, t: u64) -> i128 {
    if b.at_ns <= a.at_ns {
        return a.theta;
    }
    let f = (t as f64 - a.at_ns as f64) / (b.at_ns as f64 - a.at_ns as f64);
    a.theta + ((b.theta - a.theta) as f64 * f) as i128
}

/// Host time (ns, CLOCK_MONOTONIC) of GPU stamp `g`, given the calibrations before and after.
pub fn to_host(g: u64, a: &Calibration, b: &Calibration) -> i128 {
    let approx = (g as i128 - a.theta).max(0) as u64;
    g as i128 - theta_at(a, b, approx)
}

/// What the report says about a pair of calibrations.
pub fn describe(a: &Calibration, b: &Calibration) -> Value {
    let span = b.at_ns.saturating_sub(a.at_ns) as f64;
    json!({
        "method": if a.pinned { "pinned host word polled by the host (theta = max(g - seen)); kernel starts are placed late by at most the GPU->host write latency" } else { "launch/synchronise bracket midpoint" },
        "uncertainty_start_ns": (a.hi - a.lo) as f64,
        "uncertainty_end_ns": (b.hi - b.lo) as f64,
        "drift_ppm": if span > 0.0 { (b.theta - a.theta) as f64 / span * 1e6 } else { 0.0 },
        "globaltimer_resolution_ns": a.resolution_ns.min(b.resolution_ns),
        "samples": a.samples + b.samples,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cal(at_ns: u64, theta: i128) -> Calibration {
        Calibration {
            at_ns,
            theta,
            lo: theta,
            hi: theta + 100,
            samples: 1,
            resolution_ns: 32,
            pinned: true,
        }
    }

    #[test]
    fn stamps_convert_with_the_interpolated_offset() {
        // The GPU clock runs 1,000 ns ahead at t = 1 s and 3,000 ns ahead at t = 3 s.
        let (a, b) = (cal(1_000_000_000, 1_000), cal(3_000_000_000, 3_000));
        assert_eq!(to_host(1_000_001_000, &a, &b), 1_000_000_000);
        assert_eq!(to_host(2_000_002_000, &a, &b), 2_000_000_000);
        assert_eq!(to_host(3_000_003_000, &a, &b), 3_000_000_000);
        // One calibration only (or both at once): a constant offset.
        assert_eq!(to_host(5_000, &a, &a), 4_000);
    }

    #[test]
    fn gcd_gives_the_timer_resolution() {
        assert_eq!([32u64, 96, 64].iter().fold(0, |g, &x| gcd(g, x)), 32);
        assert_eq!(gcd(0, 1000), 1000);
    }
}
