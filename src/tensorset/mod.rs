//! Tensor sets: a named, versioned set of tensors (name, DLPack dtype, shape, strides, byte
//! offset) that one [`TensorSetWriter`] publishes and any number of [`TensorSetReader`]s map,
//! each allocation imported once, read-only where the memory allows; new generations switch
//! atomically.
//!
//! Objects under `/dev/shm` for set `NAME`:
//! - `cuda-ipc.ts.NAME`: the manifest segment (`segment.rs`; the body's layout in `manifest.rs`):
//!   memory kind, buffers B, allocations per buffer A, the allocation table (a token and a length
//!   per allocation), the tensor table, the layout fingerprint, the generation channel's creation
//!   generation. Written once, read-only afterwards, every field range-checked by readers.
//! - `cuda-ipc.tg.NAME`: the generation channel, a memoryless channel control segment (no pool,
//!   empty tokens): channel buffer `i` stands for the set's buffer `i`, a frame's sequence number
//!   is the generation, its metadata the generation, the content fingerprint and flags. The
//!   channel's protocol does the rest: holds, release words written by readers' streams after
//!   their work, the writer's stream waiting for them, dead readers freed by the writer's
//!   watchdog, a dead writer's gate closed by readers' watchdogs (a reader's starts with its
//!   stream, at its first need) or by a reader's take or wait that finds the writer dead.
//! - host sets only: `cuda-ipc.td.NAME`, the data segment with the B buffers.
//! - VMM sets only: `cuda-ipc.th.NAME`, the holders segment (`holders/mod.rs`): who serves the
//!   set's file descriptors (the writer, [`Holder`]s, readers opened with
//!   [`ReaderOptions::serve`]), with liveness, and the last whole generation. A set whose writer
//!   died stays attachable while a holder lives: a new reader imports the memory from a holder
//!   and reads the last whole generation (a *writerless* reader,
//!   [`TensorSetReader::is_writerless`]).
//!
//! Modes ([`GenerationMode`]): in place (B = 1: [`TensorSetWriter::begin`] waits until no reader
//! holds the generation, and the writer's stream for their release words) or buffered (B ≥ 2:
//! readers of the newest generation never wait for the writer, which writes the oldest buffer no
//! reader holds).
//!
//! Stable addresses ([`ReaderOptions::stable_addresses`], VMM sets): a reader reserves one
//! address range per allocation at open and keeps it for its life; at a point it chooses
//! ([`TensorSetReader::switch_stable`], never under its running kernels: the switch waits for the
//! context's work first), a held generation's memory is mapped there, and the reader keeps that
//! generation held until the next switch, so CUDA graphs captured over the stable addresses read
//! one whole generation and stay valid across generations. In place (B = 1) the stable addresses
//! are the buffer's own, and the writer waits for [`TensorSetReader::release_stable`].
//!
//! PyTorch tensors carry no read-only flag: a stray in-place operation on a tensor over a
//! read-only mapping faults the reader's context (a CUDA error in that process, which must then
//! be restarted); the writer and the other readers go on. Over read-write mappings (pool, legacy,
//! `read_only: false`) such a write would silently change every process's weights.

pub mod content;
mod dtype;
mod error;
pub mod holders;
pub mod inspect;
mod manifest;
pub mod owned;
mod reader;
pub mod reclaim;
mod segment;
mod stable;
mod writer;

pub use dtype::DType;
pub(crate) use error::is_not_found;
pub use error::{ManifestFault, TensorSetError};
pub use holders::{Holder, HolderRole, HolderSnapshot, HolderStatus};
pub use manifest::{
    ALIGN, Layout, MAX_ALLOCATIONS, MAX_NAME, MAX_NDIM, MAX_SET_BYTES, MAX_TENSORS, TensorInfo,
    TensorSpec, fingerprint,
};
pub use reader::{Held, Location, OpenTimings, TensorRef, TensorSetReader, VERIFY_APART};
pub use segment::{
    DATA_PREFIX, GENERATION_PREFIX, HOLDERS_PREFIX, MANIFEST_PREFIX, validate_set_name,
};
pub use stable::StableSwitch;
pub use writer::{CloseReport, Closer, TensorSetWriter, Update};

