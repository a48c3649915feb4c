//! Receives posted ahead ([`Consumer::post`]): the consumer's stream waits on the GPU for frames
//! not yet published, in ring order, and [`Posted::wait`] takes them on the host afterwards.

use super::{Consumer, GpuImports, GpuObjects};
use crate::channel::handoff::Metadata;
use crate::channel::layout::{self, Delivery};
#[cfg(doc)]
use crate::channel::{ChannelError, ChannelOptions};
use crate::driver::Stream;
use crate::error::{Error, Result};
use crate::ipc::ImportedBuffer;
use std::time::{Duration, Instant};

/// Most frames a receive may be posted ahead of the last frame this consumer received.
pub const MAX_POSTED_AHEAD: u64 = 1 << 20;

impl Consumer {
    /// Posts the receive of the next frame ahead of its publication: the consumer's stream waits
    /// on the GPU for that frame's ready word (`cuStreamWaitValue32`), `work` enqueues what reads
    /// it (on [`Posted::stream`], the consumer's stream, where the buffer [`Posted::buffer`] will
    /// hold the frame), and the write of its release word follows on the stream
    /// (`cuStreamWriteValue32`). The calling thread does not wait: the kernels start on the GPU as
    /// the producer's write of the frame ends, while this thread sleeps or posts the next frames.
    /// Then [`Posted::wait`] takes the frame on the host (its metadata, and the errors of
    /// [`Consumer::recv`]), in order.
    ///
    /// Needs a GPU channel created in ring order ([`ChannelOptions::ring`]) and
    /// every-frame delivery: there, frame `s` lands in buffer `(s - 1) % B`, known in advance. A
    /// receive may be posted at most [`MAX_POSTED_AHEAD`] frames past the last frame received.
    /// Work posted for a frame that never comes (the channel closed, its producer died) is let go
    /// and can tell from the gate words ([`Consumer::gate_device_ptr`]). Frames posted are also
    /// what the next [`Consumer::recv`] returns if it comes first (its stream wait passes at once).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel, a channel not in ring order, a latest-only
    /// consumer, or past [`MAX_POSTED_AHEAD`]; what `work` returns (the release write is enqueued
    /// anyway, so the producer is never held up by it); [`Error::Cuda`] naming
    /// `cuStreamWaitValue32_v2` or `cuStreamWriteValue32_v2`; [`Error::ForkedChild`] in a process
    /// forked from the one that attached (before any lock is taken).
    pub fn post<F>(&self, work: F) -> Result<Posted<'_>>
    where
        F: FnOnce(&Posted<'_>) -> Result<()>,
    {
        self.control.check_fork()?;
        let Some(gpu) = self.imports() else {
            return Err(Error::InvalidArgument(
                "a host channel has no stream to post receives on".into(),
            ));
        };
        if gpu.buffers.is_empty() {
            return Err(Error::InvalidArgument(
                "a memoryless channel has no buffers to post receives for".into(),
            ));
        }
        if !self.control.is_ring() {
            return Err(Error::InvalidArgument(
                "posted receives need a channel created in ring order (ChannelOptions::ring; ring=True in Python)"
                    .into(),
            ));
        }
        if self.control.policy(self.slot) != Delivery::EveryFrame.to_wire() {
            return Err(Error::InvalidArgument(
                "posted receives need every-frame delivery".into(),
            ));
        }
        let mut last = self.posted.lock().unwrap_or_else(|p| p.into_inner());
        let cursor = self.control.cursor(self.slot);
        let seq = (*last).max(cursor) + 1;
        if seq - cursor > MAX_POSTED_AHEAD {
            return Err(Error::InvalidArgument(format!(
                "a receive may be posted at most {MAX_POSTED_AHEAD} frames ahead of the last one received"
            )));
        }
        let index = ((seq - 1) % self.control.buffers() as u64) as usize;
        let objects = gpu.objects(&self.control)?;
        // SAFETY: the word lies in the registered GPU words (index < buffers), which stay
        // registered and mapped until this consumer's stream has drained (Drop of Consumer).
        unsafe {
            objects.stream.wait_value_u32(
                objects.ready.device_ptr + layout::ready_word_offset(index) as u64,
                seq as u32,
            )?;
        }
        *last = seq;
        let posted = Posted {
            consumer: self,
            gpu,
            objects,
            index,
            seq,
        };
        let r = work(&posted);
        // SAFETY: as above; the release word of this consumer's own slot.
        unsafe {
            objects.stream.write_value_u32(
                objects.ready.device_ptr + layout::release_word_offset(self.slot, index) as u64,
                seq as u32,
            )?;
        }
        r.map(|()| posted)
    }
}

/// A receive posted ahead ([`Consumer::post`]): the consumer's stream waits on the GPU for frame
/// [`Posted::seq`], which will be in buffer [`Posted::buffer`]. [`Posted::wait`] takes it on the
/// host; dropping it without waiting leaves the frame to the next `wait` or `recv`.
pub struct Posted<'a> {
    consumer: &'a Consumer,
    /// The GPU side of the consumer that posted it (posted receives exist only on GPU channels).
    gpu: &'a GpuImports,
    /// Its stream and registration.
    objects: &'a GpuObjects,
    index: usize,
    seq: u64,
}

