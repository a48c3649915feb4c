//! How a [`TensorSetReader`](super::TensorSetReader) open is timed ([`OpenTimings`]), how it
//! joins the set's generation channel on a thread of its own ([`EarlyJoin`]: started before the
//! manifest is read when the context is known; it then decodes the manifest's tensor tables) and
//! how it maps the set's memory ([`map_memory`]).

use super::super::ReaderOptions;
use super::super::error::{ManifestFault, TensorSetError};
use super::super::holders::FdSource;
use super::super::manifest::{Manifest, TensorTables, Verified};
use super::super::segment::{
    DataSegment, GENERATION_PREFIX, ManifestBody, OpenedHead, OpenedManifest,
};
use super::Memory;
use crate::channel::{Consumer, ConsumerOptions, Delivery};
use crate::driver::{Context, DeviceMemory};
use crate::error::Error;
use crate::error::Result;
use crate::ipc::{Access, ImportedBuffer};
use crate::token::Token;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Where one [`TensorSetReader`](super::TensorSetReader) open spent its time (wall clock, measured by
/// [`TensorSetReader::open`](super::TensorSetReader::open), [`TensorSetReader::open_auto`](super::TensorSetReader::open_auto) and
/// [`TensorSetReader::open_host`](super::TensorSetReader::open_host); [`TensorSetReader::open_timings`](super::TensorSetReader::open_timings) returns it). For a GPU set
/// the mapping (`fd_fetch` + `map`, on the opening thread) and the channel's `join` (on a second
/// thread) overlap: `total` is about `manifest` + the longer of the two.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct OpenTimings {
    /// On the opening thread: opening the manifest segment (`shm_open`, `mmap`, the header's
    /// checks), copying its head out (the body header and the allocation table) and decoding and
    /// checking it (every range and code); for a host set also the tensor tables
    /// ([`tables`](Self::tables)), which a GPU set copies and decodes on the join thread.
    pub manifest: Duration,
    /// Copying the tensor tables out of the manifest segment and decoding them (every tensor's
    /// name, dtype, shape, strides and span checked; the name index made): for a GPU set beside the mapping, on the join thread once it has
    /// joined (more than [`VERIFY_APART`] tensors: on a thread of their own, which splits them
    /// among up to four threads where the process may use four CPUs or more); for a host set (or
    /// where no thread could be started) on the opening thread, where it is part of
    /// [`manifest`](Self::manifest).
    pub tables: Duration,
    /// Recomputing the layout fingerprint (SHA-256 over the tensor table's canonical encoding)
    /// and comparing it with the manifest's (nothing is returned before it passed): on the
    /// thread that decoded the tables, after them (on the opening thread before the mapping,
    /// where that thread decoded them); for more than [`VERIFY_APART`] tensors on four CPUs or
    /// more, from the tables' raw entries on a thread of its own, beside their decode.
    pub fingerprint: Duration,
    /// Fetching the file descriptors of the allocations that were not in the import cache from
    /// their exporters (one socket round trip per exporter, with its peer checks); zero for a
    /// host set and for allocations this process had imported already.
    pub fd_fetch: Duration,
    /// Of `fd_fetch`: the exporter's liveness (its `/proc` entry or liveness file), asked before
    /// connecting by the `pidfd_getfd` transports; the socket, the default, asks it after the
    /// request is sent only where the listener's uid is neither this process's nor root's, and
    /// otherwise only when the exchange fails or stalls.
    pub fd_peer: Duration,
    /// Of `fd_fetch`: the socket path's `lstat`, the connection and the listener's checks
    /// (`SO_PEERCRED`).
    pub fd_connect: Duration,
    /// Of `fd_fetch`: the request sent and the fds received (the exporter's server thread wakes,
    /// checks this client and answers), less the join thread's start made meanwhile
    /// ([`spawn`](Self::spawn)).
    pub fd_reply: Duration,
    /// The rest of the mapping: the import cache's look-ups and, per allocation not in it,
    /// `cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap` and `cuMemSetAccess`
    /// (pool and legacy memory: their own import calls); a host set: its data segment's open.
    pub map: Duration,
    /// Of `map`: the driver's `cuMemImportFromShareableHandle` calls.
    pub map_import: Duration,
    /// Of `map`: `cuMemAddressReserve`.
    pub map_reserve: Duration,
    /// Of `map`: `cuMemMap`.
    pub map_map: Duration,
    /// Of `map`: `cuMemSetAccess` (read-only or read-write).
    pub map_set_access: Duration,
    /// Of `map`: closing the imported descriptors.
    pub map_fd_close: Duration,
    /// Of `map`: this process's identity, where a token's exporter has this process's pid (made
    /// on a process's first use: its `/proc` entries read, its liveness file created and locked);
    /// near zero otherwise.
    pub map_identity: Duration,
    /// The generation channel's join, as long as it ran on its own thread: its control segment
    /// opened, the producer's liveness checked and a reader slot claimed. A host set joins on
    /// the opening thread, after the mapping.
    pub join: Duration,
    /// The part of `join` that made GPU objects: none since the watchdog thread (which closes a
    /// dead writer's gate) starts with them. The reader's stream (`cuStreamCreate`), the
    /// registration of the channel's GPU words (`cuMemHostRegister`), the join event
    /// (`cuEventCreate`) and the watchdog are not made by the open but at their first need:
    /// [`TensorSetReader::stream`](super::TensorSetReader::stream), a `release_after`, or a hold
    /// of a generation whose writer's stream had not finished it (a writer that died before
    /// then has its gate closed by that hold, which then reads as cut short). Waits on the host
    /// look at the writer's liveness themselves. Zero for a host set.
    pub join_gpu: Duration,
    /// How long the opening thread waited for the join once its mapping was done (zero when the
    /// join finished first); a host set: the whole join.
    pub join_wait: Duration,
    /// On the opening thread: starting the join thread (for a GPU set, while the writer answers
    /// the fd fetch, so part of `fd_fetch`; zero where none started).
    pub spawn: Duration,
    /// On the opening thread, after the mapping: the wait for the join thread (`join_wait`),
    /// the results put together, the checks of the generation channel against the manifest and
    /// the reader made.
    pub finish: Duration,
    /// The whole open, from the call to the reader returned (for [`TensorSetReader::open_auto`](super::TensorSetReader::open_auto)
    /// including the look-up of the device and its primary context).
    pub total: Duration,
}

