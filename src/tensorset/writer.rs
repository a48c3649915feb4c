//! The writing end: [`TensorSetWriter`] (the set's memory, its manifest, the generation channel's
//! producer) and the [`Update`] it hands out between [`TensorSetWriter::begin`] and
//! [`Update::commit`].

use super::error::TensorSetError;
use super::holders::{self, HoldersSegment, Recorder};
use super::manifest::{
    FLAG_BUFFERED, KIND_HOST, KIND_LEGACY, KIND_POOL, KIND_VMM, Layout, MAX_SET_BUFFERS, Manifest,
    TensorSpec,
};
use super::segment::{self, DataSegment, GENERATION_PREFIX};
use super::{GenerationMode, TensorSetOptions};
use crate::channel::{
    ChannelBuffer, ChannelError, ChannelOptions, MemoryKind, Producer, allocate_pool, auto_kind,
};
use crate::driver::{Context, DeviceMemory, Stream, Uuid};
use crate::error::{Error, Result};
use crate::identity::ForkEpoch;
use crate::ipc::VmmBuffer;
use crate::quota::Reservation;
use crate::shm::Segment;
use crate::token::{TOKEN_LEN, Token};
use std::sync::Arc;
use std::time::Duration;

mod copies;
mod resume;
mod update;

pub use update::Update;

/// One allocation of a buffer: made by the writer, or given ([`TensorSetWriter::create_over`]).
#[derive(Debug)]
enum Allocation {
    Own(ChannelBuffer),
    External(VmmBuffer),
    /// A resumed set's: imported from a holder's fd, which this writer serves again.
    /// Drop order: the mapping, then the export (this process's fd).
    Resumed {
        buf: crate::ipc::ImportedBuffer,
        _export: crate::ipc::fdpass::FdExport,
    },
}

impl Allocation {
    fn device_ptr(&self) -> u64 {
        match self {
            Allocation::Own(b) => b.device_ptr(),
            Allocation::External(b) => b.device_ptr(),
            Allocation::Resumed { buf, .. } => buf.device_ptr(),
        }
    }
}

/// The writer's memory: host buffers in the data segment, or device allocations
/// (`buffers[b][a]`).
enum Memory {
    Host(DataSegment),
    Gpu(Vec<Vec<Allocation>>),
}

/// What the writer keeps of its generations.
#[derive(Debug, Clone, Copy, Default)]
struct State {
    /// The last generation committed (0: none).
    generation: u64,
    /// The buffer that holds it.
    head: Option<usize>,
    /// Added to the channel's sequence numbers (the manifest's generation base).
    base: u64,
}

/// The writing end of a tensor set: publishes the manifest `cuda-ipc.ts.NAME`, owns the set's
/// memory (B buffers of one allocation each, or the allocations given to
/// [`TensorSetWriter::create_over`]), and hands out generations through the memoryless
/// generation channel `cuda-ipc.tg.NAME` (the channel's protocol: holds, release words, watchdog).
///
/// Dropping it (or [`TensorSetWriter::close`]) takes every generation from readers (no hold is
/// granted from then on: they get [`TensorSetError::Closed`]), removes the names, waits (bounded)
/// for the holds taken before, and frees the memory: VMM readers keep their mappings; pool and
/// legacy readers must stop reading first.
///
/// # Examples
/// ```
/// use cuda_ipc::tensorset::{DType, ReaderOptions, TensorSetOptions, TensorSetReader,
///     TensorSetWriter, TensorSpec};
/// let name = format!("doc-ts-{}", std::process::id());
/// let specs = [TensorSpec::new("w", DType::F32, &[4])];
/// let mut w = TensorSetWriter::create_host(&name, &specs, &TensorSetOptions::new())?;
/// let mut u = w.begin(None)?;
/// u.write_tensor(0, &[1u8; 16])?;
/// assert_eq!(u.commit()?, 1);
/// let r = TensorSetReader::open_host(&name, &ReaderOptions::new())?;
/// let held = r.current()?.expect("generation 1");
/// assert_eq!(held.read_tensor(0)?, vec![1u8; 16]);
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub struct TensorSetWriter {
    // Drop order: the generations are withdrawn and the names unlinked (Drop), then the
    // generation channel is drained (the producer's own drop), then the writer's holder slot is let go, then the memory is
    // freed, then the manifest unmapped, then the bytes go back to the quota ledger.
    producer: Option<Producer>,
    /// VMM sets: the writer's part of the holders segment (`holders/recorder.rs`).
    recorder: Option<Recorder>,
    memory: Memory,
    manifest: Segment,
    layout: Arc<Layout>,
    name: String,
    state: State,
    kind: MemoryKind,
    mode: GenerationMode,
    /// Device bytes this writer allocated (0 on a resume or over given allocations).
    allocated: u64,
    /// A resumed writer's view of the dead writer's generation channel (its live readers' holds).
    old: Option<resume::OldReaders>,
    _quota: Option<Reservation>,
    /// The content fingerprint's kernel, loaded at the first fingerprinted update (GPU sets).
    fingerprinter: std::sync::OnceLock<crate::tensorset::content::Fingerprinter>,
    /// The many-ranges copy kernel, loaded at the first [`Update::copy_many`] that needs it (GPU
    /// sets; `None` where it cannot be loaded).
    copier: std::sync::OnceLock<Option<copies::RangeCopier>>,
    /// [`TensorSetWriter::wait_closing`] withdrew the generations and unlinked the names
    /// already.
    closing: bool,
    /// The process (by fork) that made the writer: a forked child's copy neither writes nor
    /// closes the set, nor removes its names (`identity::fork`).
    fork: ForkEpoch,
}