use crate::channel::{MemoryKind, WaitStrategy};
use crate::driver::{Context, DeviceMemory};
use crate::quota::QuotaScope;
use std::sync::Arc;

/// One tensor's bytes in device memory, as this process maps them: for kernels and copies
/// ([`DeviceMemory`]). Borrowed from a [`Held`] generation or an [`Update`]; valid while it lives.
#[derive(Clone, Copy, Debug)]
pub struct DeviceTensor<'a> {
    ptr: u64,
    len: usize,
    ctx: &'a Arc<Context>,
}

impl DeviceMemory for DeviceTensor<'_> {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn context(&self) -> &Arc<Context> {
        self.ctx
    }
}

/// How generations are kept.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum GenerationMode {
    /// One buffer, updated in place: an update waits for every reader of the current generation
    /// to release it (readers waiting meanwhile never see a half-written generation).
    #[default]
    InPlace,
    /// `n` buffers (2 to 16): readers of the newest generation never wait for the writer, which
    /// writes the oldest buffer no reader holds (waiting for its last readers on the GPU).
    Buffered(usize),
}

/// How a tensor set is created.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TensorSetOptions {
    /// The memory: `Vmm` (default), `Auto` (VMM where the device exports it as a file
    /// descriptor, else pool), `Pool`, `Legacy` (only on request: readers cannot map it
    /// read-only, and it fails between some pid namespaces) or `Host`. Read by
    /// [`TensorSetWriter::create`]; [`TensorSetWriter::create_host`] makes a host set whatever it
    /// says.
    pub memory: MemoryKind,
    /// In place (default) or buffered.
    pub mode: GenerationMode,
    /// Most readers attached at once (1 to 64); default 64.
    pub max_readers: usize,
    /// The shared budget the set's bytes (B × bytes per buffer) are reserved from, as a channel's
    /// pool ([`crate::channel::ChannelOptions::quota`]); `None` (default): no ledger.
    pub quota: Option<QuotaScope>,
    /// How [`TensorSetWriter::begin`] waits.
    pub wait: WaitStrategy,
    /// Whether [`TensorSetWriter::create`] resumes on a dead writer's held VMM set of the same
    /// layout (default `true`; [`TensorSetWriter::resumed`]); `false`: replace it.
    pub resume: bool,
}

impl Default for TensorSetOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl TensorSetOptions {
    /// VMM memory, in place, 64 readers, no quota, default waiting.
    pub fn new() -> TensorSetOptions {
        TensorSetOptions {
            memory: MemoryKind::Vmm,
            mode: GenerationMode::InPlace,
            max_readers: 64,
            quota: None,
            wait: WaitStrategy::default(),
            resume: true,
        }
    }
    /// Sets the memory kind.
    pub fn memory(mut self, kind: MemoryKind) -> Self {
        self.memory = kind;
        self
    }
    /// Sets the generation mode.
    pub fn mode(mut self, mode: GenerationMode) -> Self {
        self.mode = mode;
        self
    }
    /// Sets the reader limit.
    pub fn max_readers(mut self, n: usize) -> Self {
        self.max_readers = n;
        self
    }
    /// Reserves the set's bytes from `scope`'s ledger.
    pub fn quota(mut self, scope: QuotaScope) -> Self {
        self.quota = Some(scope);
        self
    }
    /// Resume on a dead writer's held set of the same layout (`true`, the default) or replace it
    /// (`false`: a new allocation, the old holders let go).
    pub fn resume(mut self, on: bool) -> Self {
        self.resume = on;
        self
    }
    /// Sets the writer's wait strategy.
    pub fn wait(mut self, w: WaitStrategy) -> Self {
        self.wait = w;
        self
    }
}

