//! The frame a [`Consumer`] receives ([`Frame`]): its buffer, its ordering with other streams,
//! and its release (from the consumer's stream, or from the host where no stream orders it); a
//! frame's hold without its borrow ([`FrameHold`]).

use super::{Consumer, GpuImports, Side};
#[cfg(doc)]
use crate::channel::MemoryKind;
use crate::channel::handoff::Metadata;
use crate::channel::layout;
use crate::channel::view::FrameBuffer;
use crate::driver::Stream;
use crate::error::{Error, Result};
use crate::ffi::sys;
use crate::ipc::ImportedBuffer;

/// A received frame: its buffer is ready on the consumer's stream; dropping it releases it, ordered
/// after the work enqueued on the consumer's stream so far.
pub struct Frame<'a> {
    pub(super) consumer: &'a Consumer,
    pub(super) index: usize,
    pub(super) seq: u64,
    /// Inline: a frame allocates nothing.
    pub(super) metadata: Metadata,
    /// Taken by [`Consumer::recv_host_ordered`]: its release word is written from the host.
    pub(super) host_ordered: bool,
}

impl std::fmt::Debug for Frame<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frame")
            .field("seq", &self.seq)
            .field("index", &self.index)
            .field("metadata_len", &self.metadata.as_slice().len())
            .finish()
    }
}

