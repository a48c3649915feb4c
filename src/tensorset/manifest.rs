//! The layout of a tensor set and its manifest: [`TensorSpec`] (what a writer asks for),
//! [`TensorInfo`] and [`Layout`] (where each tensor lies: allocation, byte offset aligned to
//! [`ALIGN`] bytes, byte length), the layout fingerprint (SHA-256 over a canonical encoding of
//! names, dtypes, shapes, strides, allocation indices and offsets) and the encoding of the
//! manifest body that the manifest segment holds after its header page (`segment.rs`).
//!
//! Body layout (little-endian; offsets in bytes from the body's start):
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | memory kind `u32` ([`KIND_HOST`] .. [`KIND_POOL`]) |
//! | 4 | flags `u32` ([`FLAG_BUFFERED`]) |
//! | 8 | buffers B `u32`, 12: allocations per buffer A `u32` |
//! | 16 | tensors N `u64`, 24: bytes per buffer (sum of A allocations) `u64` |
//! | 32..96 | offset and length `u64` of: allocation table, tensor table, dims area, string area |
//! | 96 | layout fingerprint, 32 bytes |
//! | 128 | generation channel's creation generation `u64`, 136: host data segment's (0: none) |
//! | 144 | most readers `u32`, 148: zero `u32` |
//! | 152 | holders segment's creation generation `u64` (0: none: a host, pool or legacy set, a set of more allocations than a holder forwards, or a manifest written before holders; `holders.rs`) |
//! | 160 | generation base `u64`: a set's generation is this plus the generation channel's sequence number (0 but for a writer that resumed a dead writer's held set, whose first generation is the last whole one); the rest of the [`BODY_HEADER`] bytes are zero |
//!
//! Allocation table: B × A entries of [`ALLOC_ENTRY`] bytes (a 144-byte token, the allocation's
//! length `u64`, 8 zero bytes). Tensor table: N entries of [`TENSOR_ENTRY`] bytes (name offset
//! `u64` and length `u32` in the string area, dtype code `u8`, bits `u8`, lanes `u16`, ndim `u32`,
//! 4 zero bytes, dims index `u64` (in `i64` units into the dims area: ndim shape values, then ndim
//! strides), allocation `u32`, 4 zero bytes, byte offset `u64`, byte length `u64`, 8 zero bytes).
//!
//! The decoder checks every offset, length, count and code before it reads, recomputes each
//! tensor's byte length and the fingerprint, and reports the first fault as a [`ManifestFault`]:
//! a hostile or truncated body is an error, never a panic (a property test feeds it random and
//! corrupted bytes).

use super::dtype::DType;
use super::error::{ManifestFault, TensorSetError};
use crate::error::Result;
use crate::token::TOKEN_LEN;
use hashbrown::{DefaultHashBuilder, HashTable, hash_table::Entry};
use sha2::{Digest, Sha256};
use std::hash::BuildHasher;

/// Byte alignment of every tensor's offset in a writer-allocated set.
pub const ALIGN: u64 = 256;
/// Most tensors in one set.
pub const MAX_TENSORS: usize = 1 << 24;
/// Most dimensions of one tensor.
pub const MAX_NDIM: usize = 64;
/// Longest tensor name, bytes.
pub const MAX_NAME: usize = 4096;
/// Most allocations per buffer.
pub const MAX_ALLOCATIONS: usize = 4096;
/// Bytes of the body's fixed header.
pub const BODY_HEADER: usize = 256;
/// Bytes of one allocation table entry.
pub const ALLOC_ENTRY: usize = TOKEN_LEN + 16;
/// Where in the body header the allocation table's offset (`u64`) and then its length (`u64`)
/// are: the first of the four table ranges.
pub(crate) const ALLOC_TABLE_AT: usize = 32;

