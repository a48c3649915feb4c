//! A reader opened after its writer's death ([`crate::tensorset::TensorSetReader::open`] when the
//! generation channel's producer is dead): it reads the last whole generation the holders segment
//! records, on a stream of its own; nothing writes the memory while the writer is dead, so there
//! are no ready or release words, and no newer generation will come.

use super::{HoldersSegment, Whole};
use crate::driver::{Context, Stream};
use crate::error::Result;
use crate::tensorset::error::TensorSetError;
use crate::tensorset::manifest::Manifest;
use std::sync::Arc;

/// The writerless mode of a reader: the generation it serves and its own stream.
pub(crate) struct Writerless {
    stream: Stream,
    generation: u64,
    buffer: usize,
    content: [u8; 32],
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
            } => Ok(Writerless {
                stream: Stream::new(ctx)?,
                generation,
                buffer,
                content,
            }),
            Whole::None(why) => Err(gone(&format!("no whole generation is left: {why}"))),
        }
    }

    /// The reader's own stream.
    pub(crate) fn stream(&self) -> &Stream {
        &self.stream
    }

    /// (generation, buffer, content) when the generation is newer than `than`.
    pub(crate) fn newer_than(&self, than: u64) -> Option<(u64, usize, [u8; 32])> {
        (self.generation > than).then_some((self.generation, self.buffer, self.content))
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
    }
}
