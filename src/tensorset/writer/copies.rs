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
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// The PTX of `kernels/copy.cu` (compute_75, PTX ISA 8.0: any CUDA 12 or newer driver).
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

/// Enqueues on `stream` a copy of each of `ranges` (see the module's documentation). With
/// `check`, the source of every range the kernel copies is first checked against what the driver
/// knows of its memory ([`check_sources`]: one query per allocation touched),
/// and a range the driver's copy refuses goes to the kernel only once it passed that check too;
/// `check` names what a destination address belongs to (a tensor), for the error of a source
/// refused.
///
/// # Errors
/// [`Error::InvalidArgument`] for a source that fails the check (nothing of the kernel's ranges
/// enqueued); [`Error::Cuda`] naming `cuMemcpyDtoDAsync_v2` or `cuLaunchKernel`; the copies
/// enqueued before the failing call stay enqueued.
///
/// # Safety
/// 1. Every range's destination is device memory of `stream`'s context for `len` bytes.
/// 2. Every source stays allocated until the copies ran.
/// 3. Without `check` (`None`), every source is memory a kernel of that context can read (its device's
///    memory, allocated in that context or by VMM or a memory pool with access for the device,
///    or managed memory).
/// 4. No two destinations overlap, nor a destination its own or another range's source, except
///    a range onto itself.
pub(crate) unsafe fn copy<'c>(
    ranges: &[Range],
    stream: &Stream,
    copier: impl Fn() -> Option<&'c RangeCopier>,
    check: Option<&dyn Fn(u64) -> Option<String>>,
) -> Result<()> {
    // The kernel is loaded at the first need: enough small ranges, or a range to spill.
    let small = ranges
        .iter()
        .filter(|r| r.2 > 0 && r.2 < DIRECT_BYTES)
        .count();
    let early = if small >= KERNEL_MIN { copier() } else { None };
    let plan = plan(ranges, early.is_some());
    let ctx = stream.context();
    if let Some(describe) = check
        && !plan.launches.is_empty()
    {
        let _cur = ctx.enter()?;
        check_sources(&plan.launches.concat(), ctx, describe)?;
    }
    // Ranges the driver refused as one copy (they span allocations), for the kernel.
    let mut spilled: Vec<Range> = Vec::new();
    if !plan.direct.is_empty() {
        let _cur = ctx.enter()?;
        for &range in &plan.direct {
            // SAFETY: context current (`_cur`); destinations and sources as this function's
            // contract says; the stream lives for the call.
            unsafe { copy_direct(range, stream, &copier, &mut spilled) }?;
        }
        // With `check`, a refused range reaches the kernel only if all its bytes lie in readable
        // memory of this device (the driver refuses an unknown address the same way); without,
        // the caller vouches for every source (checked before, allocated since).
        if let Some(describe) = check {
            check_sources(&spilled, ctx, describe)?;
        }
    }
    let Some(copier) = early.or_else(|| (!spilled.is_empty()).then(&copier).flatten()) else {
        return Ok(());
    };
    // The spilled ranges in launches of their own (each as large as the part of its source that
    // spans allocations: usually large), so that the grid's columns for them are not given to
    // every small range's row too.
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
/// 1. The range's context is current.
/// 2. Its bytes are accessible as [`copy`] requires.
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
        let Some(end) = allocation_at(at).map(|a| a.end) else {
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

/// What the driver knows of the allocation holding a device address
/// (`cuPointerGetAttributes`).
struct Allocation {
    /// The address range the driver gives (`RANGE_START_ADDR`, `RANGE_SIZE`): a `cuMemAlloc`
    /// allocation's own, but for VMM memory the whole reservation, mapped or not.
    start: u64,
    end: u64,
    /// `CUmemorytype` (device 2, host 1).
    memory_type: u32,
    device: i32,
    /// The allocation's context; 0 for memory of no context (VMM mappings, memory pools).
    context: u64,
    /// `CUDA_POINTER_ATTRIBUTE_ACCESS_FLAGS` of the current context's device (0 none, 1 read,
    /// 3 read and write).
    access: u32,
    managed: bool,
    /// Whether the address is mapped to backing memory (`MAPPED`).
    mapped: bool,
    /// A `cuMemAlloc` allocation (`IS_LEGACY_CUDA_IPC_CAPABLE`): one mapping, whose facts hold
    /// for its whole range.
    legacy: bool,
}

/// The allocation holding `ptr`, `None` where the driver knows no allocation there (or cannot
/// say). A context is current.
fn allocation_at(ptr: u64) -> Option<Allocation> {
    use sys::CUpointer_attribute as A;
    let mut attrs = [
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        A::CU_POINTER_ATTRIBUTE_CONTEXT,
        A::CU_POINTER_ATTRIBUTE_ACCESS_FLAGS,
        A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        A::CU_POINTER_ATTRIBUTE_MAPPED,
        A::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    ];
    // One zeroed 8-byte slot per attribute, wide enough for each one's type (a pointer, a size,
    // an int, a bool); a value the driver leaves unwritten reads as 0.
    let mut vals = [0u64; 9];
    let mut data: [*mut c_void; 9] = std::array::from_fn(|i| (&raw mut vals[i]).cast());
    // SAFETY: `attrs` and `data` hold 9 entries each, every `data` entry points to 8 writable
    // bytes that outlive the call; an unknown pointer gets default values, not an error.
    check("cuPointerGetAttributes", unsafe {
        sys::cuPointerGetAttributes(9, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr)
    })
    .ok()?;
    let [
        start,
        size,
        memory_type,
        device,
        context,
        access,
        managed,
        mapped,
        legacy,
    ] = vals;
    let end = start.saturating_add(size);
    (start != 0 && size != 0 && (start..end).contains(&ptr)).then_some(Allocation {
        start,
        end,
        memory_type: memory_type as u32,
        device: device as u32 as i32,
        context,
        access: access as u32,
        managed: managed as u32 != 0,
        mapped: mapped as u32 != 0,
        legacy: legacy as u32 != 0,
    })
}

/// The smallest granularity of `ctx`'s device's VMM mappings (`cuMemGetAllocationGranularity`,
/// minimum), the unit in which a mapping's presence and access can change; 64 KiB where the
/// driver does not say (smaller than any, so only more queries).
fn mapping_granule(ctx: &Context) -> u64 {
    match crate::ipc::min_granularity(&ctx.device()) {
        Ok(g) if g.is_power_of_two() => g as u64,
        _ => 64 << 10,
    }
}

/// Checks that every byte of every range's source lies in memory a kernel of `ctx` can read:
/// mapped device memory of `ctx`'s device, of `ctx` itself or of no context (VMM mappings,
/// memory pools), that device having at least read access; or managed memory. The ranges are
/// visited by source address. A `cuMemAlloc` allocation's facts serve every range inside it;
/// other memory (VMM, pools, managed) is asked about once per mapping granule touched, since its
/// mappings and their access can differ within the range the driver gives. `ctx` is current.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the first source (its address and bytes, and its
/// destination, with what `describe` says it belongs to) that fails, and why.
pub(crate) fn check_sources(
    ranges: &[Range],
    ctx: &Context,
    describe: &dyn Fn(u64) -> Option<String>,
) -> Result<()> {
    const DEVICE: u32 = 2;
    let ordinal = ctx.device().ordinal() as i32;
    let own = ctx.as_raw() as usize as u64;
    let mut granule: Option<u64> = None;
    let mut order: Vec<usize> = (0..ranges.len()).filter(|&k| ranges[k].2 > 0).collect();
    order.sort_unstable_by_key(|&k| ranges[k].1);
    // The last region found readable: [start, end).
    let mut known: Option<(u64, u64)> = None;
    for k in order {
        let (dst, src, len) = ranges[k];
        let fail = |why: String| -> Error {
            let to = match describe(dst) {
                Some(what) => format!("{what}, at {dst:#x}"),
                None => format!("{dst:#x}"),
            };
            Error::InvalidArgument(format!(
                "a source of {} at {src:#x} (copied to {to}) {why}; the copy kernel reads \
                 mapped device memory of device {ordinal} only",
                crate::error::bytes(len)
            ))
        };
        let end = src
            .checked_add(len)
            .ok_or_else(|| fail("runs past the end of the address space".into()))?;
        let mut at = src;
        while at < end {
            if let Some((s, e)) = known
                && (s..e).contains(&at)
            {
                at = e;
                continue;
            }
            let a = allocation_at(at)
                .ok_or_else(|| fail(format!("has no allocation the driver knows at {at:#x}")))?;
            if !a.managed {
                if a.memory_type != DEVICE {
                    return Err(fail(format!(
                        "lies in memory of type {} (not device memory)",
                        a.memory_type
                    )));
                }
                if a.device != ordinal {
                    return Err(fail(format!("lies on device {}", a.device)));
                }
                if a.context != 0 && a.context != own {
                    return Err(fail("belongs to another CUDA context".into()));
                }
                if !a.mapped {
                    return Err(fail(format!("is not mapped at {at:#x}")));
                }
                if a.access & 1 == 0 {
                    return Err(fail(format!("is not readable by this device at {at:#x}")));
                }
            }
            let region_end = if a.legacy {
                a.end
            } else {
                let g = *granule.get_or_insert_with(|| mapping_granule(ctx));
                a.end.min((at / g).saturating_add(1).saturating_mul(g))
            };
            known = Some((if a.legacy { a.start } else { at }, region_end));
            at = region_end;
        }
    }
    Ok(())
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

    /// Without the kernel (a driver that cannot load its PTX), a range whose source runs from one
    /// allocation into its neighbour is split where the first ends, and small ranges are copied
    /// one by one: every byte lands.
    #[test]
    #[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
    fn without_the_kernel_a_spanning_range_is_split_where_its_allocations_end() {
        use crate::driver::{DeviceBuffer, DeviceMemory};
        const PART: usize = 16 << 20;
        let c = Context::default_device().expect("a CUDA GPU is needed for this test");
        // Allocations made one after another get neighbouring addresses.
        let parts: Vec<DeviceBuffer> = (0..8)
            .map(|_| DeviceBuffer::new(&c, PART).unwrap())
            .collect();
        let pair = parts
            .windows(2)
            .find(|w| w[0].device_ptr() + PART as u64 == w[1].device_ptr())
            .expect("two neighbouring allocations among eight made one after another");
        let host: Vec<u8> = (0..2 * PART).map(|i| (i * 7 + i / 4099) as u8).collect();
        pair[0].copy_from_host(0, &host[..PART]).unwrap();
        pair[1].copy_from_host(0, &host[PART..]).unwrap();
        let dst = DeviceBuffer::new(&c, 32 << 20).unwrap();
        let stream = Stream::new(&c).unwrap();
        let (start, len) = (PART - (7 << 20) + 5, 20 << 20);
        let base = (dst.device_ptr(), pair[0].device_ptr(), pair[1].device_ptr());
        let mut ranges: Vec<Range> = vec![(base.0, base.1 + start as u64, len as u64)];
        let small = |k: usize| ((24 << 20) + k * 8192, (9 << 20) + k * 4097);
        for k in 0..8 {
            let (d, s) = small(k);
            ranges.push((base.0 + d as u64, base.2 + s as u64, 4097));
        }
        // SAFETY: every destination lies in `dst` and no two overlap, every source in the two
        // allocations, all alive until the stream is drained below.
        unsafe {
            copy(
                &ranges,
                &stream,
                || -> Option<&RangeCopier> { None },
                Some(&|_| None),
            )
        }
        .unwrap();
        stream.synchronize().unwrap();
        let mut back = vec![0u8; 32 << 20];
        dst.copy_to_host(0, &mut back).unwrap();
        assert!(
            back[..len] == host[start..start + len],
            "the spanning range"
        );
        for k in 0..8 {
            let (d, s) = small(k);
            assert!(
                back[d..d + 4097] == host[PART + s..PART + s + 4097],
                "small range {k}"
            );
        }
    }

    #[test]
    fn the_parameter_matches_the_kernels() {
        // The PTX's parameter: `.param .align 8 .b8 copy_ranges_param_0[3848]`.
        assert!(PTX.contains("copy_ranges_param_0[3848]"));
        assert!(PTX.contains(".align 8"));
        assert_eq!(std::mem::align_of::<CopyRanges>(), 8);
    }
}