/// Tensors above which a GPU set's tensor tables are decoded and its layout fingerprint
/// recomputed on a thread of their own, beside the mapping and the join (their decode then takes
/// longer than the join; below, the join thread does both once joined, which costs no thread's
/// start).
pub const VERIFY_APART: usize = 1024;

/// Where a GPU open's tensor tables are being decoded ([`hand_off_tables`]).
pub(super) enum PendingTables {
    /// Nowhere: decoded already, on the opening thread.
    Decoded,
    /// By the join thread, once joined.
    OnJoin,
    /// By a thread of their own (more than [`VERIFY_APART`] tensors).
    Apart(JoinHandle<Decoded>),
}

/// Gives the tensor tables of `head` to another thread while the opening thread maps: a thread of
/// their own for more than [`VERIFY_APART`] tensors, else `early`'s join thread; decodes them here
/// where no thread takes them. Returns the manifest (its layout provisional unless
/// [`PendingTables::Decoded`]) and where the tables are.
///
/// # Errors
/// [`TensorSetError::BadManifest`] for tables decoded
/// here that do not decode.
pub(super) fn hand_off_tables(
    head: OpenedHead,
    early: &mut EarlyJoin,
) -> Result<(OpenedManifest, PendingTables)> {
    let OpenedHead {
        opened,
        body,
        tables,
    } = head;
    let mut left = Some((body, tables));
    let mut pending = PendingTables::Decoded;
    if left.as_ref().is_some_and(|(_, t)| t.len() > VERIFY_APART) {
        // Sent once the thread runs, so that a failed start gives them back here.
        let (tx, rx) = sync_channel::<Tables>(1);
        let started = std::thread::Builder::new()
            .name("cuda-ipc-tables".into())
            .spawn(move || match rx.recv() {
                Ok((body, t)) => decode_and_verify(body, &t),
                // Nothing sent: the handle was not kept and this is never read.
                Err(_) => (
                    Err(ManifestFault::Fingerprint),
                    Duration::ZERO,
                    Duration::ZERO,
                ),
            });
        if let Ok(h) = started
            && let Some(sent) = left.take()
        {
            match tx.send(sent) {
                Ok(()) => pending = PendingTables::Apart(h),
                Err(e) => left = Some(e.0),
            }
        }
    }
    if let Some((body, tables)) = left.take() {
        match early.decode_after_join(body, tables) {
            None => pending = PendingTables::OnJoin,
            Some(back) => left = Some(back),
        }
    }
    match left {
        Some((body, tables)) => Ok((
            OpenedHead {
                opened,
                body,
                tables,
            }
            .decoded()?,
            PendingTables::Decoded,
        )),
        None => Ok((opened, pending)),
    }
}

