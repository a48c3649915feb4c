//! The manifest's tensor tables: decoded and checked entry by entry into a layout
//! ([`TensorTables::decode`]), or, for a large manifest, split among several threads with the
//! layout fingerprint recomputed from the tables' raw entries beside the decode
//! ([`TensorTables::decode_verified`]): a reader's open of a set of thousands of tensors then
//! waits for the longer of the two, not for their sum on one thread.
//!
//! The raw encoding is the decoded one's, byte for byte: a name is the string area's bytes, the
//! dtype the entry's four bytes, shape and strides the dims area's little-endian words, which is
//! what [`fingerprint`] writes of a decoded tensor (a unit test holds the two to one digest).

use super::{
    Body, Canonical, DType, Layout, MAX_NAME, MAX_NDIM, ManifestFault, TENSOR_ENTRY, TensorInfo,
    TensorSetError, TensorTables, span_bytes,
};
#[cfg(doc)]
use super::{Manifest, decode_head_within, fingerprint};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

impl TensorTables {
    /// The layout of the body `bytes` these tables were found in (the one given to
    /// [`decode_head_within`]): every tensor's name, dtype, shape, strides and span checked, the name
    /// index made; the fingerprint is the stored one, still to be checked
    /// ([`Manifest::verify_fingerprint`]).
    pub(crate) fn decode(&self, bytes: &[u8]) -> std::result::Result<Layout, ManifestFault> {
        let (t_tab, dims, strings) = self.areas(bytes)?;
        let infos = decode_entries(0..self.tensors, t_tab, dims, strings, || true)?;
        layout_of(infos, &self.allocations, self.fingerprint)
    }

    /// The tensor table, the dims area and the string area of the body `bytes` (ranges checked
    /// by [`decode_head_within`], and again here).
    fn areas<'b>(&self, bytes: &'b [u8]) -> std::result::Result<Areas<'b>, ManifestFault> {
        let b = Body::of(bytes);
        let t_tab = b.bytes("the tensor table", self.table.0, self.table.1)?;
        let dims = b.bytes("the dims area", self.dims.0, self.dims.1)?;
        let strings = b.bytes("the string area", self.strings.0, self.strings.1)?;
        Ok((t_tab, dims, strings))
    }

    /// The number of tensors the table holds.
    pub(crate) fn len(&self) -> usize {
        self.tensors
    }
}

/// A body's tensor table, dims area and string area ([`TensorTables`]).
type Areas<'b> = (&'b [u8], &'b [u8], &'b [u8]);

/// Entries `range` of the tensor table `t_tab` (their dims in `dims`, names in `strings`), each
/// checked: name, dtype, dims in bounds, span. Errors name the entry's index in the whole table.
fn decode_entries(
    range: std::ops::Range<usize>,
    t_tab: &[u8],
    dims: &[u8],
    strings: &[u8],
    keep_going: impl Fn() -> bool,
) -> std::result::Result<Vec<TensorInfo>, ManifestFault> {
    let d_len = dims.len() as u64;
    // Shape then strides of a tensor whose dims start at index `d0` (in `i64` units).
    let dims_of =
        |d0: u64, ndim: u64| -> std::result::Result<(Vec<i64>, Vec<i64>), ManifestFault> {
            let bytes = dims_bytes(dims, d0, ndim).ok_or(ManifestFault::OutOfBounds {
                what: "a tensor's dims",
                offset: d0.saturating_mul(8),
                len: 16 * ndim,
                body: d_len,
            })?;
            let word = |w: &[u8]| i64::from_le_bytes(w.try_into().expect("8 bytes"));
            let (shape, strides) = bytes.split_at(8 * ndim as usize);
            Ok((
                shape.chunks_exact(8).map(word).collect(),
                strides.chunks_exact(8).map(word).collect(),
            ))
        };
    let mut infos = Vec::with_capacity(range.len());
    for i in range {
        if i % STOP_CHECK == 0 && !keep_going() {
            // Another part faulted first: this part's result is discarded.
            return Err(ManifestFault::Fingerprint);
        }
        let e = Entry64::at(t_tab, i);
        let bad = |why: String| ManifestFault::Tensor {
            index: i as u64,
            why,
        };
        let (name_off, name_len) = (e.r64(0), u64::from(e.r32(8)));
        if name_len == 0 || name_len > MAX_NAME as u64 {
            return Err(bad(format!("a name of {name_len} bytes")));
        }
        let name = name_bytes(strings, name_off, name_len)
            .and_then(|b| std::str::from_utf8(b).ok())
            .ok_or_else(|| bad("its name lies outside the string area or is not UTF-8".into()))?;
        if name.contains('\0') {
            return Err(bad("a NUL byte in its name".into()));
        }
        let dtype = DType {
            code: e.0[12],
            bits: e.0[13],
            lanes: u16::from_le_bytes([e.0[14], e.0[15]]),
        };
        let ndim = e.r32(16) as u64;
        if ndim > MAX_NDIM as u64 {
            return Err(bad(format!("{ndim} dimensions")));
        }
        let (shape, strides) = dims_of(e.r64(24), ndim)?;
        let bytes = e.r64(48);
        let want = span_bytes(dtype, &shape, &strides).map_err(bad)?;
        if want != bytes {
            return Err(bad(format!(
                "{} where its shape spans {want}",
                crate::error::bytes(bytes)
            )));
        }
        infos.push(TensorInfo {
            name: name.to_string(),
            dtype,
            shape,
            strides,
            allocation: e.r32(32),
            offset: e.r64(40),
            bytes,
        });
    }
    Ok(infos)
}

