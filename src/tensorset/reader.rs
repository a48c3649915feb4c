//! The reading end: [`TensorSetReader`] (the manifest, the set's memory imported once, the
//! generation channel's consumer) and the [`Held`] generation guard.

use super::error::{ManifestFault, TensorSetError};
use super::holders::{self, HolderRole, Writerless};
use super::manifest::{KIND_HOST, KIND_VMM, Layout, MAX_SET_BUFFERS};
use super::segment::{self, DataSegment};
use super::stable::{Stable, StableSwitch};
use super::{ReaderOptions, content, decode_meta};
use crate::channel::{ChannelError, Consumer, FrameHold};
use crate::driver::{Context, Device, Stream};
use crate::error::{Error, Result};
use crate::identity::ForkEpoch;
use crate::identity::{Liveness, ProcessIdentity};
use crate::ipc::ImportedBuffer;
use crate::shm::Segment;
use crate::token::Token;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod content_api;
mod held;
mod open;
mod stable_api;

pub use held::{Held, Location, TensorRef};
use open::{
    EarlyJoin, PendingTables, decode_and_verify, hand_off_tables, join_channel, map_memory,
};
pub use open::{OpenTimings, VERIFY_APART};

/// How many times an open is made again where it found segments of two creations of the set
/// ([`TensorSetReader::open`]'s errors).
const REOPENS: u32 = 4;

/// `open()`, made again (at most [`REOPENS`] times) where it found segments of two creations of
/// the set (`ManifestFault::Mismatch`: a writer that replaced the set, its old writer dead, during
/// the open) or a set closed by its running writer during the open ([`TensorSetError::Closed`]:
/// the next try finds the set made again, or none, [`TensorSetError::NotFound`]). Segments
/// planted under the set's names mismatch every time: their error is returned after the last try.
fn reopening(mut open: impl FnMut() -> Result<TensorSetReader>) -> Result<TensorSetReader> {
    let mut tries = 0;
    loop {
        match open() {
            Err(Error::TensorSet(
                TensorSetError::BadManifest {
                    fault: ManifestFault::Mismatch { .. },
                    ..
                }
                | TensorSetError::Closed(_),
            )) if tries < REOPENS => tries += 1,
            r => return r,
        }
    }
}

/// What a reader maps of the set's memory.
enum Memory {
    Host(DataSegment),
    /// `imports[b][a]`: allocation `a` of buffer `b`, imported once at open.
    Gpu(Vec<Vec<ImportedBuffer>>),
}

/// Where a reader's generations come from.
enum Source {
    /// The generation channel (the writer runs, or ran when the reader joined).
    Channel(Consumer),
    /// The last whole generation of a set whose writer was dead at open (`holders.rs`).
    Writerless(Writerless),
}

/// The reading end of a tensor set: maps every buffer once at open (one driver import per
/// allocation, through the import cache and fd passing; read-only where the memory allows) and
/// keeps the mappings for every generation; takes generations as [`Held`] guards.
///
/// Opened after its writer's death (a VMM set that holders keep: [`super::Holder`]), a reader is
/// *writerless*: it imports the memory from a holder and serves the last whole generation
/// ([`TensorSetReader::is_writerless`]).
pub struct TensorSetReader {
    // Drop order: `Drop` first closes the stable addresses (context drained, ranges unmapped and
    // freed, their hold released on the consumer's stream); then the serving part lets go of its
    // holder slot, the consumer drains its stream and leaves the generation channel (a writerless
    // reader drains its own stream), then the imports are dropped (no GPU work reads them any
    // more), then the manifest is unmapped.
    stable: Option<Stable>,
    _serving: Option<holders::Serving>,
    consumer: Source,
    memory: Memory,
    /// Holds of this reader per buffer: a buffer held twice (the same generation taken again) is
    /// released when its last guard drops. Locked around each take and each release.
    holds: Mutex<[u32; MAX_SET_BUFFERS]>,
    layout: Arc<Layout>,
    name: String,
    read_only: bool,
    imports: u32,
    buffers: usize,
    expect_content: Option<[u8; 32]>,
    timings: OpenTimings,
    /// The manifest's generation base: generation = base + the channel's sequence number.
    generation_base: u64,
    /// The set's creation generation (its generation channel's, as the manifest names it).
    incarnation: u64,
    _manifest: Arc<Segment>,
    /// What the set's holders segment must match to be read (its creation generation, buffers,
    /// allocations); `None`: the set has none (not VMM).
    holders_expect: Option<(u64, usize, usize)>,
    /// The content-fingerprint kernel, loaded at the first [`Held::verify_content`] (GPU sets).
    fingerprinter: std::sync::OnceLock<content::Fingerprinter>,
    /// The process (by fork) that opened the reader: a forked child's copy takes no hold and
    /// lets go of nothing (`identity::fork`).
    fork: ForkEpoch,
}