/// A generation channel's join as the opening threads time it: (the consumer, its time, the
/// part that made GPU objects).
pub(super) type Joined = (Result<Consumer>, Duration, Duration);

/// The tensor tables decoded and the fingerprint checked on a join thread ([`EarlyJoin`]): (the
/// layout, or the manifest's fault; the decode's time; the check's time).
pub(super) type Decoded = Verified;

/// What a join thread returns: its join, and the tables it was given to decode, if any.
pub(super) type JoinedAndDecoded = (Joined, Option<Decoded>);

/// Copies `body` out of its segment (if it is still there), decodes `tables` from it and checks
/// the layout's fingerprint: more than [`VERIFY_APART`] tensors split among threads, the
/// fingerprint from the raw entries beside them. The copy's time counts as the decode's.
pub(super) fn decode_and_verify(body: ManifestBody, tables: &TensorTables) -> Decoded {
    let t = Instant::now();
    let bytes = body.copied();
    let copy = t.elapsed();
    let (layout, took, verify) = tables.decode_verified(&bytes, tables.len() > VERIFY_APART);
    (layout, took + copy, verify)
}

/// Joins tensor set `name`'s generation channel as a latest-only reader (in `ctx`: a GPU set).
pub(super) fn join_channel(ctx: Option<&Arc<Context>>, name: &str, opts: &ReaderOptions) -> Joined {
    let copts = ConsumerOptions::new()
        .delivery(Delivery::LatestOnly)
        .wait(opts.wait);
    let t = Instant::now();
    let mut gpu = Duration::ZERO;
    let r = Consumer::attach_memoryless(ctx, GENERATION_PREFIX, name, &copts, &mut gpu);
    (r, t.elapsed(), gpu)
}

/// The tensor tables handed to the join thread, with the manifest body they lie in.
type Tables = (ManifestBody, TensorTables);

/// The generation channel's join on a thread of its own, made before the manifest is read
/// ([`TensorSetReader::open`](super::TensorSetReader::open)) or once its header named the device
/// ([`TensorSetReader::open_auto`](super::TensorSetReader::open_auto)), and started at
/// [`EarlyJoin::start`]: while the writer answers the fd fetch, where the opening thread waits
/// anyway (a fresh process's first thread start costs it tens of µs), or at [`EarlyJoin::take`]
/// where nothing was fetched. Once joined, the thread decodes the manifest's tensor tables if the
/// opening thread sent them ([`EarlyJoin::decode_after_join`]; they wait in a channel of one
/// meanwhile), so that the opening thread goes from the allocation table straight to the
/// mapping. Dropped untaken, it waits for the thread and drops its consumer (it leaves the
/// channel): nothing stays behind when the open fails or the set turns out to be a host set.
pub(super) struct EarlyJoin {
    /// How long the thread's start took the opening thread.
    pub(super) spawn: Duration,
    /// The join, until the thread's start takes it.
    join: Option<Box<dyn FnOnce() -> Joined + Send + 'static>>,
    /// The tables' receiving end: the thread's once started; read back here by
    /// [`EarlyJoin::take_back`] where no thread could start.
    rx: Arc<Mutex<Receiver<Tables>>>,
    /// The sending end, until the tables are sent or the thread is taken.
    tables: Option<SyncSender<Tables>>,
    thread: Option<JoinHandle<JoinedAndDecoded>>,
}

