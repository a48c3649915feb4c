//! A thread-safe device allocator that carves allocations out of a few large [`VmmBuffer`] chunks,
//! so memory a program allocates piecemeal (PyTorch's caching allocator asks for 2 MiB and 20 MiB+
//! segments) lives in a handful of fd-exportable allocations that another process imports once
//! each.
//!
//! Owns: [`VmmArena`] (the chunks and the lock around them), its options and statistics, and the
//! pure bookkeeping of the carving ([`Carving`]: first fit over per-chunk free lists that coalesce
//! on free), kept apart from the driver calls so it is tested without a GPU. Chunks are
//! [`VmmBuffer`]s (`cuMemCreate` with POSIX-fd handles); this file makes no driver call of its own.

use super::cache::lock;
use super::vmm::{VmmBuffer, vmm_granularity};
use crate::driver::{Context, DeviceMemory};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// The alignment of every address [`VmmArena::alloc`] returns, and the unit sizes are rounded up
/// to, in bytes (PyTorch's caching allocator and DLPack consumers need at most 256).
pub const ARENA_ALIGN: u64 = 512;

/// The default size of a chunk, in bytes: 1 GiB.
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 30;

/// How a [`VmmArena`] sizes and keeps its chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ArenaOptions {
    /// The size of a new chunk, in bytes (default [`DEFAULT_CHUNK_BYTES`]); a request larger than
    /// it gets a chunk of its own size. Both are rounded up to the device's VMM granularity.
    pub chunk_bytes: usize,
    /// Whether a chunk that becomes entirely free is released (default `false`: chunks are kept,
    /// since a tensor set may list them and readers may have imported them).
    pub release_empty_chunks: bool,
}

impl Default for ArenaOptions {
    fn default() -> Self {
        ArenaOptions {
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            release_empty_chunks: false,
        }
    }
}

impl ArenaOptions {
    /// Options with chunks of `chunk_bytes` bytes, kept when empty.
    pub fn with_chunk_bytes(chunk_bytes: usize) -> Self {
        ArenaOptions {
            chunk_bytes,
            ..Self::default()
        }
    }
}

/// What a [`VmmArena`] holds, in bytes and counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ArenaStats {
    /// Live chunks.
    pub chunks: usize,
    /// Bytes of device memory the live chunks hold.
    pub reserved_bytes: u64,
    /// Bytes handed out and not yet freed (each allocation rounded up to [`ARENA_ALIGN`]).
    pub in_use_bytes: u64,
    /// Allocations handed out and not yet freed.
    pub allocations: usize,
}

/// One chunk's book: where it starts, its size and its free ranges (offset → length, coalesced:
/// no two ranges touch).
#[derive(Debug, Clone)]
struct ChunkBook {
    base: u64,
    size: u64,
    free: BTreeMap<u64, u64>,
    used: u64,
}

/// The carving of chunks into allocations, without a driver call: chunks are (base address, size)
/// pairs in stable slots, allocations first fit (lowest slot, then lowest offset), sizes rounded up
/// to [`ARENA_ALIGN`]; a free coalesces the range with its free neighbours.
#[derive(Debug, Default, Clone)]
pub(crate) struct Carving {
    slots: Vec<Option<ChunkBook>>,
    /// Chunk base address → slot, to find the chunk of an address.
    by_base: BTreeMap<u64, usize>,
    /// Address → (slot, rounded length) of every live allocation.
    live: BTreeMap<u64, (usize, u64)>,
    in_use: u64,
    reserved: u64,
}

impl Carving {
    /// `len` rounded up to [`ARENA_ALIGN`]; `None` for 0 or an overflow.
    pub(crate) fn rounded(len: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        len.checked_next_multiple_of(ARENA_ALIGN)
    }

