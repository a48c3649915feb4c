//! GPU tests of exporting memory cuda-ipc did not allocate (`ipc::ForeignBuffer`, and with the
//! `cudarc` feature `cudarc_interop`): the exportable kinds are read in another process, the others
//! are refused with their typed error before any IPC call. They need a CUDA GPU and fail without
//! one; `cargo test` lists them as ignored.
//!
//! The tests of this file run one at a time (`SERIAL`): some make an exportable pool the device's
//! current pool, which is process-wide, and the refusal tests count IPC export calls.

mod common;

use common::{Peer, ctx, role, tell};
use cuda_ipc::Error;
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory, Stream};
use cuda_ipc::ipc::{
    ForeignBuffer, ForeignKind, ImportedBuffer, NotExportable, VmmBuffer, classify, foreign_stats,
};
use cuda_ipc::raw::kernels::pattern;
use cuda_ipc::token::Token;
use cudarc::driver::sys;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const TOKEN_ENV: &str = "CUDA_IPC_TEST_TOKEN";
const SEED_ENV: &str = "CUDA_IPC_TEST_SEED";

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `n` words of the pattern of `seed`, as bytes.
fn pattern_bytes(seed: u32, n: usize) -> Vec<u8> {
    (0..n as u64)
        .flat_map(|i| pattern(seed, i).to_le_bytes())
        .collect()
}

/// The child's side of [`read_in_another_process`]: imports the token, copies it to the host and
/// reports how many words differ from the pattern.
fn reader() {
    let ctx = ctx();
    let tok = Token::from_hex(&std::env::var(TOKEN_ENV).unwrap()).unwrap();
    let seed: u32 = std::env::var(SEED_ENV).unwrap().parse().unwrap();
    let buf = ImportedBuffer::open_in(&ctx, &tok).unwrap();
    assert!(!buf.is_local());
    let mut got = vec![0u8; buf.len()];
    buf.copy_to_host(0, &mut got).unwrap();
    let want = pattern_bytes(seed, buf.len() / 4);
    let bad = got
        .chunks(4)
        .zip(want.chunks(4))
        .filter(|(a, b)| a != b)
        .count();
    tell(format!("mismatches {bad} len {}", buf.len()));
}

/// Runs `test` of this binary as the reader of `token` and checks it read `len` bytes of the
/// pattern of `seed`.
fn read_in_another_process(test: &str, token: &Token, seed: u32, len: usize) {
    let hex = token.to_hex();
    let seed_s = seed.to_string();
    let mut p = Peer::spawn(test, "reader", &[(TOKEN_ENV, &hex), (SEED_ENV, &seed_s)]);
    let rest = p.expect("mismatches ", T);
    assert_eq!(
        rest,
        format!("0 len {len}"),
        "the other process read wrong data"
    );
    p.finish(T);
}