/// Takes a set's generations from its readers from any thread, while its writer may be busy in
/// another ([`TensorSetWriter::closer`]): for a binding whose `close()` can come while another
/// thread waits in `begin` with the writer.
#[derive(Clone)]
pub struct Closer {
    /// The generation channel's control (`None`: the writer had closed).
    control: Option<Arc<crate::channel::Control>>,
}

impl std::fmt::Debug for Closer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Closer").finish_non_exhaustive()
    }
}

impl Closer {
    /// Takes every generation from readers now, as [`TensorSetWriter::close`] begins by doing:
    /// no hold is granted from then on (readers' `current` and `wait_newer` say
    /// [`TensorSetError::Closed`]); holds taken before stay until they end. The names, memory and
    /// writer stay until the writer closes, which then finds this step done; the writer's
    /// [`TensorSetWriter::begin`] (also one waiting now) and an open update's commit fail with
    /// [`TensorSetError::Closed`] from then on, publishing nothing. Made once, however
    /// often called (also after the writer's own close); nothing in a process forked from the
    /// one that made the writer.
    pub fn withdraw(&self) {
        if let Some(c) = &self.control {
            c.close_withdrawing();
        }
    }
}

impl std::fmt::Debug for TensorSetWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorSetWriter")
            .field("name", &self.name)
            .field("generation", &self.state.generation)
            .finish_non_exhaustive()
    }
}

/// Buffers of `mode`, checked.
fn buffer_count(mode: GenerationMode) -> Result<usize> {
    match mode {
        GenerationMode::InPlace => Ok(1),
        GenerationMode::Buffered(n) if (2..=MAX_SET_BUFFERS).contains(&n) => Ok(n),
        GenerationMode::Buffered(n) => Err(Error::InvalidArgument(format!(
            "a buffered tensor set needs 2 to {MAX_SET_BUFFERS} buffers, got {n}"
        ))),
    }
}

/// Bytes of a set of `buffers` buffers of `bytes` bytes each (what the quota ledger is asked
/// for).
///
/// # Errors
/// [`Error::InvalidArgument`] naming both when the product is 2^64 bytes or more: refused as
/// such, not reserved as a saturated `u64::MAX` (and refused by the budget instead).
fn set_bytes(buffers: usize, bytes: u64) -> Result<u64> {
    (buffers as u64).checked_mul(bytes).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "a set of {buffers} buffers of {bytes} bytes is 2^64 bytes or more"
        ))
    })
}

/// Reserves `bytes` from the ledger `opts.quota` names for `device`; `data` is a host set's data
/// segment name (host memory).
fn reserve(
    opts: &TensorSetOptions,
    device: Uuid,
    bytes: u64,
    data: Option<&str>,
) -> Result<Option<Reservation>> {
    crate::quota::reserve_in(opts.quota, device, bytes, data)
}

/// The set's generation channel (`cuda-ipc.tg.NAME`, memoryless, `buffers` buffers), in `ctx` or
/// on the host; a live or starting writer's channel is the set's `AlreadyExists` /
/// `CreationInProgress`.
fn generation_channel(
    ctx: Option<&Arc<Context>>,
    name: &str,
    opts: &TensorSetOptions,
    buffers: usize,
) -> Result<Producer> {
    if opts.max_readers == 0 || opts.max_readers > crate::channel::MAX_CONSUMERS {
        return Err(Error::InvalidArgument(format!(
            "a tensor set takes 1 to {} readers, got {}",
            crate::channel::MAX_CONSUMERS,
            opts.max_readers
        )));
    }
    let copts = ChannelOptions::new(0)
        .buffers(buffers)
        .max_consumers(opts.max_readers)
        .wait(opts.wait);
    Producer::create_memoryless(ctx, GENERATION_PREFIX, name, &copts).map_err(|e| match e {
        Error::Channel(ChannelError::AlreadyExists { pid, .. }) => TensorSetError::AlreadyExists {
            name: name.to_string(),
            pid,
        }
        .into(),
        Error::Channel(ChannelError::CreationInProgress(_)) => {
            TensorSetError::CreationInProgress(name.to_string()).into()
        }
        other => other,
    })
}