impl std::fmt::Debug for TensorSetReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorSetReader")
            .field("name", &self.name)
            .field("read_only", &self.read_only)
            .field("imports", &self.imports)
            .finish_non_exhaustive()
    }
}

/// The error for a set whose generation channel is missing though its manifest was found:
/// [`TensorSetError::WriterGone`] naming `writer` (the manifest's, with its uid) when it is dead,
/// else [`TensorSetError::Closed`] (its writer closed it, or is making it again, meanwhile).
fn channel_gone(name: &str, (writer, uid): (ProcessIdentity, u32)) -> Error {
    if writer.pid != 0 && writer.liveness_as(uid) == Liveness::Dead {
        TensorSetError::WriterGone {
            name: name.to_string(),
            pid: writer.pid,
            why: String::new(),
        }
        .into()
    } else {
        TensorSetError::Closed(name.to_string()).into()
    }
}

/// A channel error in the set's words: the generation channel's producer gone or closed is the
/// writer's, named with the set.
fn set_error(name: &str, e: Error) -> Error {
    match e {
        Error::Channel(ChannelError::ProducerGone { pid }) => TensorSetError::WriterGone {
            name: name.to_string(),
            pid,
            why: String::new(),
        }
        .into(),
        Error::Channel(ChannelError::Closed) => TensorSetError::Closed(name.to_string()).into(),
        Error::Channel(ChannelError::NotFound(_)) => TensorSetError::WriterGone {
            name: name.to_string(),
            pid: 0,
            why: String::new(),
        }
        .into(),
        Error::Channel(ChannelError::NoConsumerSlot(max)) => TensorSetError::TooManyReaders {
            name: name.to_string(),
            max,
        }
        .into(),
        other => other,
    }
}

impl TensorSetReader {
    /// Opens tensor set `name` in `ctx`: reads and checks the manifest, imports every allocation
    /// of every buffer once (`cuMemImportFromShareableHandle` and a read-only `cuMemSetAccess`
    /// for VMM, with [`ReaderOptions::read_only`]; pool and legacy memory read-write, see
    /// [`TensorSetReader::is_read_only`]) and joins the generation channel, the two at the same
    /// time (the channel's attach on a thread of its own, started while the writer answers the fd
    /// fetch, which then decodes the manifest's tensor tables and checks its fingerprint while
    /// this thread maps; on an error of either, the other's result is dropped once that thread
    /// is done: no reader slot or mapping stays behind). The reader's stream is not made here
    /// but at its first need ([`TensorSetReader::stream`]). A host set is opened as by
    /// [`TensorSetReader::open_host`], without `ctx`.
    ///
    /// # Errors
    /// [`TensorSetError::NotFound`]; [`TensorSetError::LayoutMismatch`] when
    /// [`ReaderOptions::expect_layout`] differs; [`TensorSetError::BadManifest`] /
    /// [`TensorSetError::VersionMismatch`] for a manifest that is not one (segments of two
    /// creations of the set, as when a new writer replaces the set during the open, are opened
    /// again, four times at most, before `BadManifest` says so); the segment's own errors
    /// ([`crate::Error::Shm`]); [`TensorSetError::WriterGone`] when the writer is dead;
    /// [`TensorSetError::TooManyReaders`] past the set's reader limit; CUDA and fd
    /// passing errors from the imports.
    pub fn open(ctx: &Arc<Context>, name: &str, opts: &ReaderOptions) -> Result<TensorSetReader> {
        Self::open_inner(Some(ctx), name, opts)
    }