impl EarlyJoin {
    /// The join of set `name`'s generation channel in `ctx`, not started.
    pub(super) fn new(ctx: &Arc<Context>, name: &str, opts: &ReaderOptions) -> EarlyJoin {
        let (ctx, name, opts) = (ctx.clone(), name.to_string(), *opts);
        Self::with(move || join_channel(Some(&ctx), &name, &opts))
    }

    /// The thread that will run `join`, not started.
    fn with(join: impl FnOnce() -> Joined + Send + 'static) -> EarlyJoin {
        let (tx, rx) = sync_channel::<Tables>(1);
        EarlyJoin {
            spawn: Duration::ZERO,
            join: Some(Box::new(join)),
            rx: Arc::new(Mutex::new(rx)),
            tables: Some(tx),
            thread: None,
        }
    }

    /// Starts the thread, once (a failed start is not tried again: the join then runs where
    /// [`EarlyJoin::take`] is called, on the opening thread).
    pub(super) fn start(&mut self) {
        let Some(join) = self.join.take() else {
            return;
        };
        let t = Instant::now();
        let rx = self.rx.clone();
        let started = std::thread::Builder::new()
            .name("cuda-ipc-attach".into())
            .spawn(move || {
                let joined = join();
                // The sender is dropped without a message when the opening thread decodes the
                // tables itself (or fails first): `recv` then returns at once.
                let tables = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                (
                    joined,
                    tables.ok().map(|(body, t)| decode_and_verify(body, &t)),
                )
            });
        self.spawn += t.elapsed();
        match started {
            Ok(h) => self.thread = Some(h),
            // The tables (if sent) wait in the channel for `take_back`; none are sent from now.
            Err(_) => self.tables = None,
        }
    }

    /// Hands `tables` to the thread, which decodes them once joined; gives them back where no
    /// thread runs or will (its start failed).
    pub(super) fn decode_after_join(
        &mut self,
        body: ManifestBody,
        tables: TensorTables,
    ) -> Option<Tables> {
        // Once: the channel holds one message (a second send would wait for a thread that may
        // not run yet); what was sent stays receivable after the sender drops.
        match self.tables.take() {
            Some(tx) => tx.send((body, tables)).err().map(|e| e.0),
            None => Some((body, tables)),
        }
    }

    /// The thread, started now if it was not; `None` where it could not start (the caller joins
    /// on its own thread and takes the tables back: [`EarlyJoin::take_back`]). No tables are
    /// sent after this.
    pub(super) fn take(&mut self) -> Option<JoinHandle<JoinedAndDecoded>> {
        self.start();
        self.tables = None;
        self.thread.take()
    }

    /// Tables sent to a thread that never started.
    pub(super) fn take_back(&self) -> Option<Tables> {
        self.rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .try_recv()
            .ok()
    }
}

impl Drop for EarlyJoin {
    fn drop(&mut self) {
        // The sender first: a thread waiting for tables that will not come returns.
        self.tables = None;
        if let Some(h) = self.thread.take() {
            let _ = h.join();
        }
    }
}