    /// Adds a chunk of `size` bytes at `base` (aligned to [`ARENA_ALIGN`], not overlapping another
    /// chunk) in the lowest empty slot; returns the slot.
    pub(crate) fn add_chunk(&mut self, base: u64, size: u64) -> Result<usize> {
        if size == 0 || !base.is_multiple_of(ARENA_ALIGN) || base.checked_add(size).is_none() {
            return Err(Error::InvalidArgument(format!(
                "an arena chunk of {size} bytes at {base:#x}"
            )));
        }
        if self.chunk_of(base, 1).is_some()
            || self.by_base.range(base..base + size).next().is_some()
        {
            return Err(Error::InvalidArgument(format!(
                "an arena chunk at {base:#x} overlaps another"
            )));
        }
        let book = ChunkBook {
            base,
            size,
            free: BTreeMap::from([(0, size)]),
            used: 0,
        };
        let slot = match self.slots.iter().position(Option::is_none) {
            Some(s) => {
                self.slots[s] = Some(book);
                s
            }
            None => {
                self.slots.push(Some(book));
                self.slots.len() - 1
            }
        };
        self.by_base.insert(base, slot);
        self.reserved += size;
        Ok(slot)
    }

    /// Places `need` bytes (already rounded) first fit; the address, or `None` when no chunk has
    /// a free range that large.
    pub(crate) fn place(&mut self, need: u64) -> Option<u64> {
        let slot = self.slots.iter().position(|b| {
            b.as_ref()
                .is_some_and(|b| b.free.values().any(|&l| l >= need))
        })?;
        self.place_in(slot, need)
    }

    /// Places `need` bytes in chunk `slot`, first fit; `None` when it has no room.
    pub(crate) fn place_in(&mut self, slot: usize, need: u64) -> Option<u64> {
        let book = self.slots.get_mut(slot)?.as_mut()?;
        let (&off, &len) = book.free.iter().find(|&(_, &l)| l >= need)?;
        book.free.remove(&off);
        if len > need {
            book.free.insert(off + need, len - need);
        }
        book.used += need;
        let ptr = book.base + off;
        self.live.insert(ptr, (slot, need));
        self.in_use += need;
        Some(ptr)
    }

    /// Frees the allocation at `ptr`; returns its slot and whether that chunk is now entirely
    /// free.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `ptr` is not the address of a live allocation (never
    /// handed out, freed already, or inside one).
    pub(crate) fn free(&mut self, ptr: u64) -> Result<(usize, bool)> {
        let (slot, len) = self.live.remove(&ptr).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{ptr:#x} is not the address of a live allocation of this arena"
            ))
        })?;
        self.in_use -= len;
        let book = self.slots[slot]
            .as_mut()
            .expect("a live allocation's chunk is live");
        book.used -= len;
        let mut off = ptr - book.base;
        let mut len = len;
        // Coalesce with the free range just before (ending at `off`) and just after.
        if let Some((&p, &pl)) = book.free.range(..off).next_back()
            && p + pl == off
        {
            book.free.remove(&p);
            off = p;
            len += pl;
        }
        if let Some(nl) = book.free.remove(&(off + len)) {
            len += nl;
        }
        book.free.insert(off, len);
        Ok((slot, book.used == 0))
    }

    /// Removes chunk `slot` when it is entirely free; returns whether it did.
    pub(crate) fn remove_chunk_if_empty(&mut self, slot: usize) -> bool {
        match self.slots.get(slot) {
            Some(Some(b)) if b.used == 0 => {
                let (base, size) = (b.base, b.size);
                self.slots[slot] = None;
                self.by_base.remove(&base);
                self.reserved -= size;
                true
            }
            _ => false,
        }
    }

    /// The slot and offset of `[ptr, ptr + len)` when one chunk holds all of it.
    pub(crate) fn chunk_of(&self, ptr: u64, len: u64) -> Option<(usize, u64)> {
        let (&base, &slot) = self.by_base.range(..=ptr).next_back()?;
        let book = self.slots[slot].as_ref()?;
        let off = ptr - base;
        (off.checked_add(len)? <= book.size).then_some((slot, off))
    }

    /// The index of `slot` among the live chunks (slot order), as [`VmmArena::chunks`] lists them.
    pub(crate) fn live_index(&self, slot: usize) -> usize {
        self.slots[..slot].iter().filter(|s| s.is_some()).count()
    }

    /// The rounded length of the live allocation at `ptr`.
    pub(crate) fn allocation_len(&self, ptr: u64) -> Option<u64> {
        self.live.get(&ptr).map(|&(_, l)| l)
    }

    /// The counters.
    pub(crate) fn stats(&self) -> ArenaStats {
        ArenaStats {
            chunks: self.by_base.len(),
            reserved_bytes: self.reserved,
            in_use_bytes: self.in_use,
            allocations: self.live.len(),
        }
    }
}

