//! GPU test of `ipc::VmmArena`: allocations carved out of VMM chunks are mapped read/write,
//! aligned, located in their chunk, reused after a free, and the chunks export. It needs a CUDA GPU
//! and fails without one; `cargo test` lists it as ignored.

mod common;

use common::ctx;
use cuda_ipc::driver::DeviceMemory;
use cuda_ipc::ipc::{ARENA_ALIGN, ArenaOptions, VmmArena};
use cuda_ipc::token::TokenKind;
use cudarc::driver::sys;

const MIB: usize = 1 << 20;

/// Writes `len` bytes of `byte` at `ptr` and reads them back through a host copy.
fn round_trip(ctx: &cuda_ipc::driver::Context, ptr: u64, len: usize, byte: u8) -> Vec<u8> {
    let _cur = ctx.enter().unwrap();
    let src = vec![byte; len];
    let mut dst = vec![0u8; len];
    // SAFETY: context current; `ptr` names `len` mapped bytes of an arena allocation; `src` holds
    // `len` bytes.
    let r = unsafe { sys::cuMemcpyHtoD_v2(ptr, src.as_ptr().cast(), len) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: as above; `dst` holds `len` bytes.
    let r = unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), ptr, len) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    dst
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn an_arena_carves_chunks_and_locates_ranges() {
    let ctx = ctx();
    let mut opts = ArenaOptions::with_chunk_bytes(64 * MIB);
    opts.release_empty_chunks = false;
    let arena = VmmArena::new(&ctx, opts).unwrap();
    assert_eq!(arena.stats().chunks, 0);
    assert!(arena.alloc(0).is_err());

    // Small and odd sizes, then segment-sized ones, as PyTorch's caching allocator asks.
    let sizes = [
        1usize,
        513,
        4096,
        2 * MIB,
        20 * MIB,
        20 * MIB,
        20 * MIB,
        2 * MIB,
    ];
    let ptrs: Vec<u64> = sizes.iter().map(|&s| arena.alloc(s).unwrap()).collect();
    for (&p, &s) in ptrs.iter().zip(&sizes) {
        assert!(p.is_multiple_of(ARENA_ALIGN), "{p:#x} aligned");
        assert_eq!(
            arena.allocation_len(p),
            Some(s.next_multiple_of(ARENA_ALIGN as usize))
        );
    }
    let st = arena.stats();
    assert_eq!(st.allocations, sizes.len());
    assert_eq!(st.chunks, 2, "about 66 MiB in chunks of 64 MiB: {st:?}");
    assert!(st.reserved_bytes >= 128 * MIB as u64);

    // Every allocation is mapped read/write in the context.
    for (i, (&p, &s)) in ptrs.iter().zip(&sizes).enumerate() {
        let n = s.min(MIB);
        assert!(
            round_trip(&ctx, p, n, i as u8 + 1)
                .iter()
                .all(|&b| b == i as u8 + 1)
        );
    }

    // Located in their chunk, at the right offset; the chunk exports as a VMM token.
    let chunks = arena.chunks();
    assert_eq!(chunks.len(), 2);
    for (&p, &s) in ptrs.iter().zip(&sizes) {
        let (idx, buf, off) = arena.locate(p, s).unwrap();
        assert_eq!(buf.device_ptr(), chunks[idx].device_ptr());
        assert_eq!(buf.device_ptr() + off, p);
        assert!(off as usize + s <= buf.len());
    }
    assert!(
        arena.locate(ptrs[0] + 16, 16).is_some(),
        "inside an allocation"
    );
    assert!(arena.locate(0x10, 16).is_none());
    let tok = chunks[0].export().unwrap();
    assert_eq!(tok.kind, TokenKind::VmmMemory);

    // A request larger than a chunk gets a chunk of its own size.
    let big = arena.alloc(100 * MIB).unwrap();
    assert_eq!(arena.stats().chunks, 3);
    assert!(arena.chunks()[2].len() >= 100 * MIB);

    // Frees: unknown pointers are errors, freed memory is reused first fit.
    assert!(arena.free(big + 512).is_err());
    arena.free(big).unwrap();
    assert!(arena.free(big).is_err(), "double free");
    arena.free(ptrs[3]).unwrap();
    assert_eq!(arena.alloc(2 * MIB).unwrap(), ptrs[3]);
    assert_eq!(arena.stats().chunks, 3, "chunks are kept by default");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn an_arena_releases_empty_chunks_when_asked() {
    let ctx = ctx();
    let mut opts = ArenaOptions::with_chunk_bytes(8 * MIB);
    opts.release_empty_chunks = true;
    let arena = VmmArena::new(&ctx, opts).unwrap();
    let a = arena.alloc(6 * MIB).unwrap();
    let b = arena.alloc(6 * MIB).unwrap();
    assert_eq!(arena.stats().chunks, 2);
    arena.free(a).unwrap();
    assert_eq!(arena.stats().chunks, 1);
    assert!(arena.locate(b, MIB).is_some_and(|(i, _, _)| i == 0));
    arena.free(b).unwrap();
    let st = arena.stats();
    assert_eq!((st.chunks, st.reserved_bytes, st.in_use_bytes), (0, 0, 0));
}