/// One entry of the tensor table ([`TENSOR_ENTRY`] bytes): name offset `u64` at 0, name length
/// `u32` at 8, dtype at 12, ndim `u32` at 16, dims index `u64` at 24, allocation `u32` at 32,
/// offset `u64` at 40, bytes `u64` at 48.
struct Entry64<'a>(&'a [u8]);

impl<'a> Entry64<'a> {
    /// Entry `i` of `t_tab` (whose length the head checked: tensors × [`TENSOR_ENTRY`]).
    fn at(t_tab: &'a [u8], i: usize) -> Entry64<'a> {
        Entry64(&t_tab[i * TENSOR_ENTRY..][..TENSOR_ENTRY])
    }

    fn r64(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.0[at..at + 8].try_into().expect("8 bytes"))
    }

    fn r32(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.0[at..at + 4].try_into().expect("4 bytes"))
    }
}

/// The `16 × ndim` bytes of a tensor's shape and strides starting at `i64` index `d0` of `dims`;
/// `None` out of bounds.
fn dims_bytes(dims: &[u8], d0: u64, ndim: u64) -> Option<&[u8]> {
    let start = d0.checked_mul(8)?;
    let end = start.checked_add(ndim.checked_mul(16)?)?;
    (end <= dims.len() as u64).then(|| &dims[start as usize..end as usize])
}

/// A name's `len` bytes at `off` of the string area `strings`; `None` out of bounds.
fn name_bytes(strings: &[u8], off: u64, len: u64) -> Option<&[u8]> {
    let end = off.checked_add(len)?;
    (end <= strings.len() as u64).then(|| &strings[off as usize..end as usize])
}

/// The layout of decoded `infos` over allocations of `lens` bytes with the stored fingerprint
/// `fp` (every tensor inside its allocation, names unique).
fn layout_of(
    infos: Vec<TensorInfo>,
    lens: &[u64],
    fp: [u8; 32],
) -> std::result::Result<Layout, ManifestFault> {
    Layout::checked(infos, lens.to_vec(), Some(fp)).map_err(|e| match e {
        crate::Error::TensorSet(TensorSetError::BadTensor { name, why }) => ManifestFault::Tensor {
            index: u64::MAX,
            why: format!("{name:?}: {why}"),
        },
        other => ManifestFault::Tensor {
            index: u64::MAX,
            why: other.to_string(),
        },
    })
}

/// Tensors per decoding thread, at least: below twice this, one thread decodes them all (the
/// unit tests split small tables with a smaller one).
#[cfg(not(test))]
const TENSORS_PER_THREAD: usize = 1024;
#[cfg(test)]
const TENSORS_PER_THREAD: usize = 8;

/// Entries between two looks at whether a split decode may stop early (a part before this one,
/// or any part for the fingerprint, faulted).
const STOP_CHECK: usize = 256;

