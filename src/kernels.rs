//! The small kernels the examples, tests and benchmarks run (`kernels/kernels.cu`, PTX checked in at
//! `kernels/kernels.ptx`, JIT-compiled by the driver for the GPU it runs on).
//!
//! They exist to prove hand-offs correct: a producer fills a buffer with a pattern that depends on a
//! seed and on each element's index; a consumer counts the elements that differ. A read that raced a
//! write, or landed at the wrong offset, shows up as a non-zero count.

use crate::driver::{Context, DeviceMemory, Function, LaunchConfig, Module, Stream};
use crate::error::{Error, Result};
use std::ffi::c_void;
use std::sync::Arc;

/// The PTX text of `kernels/kernels.cu` (compute_75, PTX ISA 8.0: any CUDA 12 or newer driver).
pub const PTX: &str = include_str!("../kernels/kernels.ptx");

/// The host-side twin of the kernels' pattern: the 32-bit word at index `i` of a buffer tagged `seed`.
pub fn pattern(seed: u32, i: u64) -> u32 {
    let mut x = seed.wrapping_mul(2_654_435_761)
        ^ (i as u32)
        ^ ((i >> 32) as u32).wrapping_mul(0x9E37_79B9);
    x ^= x >> 16;
    x = x.wrapping_mul(0x85EB_CA6B);
    x ^= x >> 13;
    x.wrapping_add(i as u32)
}

/// The loaded kernels of one context.
#[derive(Debug, Clone)]
pub struct Kernels {
    fill: Function,
    check: Function,
    xor: Function,
    check_xor: Function,
    spin: Function,
    stamp: Function,
    sum: Function,
    rgba_planar: Function,
}

fn words(mem: &(impl DeviceMemory + ?Sized)) -> Result<u64> {
    if !mem.len().is_multiple_of(4) {
        return Err(Error::InvalidArgument(format!(
            "pattern kernels work on 32-bit words; length {} is not a multiple of 4",
            mem.len()
        )));
    }
    Ok(mem.len() as u64 / 4)
}

macro_rules! args {
    ($($x:expr),*) => { [$( (&$x as *const _ as *mut c_void) ),*] };
}

impl Kernels {
    /// Loads [`PTX`] into `ctx`.
    ///
    /// # Errors
    /// As [`Module::from_ptx`] (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION` on drivers older than CUDA 13.0).
    pub fn load(ctx: &Arc<Context>) -> Result<Kernels> {
        let m = Module::from_ptx(ctx, PTX)?;
        Ok(Kernels {
            fill: m.function("fill_pattern")?,
            check: m.function("check_pattern")?,
            xor: m.function("xor_u32")?,
            check_xor: m.function("check_pattern_xor")?,
            spin: m.function("spin_ns")?,
            stamp: m.function("stamp_globaltimer")?,
            sum: m.function("sum_u32")?,
            rgba_planar: m.function("rgba_to_planar_f32")?,
        })
    }

    /// Enqueues `mem[i] = pattern(seed, i)` for every 32-bit word.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a length not a multiple of 4; launch errors.
    pub fn fill_pattern(
        &self,
        mem: &(impl DeviceMemory + ?Sized),
        seed: u32,
        stream: &Stream,
    ) -> Result<()> {
        let n = words(mem)?;
        let p = mem.device_ptr();
        // SAFETY: parameters match `fill_pattern(unsigned*, unsigned long long, unsigned)`; `p`
        // addresses `n` words of `mem`, valid in the stream's context while the caller keeps `mem`
        // (the hand-off protocol keeps buffers alive until their streams are done).
        unsafe {
            self.fill.launch(
                LaunchConfig::for_elements(n),
                stream,
                &mut args!(p, n, seed),
            )
        }
    }

    /// Enqueues a count of words with `mem[i] != pattern(seed, i)`, added to the `u64` at
    /// `counter` (a device buffer of at least 8 bytes).
    ///
    /// # Errors
    /// As [`Kernels::fill_pattern`]; [`Error::InvalidArgument`] when `counter` is under 8 bytes.
    pub fn check_pattern(
        &self,
        mem: &(impl DeviceMemory + ?Sized),
        seed: u32,
        counter: &(impl DeviceMemory + ?Sized),
        stream: &Stream,
    ) -> Result<()> {
        let n = words(mem)?;
        let (p, c) = (mem.device_ptr(), counter_ptr(counter)?);
        // SAFETY: parameters match `check_pattern(const unsigned*, ull, unsigned, ull*)`; both
        // pointers valid in the stream's context for the kernel's duration (caller keeps them).
        unsafe {
            self.check.launch(
                LaunchConfig::for_elements(n),
                stream,
                &mut args!(p, n, seed, c),
            )
        }
    }

