//! The buffer view that a received [`Frame`] and a [`WriteFrame`] share: [`FrameBuffer`], either a
//! device buffer with the stream that orders it or a range of host memory, decided once by the
//! channel's memory kind.
//!
//! Owns: the accessors both frame types had, each once; an accessor of one kind asked of the other
//! is an error, never a panic. It owns no memory: the view borrows the frame's end of the channel.
//!
//! [`Frame`]: super::Frame
//! [`WriteFrame`]: super::WriteFrame

use super::host::HostPool;
use super::options::{HOST_NO_GPU, no_host_bytes};
use crate::driver::{DeviceMemory, Stream};
use crate::error::{Error, Result};

/// Where a frame's bytes are, as this process sees them: a device buffer ordered on a stream
/// ([`MemoryKind::Legacy`], `Vmm` or `Pool`) or host memory ([`MemoryKind::Host`]).
///
/// `B` is the buffer type of the end: [`crate::ipc::ImportedBuffer`] for a received [`Frame`],
/// [`super::ChannelBuffer`] for a [`WriteFrame`]. Made by [`Frame::view`] and
/// [`WriteFrame::view`]; valid while the frame lives.
///
/// [`MemoryKind::Legacy`]: super::MemoryKind::Legacy
/// [`MemoryKind::Host`]: super::MemoryKind::Host
/// [`Frame`]: super::Frame
/// [`Frame::view`]: super::Frame::view
/// [`WriteFrame`]: super::WriteFrame
/// [`WriteFrame::view`]: super::WriteFrame::view
#[derive(Debug)]
#[non_exhaustive]
pub enum FrameBuffer<'a, B> {
    /// A device buffer in this end's context, and the stream its frame is ordered on (the
    /// consumer's stream, where the frame is ready; the producer's, where it is written).
    Device {
        /// The whole pool buffer.
        buffer: &'a B,
        /// The end's stream.
        stream: &'a Stream,
    },
    /// Host memory shared with the other processes of the channel.
    Host {
        /// The buffer's first byte, valid for `len` bytes while the frame lives. Shared memory:
        /// read and write it through the pointer (or [`FrameBuffer::read_at`]), never through a
        /// Rust reference.
        ptr: *mut u8,
        /// The buffer's length in bytes.
        len: usize,
    },
}

// Derived `Clone`/`Copy` would ask `B: Clone`/`Copy`; the view holds only a reference and a
// pointer.
impl<B> Clone for FrameBuffer<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for FrameBuffer<'_, B> {}

impl<'a, B> FrameBuffer<'a, B> {
    /// Host buffer `index` of `pool`; no bytes where the channel has none (a memoryless
    /// channel's frames: every range but the empty one is refused, and the pointer is dangling).
    pub(crate) fn host(pool: Option<&'a HostPool>, index: usize) -> Self {
        match pool {
            Some(pool) => FrameBuffer::Host {
                ptr: pool.ptr(index),
                len: pool.buffer_bytes(),
            },
            None => FrameBuffer::Host {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len: 0,
            },
        }
    }

    /// Whether the bytes are host memory.
    pub fn is_host(&self) -> bool {
        matches!(self, FrameBuffer::Host { .. })
    }

    /// The device buffer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel (use [`FrameBuffer::host_ptr`]).
    pub fn device(&self) -> Result<&'a B> {
        match self {
            FrameBuffer::Device { buffer, .. } => Ok(buffer),
            FrameBuffer::Host { .. } => Err(Error::InvalidArgument(HOST_NO_GPU.into())),
        }
    }

    /// The stream the frame is ordered on.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host channel, which has no stream.
    pub fn stream(&self) -> Result<&'a Stream> {
        match self {
            FrameBuffer::Device { stream, .. } => Ok(stream),
            FrameBuffer::Host { .. } => Err(Error::InvalidArgument(HOST_NO_GPU.into())),
        }
    }

    /// The first byte of the host buffer, valid for the buffer's length while the frame lives.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a GPU channel (use [`FrameBuffer::device`] on
    /// [`FrameBuffer::stream`]).
    pub fn host_ptr(&self) -> Result<*mut u8> {
        match self {
            FrameBuffer::Host { ptr, .. } => Ok(*ptr),
            FrameBuffer::Device { .. } => Err(no_host_bytes()),
        }
    }

    /// The address of `n` host bytes from byte `offset`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a GPU channel, or when `offset + n` passes the buffer's end.
    pub(super) fn host_range(&self, offset: usize, n: usize) -> Result<*mut u8> {
        let FrameBuffer::Host { ptr, len } = *self else {
            return Err(no_host_bytes());
        };
        if offset.checked_add(n).is_none_or(|end| end > len) {
            return Err(Error::InvalidArgument(format!(
                "{} at offset {offset} would pass the end of a {len}-byte buffer",
                crate::error::bytes(n)
            )));
        }
        // SAFETY: offset + n <= len (checked), so the result stays in the buffer that `ptr`
        // starts (valid for `len` bytes, the variant's contract).
        let at = unsafe { ptr.add(offset) };
        Ok(at)
    }

    /// Copies `dst.len()` bytes of the host buffer from byte `offset` into `dst`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `offset + dst.len()` passes the buffer's end, or on a GPU
    /// channel (copy the device buffer on the stream there).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.host_range(offset, dst.len())?;
        // No other process writes the buffer while the frame holds it (a received frame's hold,
        // or the producer's WRITING state).
        // SAFETY: `src..src + dst.len()` lies in the buffer (`host_range`); `dst` is this
        // process's own memory, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

impl<B: DeviceMemory> FrameBuffer<'_, B> {
    /// The buffer's length in bytes: the device buffer's ([`DeviceMemory::len`]) or the host
    /// buffer's.
    pub fn len(&self) -> usize {
        match self {
            FrameBuffer::Device { buffer, .. } => buffer.len(),
            FrameBuffer::Host { len, .. } => *len,
        }
    }

    /// Whether the buffer has no bytes (never for a channel's buffers: they hold at least one).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
