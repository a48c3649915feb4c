//! A reader opened after its writer's death ([`crate::tensorset::TensorSetReader::open`] when the
//! generation channel's producer is dead): it reads the last whole generation the holders segment
//! records, on a stream of its own; nothing writes the memory while the writer is dead, so there
//! are no ready or release words, and no newer generation will come from that writer.
//!
//! It claims a slot of role [`super::HolderRole::WriterlessReader`] in the holders segment, whose
//! reading word names the buffer while one of its guards holds it: a writer that resumes on the
//! memory (`resume.rs`) does not write that buffer meanwhile. Once a live writer has a slot, the
//! reader takes no generation ([`TensorSetError::WriterGone`] saying the set was resumed: reopen).

use super::{HoldersSegment, SlotClaim, Whole};
use crate::driver::{Context, Stream};
use crate::error::Result;
use crate::tensorset::error::TensorSetError;
use crate::tensorset::manifest::Manifest;
use std::sync::{Arc, Mutex, PoisonError};

/// The writerless mode of a reader: the generation it serves and its own stream.
pub(crate) struct Writerless {
    stream: Stream,
    generation: u64,
    buffer: usize,
    content: [u8; 32],
    // Drop order: the slot is let go (Drop) before the segment's mapping.
    claim: Option<SlotClaim>,
    /// Guards that hold the buffer now; the reading word is stored while this is not zero.
    holds: Mutex<u32>,
    holders: HoldersSegment,
}

impl std::fmt::Debug for Writerless {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writerless")
            .field("generation", &self.generation)
            .field("buffer", &self.buffer)
            .finish_non_exhaustive()
    }
}

impl Writerless {
    /// The writerless mode of set `set` (manifest `m`) whose writer, pid `pid`, is dead: the last
    /// whole generation, a stream in `ctx`.
    ///
    /// # Errors
    /// [`TensorSetError::WriterGone`] saying why when the set has no holders segment or no whole
    /// generation; as the holders segment's open; CUDA errors from the stream.
    pub(crate) fn open(
        ctx: &Arc<Context>,
        set: &str,
        m: &Manifest,
        pid: u32,
    ) -> Result<Writerless> {
        let (holders, generation, buffer, content) = Self::whole(set, m, pid)?;
        let stream = Stream::new(ctx)?;
        let claim = holders.claim_reading()?;
        Ok(Writerless {
            stream,
            generation,
            buffer,
            content,
            claim: Some(claim),
            holds: Mutex::new(0),
            holders,
        })
    }

    /// What [`Writerless::open`] reads before it makes a stream (no CUDA call): the holders
    /// segment `m` names and its last whole generation (generation, buffer, content).
    ///
    /// # Errors
    /// As [`Writerless::open`], less the stream's.
    pub(crate) fn whole(
        set: &str,
        m: &Manifest,
        pid: u32,
    ) -> Result<(HoldersSegment, u64, usize, [u8; 32])> {
        let gone = |why: &str| -> crate::Error {
            TensorSetError::WriterGone {
                name: set.to_string(),
                pid,
                why: why.to_string(),
            }
            .into()
        };
        if m.holders_generation == 0 {
            return Err(gone("the set has no holders segment (not a VMM set)"));
        }
        let holders = HoldersSegment::open(
            set,
            Some((
                m.holders_generation,
                m.buffers,
                m.layout.allocations().len(),
            )),
        )?;
        match holders.last_whole() {
            Whole::Generation {
                generation,
                buffer,
                content,
            } => Ok((holders, generation, buffer, content)),
            Whole::None(why) => Err(gone(&format!("no whole generation is left: {why}"))),
        }
    }

    /// The reader's own stream.
    pub(crate) fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Whether a writer has resumed the set since this reader opened (a live writer has a slot
    /// in the holders segment): no generation is ever newer for this reader; it should reopen.
    pub(crate) fn resumed(&self) -> bool {
        self.holders.has_live_writer()
    }

    /// (generation, buffer, content) when the generation is newer than `than`.
    pub(crate) fn newer_than(&self, than: u64) -> Option<(u64, usize, [u8; 32])> {
        (self.generation > than).then_some((self.generation, self.buffer, self.content))
    }

    /// One more guard holds the buffer: its reading word is stored (the first guard).
    ///
    /// # Errors
    /// [`TensorSetError::WriterGone`] saying the set was resumed when a live writer has a slot
    /// (the hold is withdrawn: the resumed writer may write the buffer);
    /// [`crate::ShmError::Shrunk`] when the holders segment was cut short under this mapping (the
    /// hold cannot be recorded, so none is taken).
    pub(crate) fn hold(&self, set: &str) -> crate::error::Result<()> {
        let mut n = self.holds.lock().unwrap_or_else(PoisonError::into_inner);
        let resumed = match &self.claim {
            Some(c) if *n == 0 => self.holders.set_reading(c, Some(self.buffer))?,
            _ => self.holders.has_live_writer(),
        };
        if resumed {
            if *n == 0
                && let Some(c) = &self.claim
            {
                let _ = self.holders.set_reading(c, None);
            }
            return Err(TensorSetError::WriterGone {
                name: set.to_string(),
                pid: 0,
                why: "a new writer resumed the set on the same memory: reopen it".into(),
            }
            .into());
        }
        *n += 1;
        Ok(())
    }

    /// A guard let go: once none holds the buffer, the reader's stream is drained (the guards'
    /// work on it has read the buffer) and the reading word cleared.
    pub(crate) fn unhold(&self) {
        let mut n = self.holds.lock().unwrap_or_else(PoisonError::into_inner);
        *n = n.saturating_sub(1);
        if *n == 0
            && let Some(c) = &self.claim
        {
            if let Err(e) = self.stream.synchronize() {
                tracing::warn!("draining a writerless reader's stream before its release: {e}");
            }
            if let Err(e) = self.holders.set_reading(c, None) {
                tracing::warn!("a writerless reader's hold not cleared: {e}");
            }
        }
    }

    /// The generation served.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }
}

impl Drop for Writerless {
    fn drop(&mut self) {
        // The reader's work on its stream reads the imports, which drop after this: drain first.
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!("draining a writerless reader's stream: {e}");
        }
        if let Some(c) = self.claim.take() {
            self.holders.release(c);
        }
    }
}
