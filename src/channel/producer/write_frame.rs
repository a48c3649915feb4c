//! The buffer a [`Producer`] hands out for writing ([`WriteFrame`]: its view, its ordering
//! with other streams, its publication or return) and the crate's lent form of it
//! ([`LentFrame`]).

#[cfg(doc)]
use super::ChannelOptions;
use super::{GpuPool, Producer, Side};
use crate::channel::META_BYTES;
#[cfg(doc)]
use crate::channel::MemoryKind;
use crate::channel::control::Control;
use crate::channel::layout;
use crate::channel::pool::ChannelBuffer;
use crate::channel::view::FrameBuffer;
use crate::driver::Stream;
use crate::error::{Error, Result};
use crate::ffi::sys;
use std::sync::Arc;

/// A buffer the producer is writing. Publish it, or drop it to give it back unpublished.
pub struct WriteFrame<'a> {
    pub(super) producer: &'a mut Producer,
    pub(super) index: usize,
    pub(super) done: bool,
    /// Resumed from a loan ([`Producer::resume`]): written outside any stream, published from
    /// the host.
    pub(super) lent: bool,
}

impl WriteFrame<'_> {
    /// The frame's buffer as this process sees it: the device buffer and the producer's stream,
    /// or the host buffer ([`FrameBuffer`], shared with [`crate::channel::Frame`]).
    pub fn view(&self) -> FrameBuffer<'_, ChannelBuffer> {
        match &self.producer.side {
            Side::Gpu(gpu) => FrameBuffer::Device {
                buffer: &gpu.buffers[self.index],
                stream: &gpu.stream,
            },
            Side::Host(pool) => FrameBuffer::host(pool.as_ref(), self.index),
        }
    }

    /// The device buffer to write (the whole pool buffer).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel ([`MemoryKind::Host`]; formerly a
    /// panic): use [`WriteFrame::as_mut_ptr`] or [`WriteFrame::write_at`].
    pub fn buffer(&self) -> Result<&ChannelBuffer> {
        self.producer.control.check_fork()?;
        self.view().device()
    }

    /// Whether the frame's buffer is host memory ([`MemoryKind::Host`]).
    pub fn is_host(&self) -> bool {
        self.producer.is_host()
    }

    /// The buffer's length in bytes (the channel's `buffer_bytes`), for every memory kind.
    pub fn len(&self) -> usize {
        self.producer.control.buffer_bytes() as usize
    }

    /// Whether the buffer has no bytes (never: buffers hold at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first byte of the frame's host buffer, valid for [`WriteFrame::len`] bytes until the
    /// frame is published or dropped.
    ///
    /// A raw pointer and not a `&mut [u8]`: the bytes are shared memory that consumer processes
    /// map. No consumer holds this buffer while the producer writes it (the protocol's Dekker pair
    /// on `seq` and `hold_mask`), so plain writes through the pointer are ordered; but a reference
    /// would promise the compiler exclusive access that another (misbehaving) process could break.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a GPU channel (formerly a panic): use
    /// [`WriteFrame::buffer`].
    pub fn as_mut_ptr(&self) -> Result<*mut u8> {
        self.producer.control.check_fork()?;
        self.view().host_ptr()
    }

    /// Copies `src` into the frame's host buffer at byte `offset`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `offset + src.len()` passes the buffer's end, or on a GPU
    /// channel (write the device buffer on the stream there).
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.producer.control.check_fork()?;
        let dst = self.view().host_range(offset, src.len())?;
        // SAFETY: `dst..dst + src.len()` lies in this frame's buffer (checked by `host_range`),
        // which nobody else reads or writes while the producer holds it as WRITING; `src` is
        // ordinary memory of this process, so the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies `dst.len()` bytes of the frame's host buffer from byte `offset` into `dst`.
    ///
    /// # Errors
    /// As [`WriteFrame::write_at`].
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.producer.control.check_fork()?;
        self.view().read_at(offset, dst)
    }

    /// Index of the buffer in the pool.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The producer's stream, or `None` on a host channel; never touches the pool (crate-private:
    /// a memoryless channel's frames have no buffer to view).
    pub(crate) fn producer_stream(&self) -> Option<&Stream> {
        match &self.producer.side {
            Side::Gpu(gpu) => Some(&gpu.stream),
            Side::Host(_) => None,
        }
    }

    /// The producer's stream, on which the write must be enqueued.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel ([`MemoryKind::Host`]), which has no stream
    /// (formerly a panic); [`Error::ForkedChild`] in a process forked from the one that acquired
    /// the frame.
    pub fn stream(&self) -> Result<&Stream> {
        self.producer.control.check_fork()?;
        self.view().stream()
    }

    /// The producer's GPU side, or the error of a host channel's frame asked to order a stream.
    fn gpu_or_err(&self) -> Result<&GpuPool> {
        match &self.producer.side {
            Side::Gpu(gpu) => Ok(gpu),
            Side::Host(_) => Err(Error::InvalidArgument(
                "a host channel's frame has no stream to order".into(),
            )),
        }
    }

    /// Makes `stream` wait on the GPU until the buffer may be written (an event recorded on the
    /// producer's stream after its waits for the last readers' release words,
    /// `cuStreamWaitEvent` on `stream`): for writes enqueued on another stream than
    /// [`WriteFrame::stream`], such as a library's current stream. The calling thread does not
    /// block. Pair it with [`WriteFrame::publish_after`] for the same stream.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel; [`Error::Cuda`] naming `cuEventRecord` or
    /// `cuStreamWaitEvent`.
    pub fn ready_on(&self, stream: &Stream) -> Result<()> {
        // SAFETY: `stream` is a live stream (borrowed for the call).
        unsafe { self.ready_on_raw(stream.as_raw()) }
    }

    /// [`WriteFrame::ready_on`] for a raw `CUstream` (one that PyTorch, CuPy or JAX made).
    ///
    /// # Errors
    /// As [`WriteFrame::ready_on`].
    ///
    /// # Safety
    /// 1. `stream` is a live stream of any context for the duration of the call, or null or
    ///    `CU_STREAM_LEGACY` (`0x1`) or `CU_STREAM_PER_THREAD` (`0x2`), which name the default
    ///    streams of the producer's context.
    pub unsafe fn ready_on_raw(&self, stream: sys::CUstream) -> Result<()> {
        self.producer.control.check_fork()?;
        let gpu = self.gpu_or_err()?;
        let join = gpu.join.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the producer's stream lives as long as the producer this frame borrows
        // (obligation 1 of `order_raw`); `stream` as the caller guarantees (obligation 2).
        unsafe { join.order_raw(gpu.stream.as_raw(), stream) }
    }

    /// Orders the publish after the work enqueued so far on `stream` (another stream of the
    /// producer's context that writes the buffer, such as PyTorch's current stream): the
    /// producer's stream waits for it on the GPU (an event recorded on `stream`,
    /// `cuStreamWaitEvent`), and the ready word that [`WriteFrame::publish`] enqueues there comes
    /// after. The calling thread does not block. Call it after the last write on `stream`; it may
    /// be called for several streams. Without it, only work on [`WriteFrame::stream`] is ordered
    /// before consumers read the frame.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel; [`Error::Cuda`] naming `cuEventRecord`
    /// (`stream` belongs to another context) or `cuStreamWaitEvent`.
    pub fn publish_after(&self, stream: &Stream) -> Result<()> {
        // SAFETY: `stream` is a live stream (borrowed for the call); the driver rejects one of
        // another context at `cuEventRecord`.
        unsafe { self.publish_after_raw(stream.as_raw()) }
    }

    /// [`WriteFrame::publish_after`] for a raw `CUstream` (one that PyTorch, CuPy or JAX made).
    ///
    /// # Errors
    /// As [`WriteFrame::publish_after`].
    ///
    /// # Safety
    /// 1. `stream` is a live stream of the producer's context for the duration of the call, or
    ///    null or `CU_STREAM_LEGACY` (`0x1`) or `CU_STREAM_PER_THREAD` (`0x2`), which name that
    ///    context's default streams.
    pub unsafe fn publish_after_raw(&self, stream: sys::CUstream) -> Result<()> {
        self.producer.control.check_fork()?;
        let gpu = self.gpu_or_err()?;
        let join = gpu.join.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `stream` as the caller guarantees (obligation 1 of `order_raw`); the producer's
        // stream lives as long as the producer this frame borrows (obligation 2).
        unsafe { join.order_raw(stream, gpu.stream.as_raw()) }
    }

    /// Publishes the frame with `metadata` (at most [`META_BYTES`] bytes) and wakes waiting
    /// consumers. On a host channel that is all: the writes made through the frame so far are
    /// visible to every consumer that receives it. On a GPU channel it then enqueues on the
    /// producer's stream, after the work enqueued so far, the write of the buffer's ready word
    /// (`cuStreamWriteValue32`) that consumers' streams wait for.
    /// Returns its sequence number (1, 2, ...).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for metadata over [`META_BYTES`] (the buffer is given back
    /// unpublished); CUDA errors from enqueuing the ready word's write (the frame is published
    /// and marked ready from the host once the producer's stream has drained).
    pub fn publish(mut self, metadata: &[u8]) -> Result<u64> {
        if metadata.len() > META_BYTES {
            return Err(Error::InvalidArgument(format!(
                "metadata is {} bytes; at most {META_BYTES}",
                metadata.len()
            )));
        }
        let p = &*self.producer;
        // Publish first, then enqueue the ready word's write: consumers may see the frame before
        // the write is enqueued, which is correct (their streams wait for the word on the GPU) and
        // takes the enqueue off the hand-off's path.
        let seq = p.control.publish(self.index, metadata)?;
        let Side::Gpu(gpu) = &p.side else {
            self.done = true;
            return Ok(seq);
        };
        if self.lent {
            // Written outside any stream and complete by now: ready from the host.
            p.control.set_ready(self.index, seq);
            self.done = true;
            return Ok(seq);
        }
        let word = gpu.ready.device_ptr + layout::ready_word_offset(self.index) as u64;
        // SAFETY: the word lies in the registered ready page (index < buffers), which stays
        // registered and mapped until the producer's stream has drained (Drop order of Producer).
        if let Err(e) = unsafe { gpu.stream.write_value_u32(word, seq as u32) } {
            // Consumers already wait for this word: set it from the host once our work on the
            // buffer is done (or failed), so they never wait for good.
            let _ = gpu.stream.synchronize();
            p.control.set_ready(self.index, seq);
            self.done = true;
            return Err(e);
        }
        self.done = true;
        Ok(seq)
    }
}

