//! The exportable kinds of foreign memory and why the others are refused: the classification
//! from the driver's facts (pure, tested without a GPU) and the driver queries that gather them.

use super::{CLASSIFIED, REFUSED, bump};
use crate::driver::Context;
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use crate::ipc::pool::our_pool;
use std::mem::MaybeUninit;
use std::sync::Arc;

// ------------------------------------------------------------------------------ kinds and errors

/// An exportable kind of foreign memory, as [`classify`] found it. Addresses are device addresses
/// in the context the pointer was classified in; sizes in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForeignKind {
    /// `cuMemAlloc` memory: exported with a legacy `IpcMemHandle` of the whole allocation
    /// `base..base + size` (an importer's mapping covers all of it), the range at its offset.
    Legacy {
        /// Start of the allocation (`CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`).
        base: u64,
        /// Size of the allocation (`CU_POINTER_ATTRIBUTE_RANGE_SIZE`).
        size: usize,
    },
    /// An allocation from one of this crate's exportable pools ([`MemPool::exportable`](crate::ipc::MemPool::exportable)):
    /// exported as a pool token (`cuMemPoolExportPointer`), from the allocation's start.
    Pool {
        /// Start of the allocation.
        base: u64,
        /// Size of the allocation.
        size: usize,
    },
    /// A VMM allocation with POSIX file descriptor handles, mapped alone in its reservation
    /// `base..base + size`: exported as a VMM token (`cuMemExportToShareableHandle`).
    Vmm {
        /// Start of the reserved address range.
        base: u64,
        /// Size of the reserved range (the importer maps this much of the allocation).
        size: usize,
    },
}

impl ForeignKind {
    /// Start of the allocation (or reservation) the pointer lies in.
    pub fn base(&self) -> u64 {
        match *self {
            ForeignKind::Legacy { base, .. }
            | ForeignKind::Pool { base, .. }
            | ForeignKind::Vmm { base, .. } => base,
        }
    }
}

