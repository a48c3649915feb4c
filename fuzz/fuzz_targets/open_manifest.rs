//! Opens a host tensor set whose manifest segment (`cuda-ipc.ts.NAME`) holds arbitrary bytes, as
//! a reader ([`TensorSetReader::open_host`], then its layout, a held generation's tensors, their
//! bytes and digests) and as `cuda-ipc ls` and `gc` look at it ([`inspect`] and
//! [`cleanup::scan`]): every outcome must be a value or an error, never a panic, a fault, a hang
//! or an allocation the segment's bytes did not pay for. The set's writer lives (in this process)
//! and its generation channel and data segment stand; only the manifest is replaced.
//!
//! The first input byte picks the mode: bits 0-1: raw bytes as the whole segment (header page
//! included), a valid manifest with the input's (offset high, offset low, value) triples written
//! over it, or a valid header page with the input as the body (its length recorded, its creation
//! generations of the channel and the data segment the set's own); bit 2: the body's layout
//! fingerprint recomputed from its tables after the edits (as a hostile writer would store it),
//! so the decode's later checks and the reader are reached; bit 3: which set (in place, or
//! buffered with two buffers). A header left without its stamp records a writer that does not
//! run: one that runs, or none, is a creation under way, which every opener awaits for 2 s by
//! design (a wait, not a hang, that would only slow the run).
//!
//! `cargo +nightly fuzz run open_manifest -- -max_len=16384 -max_total_time=60`
#![no_main]

use cuda_ipc::cleanup::{self, Scope};
use cuda_ipc::tensorset::{
    self, DType, GenerationMode, MANIFEST_PREFIX, ReaderOptions, TensorInfo, TensorSetOptions,
    TensorSetReader, TensorSetWriter, TensorSpec,
};
use libfuzzer_sys::fuzz_target;

mod common;
use common::plant;
use std::sync::OnceLock;
use std::time::Duration;

/// Bytes of the manifest's header page, before the body.
const HEADER_PAGE: usize = 4096;
/// Offsets of the init stamp and the writer's pid in the header page.
const STAMP_AT: usize = 12;
const WRITER_PID_AT: usize = 24;
/// A pid no process has (above the kernel's `pid_max` limit of 2^22).
const NO_PROCESS: u32 = (1 << 22) + 7;
/// Offset of the body's length in the header page.
const BODY_LEN_AT: usize = 64;
/// Where the body's generation channel's and data segment's creation generations lie in the
/// segment.
const GENERATIONS: std::ops::Range<usize> = HEADER_PAGE + 128..HEADER_PAGE + 144;

/// A live host set: its name, its manifest segment's bytes as its writer made them, and its
/// writer (kept for the whole run).
struct Set {
    name: String,
    image: Vec<u8>,
    _writer: TensorSetWriter,
}

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed.weight", DType::BF16, &[16, 8]),
        TensorSpec::new("layer.0.bias", DType::F32, &[8]),
        TensorSpec::strided("layer.0.t", DType::F16, &[4, 8], &[1, 4]),
        TensorSpec::new("mask", DType::U8, &[33]),
        TensorSpec::new("scalar", DType::F64, &[]),
        TensorSpec::new("empty", DType::I64, &[0, 5]),
    ]
}

/// Set `which` (0: in place, 1: buffered), made once with every buffer written and committed;
/// its writer is kept for the whole run.
fn set(which: usize) -> &'static Set {
    static SETS: [OnceLock<Set>; 2] = [OnceLock::new(), OnceLock::new()];
    SETS[which].get_or_init(|| {
        let name = format!("fz-ts-{which}-{}", std::process::id());
        let mode = if which == 0 {
            GenerationMode::InPlace
        } else {
            GenerationMode::Buffered(2)
        };
        let opts = TensorSetOptions::new().mode(mode);
        let mut w = TensorSetWriter::create_host(&name, &specs(), &opts).expect("create_host");
        for g in 0..2u8 {
            let sizes: Vec<u64> = w.layout().tensors().iter().map(|t| t.bytes).collect();
            let mut u = w.begin(Some(Duration::from_secs(5))).expect("begin");
            for (i, n) in sizes.iter().enumerate() {
                let bytes: Vec<u8> = (0..*n).map(|k| (k as u8) ^ (i as u8) ^ g).collect();
                u.write_tensor(i, &bytes).expect("write_tensor");
            }
            u.commit_fingerprinted().expect("commit");
        }
        let image =
            std::fs::read(format!("/dev/shm/{MANIFEST_PREFIX}{name}")).expect("read manifest");
        Set {
            name,
            image,
            _writer: w,
        }
    })
}