    /// Opens tensor set `name` on the device that holds it (found by UUID), in that device's
    /// primary context; a host set without the CUDA driver.
    ///
    /// # Errors
    /// As [`TensorSetReader::open`].
    pub fn open_auto(name: &str, opts: &ReaderOptions) -> Result<TensorSetReader> {
        Self::open_inner(None, name, opts)
    }

    /// Opens host tensor set `name` (CPU only: never calls the CUDA driver).
    ///
    /// # Errors
    /// As [`TensorSetReader::open`]; [`TensorSetError::WrongKind`] for a GPU set.
    pub fn open_host(name: &str, opts: &ReaderOptions) -> Result<TensorSetReader> {
        reopening(|| Self::open_host_once(name, opts))
    }

    fn open_host_once(name: &str, opts: &ReaderOptions) -> Result<TensorSetReader> {
        let started = Instant::now();
        let opened = segment::open_manifest_unverified(name, segment::INIT_WAIT)?;
        if opened.manifest.kind != KIND_HOST {
            return Err(TensorSetError::WrongKind(
                "a GPU tensor set: open it with a context (TensorSetReader::open)",
            )
            .into());
        }
        Self::finish(
            None,
            name,
            opts,
            opened,
            started,
            None,
            PendingTables::Decoded,
        )
    }

    /// [`TensorSetReader::open_once`], made again where it found segments of two creations
    /// ([`reopening`]).
    fn open_inner(
        ctx: Option<&Arc<Context>>,
        name: &str,
        opts: &ReaderOptions,
    ) -> Result<TensorSetReader> {
        reopening(|| Self::open_once(ctx, name, opts))
    }

    fn open_once(
        ctx: Option<&Arc<Context>>,
        name: &str,
        opts: &ReaderOptions,
    ) -> Result<TensorSetReader> {
        let started = Instant::now();
        // With the context known, the generation channel's join (which needs only the name) is
        // made ready first; its thread starts while the writer answers the fd fetch
        // (`EarlyJoin`), and runs beside the mapping. A host set's join (found in the manifest)
        // is dropped unstarted and done without a context.
        //
        // The opening thread decodes the manifest's header and allocation table only and goes on
        // to the mapping; the join thread decodes the tensor tables and checks the fingerprint
        // once joined, or for a large set a thread of their own does (`hand_off_tables`).
        let mut early = ctx.map(|c| EarlyJoin::new(c, name, opts));
        let head = segment::open_manifest_head(name, segment::INIT_WAIT)?;
        if head.opened.manifest.kind == KIND_HOST {
            drop(early);
            return Self::finish(
                None,
                name,
                opts,
                head.decoded()?,
                started,
                None,
                PendingTables::Decoded,
            );
        }
        let ctx = match ctx {
            Some(c) => c.clone(),
            None => {
                let tok = Token::from_bytes(&head.opened.manifest.tokens[0][0])?;
                Device::by_uuid(tok.device)?.primary_context()?
            }
        };
        // `open_auto` learns the context from the manifest: its join starts now, and takes the
        // tables all the same.
        let e = early.get_or_insert_with(|| EarlyJoin::new(&ctx, name, opts));
        let (opened, pending) = hand_off_tables(head, e)?;
        Self::finish(Some(&ctx), name, opts, opened, started, early, pending)
    }