impl Frame<'_> {
    /// The frame's buffer as this process sees it: the imported device buffer and the consumer's
    /// stream, or the host buffer ([`FrameBuffer`], shared with [`crate::channel::WriteFrame`]).
    pub fn view(&self) -> FrameBuffer<'_, ImportedBuffer> {
        let c = self.consumer;
        match &c.side {
            Side::Gpu { imports, .. } => {
                match (imports.buffers.get(self.index), imports.objects.get()) {
                    // A channel with buffers made its objects at attach.
                    (Some(buffer), Some(o)) => FrameBuffer::Device {
                        buffer,
                        stream: &o.stream,
                    },
                    // A memoryless channel: no bytes.
                    _ => FrameBuffer::host(None, self.index),
                }
            }
            Side::Host(pool) => FrameBuffer::host(pool.as_ref(), self.index),
        }
    }

    /// The frame's buffer, mapped in the consumer's context.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel ([`MemoryKind::Host`]; formerly a panic):
    /// use [`Frame::as_ptr`] or [`Frame::read_at`].
    pub fn buffer(&self) -> Result<&ImportedBuffer> {
        self.consumer.control.check_fork()?;
        self.view().device()
    }

    /// Whether the frame's buffer is host memory ([`MemoryKind::Host`]).
    pub fn is_host(&self) -> bool {
        self.consumer.is_host()
    }

    /// The buffer's length in bytes (the channel's `buffer_bytes`), for every memory kind.
    pub fn len(&self) -> usize {
        self.consumer.control.buffer_bytes() as usize
    }

    /// Whether the buffer has no bytes (never: buffers hold at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first byte of the frame's host buffer, valid for [`Frame::len`] bytes while the frame
    /// lives (it holds the buffer: the producer does not write it meanwhile).
    ///
    /// A raw pointer and never a `&[u8]`: the bytes are shared memory another process writes (the
    /// producer, after this frame is dropped; or any process of the user that maps the segment),
    /// and a shared reference would promise the compiler they do not change. Read through it with
    /// [`std::ptr::copy_nonoverlapping`] or [`std::ptr::read_unaligned`], or use
    /// [`Frame::read_at`]; the protocol orders the producer's writes before these reads (the
    /// publish Release / take Acquire pair on the buffer's `seq`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a GPU channel (formerly a panic): use [`Frame::buffer`].
    pub fn as_ptr(&self) -> Result<*const u8> {
        self.consumer.control.check_fork()?;
        self.view().host_ptr().map(<*mut u8>::cast_const)
    }

    /// Copies `dst.len()` bytes of the frame's host buffer from byte `offset` into `dst`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `offset + dst.len()` passes the buffer's end, or on a GPU
    /// channel (copy the device buffer on the stream there).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.consumer.control.check_fork()?;
        self.view().read_at(offset, dst)
    }

    /// The whole host buffer, copied.
    ///
    /// # Errors
    /// As [`Frame::read_at`].
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len()];
        self.read_at(0, &mut v)?;
        Ok(v)
    }
    /// Its sequence number (1, 2, ... per channel).
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// The producer's metadata for it.
    pub fn metadata(&self) -> &[u8] {
        self.metadata.as_slice()
    }
    /// Index of the buffer in the pool.
    pub fn index(&self) -> usize {
        self.index
    }
    /// Whether the producer's work on this frame is known complete, read on the host now (its
    /// buffer's ready word, `cuStreamWriteValue32` on the producer's stream after that work):
    /// `Some(true)` once the producer's stream wrote the word (always on a host channel);
    /// `None` while it has not; `Some(false)` when the producer died and the word was raised by
    /// the gate closed for it instead, which says nothing of the bytes: they may be partial, and
    /// work ordered after the frame's ready wait ran over them (the driver never completes a dead
    /// process's work). A frame written whole before its producer died reads `Some(false)` too
    /// once the gate is closed: the word no longer tells the two apart.
    pub fn written(&self) -> Option<bool> {
        if self.consumer.is_host() {
            return Some(true);
        }
        self.consumer.control.frame_written(self.index, self.seq)
    }
    /// The consumer's stream.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel ([`MemoryKind::Host`]), which has no stream
    /// (formerly a panic); [`Error::ForkedChild`] in a process forked from the one that received
    /// it.
    pub fn stream(&self) -> Result<&Stream> {
        self.consumer.stream()
    }

    /// Makes `stream` wait on the GPU for this frame (an event recorded on the consumer's stream,
    /// `cuStreamWaitEvent` on `stream`): work enqueued on `stream` from now on reads the
    /// producer's data. The calling thread does not block. `stream` may belong to any context (a
    /// library's own stream, such as PyTorch's current one); pair it with
    /// [`Frame::release_after`] for the same stream after the last work there that reads the
    /// frame.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel; [`Error::Cuda`] naming `cuEventRecord` or
    /// `cuStreamWaitEvent`.
    pub fn ready_on(&self, stream: &Stream) -> Result<()> {
        // SAFETY: `stream` is a live stream (borrowed for the call).
        unsafe { self.ready_on_raw(stream.as_raw()) }
    }

    /// [`Frame::ready_on`] for a raw `CUstream` (one that PyTorch, CuPy or JAX made).
    ///
    /// # Errors
    /// As [`Frame::ready_on`].
    ///
    /// # Safety
    /// 1. `stream` is a live stream of any context for the duration of the call, or null or
    ///    `CU_STREAM_LEGACY` (`0x1`) or `CU_STREAM_PER_THREAD` (`0x2`), which name the default
    ///    streams of the consumer's context.
    pub unsafe fn ready_on_raw(&self, stream: sys::CUstream) -> Result<()> {
        self.consumer.control.check_fork()?;
        let gpu = self.gpu_or_err()?;
        let Some(objects) = gpu.objects.get() else {
            // No consumer stream yet: the frame was delivered only once its ready word showed
            // the producer's work done (`deliver_parts`); work on `stream` reads it as it is.
            return Ok(());
        };
        let join = objects.join.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the consumer's stream lives as long as the consumer this frame borrows
        // (obligation 1 of `order_raw`); `stream` as the caller guarantees (obligation 2).
        unsafe { join.order_raw(objects.stream.as_raw(), stream) }
    }

    /// Orders this frame's release after the work enqueued so far on `stream` (a stream of the
    /// consumer's context that read the frame): the consumer's stream waits for it on the GPU (an
    /// event recorded on `stream`, `cuStreamWaitEvent`), and the release that dropping the frame
    /// records there comes after. The calling thread does not block. Call it after the last work
    /// on `stream` that reads the frame; it may be called for several streams and more than once.
    /// Without it, only work on [`Frame::stream`] is ordered before the producer reuses the
    /// buffer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel; [`Error::Cuda`] naming `cuEventRecord`
    /// (`stream` belongs to another context) or `cuStreamWaitEvent`.
    pub fn release_after(&self, stream: &Stream) -> Result<()> {
        // SAFETY: `stream` is a live stream (borrowed for the call); the driver rejects one of
        // another context at `cuEventRecord`.
        unsafe { self.release_after_raw(stream.as_raw()) }
    }

    /// [`Frame::release_after`] for a raw `CUstream`.
    ///
    /// # Errors
    /// As [`Frame::release_after`].
    ///
    /// # Safety
    /// 1. `stream` is a live stream of the consumer's context for the duration of the call, or
    ///    null or `CU_STREAM_LEGACY` (`0x1`) or `CU_STREAM_PER_THREAD` (`0x2`), which name that
    ///    context's default streams.
    pub unsafe fn release_after_raw(&self, stream: sys::CUstream) -> Result<()> {
        let objects = self.gpu_or_err()?.objects(&self.consumer.control)?;
        let join = objects.join.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `stream` as the caller guarantees (obligation 1 of `order_raw`); the consumer's
        // stream lives as long as the consumer this frame borrows (obligation 2).
        unsafe { join.order_raw(stream, objects.stream.as_raw()) }
    }

    fn gpu_or_err(&self) -> Result<&GpuImports> {
        self.consumer.imports().ok_or_else(|| {
            Error::InvalidArgument("a host channel's frame has no stream to order".into())
        })
    }
}