/// The layout fingerprint of the tensor tables `body` stores, as the decoder recomputes it
/// (`None` where a table, name or dims lie outside the body: the decode refuses those anyway).
fn raw_fingerprint(body: &[u8]) -> Option<[u8; 32]> {
    let get = |off: u64, len: u64| -> Option<&[u8]> {
        let end = usize::try_from(off.checked_add(len)?).ok()?;
        body.get(usize::try_from(off).ok()?..end)
    };
    let r64 = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    let r32 = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    let head = get(0, 128)?;
    let n = r64(head, 16);
    if n > 1 << 16 {
        return None;
    }
    let t_off = r64(head, 48);
    let dims = get(r64(head, 64), r64(head, 72))?;
    let strings = get(r64(head, 80), r64(head, 88))?;
    let mut tensors = Vec::with_capacity(n as usize);
    for i in 0..n {
        let e = get(t_off.checked_add(i * 64)?, 64)?;
        let name_off = r64(e, 0);
        let name_len = u64::from(r32(e, 8));
        let name_end = usize::try_from(name_off.checked_add(name_len)?).ok()?;
        let name = strings.get(usize::try_from(name_off).ok()?..name_end)?;
        let ndim = u64::from(r32(e, 16));
        if ndim > 64 {
            return None;
        }
        let d0 = r64(e, 24).checked_mul(8)?;
        let d_end = usize::try_from(d0.checked_add(16 * ndim)?).ok()?;
        let words: Vec<i64> = dims
            .get(usize::try_from(d0).ok()?..d_end)?
            .chunks_exact(8)
            .map(|w| i64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        let (shape, strides) = words.split_at(ndim as usize);
        tensors.push(TensorInfo {
            name: std::str::from_utf8(name).ok()?.to_string(),
            dtype: DType {
                code: e[12],
                bits: e[13],
                lanes: u16::from_le_bytes([e[14], e[15]]),
            },
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            allocation: r32(e, 32),
            offset: r64(e, 40),
            bytes: r64(e, 48),
        });
    }
    Some(tensorset::fingerprint(&tensors))
}

/// Stores the recomputed fingerprint in the body of manifest image `img` (where its header's
/// body length lies within it).
fn restamp(img: &mut [u8]) {
    let Some(len) = img
        .get(BODY_LEN_AT..BODY_LEN_AT + 8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    else {
        return;
    };
    let Some(body) = usize::try_from(len)
        .ok()
        .and_then(|l| l.checked_add(HEADER_PAGE))
        .and_then(|end| img.get_mut(HEADER_PAGE..end))
    else {
        return;
    };
    if let Some(fp) = raw_fingerprint(body) {
        body[96..128].copy_from_slice(&fp);
    }
}

/// Reads the set as a reader does, touching every tensor it was given.
fn read(name: &str) {
    let Ok(rx) = TensorSetReader::open_host(name, &ReaderOptions::new()) else {
        return;
    };
    let layout = rx.layout();
    let per_buffer = layout.bytes_per_buffer();
    assert!(!layout.allocations().is_empty());
    for (i, t) in layout.tensors().iter().enumerate() {
        assert_eq!(layout.index_of(&t.name), Some(i));
        let alloc = layout.allocations()[t.allocation as usize];
        assert!(
            t.offset
                .checked_add(t.bytes)
                .is_some_and(|end| end <= alloc)
        );
        assert!(alloc <= per_buffer);
        let _ = t.dtype.size_bytes();
    }
    let _ = layout.fingerprint();
    if let Ok(Some(held)) = rx.current() {
        for (i, t) in layout.tensors().iter().enumerate() {
            let _ = held.tensor(i);
            let _ = held.by_name(&t.name);
            if let Ok(bytes) = held.read_tensor(i) {
                assert_eq!(bytes.len() as u64, t.bytes);
            }
        }
        let _ = held.tensor(layout.len());
        let _ = held.whole();
        let _ = held.verify_content();
        let g = held.generation();
        drop(held);
        let _ = rx.wait_newer(g, Some(Duration::from_millis(1)));
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let set = set(usize::from(mode >> 3 & 1));
    let mut img = match mode & 3 {
        0 => rest.to_vec(),
        1 => {
            let mut img = set.image.clone();
            for e in rest.chunks_exact(3) {
                let at = (usize::from(e[0]) << 8 | usize::from(e[1])) % img.len();
                img[at] = e[2];
            }
            img
        }
        _ => {
            let mut img = set.image[..HEADER_PAGE].to_vec();
            img[BODY_LEN_AT..BODY_LEN_AT + 8].copy_from_slice(&(rest.len() as u64).to_le_bytes());
            img.extend_from_slice(rest);
            // The creation generations of the set's channel and data segment, which no input can
            // know (random per creation): the valid body's.
            if let Some(words) = img.get_mut(GENERATIONS) {
                words.copy_from_slice(&set.image[GENERATIONS]);
            }
            img
        }
    };
    if mode & 4 != 0 {
        restamp(&mut img);
    }
    // A header without its stamp that records no writer, or one that runs (this process), is a
    // creation under way, which every opener awaits for 2 s: a wait by design, not a hang. Such a
    // header records a writer that does not run instead, whose creation every opener refuses at
    // once as abandoned.
    if img.len() >= WRITER_PID_AT + 4 && img[STAMP_AT..STAMP_AT + 4] == [0; 4] {
        img[WRITER_PID_AT..WRITER_PID_AT + 4].copy_from_slice(&NO_PROCESS.to_le_bytes());
    }
    let seg = format!("{MANIFEST_PREFIX}{}", set.name);
    if !plant(&seg, &img, false) {
        return;
    }
    read(&set.name);
    if let Ok(s) = tensorset::inspect::inspect(&set.name) {
        assert_eq!(s.name, set.name);
        let _ = s.live_holders();
    }
    let scope = Scope::only(Vec::new(), Vec::new()).with_tensor_sets(vec![set.name.clone()]);
    let _ = cleanup::scan(&scope);
});