/// Maps set `name`'s memory (manifest `m`): its data segment (host sets) or every allocation,
/// imported through the import cache with its fds fetched from the writer or a holder.
/// `waiting` runs while the writer answers the fd fetch ([`FdSource::fetch`]); not at all
/// where nothing is fetched.
pub(super) fn map_memory(
    ctx: Option<&Arc<Context>>,
    name: &str,
    opts: &ReaderOptions,
    m: &Manifest,
    seg_name: &str,
    waiting: &mut dyn FnMut(),
) -> Result<(Memory, bool, u32)> {
    Ok(match ctx {
        None => (Memory::Host(DataSegment::open(name, m)?), false, 0),
        Some(ctx) => {
            let access = if opts.read_only {
                Access::ReadOnly
            } else {
                Access::ReadWrite
            };
            let tokens = m
                .tokens
                .iter()
                .flatten()
                .map(|t| Token::from_bytes(t))
                .collect::<Result<Vec<_>>>()?;
            // The writer's exports, or a holder's once the writer is gone.
            let mut source = FdSource::new(name, m);
            let mut imported =
                ImportedBuffer::open_many(ctx, &tokens, access, &mut |asked: &[&Token]| {
                    source.fetch(asked, waiting)
                })?
                .into_iter();
            let mut ro = opts.read_only;
            let mut count = 0u32;
            let mut all = Vec::with_capacity(m.buffers);
            for toks in &m.tokens {
                let mut row = Vec::with_capacity(toks.len());
                for a in 0..toks.len() {
                    // One import per token, in the order of the flattened table.
                    let got = imported.next().ok_or_else(|| {
                        Error::InvalidArgument("fewer imports than allocations".into())
                    })?;
                    let need = m.layout.allocations()[a];
                    if (got.buffer.len() as u64) < need {
                        return Err(TensorSetError::BadManifest {
                            segment: seg_name.to_string(),
                            fault: ManifestFault::Field {
                                what: "an imported allocation's length",
                                found: got.buffer.len() as u64,
                                allowed: "at least the allocation table's length",
                            },
                        }
                        .into());
                    }
                    ro &= got.read_only;
                    count += got.driver_imports;
                    row.push(got.buffer);
                }
                all.push(row);
            }
            (Memory::Gpu(all), ro, count)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::super::super::segment::{INIT_WAIT, open_manifest_head};
    use super::super::super::{DType, TensorSetOptions, TensorSetWriter, TensorSpec};
    use super::*;
    use crate::error::Error;

    /// A join that fails at once (no channel is needed to test the decode's hand-off).
    fn no_join() -> Joined {
        let e = Err(Error::InvalidArgument("no join in this test".into()));
        (e, Duration::ZERO, Duration::ZERO)
    }

    fn host_set(tag: &str) -> (String, TensorSetWriter) {
        host_set_of(tag, 300)
    }

    fn host_set_of(tag: &str, tensors: usize) -> (String, TensorSetWriter) {
        let name = format!("early-join-{tag}-{}", std::process::id());
        let specs: Vec<TensorSpec> = (0..tensors)
            .map(|i| TensorSpec::new(format!("layers.{i}.weight"), DType::BF16, &[4, 8]))
            .collect();
        let w = TensorSetWriter::create_host(&name, &specs, &TensorSetOptions::new()).unwrap();
        (name, w)
    }

    /// The tables sent to the thread (before its start: they wait in the channel) come back
    /// decoded and checked, as the opening thread would have decoded them; a thread sent nothing
    /// (taken, or dropped) returns without waiting; one never started leaves its tables to be
    /// taken back.
    #[test]
    fn the_join_thread_decodes_the_tables_it_is_sent_and_ends_when_sent_none() {
        let (name, w) = host_set("decode");
        let head = open_manifest_head(&name, INIT_WAIT).unwrap();
        assert!(
            head.opened.manifest.layout.is_empty(),
            "the head's layout is provisional"
        );
        let whole = open_manifest_head(&name, INIT_WAIT)
            .unwrap()
            .decoded()
            .unwrap();
        let mut early = EarlyJoin::with(no_join);
        assert!(early.decode_after_join(head.body, head.tables).is_none());
        let (joined, decoded) = early.take().unwrap().join().unwrap();
        assert!(joined.0.is_err());
        let (layout, _, _) = decoded.expect("the tables were decoded");
        let layout = layout.unwrap();
        assert_eq!(layout.tensors(), whole.manifest.layout.tensors());
        assert_eq!(layout.fingerprint(), whole.manifest.layout.fingerprint());
        assert_eq!(layout.index_of("layers.299.weight"), Some(299));

        // Taken before any tables: the thread decodes nothing and ends.
        let mut early = EarlyJoin::with(no_join);
        let (_, decoded) = early.take().unwrap().join().unwrap();
        assert!(decoded.is_none());
        // Dropped untaken (an open that failed first): the drop returns, the thread is joined.
        drop(EarlyJoin::with(no_join));
        // Tables offered after the take are given back.
        let head = open_manifest_head(&name, INIT_WAIT).unwrap();
        assert!(early.decode_after_join(head.body, head.tables).is_some());
        // Started by `start` (as the fd fetch's wait does), then taken: the same thread.
        let mut early = EarlyJoin::with(no_join);
        early.start();
        assert!(early.thread.is_some());
        let head = open_manifest_head(&name, INIT_WAIT).unwrap();
        assert!(early.decode_after_join(head.body, head.tables).is_none());
        let (_, decoded) = early.take().unwrap().join().unwrap();
        assert!(decoded.is_some_and(|(l, _, _)| l.is_ok()));
        // Never started (its start failed: here, the join taken out by hand): the tables sent
        // wait in the channel and are taken back.
        let mut early = EarlyJoin::with(no_join);
        let head = open_manifest_head(&name, INIT_WAIT).unwrap();
        assert!(early.decode_after_join(head.body, head.tables).is_none());
        early.join = None;
        assert!(early.take().is_none());
        let (body, tables) = early.take_back().expect("the tables sent");
        assert!(tables.decode(&body.copied()).is_ok());
        drop(w);
    }

    /// Tables whose stored fingerprint is not theirs are refused by the thread's check.
    #[test]
    fn the_join_thread_refuses_tables_whose_fingerprint_is_not_theirs() {
        let (name, w) = host_set("fingerprint");
        let head = open_manifest_head(&name, INIT_WAIT).unwrap();
        let mut body = head.body.copied();
        // A byte of a name in the string area, the last bytes of the body: the tables still
        // decode (a valid UTF-8 name, unique), but they no longer match the fingerprint.
        let last = body.iter().rposition(|&b| b == b'w').unwrap();
        body[last] = b'W';
        let mut early = EarlyJoin::with(no_join);
        assert!(
            early
                .decode_after_join(ManifestBody::Copied(body), head.tables)
                .is_none()
        );
        let (_, decoded) = early.take().unwrap().join().unwrap();
        let (layout, _, _) = decoded.unwrap();
        assert!(
            matches!(layout, Err(ManifestFault::Fingerprint)),
            "{layout:?}"
        );
        drop(w);
    }

    /// Tables go to a thread of their own above `VERIFY_APART` tensors, to the join thread below
    /// it, and are decoded on the opening thread where no thread takes them; each way gives the
    /// layout the whole decode gives.
    #[test]
    fn the_tables_are_handed_off_by_their_size_and_decoded_here_without_a_thread() {
        let (small, ws) = host_set_of("handoff-small", 300);
        let (large, wl) = host_set_of("handoff-large", VERIFY_APART + 1);
        let layout_of = |pending: PendingTables, joined: Option<Decoded>| match pending {
            PendingTables::Decoded => None,
            PendingTables::OnJoin => Some(joined.unwrap().0.unwrap()),
            PendingTables::Apart(h) => Some(h.join().unwrap().0.unwrap()),
        };
        for (name, want_apart) in [(&small, false), (&large, true)] {
            let whole = open_manifest_head(name, INIT_WAIT)
                .unwrap()
                .decoded()
                .unwrap();
            let head = open_manifest_head(name, INIT_WAIT).unwrap();
            let mut early = EarlyJoin::with(no_join);
            let (opened, pending) = hand_off_tables(head, &mut early).unwrap();
            assert!(
                opened.manifest.layout.is_empty(),
                "provisional while pending"
            );
            assert_eq!(matches!(pending, PendingTables::Apart(_)), want_apart);
            assert_eq!(matches!(pending, PendingTables::OnJoin), !want_apart);
            let (_, joined) = early.take().unwrap().join().unwrap();
            let layout = layout_of(pending, joined).unwrap();
            assert_eq!(layout.tensors(), whole.manifest.layout.tensors());
        }
        // No join thread to take a small set's tables: decoded here, the layout whole.
        let mut early = EarlyJoin::with(no_join);
        drop(early.take());
        let head = open_manifest_head(&small, INIT_WAIT).unwrap();
        let (opened, pending) = hand_off_tables(head, &mut early).unwrap();
        assert!(matches!(pending, PendingTables::Decoded));
        assert_eq!(opened.manifest.layout.len(), 300);
        drop((ws, wl));
    }
}