/// The carving and the chunks' buffers, slot by slot, under one lock.
#[derive(Debug, Default)]
struct ArenaState {
    carving: Carving,
    buffers: Vec<Option<VmmBuffer>>,
}

/// A thread-safe allocator of device memory in one context, carving allocations out of large
/// fd-exportable [`VmmBuffer`] chunks (`cuMemCreate` with POSIX-fd handles): first fit over
/// per-chunk free lists that coalesce on free, every address aligned to [`ARENA_ALIGN`] (512)
/// bytes. A chunk is [`ArenaOptions::chunk_bytes`] (1 GiB by default) or the request rounded up to
/// the VMM granularity, whichever is larger.
///
/// The chunks are what other processes import: [`VmmArena::chunks`] lists them and
/// [`VmmArena::locate`] names the chunk and offset of a range (for example a tensor of a model
/// built in the arena), so a tensor set can publish that memory without a copy
/// (`TensorSetWriter::create_over`). Chunks are kept when they become free unless
/// [`ArenaOptions::release_empty_chunks`] is set; dropping the arena drops its chunk buffers (memory
/// other processes imported stays theirs until they drop it).
#[derive(Debug)]
pub struct VmmArena {
    ctx: Arc<Context>,
    opts: ArenaOptions,
    granularity: u64,
    state: Mutex<ArenaState>,
}

impl VmmArena {
    /// An empty arena in `ctx`; no memory is allocated until the first [`VmmArena::alloc`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `chunk_bytes == 0`; [`Error::Cuda`] from
    /// `cuMemGetAllocationGranularity`.
    pub fn new(ctx: &Arc<Context>, opts: ArenaOptions) -> Result<VmmArena> {
        if opts.chunk_bytes == 0 {
            return Err(Error::InvalidArgument(
                "an arena's chunk size must be at least 1 byte".into(),
            ));
        }
        let granularity = {
            let _cur = ctx.enter()?;
            vmm_granularity(&ctx.device())?
        };
        Ok(VmmArena {
            ctx: ctx.clone(),
            opts,
            granularity: (granularity as u64).max(ARENA_ALIGN),
            state: Mutex::new(ArenaState::default()),
        })
    }

    /// The context the arena allocates in.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The options the arena was made with.
    pub fn options(&self) -> &ArenaOptions {
        &self.opts
    }

    /// `len` bytes of device memory (rounded up to [`ARENA_ALIGN`]), uninitialised, at an address
    /// aligned to [`ARENA_ALIGN`]; a new chunk is created (`cuMemCreate`, reserve, map, set
    /// access) when no chunk has room. Free it with [`VmmArena::free`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `len == 0` or a size that overflows; from a new chunk:
    /// [`Error::Unsupported`] (no VMM or POSIX fd handles) and [`Error::Cuda`]
    /// (`CUDA_ERROR_OUT_OF_MEMORY`, ...).
    pub fn alloc(&self, len: usize) -> Result<u64> {
        let need = Carving::rounded(len as u64)
            .ok_or_else(|| Error::InvalidArgument(format!("an arena allocation of {len} bytes")))?;
        let mut st = lock(&self.state);
        if let Some(p) = st.carving.place(need) {
            return Ok(p);
        }
        let size = need
            .max(self.opts.chunk_bytes as u64)
            .checked_next_multiple_of(self.granularity)
            .and_then(|s| usize::try_from(s).ok())
            .ok_or_else(|| Error::InvalidArgument(format!("{len} bytes overflow")))?;
        // Created under the lock, so that threads short of room at once make one chunk, not one
        // each.
        let buf = VmmBuffer::new(&self.ctx, size)?;
        let slot = st.carving.add_chunk(buf.device_ptr(), buf.len() as u64)?;
        if st.buffers.len() <= slot {
            st.buffers.resize_with(slot + 1, || None);
        }
        st.buffers[slot] = Some(buf);
        st.carving.place_in(slot, need).ok_or_else(|| {
            Error::InvalidArgument(format!("a new chunk has no room for {len} bytes"))
        })
    }

