//! Many device-to-device copies into an update's buffer at once
//! ([`Update::copy_many`](super::Update::copy_many)): a new generation written from many separate
//! source tensors (a model's parameters, each its own allocation of PyTorch's caching allocator).
//!
//! One `cuMemcpyDtoDAsync` per range costs about 5 µs of device time whatever its size (on an
//! H200: 4,608 copies of 1 MiB take 23–33 ms where one copy of the same 4.5 GiB takes 2.4 ms;
//! `cuMemcpyBatchAsync` takes as long, docs/benchmarks.md). Small ranges are therefore copied by
//! a kernel (`kernels/copy.cu`, `copy_ranges`) that takes [`PER_LAUNCH`] ranges per launch in its
//! parameters, so nothing is allocated and nothing outlives the launch; ranges of
//! [`DIRECT_BYTES`] or more, or a handful of ranges, keep one `cuMemcpyDtoDAsync` each, which
//! moves large ranges at copy bandwidth. A range the driver refuses as one copy because its
//! source spans allocations (tensors of neighbouring segments merged into one range) goes to the
//! kernel too. Where the kernel cannot be loaded (a driver older than its PTX), every range is
//! copied by `cuMemcpyDtoDAsync`, a spanning one split where its source's allocations end.

use crate::driver::{Context, Function, LaunchConfig, Module, Stream};
use crate::error::Result;
use crate::ffi::{check, sys};
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// The PTX of `kernels/copy.cu` (compute_75, PTX ISA 9.0: a CUDA 13.0 driver or newer).
pub(crate) const PTX: &str = include_str!("../../../kernels/copy.ptx");

/// Ranges per launch: `COPY_RANGES` of `kernels/copy.cu`.
pub(crate) const PER_LAUNCH: usize = 160;

/// Ranges of at least this many bytes (8 MiB) are copied by one `cuMemcpyDtoDAsync` each.
pub(crate) const DIRECT_BYTES: u64 = 8 << 20;

/// Fewer small ranges than this (in one call) are copied by one `cuMemcpyDtoDAsync` each: the
/// kernel's launch would cost about as much.
pub(crate) const KERNEL_MIN: usize = 4;

/// Bytes of a range one block copies at least (grid columns = the largest range of a launch over
/// this, at most [`MAX_COLUMNS`]): one 16-byte word for each of its 256 threads. On an H200,
/// launches of 160 ranges of 1 MiB copy at 0.88 of one `cudaMemcpyAsync` of the same bytes so
/// (0.82 with four words a thread, fewer blocks), one range of 4.5 GiB at 0.92–0.93 with 1,024 to
/// 4,096 columns (`kernels/copy.cu`).
const BYTES_PER_BLOCK: u64 = 4 << 10;

/// The most blocks one range gets in a launch.
const MAX_COLUMNS: u64 = 4096;

/// The kernel's parameter: `struct CopyRanges` of `kernels/copy.cu`, byte for byte (3,848 bytes,
/// 8-aligned; the PTX declares `.param .align 8 .b8 copy_ranges_param_0[3848]`).
#[repr(C)]
struct CopyRanges {
    dst: [u64; PER_LAUNCH],
    src: [u64; PER_LAUNCH],
    len: [u64; PER_LAUNCH],
    count: u32,
    _pad: u32,
}

const _: () = assert!(std::mem::size_of::<CopyRanges>() == 3848);

/// One device-to-device copy: `(dst, src, len)`, device addresses and bytes.
pub(crate) type Range = (u64, u64, u64);

/// How [`copy`] splits `ranges`: those copied by `cuMemcpyDtoDAsync` each, and the launches of
/// the kernel (each at most [`PER_LAUNCH`] ranges), in the order given.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub direct: Vec<Range>,
    pub launches: Vec<Vec<Range>>,
}

/// The split of `ranges` (empty ones dropped) for a kernel that `loaded` or not.
pub(crate) fn plan(ranges: &[Range], loaded: bool) -> Plan {
    let (mut direct, small): (Vec<Range>, Vec<Range>) = ranges
        .iter()
        .copied()
        .filter(|r| r.2 > 0)
        .partition(|r| r.2 >= DIRECT_BYTES);
    if !loaded || small.len() < KERNEL_MIN {
        direct.extend(small);
        return Plan {
            direct,
            launches: Vec::new(),
        };
    }
    Plan {
        direct,
        launches: small.chunks(PER_LAUNCH).map(<[Range]>::to_vec).collect(),
    }
}

