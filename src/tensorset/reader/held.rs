//! A held generation ([`Held`]): the guard a reader's take returns, the tensors it gives
//! ([`TensorRef`], [`Location`]), its ordering with other streams and its release.

use super::{Memory, Source, TensorSetReader};
use crate::channel::Frame;
use crate::driver::{Context, DeviceMemory, Stream};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::ffi::sys;
use crate::tensorset::TensorSetError;
use crate::tensorset::manifest::TensorInfo;
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// Where a tensor of a held generation is, in this process.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum Location {
    /// A device address in the reader's context.
    Device(u64),
    /// The first byte in the host data segment's mapping (shared memory: read it through the
    /// pointer, never through a reference).
    Host(*const u8),
}

/// One tensor of a held generation: its layout entry and where its bytes are.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    /// Name, dtype, shape, strides, offset, bytes.
    pub info: &'a TensorInfo,
    /// Its first byte.
    pub location: Location,
}

/// A held generation: its buffer is not rewritten while the guard lives (and, on a GPU set, while
/// the work enqueued on the reader's stream before the guard dropped runs: the release word is
/// written there). On a GPU set the generation is ready on the reader's stream: its writer's work
/// was done when it was taken, or the stream waits for its ready word. Dropping it releases the
/// hold.
pub struct Held<'a> {
    pub(super) reader: &'a TensorSetReader,
    /// The generation channel's frame (`None` for a writerless reader: nothing to release).
    pub(super) frame: Option<ManuallyDrop<Frame<'a>>>,
    pub(super) buffer: usize,
    pub(super) generation: u64,
    pub(super) content: [u8; 32],
}

impl std::fmt::Debug for Held<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("generation", &self.generation)
            .field("buffer", &self.buffer)
            .finish()
    }
}