/// A frame's hold without its borrow of the consumer ([`Frame::detach`]; a tensor-set reader's
/// stable generation), released by [`Consumer::release_hold`] of the same consumer, or with the
/// consumer's slot when it drops.
#[derive(Debug)]
pub(crate) struct FrameHold {
    index: usize,
    seq: u64,
    host_ordered: bool,
}

impl Frame<'_> {
    /// The frame's hold without the borrow: nothing is released now.
    pub(crate) fn detach(self) -> FrameHold {
        let hold = FrameHold {
            index: self.index,
            seq: self.seq,
            host_ordered: self.host_ordered,
        };
        // The frame owns nothing but its hold (a borrow, inline metadata): nothing leaks.
        std::mem::forget(self);
        hold
    }
}

impl Consumer {
    /// Releases a hold detached from one of this consumer's frames, as dropping the frame would.
    pub(crate) fn release_hold(&self, hold: FrameHold) {
        self.release_frame(hold.index, hold.seq, hold.host_ordered);
    }

    fn release_frame(&self, index: usize, seq: u64, host_ordered: bool) {
        let c = self;
        if let Some(gpu) = c.imports() {
            if host_ordered {
                // Every read of the buffer finished before the drop (the caller's obligation).
                c.control.set_released(c.slot, index, seq);
            } else if let Some(objects) = gpu.objects.get() {
                let word =
                    objects.ready.device_ptr + layout::release_word_offset(c.slot, index) as u64;
                // SAFETY: the word lies in the registered GPU words (this consumer's slot, index <
                // buffers), which stay registered until its stream has drained (Drop of Consumer).
                if let Err(e) = unsafe { objects.stream.write_value_u32(word, seq as u32) } {
                    // Without the write the producer's stream would wait for good: wait for our
                    // kernels on the host instead and write the word from here.
                    tracing::warn!(
                        "enqueuing the release word failed ({e}); synchronising instead"
                    );
                    if let Err(e) = objects.stream.synchronize() {
                        tracing::warn!("synchronising the consumer stream failed: {e}");
                    }
                    c.control.set_released(c.slot, index, seq);
                }
            } else {
                // No consumer stream was made (a memoryless channel's consumer): no work of this
                // consumer's was enqueued on one, and the frame was delivered complete
                // (`deliver_parts`). Work on another stream orders itself first with
                // `Frame::release_after`, which makes the stream (and so is written above).
                c.control.set_released(c.slot, index, seq);
            }
        }
        // On a host channel this clear (a release) is what orders this frame's reads before the
        // producer's next write of the buffer.
        c.control.release(c.slot, index);
    }
}

impl Drop for Frame<'_> {
    fn drop(&mut self) {
        if self.consumer.control.inherited() {
            return; // the parent's hold (`identity::fork`)
        }
        self.consumer
            .release_frame(self.index, self.seq, self.host_ordered);
    }
}