impl TensorSetWriter {
    /// Creates tensor set `name` in `ctx` with the tensors `specs` (laid out in order, offsets
    /// aligned to 256 bytes, [`Layout::new`]): the generation channel, B buffers of one
    /// allocation each of [`TensorSetOptions::memory`] (`Vmm` by default; `Auto`: VMM where the
    /// device exports it as a file descriptor, else pool; `Legacy` only when asked: its readers
    /// cannot map it read-only; `Host`: as [`TensorSetWriter::create_host`]), exported, and the
    /// manifest. With [`TensorSetOptions::quota`], B × the set's bytes are reserved first. No
    /// generation exists until the first [`Update::commit`]. A dead writer's set (or a creation
    /// abandoned half-way) under the name is replaced.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad name, mode or reader count, or a set (buffers × bytes
    /// per buffer) of 2^64 bytes or more, before any budget is asked;
    /// [`TensorSetError::BadTensor`] / [`TensorSetError::TooManyTensors`] for specs that cannot be
    /// laid out; [`TensorSetError::AlreadyExists`] (or the channel's
    /// [`crate::channel::ChannelError::AlreadyExists`] for its generation channel) when a live
    /// writer has the name; [`TensorSetError::BadManifest`] (or the channel's
    /// [`crate::channel::ChannelError::BadSegment`]) for a live writer's segment whose init stamp
    /// was zeroed, after the 2 s wait for it; [`crate::quota::QuotaError::OverQuota`]; CUDA
    /// errors from allocation and export; shared-memory errors (a full /dev/shm, what is in the
    /// way).
    pub fn create(
        ctx: &Arc<Context>,
        name: &str,
        specs: &[TensorSpec],
        opts: &TensorSetOptions,
    ) -> Result<TensorSetWriter> {
        if opts.memory == MemoryKind::Host {
            return Self::create_host(name, specs, opts);
        }
        let layout = Layout::new(specs)?;
        Self::create_gpu(ctx, name, layout, opts)
    }

    fn create_gpu(
        ctx: &Arc<Context>,
        name: &str,
        layout: Layout,
        opts: &TensorSetOptions,
    ) -> Result<TensorSetWriter> {
        segment::validate_set_name(name)?;
        let b = buffer_count(opts.mode)?;
        let bytes = layout.bytes_per_buffer();
        let total = set_bytes(b, bytes)?;
        if opts.resume
            && matches!(opts.memory, MemoryKind::Vmm | MemoryKind::Auto)
            && let Some(w) = Self::try_resume(ctx, name, &layout, opts, b)?
        {
            return Ok(w);
        }
        let quota = reserve(opts, ctx.device().uuid(), total, None)?;
        let producer = generation_channel(Some(ctx), name, opts, b)?;
        let kind = match opts.memory {
            MemoryKind::Auto => match auto_kind(ctx, &ChannelOptions::new(1)) {
                MemoryKind::Vmm => MemoryKind::Vmm,
                _ => MemoryKind::Pool,
            },
            k => k,
        };
        let len = usize::try_from(bytes)
            .map_err(|_| Error::InvalidArgument(format!("{bytes} bytes per buffer")))?;
        let alloc = |k| allocate_pool(ctx, k, &ChannelOptions::new(len).buffers(b).memory(k));
        let (kind, buffers, tokens) = match alloc(kind) {
            // VMM where the device reports it but the driver still refuses (an MPS client, a
            // restricted container): pool memory instead, said once.
            Err(e) if opts.memory == MemoryKind::Auto && kind == MemoryKind::Vmm => {
                tracing::info!("tensor set {name}: VMM memory refused ({e}); using pool memory");
                alloc(MemoryKind::Pool)?
            }
            r => r?,
        };
        let code = match kind {
            MemoryKind::Vmm => KIND_VMM,
            MemoryKind::Pool => KIND_POOL,
            _ => KIND_LEGACY,
        };
        let memory = Memory::Gpu(
            buffers
                .into_iter()
                .map(|x| vec![Allocation::Own(x)])
                .collect(),
        );
        let tokens = tokens.into_iter().map(|t| vec![t]).collect();
        Self::finish(
            name, layout, opts, producer, memory, tokens, code, kind, 0, quota,
        )
    }