/// `cuMemAlloc_v2` of `len` bytes with raw driver calls, as another library would.
fn raw_alloc(ctx: &Arc<Context>, len: usize) -> u64 {
    let _cur = ctx.enter().unwrap();
    let mut p = 0u64;
    // SAFETY: context current; `p` a valid out-pointer.
    let r = unsafe { sys::cuMemAlloc_v2(&mut p, len) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    p
}

fn raw_free(ctx: &Arc<Context>, p: u64) {
    let _cur = ctx.enter().unwrap();
    // SAFETY: `p` came from cuMemAlloc_v2 and every user of it is done.
    let r = unsafe { sys::cuMemFree_v2(p) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}

/// The refusal `from_raw` gives for `ptr..ptr + len`, checking no IPC export call was made for it.
fn refusal(ctx: &Arc<Context>, ptr: u64, len: usize) -> NotExportable {
    let before = foreign_stats();
    // SAFETY: the memory is never exported (the call is expected to fail), and stays allocated
    // until after the call.
    let r = unsafe { ForeignBuffer::from_raw(ctx, ptr, len) };
    let after = foreign_stats();
    assert_eq!(
        after.ipc_export_calls, before.ipc_export_calls,
        "an IPC export call was made for memory that is refused"
    );
    assert_eq!(after.refused, before.refused + 1);
    match r {
        Err(Error::NotExportable(e)) => {
            println!("refused as expected: {e}");
            e
        }
        Err(e) => panic!("expected a NotExportable error, got {e}"),
        Ok(b) => panic!("expected a refusal, got {:?}", b.kind()),
    }
}

const LEGACY: &str = "a_raw_cumemalloc_range_exported_through_from_raw_is_read_in_another_process";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_raw_cumemalloc_range_exported_through_from_raw_is_read_in_another_process() {
    if role().as_deref() == Some("reader") {
        return reader();
    }
    let _s = serial();
    let ctx = ctx();
    let (total, offset, len) = (2 << 20, 64 << 10, 1 << 20);
    let base = raw_alloc(&ctx, total);
    {
        // SAFETY: the allocation is freed below, after the export dropped and the reader exited.
        let f = unsafe { ForeignBuffer::from_raw(&ctx, base + offset as u64, len) }.unwrap();
        match f.kind() {
            ForeignKind::Legacy { base: b, size } => {
                assert_eq!(b, base);
                assert!(size >= total, "allocation size {size} < {total}");
            }
            k => panic!("expected legacy memory, got {k:?}"),
        }
        f.copy_from_host(0, &pattern_bytes(7, len / 4)).unwrap();
        let before = foreign_stats().ipc_export_calls;
        let tok = f.export().unwrap();
        assert_eq!(foreign_stats().ipc_export_calls, before + 1);
        assert_eq!((tok.offset, tok.len), (offset as u64, len as u64));
        let again = f.export().unwrap();
        assert_eq!(again.handle, tok.handle);
        assert_eq!(
            foreign_stats().ipc_export_calls,
            before + 1,
            "export reused"
        );
        read_in_another_process(LEGACY, &tok, 7, len);
    }
    raw_free(&ctx, base);
}

const VMM: &str = "a_vmm_buffer_exported_from_its_raw_pointer_is_read_in_another_process";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_vmm_buffer_exported_from_its_raw_pointer_is_read_in_another_process() {
    if role().as_deref() == Some("reader") {
        return reader();
    }
    let _s = serial();
    let ctx = ctx();
    let buf = VmmBuffer::new(&ctx, 2 << 20).unwrap();
    let (offset, len) = (4096usize, 1 << 20);
    buf.copy_from_host(offset, &pattern_bytes(11, len / 4))
        .unwrap();
    // SAFETY: `buf` outlives the export; the VMM import holds its own reference.
    let f =
        unsafe { ForeignBuffer::from_raw(&ctx, buf.device_ptr() + offset as u64, len) }.unwrap();
    assert_eq!(
        f.kind(),
        ForeignKind::Vmm {
            base: buf.device_ptr(),
            size: buf.allocation_size()
        }
    );
    let tok = f.export().unwrap();
    assert_eq!(tok.offset, offset as u64);
    read_in_another_process(VMM, &tok, 11, len);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_range_past_its_allocation_end_is_refused_before_any_ipc_call() {
    let _s = serial();
    let ctx = ctx();
    let buf = DeviceBuffer::new(&ctx, 1 << 20).unwrap();
    let size = match classify(&ctx, buf.device_ptr(), 1).unwrap() {
        ForeignKind::Legacy { size, .. } => size,
        k => panic!("expected legacy memory, got {k:?}"),
    };
    let e = refusal(&ctx, buf.device_ptr(), size + 1);
    assert!(matches!(e, NotExportable::PastAllocation { .. }), "{e:?}");
    let e = refusal(&ctx, buf.device_ptr() + size as u64 - 8, 16);
    assert!(matches!(e, NotExportable::PastAllocation { .. }), "{e:?}");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn default_pool_memory_is_refused_before_any_ipc_call() {
    let _s = serial();
    let ctx = ctx();
    let s = Stream::new(&ctx).unwrap();
    let _cur = ctx.enter().unwrap();
    let mut p = 0u64;
    // SAFETY: context current; live stream of it; `p` a valid out-pointer.
    let r = unsafe { sys::cuMemAllocAsync(&mut p, 1 << 20, s.as_raw()) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    s.synchronize().unwrap();
    let e = refusal(&ctx, p, 1 << 20);
    assert_eq!(e, NotExportable::DefaultPool { ptr: p });
    assert!(e.to_string().contains("MemPool::exportable"), "{e}");
    // SAFETY: `p` came from cuMemAllocAsync on `s` and nothing uses it.
    let r = unsafe { sys::cuMemFreeAsync(p, s.as_raw()) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    s.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn managed_memory_is_refused_before_any_ipc_call() {
    let _s = serial();
    let ctx = ctx();
    let _cur = ctx.enter().unwrap();
    let mut p = 0u64;
    let global = sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32;
    // SAFETY: context current; `p` a valid out-pointer.
    let r = unsafe { sys::cuMemAllocManaged(&mut p, 1 << 20, global) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    assert_eq!(refusal(&ctx, p, 1 << 20), NotExportable::Managed { ptr: p });
    // SAFETY: `p` came from cuMemAllocManaged and nothing uses it.
    let r = unsafe { sys::cuMemFree_v2(p) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn page_locked_and_pageable_host_memory_are_refused_before_any_ipc_call() {
    let _s = serial();
    let ctx = ctx();
    let _cur = ctx.enter().unwrap();
    let mut h: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: context current; `h` a valid out-pointer.
    let r = unsafe { sys::cuMemAllocHost_v2(&mut h, 1 << 20) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let hp = h as u64;
    assert_eq!(refusal(&ctx, hp, 1 << 20), NotExportable::Host { ptr: hp });
    // SAFETY: `h` came from cuMemAllocHost_v2 and nothing uses it.
    let r = unsafe { sys::cuMemFreeHost(h) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);

    let v = vec![0u8; 1 << 20];
    let vp = v.as_ptr() as u64;
    let e = refusal(&ctx, vp, v.len());
    // A driver with heterogeneous memory management may call pageable memory host memory.
    assert!(
        matches!(e, NotExportable::UnknownPointer { ptr } | NotExportable::Host { ptr } if ptr == vp),
        "{e:?}"
    );
}

#[cfg(feature = "cudarc")]
mod cudarc_tests {
    use super::*;
    use cuda_ipc::cudarc_interop;
    use cuda_ipc::ipc::MemPool;
    use cudarc::driver::CudaContext;

    fn cudarc_ctx() -> (Arc<CudaContext>, Arc<Context>) {
        let ctx = ctx();
        let cx = CudaContext::new(ctx.device().ordinal()).expect("cudarc context");
        (cx, ctx)
    }

    const POOL: &str = "cudarc_tests::a_cudarc_slice_allocated_from_an_exportable_pool_made_current_is_read_in_another_process";

    #[test]
    #[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
    fn a_cudarc_slice_allocated_from_an_exportable_pool_made_current_is_read_in_another_process() {
        if role().as_deref() == Some("reader") {
            return reader();
        }
        let _s = serial();
        let (cx, ctx) = cudarc_ctx();
        // cudarc's CudaContext::new is the device's primary context, the crate's context.
        assert_eq!(cudarc_interop::context(&cx).unwrap().as_raw(), ctx.as_raw());
        let n = 1 << 18;
        let host: Vec<u32> = (0..n as u64).map(|i| pattern(5, i)).collect();
        let pool = MemPool::exportable(&ctx).unwrap();
        let stream = cx.new_stream().unwrap();
        let current = pool.make_device_current().unwrap();
        let slice = stream.clone_htod(&host).unwrap();
        current.restore().unwrap();
        {
            let export = cudarc_interop::export(&ctx, &slice).unwrap();
            assert!(
                matches!(export.kind(), ForeignKind::Pool { .. }),
                "{:?}",
                export.kind()
            );
            let tok = export.export().unwrap();
            read_in_another_process(POOL, &tok, 5, n * 4);
            // A view from the allocation's start is exportable, one from inside it is not.
            let head = slice.slice(0..n / 2);
            assert!(cudarc_interop::export(&ctx, &head).is_ok());
            let inner = slice.slice(4..);
            let e = cudarc_interop::export(&ctx, &inner).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::NotExportable(NotExportable::PoolSubRange { offset: 16, .. })
                ),
                "{e}"
            );
        }
        drop(slice);
        stream.synchronize().unwrap();
    }

    #[test]
    #[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
    fn a_cudarc_slice_from_the_default_pool_is_refused_before_any_ipc_call() {
        let _s = serial();
        let (cx, ctx) = cudarc_ctx();
        let stream = cx.new_stream().unwrap();
        let slice = stream.alloc_zeros::<u32>(1 << 16).unwrap();
        let before = foreign_stats();
        let e = cudarc_interop::export(&ctx, &slice).unwrap_err();
        assert_eq!(foreign_stats().ipc_export_calls, before.ipc_export_calls);
        assert!(
            matches!(e, Error::NotExportable(NotExportable::DefaultPool { .. })),
            "{e}"
        );
    }

    #[test]
    #[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
    fn cudarc_views_of_a_crate_buffer_are_never_freed_by_cudarc() {
        let _s = serial();
        let (cx, ctx) = cudarc_ctx();
        let buf = DeviceBuffer::new(&ctx, 1 << 20).unwrap();
        let s = Stream::new(&ctx).unwrap();
        let n = (1 << 20) / 4;
        let host: Vec<u32> = (0..n as u64).map(|i| pattern(9, i)).collect();
        for _ in 0..3 {
            let wrapped = cudarc_interop::stream(&cx, &s).unwrap();
            let mut v = cudarc_interop::slice::<u32, _>(&cx, &buf).unwrap();
            assert_eq!(v.len(), n);
            // SAFETY: neither the `Arc` nor anything allocated on it outlives `wrapped`.
            let arc = unsafe { wrapped.as_arc() };
            arc.memcpy_htod(&host, &mut v.view_mut()).unwrap();
            wrapped.synchronize().unwrap();
            // `v` drops here: had cudarc freed the memory, the next round's copy would fail.
        }
        let mut got = vec![0u8; 1 << 20];
        buf.copy_to_host(0, &mut got).unwrap();
        assert_eq!(got, pattern_bytes(9, n));
        // A type that does not divide the length is refused.
        let odd = DeviceBuffer::new(&ctx, 6).unwrap();
        assert!(cudarc_interop::slice::<u32, _>(&cx, &odd).is_err());
    }
}