    fn finish(
        ctx: Option<&Arc<Context>>,
        name: &str,
        opts: &ReaderOptions,
        opened: segment::OpenedManifest,
        started: Instant,
        mut early: Option<EarlyJoin>,
        pending: PendingTables,
    ) -> Result<TensorSetReader> {
        let mut timings = OpenTimings {
            manifest: opened.took,
            tables: opened.tables_took,
            ..OpenTimings::default()
        };
        // Tables still pending: a provisional layout (allocations and the stored fingerprint)
        // until their decode replaces it, below.
        let deferred = !matches!(pending, PendingTables::Decoded);
        // The writer the manifest records: who a generation channel found missing belongs to.
        let writer = opened.header().writer();
        let mut m = opened.manifest;
        let seg_name = opened.seg.name().to_string();
        let bad_fingerprint = |fault| TensorSetError::BadManifest {
            segment: seg_name.clone(),
            fault,
        };
        let verify = || {
            let t = Instant::now();
            (m.verify_fingerprint(), t.elapsed())
        };
        // The fingerprint is checked before anything is returned: by the thread that decodes
        // pending tables, after them; a large GPU set's beside the mapping (below, where no
        // thread took its tables); every other set's here, first.
        let verify_apart = !deferred && ctx.is_some() && m.layout.len() > VERIFY_APART;
        if !deferred && !verify_apart {
            let (r, took) = verify();
            timings.fingerprint = took;
            r.map_err(bad_fingerprint)?;
        }
        if let Some(expected) = opts.expect_layout
            && expected != m.layout.fingerprint()
        {
            return Err(TensorSetError::LayoutMismatch {
                expected,
                found: m.layout.fingerprint(),
            }
            .into());
        }
        Self::check_stable(opts, m.kind)?;
        // The generation channel's attach (segment open, slot claim; its stream, registration,
        // event and watchdog thread come at their first need) needs nothing of the imports: for a
        // GPU set it runs on a thread of its own (`EarlyJoin`: made before the manifest's read by
        // `open`, after its header by `open_auto`, started while the writer answers the fd
        // fetch, or below where nothing was fetched) while this thread maps the memory (a host
        // set's two halves are cheaper than a thread: one after the other). Context hygiene: the
        // consumer's objects (`Stream::new`, `HostRegistration::new`, `Event::new`) enter `ctx`
        // themselves and pop it again, whichever thread makes them. The imports stay on this
        // thread: their driver import count is this thread's (`open_with_access`).
        // Each half times itself (the join on its own thread): (result, its time, GPU part).
        let attach = || join_channel(ctx, name, opts);
        let map = |waiting: &mut dyn FnMut()| {
            let t = Instant::now();
            let before = crate::ipc::import_times_on_this_thread();
            let fetch_before = crate::ipc::fdpass::fetch_times_on_this_thread();
            let r = map_memory(ctx, name, opts, &m, &seg_name, waiting);
            let after = crate::ipc::import_times_on_this_thread();
            let fetch_after = crate::ipc::fdpass::fetch_times_on_this_thread();
            let steps: [Duration; crate::ipc::IMPORT_STEPS] =
                std::array::from_fn(|i| after[i].saturating_sub(before[i]));
            let fetch_steps: [Duration; crate::ipc::fdpass::FETCH_STEPS] =
                std::array::from_fn(|i| fetch_after[i].saturating_sub(fetch_before[i]));
            (r, t.elapsed(), steps, fetch_steps, Instant::now())
        };
        let (mapped, attached, join_wait, verified) = if ctx.is_none() {
            let mapped = map(&mut || {});
            let attached = (attach(), None);
            let wait = attached.0.1;
            (mapped, attached, wait, None)
        } else {
            std::thread::scope(|s| {
                let verifier = verify_apart.then(|| {
                    std::thread::Builder::new()
                        .name("cuda-ipc-verify".into())
                        .spawn_scoped(s, verify)
                });
                // The join's thread starts while the writer answers the fd fetch, or below where
                // nothing was fetched; an early return before this point drops `early`, which
                // waits for a thread that started.
                let mapped = map(&mut || {
                    if let Some(e) = early.as_mut() {
                        e.start();
                    }
                });
                let t = Instant::now();
                let attached = match early.as_mut().and_then(EarlyJoin::take) {
                    Some(h) => h
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                    // No thread to be had: attach here, after the imports, and decode the
                    // tables sent to it here too.
                    None => (
                        attach(),
                        early
                            .as_ref()
                            .and_then(EarlyJoin::take_back)
                            .map(|(body, t)| decode_and_verify(body, &t)),
                    ),
                };
                let join_wait = t.elapsed();
                let verified = verifier.map(|v| match v {
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                    Err(_) => verify(),
                });
                (mapped, attached, join_wait, verified)
            })
        };
        // A manifest whose fingerprint is not its tables' is refused before anything else; the
        // mapping and the consumer drop (back to the cache, out of the channel).
        if let Some((r, took)) = verified {
            timings.fingerprint = took;
            r.map_err(bad_fingerprint)?;
        }
        let (attached, decoded) = attached;
        let decoded = match pending {
            PendingTables::Decoded => None,
            // Given to the join thread, which decodes them once it has joined: a thread that
            // joined returned them decoded (or its panic was resumed above).
            PendingTables::OnJoin => Some(decoded.ok_or(Error::InvalidArgument(
                "the join thread returned no tensor tables".into(),
            ))?),
            PendingTables::Apart(h) => Some(
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
            ),
        };
        if let Some((layout, took, verify_took)) = decoded {
            timings.tables = took;
            timings.fingerprint = verify_took;
            m.layout = layout.map_err(bad_fingerprint)?;
        }
        let (mapped, map_time, steps, fetch_steps, mapped_at) = mapped;
        timings.spawn += early.as_ref().map_or(Duration::ZERO, |e| e.spawn);
        let step = |s: crate::ipc::ImportStep| steps[s as usize];
        let fetch_time = step(crate::ipc::ImportStep::FdFetch);
        timings.map_import = step(crate::ipc::ImportStep::Import);
        timings.map_reserve = step(crate::ipc::ImportStep::Reserve);
        timings.map_map = step(crate::ipc::ImportStep::Map);
        timings.map_set_access = step(crate::ipc::ImportStep::SetAccess);
        timings.map_fd_close = step(crate::ipc::ImportStep::CloseFd);
        timings.map_identity = step(crate::ipc::ImportStep::Identity);
        let fetch_step = |s: crate::ipc::fdpass::FetchStep| fetch_steps[s as usize];
        timings.fd_peer = fetch_step(crate::ipc::fdpass::FetchStep::Peer);
        timings.fd_connect = fetch_step(crate::ipc::fdpass::FetchStep::Connect);
        timings.fd_reply = fetch_step(crate::ipc::fdpass::FetchStep::Reply);
        let (attached, join_time, join_gpu) = attached;
        timings.fd_fetch = fetch_time;
        timings.map = map_time.saturating_sub(fetch_time);
        timings.join = join_time;
        timings.join_gpu = join_gpu;
        timings.join_wait = join_wait;
        // Either error is returned, the imports' first (as when they ran first); the other half's
        // result drops here: a consumer leaves the channel (its stream drained, its slot freed),
        // imports go back to the cache.
        let (memory, read_only, imports) = mapped?;
        let attached = attached.map_err(|e| match e {
            // The manifest was there, its generation channel is not: removed since, by its
            // writer's close (the writer runs: the set was closed) or by `gc` after its death.
            Error::Channel(ChannelError::NotFound(_)) => channel_gone(name, writer),
            e => set_error(name, e),
        });
        let consumer = match (attached, ctx) {
            (Ok(c), _) => Source::Channel(c),
            // The writer is dead: a VMM set that holders keep is read writerless (the imports
            // above came from a holder).
            (Err(Error::TensorSet(TensorSetError::WriterGone { pid, .. })), Some(ctx))
                if m.holders_generation != 0 =>
            {
                Source::Writerless(Writerless::open(ctx, name, &m, pid)?)
            }
            (Err(e), _) => return Err(e),
        };
        if let Source::Channel(c) = &consumer
            && c.control_generation() != (m.channel_generation, m.buffers)
        {
            return Err(TensorSetError::BadManifest {
                segment: seg_name,
                fault: ManifestFault::Mismatch {
                    what: "the generation channel",
                },
            }
            .into());
        }
        let serving = if opts.serve {
            Some(holders::Serving::start(name, &m, HolderRole::Reader)?)
        } else {
            None
        };
        let buffers = m.buffers;
        let holders_expect = (m.holders_generation != 0).then(|| {
            (
                m.holders_generation,
                m.buffers,
                m.layout.allocations().len(),
            )
        });
        let stable = Self::open_stable(ctx, opts, &memory, read_only)?;
        Ok(TensorSetReader {
            _serving: serving,
            stable,
            consumer,
            memory,
            buffers,
            holds: Mutex::new([0; MAX_SET_BUFFERS]),
            layout: Arc::new(m.layout),
            name: name.to_string(),
            read_only,
            imports,
            expect_content: opts.expect_content,
            generation_base: m.generation_base,
            incarnation: m.channel_generation,
            timings: OpenTimings {
                total: started.elapsed(),
                finish: mapped_at.elapsed(),
                ..timings
            },
            _manifest: opened.seg,
            holders_expect,
            fingerprinter: std::sync::OnceLock::new(),
            fork: ForkEpoch::now(),
        })
    }