impl Drop for WriteFrame<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.producer.control.abandon(self.index);
        }
    }
}

/// A buffer taken for writing that does not borrow its producer ([`Producer::lend`]): several
/// can be out at once. Crate-private; [`Producer::resume`] makes it a [`WriteFrame`] again, and
/// dropping it unresumed gives the buffer back unpublished.
#[cfg_attr(not(feature = "remote"), allow(dead_code))]
pub(crate) struct LentFrame {
    /// The lending producer's control segment (kept mapped while the buffer is lent).
    pub(super) control: Arc<Control>,
    pub(super) index: usize,
    /// The frame the buffer held before: the one its last readers' release words must reach.
    pub(super) old_seq: u64,
    /// Consumer slots whose release words for that frame were not yet seen (bit per slot).
    pub(super) pending: u64,
    /// False once resumed (the frame it became gives the buffer back or publishes it).
    pub(super) armed: bool,
}

#[cfg_attr(not(feature = "remote"), allow(dead_code))]
impl LentFrame {
    /// The buffer's index in the pool.
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    /// Whether the buffer's last readers finished with it, on their GPUs too (their release
    /// words, read on the host; a dead reader's are raised by the producer's watchdog, a
    /// detached one's when its slot was freed): until then nothing may write it.
    pub(crate) fn is_free(&mut self) -> bool {
        let mut bits = self.pending;
        while bits != 0 {
            let c = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if self.control.released(c, self.index, self.old_seq) {
                self.pending &= !(1 << c);
            }
        }
        self.pending == 0
    }
}

impl std::fmt::Debug for LentFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LentFrame")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl Drop for LentFrame {
    fn drop(&mut self) {
        if self.armed && !self.control.inherited() {
            // The readers not yet seen done are waited for by whoever takes the buffer next.
            if self.pending != 0 {
                self.control.restore_used(self.index, self.pending);
            }
            self.control.abandon(self.index);
        }
    }
}