    /// Frees the allocation at `ptr` (an address [`VmmArena::alloc`] returned); its bytes become
    /// free for later allocations. With [`ArenaOptions::release_empty_chunks`], a chunk left
    /// entirely free is released (its buffer dropped).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `ptr` is not a live allocation of this arena; nothing
    /// changes then.
    pub fn free(&self, ptr: u64) -> Result<()> {
        let released = {
            let mut st = lock(&self.state);
            let (slot, empty) = st.carving.free(ptr)?;
            if empty && self.opts.release_empty_chunks && st.carving.remove_chunk_if_empty(slot) {
                st.buffers[slot].take()
            } else {
                None
            }
        };
        // Dropped outside the lock: unmapping synchronises nothing, but it is a driver call.
        drop(released);
        Ok(())
    }

    /// The size in bytes of the live allocation at `ptr` (its request rounded up to
    /// [`ARENA_ALIGN`]), or `None` when `ptr` is not one.
    pub fn allocation_len(&self, ptr: u64) -> Option<usize> {
        lock(&self.state)
            .carving
            .allocation_len(ptr)
            .map(|l| l as usize)
    }

    /// Which chunk holds the device range `[ptr, ptr + len)`: its index in [`VmmArena::chunks`]
    /// (as listed now), a clone of its buffer and the range's byte offset in it; `None` when no
    /// chunk holds all of it. The range need not be one allocation: a tensor inside an allocation
    /// of PyTorch's caching allocator is found too.
    ///
    /// With [`ArenaOptions::release_empty_chunks`] a chunk released between this call and
    /// [`VmmArena::chunks`] shifts the indices; keep the default (chunks kept) when publishing.
    pub fn locate(&self, ptr: u64, len: usize) -> Option<(usize, VmmBuffer, u64)> {
        let st = lock(&self.state);
        let (slot, off) = st.carving.chunk_of(ptr, len as u64)?;
        let buf = st.buffers.get(slot)?.clone()?;
        Some((st.carving.live_index(slot), buf, off))
    }

    /// The live chunks, in index order (the indices [`VmmArena::locate`] returns).
    pub fn chunks(&self) -> Vec<VmmBuffer> {
        lock(&self.state)
            .buffers
            .iter()
            .flatten()
            .cloned()
            .collect()
    }