/// How many of a body's first bytes hold its head (the body header, then up to the allocation
/// table's end), as the body header `first` (at least its first [`BODY_HEADER`] bytes, or the
/// whole body if shorter) says, within a body of `body_len` bytes: what an opener copies to
/// decode it with [`decode_head_within`]. A range the header gets wrong is clamped to the body;
/// the decode then refuses it.
pub(crate) fn head_len(first: &[u8], body_len: usize) -> usize {
    let word = |at: usize| {
        first
            .get(at..at + 8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    };
    let end = word(ALLOC_TABLE_AT).saturating_add(word(ALLOC_TABLE_AT + 8));
    usize::try_from(end)
        .unwrap_or(usize::MAX)
        .max(BODY_HEADER)
        .min(body_len)
}
/// Bytes of one tensor table entry.
pub const TENSOR_ENTRY: usize = 64;
/// Memory kind code: host memory (the data segment `cuda-ipc.td.NAME`).
pub const KIND_HOST: u32 = 1;
/// Memory kind code: legacy IPC memory.
pub const KIND_LEGACY: u32 = 2;
/// Memory kind code: VMM memory.
pub const KIND_VMM: u32 = 3;
/// Memory kind code: memory-pool memory.
pub const KIND_POOL: u32 = 4;
/// Flag: double- (or more) buffered generations; clear: in place.
pub const FLAG_BUFFERED: u32 = 1;
/// Most buffers (generations in flight) of a set: the channel's limit.
pub const MAX_SET_BUFFERS: usize = crate::channel::MAX_BUFFERS;

/// A tensor a writer publishes: name, DLPack dtype, shape, and strides in elements (`None`:
/// contiguous, row-major).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Unique within the set, 1 to [`MAX_NAME`] bytes of UTF-8 without a NUL byte.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Extent of each dimension (0 to [`MAX_NDIM`] dimensions, none negative).
    pub shape: Vec<i64>,
    /// Strides in elements, one per dimension, none negative; `None` for row-major contiguous.
    pub strides: Option<Vec<i64>>,
}

impl TensorSpec {
    /// A contiguous tensor.
    pub fn new(name: impl Into<String>, dtype: DType, shape: &[i64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            strides: None,
        }
    }

    /// A tensor with explicit strides (elements).
    pub fn strided(
        name: impl Into<String>,
        dtype: DType,
        shape: &[i64],
        strides: &[i64],
    ) -> TensorSpec {
        TensorSpec {
            strides: Some(strides.to_vec()),
            ..TensorSpec::new(name, dtype, shape)
        }
    }
}

/// Where one tensor of a set lies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Its name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Extent of each dimension.
    pub shape: Vec<i64>,
    /// Strides in elements (filled in for contiguous tensors).
    pub strides: Vec<i64>,
    /// Index of its allocation within a buffer.
    pub allocation: u32,
    /// Byte offset in that allocation.
    pub offset: u64,
    /// Bytes it spans (element size × (1 + Σ (dim − 1) × stride); 0 for an empty tensor).
    pub bytes: u64,
}

/// The layout of a set: its tensors, the bytes of each allocation of one buffer, the fingerprint.
#[derive(Clone, Debug)]
pub struct Layout {
    tensors: Vec<TensorInfo>,
    allocations: Vec<u64>,
    fingerprint: [u8; 32],
    index: NameIndex,
}

/// Tensor indices by name: a hash table of indices into the tensors, hashed by their names (no
/// copy of a name; the hasher's seed is random per table, so names another process chose cannot
/// be made to collide on purpose).
#[derive(Clone, Debug, Default)]
struct NameIndex {
    table: HashTable<u32>,
    hasher: DefaultHashBuilder,
}

impl NameIndex {
    /// The index of `tensors`' names, or the position of the first name given twice.
    fn of(tensors: &[TensorInfo]) -> std::result::Result<NameIndex, usize> {
        let hasher = DefaultHashBuilder::default();
        let mut table = HashTable::with_capacity(tensors.len());
        let name = |j: &u32| tensors[*j as usize].name.as_str();
        for (i, t) in tensors.iter().enumerate() {
            let h = hasher.hash_one(t.name.as_str());
            match table.entry(h, |j| name(j) == t.name, |j| hasher.hash_one(name(j))) {
                Entry::Occupied(_) => return Err(i),
                // `i < MAX_TENSORS = 2^24` (checked by every constructor): fits a `u32`.
                Entry::Vacant(v) => {
                    v.insert(i as u32);
                }
            }
        }
        Ok(NameIndex { table, hasher })
    }

    /// The index of tensor `name` among `tensors` (those this index was made of).
    fn get(&self, tensors: &[TensorInfo], name: &str) -> Option<usize> {
        let h = self.hasher.hash_one(name);
        self.table
            .find(h, |&j| tensors[j as usize].name == name)
            .map(|&j| j as usize)
    }
}

fn bad_tensor(name: &str, why: impl Into<String>) -> crate::Error {
    TensorSetError::BadTensor {
        name: name.chars().take(64).collect(),
        why: why.into(),
    }
    .into()
}

/// Row-major strides of `shape`, elements.
fn contiguous(shape: &[i64]) -> Vec<i64> {
    let mut s = vec![0i64; shape.len()];
    let mut acc = 1i64;
    for i in (0..shape.len()).rev() {
        s[i] = acc;
        acc = acc.saturating_mul(shape[i].max(1));
    }
    s
}

