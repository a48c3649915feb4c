//! GPU tests of an update written from many separate sources (`Update::copy_many`, the kernel of
//! `kernels/copy.cu` for small ranges, `cuMemcpyDtoDAsync` for large ones and a handful) and of a
//! buffered update's `copy_ranges_from_previous` over many ranges: every byte of every range lands,
//! at any size and any alignment of source and destination, and nothing outside them changes; a
//! source spanning two neighbouring allocations lands; sources the driver does not know as this
//! device's memory (freed, host, null) are refused before the kernel reads them.
//! They need a CUDA GPU and fail without one; `cargo test` lists them as ignored.

mod common;

use common::ctx;
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory};
use cuda_ipc::tensorset::{DType, GenerationMode, TensorSetOptions, TensorSetWriter, TensorSpec};
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// Byte `i` of the source: a pattern that no shifted copy reproduces.
fn source_byte(i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ (i >> 7) as u8
}

/// Sizes of tensors around the kernel's 16-byte word and its 4 KiB per block, a few past the
/// direct copy's 8 MiB: 500 tensors in all (four launches of the kernel and a partial one).
fn sizes() -> Vec<usize> {
    let mut out = Vec::new();
    for i in 0..497 {
        out.push(match i % 7 {
            0 => 1 + i % 5,
            1 => 15 + i % 3,
            2 => 16 * (1 + i),
            3 => (64 << 10) + i,
            4 => 3 * (64 << 10) - 1,
            5 => 4096 + 13 * i,
            _ => 1000 + i,
        });
    }
    out.extend([(8 << 20) + 3, 9 << 20, (8 << 20) - 1]);
    out
}

/// The whole of the set's one allocation in this update's buffer (gaps between tensors
/// included), for the driver's copies to and from the host.
struct Whole {
    ptr: u64,
    len: usize,
    ctx: Arc<Context>,
}

impl DeviceMemory for Whole {
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

/// [`Whole`] of `u`'s buffer, whose first tensor lies at `first_offset` of it.
fn whole(u: &cuda_ipc::tensorset::Update<'_>, first_offset: u64, len: usize) -> Whole {
    let t = u.device_tensor(0).unwrap();
    Whole {
        ptr: t.device_ptr() - first_offset,
        len,
        ctx: t.context().clone(),
    }
}

/// One `u8` tensor `t{i}` of each size.
fn u8_specs(sizes: &[usize]) -> Vec<TensorSpec> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| TensorSpec::new(format!("t{i}"), DType::U8, &[n as i64]))
        .collect()
}