    /// Bytes reserved and in use, chunks and allocations.
    pub fn stats(&self) -> ArenaStats {
        lock(&self.state).carving.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn rounding() {
        assert_eq!(Carving::rounded(0), None);
        assert_eq!(Carving::rounded(1), Some(512));
        assert_eq!(Carving::rounded(512), Some(512));
        assert_eq!(Carving::rounded(513), Some(1024));
        assert_eq!(Carving::rounded(u64::MAX), None);
    }

    #[test]
    fn first_fit_and_alignment() {
        let mut c = Carving::default();
        let s = c.add_chunk(0x1000_0000, 4 * MIB).unwrap();
        assert_eq!(s, 0);
        let a = c.place(512).unwrap();
        let b = c.place(1024).unwrap();
        let d = c.place(2 * MIB).unwrap();
        assert_eq!(a, 0x1000_0000);
        assert_eq!(b, a + 512);
        assert_eq!(d, b + 1024);
        for p in [a, b, d] {
            assert!(p.is_multiple_of(ARENA_ALIGN));
        }
        assert_eq!(c.stats().in_use_bytes, 512 + 1024 + 2 * MIB);
        assert_eq!(c.stats().allocations, 3);
        // Too large for what is left.
        assert_eq!(c.place(3 * MIB), None);
        // A freed hole is reused first (first fit, lowest address).
        c.free(b).unwrap();
        assert_eq!(c.place(512).unwrap(), b);
        assert_eq!(c.place(512).unwrap(), b + 512);
    }

    #[test]
    fn coalescing_restores_one_range() {
        let mut c = Carving::default();
        c.add_chunk(0x2000_0000, 8 * MIB).unwrap();
        let ps: Vec<u64> = (0..8).map(|_| c.place(MIB).unwrap()).collect();
        assert_eq!(c.place(512), None, "the chunk is full");
        // Free in an order that exercises both neighbours: odd ones, then even ones.
        for (i, &p) in ps.iter().enumerate() {
            if i % 2 == 1 {
                assert_eq!(c.free(p).unwrap(), (0, false));
            }
        }
        for (i, &p) in ps.iter().enumerate() {
            if i % 2 == 0 {
                let (_, empty) = c.free(p).unwrap();
                assert_eq!(empty, i == 6);
            }
        }
        let book = c.slots[0].as_ref().unwrap();
        assert_eq!(book.free.len(), 1);
        assert_eq!(book.free.get(&0), Some(&(8 * MIB)));
        assert_eq!(c.stats().in_use_bytes, 0);
        // The whole chunk can be handed out again in one piece.
        assert_eq!(c.place(8 * MIB), Some(0x2000_0000));
    }

    #[test]
    fn unknown_and_double_free_are_errors() {
        let mut c = Carving::default();
        c.add_chunk(0x4000_0000, MIB).unwrap();
        let a = c.place(4096).unwrap();
        assert!(c.free(a + 512).is_err(), "inside an allocation");
        assert!(c.free(0xdead_0000).is_err(), "never handed out");
        c.free(a).unwrap();
        let e = c.free(a).unwrap_err();
        assert!(
            e.to_string()
                .contains("not the address of a live allocation"),
            "{e}"
        );
        assert_eq!(c.stats().in_use_bytes, 0);
    }

    #[test]
    fn several_chunks_locate_and_release() {
        let mut c = Carving::default();
        let s0 = c.add_chunk(0x1_0000_0000, 2 * MIB).unwrap();
        let s1 = c.add_chunk(0x2_0000_0000, 2 * MIB).unwrap();
        assert_eq!((s0, s1), (0, 1));
        let a = c.place(2 * MIB).unwrap();
        let b = c.place(MIB).unwrap();
        assert_eq!(a, 0x1_0000_0000);
        assert_eq!(b, 0x2_0000_0000);
        assert_eq!(c.chunk_of(b + 100, 200), Some((1, 100)));
        assert_eq!(c.chunk_of(a + 2 * MIB - 1, 1), Some((0, 2 * MIB - 1)));
        assert_eq!(c.chunk_of(a + 2 * MIB - 1, 2), None, "runs past the chunk");
        assert_eq!(c.chunk_of(0x1000, 1), None, "below every chunk");
        assert_eq!(
            c.chunk_of(0x1_0000_0000 + 3 * MIB, 1),
            None,
            "between chunks"
        );
        // Overlapping chunks are refused.
        assert!(c.add_chunk(0x1_0000_0000 + MIB, 2 * MIB).is_err());
        assert!(c.add_chunk(0x0_ffff_0000, 2 * MIB).is_err());
        assert!(c.add_chunk(0x3_0000_0100, MIB).is_err(), "misaligned");
        // Release the first chunk; the second's live index moves down, its slot stays.
        assert_eq!(c.free(a).unwrap(), (0, true));
        assert!(!c.remove_chunk_if_empty(1), "chunk 1 is in use");
        assert!(c.remove_chunk_if_empty(0));
        assert_eq!(c.stats().chunks, 1);
        assert_eq!(c.stats().reserved_bytes, 2 * MIB);
        assert_eq!(c.chunk_of(a, 1), None);
        assert_eq!(c.live_index(1), 0);
        // A new chunk takes the empty slot.
        assert_eq!(c.add_chunk(0x5_0000_0000, MIB).unwrap(), 0);
    }

    #[test]
    fn random_churn_keeps_invariants() {
        // A deterministic pseudo-random walk of allocations and frees over three chunks: live
        // allocations never overlap, and the books always add up.
        let mut c = Carving::default();
        for i in 0..3u64 {
            c.add_chunk((i + 1) << 32, 16 * MIB).unwrap();
        }
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut live: Vec<(u64, u64)> = Vec::new();
        for _ in 0..5000 {
            if live.is_empty() || next() % 3 != 0 {
                let len = Carving::rounded(next() % (3 * MIB) + 1).unwrap();
                if let Some(p) = c.place(len) {
                    for &(q, l) in &live {
                        assert!(p + len <= q || q + l <= p, "overlap");
                    }
                    live.push((p, len));
                }
            } else {
                let i = (next() % live.len() as u64) as usize;
                let (p, _) = live.swap_remove(i);
                c.free(p).unwrap();
            }
            let s = c.stats();
            assert_eq!(s.in_use_bytes, live.iter().map(|&(_, l)| l).sum::<u64>());
            assert_eq!(s.allocations, live.len());
        }
        for (p, _) in live.drain(..) {
            c.free(p).unwrap();
        }
        for b in c.slots.iter().flatten() {
            assert_eq!(b.free.len(), 1);
            assert_eq!(b.used, 0);
        }
    }
}