    /// Creates tensor set `name` in shared host memory ([`MemoryKind::Host`], whatever
    /// [`TensorSetOptions::memory`] says): the data segment `cuda-ipc.td.NAME` with B buffers at a
    /// page-aligned stride, the generation channel (no GPU words are used) and the manifest.
    /// Never calls the CUDA driver.
    ///
    /// The options' memory kind is not read, not refused: the default options
    /// ([`TensorSetOptions::new`], whose kind is `Vmm`) make a host set here, as
    /// `.memory(MemoryKind::Host)` does, and so does any other kind. The call names the memory;
    /// [`TensorSetWriter::create`] is the one that reads the kind (and with `Host` comes here).
    ///
    /// # Errors
    /// As [`TensorSetWriter::create`], less CUDA's; [`Error::InvalidArgument`] for a data
    /// segment past `isize::MAX` bytes (its buffers each rounded up to 4096 bytes), before any
    /// budget is asked.
    pub fn create_host(
        name: &str,
        specs: &[TensorSpec],
        opts: &TensorSetOptions,
    ) -> Result<TensorSetWriter> {
        segment::validate_set_name(name)?;
        let layout = Layout::new(specs)?;
        let b = buffer_count(opts.mode)?;
        let bytes = layout.bytes_per_buffer();
        let total = set_bytes(b, bytes)?;
        // The data segment's size is checked before the ledger is asked: a set no segment can
        // hold is refused as such, whatever the budget.
        segment::data_len(b, bytes)?;
        let data_name = segment::data_name(name);
        let quota = reserve(opts, Uuid([0; 16]), total, Some(&data_name))?;
        let producer = generation_channel(None, name, opts, b)?;
        let data = DataSegment::create(name, b, bytes)?;
        if let Some(q) = &quota {
            q.record_memory_or_warn(&data.seg);
        }
        let generation = data.generation;
        let tokens = vec![vec![[0u8; TOKEN_LEN]]; b];
        let memory = Memory::Host(data);
        Self::finish(
            name,
            layout,
            opts,
            producer,
            memory,
            tokens,
            KIND_HOST,
            MemoryKind::Host,
            generation,
            quota,
        )
    }