fn name(prefix: &str) -> String {
    format!("{prefix}-{}", std::process::id())
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn copy_many_lands_every_byte_of_ranges_of_any_size_and_alignment() {
    let c = ctx();
    let sizes = sizes();
    let specs = u8_specs(&sizes);
    let set = name("tscopy");
    let mut w = TensorSetWriter::create(&c, &set, &specs, &TensorSetOptions::new()).unwrap();
    let layout = w.layout().clone();
    // One source buffer; each tensor's source starts at an offset whose alignment cycles
    // through 1, 2, 4, 8 and 16 bytes (so do the kernel's word widths), and the ranges lie
    // apart in it (no two sources back to back).
    let total: usize = sizes.iter().map(|n| n + 64).sum();
    let src = DeviceBuffer::new(&c, total).unwrap();
    let host: Vec<u8> = (0..total).map(source_byte).collect();
    src.copy_from_host(0, &host).unwrap();
    let mut at = 0usize;
    let mut offsets = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let shift = [1, 2, 4, 8, 16, 3][i % 6];
        let o = (at + 32).next_multiple_of(16) + shift % 16;
        offsets.push(o);
        at = o + n;
    }
    assert!(at <= total);
    // Everything else of the buffer: a known byte, to see that nothing outside the ranges moves.
    let u = w.begin(Some(T)).unwrap();
    let alloc_len = layout.allocations()[0] as usize;
    let whole = whole(&u, layout.tensors()[0].offset, alloc_len);
    whole.copy_from_host(0, &vec![0xA5u8; alloc_len]).unwrap();
    let copies: Vec<(usize, u64, u64, usize)> = layout
        .tensors()
        .iter()
        .zip(&offsets)
        .zip(&sizes)
        .map(|((t, &o), &n)| {
            (
                t.allocation as usize,
                t.offset,
                src.device_ptr() + o as u64,
                n,
            )
        })
        .collect();
    // SAFETY: every source range lies in `src`, device memory of this context alive until the
    // stream is drained below; no source overlaps the set's buffer.
    unsafe { u.copy_many(&copies) }.unwrap();
    u.stream().unwrap().synchronize().unwrap();
    let mut back = vec![0u8; alloc_len];
    whole.copy_to_host(0, &mut back).unwrap();
    let mut inside = vec![false; alloc_len];
    for ((t, &o), &n) in layout.tensors().iter().zip(&offsets).zip(&sizes) {
        let d = t.offset as usize;
        assert_eq!(
            &back[d..d + n],
            &host[o..o + n],
            "tensor {} ({n} bytes)",
            t.name
        );
        inside[d..d + n].iter_mut().for_each(|b| *b = true);
    }
    let moved = (0..alloc_len)
        .filter(|&i| !inside[i] && back[i] != 0xA5)
        .count();
    assert_eq!(moved, 0, "bytes outside the ranges changed");
    // A range past its allocation is refused before anything is enqueued.
    let bad = [(0usize, alloc_len as u64 - 1, src.device_ptr(), 2usize)];
    // SAFETY: refused before any copy.
    let e = unsafe { u.copy_many(&bad) }.unwrap_err();
    assert!(e.to_string().contains("leave allocation"), "{e}");
    u.commit().unwrap();
    drop(w);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_buffered_update_copies_many_ranges_of_the_previous_generation() {
    let c = ctx();
    let sizes = sizes();
    let specs = u8_specs(&sizes);
    let set = name("tscopyprev");
    let opts = TensorSetOptions::new().mode(GenerationMode::Buffered(2));
    let mut w = TensorSetWriter::create(&c, &set, &specs, &opts).unwrap();
    let layout = w.layout().clone();
    let alloc_len = layout.allocations()[0] as usize;
    let host: Vec<u8> = (0..alloc_len).map(source_byte).collect();
    let first = layout.tensors()[0].offset;
    // Generation 1: the pattern over the whole allocation.
    let u = w.begin(Some(T)).unwrap();
    whole(&u, first, alloc_len)
        .copy_from_host(0, &host)
        .unwrap();
    u.commit().unwrap();
    // Generation 2, the other buffer: zeros, then every other tensor's range (and a piece of
    // each remaining one at an odd offset) taken from generation 1.
    let mut u = w.begin(Some(T)).unwrap();
    let whole2 = whole(&u, first, alloc_len);
    whole2.copy_from_host(0, &vec![0u8; alloc_len]).unwrap();
    let mut ranges = Vec::new();
    for (i, t) in layout.tensors().iter().enumerate() {
        if i % 2 == 0 {
            ranges.push((t.allocation as usize, t.offset, t.bytes));
        } else if t.bytes > 3 {
            ranges.push((t.allocation as usize, t.offset + 1, t.bytes - 2));
        }
    }
    u.copy_ranges_from_previous(&ranges).unwrap();
    u.stream().unwrap().synchronize().unwrap();
    let mut back = vec![0u8; alloc_len];
    whole2.copy_to_host(0, &mut back).unwrap();
    let mut want = vec![0u8; alloc_len];
    for &(_, off, len) in &ranges {
        let (o, n) = (off as usize, len as usize);
        want[o..o + n].copy_from_slice(&host[o..o + n]);
    }
    let wrong = (0..alloc_len).filter(|&i| back[i] != want[i]).count();
    assert_eq!(wrong, 0, "bytes differing from the ranges of generation 1");
    u.commit().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_range_whose_source_spans_two_neighbouring_allocations_lands() {
    let c = ctx();
    // Device allocations of 16 MiB made one after another: the driver hands out neighbouring
    // addresses, so a range can run from one into the next (as tensors of a caching allocator's
    // neighbouring segments merged into one range do); `cuMemcpyDtoDAsync` refuses such a range.
    const PART: usize = 16 << 20;
    let parts: Vec<DeviceBuffer> = (0..8)
        .map(|_| DeviceBuffer::new(&c, PART).unwrap())
        .collect();
    let pair = parts
        .windows(2)
        .find(|w| w[0].device_ptr() + PART as u64 == w[1].device_ptr())
        .expect("two neighbouring allocations among eight made one after another");
    let host: Vec<u8> = (0..2 * PART).map(source_byte).collect();
    pair[0].copy_from_host(0, &host[..PART]).unwrap();
    pair[1].copy_from_host(0, &host[PART..]).unwrap();
    let len = 20 << 20;
    let start = PART - (7 << 20) + 5;
    let specs = [TensorSpec::new("w", DType::U8, &[len as i64])];
    let set = name("tscopyspan");
    let mut w = TensorSetWriter::create(&c, &set, &specs, &TensorSetOptions::new()).unwrap();
    let t = w.layout().tensors()[0].clone();
    let u = w.begin(Some(T)).unwrap();
    let src = pair[0].device_ptr() + start as u64;
    // SAFETY: the source range lies in the two neighbouring allocations, alive until the stream
    // is drained below.
    unsafe { u.copy_many(&[(t.allocation as usize, t.offset, src, len)]) }.unwrap();
    u.stream().unwrap().synchronize().unwrap();
    let mut back = vec![0u8; len];
    u.device_tensor(0)
        .unwrap()
        .copy_to_host(0, &mut back)
        .unwrap();
    assert!(
        back == host[start..start + len],
        "the spanning range's bytes"
    );
    u.commit().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn sources_the_driver_does_not_know_as_this_devices_memory_are_refused_before_the_kernel() {
    let c = ctx();
    let specs: Vec<TensorSpec> = (0..8)
        .map(|i| TensorSpec::new(format!("t{i}"), DType::U8, &[4096]))
        .collect();
    let set = name("tscopycheck");
    let mut w = TensorSetWriter::create(&c, &set, &specs, &TensorSetOptions::new()).unwrap();
    let layout = w.layout().clone();
    let good = DeviceBuffer::new(&c, 8 * 4096).unwrap();
    good.copy_from_host(0, &vec![7u8; 8 * 4096]).unwrap();
    let freed = {
        let b = DeviceBuffer::new(&c, 1 << 21).unwrap();
        b.device_ptr()
    };
    let host = vec![1u8; 4096];
    let copies = |bad: u64| -> Vec<(usize, u64, u64, usize)> {
        layout
            .tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let src = if i == 5 {
                    bad
                } else {
                    good.device_ptr() + (i * 4096) as u64
                };
                (t.allocation as usize, t.offset, src, 4096)
            })
            .collect()
    };
    let u = w.begin(Some(T)).unwrap();
    for (bad, what) in [
        (freed, "freed device memory"),
        (host.as_ptr() as u64, "pageable host memory"),
        (0, "a null address"),
    ] {
        // SAFETY: the check refuses the bad source before any kernel runs (what the test shows);
        // the good sources stay allocated until the stream is drained.
        let e = unsafe { u.copy_many(&copies(bad)) }.unwrap_err();
        assert!(
            matches!(e, cuda_ipc::Error::InvalidArgument(_)),
            "{what}: {e}"
        );
        // The error names the tensor the source was to be copied into.
        assert!(e.to_string().contains("tensor \"t5\""), "{what}: {e}");
    }
    // The context is whole: the good sources land.
    let ok: Vec<_> = copies(good.device_ptr() + 5 * 4096);
    // SAFETY: every source lies in `good`, alive until the stream is drained.
    unsafe { u.copy_many(&ok) }.unwrap();
    u.stream().unwrap().synchronize().unwrap();
    let mut back = vec![0u8; 4096];
    u.device_tensor(5)
        .unwrap()
        .copy_to_host(0, &mut back)
        .unwrap();
    assert!(back.iter().all(|&b| b == 7));
    u.commit().unwrap();
}