    /// Buffers of the set (1 in place; B buffered): generations in flight.
    pub fn buffers(&self) -> usize {
        self.buffers
    }

    /// The set's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The layout (tensors, allocations, fingerprint).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The reader's stream (GPU sets): a held generation is ready on it; enqueue the work that
    /// reads it here (its release is written there after that work). Made at the first call
    /// (`cuStreamCreate`, with the registration of the generation channel's words and an event:
    /// about 0.3 ms), or at the first hold of a generation whose writer's stream had not
    /// finished it: an open makes none of them, so they never slow the mapping. Until it is
    /// made, a hold of a generation whose work is done (the host sees its ready word) waits on
    /// no stream, and releases are written from the host (no work of the reader's can be on a
    /// stream that does not exist; work on another stream orders itself first with
    /// [`Held::release_after`], which makes the stream).
    ///
    /// # Errors
    /// [`TensorSetError::WrongKind`] on a host set; CUDA errors where it is made;
    /// [`crate::Error::ForkedChild`] in a process forked from the one that opened the reader.
    pub fn stream(&self) -> Result<&Stream> {
        self.fork.check("tensor set reader")?;
        match &self.consumer {
            Source::Channel(c) if c.is_host() => {
                Err(TensorSetError::WrongKind("a host tensor set has no stream").into())
            }
            Source::Channel(c) => c.stream(),
            Source::Writerless(w) => Ok(w.stream()),
        }
    }