/// How a reader opens a set.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct ReaderOptions {
    /// Refuse the set unless its layout fingerprint is this ([`TensorSetError::LayoutMismatch`]).
    pub expect_layout: Option<[u8; 32]>,
    /// Refuse each generation whose content fingerprint is not this
    /// ([`TensorSetError::ContentMismatch`]).
    pub expect_content: Option<[u8; 32]>,
    /// How [`TensorSetReader::wait_newer`] waits.
    pub wait: WaitStrategy,
    /// Map VMM memory read-only (default `true`).
    pub read_only: bool,
    /// Serve the set's file descriptors to new readers too, as a [`Holder`] does (default
    /// `false`): after its imports the reader fetches the fds again (from the writer, or a
    /// holder), offers them from this process and claims a slot of the set's holders segment
    /// (role reader), let go when the reader drops. VMM sets only
    /// ([`TensorSetError::NotHoldable`] otherwise).
    pub serve: bool,
    /// Keep stable addresses across generations (default `false`; VMM sets only): see
    /// [`TensorSetReader::switch_stable`].
    pub stable_addresses: bool,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl ReaderOptions {
    /// No expectations, default waiting, read-only.
    pub fn new() -> ReaderOptions {
        ReaderOptions {
            expect_layout: None,
            expect_content: None,
            wait: WaitStrategy::default(),
            read_only: true,
            serve: false,
            stable_addresses: false,
        }
    }
    /// Demands the layout fingerprint `fp`.
    pub fn expect_layout(mut self, fp: [u8; 32]) -> Self {
        self.expect_layout = Some(fp);
        self
    }
    /// Demands the content fingerprint `fp` of every generation taken.
    pub fn expect_content(mut self, fp: [u8; 32]) -> Self {
        self.expect_content = Some(fp);
        self
    }
    /// Sets the wait strategy.
    pub fn wait(mut self, w: WaitStrategy) -> Self {
        self.wait = w;
        self
    }
    /// Maps read-only (`true`) or read-write.
    pub fn read_only(mut self, on: bool) -> Self {
        self.read_only = on;
        self
    }
    /// Serves the set's file descriptors to new readers (`true`) or not (the default); see
    /// [`ReaderOptions::serve`](struct.ReaderOptions.html#structfield.serve).
    pub fn serve(mut self, on: bool) -> Self {
        self.serve = on;
        self
    }
    /// Reserves stable addresses at open (`true`; VMM sets only), at which
    /// [`TensorSetReader::switch_stable`] maps the generation the reader chooses.
    pub fn stable_addresses(mut self, on: bool) -> Self {
        self.stable_addresses = on;
        self
    }
}

/// Bytes of a generation's frame metadata: generation `u64`, content fingerprint (32 bytes),
/// flags `u32`.
const META_LEN: usize = 44;

/// A generation's frame metadata.
pub(crate) fn encode_meta(generation: u64, content: &[u8; 32], flags: u32) -> [u8; META_LEN] {
    let mut m = [0u8; META_LEN];
    m[..8].copy_from_slice(&generation.to_le_bytes());
    m[8..40].copy_from_slice(content);
    m[40..].copy_from_slice(&flags.to_le_bytes());
    m
}

/// (generation, content fingerprint) of a frame's metadata; the frame's sequence number and no
/// fingerprint when the metadata is not a tensor set's.
pub(crate) fn decode_meta(meta: &[u8], seq: u64) -> (u64, [u8; 32]) {
    if meta.len() != META_LEN {
        return (seq, [0; 32]);
    }
    let mut c = [0u8; 32];
    c.copy_from_slice(&meta[8..40]);
    // The writer's own number: the sequence number plus the manifest's generation base.
    let g = u64::from_le_bytes(meta[..8].try_into().unwrap_or_default());
    (if g == 0 { seq } else { g }, c)
}

#[cfg(test)]
mod tests {
    /// The ends can move between threads (the Python bindings hold them behind locks), and a
    /// reader can be shared by threads that each take generations.
    #[test]
    fn the_ends_are_send_and_the_reader_is_sync() {
        fn send<T: Send>() {}
        fn sync<T: Sync>() {}
        send::<super::TensorSetWriter>();
        send::<super::TensorSetReader>();
        sync::<super::TensorSetReader>();
        sync::<super::TensorSetWriter>();
    }
}