impl std::fmt::Debug for Posted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Posted")
            .field("seq", &self.seq)
            .field("index", &self.index)
            .finish()
    }
}

impl<'a> Posted<'a> {
    /// The sequence number of the frame waited for.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Index of the buffer in the pool that will hold it (`(seq - 1) % buffers`).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The buffer that will hold the frame, mapped in the consumer's context.
    ///
    /// # Errors
    /// [`Error::ForkedChild`] in a process forked from the one that posted the receive (the
    /// mapping and the context are the parent's).
    pub fn buffer(&self) -> Result<&'a ImportedBuffer> {
        self.consumer.control.check_fork()?;
        Ok(&self.gpu.buffers[self.index])
    }

    /// The consumer's stream, where the work that reads the frame goes (it waits for the frame).
    ///
    /// # Errors
    /// [`Error::ForkedChild`] in a process forked from the one that posted the receive.
    pub fn stream(&self) -> Result<&'a Stream> {
        self.consumer.control.check_fork()?;
        Ok(&self.objects.stream)
    }

    /// The gate words' device address ([`Consumer::gate_device_ptr`]): work on the stream reads
    /// them to tell whether this frame came.
    ///
    /// # Errors
    /// [`Error::ForkedChild`] in a process forked from the one that posted the receive.
    pub fn gate_device_ptr(&self) -> Result<u64> {
        self.consumer.control.check_fork()?;
        Ok(self.objects.ready.device_ptr + layout::GATE_STATE_OFFSET as u64)
    }

    /// Waits on the host up to `timeout` (`None`: no bound) until the frame is published, and takes
    /// it: its metadata. Frames before it posted and not waited for are taken (and let go) on the
    /// way. The frame's GPU release was enqueued when it was posted, so nothing is held after this.
    ///
    /// # Errors
    /// As [`Consumer::recv_timeout`]: [`Error::Timeout`], [`ChannelError::ProducerGone`],
    /// [`ChannelError::Closed`] (the frame never came), [`ChannelError::Detached`];
    /// [`Error::InvalidArgument`] when [`Consumer::recv`] already took the frame.
    pub fn wait(self, timeout: Option<Duration>) -> Result<PostedFrame> {
        self.take(timeout)
    }

    /// [`Posted::wait`] without consuming the receive, so that a binding can wait in bounded
    /// slices (a [`Error::Timeout`] leaves it waitable; frames before it taken on the way stay
    /// taken). Once it returned the frame, a second call is the [`Error::InvalidArgument`] of a
    /// frame received already.
    pub(crate) fn take(&self, timeout: Option<Duration>) -> Result<PostedFrame> {
        let c = self.consumer;
        // Before `taking` is locked: a thread of the parent may have held it at the fork.
        c.control.check_fork()?;
        // A timeout past what `Instant` can hold (`Duration::MAX`) is no bound (`+` would panic).
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            if c.control.cursor(c.slot) >= self.seq {
                return Err(Error::InvalidArgument(format!(
                    "frame {} was received already (by recv)",
                    self.seq
                )));
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let (i, seq, metadata) = match c.control.take(c.slot, c.wait, left, &c.taking) {
                Ok(Some(got)) => got,
                Ok(None) => {
                    return Err(Error::Timeout {
                        what: "a posted frame",
                        after: timeout.unwrap_or_default(),
                    });
                }
                Err(e) => return Err(c.on_error(e)),
            };
            // Its GPU release is on the stream already (posted), or it is an unposted frame
            // before ours, which nothing reads: the host hold ends now.
            c.control.release(c.slot, i);
            if seq == self.seq {
                return Ok(PostedFrame {
                    seq,
                    index: i,
                    metadata,
                });
            }
            if seq > self.seq {
                return Err(Error::InvalidArgument(format!(
                    "frame {} was skipped (the consumer took {seq})",
                    self.seq
                )));
            }
        }
    }
}

/// A posted frame taken on the host ([`Posted::wait`]): what the producer published with it.
#[derive(Clone, Copy, Debug)]
pub struct PostedFrame {
    seq: u64,
    index: usize,
    metadata: Metadata,
}

impl PostedFrame {
    /// Its sequence number.
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// Index of its buffer in the pool.
    pub fn index(&self) -> usize {
        self.index
    }
    /// The producer's metadata for it.
    pub fn metadata(&self) -> &[u8] {
        self.metadata.as_slice()
    }
}