    /// Whether the reader's stream has been made ([`TensorSetReader::stream`] says when); a
    /// writerless reader's is made at its open; `false` for a host set.
    pub fn has_stream(&self) -> bool {
        match &self.consumer {
            Source::Channel(c) => c.has_stream(),
            Source::Writerless(_) => true,
        }
    }

    /// (address, bytes) of allocation `a` of buffer `buffer` as this process maps it: the host
    /// address of the buffer in the data segment (host sets, one allocation) or the device
    /// address of the import; `None` out of range. For registering the memory with a transport.
    #[cfg(feature = "remote")]
    pub(crate) fn allocation_span(&self, buffer: usize, a: usize) -> Option<(u64, u64)> {
        let len = *self.layout.allocations().get(a)?;
        match &self.memory {
            Memory::Host(d) => {
                (buffer < self.buffers && a == 0).then(|| (d.ptr(buffer) as u64, len))
            }
            Memory::Gpu(b) => Some((
                crate::driver::DeviceMemory::device_ptr(b.get(buffer)?.get(a)?),
                len,
            )),
        }
    }

    /// Whether this reader was opened after its writer's death: it reads the last whole
    /// generation (from memory a holder forwarded), on a stream of its own; no newer generation
    /// comes ([`TensorSetReader::wait_newer`] says [`TensorSetError::WriterGone`]; its `why`
    /// says the set was resumed, reopen it, once a new writer resumed the set on its memory).
    pub fn is_writerless(&self) -> bool {
        matches!(self.consumer, Source::Writerless(_))
    }

    /// Whether this reader's writer is alive, asked now (one look at its liveness lock and at
    /// the channel's closed word): `false` once it closed the set or its process died, and for a
    /// reader opened after its death ([`TensorSetReader::is_writerless`]). A writer made again
    /// under the name is another writer: this reader's stays gone (open the set again to read
    /// the new one's generations). [`TensorSetReader::current`] goes on returning the last
    /// generation published after the writer is gone (its memory stays mapped); this tells a
    /// reader that only polls `current` that no newer generation will come.
    pub fn writer_alive(&self) -> bool {
        match &self.consumer {
            Source::Channel(c) => c.producer_alive(),
            Source::Writerless(_) => false,
        }
    }