    /// Enqueues `dst[i] = src[i] ^ key` (in place when both are the same memory).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lengths differ or are not multiples of 4; launch errors.
    pub fn xor(
        &self,
        src: &(impl DeviceMemory + ?Sized),
        dst: &(impl DeviceMemory + ?Sized),
        key: u32,
        stream: &Stream,
    ) -> Result<()> {
        let n = words(src)?;
        if dst.len() != src.len() {
            return Err(Error::InvalidArgument("xor needs equal lengths".into()));
        }
        let (s, d) = (src.device_ptr(), dst.device_ptr());
        // SAFETY: parameters match `xor_u32(const unsigned*, unsigned*, ull, unsigned)`; both
        // ranges hold `n` words valid in the stream's context while the caller keeps them.
        unsafe {
            self.xor.launch(
                LaunchConfig::for_elements(n),
                stream,
                &mut args!(s, d, n, key),
            )
        }
    }

    /// Enqueues a count of words with `mem[i] != pattern(seed, i) ^ key` into `counter`.
    ///
    /// # Errors
    /// As [`Kernels::check_pattern`].
    pub fn check_pattern_xor(
        &self,
        mem: &(impl DeviceMemory + ?Sized),
        seed: u32,
        key: u32,
        counter: &(impl DeviceMemory + ?Sized),
        stream: &Stream,
    ) -> Result<()> {
        let n = words(mem)?;
        let (p, c) = (mem.device_ptr(), counter_ptr(counter)?);
        // SAFETY: parameters match `check_pattern_xor(const unsigned*, ull, unsigned, unsigned,
        // ull*)`; pointers valid as for `check_pattern`.
        unsafe {
            self.check_xor.launch(
                LaunchConfig::for_elements(n),
                stream,
                &mut args!(p, n, seed, key, c),
            )
        }
    }

    /// Enqueues a kernel that keeps the stream busy for `ns` nanoseconds of GPU time.
    ///
    /// # Errors
    /// Launch errors.
    pub fn spin(&self, ns: u64, stream: &Stream) -> Result<()> {
        let cfg = LaunchConfig {
            grid: (1, 1, 1),
            block: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: parameters match `spin_ns(unsigned long long)`; no pointers.
        unsafe { self.spin.launch(cfg, stream, &mut args!(ns)) }
    }

    /// Enqueues a kernel that writes the GPU's `%globaltimer` (ns) into the first 8 bytes of `out`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `out` is under 8 bytes; launch errors.
    pub fn stamp(&self, out: &(impl DeviceMemory + ?Sized), stream: &Stream) -> Result<()> {
        let p = counter_ptr(out)?;
        let cfg = LaunchConfig {
            grid: (1, 1, 1),
            block: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: parameters match `stamp_globaltimer(ull*)`; `p` holds 8 bytes valid in the context.
        unsafe { self.stamp.launch(cfg, stream, &mut args!(p)) }
    }

    /// Enqueues the 64-bit sum of all 32-bit words of `mem`, added to the `u64` at `counter`.
    ///
    /// # Errors
    /// As [`Kernels::check_pattern`].
    pub fn sum(
        &self,
        mem: &(impl DeviceMemory + ?Sized),
        counter: &(impl DeviceMemory + ?Sized),
        stream: &Stream,
    ) -> Result<()> {
        let n = words(mem)?;
        let (p, c) = (mem.device_ptr(), counter_ptr(counter)?);
        // SAFETY: parameters match `sum_u32(const unsigned*, ull, ull*)`; pointers valid as above.
        unsafe {
            self.sum
                .launch(LaunchConfig::for_elements(n), stream, &mut args!(p, n, c))
        }
    }

    /// Enqueues the conversion of `npix` RGBA8 pixels in `rgba` into three f32 planes (R, G, B,
    /// scaled to 0..1) in `planes` (`3 * npix * 4` bytes).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the buffers are too small; launch errors.
    pub fn rgba_to_planar(
        &self,
        rgba: &(impl DeviceMemory + ?Sized),
        planes: &(impl DeviceMemory + ?Sized),
        npix: u64,
        stream: &Stream,
    ) -> Result<()> {
        if (rgba.len() as u64) < npix * 4 || (planes.len() as u64) < npix * 12 {
            return Err(Error::InvalidArgument(format!(
                "{npix} pixels need {} input and {} output bytes",
                npix * 4,
                npix * 12
            )));
        }
        let (i, o) = (rgba.device_ptr(), planes.device_ptr());
        // SAFETY: parameters match `rgba_to_planar_f32(const uchar*, float*, ull)`; sizes checked.
        unsafe {
            self.rgba_planar.launch(
                LaunchConfig::for_elements(npix),
                stream,
                &mut args!(i, o, npix),
            )
        }
    }
}

fn counter_ptr(counter: &(impl DeviceMemory + ?Sized)) -> Result<u64> {
    if counter.len() < 8 {
        return Err(Error::InvalidArgument(
            "a counter needs at least 8 bytes of device memory".into(),
        ));
    }
    Ok(counter.device_ptr())
}

#[cfg(test)]
mod tests {
    #[test]
    fn ptx_is_embedded_and_names_every_kernel() {
        for k in [
            "fill_pattern",
            "check_pattern",
            "xor_u32",
            "check_pattern_xor",
            "spin_ns",
            "stamp_globaltimer",
            "sum_u32",
            "rgba_to_planar_f32",
        ] {
            assert!(super::PTX.contains(&format!(".entry {k}(")), "{k} missing");
        }
    }
}