/// Why a pointer cannot be exported: the kind of memory, and what to allocate instead. Returned
/// (as [`Error::NotExportable`]) before any IPC call was made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotExportable {
    /// A null pointer or a range of zero bytes.
    #[error("a null pointer or an empty range cannot be exported")]
    Empty,
    /// The driver does not know the pointer: pageable host memory (a `Vec`, a `Box`, a stack
    /// array) or no memory at all.
    #[error(
        "{ptr:#x} is not memory the CUDA driver knows (pageable host memory such as a Vec?); host memory cannot be exported: copy it into a DeviceBuffer"
    )]
    UnknownPointer {
        /// The pointer.
        ptr: u64,
    },
    /// Page-locked host memory (`cuMemAllocHost`, `cuMemHostAlloc`, `cuMemHostRegister`).
    #[error(
        "{ptr:#x} is host memory (cuMemAllocHost or cuMemHostRegister); host memory cannot be exported: copy it into a DeviceBuffer"
    )]
    Host {
        /// The pointer.
        ptr: u64,
    },
    /// Managed memory (`cuMemAllocManaged`).
    #[error(
        "{ptr:#x} is managed memory (cuMemAllocManaged); managed memory cannot be exported: allocate a DeviceBuffer, a VmmBuffer or from MemPool::exportable"
    )]
    Managed {
        /// The pointer.
        ptr: u64,
    },
    /// A memory type that has no export (a CUDA array, or a type newer than this crate).
    #[error("{ptr:#x} has CUDA memory type {memory_type}, which cannot be exported")]
    UnsupportedType {
        /// The pointer.
        ptr: u64,
        /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`.
        memory_type: u32,
    },
    /// Memory of another device than the context's.
    #[error(
        "{ptr:#x} is memory of device ordinal {found}, not of the context's device {expected}; export it in its own device's context"
    )]
    OtherDevice {
        /// The pointer.
        ptr: u64,
        /// The context's device ordinal.
        expected: i32,
        /// The pointer's device ordinal (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`).
        found: i32,
    },
    /// Memory allocated in another context of the same device (not the primary context).
    #[error(
        "{ptr:#x} was allocated in another context than the device's primary context; export it from the primary context (cudarc's CudaContext::new uses it)"
    )]
    OtherContext {
        /// The pointer.
        ptr: u64,
    },
    /// The range runs past the allocation the pointer lies in.
    #[error(
        "range {ptr:#x}+{len} runs past its allocation {base:#x}+{size}; export at most the allocation"
    )]
    PastAllocation {
        /// The pointer.
        ptr: u64,
        /// The length asked for.
        len: usize,
        /// Start of the allocation.
        base: u64,
        /// Size of the allocation.
        size: usize,
    },
    /// `cuMemAllocAsync` memory from the device's default pool, which has no shareable handles.
    #[error(
        "stream-ordered pool memory from the default pool cannot be exported ({ptr:#x}, cuMemAllocAsync); allocate from MemPool::exportable (MemPool::make_device_current makes cuMemAllocAsync use it) or a DeviceBuffer"
    )]
    DefaultPool {
        /// The pointer.
        ptr: u64,
    },
    /// Stream-ordered memory from a pool this process's cuda-ipc did not create (or has dropped):
    /// its file descriptor is not ours to serve.
    #[error(
        "stream-ordered pool memory from a pool cuda-ipc did not create (or has dropped) cannot be exported ({ptr:#x}); allocate from a live MemPool::exportable or a DeviceBuffer"
    )]
    OtherPool {
        /// The pointer.
        ptr: u64,
    },
    /// Pool memory not at the start of its allocation: a pool token names a whole allocation.
    #[error(
        "pool memory is exported from the start of its allocation: {ptr:#x} lies {} into the allocation at {base:#x}; export the whole allocation",
        crate::error::bytes(.offset)
    )]
    PoolSubRange {
        /// The pointer.
        ptr: u64,
        /// Start of the allocation.
        base: u64,
        /// Bytes from the start.
        offset: u64,
    },
    /// VMM memory created without POSIX file descriptor handles.
    #[error(
        "{ptr:#x} is VMM memory created without POSIX file descriptor handles; create it with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in requestedHandleTypes, or use VmmBuffer"
    )]
    VmmNotFdExportable {
        /// The pointer.
        ptr: u64,
    },
    /// VMM memory whose reservation holds several mappings, so the offset inside the physical
    /// allocation cannot be known.
    #[error(
        "{ptr:#x} is VMM memory whose reserved range {base:#x}+{size} holds more than one mapping, so its offset in the allocation is unknown; map each allocation alone in its own reservation (as VmmBuffer does)"
    )]
    VmmSharedReservation {
        /// The pointer.
        ptr: u64,
        /// Start of the reservation.
        base: u64,
        /// Size of the reservation.
        size: usize,
    },
    /// Device memory the driver does not allow legacy IPC for, and of no other exportable kind.
    #[error(
        "{ptr:#x} is device memory the driver does not allow legacy IPC for (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE is 0) and of no other exportable kind; allocate a VmmBuffer or from MemPool::exportable"
    )]
    NotLegacyIpcCapable {
        /// The pointer.
        ptr: u64,
    },
}

// --------------------------------------------------------------------- the pure classification

/// Where a stream-ordered allocation comes from (`CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum PoolFact {
    /// No pool: not stream-ordered memory.
    #[default]
    None,
    /// One of this crate's live exportable pools.
    Ours,
    /// The device's default pool.
    DeviceDefault,
    /// Another pool.
    Other,
}

/// What `cuMemRetainAllocationHandle` and `ALLOWED_HANDLE_TYPES` say of VMM memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct VmmFact {
    /// POSIX file descriptor handles allowed.
    pub(crate) fd_handles: bool,
    /// The same allocation handle at both ends of the reservation and at the pointer.
    pub(crate) one_mapping: bool,
}

/// The driver's answers about a pointer, gathered before classifying it. `CU_MEMORYTYPE_*`
/// numbers; `context` the `CUcontext` address (0 when the driver reports none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PointerFacts {
    pub(crate) memory_type: u32,
    pub(crate) context: usize,
    pub(crate) device_ordinal: i32,
    pub(crate) is_managed: bool,
    pub(crate) legacy_ipc: bool,
    pub(crate) range_start: u64,
    pub(crate) range_size: usize,
    pub(crate) pool: PoolFact,
    /// `None` when not VMM memory (or not asked: pool or legacy memory is never VMM here).
    pub(crate) vmm: Option<VmmFact>,
}