    /// The reader's context (GPU sets): the one it was opened in, where its mappings are.
    ///
    /// # Errors
    /// [`TensorSetError::WrongKind`] on a host set; [`crate::Error::ForkedChild`] in a process
    /// forked from the one that opened the reader.
    pub fn context(&self) -> Result<&Arc<Context>> {
        self.fork.check("tensor set reader")?;
        match &self.consumer {
            Source::Channel(c) if c.is_host() => {
                Err(TensorSetError::WrongKind("a host tensor set has no context").into())
            }
            Source::Channel(c) => c.context(),
            Source::Writerless(w) => Ok(w.stream().context()),
        }
    }

    /// Driver imports this open made (cache misses: 0 for allocations this process had imported
    /// already); B × A for a first open (A = 1 for writer-allocated sets).
    pub fn imports(&self) -> u32 {
        self.imports
    }

    /// Where this reader's open spent its time (see [`OpenTimings`] for what each phase covers).
    pub fn open_timings(&self) -> OpenTimings {
        self.timings
    }

    /// Whether every mapping is read-only on this device (VMM memory opened with
    /// [`ReaderOptions::read_only`]): a kernel of this process storing into the set then faults
    /// in this process's context only. `false` for host sets (plain shared memory, read through
    /// the guard's accessors), pool and legacy memory and read-write opens.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Which creation of the set under this name this reader maps: 64 random bits, nonzero,
    /// drawn when the writer created it (its generation channel's creation generation, which the
    /// manifest names). A writer that replaced a dead or closed one has another, and numbers its
    /// generations from 1 again: compare this, not the generation, to tell its generations from
    /// the old writer's (as the tensor-set bridges do before they resume).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The newest published generation, even one this reader took before; `None` when none was
    /// published yet (or the only one is being rewritten in place, or reserved by a waiting
    /// [`super::TensorSetWriter::begin`]: also for a reader that holds it already, whose guard
    /// that `begin` waits for). Does not wait. After the writer's death the last generation
    /// published is still returned (its memory stays mapped);
    /// [`TensorSetReader::writer_alive`] says whether a newer one can come.
    ///
    /// # Errors
    /// [`TensorSetError::WriterGone`] / [`TensorSetError::Closed`] when no generation is left
    /// and the writer died or closed; [`TensorSetError::ContentMismatch`] with
    /// [`ReaderOptions::expect_content`]; CUDA errors from the stream wait.
    pub fn current(&self) -> Result<Option<Held<'_>>> {
        self.take(0, Some(Duration::ZERO))
    }

    /// Waits up to `timeout` (`None`: no bound) for a generation newer than `than`, by the
    /// reader's wait strategy, and holds it. In place, while a `begin` waits, the generation is
    /// reserved and this waits for the commit, also in a reader that holds the generation
    /// already: a thread that asks while its own guard is held waits for a `begin` that waits
    /// for that guard (until the `begin`'s timeout, or this one's).
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`TensorSetError::WriterGone`] when the writer dies (within about 1 s
    /// of its death), [`TensorSetError::Closed`] when it closed;
    /// [`TensorSetError::BadManifest`] when the generation taken is no newer than `than` (the
    /// manifest's generation base does not match the generations' numbers: overwritten); as
    /// [`TensorSetReader::current`].
    pub fn wait_newer(&self, than: u64, timeout: Option<Duration>) -> Result<Held<'_>> {
        self.take(than, timeout)?.ok_or(Error::Timeout {
            what: "a newer tensor-set generation",
            after: timeout.unwrap_or_default(),
        })
    }

    fn take(&self, than: u64, timeout: Option<Duration>) -> Result<Option<Held<'_>>> {
        self.fork.check("tensor set reader")?;
        let consumer = match &self.consumer {
            Source::Channel(c) => c,
            Source::Writerless(w) => return self.take_writerless(w, than),
        };
        let got = consumer
            // A buffer this reader holds already: a take whose stream wait fails leaves that
            // hold alone (`Consumer::take_newer`); only a first hold is released by it.
            .take_newer(
                than.saturating_sub(self.generation_base),
                timeout,
                &self.holds,
                |holds, i| holds.get(i).is_some_and(|&n| n > 0),
            )
            .map_err(|e| set_error(&self.name, e))?;
        let Some((frame, mut holds)) = got else {
            return Ok(None);
        };
        let buffer = frame.index();
        let (generation, content) = decode_meta(frame.metadata(), frame.seq());
        let refused: Option<Error> = if generation <= than {
            // A writer numbers its generations from the manifest's base on, so a take newer than
            // `than - base` is newer than `than`: one that is not means the base in the
            // manifest (a word outside the layout fingerprint) does not match the generations'
            // own numbers. Never handed out as newer.
            Some(
                TensorSetError::BadManifest {
                    segment: format!("{}{}", segment::MANIFEST_PREFIX, self.name),
                    fault: ManifestFault::Field {
                        what: "the generation base",
                        found: self.generation_base,
                        allowed: "one that the generations' own numbers follow (it took a \
                                  generation no newer than the one asked to be passed)",
                    },
                }
                .into(),
            )
        } else if frame.written() == Some(false) && !self.recorded_whole(generation, buffer) {
            // The writer died and its stream may not have finished this generation: its bytes
            // may be partial. Never handed out as whole.
            Some(
                TensorSetError::WriterGone {
                    name: self.name.clone(),
                    pid: consumer.producer_pid(),
                    why: format!(
                        "it died before its stream was known to have finished generation \
                         {generation}, whose bytes may be partial; reopen the set to read its \
                         last whole generation"
                    ),
                }
                .into(),
            )
        } else {
            None
        };
        if let Some(e) = refused {
            // Let go as `take_newer` lets go of a take whose stream wait failed (a buffer another
            // guard holds keeps that hold).
            if holds[buffer] > 0 {
                std::mem::forget(frame);
            } else {
                drop(frame);
            }
            drop(holds);
            return Err(e);
        }
        holds[buffer] += 1;
        drop(holds);
        let held = Held {
            reader: self,
            frame: Some(ManuallyDrop::new(frame)),
            buffer,
            generation,
            content,
        };
        if let Some(expected) = self.expect_content
            && expected != content
        {
            return Err(TensorSetError::ContentMismatch {
                generation,
                expected,
                found: content,
            }
            .into());
        }
        Ok(Some(held))
    }
}