/// The grid of a launch over `ranges`: one row per range, columns for the largest.
fn grid(ranges: &[Range]) -> LaunchConfig {
    let largest = ranges.iter().map(|r| r.2).max().unwrap_or(0);
    LaunchConfig {
        grid: (
            largest.div_ceil(BYTES_PER_BLOCK).clamp(1, MAX_COLUMNS) as u32,
            ranges.len() as u32,
            1,
        ),
        block: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The copy kernel loaded in one context (`cuModuleLoadData` of [`PTX`]; the driver JIT-compiles
/// it once per process and caches the result on disk).
#[derive(Debug)]
pub(crate) struct RangeCopier {
    func: Function,
}

impl RangeCopier {
    fn new(ctx: &Arc<Context>) -> Result<RangeCopier> {
        let m = Module::from_ptx(ctx, PTX)?;
        Ok(RangeCopier {
            func: m.function("copy_ranges")?,
        })
    }
}

/// The copier in `cell`, loaded into `ctx` at the first call; `None` where it cannot be loaded
/// (the reason logged once, at debug level), and then for good.
pub(crate) fn cached<'c>(
    cell: &'c OnceLock<Option<RangeCopier>>,
    ctx: &Arc<Context>,
) -> Option<&'c RangeCopier> {
    cell.get_or_init(|| match RangeCopier::new(ctx) {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::debug!("the copy kernel is not used (one cuMemcpyDtoDAsync per range): {e}");
            None
        }
    })
    .as_ref()
}

/// Enqueues on `stream` a copy of each of `ranges` (see the module's documentation).
///
/// # Errors
/// [`crate::error::Error::Cuda`] naming `cuMemcpyDtoDAsync_v2` or `cuLaunchKernel`; the copies
/// enqueued before the failing call stay enqueued.
///
/// # Safety
/// Every range's destination and source are device memory accessible from `stream`'s context
/// for `len` bytes until the copies ran; no two destinations overlap, nor a destination its own
/// or another range's source, except a range onto itself.
pub(crate) unsafe fn copy<'c>(
    ranges: &[Range],
    stream: &Stream,
    copier: impl Fn() -> Option<&'c RangeCopier>,
) -> Result<()> {
    // The kernel is loaded at the first need: enough small ranges, or a range to spill.
    let small = ranges
        .iter()
        .filter(|r| r.2 > 0 && r.2 < DIRECT_BYTES)
        .count();
    let early = if small >= KERNEL_MIN { copier() } else { None };
    let plan = plan(ranges, early.is_some());
    // Ranges the driver refused as one copy (they span allocations), for the kernel.
    let mut spilled: Vec<Range> = Vec::new();
    if !plan.direct.is_empty() {
        let _cur = stream.context().enter()?;
        for &range in &plan.direct {
            // SAFETY: context current (`_cur`); both ranges accessible (this function's
            // contract); the stream lives for the call.
            unsafe { copy_direct(range, stream, &copier, &mut spilled) }?;
        }
    }
    let Some(copier) = early.or_else(|| (!spilled.is_empty()).then(&copier).flatten()) else {
        return Ok(());
    };
    // The spilled ranges (large ones) in launches of their own, so that the grid's columns for
    // them are not given to every small range's row too.
    let spilled: Vec<Vec<Range>> = spilled.chunks(PER_LAUNCH).map(<[Range]>::to_vec).collect();
    for launch in plan.launches.iter().chain(&spilled) {
        let mut p = CopyRanges {
            dst: [0; PER_LAUNCH],
            src: [0; PER_LAUNCH],
            len: [0; PER_LAUNCH],
            count: launch.len() as u32,
            _pad: 0,
        };
        for (k, &(dst, src, len)) in launch.iter().enumerate() {
            p.dst[k] = dst;
            p.src[k] = src;
            p.len[k] = len;
        }
        let mut params = [(&mut p as *mut CopyRanges).cast::<c_void>()];
        // SAFETY: one parameter, a `CopyRanges` laid out as the kernel's (checked size, `repr(C)`),
        // copied by `cuLaunchKernel` before it returns; the kernel touches only the ranges, which
        // this function's contract keeps accessible until it ran.
        unsafe { copier.func.launch(grid(launch), stream, &mut params)? };
    }
    Ok(())
}