/// Bytes a tensor spans, or why it cannot be laid out.
fn span_bytes(dtype: DType, shape: &[i64], strides: &[i64]) -> std::result::Result<u64, String> {
    let elem = dtype
        .size_bytes()
        .ok_or_else(|| format!("dtype {dtype} has no size in whole bytes"))? as u64;
    if shape.len() > MAX_NDIM {
        return Err(format!("{} dimensions; at most {MAX_NDIM}", shape.len()));
    }
    if strides.len() != shape.len() {
        return Err(format!(
            "{} strides for {} dimensions",
            strides.len(),
            shape.len()
        ));
    }
    if let Some(d) = shape.iter().find(|&&d| d < 0) {
        return Err(format!("negative dimension {d}"));
    }
    if let Some(s) = strides.iter().find(|&&s| s < 0) {
        return Err(format!("negative stride {s}"));
    }
    if shape.contains(&0) {
        return Ok(0);
    }
    let mut last: u64 = 0;
    for (&d, &s) in shape.iter().zip(strides) {
        last = (d as u64 - 1)
            .checked_mul(s as u64)
            .and_then(|x| x.checked_add(last))
            .ok_or("its span overflows")?;
    }
    let n = last
        .checked_add(1)
        .and_then(|n| n.checked_mul(elem))
        .ok_or_else(|| "its span overflows".to_string())?;
    if n > MAX_SET_BYTES {
        return Err(format!(
            "its span of {n} bytes passes the most one allocation can hold ({MAX_SET_BYTES} \
             bytes, isize::MAX)"
        ));
    }
    Ok(n)
}

/// The most bytes a tensor, a buffer of a set or a segment may span: what one allocation (a
/// mapping, `isize::MAX`) and a file size (`off_t`, `ftruncate`) can hold. Checked when the
/// layout is made, before any system call sees the size.
pub const MAX_SET_BYTES: u64 = isize::MAX as u64;

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(bad_tensor(
            name,
            format!("a name of {} bytes; 1 to {MAX_NAME}", name.len()),
        ));
    }
    if name.contains('\0') {
        return Err(bad_tensor(
            name,
            "a NUL byte in its name (names pass through C strings: not allowed)".to_string(),
        ));
    }
    Ok(())
}

fn info_of(spec: &TensorSpec, allocation: u32, offset: u64) -> Result<TensorInfo> {
    check_name(&spec.name)?;
    let strides = spec
        .strides
        .clone()
        .unwrap_or_else(|| contiguous(&spec.shape));
    let bytes =
        span_bytes(spec.dtype, &spec.shape, &strides).map_err(|w| bad_tensor(&spec.name, w))?;
    Ok(TensorInfo {
        name: spec.name.clone(),
        dtype: spec.dtype,
        shape: spec.shape.clone(),
        strides,
        allocation,
        offset,
        bytes,
    })
}

impl Layout {
    /// Lays `specs` out in one allocation per buffer, in order, each at an offset aligned to
    /// [`ALIGN`] bytes.
    ///
    /// # Errors
    /// [`TensorSetError::TooManyTensors`] past [`MAX_TENSORS`]; [`TensorSetError::BadTensor`] for
    /// an empty, long or repeated name or one with a NUL byte, a dtype without a byte size, a
    /// negative dimension or stride, too many dimensions or a size that overflows.
    pub fn new(specs: &[TensorSpec]) -> Result<Layout> {
        if specs.len() > MAX_TENSORS {
            return Err(TensorSetError::TooManyTensors {
                what: "tensors",
                found: specs.len() as u64,
                max: MAX_TENSORS as u64,
            }
            .into());
        }
        let mut tensors = Vec::with_capacity(specs.len());
        let mut at = 0u64;
        for s in specs {
            let t = info_of(s, 0, at)?;
            at = at
                .checked_add(t.bytes)
                .and_then(|e| e.checked_next_multiple_of(ALIGN))
                .filter(|&e| e <= MAX_SET_BYTES)
                .ok_or_else(|| {
                    bad_tensor(
                        &s.name,
                        format!(
                            "the set's size passes the most one allocation can hold \
                             ({MAX_SET_BYTES} bytes, isize::MAX)"
                        ),
                    )
                })?;
            tensors.push(t);
        }
        Self::from_tensors(tensors, vec![at.max(ALIGN)])
    }