const MEMORYTYPE_HOST: u32 = 1;
const MEMORYTYPE_DEVICE: u32 = 2;

/// The kind of `ptr..ptr + len` from the driver's facts, for a context `ctx` (its address) on the
/// device with ordinal `ordinal`. Pure: no driver calls.
pub(crate) fn classify_facts(
    f: &PointerFacts,
    ptr: u64,
    len: usize,
    ctx: usize,
    ordinal: i32,
) -> std::result::Result<ForeignKind, NotExportable> {
    use NotExportable as N;
    if ptr == 0 || len == 0 {
        return Err(N::Empty);
    }
    if f.is_managed {
        return Err(N::Managed { ptr });
    }
    match f.memory_type {
        0 if f.context == 0 => return Err(N::UnknownPointer { ptr }),
        MEMORYTYPE_HOST => return Err(N::Host { ptr }),
        MEMORYTYPE_DEVICE => {}
        t => {
            return Err(N::UnsupportedType {
                ptr,
                memory_type: t,
            });
        }
    }
    if f.device_ordinal != ordinal {
        return Err(N::OtherDevice {
            ptr,
            expected: ordinal,
            found: f.device_ordinal,
        });
    }
    // VMM and pool memory belong to no context (the driver reports none); a context reported
    // must be ours.
    if f.context != 0 && f.context != ctx {
        return Err(N::OtherContext { ptr });
    }
    let (base, size) = (f.range_start, f.range_size);
    let inside = ptr >= base
        && (ptr - base)
            .checked_add(len as u64)
            .is_some_and(|end| end <= size as u64);
    if !inside {
        return Err(N::PastAllocation {
            ptr,
            len,
            base,
            size,
        });
    }
    match f.pool {
        PoolFact::None => {}
        PoolFact::DeviceDefault => return Err(N::DefaultPool { ptr }),
        PoolFact::Other => return Err(N::OtherPool { ptr }),
        PoolFact::Ours if ptr != base => {
            return Err(N::PoolSubRange {
                ptr,
                base,
                offset: ptr - base,
            });
        }
        PoolFact::Ours => return Ok(ForeignKind::Pool { base, size }),
    }
    if f.legacy_ipc {
        return Ok(ForeignKind::Legacy { base, size });
    }
    match f.vmm {
        Some(VmmFact {
            fd_handles: false, ..
        }) => Err(N::VmmNotFdExportable { ptr }),
        Some(VmmFact {
            one_mapping: false, ..
        }) => Err(N::VmmSharedReservation { ptr, base, size }),
        Some(_) => Ok(ForeignKind::Vmm { base, size }),
        None => Err(N::NotLegacyIpcCapable { ptr }),
    }
}

// ------------------------------------------------------------------------- the driver's facts

pub(super) const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// `POSIX_FD` as a bit of `CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES`.
fn posix_fd_bit() -> u64 {
    u64::from(crate::driver::MEMPOOL_HANDLE_POSIX_FD)
}