impl Held<'_> {
    /// The generation number (1, 2, ...).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The buffer that holds it.
    pub fn buffer(&self) -> usize {
        self.buffer
    }

    /// Its content fingerprint as the writer committed it (all zeros: none).
    pub fn content(&self) -> [u8; 32] {
        self.content
    }

    /// Whether this generation is known whole, read on the host now: `Some(true)` once the
    /// writer's stream finished it (its ready word) or the set's holders segment recorded it
    /// whole, and always on a host set or a writerless reader; `None` while the writer's stream
    /// still works on it (the hold is stream-ordered: the reader's work waits for it on the
    /// GPU); `Some(false)` when the writer died before its stream was known to have finished it:
    /// its bytes may be partial, and work ordered after this hold ran over them. A take never
    /// hands out a generation that reads `Some(false)` already ([`TensorSetError::WriterGone`]);
    /// this tells a caller whose hold came first. No CUDA call; a few atomic loads (and, after
    /// a writer's death, a look at the holders segment).
    pub fn whole(&self) -> Option<bool> {
        let Some(frame) = self.frame.as_ref() else {
            // Writerless: its generation was recorded whole before the reader opened.
            return Some(true);
        };
        match frame.written() {
            Some(false) if self.reader.recorded_whole(self.generation, self.buffer) => Some(true),
            w => w,
        }
    }

    /// Tensor `i`.
    ///
    /// # Errors
    /// [`TensorSetError::NoSuchTensor`].
    pub fn tensor(&self, i: usize) -> Result<TensorRef<'_>> {
        self.reader.fork.check("tensor set hold")?;
        let info = self
            .reader
            .layout
            .tensors()
            .get(i)
            .ok_or_else(|| TensorSetError::NoSuchTensor(i.to_string()))?;
        let location = match &self.reader.memory {
            Memory::Host(d) => {
                // SAFETY: `offset + bytes <= bytes_per_buffer <= stride` (checked by the layout
                // at decode), so the address lies in this buffer of the mapping.
                Location::Host(unsafe { d.ptr(self.buffer).add(info.offset as usize) }.cast_const())
            }
            Memory::Gpu(b) => Location::Device(
                b[self.buffer][info.allocation as usize].device_ptr() + info.offset,
            ),
        };
        Ok(TensorRef { info, location })
    }

    /// Tensor `name`.
    ///
    /// # Errors
    /// [`TensorSetError::NoSuchTensor`].
    pub fn by_name(&self, name: &str) -> Result<TensorRef<'_>> {
        let i = self
            .reader
            .layout
            .index_of(name)
            .ok_or_else(|| TensorSetError::NoSuchTensor(format!("{name:?}")))?;
        self.tensor(i)
    }

    /// The device address of tensor `i` in the reader's context (GPU sets).
    ///
    /// # Errors
    /// [`TensorSetError::NoSuchTensor`]; [`TensorSetError::WrongKind`] on a host set.
    pub fn device_ptr(&self, i: usize) -> Result<u64> {
        match self.tensor(i)?.location {
            Location::Device(p) => Ok(p),
            Location::Host(_) => {
                Err(TensorSetError::WrongKind("a host tensor set has no device addresses").into())
            }
        }
    }

    /// Tensor `i` as device memory in the reader's context (GPU sets), for kernels on the
    /// reader's stream. A VMM set opened read-only faults a kernel that stores into it.
    ///
    /// # Errors
    /// As [`Held::device_ptr`].
    pub fn device_tensor(&self, i: usize) -> Result<crate::tensorset::DeviceTensor<'_>> {
        let ptr = self.device_ptr(i)?;
        Ok(crate::tensorset::DeviceTensor {
            ptr,
            len: self.reader.layout.tensors()[i].bytes as usize,
            ctx: self.reader.context()?,
        })
    }

    /// The first byte of tensor `i` in host memory (host sets).
    ///
    /// # Errors
    /// [`TensorSetError::NoSuchTensor`]; [`TensorSetError::WrongKind`] on a GPU set.
    pub fn host_ptr(&self, i: usize) -> Result<*const u8> {
        match self.tensor(i)?.location {
            Location::Host(p) => Ok(p),
            Location::Device(_) => Err(TensorSetError::WrongKind(
                "a GPU tensor set has no host bytes; read it on the reader's stream",
            )
            .into()),
        }
    }

    /// A copy of tensor `i`'s bytes (host sets).
    ///
    /// # Errors
    /// As [`Held::host_ptr`].
    pub fn read_tensor(&self, i: usize) -> Result<Vec<u8>> {
        let p = self.host_ptr(i)?;
        let n = self.reader.layout.tensors()[i].bytes as usize;
        let mut v = vec![0u8; n];
        // SAFETY: `p..p + n` lies in the held buffer (see `tensor`); the writer does not write it
        // while this guard holds it (the hold's Dekker pair orders its last writes before the
        // take); copied out byte-wise into this process's memory.
        unsafe { std::ptr::copy_nonoverlapping(p, v.as_mut_ptr(), n) };
        Ok(v)
    }

    /// The reader's stream (GPU sets), where the generation is ready.
    ///
    /// # Errors
    /// [`TensorSetError::WrongKind`] on a host set.
    pub fn stream(&self) -> Result<&Stream> {
        self.reader.stream()
    }

    /// The reader's context (GPU sets), as [`TensorSetReader::context`]: where a caller that
    /// could not order the release after its stream synchronises instead (it needs no reader
    /// stream).
    ///
    /// # Errors
    /// [`TensorSetError::WrongKind`] on a host set.
    pub fn context(&self) -> Result<&Arc<Context>> {
        self.reader.context()
    }

    /// Makes `stream` wait on the GPU for this generation (as a channel frame's `ready_on`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host set; CUDA errors.
    pub fn ready_on(&self, stream: &Stream) -> Result<()> {
        match &self.frame {
            Some(f) => f.ready_on(stream),
            None => Ok(()), // writerless: the generation's work completed before the record
        }
    }

    /// Orders this generation's release after the work enqueued so far on `stream` (as a channel
    /// frame's `release_after`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host set; CUDA errors.
    pub fn release_after(&self, stream: &Stream) -> Result<()> {
        match &self.frame {
            Some(f) => f.release_after(stream),
            None => Ok(()), // writerless: nothing writes the memory, nothing to release
        }
    }

    /// [`Held::ready_on`] for a raw `CUstream` (one that PyTorch, CuPy or JAX made).
    ///
    /// # Errors
    /// As [`Held::ready_on`].
    ///
    /// # Safety
    /// As [`Frame::ready_on_raw`]: `stream` is a live stream for the duration of the call, or
    /// null, `CU_STREAM_LEGACY` or `CU_STREAM_PER_THREAD`.
    pub unsafe fn ready_on_raw(&self, stream: sys::CUstream) -> Result<()> {
        match &self.frame {
            // SAFETY: forwarded from this function's contract.
            Some(f) => unsafe { f.ready_on_raw(stream) },
            None => Ok(()),
        }
    }

    /// [`Held::release_after`] for a raw `CUstream`.
    ///
    /// # Errors
    /// As [`Held::release_after`].
    ///
    /// # Safety
    /// As [`Frame::release_after_raw`]: `stream` is a live stream of the reader's context for the
    /// duration of the call, or null, `CU_STREAM_LEGACY` or `CU_STREAM_PER_THREAD`.
    pub unsafe fn release_after_raw(&self, stream: sys::CUstream) -> Result<()> {
        match &self.frame {
            // SAFETY: forwarded from this function's contract.
            Some(f) => unsafe { f.release_after_raw(stream) },
            None => Ok(()),
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if self.reader.fork.inherited() {
            return; // the parent's hold (`identity::fork`)
        }
        let Some(frame) = self.frame.as_mut() else {
            // Writerless: its hold is the reading word of the reader's holder slot.
            if let Source::Writerless(w) = &self.reader.consumer {
                w.unhold();
            }
            return;
        };
        let mut holds = self.reader.holds.lock().unwrap_or_else(|p| p.into_inner());
        holds[self.buffer] = holds[self.buffer].saturating_sub(1);
        if holds[self.buffer] == 0 {
            // SAFETY: the frame is dropped once, here, and never used after (the guard is being
            // dropped). Under the lock, so a take of the same buffer waits for the release.
            unsafe { ManuallyDrop::drop(frame) };
        }
        // Otherwise another guard of this reader holds the same generation in the same buffer:
        // the frame is let go without releasing; the last guard's release (on the same stream,
        // after this guard's work) ends the hold.
    }
}