/// Most threads one decode uses, the calling one included (besides the fingerprint's).
const MAX_DECODERS: usize = 4;

/// Threads a decode may use: [`MAX_DECODERS`], less where this process may run on fewer CPUs
/// (`sched_getaffinity`), leaving one for the fingerprint and one for the opening thread's
/// mapping; `None` below four CPUs, where threads only slow it down (measured on two).
fn decoders() -> Option<usize> {
    let cpus = rustix::thread::sched_getaffinity(None).map_or(1, |set| set.count() as usize);
    (cpus >= 4).then(|| (cpus - 2).min(MAX_DECODERS))
}

/// A decode's outcome: the layout (or the manifest's fault), the decode's wall time, the
/// fingerprint's.
pub(crate) type Verified = (
    std::result::Result<Layout, ManifestFault>,
    Duration,
    Duration,
);

impl TensorTables {
    /// [`TensorTables::decode`] and the fingerprint check. With `split`, the tensors are split
    /// among up to four threads (one per [`TENSORS_PER_THREAD`] tensors, at most the CPUs this
    /// process may use less two) and the fingerprint is recomputed on one more from the raw
    /// entries; without it, or where the process may use fewer than four CPUs, both run on this
    /// thread, one after the other. A fault of the decode comes first (the lowest index's, as one
    /// thread would have found it), then [`ManifestFault::Fingerprint`]. Where a thread cannot be
    /// started its part runs on the calling thread; the result is the same.
    pub(crate) fn decode_verified(&self, bytes: &[u8], split: bool) -> Verified {
        self.decode_verified_with(bytes, if split { decoders() } else { None })
    }

    /// [`TensorTables::decode_verified`] with at most `most` decoding threads (`None`: on this
    /// thread, the fingerprint after the decode).
    fn decode_verified_with(&self, bytes: &[u8], most: Option<usize>) -> Verified {
        let (t_tab, dims, strings) = match self.areas(bytes) {
            Ok(areas) => areas,
            Err(f) => return (Err(f), Duration::ZERO, Duration::ZERO),
        };
        let n = self.tensors;
        let Some(most) = most else {
            let t = Instant::now();
            let layout = self.decode(bytes);
            let decode_took = t.elapsed();
            let t = Instant::now();
            let checked = layout.and_then(|l| l.verify_fingerprint().map(|()| l));
            return (checked, decode_took, t.elapsed());
        };
        let parts = (n / TENSORS_PER_THREAD).clamp(1, most);
        let chunk = n.div_ceil(parts).max(1);
        // The lowest part that faulted (`usize::MAX`: none yet): parts after it and the
        // fingerprint stop early, their results unused. Relaxed: a hint that synchronises
        // nothing (what is returned comes from the joined threads' results).
        let faulted = AtomicUsize::new(usize::MAX);
        let faulted = &faulted;
        std::thread::scope(|s| {
            let raw = || {
                let t = Instant::now();
                let fine = || faulted.load(Ordering::Relaxed) == usize::MAX;
                (
                    self.raw_fingerprint(t_tab, dims, strings, fine),
                    t.elapsed(),
                )
            };
            let fp = std::thread::Builder::new()
                .name("cuda-ipc-fingerprint".into())
                .spawn_scoped(s, raw)
                .ok();
            let t = Instant::now();
            let range = |k: usize| (k * chunk).min(n)..((k + 1) * chunk).min(n);
            let decode = move |k: usize| {
                let before = || faulted.load(Ordering::Relaxed) >= k;
                let r = decode_entries(range(k), t_tab, dims, strings, before);
                if r.is_err() {
                    faulted.fetch_min(k, Ordering::Relaxed);
                }
                r
            };
            let rest: Vec<_> = (1..parts)
                .map(|k| {
                    std::thread::Builder::new()
                        .name("cuda-ipc-tables".into())
                        .spawn_scoped(s, move || decode(k))
                        .map_err(|_| k)
                })
                .collect();
            let mut all = decode(0);
            for h in rest {
                let part = match h {
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                    Err(k) => decode(k),
                };
                // The first fault by index wins; later parts are dropped.
                if let Ok(v) = &mut all {
                    match part {
                        Ok(p) => v.extend(p),
                        Err(f) => all = Err(f),
                    }
                }
            }
            let layout =
                all.and_then(|infos| layout_of(infos, &self.allocations, self.fingerprint));
            let decode_took = t.elapsed();
            let (digest, fp_took) = match fp {
                Some(h) => h
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                None => raw(),
            };
            let checked = layout.and_then(|l| {
                if digest == Some(self.fingerprint) {
                    Ok(l)
                } else {
                    Err(ManifestFault::Fingerprint)
                }
            });
            (checked, decode_took, fp_took)
        })
    }