    /// A layout over given allocations (of `allocations[a]` bytes each): tensor `i` of
    /// `tensors` lies in allocation `tensors[i].1` at byte offset `tensors[i].2`.
    ///
    /// # Errors
    /// As [`Layout::new`]; [`TensorSetError::BadTensor`] for a tensor outside its allocation or
    /// an allocation index out of range; [`TensorSetError::TooManyTensors`] for no allocation,
    /// more than [`MAX_ALLOCATIONS`], or allocations of more than [`MAX_SET_BYTES`] bytes in
    /// all.
    pub fn with_locations(
        tensors: &[(TensorSpec, u32, u64)],
        allocations: Vec<u64>,
    ) -> Result<Layout> {
        if tensors.len() > MAX_TENSORS {
            return Err(TensorSetError::TooManyTensors {
                what: "tensors",
                found: tensors.len() as u64,
                max: MAX_TENSORS as u64,
            }
            .into());
        }
        let infos = tensors
            .iter()
            .map(|(s, a, o)| info_of(s, *a, *o))
            .collect::<Result<Vec<_>>>()?;
        Self::from_tensors(infos, allocations)
    }

    /// Checks the tensors against the allocations and each other's names, and fingerprints them.
    fn from_tensors(tensors: Vec<TensorInfo>, allocations: Vec<u64>) -> Result<Layout> {
        Self::checked(tensors, allocations, None)
    }

    /// As [`Layout::from_tensors`], with the fingerprint `stored` (a manifest's, recomputed later
    /// by [`Manifest::verify_fingerprint`]) instead of one computed now when given.
    fn checked(
        tensors: Vec<TensorInfo>,
        allocations: Vec<u64>,
        stored: Option<[u8; 32]>,
    ) -> Result<Layout> {
        if allocations.is_empty() || allocations.len() > MAX_ALLOCATIONS {
            return Err(TensorSetError::TooManyTensors {
                what: "allocations per buffer",
                found: allocations.len() as u64,
                max: MAX_ALLOCATIONS as u64,
            }
            .into());
        }
        if tensors.len() > MAX_TENSORS {
            return Err(TensorSetError::TooManyTensors {
                what: "tensors",
                found: tensors.len() as u64,
                max: MAX_TENSORS as u64,
            }
            .into());
        }
        // The sum, as `bytes_per_buffer` and the writers compute it: within one allocation's
        // most (what a mapping, a file and the quota ledger can hold), never overflowing.
        let total = allocations
            .iter()
            .try_fold(0u64, |sum, &len| sum.checked_add(len))
            .filter(|&t| t <= MAX_SET_BYTES);
        if total.is_none() {
            return Err(TensorSetError::TooManyTensors {
                what: "bytes per buffer (the sum of its allocations' lengths)",
                found: allocations
                    .iter()
                    .fold(0u64, |sum, &len| sum.saturating_add(len)),
                max: MAX_SET_BYTES,
            }
            .into());
        }
        for t in &tensors {
            let Some(&len) = allocations.get(t.allocation as usize) else {
                return Err(bad_tensor(
                    &t.name,
                    format!("allocation {} of {}", t.allocation, allocations.len()),
                ));
            };
            if t.offset.checked_add(t.bytes).is_none_or(|end| end > len) {
                return Err(bad_tensor(
                    &t.name,
                    format!(
                        "bytes {}+{} leave allocation {} of {len} bytes",
                        t.offset, t.bytes, t.allocation
                    ),
                ));
            }
        }
        let index = NameIndex::of(&tensors)
            .map_err(|i| bad_tensor(&tensors[i].name, "a name given twice"))?;
        let fingerprint = stored.unwrap_or_else(|| fingerprint(&tensors));
        Ok(Layout {
            tensors,
            allocations,
            fingerprint,
            index,
        })
    }

    /// A layout of `allocations` with the stored fingerprint `fingerprint` and no tensors yet: a
    /// manifest's between [`decode_head_within`] and [`TensorTables::decode`], for what needs only the
    /// allocations (the mapping); never handed to a user.
    fn provisional(allocations: Vec<u64>, fingerprint: [u8; 32]) -> Layout {
        Layout {
            tensors: Vec::new(),
            allocations,
            fingerprint,
            index: NameIndex::default(),
        }
    }

    /// Recomputes the fingerprint of the tensors and compares it with the one this layout
    /// carries (a manifest's stored one).
    pub(crate) fn verify_fingerprint(&self) -> std::result::Result<(), ManifestFault> {
        if fingerprint(&self.tensors) == self.fingerprint {
            Ok(())
        } else {
            Err(ManifestFault::Fingerprint)
        }
    }

