//! How a [`TensorSetReader`](super::TensorSetReader) open is timed ([`OpenTimings`]), how it
//! joins the set's generation channel on a thread of its own ([`EarlyJoin`]: started before the
//! manifest is read when the context is known; it then decodes the manifest's tensor tables) and
//! how it maps the set's memory ([`map_memory`]).

use super::super::ReaderOptions;
use super::super::error::{ManifestFault, TensorSetError};
use super::super::holders::FdSource;
use super::super::manifest::{Manifest, TensorTables, Verified};
use super::super::segment::{DataSegment, GENERATION_PREFIX, OpenedHead, OpenedManifest};
use super::Memory;
use crate::channel::{Consumer, ConsumerOptions, Delivery};
use crate::driver::{Context, DeviceMemory};
use crate::error::Error;
use crate::error::Result;
use crate::ipc::{Access, ImportedBuffer};
use crate::token::Token;
use std::sync::Arc;
use std::sync::mpsc::{SyncSender, sync_channel};
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
    /// checks), copying its body out and decoding and checking it (every range and code; for a
    /// GPU set the allocation table only, the tensor tables being decoded on the join thread:
    /// [`tables`](Self::tables)).
    pub manifest: Duration,
    /// Decoding the tensor tables (every tensor's name, dtype, shape, strides and span checked;
    /// the name index made): for a GPU set beside the mapping, on the join thread once it has
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
    /// opened, the producer's liveness checked, a reader slot claimed and the GPU objects made
    /// (`join_gpu`). A host set joins on the opening thread, after the mapping.
    pub join: Duration,
    /// The part of `join` that started the watchdog thread (which closes a dead writer's gate).
    /// The reader's stream (`cuStreamCreate`), the registration of the channel's GPU words
    /// (`cuMemHostRegister`) and the join event (`cuEventCreate`) are not made by the open but
    /// at their first need: [`TensorSetReader::stream`](super::TensorSetReader::stream), a
    /// `release_after`, or a hold of a generation whose writer's stream had not finished it.
    /// Zero for a host set.
    pub join_gpu: Duration,
    /// How long the opening thread waited for the join once its mapping was done (zero when the
    /// join finished first); a host set: the whole join.
    pub join_wait: Duration,
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
/// [`TensorSetError::BadManifest`](super::super::TensorSetError::BadManifest) for tables decoded
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
        let (tx, rx) = sync_channel::<(Vec<u8>, TensorTables)>(1);
        let started = std::thread::Builder::new()
            .name("cuda-ipc-tables".into())
            .spawn(move || match rx.recv() {
                Ok((body, t)) => decode_and_verify(&body, &t),
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

/// Decodes `tables` from `body` and checks the layout's fingerprint: more than [`VERIFY_APART`]
/// tensors split among threads, the fingerprint from the raw entries beside them.
fn decode_and_verify(body: &[u8], tables: &TensorTables) -> Decoded {
    tables.decode_verified(body, tables.len() > VERIFY_APART)
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

/// [`join_channel`] as a thread's body, owning what it needs (no tables to decode).
pub(super) fn spawnable_join(
    ctx: Option<&Arc<Context>>,
    name: &str,
    opts: &ReaderOptions,
) -> impl FnOnce() -> JoinedAndDecoded + Send + 'static {
    let (ctx, name, opts) = (ctx.cloned(), name.to_string(), *opts);
    move || (join_channel(ctx.as_ref(), &name, &opts), None)
}

/// A join started before the manifest was read ([`TensorSetReader::open`](super::TensorSetReader::open)),
/// or once its header named the device ([`TensorSetReader::open_auto`](super::TensorSetReader::open_auto)).
/// Once joined, the thread decodes the manifest's tensor tables if the opening thread sent them
/// ([`EarlyJoin::decode_after_join`]), so that the opening thread goes from the allocation table
/// straight to the mapping. Dropped untaken, it waits for the thread and drops its consumer (it
/// leaves the channel): nothing stays behind when the open fails or the set turns out to be a
/// host set.
pub(super) struct EarlyJoin {
    thread: Option<JoinHandle<JoinedAndDecoded>>,
    /// Where the tables go; dropped (the thread then decodes nothing) by `take` and on drop.
    tables: Option<SyncSender<(Vec<u8>, TensorTables)>>,
}

impl EarlyJoin {
    pub(super) fn start(ctx: &Arc<Context>, name: &str, opts: &ReaderOptions) -> EarlyJoin {
        Self::spawn(spawnable_join(Some(ctx), name, opts))
    }

    /// A thread that runs `join`, then decodes the tables it is sent, if any.
    fn spawn(join: impl FnOnce() -> JoinedAndDecoded + Send + 'static) -> EarlyJoin {
        let (tx, rx) = sync_channel::<(Vec<u8>, TensorTables)>(1);
        let thread = std::thread::Builder::new()
            .name("cuda-ipc-attach".into())
            .spawn(move || {
                let (joined, _) = join();
                // The sender is dropped without a message when the opening thread decodes the
                // tables itself (or fails first): `recv` then returns at once.
                let decoded = rx.recv().ok().map(|(body, t)| decode_and_verify(&body, &t));
                (joined, decoded)
            })
            .ok();
        EarlyJoin {
            tables: thread.as_ref().map(|_| tx),
            thread,
        }
    }

    /// Hands the manifest's `body` and its `tables` to the thread, to be decoded and checked
    /// after its join (`None`); gives them back when there is no thread to take them.
    pub(super) fn decode_after_join(
        &mut self,
        body: Vec<u8>,
        tables: TensorTables,
    ) -> Option<(Vec<u8>, TensorTables)> {
        match self.tables.take() {
            Some(tx) => tx.send((body, tables)).err().map(|e| e.0),
            None => Some((body, tables)),
        }
    }

    /// The thread, to be joined by the caller; no tables are sent to it after this.
    pub(super) fn take(&mut self) -> Option<JoinHandle<JoinedAndDecoded>> {
        self.tables = None;
        self.thread.take()
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

/// Maps the set's memory for [`TensorSetReader::open`](super::TensorSetReader::open): the host data segment, or every
/// allocation of every buffer imported once in `ctx` (each checked to hold at least the
/// allocation table's length), the fds of those not in the import cache fetched together
/// first (`ImportedBuffer::open_many`: one round trip per exporter). Returns the memory,
/// whether every mapping is read-only and the driver imports made (on this thread).
pub(super) fn map_memory(
    ctx: Option<&Arc<Context>>,
    name: &str,
    opts: &ReaderOptions,
    m: &Manifest,
    seg_name: &str,
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
                    source.fetch(asked)
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
    fn no_join() -> JoinedAndDecoded {
        let e = Err(Error::InvalidArgument("no join in this test".into()));
        ((e, Duration::ZERO, Duration::ZERO), None)
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

    /// The tables sent to the thread come back decoded and checked, as the opening thread would
    /// have decoded them; a thread sent nothing (taken, or dropped) returns without waiting.
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
        let mut early = EarlyJoin::spawn(no_join);
        assert!(early.decode_after_join(head.body, head.tables).is_none());
        let (joined, decoded) = early.take().unwrap().join().unwrap();
        assert!(joined.0.is_err());
        let (layout, _, _) = decoded.expect("the tables were decoded");
        let layout = layout.unwrap();
        assert_eq!(layout.tensors(), whole.manifest.layout.tensors());
        assert_eq!(layout.fingerprint(), whole.manifest.layout.fingerprint());
        assert_eq!(layout.index_of("layers.299.weight"), Some(299));

        // Taken before any tables: the thread decodes nothing and ends.
        let mut early = EarlyJoin::spawn(no_join);
        let (_, decoded) = early.take().unwrap().join().unwrap();
        assert!(decoded.is_none());
        // Dropped untaken (an open that failed first): the drop returns, the thread is joined.
        drop(EarlyJoin::spawn(no_join));
        // Tables offered after the take are given back.
        let head = open_manifest_head(&name, INIT_WAIT).unwrap();
        assert!(early.decode_after_join(head.body, head.tables).is_some());
        drop(w);
    }

    /// Tables whose stored fingerprint is not theirs are refused by the thread's check.
    #[test]
    fn the_join_thread_refuses_tables_whose_fingerprint_is_not_theirs() {
        let (name, w) = host_set("fingerprint");
        let head = open_manifest_head(&name, INIT_WAIT).unwrap();
        let mut body = head.body;
        // A byte of a name in the string area, the last bytes of the body: the tables still
        // decode (a valid UTF-8 name, unique), but they no longer match the fingerprint.
        let last = body.iter().rposition(|&b| b == b'w').unwrap();
        body[last] = b'W';
        let mut early = EarlyJoin::spawn(no_join);
        assert!(early.decode_after_join(body, head.tables).is_none());
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
            let mut early = EarlyJoin::spawn(no_join);
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
        let mut early = EarlyJoin::spawn(no_join);
        drop(early.take());
        let head = open_manifest_head(&small, INIT_WAIT).unwrap();
        let (opened, pending) = hand_off_tables(head, &mut early).unwrap();
        assert!(matches!(pending, PendingTables::Decoded));
        assert_eq!(opened.manifest.layout.len(), 300);
        drop((ws, wl));
    }
}