/// Gathers the facts about `ptr` (`cuPointerGetAttributes`, `cuDeviceGetDefaultMemPool`, and for
/// device memory of no pool and no legacy IPC, `cuMemRetainAllocationHandle`). The caller has made
/// `ctx` current.
fn gather(ctx: &Context, ptr: u64) -> Result<PointerFacts> {
    use sys::CUpointer_attribute as A;
    let mut attrs = [
        A::CU_POINTER_ATTRIBUTE_CONTEXT,
        A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        A::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        A::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
        A::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
    ];
    // One zeroed 8-byte slot per attribute: wide enough for each one's type (a pointer, a size,
    // an int, a bool, a 64-bit mask), and a value the driver leaves unwritten reads as 0.
    let mut vals = [0u64; 9];
    let mut data: [*mut std::ffi::c_void; 9] = std::array::from_fn(|i| (&raw mut vals[i]).cast());
    // SAFETY: driver loaded (a Context exists); `attrs` and `data` hold 9 entries each, every
    // `data` entry points to 8 writable bytes that outlive the call. The driver does not fail for
    // a pointer it does not know: it writes default values (the call's documented behaviour).
    check("cuPointerGetAttributes", unsafe {
        sys::cuPointerGetAttributes(9, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr)
    })?;
    let [c, t, ord, managed, legacy, start, size, pool, handles] = vals;
    let mut f = PointerFacts {
        context: c as usize,
        memory_type: t as u32,
        device_ordinal: ord as u32 as i32,
        is_managed: managed != 0,
        legacy_ipc: legacy != 0,
        range_start: start,
        range_size: size as usize,
        pool: PoolFact::None,
        vmm: None,
    };
    if pool != 0 {
        f.pool = if our_pool(pool as usize).is_some() {
            PoolFact::Ours
        } else if pool == default_pool(ctx)? as usize as u64 {
            PoolFact::DeviceDefault
        } else {
            PoolFact::Other
        };
    }
    if f.memory_type == MEMORYTYPE_DEVICE
        && f.pool == PoolFact::None
        && !f.legacy_ipc
        && let Some(h) = retain_handle(ptr)
    {
        let end = f.range_start + (f.range_size as u64).saturating_sub(1);
        let one = [f.range_start, end]
            .into_iter()
            .all(|a| retain_handle(a) == Some(h));
        f.vmm = Some(VmmFact {
            fd_handles: handles & posix_fd_bit() != 0,
            one_mapping: one,
        });
    }
    Ok(f)
}

/// The device's default pool (`cuDeviceGetDefaultMemPool`).
fn default_pool(ctx: &Context) -> Result<sys::CUmemoryPool> {
    let mut p = MaybeUninit::<sys::CUmemoryPool>::uninit();
    // SAFETY: driver loaded; valid device; `p` a valid out-pointer.
    check("cuDeviceGetDefaultMemPool", unsafe {
        sys::cuDeviceGetDefaultMemPool(p.as_mut_ptr(), ctx.device().raw())
    })?;
    // SAFETY: written on success.
    Ok(unsafe { p.assume_init() })
}

/// The VMM allocation handle mapped at `addr` (`cuMemRetainAllocationHandle`, released again at
/// once with `cuMemRelease`); `None` when `addr` is not VMM-mapped memory. The handle value is the
/// one used to map the memory (the driver's guarantee), so two addresses compare by it.
fn retain_handle(addr: u64) -> Option<sys::CUmemGenericAllocationHandle> {
    let mut h = MaybeUninit::<sys::CUmemGenericAllocationHandle>::uninit();
    // SAFETY: driver loaded; `h` a valid out-pointer; the driver validates `addr` (an error for
    // memory that is not VMM-mapped). `addr` is passed as the pointer-sized value it is.
    let r = unsafe { sys::cuMemRetainAllocationHandle(h.as_mut_ptr(), addr as usize as *mut _) };
    check("cuMemRetainAllocationHandle", r).ok()?;
    // SAFETY: written on success.
    let h = unsafe { h.assume_init() };
    // SAFETY: the retain above took one reference, released once here.
    if let Err(e) = check("cuMemRelease", unsafe { sys::cuMemRelease(h) }) {
        tracing::warn!("{e}; a VMM allocation stays referenced until exit");
    }
    Some(h)
}