    /// The tensors, in the order given.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the set has no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The index of tensor `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.index.get(&self.tensors, name)
    }

    /// Tensor `name`.
    pub fn by_name(&self, name: &str) -> Option<&TensorInfo> {
        self.index_of(name).map(|i| &self.tensors[i])
    }

    /// Bytes of each allocation of one buffer.
    pub fn allocations(&self) -> &[u64] {
        &self.allocations
    }

    /// Bytes of one buffer (all its allocations).
    pub fn bytes_per_buffer(&self) -> u64 {
        self.allocations.iter().sum()
    }

    /// The layout fingerprint (SHA-256 of the canonical encoding of the tensor table).
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }
}

/// SHA-256 of the canonical encoding: a domain string, the tensor count, then per tensor its name
/// (length `u32` + bytes), dtype (code, bits, lanes), ndim `u32`, shape and strides (`i64`),
/// allocation `u32` and offset `u64`; all little-endian.
///
/// The encoding is gathered in a buffer of 64 KiB (`HASH_CHUNK`) and hashed a chunk at a time
/// (one `Sha256::update` per chunk rather than one per field: the same digest, a fraction of the
/// calls; `sha2` uses the CPU's SHA extensions where it has them).
pub fn fingerprint(tensors: &[TensorInfo]) -> [u8; 32] {
    let mut c = Canonical::new(tensors.len());
    for t in tensors {
        let lanes = t.dtype.lanes.to_le_bytes();
        c.tensor(
            t.name.as_bytes(),
            [t.dtype.code, t.dtype.bits, lanes[0], lanes[1]],
            t.shape.len() as u32,
            |buf| {
                for d in t.shape.iter().chain(&t.strides) {
                    buf.extend_from_slice(&d.to_le_bytes());
                }
            },
            t.allocation,
            t.offset,
        );
    }
    c.finish()
}

/// The canonical encoding [`fingerprint`] hashes, fed a tensor at a time (by the decoded tensors,
/// and by the raw tensor tables in `manifest::tables`: one encoding, two sources).
pub(crate) struct Canonical {
    h: Sha256,
    buf: Vec<u8>,
}

impl Canonical {
    /// The encoding of a set of `count` tensors, before its first tensor.
    pub(crate) fn new(count: usize) -> Canonical {
        let mut buf: Vec<u8> = Vec::with_capacity(HASH_CHUNK + MAX_ENCODED_TENSOR);
        buf.extend_from_slice(b"cuda-ipc tensor-set layout v1\0");
        buf.extend_from_slice(&(count as u64).to_le_bytes());
        Canonical {
            h: Sha256::new(),
            buf,
        }
    }

    /// Adds one tensor: its `name`'s bytes, its dtype's code, bits and lanes (`u16`,
    /// little-endian), `ndim`, then `dims` writes its shape and strides (`i64`, little-endian),
    /// then its allocation and byte offset.
    pub(crate) fn tensor(
        &mut self,
        name: &[u8],
        dtype: [u8; 4],
        ndim: u32,
        dims: impl FnOnce(&mut Vec<u8>),
        allocation: u32,
        offset: u64,
    ) {
        let buf = &mut self.buf;
        buf.extend_from_slice(&(name.len() as u32).to_le_bytes());
        buf.extend_from_slice(name);
        buf.extend_from_slice(&dtype);
        buf.extend_from_slice(&ndim.to_le_bytes());
        dims(buf);
        buf.extend_from_slice(&allocation.to_le_bytes());
        buf.extend_from_slice(&offset.to_le_bytes());
        if buf.len() >= HASH_CHUNK {
            self.h.update(&*buf);
            buf.clear();
        }
    }

    /// The SHA-256 digest of the whole encoding.
    pub(crate) fn finish(mut self) -> [u8; 32] {
        self.h.update(&self.buf);
        self.h.finalize().into()
    }
}

/// Bytes of the canonical encoding [`fingerprint`] hashes at a time.
const HASH_CHUNK: usize = 64 << 10;
/// Most bytes one tensor adds to the canonical encoding (a name of [`MAX_NAME`] bytes and
/// [`MAX_NDIM`] dimensions), so a chunk's buffer rarely grows.
const MAX_ENCODED_TENSOR: usize = 4 + MAX_NAME + 4 + 4 + 16 * MAX_NDIM + 4 + 8;