/// One `cuMemcpyDtoDAsync_v2` of `range`. Where the driver refuses it as an invalid value (a
/// source that runs on from one allocation into the next, as tensors of a caching allocator's
/// neighbouring segments merged into one range do): pushed onto `spill` (for the kernel, which
/// reads across allocations) where `copier` gives the kernel, else one copy per source allocation, split where
/// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` and `RANGE_SIZE` say each ends; the first error stands
/// where that does not help.
///
/// # Safety
/// The range's context is current; its bytes are accessible as [`copy`] requires.
unsafe fn copy_direct<'c>(
    (dst, src, len): Range,
    stream: &Stream,
    copier: impl Fn() -> Option<&'c RangeCopier>,
    spill: &mut Vec<Range>,
) -> Result<()> {
    let one = |dst: u64, src: u64, len: u64| {
        // SAFETY: the caller's contract, for a part of its range.
        check("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, len as usize, stream.as_raw())
        })
    };
    let Err(first) = one(dst, src, len) else {
        return Ok(());
    };
    if first.code != sys::CUresult::CUDA_ERROR_INVALID_VALUE as u32 {
        return Err(first.into());
    }
    if copier().is_some() {
        spill.push((dst, src, len));
        return Ok(());
    }
    let mut done = 0u64;
    while done < len {
        let at = src + done;
        let Some(end) = allocation_end(at) else {
            return Err(first.into());
        };
        let n = end.saturating_sub(at).min(len - done);
        if n == 0 || n == len {
            return Err(first.into());
        }
        one(dst + done, at, n)?;
        done += n;
    }
    Ok(())
}

/// The end of the allocation holding device address `ptr` (`cuPointerGetAttributes`), `None`
/// where the driver does not know it. The context is current.
fn allocation_end(ptr: u64) -> Option<u64> {
    use sys::CUpointer_attribute as A;
    let mut attrs = [
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    ];
    let mut vals = [0u64; 2];
    let mut data: [*mut c_void; 2] = std::array::from_fn(|i| (&raw mut vals[i]).cast());
    // SAFETY: `attrs` and `data` hold 2 entries each, every `data` entry points to 8 writable
    // bytes (a pointer and a size) that outlive the call; an unknown pointer gets zeros.
    check("cuPointerGetAttributes", unsafe {
        sys::cuPointerGetAttributes(2, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr)
    })
    .ok()?;
    let [start, size] = vals;
    (start != 0 && size != 0 && (start..start + size).contains(&ptr)).then_some(start + size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_ranges_and_a_handful_of_small_ones_are_copied_directly() {
        let big = (0, 1 << 40, DIRECT_BYTES);
        let small = (4096, 2 << 40, 4096);
        let p = plan(&[big, small, small, small], true);
        assert_eq!(p.direct, vec![big, small, small, small]);
        assert!(p.launches.is_empty());
    }

    #[test]
    fn small_ranges_go_to_launches_of_at_most_per_launch_in_order() {
        let ranges: Vec<Range> = (0..(2 * PER_LAUNCH as u64 + 3))
            .map(|i| (i << 20, (1 << 40) + (i << 20), 1 << 20))
            .collect();
        let mut with_big = ranges.clone();
        with_big.insert(5, (1 << 50, 1 << 51, 64 << 20));
        with_big.push((7, 8, 0)); // empty: dropped
        let p = plan(&with_big, true);
        assert_eq!(p.direct, vec![(1 << 50, 1 << 51, 64 << 20)]);
        assert_eq!(
            p.launches.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![PER_LAUNCH, PER_LAUNCH, 3]
        );
        assert_eq!(p.launches.concat(), ranges);
    }

    #[test]
    fn without_the_kernel_every_range_is_copied_directly() {
        let ranges: Vec<Range> = (0..100)
            .map(|i| (i << 20, (1 << 40) + (i << 20), 512))
            .collect();
        let p = plan(&ranges, false);
        assert_eq!(p.direct, ranges);
        assert!(p.launches.is_empty());
    }

    #[test]
    fn a_launch_has_a_row_per_range_and_columns_for_the_largest() {
        let g = grid(&[(0, 0, 1), (0, 0, 3 << 20), (0, 0, 100)]);
        assert_eq!(g.grid, (768, 3, 1));
        assert_eq!(g.block, (256, 1, 1));
        assert_eq!(grid(&[(0, 0, 1)]).grid, (1, 1, 1));
        assert_eq!(
            grid(&[(0, 0, DIRECT_BYTES * 1000)]).grid.0,
            MAX_COLUMNS as u32
        );
    }

    #[test]
    fn the_parameter_matches_the_kernels() {
        // The PTX's parameter: `.param .align 8 .b8 copy_ranges_param_0[3848]`.
        assert!(PTX.contains("copy_ranges_param_0[3848]"));
        assert!(PTX.contains(".align 8"));
        assert_eq!(std::mem::align_of::<CopyRanges>(), 8);
    }
}
