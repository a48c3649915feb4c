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
//! The decoder checks every offset, length, count and code before it reads (and that each token
//! of a GPU set's allocation table decodes), recomputes each tensor's byte length and the
//! fingerprint, and reports the first fault as a [`ManifestFault`]:
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

/// Row-major strides of `shape`, elements (a dimension of extent 0 counts as 1, as PyTorch's
/// strides do), or why they cannot be: a stride past `i64::MAX` (a shape with a dimension of
/// extent 0 has no bytes, but its other dimensions' strides must still be numbers).
fn contiguous(shape: &[i64]) -> std::result::Result<Vec<i64>, String> {
    let mut s = vec![0i64; shape.len()];
    let mut acc = 1i64;
    for i in (0..shape.len()).rev() {
        s[i] = acc;
        if i > 0 {
            acc = acc.checked_mul(shape[i].max(1)).ok_or_else(|| {
                format!(
                    "its row-major stride of dimension {} (the product of extents {:?}, each \
                     counted as at least 1) passes i64::MAX",
                    i - 1,
                    &shape[i..]
                )
            })?;
        }
    }
    Ok(s)
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
    let strides = match &spec.strides {
        Some(s) => s.clone(),
        None => contiguous(&spec.shape).map_err(|w| bad_tensor(&spec.name, w))?,
    };
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
    /// negative dimension or stride, too many dimensions, a size that overflows, or row-major
    /// strides past `i64::MAX` (also for a tensor with no elements, whose strides are kept).
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
    /// `tensors` lies in allocation `tensors[i].1` at byte offset `tensors[i].2`. An offset that
    /// is not a multiple of the tensor's element size is accepted (a Rust reader gets its bytes
    /// where they lie), but no PyTorch view can start there: Python's `TensorHold.tensors()`
    /// refuses such a tensor with `NotSupported` naming it and its offset. Put each tensor at a
    /// multiple of its element size (of 256 bytes for the fastest kernels) to read it from
    /// PyTorch.
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
                        "bytes {}+{} leave allocation {} of {}",
                        t.offset,
                        t.bytes,
                        t.allocation,
                        crate::error::bytes(len)
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

mod body;
mod tables;
use body::Body;
pub(crate) use body::{Manifest, TensorTables, decode_head_within, encode};
#[cfg(test)]
pub(crate) use body::{decode, decode_head, decode_unverified};
pub(crate) use tables::Verified;

#[cfg(test)]
mod tests;