    /// Publishes existing VMM allocations as tensor set `name` without a copy (a live model's
    /// weights, e.g. chunks of an arena a PyTorch pool carved them from): the allocation table
    /// lists `allocations`, and tensor `i` of `tensors` lies in allocation `tensors[i].1` at byte
    /// offset `tensors[i].2`. In place only ([`GenerationMode::InPlace`]: one buffer, the
    /// allocations themselves); the writer keeps the buffers (clones) alive until it closes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a mode other than in place or no allocation; as
    /// [`TensorSetWriter::create`] otherwise ([`TensorSetError::BadTensor`] for a tensor outside
    /// its allocation); CUDA errors from the export.
    pub fn create_over(
        ctx: &Arc<Context>,
        name: &str,
        tensors: &[(TensorSpec, u32, u64)],
        allocations: Vec<VmmBuffer>,
        opts: &TensorSetOptions,
    ) -> Result<TensorSetWriter> {
        segment::validate_set_name(name)?;
        if opts.mode != GenerationMode::InPlace {
            return Err(Error::InvalidArgument(
                "a tensor set over given allocations is published in place only".into(),
            ));
        }
        let lens = allocations.iter().map(|a| a.len() as u64).collect();
        let layout = Layout::with_locations(tensors, lens)?;
        let quota = reserve(opts, ctx.device().uuid(), layout.bytes_per_buffer(), None)?;
        let producer = generation_channel(Some(ctx), name, opts, 1)?;
        let tokens = vec![
            allocations
                .iter()
                .map(|a| a.export().map(|t| t.to_bytes()))
                .collect::<Result<Vec<_>>>()?,
        ];
        let memory = Memory::Gpu(vec![
            allocations.into_iter().map(Allocation::External).collect(),
        ]);
        Self::finish(
            name,
            layout,
            opts,
            producer,
            memory,
            tokens,
            KIND_VMM,
            MemoryKind::Vmm,
            0,
            quota,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        name: &str,
        layout: Layout,
        opts: &TensorSetOptions,
        producer: Producer,
        memory: Memory,
        tokens: Vec<Vec<[u8; TOKEN_LEN]>>,
        code: u32,
        kind: MemoryKind,
        data_generation: u64,
        quota: Option<Reservation>,
    ) -> Result<TensorSetWriter> {
        let buffers = tokens.len();
        let own = matches!(&memory, Memory::Gpu(r) if r.iter().flatten().any(|a| matches!(a, Allocation::Own(_))));
        let allocated = if own {
            layout.bytes_per_buffer().saturating_mul(buffers as u64)
        } else {
            0
        };
        // VMM sets get a holders segment (made before the manifest, which records its
        // generation); a set of more allocations than a slot holds gets none.
        let holders = if code == KIND_VMM {
            let allocs = layout.allocations().len();
            match holders::check_entries(name, buffers, allocs) {
                Ok(_) => Some(HoldersSegment::create(
                    name,
                    buffers,
                    allocs,
                    layout.fingerprint(),
                    layout.bytes_per_buffer(),
                )?),
                Err(e) => {
                    tracing::info!("tensor set {name} is not holdable: {e}");
                    None
                }
            }
        } else {
            None
        };
        let m = Manifest {
            kind: code,
            flags: if buffers > 1 { FLAG_BUFFERED } else { 0 },
            buffers,
            layout,
            tokens,
            channel_generation: producer.control_generation(),
            data_generation,
            max_readers: opts.max_readers as u32,
            holders_generation: holders.as_ref().map_or(0, HoldersSegment::generation),
            generation_base: 0,
        };
        let undo = |memory: &Memory, holders: Option<&HoldersSegment>| {
            if let Memory::Host(d) = memory {
                d.unlink();
            }
            if let Some(h) = holders {
                h.unlink();
            }
        };
        let manifest = match segment::create_manifest(name, &m) {
            Ok(s) => s,
            Err(e) => {
                undo(&memory, holders.as_ref());
                return Err(e);
            }
        };
        let recorder = match holders {
            Some(h) => {
                let made = h.generation();
                match Self::start_recorder(&producer, &m, h) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        segment::unlink_own(&manifest);
                        if let Ok(h) = HoldersSegment::open(name, None)
                            && h.generation() == made
                        {
                            h.unlink();
                        }
                        undo(&memory, None);
                        return Err(e);
                    }
                }
            }
            None => None,
        };
        Ok(TensorSetWriter {
            producer: Some(producer),
            recorder,
            memory,
            manifest,
            layout: Arc::new(m.layout),
            name: name.to_string(),
            state: State::default(),
            kind,
            mode: opts.mode,
            allocated,
            old: None,
            _quota: quota,
            fingerprinter: std::sync::OnceLock::new(),
            copier: std::sync::OnceLock::new(),
            closing: false,
            fork: ForkEpoch::now(),
        })
    }

    /// The writer's part of `holders`: its slot with its export ids (from the manifest's tokens),
    /// the recorder thread.
    fn start_recorder(producer: &Producer, m: &Manifest, h: HoldersSegment) -> Result<Recorder> {
        let ids = m
            .tokens
            .iter()
            .flatten()
            .map(|t| Token::from_bytes(t).map(|t| t.export_id))
            .collect::<Result<Vec<u32>>>()?;
        Recorder::start(producer.context()?, h, &ids)
    }

    /// The set's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The layout (tensors, allocations, fingerprint).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The kind of memory chosen (`Auto` resolved).
    pub fn memory_kind(&self) -> MemoryKind {
        self.kind
    }

    /// The generation mode.
    pub fn mode(&self) -> GenerationMode {
        self.mode
    }

    /// A [`Closer`] of this set, which another thread can use while this writer is busy.
    pub fn closer(&self) -> Closer {
        Closer {
            control: self.producer.as_ref().map(|p| p.control().clone()),
        }
    }

    /// Waits up to `timeout` (`None`: no bound) until every reader has taken the newest
    /// generation: each reader attached when it was committed has held it (or a later one);
    /// readers that open the set later start at it. Returns whether they all have. For a writer
    /// about to close: its close takes every generation from readers as it begins, so a reader
    /// still waiting for the last one (`wait_newer`) would get [`TensorSetError::Closed`]
    /// instead. A reader that died is let go on the way (its slot freed within the wait's
    /// liveness checks), so it holds nothing up; one that is alive but never asks (it read the
    /// weights once and stopped) keeps the wait until its timeout.
    ///
    /// # Errors
    /// [`Error::ForkedChild`] in a process forked from the one that made the writer;
    /// [`TensorSetError::Closed`] once closing, or once a [`Closer::withdraw`] took the
    /// generations (also one that comes while this waits: it ends at once).
    pub fn wait_readers(&self, timeout: Option<Duration>) -> Result<bool> {
        self.fork.check("tensor set writer")?;
        let withdrawn = || {
            self.closing
                || self
                    .producer
                    .as_ref()
                    .is_some_and(|p| p.control().is_withdrawn())
        };
        if withdrawn() {
            return Err(TensorSetError::Closed(self.name.clone()).into());
        }
        let taken = self.producer.as_ref().is_none_or(|p| p.wait_taken(timeout));
        if !taken && withdrawn() {
            return Err(TensorSetError::Closed(self.name.clone()).into());
        }
        Ok(taken)
    }

    /// The last generation committed (0: none yet).
    pub fn generation(&self) -> u64 {
        self.state.generation
    }

    /// Whether this writer resumed on a dead writer's held memory (no allocation, no copy; its
    /// first generation is the old set's last whole one): see [`TensorSetOptions::resume`].
    pub fn resumed(&self) -> bool {
        self.old.is_some()
    }

    /// Device bytes this writer allocated: B × bytes per buffer, 0 on a resume, over given
    /// allocations ([`TensorSetWriter::create_over`]) and for host sets.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated
    }

    fn producer(&self) -> &Producer {
        self.producer
            .as_ref()
            .expect("the producer lives until close")
    }

    /// The writer's stream (the generation channel producer's): enqueue the writes of an update
    /// here. It waits on the GPU for the readers' release words of the buffer an update takes.
    ///
    /// # Errors
    /// [`TensorSetError::WrongKind`] on a host set; [`crate::Error::ForkedChild`] in a process
    /// forked from the one that made the writer.
    pub fn stream(&self) -> Result<&Stream> {
        self.fork.check("tensor set writer")?;
        if self.kind == MemoryKind::Host {
            return Err(TensorSetError::WrongKind("a host tensor set has no stream").into());
        }
        self.producer().stream()
    }

    /// The device address of tensor `i` in buffer `buffer` (GPU sets).
    ///
    /// # Errors
    /// [`TensorSetError::NoSuchTensor`]; [`TensorSetError::WrongKind`] on a host set;
    /// [`Error::InvalidArgument`] for a buffer out of range; [`Error::ForkedChild`] in a process
    /// forked from the one that made the writer.
    pub fn device_ptr(&self, buffer: usize, i: usize) -> Result<u64> {
        self.fork.check("tensor set writer")?;
        tensor_ptr(&self.memory, &self.layout, buffer, i)
    }

    /// (address, bytes) of allocation `a` of buffer `buffer` in this process: the host address
    /// of the buffer in the data segment (host sets, one allocation) or the device address;
    /// `None` out of range. For registering the memory with a transport.
    #[cfg(feature = "remote")]
    pub(crate) fn allocation_span(&self, buffer: usize, a: usize) -> Option<(u64, u64)> {
        let len = *self.layout.allocations().get(a)?;
        match &self.memory {
            Memory::Host(d) => (buffer < d.buffers && a == 0).then(|| (d.ptr(buffer) as u64, len)),
            Memory::Gpu(b) => Some((b.get(buffer)?.get(a)?.device_ptr(), len)),
        }
    }

    /// Buffers of the set (1 in place).
    pub fn buffers(&self) -> usize {
        match self.mode {
            GenerationMode::InPlace => 1,
            GenerationMode::Buffered(n) => n,
        }
    }

    /// Takes a buffer for generation [`TensorSetWriter::generation`] + 1, waiting up to `timeout`
    /// (`None`: forever) while readers hold it (in place: until every reader released the current
    /// generation, which no reader takes from the call on: readers asking meanwhile wait for this
    /// update's commit, so readers whose holds overlap without pause do not keep the buffer from
    /// the writer, and a `begin` that times out gives the generation back; buffered: the oldest
    /// buffer no reader holds, never the newest generation's, so readers of the newest never wait
    /// for the writer and an update dropped unpublished takes nothing from them: while readers
    /// hold every older buffer, this waits for one of them to be let go; give the set a buffer
    /// more when readers keep old generations long). Readers waiting meanwhile never see the
    /// buffer. On a GPU set the writer's stream then waits for the last readers' release
    /// words on the GPU (`cuStreamWaitValue32`): their kernels finish before the update's writes.
    /// A reader that died holding a generation is freed within about 1 s (the channel's
    /// watchdog and liveness checks). A resumed writer ([`TensorSetWriter::resumed`]) also waits
    /// on the host, within the same `timeout`, for the dead writer's readers: until none holds
    /// the buffer (their hold bits, writerless readers' reading words) and every live one that
    /// read it has its release word there (the kernels it ran over the buffer finished).
    ///
    /// One update at a time: the [`Update`] borrows the writer mutably until it is committed or
    /// dropped, so no second `begin` can be open or waiting meanwhile (the Python binding, whose
    /// writer any thread may call, refuses a second `begin()` or `publish()` at once with
    /// `InvalidArgument`).
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`TensorSetError::Closed`] after [`TensorSetWriter::wait_closing`] or
    /// a [`Closer::withdraw`] (also one that comes while this waits: it ends at once);
    /// CUDA errors from the stream wait.
    pub fn begin(&mut self, timeout: Option<Duration>) -> Result<Update<'_>> {
        self.begin_with(timeout, Acquire::Whole)
    }

    /// [`TensorSetWriter::begin`] for a caller that waits in slices (a binding checking for
    /// signals between them): in place, a slice that times out leaves the generation reserved (no
    /// reader takes it), so the next slice (this or [`TensorSetWriter::begin`]) goes on waiting
    /// for the same holds; readers whose holds outlast a slice would otherwise take it again
    /// between slices and could keep the buffer from the writer for good. A caller that stops
    /// waiting gives the generation back with [`TensorSetWriter::give_back_reservation`];
    /// `begin`, and an error other than the timeout, give it back themselves. Buffered, as
    /// `begin`.
    ///
    /// # Errors
    /// As [`TensorSetWriter::begin`].
    pub fn begin_slice(&mut self, timeout: Option<Duration>) -> Result<Update<'_>> {
        self.begin_with(timeout, Acquire::Slice)
    }

    /// Gives back the generation that [`TensorSetWriter::begin_slice`] left reserved (readers
    /// take it again); nothing when none is.
    pub fn give_back_reservation(&mut self) {
        if self.fork.inherited() {
            return;
        }
        if let Some(p) = self.producer.as_mut() {
            p.give_back_reservation();
        }
    }

    /// [`TensorSetWriter::begin`], but never in the newest generation's buffer: it waits for an
    /// older one ([`Error::Timeout`] when none freed up in time). For updates that may be dropped
    /// unpublished (the tensor-set bridge's far writer): one dropped in the newest generation's
    /// buffer would take that generation from readers until the next commit.
    #[cfg(feature = "remote")]
    pub(crate) fn begin_behind_newest(&mut self, timeout: Option<Duration>) -> Result<Update<'_>> {
        self.begin_with(timeout, Acquire::Older)
    }

    fn begin_with(&mut self, timeout: Option<Duration>, how: Acquire) -> Result<Update<'_>> {
        self.fork.check("tensor set writer")?;
        if self.closing {
            // Its generations are withdrawn: no buffer would come.
            return Err(TensorSetError::Closed(self.name.clone()).into());
        }
        let previous = self.state.head;
        let producer = self
            .producer
            .as_mut()
            .expect("the producer lives until close");
        // Buffered: never the newest generation's buffer, so that its readers never wait for
        // the writer; it waits for an older buffer's holds to end instead.
        let keep_newest = self.mode != GenerationMode::InPlace;
        let frame = match how {
            _ if keep_newest => producer.acquire_older(timeout),
            Acquire::Whole => producer.acquire(timeout),
            Acquire::Slice => producer.acquire_slice(timeout),
            #[cfg(feature = "remote")]
            Acquire::Older => producer.acquire_older(timeout),
        }
        .map_err(|e| closed_error(&self.name, e))?;
        let buffered = self.mode != GenerationMode::InPlace;
        if let (Some(old), Some(r)) = (&self.old, &self.recorder) {
            // A resumed set: readers of the dead writer's incarnation may still read the buffer.
            old.wait_free(r.holders(), frame.index(), timeout)?;
        }
        if let Some(r) = self.recorder.as_mut() {
            // Before anything writes the buffer: holders' readers never take it for whole.
            r.before_write(self.state.generation + 1, frame.index(), buffered);
        }
        Ok(Update {
            name: &self.name,
            buffer: frame.index(),
            recorder: self.recorder.as_mut(),
            frame,
            memory: &self.memory,
            layout: &self.layout,
            state: &mut self.state,
            previous,
            fingerprinter: &self.fingerprinter,
            copier: &self.copier,
            fork: self.fork,
        })
    }

    /// Closes the set: first takes every generation from readers, so that no hold is granted
    /// from then on (`current`, `wait_newer` and their bindings' forms get
    /// [`TensorSetError::Closed`], waiting ones within their wait's next look), then removes its
    /// names (no new reader opens it), waits up to `timeout` for the holds taken before (it
    /// returns as soon as they end: readers that keep asking cannot prolong it), then frees the
    /// memory; holds still out at the timeout are forced, and the report counts them.
    ///
    /// # Errors
    /// [`Error::ForkedChild`] in a process forked from the one that made the writer; CUDA errors
    /// from synchronising the writer's stream.
    pub fn close(self, timeout: Duration) -> Result<CloseReport> {
        self.close_as(timeout, false)
    }

    /// Closes the set as [`TensorSetWriter::close`] does, for a process that is exiting: waits
    /// up to `timeout` for other processes' holds only and forces this process's own readers'
    /// at once ([`crate::channel::Producer::close_at_exit`]): their threads release nothing any
    /// more (a binding's interpreter that is finalizing), so waiting for them would only hold
    /// the exit up by `timeout`. The report counts the holds forced, this process's included.
    ///
    /// # Errors
    /// As [`TensorSetWriter::close`].
    pub fn close_at_exit(self, timeout: Duration) -> Result<CloseReport> {
        self.close_as(timeout, true)
    }

    /// [`TensorSetWriter::close`], or with `at_exit` [`TensorSetWriter::close_at_exit`].
    fn close_as(mut self, timeout: Duration, at_exit: bool) -> Result<CloseReport> {
        self.fork.check("tensor set writer")?;
        self.start_closing();
        let report = |r: crate::channel::ShutdownReport| CloseReport {
            forced_holds: r.forced_holds,
        };
        match self.producer.take() {
            Some(p) if at_exit => p.close_at_exit(timeout).map(report),
            Some(p) => p.close(timeout).map(report),
            None => Ok(CloseReport::default()),
        }
    }

    /// Starts closing the set as [`TensorSetWriter::close`] does (no hold is granted from then
    /// on, readers get [`TensorSetError::Closed`]; its names go; [`TensorSetWriter::begin`]
    /// fails with [`TensorSetError::Closed`]) and waits up to `timeout` for the holds taken
    /// before. Returns whether none is left. For callers that wait in slices (a binding checking
    /// for signals between them) before `close`; the memory stays until `close` (or the drop).
    pub fn wait_closing(&mut self, timeout: Duration) -> bool {
        if self.fork.inherited() {
            // Nothing of this process's to wait for: `close` then says why it cannot close.
            return true;
        }
        self.start_closing();
        match self.producer.as_mut() {
            Some(p) => p.wait_closing(timeout),
            None => true,
        }
    }

    /// The first steps of a close, once: the generations withdrawn from readers
    /// (`Producer::close_to_consumers`), then the names unlinked. In that order, so that a reader
    /// that finds the names gone is granted no hold.
    fn start_closing(&mut self) {
        if self.closing {
            return;
        }
        self.closing = true;
        if let Some(p) = self.producer.as_mut() {
            p.close_to_consumers();
        }
        self.unlink_names();
    }

    fn unlink_names(&self) {
        segment::unlink_own(&self.manifest);
        if let Memory::Host(d) = &self.memory {
            d.unlink();
        }
        // A deliberate close: the set's holders see their segment's name gone and let go.
        if let Some(r) = &self.recorder {
            r.holders().unlink();
        }
    }
}