/// Classifies `ptr..ptr + len` (a device address, `len` in bytes) in `ctx`: which exportable kind
/// it is, or why it cannot be exported. Only queries the driver (`cuPointerGetAttributes`,
/// `cuDeviceGetDefaultMemPool`, `cuMemRetainAllocationHandle`); makes no IPC call.
///
/// # Errors
/// [`Error::NotExportable`] naming the kind and the fix (the table in the module doc);
/// [`Error::Cuda`] when a query fails.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html>.
#[doc(alias = "cuPointerGetAttributes")]
pub fn classify(ctx: &Arc<Context>, ptr: u64, len: usize) -> Result<ForeignKind> {
    bump(&CLASSIFIED);
    let r = (|| {
        if ptr == 0 || len == 0 {
            return Err(NotExportable::Empty.into());
        }
        let _cur = ctx.enter()?;
        let f = gather(ctx, ptr)?;
        let ordinal = ctx.device().ordinal() as i32;
        Ok(classify_facts(
            &f,
            ptr,
            len,
            ctx.as_raw() as usize,
            ordinal,
        )?)
    })();
    if let Err(Error::NotExportable(_)) = &r {
        bump(&REFUSED);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: usize = 0x1000;
    const PTR: u64 = 0x7f00_0000_0000;

    fn device(base: u64, size: usize) -> PointerFacts {
        PointerFacts {
            memory_type: MEMORYTYPE_DEVICE,
            context: CTX,
            device_ordinal: 0,
            legacy_ipc: true,
            range_start: base,
            range_size: size,
            ..Default::default()
        }
    }

    fn classify(
        f: &PointerFacts,
        ptr: u64,
        len: usize,
    ) -> std::result::Result<ForeignKind, NotExportable> {
        classify_facts(f, ptr, len, CTX, 0)
    }

    #[test]
    fn legacy_memory_is_exported_from_its_allocation_base() {
        let f = device(PTR, 4096);
        assert_eq!(
            classify(&f, PTR + 256, 1024),
            Ok(ForeignKind::Legacy {
                base: PTR,
                size: 4096
            })
        );
        assert_eq!(classify(&f, PTR, 4096).map(|k| k.base()), Ok(PTR));
    }

    #[test]
    fn a_range_past_the_allocation_end_is_refused() {
        let f = device(PTR, 4096);
        assert!(matches!(
            classify(&f, PTR + 4000, 97),
            Err(NotExportable::PastAllocation { size: 4096, .. })
        ));
        assert!(matches!(
            classify(&f, PTR - 1, 2),
            Err(NotExportable::PastAllocation { .. })
        ));
        assert!(matches!(
            classify(&f, u64::MAX - 1, usize::MAX),
            Err(NotExportable::PastAllocation { .. })
        ));
    }

    #[test]
    fn null_pointers_and_empty_ranges_are_refused() {
        let f = device(PTR, 4096);
        assert_eq!(classify(&f, 0, 8), Err(NotExportable::Empty));
        assert_eq!(classify(&f, PTR, 0), Err(NotExportable::Empty));
    }

    #[test]
    fn pageable_host_memory_is_an_unknown_pointer() {
        let f = PointerFacts::default();
        assert_eq!(
            classify(&f, PTR, 8),
            Err(NotExportable::UnknownPointer { ptr: PTR })
        );
    }

    #[test]
    fn page_locked_host_memory_is_refused_as_host() {
        let f = PointerFacts {
            memory_type: MEMORYTYPE_HOST,
            context: CTX,
            ..Default::default()
        };
        assert_eq!(classify(&f, PTR, 8), Err(NotExportable::Host { ptr: PTR }));
    }

    #[test]
    fn managed_memory_is_refused_whatever_type_the_driver_reports() {
        for t in [MEMORYTYPE_DEVICE, MEMORYTYPE_HOST, 4] {
            let f = PointerFacts {
                memory_type: t,
                is_managed: true,
                ..device(PTR, 4096)
            };
            assert_eq!(
                classify(&f, PTR, 8),
                Err(NotExportable::Managed { ptr: PTR })
            );
        }
    }

    #[test]
    fn arrays_and_unknown_types_are_refused_with_the_type() {
        let f = PointerFacts {
            memory_type: 3,
            ..device(PTR, 4096)
        };
        assert_eq!(
            classify(&f, PTR, 8),
            Err(NotExportable::UnsupportedType {
                ptr: PTR,
                memory_type: 3
            })
        );
    }

    #[test]
    fn memory_of_another_device_or_context_is_refused() {
        let f = PointerFacts {
            device_ordinal: 1,
            ..device(PTR, 4096)
        };
        assert!(matches!(
            classify(&f, PTR, 8),
            Err(NotExportable::OtherDevice {
                expected: 0,
                found: 1,
                ..
            })
        ));
        let f = PointerFacts {
            context: CTX + 8,
            ..device(PTR, 4096)
        };
        assert_eq!(
            classify(&f, PTR, 8),
            Err(NotExportable::OtherContext { ptr: PTR })
        );
    }

    #[test]
    fn default_pool_memory_is_refused_with_the_exportable_pool_as_fix() {
        let f = PointerFacts {
            legacy_ipc: false,
            context: 0,
            pool: PoolFact::DeviceDefault,
            ..device(PTR, 4096)
        };
        let e = classify(&f, PTR, 8).unwrap_err();
        assert_eq!(e, NotExportable::DefaultPool { ptr: PTR });
        let s = e.to_string();
        assert!(
            s.contains("default pool") && s.contains("MemPool::exportable"),
            "{s}"
        );
    }

    #[test]
    fn memory_of_another_pool_is_refused() {
        let f = PointerFacts {
            legacy_ipc: false,
            pool: PoolFact::Other,
            ..device(PTR, 4096)
        };
        assert_eq!(
            classify(&f, PTR, 8),
            Err(NotExportable::OtherPool { ptr: PTR })
        );
    }

    #[test]
    fn memory_of_our_pool_is_exported_from_the_allocation_start_only() {
        let f = PointerFacts {
            legacy_ipc: false,
            context: 0,
            pool: PoolFact::Ours,
            ..device(PTR, 4096)
        };
        assert_eq!(
            classify(&f, PTR, 100),
            Ok(ForeignKind::Pool {
                base: PTR,
                size: 4096
            })
        );
        assert_eq!(
            classify(&f, PTR + 64, 100),
            Err(NotExportable::PoolSubRange {
                ptr: PTR + 64,
                base: PTR,
                offset: 64
            })
        );
    }

    #[test]
    fn pool_memory_is_never_taken_for_legacy_memory() {
        // Even if a driver reported pool memory as legacy capable, the pool decides.
        let f = PointerFacts {
            pool: PoolFact::DeviceDefault,
            ..device(PTR, 4096)
        };
        assert_eq!(
            classify(&f, PTR, 8),
            Err(NotExportable::DefaultPool { ptr: PTR })
        );
    }

    #[test]
    fn vmm_memory_needs_fd_handles_and_one_mapping() {
        let vmm = |fd_handles, one_mapping| PointerFacts {
            legacy_ipc: false,
            context: 0,
            vmm: Some(VmmFact {
                fd_handles,
                one_mapping,
            }),
            ..device(PTR, 2 << 20)
        };
        assert_eq!(
            classify(&vmm(true, true), PTR + 4096, 8),
            Ok(ForeignKind::Vmm {
                base: PTR,
                size: 2 << 20
            })
        );
        assert_eq!(
            classify(&vmm(false, true), PTR, 8),
            Err(NotExportable::VmmNotFdExportable { ptr: PTR })
        );
        assert!(matches!(
            classify(&vmm(true, false), PTR, 8),
            Err(NotExportable::VmmSharedReservation { .. })
        ));
    }

    #[test]
    fn device_memory_of_no_exportable_kind_is_refused() {
        let f = PointerFacts {
            legacy_ipc: false,
            ..device(PTR, 4096)
        };
        assert_eq!(
            classify(&f, PTR, 8),
            Err(NotExportable::NotLegacyIpcCapable { ptr: PTR })
        );
    }

    #[test]
    fn every_refusal_reads_lower_case_without_a_final_period() {
        let all = [
            NotExportable::Empty,
            NotExportable::UnknownPointer { ptr: PTR },
            NotExportable::Host { ptr: PTR },
            NotExportable::Managed { ptr: PTR },
            NotExportable::DefaultPool { ptr: PTR },
            NotExportable::OtherPool { ptr: PTR },
            NotExportable::VmmNotFdExportable { ptr: PTR },
            NotExportable::NotLegacyIpcCapable { ptr: PTR },
        ];
        for e in all {
            let s = e.to_string();
            assert!(!s.ends_with('.'), "{s}");
            assert!(s.chars().next().is_some_and(|c| !c.is_uppercase()), "{s}");
        }
    }
}
