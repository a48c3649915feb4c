//! How a [`TensorSetReader`](super::TensorSetReader) open is timed ([`OpenTimings`]) and how it
//! joins the set's generation channel on a thread of its own ([`EarlyJoin`]: started before the
//! manifest is read when the context is known).

use super::super::ReaderOptions;
use super::super::segment::GENERATION_PREFIX;
use crate::channel::{Consumer, ConsumerOptions, Delivery};
use crate::driver::Context;
use crate::error::Result;
use std::sync::Arc;
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
    /// Opening the manifest segment (`shm_open`, `mmap`, the header's checks), copying its
    /// body out, decoding and checking it (every range, code, tensor span and name).
    pub manifest: Duration,
    /// Recomputing the layout fingerprint (SHA-256 over the tensor table's canonical encoding)
    /// and comparing it with the manifest's: on the opening thread before the mapping for small
    /// sets and host sets, on a thread of its own beside the mapping and the join for a GPU set
    /// of more than [`VERIFY_APART`] tensors (nothing is returned before it passed).
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
    /// Of `map`: this process's identity (made on the first open of a process: its `/proc`
    /// entries read, its liveness file created and locked).
    pub map_identity: Duration,
    /// The generation channel's join, as long as it ran on its own thread: its control segment
    /// opened, the producer's liveness checked, a reader slot claimed and the GPU objects made
    /// (`join_gpu`). A host set joins on the opening thread, after the mapping.
    pub join: Duration,
    /// The part of `join` that made GPU objects: the reader's stream (`cuStreamCreate`), the
    /// registration of the channel's GPU words (`cuMemHostRegister`), the join event
    /// (`cuEventCreate`) and the watchdog thread. Zero for a host set.
    pub join_gpu: Duration,
    /// How long the opening thread waited for the join once its mapping was done (zero when the
    /// join finished first); a host set: the whole join.
    pub join_wait: Duration,
    /// The whole open, from the call to the reader returned (for [`TensorSetReader::open_auto`](super::TensorSetReader::open_auto)
    /// including the look-up of the device and its primary context).
    pub total: Duration,
}

/// Tensors above which a GPU set's layout fingerprint is recomputed on a thread of its own while
/// the memory is mapped (below, the hash costs less than starting a thread).
pub const VERIFY_APART: usize = 1024;

/// A generation channel's join as the opening threads time it: (the consumer, its time, the
/// part that made GPU objects).
type Joined = (Result<Consumer>, Duration, Duration);

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

/// [`join_channel`] as a thread's body, owning what it needs.
pub(super) fn spawnable_join(
    ctx: Option<&Arc<Context>>,
    name: &str,
    opts: &ReaderOptions,
) -> impl FnOnce() -> Joined + Send + 'static {
    let (ctx, name, opts) = (ctx.cloned(), name.to_string(), *opts);
    move || join_channel(ctx.as_ref(), &name, &opts)
}

/// A join started before the manifest was read ([`TensorSetReader::open`](super::TensorSetReader::open)); dropped untaken, it
/// waits for the thread and drops its consumer (it leaves the channel): nothing stays behind
/// when the open fails or the set turns out to be a host set.
pub(super) struct EarlyJoin(Option<JoinHandle<Joined>>);

impl EarlyJoin {
    pub(super) fn start(ctx: &Arc<Context>, name: &str, opts: &ReaderOptions) -> EarlyJoin {
        EarlyJoin(
            std::thread::Builder::new()
                .name("cuda-ipc-attach".into())
                .spawn(spawnable_join(Some(ctx), name, opts))
                .ok(),
        )
    }

    pub(super) fn take(&mut self) -> Option<JoinHandle<Joined>> {
        self.0.take()
    }
}

impl Drop for EarlyJoin {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.join();
        }
    }
}