/// A decoded manifest body.
#[derive(Clone, Debug)]
pub(crate) struct Manifest {
    pub(crate) kind: u32,
    pub(crate) flags: u32,
    pub(crate) buffers: usize,
    pub(crate) layout: Layout,
    /// `tokens[b][a]`: the token of allocation `a` of buffer `b`.
    pub(crate) tokens: Vec<Vec<[u8; TOKEN_LEN]>>,
    pub(crate) channel_generation: u64,
    pub(crate) data_generation: u64,
    pub(crate) max_readers: u32,
    /// The holders segment's creation generation (0: none).
    pub(crate) holders_generation: u64,
    /// Added to the generation channel's sequence numbers (a resumed set's; 0 otherwise).
    pub(crate) generation_base: u64,
}

/// Offsets of the body's parts for `m`: (alloc table, tensor table, dims, strings, total).
fn plan(m: &Manifest) -> (usize, usize, usize, usize, usize) {
    let a = BODY_HEADER;
    let t = a + m.buffers * m.layout.allocations.len() * ALLOC_ENTRY;
    let d = t + m.layout.tensors.len() * TENSOR_ENTRY;
    let dims: usize = m.layout.tensors.iter().map(|x| 2 * x.shape.len()).sum();
    let s = d + 8 * dims;
    let names: usize = m.layout.tensors.iter().map(|x| x.name.len()).sum();
    (a, t, d, s, s + names)
}

/// Encodes `m` as a manifest body.
pub(crate) fn encode(m: &Manifest) -> Vec<u8> {
    let (a_off, t_off, d_off, s_off, total) = plan(m);
    let mut b = vec![0u8; total];
    let put32 = |b: &mut [u8], at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    let put64 = |b: &mut [u8], at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    put32(&mut b, 0, m.kind);
    put32(&mut b, 4, m.flags);
    put32(&mut b, 8, m.buffers as u32);
    put32(&mut b, 12, m.layout.allocations.len() as u32);
    put64(&mut b, 16, m.layout.tensors.len() as u64);
    put64(&mut b, 24, m.layout.bytes_per_buffer());
    for (k, (off, end)) in [
        (a_off, t_off),
        (t_off, d_off),
        (d_off, s_off),
        (s_off, total),
    ]
    .into_iter()
    .enumerate()
    {
        put64(&mut b, ALLOC_TABLE_AT + 16 * k, off as u64);
        put64(&mut b, ALLOC_TABLE_AT + 8 + 16 * k, (end - off) as u64);
    }
    b[96..128].copy_from_slice(&m.layout.fingerprint);
    put64(&mut b, 128, m.channel_generation);
    put64(&mut b, 136, m.data_generation);
    put32(&mut b, 144, m.max_readers);
    put64(&mut b, 152, m.holders_generation);
    put64(&mut b, 160, m.generation_base);
    let mut at = a_off;
    for toks in &m.tokens {
        for (tok, &len) in toks.iter().zip(&m.layout.allocations) {
            b[at..at + TOKEN_LEN].copy_from_slice(tok);
            put64(&mut b, at + TOKEN_LEN, len);
            at += ALLOC_ENTRY;
        }
    }
    let (mut dims, mut names) = (0u64, 0u64);
    for (i, t) in m.layout.tensors.iter().enumerate() {
        let e = t_off + i * TENSOR_ENTRY;
        put64(&mut b, e, names);
        put32(&mut b, e + 8, t.name.len() as u32);
        b[e + 12] = t.dtype.code;
        b[e + 13] = t.dtype.bits;
        b[e + 14..e + 16].copy_from_slice(&t.dtype.lanes.to_le_bytes());
        put32(&mut b, e + 16, t.shape.len() as u32);
        put64(&mut b, e + 24, dims);
        put32(&mut b, e + 32, t.allocation);
        put64(&mut b, e + 40, t.offset);
        put64(&mut b, e + 48, t.bytes);
        for v in t.shape.iter().chain(&t.strides) {
            put64(&mut b, d_off + 8 * dims as usize, *v as u64);
            dims += 1;
        }
        let s = s_off + names as usize;
        b[s..s + t.name.len()].copy_from_slice(t.name.as_bytes());
        names += t.name.len() as u64;
    }
    b
}

/// Range-checked little-endian reads of a body, or of its first bytes (`have`) where the rest is
/// only located (`len`: the whole body's length, which every range is checked against).
struct Body<'a> {
    have: &'a [u8],
    len: u64,
}