    /// The layout fingerprint of the tables as stored (`t_tab`, `dims`, `strings`: the areas
    /// [`TensorTables::areas`] found), without decoding them: `None` where an entry's name or
    /// dims lie out of bounds or are too long (the decode refuses such an entry too).
    fn raw_fingerprint(
        &self,
        t_tab: &[u8],
        dims: &[u8],
        strings: &[u8],
        keep_going: impl Fn() -> bool,
    ) -> Option<[u8; 32]> {
        let mut c = Canonical::new(self.tensors);
        for i in 0..self.tensors {
            if i % STOP_CHECK == 0 && !keep_going() {
                return None;
            }
            let e = Entry64::at(t_tab, i);
            let name_len = u64::from(e.r32(8));
            let ndim = u64::from(e.r32(16));
            if name_len > MAX_NAME as u64 || ndim > MAX_NDIM as u64 {
                return None;
            }
            let name = name_bytes(strings, e.r64(0), name_len)?;
            let words = dims_bytes(dims, e.r64(24), ndim)?;
            let dtype = [e.0[12], e.0[13], e.0[14], e.0[15]];
            c.tensor(
                name,
                dtype,
                ndim as u32,
                |buf| buf.extend_from_slice(words),
                e.r32(32),
                e.r64(40),
            );
        }
        Some(c.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        DType, KIND_HOST, Layout, Manifest, TOKEN_LEN, TensorSpec, decode_head, encode,
    };
    use super::*;
    use proptest::prelude::*;

    fn manifest_of(n: usize) -> Vec<u8> {
        let specs: Vec<TensorSpec> = (0..n)
            .map(|i| {
                TensorSpec::strided(
                    format!("experts.{}.w{}", i / 3, i % 3),
                    if i % 5 == 0 { DType::F32 } else { DType::BF16 },
                    &[(i % 7) as i64 + 1, 3],
                    &[3, 1],
                )
            })
            .collect();
        encode(&Manifest {
            kind: KIND_HOST,
            flags: 0,
            buffers: 1,
            tokens: vec![vec![[0u8; TOKEN_LEN]]],
            layout: Layout::new(&specs).unwrap(),
            channel_generation: 1,
            data_generation: 2,
            max_readers: 8,
            holders_generation: 0,
            generation_base: 0,
        })
    }

    #[test]
    fn the_raw_fingerprint_is_the_decoded_tensors_and_the_split_decode_is_the_whole() {
        for n in [0, 1, 7, 1023, 2048, 4097, 9001] {
            let body = manifest_of(n);
            let (_, tables) = decode_head(&body).unwrap();
            let whole = tables.decode(&body).unwrap();
            let (t_tab, dims, strings) = tables.areas(&body).unwrap();
            assert_eq!(
                tables.raw_fingerprint(t_tab, dims, strings, || true),
                Some(super::super::fingerprint(whole.tensors())),
                "{n} tensors"
            );
            for most in [None, Some(1), Some(2), Some(4)] {
                let (split, _, _) = tables.decode_verified_with(&body, most);
                let split = split.unwrap();
                assert_eq!(split.tensors(), whole.tensors(), "{n} tensors, {most:?}");
                assert_eq!(split.fingerprint(), whole.fingerprint());
                assert_eq!(
                    split.index_of("experts.0.w1"),
                    whole.index_of("experts.0.w1")
                );
            }
        }
    }

    #[test]
    fn a_fault_in_any_part_is_the_first_by_index_and_a_changed_entry_fails_the_fingerprint() {
        let body = manifest_of(4100);
        let (_, tables) = decode_head(&body).unwrap();
        let (t_off, _) = tables.table;
        let (s_off, _) = tables.strings;
        // A name made not UTF-8 in the last part, another in the second: the second's is named.
        let name_at = |body: &[u8], i: usize| {
            let e = &body[t_off as usize + i * super::super::TENSOR_ENTRY..];
            u64::from_le_bytes(e[..8].try_into().unwrap())
        };
        let mut bad = body.clone();
        for i in [1500usize, 4000] {
            let at = (s_off + name_at(&bad, i)) as usize;
            bad[at] = 0xff;
        }
        for most in [None, Some(1), Some(4)] {
            match tables.decode_verified_with(&bad, most).0 {
                Err(ManifestFault::Tensor { index, .. }) => assert_eq!(index, 1500, "{most:?}"),
                other => panic!("expected tensor 1500's fault ({most:?}), got {other:?}"),
            }
        }
        // An offset changed within its allocation's bounds: decodes, and fails the fingerprint.
        let mut moved = body.clone();
        let off_at = t_off as usize + 3000 * super::super::TENSOR_ENTRY + 40;
        let off = u64::from_le_bytes(moved[off_at..off_at + 8].try_into().unwrap());
        moved[off_at..off_at + 8].copy_from_slice(&(off ^ 0x100).to_le_bytes());
        let whole = tables.decode(&moved);
        assert!(whole.is_ok(), "the moved tensor still decodes: {whole:?}");
        for most in [None, Some(1), Some(4)] {
            assert!(matches!(
                tables.decode_verified_with(&moved, most).0,
                Err(ManifestFault::Fingerprint)
            ));
        }
    }

    /// Flips bits of `body` at `flips` (position, bits) in the tensor tables and the areas after
    /// them (the head stays valid).
    fn flip_tables(body: &mut [u8], tables: &TensorTables, flips: Vec<(usize, u8)>) {
        let from = tables.table.0 as usize;
        for (at, v) in flips {
            let i = from + at % (body.len() - from).max(1);
            if i < body.len() {
                body[i] ^= v | 1;
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Corrupted tables: the split decode finds what the whole one does (the same fault, or
        /// the same layout), never panics.
        #[test]
        fn corrupted_tables_split_as_they_decode_whole(
            n in 0usize..60,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
            most in 1usize..5,
        ) {
            let mut body = manifest_of(n);
            let Ok((_, tables)) = decode_head(&body) else { return Ok(()) };
            flip_tables(&mut body, &tables, flips);
            let whole = tables.decode(&body).and_then(|l| l.verify_fingerprint().map(|()| l));
            let split = tables.decode_verified_with(&body, Some(most)).0;
            match (whole, split) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a.tensors(), b.tensors()),
                (Err(a), Err(b)) => prop_assert_eq!(format!("{a:?}"), format!("{b:?}")),
                (a, b) => prop_assert!(false, "whole {:?} split {:?}", a.is_ok(), b.is_ok()),
            }
        }

        /// As above, with the corrupted tables' own raw digest stored as the fingerprint (as a
        /// writer of a hostile manifest would): most then decode, and whatever passes was hashed
        /// as decoded.
        #[test]
        fn restamped_corrupted_tables_pass_only_as_what_they_decode_to(
            n in 0usize..40,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
            most in 1usize..5,
        ) {
            let mut body = manifest_of(n);
            let Ok((_, tables)) = decode_head(&body) else { return Ok(()) };
            flip_tables(&mut body, &tables, flips);
            let (t_tab, dims, strings) = tables.areas(&body).unwrap();
            if let Some(fp) = tables.raw_fingerprint(t_tab, dims, strings, || true) {
                body[96..128].copy_from_slice(&fp);
            }
            let Ok((_, tables)) = decode_head(&body) else { return Ok(()) };
            let whole = tables.decode(&body).and_then(|l| l.verify_fingerprint().map(|()| l));
            let split = tables.decode_verified_with(&body, Some(most)).0;
            match (whole, split) {
                (Ok(a), Ok(b)) => {
                    prop_assert_eq!(a.tensors(), b.tensors());
                    prop_assert_eq!(super::super::fingerprint(b.tensors()), tables.fingerprint);
                }
                (Err(a), Err(b)) => prop_assert_eq!(format!("{a:?}"), format!("{b:?}")),
                (a, b) => prop_assert!(false, "whole {:?} split {:?}", a.is_ok(), b.is_ok()),
            }
        }
    }
}