impl TensorSetReader {
    /// Whether the set's holders segment records `generation` in `buffer` as whole (its GPU work
    /// was known complete before the writer died: the recorder's event).
    fn recorded_whole(&self, generation: u64, buffer: usize) -> bool {
        let Some(expect) = self.holders_expect else {
            return false;
        };
        match holders::HoldersSegment::open(&self.name, Some(expect)) {
            Ok(h) => matches!(
                h.last_whole(),
                holders::Whole::Generation { generation: g, buffer: b, .. }
                    if g == generation && b == buffer
            ),
            Err(_) => false,
        }
    }

    /// A writerless reader's take: its generation when newer than `than`, else
    /// [`TensorSetError::WriterGone`] at once (no writer publishes again).
    fn take_writerless(&self, w: &Writerless, than: u64) -> Result<Option<Held<'_>>> {
        let Some((generation, buffer, content)) = w.newer_than(than) else {
            return Err(TensorSetError::WriterGone {
                name: self.name.clone(),
                pid: 0,
                why: if w.resumed() {
                    "a new writer resumed the set on the same memory: reopen it".into()
                } else {
                    format!(
                        "the reader opened after its death at generation {}, the last whole one",
                        w.generation()
                    )
                },
            }
            .into());
        };
        if let Some(expected) = self.expect_content
            && expected != content
        {
            return Err(TensorSetError::ContentMismatch {
                generation,
                expected,
                found: content,
            }
            .into());
        }
        // Recorded in its holder slot: a writer that resumes on the memory waits for it.
        w.hold(&self.name)?;
        Ok(Some(Held {
            reader: self,
            frame: None,
            buffer,
            generation,
            content,
        }))
    }
}