impl<'a> Body<'a> {
    /// The whole body, `bytes`.
    fn of(bytes: &'a [u8]) -> Body<'a> {
        Body {
            have: bytes,
            len: bytes.len() as u64,
        }
    }

    /// `len` bytes at `off`: within the body, else [`ManifestFault::OutOfBounds`] (also for a
    /// range within the body but past the bytes at hand, which a caller that copied the head
    /// covering what it reads never asks for).
    fn bytes(
        &self,
        what: &'static str,
        off: u64,
        len: u64,
    ) -> std::result::Result<&'a [u8], ManifestFault> {
        self.within(what, off, len)?;
        self.have
            .get(off as usize..(off + len) as usize)
            .ok_or(ManifestFault::OutOfBounds {
                what,
                offset: off,
                len,
                body: self.have.len() as u64,
            })
    }

    /// Checks that `len` bytes at `off` lie within the body, without reading them.
    fn within(
        &self,
        what: &'static str,
        off: u64,
        len: u64,
    ) -> std::result::Result<(), ManifestFault> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(ManifestFault::OutOfBounds {
                what,
                offset: off,
                len,
                body: self.len,
            }),
        }
    }
    fn u32(&self, what: &'static str, off: u64) -> std::result::Result<u32, ManifestFault> {
        Ok(u32::from_le_bytes(
            self.bytes(what, off, 4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&self, what: &'static str, off: u64) -> std::result::Result<u64, ManifestFault> {
        Ok(u64::from_le_bytes(
            self.bytes(what, off, 8)?.try_into().expect("8 bytes"),
        ))
    }
}

fn field(what: &'static str, found: u64, allowed: &'static str) -> ManifestFault {
    ManifestFault::Field {
        what,
        found,
        allowed,
    }
}

impl Manifest {
    /// Recomputes the layout fingerprint and compares it with the one the body stores (which a
    /// manifest from [`decode_head_within`] and [`TensorTables::decode`] carries until then): SHA-256 over the whole tensor
    /// table's canonical encoding, the costly part of a decode (about 0.2 ms for 4,608 tensors).
    pub(crate) fn verify_fingerprint(&self) -> std::result::Result<(), ManifestFault> {
        self.layout.verify_fingerprint()
    }
}

/// Decodes a manifest body, checking every range, count, code, tensor and the fingerprint (the
/// tests' whole decode; openers take [`decode_head_within`] and [`TensorTables::decode`] and verify
/// when it suits them).
#[cfg(test)]
pub(crate) fn decode(bytes: &[u8]) -> std::result::Result<Manifest, ManifestFault> {
    let m = decode_unverified(bytes)?;
    m.verify_fingerprint()?;
    Ok(m)
}

/// [`decode`] but for the fingerprint: the layout carries the body's stored fingerprint, to be
/// checked with [`Manifest::verify_fingerprint`] before anything relies on the manifest (a reader
/// does it on another thread while it maps the memory). Openers take [`decode_head_within`] and
/// [`TensorTables::decode`], its two halves.
#[cfg(test)]
pub(crate) fn decode_unverified(bytes: &[u8]) -> std::result::Result<Manifest, ManifestFault> {
    let (mut m, tables) = decode_head(bytes)?;
    m.layout = tables.decode(bytes)?;
    Ok(m)
}

/// Where a manifest body's tensor tables lie, found by [`decode_head_within`] (every range checked
/// against the body), with what the layout is made of besides them.
#[derive(Clone, Debug)]
pub(crate) struct TensorTables {
    tensors: usize,
    table: (u64, u64),
    dims: (u64, u64),
    strings: (u64, u64),
    allocations: Vec<u64>,
    fingerprint: [u8; 32],
}

/// [`decode_head_within`] of a whole body (the tests' first half of [`decode_unverified`]).
#[cfg(test)]
pub(crate) fn decode_head(
    bytes: &[u8],
) -> std::result::Result<(Manifest, TensorTables), ManifestFault> {
    decode_head_within(bytes, bytes.len() as u64)
}

/// The first part of a manifest's decode: the body header and the allocation table, every range,
/// count and code checked, the tensor tables located but not read, from the body's first bytes,
/// `head` (at least the body header and the allocation table, where they lie within the body), of
/// a body of `body_len` bytes: every range is checked against `body_len`, and only the header and
/// the allocation table are read. The manifest's layout is provisional: its allocations and stored
/// fingerprint, no tensors ([`Layout::provisional`]); what maps the memory needs nothing more.
/// [`TensorTables::decode`] makes the real one from the whole body.
pub(crate) fn decode_head_within(
    head: &[u8],
    body_len: u64,
) -> std::result::Result<(Manifest, TensorTables), ManifestFault> {
    let b = Body {
        have: head,
        len: body_len,
    };
    b.bytes("the body header", 0, BODY_HEADER as u64)?;
    let kind = b.u32("kind", 0)?;
    if !(KIND_HOST..=KIND_POOL).contains(&kind) {
        return Err(field("the memory kind", kind.into(), "1 to 4"));
    }
    let flags = b.u32("flags", 4)?;
    if flags & !FLAG_BUFFERED != 0 {
        return Err(field("the flags", flags.into(), "0 or 1"));
    }
    let buffers = b.u32("buffers", 8)? as usize;
    if !(1..=MAX_SET_BUFFERS).contains(&buffers) {
        return Err(field(
            "the buffer count",
            buffers as u64,
            "1 to the channel's buffer limit",
        ));
    }
    let allocs = b.u32("allocations", 12)? as usize;
    if !(1..=MAX_ALLOCATIONS).contains(&allocs) {
        return Err(field("the allocation count", allocs as u64, "1 to 4096"));
    }
    let n = b.u64("tensors", 16)?;
    if n > MAX_TENSORS as u64 {
        return Err(field("the tensor count", n, "at most 2^24"));
    }
    let n = n as usize;
    let total = b.u64("bytes", 24)?;
    let part = |k: u64| -> std::result::Result<(u64, u64), ManifestFault> {
        Ok((
            b.u64("a table offset", ALLOC_TABLE_AT as u64 + 16 * k)?,
            b.u64("a table length", ALLOC_TABLE_AT as u64 + 8 + 16 * k)?,
        ))
    };
    let (a_off, a_len) = part(0)?;
    let (t_off, t_len) = part(1)?;
    let (d_off, d_len) = part(2)?;
    let (s_off, s_len) = part(3)?;
    if a_len != (buffers * allocs * ALLOC_ENTRY) as u64 {
        return Err(field(
            "the allocation table's length",
            a_len,
            "buffers × allocations × 160",
        ));
    }
    if t_len != (n * TENSOR_ENTRY) as u64 {
        return Err(field("the tensor table's length", t_len, "tensors × 64"));
    }
    if d_len % 8 != 0 {
        return Err(field("the dims area's length", d_len, "a multiple of 8"));
    }
    let a_tab = b.bytes("the allocation table", a_off, a_len)?;
    b.within("the tensor table", t_off, t_len)?;
    b.within("the dims area", d_off, d_len)?;
    b.within("the string area", s_off, s_len)?;
    let mut fp = [0u8; 32];
    fp.copy_from_slice(b.bytes("the fingerprint", 96, 32)?);
    let channel_generation = b.u64("the channel generation", 128)?;
    let data_generation = b.u64("the data generation", 136)?;
    let max_readers = b.u32("the reader limit", 144)?;
    let holders_generation = b.u64("the holders generation", 152)?;
    let generation_base = b.u64("the generation base", 160)?;
    let mut tokens = Vec::with_capacity(buffers);
    let mut lens: Vec<u64> = Vec::with_capacity(allocs);
    for bi in 0..buffers {
        let mut toks = Vec::with_capacity(allocs);
        for ai in 0..allocs {
            let e = &a_tab[(bi * allocs + ai) * ALLOC_ENTRY..][..ALLOC_ENTRY];
            let mut tok = [0u8; TOKEN_LEN];
            tok.copy_from_slice(&e[..TOKEN_LEN]);
            let len = u64::from_le_bytes(e[TOKEN_LEN..TOKEN_LEN + 8].try_into().expect("8 bytes"));
            if bi == 0 {
                lens.push(len);
            } else if lens[ai] != len {
                return Err(field(
                    "an allocation's length",
                    len,
                    "the same in every buffer",
                ));
            }
            toks.push(tok);
        }
        tokens.push(toks);
    }
    if lens.iter().try_fold(0u64, |s, &l| s.checked_add(l)) != Some(total) {
        return Err(field(
            "the bytes per buffer",
            total,
            "the sum of one buffer's allocations",
        ));
    }
    let tables = TensorTables {
        tensors: n,
        table: (t_off, t_len),
        dims: (d_off, d_len),
        strings: (s_off, s_len),
        allocations: lens.clone(),
        fingerprint: fp,
    };
    let manifest = Manifest {
        kind,
        flags,
        buffers,
        layout: Layout::provisional(lens, fp),
        tokens,
        channel_generation,
        data_generation,
        max_readers,
        holders_generation,
        generation_base,
    };
    Ok((manifest, tables))
}

mod tables;
pub(crate) use tables::Verified;

#[cfg(test)]
mod tests;
