//! The writer's side of the holders segment: its own slot (role writer, its export ids), the
//! writing marker stored when an update begins, and the record of the last whole generation,
//! stored by a recorder thread once an event recorded after a commit's work on the writer's stream
//! completes (the commit never waits for it).

use super::{HolderRole, HoldersSegment, SlotClaim};
use crate::driver::{Context, Event, Stream};
use crate::error::Result;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};

/// A committed generation whose GPU work an event tells.
struct Pending {
    event: Arc<Event>,
    generation: u64,
    buffer: usize,
    content: [u8; 32],
}

/// The last generation recorded whole, and its buffer. Locked around every `record_whole`.
#[derive(Default)]
struct Recorded {
    generation: u64,
    buffer: Option<usize>,
}

/// Records `p` whole when it is newer than what `rec` holds.
fn record(seg: &HoldersSegment, rec: &Mutex<Recorded>, p: &Pending) {
    let mut r = rec.lock().unwrap_or_else(PoisonError::into_inner);
    if p.generation > r.generation {
        seg.record_whole(p.generation, p.buffer, &p.content);
        r.generation = p.generation;
        r.buffer = Some(p.buffer);
    }
}

/// The writer's part of the holders segment. Dropping it lets go of the writer's slot; the
/// recorder thread ends after the event it waits for.
pub(crate) struct Recorder {
    // Drop order: the sender (the thread ends), then the slot, then the segment (the thread keeps
    // its own `Arc`).
    tx: Option<Sender<Pending>>,
    claim: Option<SlotClaim>,
    holders: Arc<HoldersSegment>,
    recorded: Arc<Mutex<Recorded>>,
    last: Option<Pending>,
    ctx: Arc<Context>,
}

impl Recorder {
    /// Claims the writer's slot in `holders` (serving `ids`, its own export ids, index b × A + a)
    /// and starts the recorder thread.
    ///
    /// # Errors
    /// As [`HoldersSegment::claim`]; [`crate::Error::Os`] when the thread cannot start.
    pub(crate) fn start(
        ctx: &Arc<Context>,
        holders: HoldersSegment,
        ids: &[u32],
    ) -> Result<Recorder> {
        let claim = holders.claim(HolderRole::Writer, ids)?;
        let holders = Arc::new(holders);
        let recorded = Arc::new(Mutex::new(Recorded::default()));
        let (tx, rx) = channel::<Pending>();
        let (seg, rec) = (holders.clone(), recorded.clone());
        let spawned = std::thread::Builder::new()
            .name("cuda-ipc-whole".into())
            .spawn(move || {
                // Context hygiene: `Event::synchronize` enters the event's context and pops it.
                while let Ok(p) = rx.recv() {
                    match p.event.synchronize() {
                        Ok(()) => record(&seg, &rec, &p),
                        Err(e) => tracing::warn!(
                            "generation {} not recorded whole in {}: {e}",
                            p.generation,
                            seg.name()
                        ),
                    }
                }
            });
        let mut r = Recorder {
            tx: None,
            claim: Some(claim),
            holders,
            recorded,
            last: None,
            ctx: ctx.clone(),
        };
        match spawned {
            Ok(_) => r.tx = Some(tx),
            Err(e) => {
                return Err(crate::error::OsError::io("spawn", "the recorder thread", e).into());
            }
        }
        Ok(r)
    }

    /// The holders segment.
    pub(crate) fn holders(&self) -> &HoldersSegment {
        &self.holders
    }

    /// Before an update writes `buffer` for `generation`: in a buffered set, when `buffer` holds
    /// the generation recorded whole and a newer one is committed but not yet recorded, waits for
    /// that one's GPU work and records it (so a whole generation stays); then stores the marker.
    pub(crate) fn before_write(&mut self, generation: u64, buffer: usize, buffered: bool) {
        if buffered && let Some(p) = &self.last {
            let stale = {
                let r = self.recorded.lock().unwrap_or_else(PoisonError::into_inner);
                r.buffer == Some(buffer) && r.generation < p.generation
            };
            if stale {
                match p.event.synchronize() {
                    Ok(()) => record(&self.holders, &self.recorded, p),
                    Err(e) => tracing::warn!("generation {} not recorded whole: {e}", p.generation),
                }
            }
        }
        self.holders.mark_writing(generation, buffer);
    }

    /// An event recorded now on the writer's `stream`, after the update's work (before the commit
    /// publishes); `None` (logged) when the driver refuses it.
    pub(crate) fn event_after(&self, stream: &Stream) -> Option<Arc<Event>> {
        let ev = Event::new(&self.ctx).and_then(|e| e.record(stream).map(|()| e));
        match ev {
            Ok(e) => Some(Arc::new(e)),
            Err(e) => {
                tracing::warn!("the whole-generation record stays behind: {e}");
                None
            }
        }
    }

    /// Generation `generation` in `buffer` with `content` was published; `event` completes with its
    /// GPU work. Handed to the recorder thread.
    pub(crate) fn committed(
        &mut self,
        event: Arc<Event>,
        generation: u64,
        buffer: usize,
        content: [u8; 32],
    ) {
        let p = Pending {
            event,
            generation,
            buffer,
            content,
        };
        if let Some(tx) = &self.tx {
            let _ = tx.send(Pending {
                event: p.event.clone(),
                ..p
            });
        }
        self.last = Some(p);
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(c) = self.claim.take() {
            self.holders.release(c);
        }
    }
}