impl Drop for TensorSetWriter {
    fn drop(&mut self) {
        if self.fork.inherited() {
            // A forked child's copy: the set, its names and its readers are the parent's
            // (`identity::fork`); the fields' drops act on nothing of theirs either.
            return;
        }
        if self.producer.is_some() {
            self.start_closing();
        }
        // The producer's own drop drains the generation channel (5 s), before the memory fields
        // drop.
    }
}

/// `e`, or [`TensorSetError::Closed`] naming set `name` for the generation channel's
/// [`ChannelError::Closed`]: a [`Closer`] withdrew the generations (no buffer comes, nothing is
/// published from then on).
pub(super) fn closed_error(name: &str, e: Error) -> Error {
    match e {
        Error::Channel(ChannelError::Closed) => TensorSetError::Closed(name.to_string()).into(),
        other => other,
    }
}

/// What [`TensorSetWriter::close`] found at its end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CloseReport {
    /// Holds of readers still out when the close's `timeout` ran out, released by force (their
    /// generation's memory is freed right after: a reader that still read it reads undefined
    /// data, or faults, from then on). 0 when every hold ended in time.
    pub forced_holds: u64,
}

/// How a `begin` takes its buffer from the generation channel's producer.
#[derive(Clone, Copy)]
enum Acquire {
    /// `Producer::acquire`: waits once, gives a reservation back when it times out.
    Whole,
    /// `Producer::acquire_slice`: a reservation outlives the timeout.
    Slice,
    /// `Producer::acquire_older`: never the newest generation's buffer.
    #[cfg(feature = "remote")]
    Older,
}

/// The device address of tensor `i` in `buffer`.
fn tensor_ptr(memory: &Memory, layout: &Layout, buffer: usize, i: usize) -> Result<u64> {
    let t = layout
        .tensors()
        .get(i)
        .ok_or_else(|| TensorSetError::NoSuchTensor(i.to_string()))?;
    match memory {
        Memory::Host(_) => Err(TensorSetError::WrongKind(
            "a host tensor set has no device addresses; use the host accessors",
        )
        .into()),
        Memory::Gpu(b) => {
            let allocs = b
                .get(buffer)
                .ok_or_else(|| Error::InvalidArgument(format!("buffer {buffer} of {}", b.len())))?;
            Ok(allocs[t.allocation as usize].device_ptr() + t.offset)
        }
    }
}
