//! [`Update`]: a generation being written, handed out by [`TensorSetWriter::begin`](super::TensorSetWriter::begin) until
//! [`Update::commit`].

use super::{Memory, State, copies, tensor_ptr};
use crate::channel::WriteFrame;
use crate::driver::Stream;
use crate::error::{Error, Result, bytes};
use crate::ffi::{check, sys};
use crate::tensorset::DeviceTensor;
use crate::tensorset::content::{self, Fingerprinter, TensorDigest};
use crate::tensorset::encode_meta;
use crate::tensorset::error::TensorSetError;
use crate::tensorset::holders::Recorder;
use crate::tensorset::manifest::Layout;
use crate::tensorset::segment::DataSegment;

/// A generation being written: a buffer no reader holds. Write it (on
/// [`TensorSetWriter::stream`](super::TensorSetWriter::stream) / [`Update::stream`], or through the host accessors), then
/// [`Update::commit`]; dropping it uncommitted gives the buffer back (in place: the generation it
/// held is gone, its bytes may be half-written, and readers see nothing until the next commit).
pub struct Update<'a> {
    /// The set's name (for errors).
    pub(super) name: &'a str,
    pub(super) frame: WriteFrame<'a>,
    pub(super) recorder: Option<&'a mut Recorder>,
    pub(super) memory: &'a Memory,
    pub(super) layout: &'a Layout,
    pub(super) state: &'a mut State,
    /// The buffer being written.
    pub(super) buffer: usize,
    /// The head before this update (the buffer `copy_from_previous` copies from).
    pub(super) previous: Option<usize>,
    /// The writer's content-fingerprint kernel, loaded on first use.
    pub(super) fingerprinter: &'a std::sync::OnceLock<Fingerprinter>,
    /// The writer's many-ranges copy kernel, loaded on first use.
    pub(super) copier: &'a std::sync::OnceLock<Option<copies::RangeCopier>>,
    /// The writer's fork epoch: a forked child's copy of an open update writes, copies and
    /// commits nothing (`identity::fork`).
    pub(super) fork: crate::identity::ForkEpoch,
}

impl std::fmt::Debug for Update<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Update")
            .field("buffer", &self.buffer)
            .field("generation", &self.generation())
            .finish()
    }
}

impl Update<'_> {
    /// The generation this update will publish.
    pub fn generation(&self) -> u64 {
        self.state.generation + 1
    }

    /// The buffer being written.
    pub fn buffer(&self) -> usize {
        self.buffer
    }

    /// The writer's stream (GPU sets).
    ///
    /// # Errors
    /// [`TensorSetError::WrongKind`] on a host set; [`crate::Error::ForkedChild`] in a process
    /// forked from the one that began the update.
    pub fn stream(&self) -> Result<&Stream> {
        self.fork.check("tensor set update")?;
        self.frame
            .producer_stream()
            .ok_or_else(|| TensorSetError::WrongKind("a host tensor set has no stream").into())
    }

    /// The device address of tensor `i` in this update's buffer (GPU sets).
    ///
    /// # Errors
    /// As [`TensorSetWriter::device_ptr`](super::TensorSetWriter::device_ptr).
    pub fn tensor_ptr(&self, i: usize) -> Result<u64> {
        self.fork.check("tensor set update")?;
        tensor_ptr(self.memory, self.layout, self.buffer, i)
    }

    /// Tensor `i` of this update's buffer as device memory in the writer's context (GPU sets), for
    /// kernels on [`Update::stream`].
    ///
    /// # Errors
    /// As [`Update::tensor_ptr`].
    pub fn device_tensor(&self, i: usize) -> Result<DeviceTensor<'_>> {
        let ptr = self.tensor_ptr(i)?;
        Ok(DeviceTensor {
            ptr,
            len: self.layout.tensors()[i].bytes as usize,
            ctx: self.stream()?.context(),
        })
    }

    /// Enqueues on the writer's stream a copy of `len` bytes from device address `src` into
    /// tensor `i` (`cuMemcpyDtoDAsync_v2`). Work on another stream that produced `src` must be
    /// ordered before (e.g. the writer's stream waiting on an event of it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `len` exceeds the tensor's bytes; as
    /// [`Update::tensor_ptr`]; [`Error::Cuda`] naming the copy.
    pub fn copy_in(&self, i: usize, src: u64, len: usize) -> Result<()> {
        self.fork.check("tensor set update")?;
        let dst = self.tensor_ptr(i)?;
        let t = &self.layout.tensors()[i];
        if len as u64 > t.bytes {
            return Err(Error::InvalidArgument(format!(
                "{} into tensor {:?} of {}",
                bytes(len),
                t.name,
                bytes(t.bytes)
            )));
        }
        self.copy_d2d(dst, src, len)
    }

    /// Enqueues on the writer's stream a copy of `len` bytes from device address `src` to byte
    /// `offset` of allocation `allocation` of this update's buffer (`cuMemcpyDtoDAsync_v2`): one
    /// copy for several tensors that lie back to back in both places. Work on another stream
    /// that produced `src` must be ordered before.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an allocation out of range or bytes past its end;
    /// [`TensorSetError::WrongKind`] on a host set; [`Error::Cuda`] naming the copy.
    pub fn copy_into(&self, allocation: usize, offset: u64, src: u64, len: usize) -> Result<()> {
        self.fork.check("tensor set update")?;
        let dst = self.allocation_range(allocation, offset, len as u64)?;
        self.copy_d2d(dst, src, len)
    }

    /// Enqueues on the writer's stream a copy for each of `copies`, `(allocation, offset, src,
    /// len)`: `len` bytes from device address `src` to byte `offset` of allocation `allocation`
    /// of this update's buffer, as [`Update::copy_into`] does one. For a generation written from
    /// many separate sources (a model's parameters): small ranges are copied by a kernel that
    /// takes 160 of them per launch (`kernels/copy.cu`), since one `cuMemcpyDtoDAsync` costs
    /// about 5 µs of device time whatever its size; ranges of 8 MiB or more, fewer than 4 small
    /// ones, or all of them where the kernel cannot be loaded, by one `cuMemcpyDtoDAsync_v2`
    /// each. The kernel is loaded (JIT-compiled from PTX) at the writer's first call that needs
    /// it. Work on another stream that produced the sources must be ordered before.
    ///
    /// Every destination is checked before anything is enqueued, and so is the source of every
    /// range the kernel copies, against what the driver knows of its memory
    /// (`cuPointerGetAttributes`, the ranges taken by address; once per `cuMemAlloc` allocation
    /// touched, once per mapping granule of VMM, pool or managed memory): all its bytes mapped
    /// device memory of the writer's device, of the writer's context or of none (VMM mappings,
    /// memory pools), readable by that device, or managed memory. A range copied by the driver
    /// is checked by the driver; one it refuses as spanning allocations goes to the kernel once
    /// it passed the same check.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an allocation out of range or bytes past its end (nothing
    /// enqueued), or a source that fails the check (nothing enqueued when the kernel would have
    /// copied it; the driver's copies before it stay enqueued when the driver refused it first);
    /// [`TensorSetError::WrongKind`] on a host set; [`Error::Cuda`] naming `cuMemcpyDtoDAsync_v2`
    /// or `cuLaunchKernel` (the copies enqueued before it stay enqueued).
    ///
    /// # Safety
    /// 1. Every source stays allocated until the copies ran on the writer's stream (the check
    ///    above sees the memory as it is now; memory freed before the kernel ran faults it, and a
    ///    kernel fault leaves the context unusable).
    /// 2. No source overlaps a destination of this call other than its own (a range copied onto
    ///    itself is allowed). Where two destinations overlap, which bytes land is unspecified.
    pub unsafe fn copy_many(&self, copies: &[(usize, u64, u64, usize)]) -> Result<()> {
        let ranges = self.ranges_of(copies)?;
        // SAFETY: destinations lie in this update's buffer, which no reader holds (checked by
        // `ranges_of`); sources checked by `copy_ranges` (`check`), kept allocated as this
        // function's contract says.
        unsafe { self.copy_ranges(&ranges, true) }
    }

    /// [`Update::copy_many`] without the check of the sources: for ranges a `copy_many` checked
    /// before (a plan made once and used at every update) whose memory the caller kept allocated
    /// since.
    ///
    /// # Errors
    /// As [`Update::copy_many`], less the sources' check.
    ///
    /// # Safety
    /// 1. As [`Update::copy_many`]'s.
    /// 2. Every source is memory a kernel of the writer's context can read: device (or managed)
    ///    memory of its device, allocated in that context or by VMM or a memory pool with access
    ///    for the device. A bad address faults the kernel, and a kernel fault leaves the context
    ///    unusable.
    pub unsafe fn copy_many_unchecked(&self, copies: &[(usize, u64, u64, usize)]) -> Result<()> {
        let ranges = self.ranges_of(copies)?;
        // SAFETY: destinations checked by `ranges_of`; sources as this function's contract says.
        unsafe { self.copy_ranges(&ranges, false) }
    }

    /// `copies` as device ranges `(dst, src, len)`, every destination checked.
    fn ranges_of(&self, copies: &[(usize, u64, u64, usize)]) -> Result<Vec<copies::Range>> {
        copies
            .iter()
            .map(|&(a, off, src, len)| {
                Ok((self.allocation_range(a, off, len as u64)?, src, len as u64))
            })
            .collect()
    }

    /// Enqueues `ranges` on the writer's stream ([`copies::copy`], the sources checked with
    /// `check`), the kernel loaded at the writer's first call that needs it.
    ///
    /// # Safety
    /// As [`copies::copy`].
    unsafe fn copy_ranges(&self, ranges: &[copies::Range], check: bool) -> Result<()> {
        let stream = self.stream()?;
        let describe = |dst: u64| self.tensor_at(dst);
        // SAFETY: forwarded from this function's contract.
        unsafe {
            copies::copy(
                ranges,
                stream,
                || copies::cached(self.copier, stream.context()),
                check.then_some(&describe as &dyn Fn(u64) -> Option<String>),
            )
        }
    }

    /// `tensor "NAME"` for the tensor of this update's buffer whose bytes hold device address
    /// `dst`, or the allocation and offset where no tensor does (for errors: a scan of the
    /// layout).
    fn tensor_at(&self, dst: u64) -> Option<String> {
        let (a, off) = (0..self.layout.allocations().len()).find_map(|a| {
            let base = self.allocation_range(a, 0, 0).ok()?;
            let off = dst.checked_sub(base)?;
            (off < self.layout.allocations()[a]).then_some((a, off))
        })?;
        let t = self.layout.tensors().iter().find(|t| {
            t.allocation as usize == a
                && (t.offset..t.offset.saturating_add(t.bytes)).contains(&off)
        });
        Some(match t {
            Some(t) => format!("tensor {:?}", t.name),
            None => format!("byte {off} of allocation {a}"),
        })
    }

    /// The device address of byte `offset` of allocation `allocation` of this update's buffer,
    /// checked to have `len` bytes after it.
    fn allocation_range(&self, allocation: usize, offset: u64, len: u64) -> Result<u64> {
        let Memory::Gpu(b) = self.memory else {
            return Err(TensorSetError::WrongKind(
                "a host tensor set has no device addresses; use the host accessors",
            )
            .into());
        };
        let size = self
            .layout
            .allocations()
            .get(allocation)
            .copied()
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "allocation {allocation} of {}",
                    self.layout.allocations().len()
                ))
            })?;
        if offset.checked_add(len).is_none_or(|e| e > size) {
            return Err(Error::InvalidArgument(format!(
                "bytes {offset}+{len} leave allocation {allocation} of {}",
                bytes(size)
            )));
        }
        Ok(b[self.buffer][allocation].device_ptr() + offset)
    }

    fn copy_d2d(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let stream = self.stream()?;
        let _cur = stream.context().enter()?;
        // SAFETY: context current (`_cur`); `dst..dst + len` lies in this update's buffer (checked
        // by the callers), which no reader holds; `src` is a device address the caller vouches
        // for (the driver refuses an unmapped one); the stream lives while the writer does.
        check("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream.as_raw())
        })?;
        Ok(())
    }

    /// Copies the last committed generation's bytes into this buffer (buffered sets: start an
    /// update from the previous generation and change part of it). On a GPU set the copies are
    /// enqueued on the writer's stream (`cuMemcpyDtoDAsync_v2`, one per allocation). Nothing to do
    /// in place or before the first commit.
    ///
    /// The previous generation's buffer may be read by readers meanwhile (reads only); the
    /// writer never writes it while it is the newest.
    ///
    /// # Errors
    /// [`Error::Cuda`] naming the copy.
    pub fn copy_from_previous(&mut self) -> Result<()> {
        self.fork.check("tensor set update")?;
        let Some(p) = self.previous.filter(|&p| p != self.buffer) else {
            return Ok(());
        };
        match self.memory {
            Memory::Host(d) => {
                let len = self.layout.bytes_per_buffer() as usize;
                // SAFETY: both buffers lie in the data segment's mapping (`p`, `buffer` < B, each
                // `stride >= len` bytes) and do not overlap; the writer alone writes `buffer`
                // now (WRITING), and nobody writes `p` while it is the newest generation.
                unsafe { std::ptr::copy_nonoverlapping(d.ptr(p), d.ptr(self.buffer), len) };
                Ok(())
            }
            Memory::Gpu(b) => {
                for (a, len) in self.layout.allocations().iter().enumerate() {
                    self.copy_d2d(
                        b[self.buffer][a].device_ptr(),
                        b[p][a].device_ptr(),
                        *len as usize,
                    )?;
                }
                Ok(())
            }
        }
    }

    /// Copies byte ranges of the last committed generation into the same places of this buffer:
    /// `(allocation, offset, len)` each, in bytes (a tensor set's bridge fills the tensors a
    /// generation did not change this way). On a GPU set the copies are enqueued on the writer's
    /// stream as [`Update::copy_many`] enqueues them (a kernel for many small ranges,
    /// `cuMemcpyDtoDAsync_v2` for the others); on a host set they are made at once.
    /// Nothing to do in place or before the first commit (the bytes are there, or there are none),
    /// but the ranges are checked all the same.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside its allocation (in every mode, before any
    /// copy); [`Error::Cuda`] naming the copy.
    pub fn copy_ranges_from_previous(&mut self, ranges: &[(usize, u64, u64)]) -> Result<()> {
        self.fork.check("tensor set update")?;
        let sizes = self.layout.allocations();
        // Every range checked first, in every mode: one outside its allocation is an error
        // whether or not there is anything to copy.
        for &(a, off, len) in ranges {
            if sizes
                .get(a)
                .is_none_or(|&size| off.checked_add(len).is_none_or(|e| e > size))
            {
                return Err(Error::InvalidArgument(format!(
                    "bytes {off}+{len} of allocation {a} (of {})",
                    sizes.len()
                )));
            }
        }
        let Some(p) = self.previous.filter(|&p| p != self.buffer) else {
            return Ok(());
        };
        let mut gpu: Vec<copies::Range> = Vec::new();
        for &(a, off, len) in ranges {
            match self.memory {
                Memory::Host(d) => {
                    // Allocation 0 is the whole buffer of a host set; both buffers lie in the
                    // data segment's mapping and do not overlap.
                    // SAFETY: `off + len` is within the buffer and its stride (checked above);
                    // only this writer writes `buffer` now (WRITING), nobody writes newest `p`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            d.ptr(p).add(off as usize),
                            d.ptr(self.buffer).add(off as usize),
                            len as usize,
                        )
                    };
                }
                Memory::Gpu(b) => gpu.push((
                    b[self.buffer][a].device_ptr() + off,
                    b[p][a].device_ptr() + off,
                    len,
                )),
            }
        }
        if gpu.is_empty() {
            return Ok(());
        }
        // SAFETY: each range lies in allocation `a` of this update's buffer and of the previous
        // generation's (checked above), both this writer's memory in its context, different
        // buffers (`p != buffer`), so no source overlaps a destination.
        unsafe { self.copy_ranges(&gpu, false) }
    }

    fn host(&self) -> Result<&DataSegment> {
        self.fork.check("tensor set update")?;
        match self.memory {
            Memory::Host(d) => Ok(d),
            Memory::Gpu(_) => Err(TensorSetError::WrongKind(
                "a GPU tensor set has no host bytes; write on the stream",
            )
            .into()),
        }
    }

    /// The first byte of this update's host buffer (host sets), valid for the layout's
    /// [`Layout::bytes_per_buffer`] bytes until the update is committed or dropped. A raw pointer,
    /// as a channel frame's: the bytes are shared memory other processes map.
    ///
    /// # Errors
    /// [`TensorSetError::WrongKind`] on a GPU set.
    pub fn as_mut_ptr(&self) -> Result<*mut u8> {
        Ok(self.host()?.ptr(self.buffer))
    }

    /// Copies `src` into tensor `i` from its first byte (host sets).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `src` is longer than the tensor; as
    /// [`Update::as_mut_ptr`]; [`TensorSetError::NoSuchTensor`].
    pub fn write_tensor(&mut self, i: usize, src: &[u8]) -> Result<()> {
        let t = self
            .layout
            .tensors()
            .get(i)
            .ok_or_else(|| TensorSetError::NoSuchTensor(i.to_string()))?;
        if src.len() as u64 > t.bytes {
            return Err(Error::InvalidArgument(format!(
                "{} into tensor {:?} of {}",
                bytes(src.len()),
                t.name,
                bytes(t.bytes)
            )));
        }
        let offset = t.offset as usize;
        self.write_at(offset, src)
    }

    /// Copies `src` into this update's host buffer at byte `offset` (host sets).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] past the buffer's end; as [`Update::as_mut_ptr`].
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        let len = self.layout.bytes_per_buffer() as usize;
        if offset.checked_add(src.len()).is_none_or(|e| e > len) {
            return Err(Error::InvalidArgument(format!(
                "bytes {offset}+{} leave the {len}-byte buffer",
                src.len()
            )));
        }
        let dst = self.as_mut_ptr()?;
        // SAFETY: `offset + src.len() <= len <= stride` (checked above), so the range lies in this
        // buffer of the mapping; no reader holds it while it is WRITING; `src` is this process's
        // memory and does not overlap shared memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.add(offset), src.len()) };
        Ok(())
    }

    /// Makes `stream` wait on the GPU for the writer's stream (which waits for the buffer's last
    /// readers): work enqueued on `stream` afterwards may write the update's buffer (as a channel
    /// write frame's [`WriteFrame::ready_on`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host set; [`Error::Cuda`] naming `cuEventRecord` or
    /// `cuStreamWaitEvent`.
    pub fn ready_on(&self, stream: &Stream) -> Result<()> {
        self.frame.ready_on(stream)
    }

    /// [`Update::ready_on`] for a raw `CUstream` (one that PyTorch, CuPy or JAX made).
    ///
    /// # Errors
    /// As [`Update::ready_on`].
    ///
    /// # Safety
    /// As [`WriteFrame::ready_on_raw`]: `stream` is a live stream for the duration of the call, or
    /// null, `CU_STREAM_LEGACY` or `CU_STREAM_PER_THREAD`.
    pub unsafe fn ready_on_raw(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.frame.ready_on_raw(stream) }
    }

    /// Makes the writer's stream wait on the GPU for the work enqueued so far on `stream`, so the
    /// generation's ready word (written at commit) comes after it (as a channel write frame's
    /// [`WriteFrame::publish_after`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a host set; [`Error::Cuda`] naming `cuEventRecord` (a stream
    /// of another context) or `cuStreamWaitEvent`.
    pub fn publish_after(&self, stream: &Stream) -> Result<()> {
        self.frame.publish_after(stream)
    }

    /// [`Update::publish_after`] for a raw `CUstream`.
    ///
    /// # Errors
    /// As [`Update::publish_after`].
    ///
    /// # Safety
    /// As [`WriteFrame::publish_after_raw`]: `stream` is a live stream of the writer's context for
    /// the duration of the call, or null, `CU_STREAM_LEGACY` or `CU_STREAM_PER_THREAD`.
    pub unsafe fn publish_after_raw(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.frame.publish_after_raw(stream) }
    }

    /// The content digest of each tensor of this update's buffer, as the work so far leaves it
    /// ([`content`]): on a GPU set computed by a kernel on the writer's stream after the work
    /// enqueued there (work on other streams must be ordered before it with
    /// [`Update::publish_after`]), waiting for it (about one pass over the set's bytes at the
    /// device's memory bandwidth); on a host set computed on the host.
    ///
    /// # Errors
    /// As [`content::Fingerprinter::digests`]; the kernel's loading at the first call
    /// ([`content::Fingerprinter::new`]); [`crate::Error::ForkedChild`] in a process forked from
    /// the one that began the update (as every read and write of it).
    pub fn tensor_digests(&self) -> Result<Vec<TensorDigest>> {
        self.fork.check("tensor set update")?;
        let n = self.layout.len();
        match self.memory {
            Memory::Gpu(_) => {
                let stream = self.stream()?;
                let f = content::cached(self.fingerprinter, stream.context())?;
                let tensors = (0..n)
                    .map(|i| self.device_tensor(i))
                    .collect::<Result<Vec<_>>>()?;
                f.digests(&tensors, stream)
            }
            Memory::Host(d) => {
                // SAFETY: this update's buffer of the data segment's mapping, which lives as long
                // as the writer.
                Ok(unsafe { content::host_digests(d.ptr(self.buffer), self.layout) })
            }
        }
    }

    /// The generation's content fingerprint as the work so far leaves it
    /// ([`content::set_fingerprint`] over [`Update::tensor_digests`]).
    ///
    /// # Errors
    /// As [`Update::tensor_digests`].
    pub fn fingerprint(&self) -> Result<[u8; 32]> {
        content::set_fingerprint(self.layout, &self.tensor_digests()?)
    }

    /// Publishes the generation with its content fingerprint computed from its bytes
    /// ([`Update::fingerprint`], then [`Update::commit_with_content`]), which readers can check
    /// ([`crate::tensorset::Held::verify_content`]) or demand
    /// ([`crate::tensorset::ReaderOptions::expect_content`]). Returns the generation number and
    /// the fingerprint. On a GPU set the commit waits for the writer's stream (the kernel's
    /// result), where [`Update::commit`] does not.
    ///
    /// # Errors
    /// As [`Update::fingerprint`]: nothing is published then, and the update is dropped, its
    /// buffer given back (in place, the generation it held is gone, as after any abandoned
    /// update). To keep the update when the fingerprint fails (and retry or abort it yourself),
    /// call [`Update::fingerprint`] first and commit with [`Update::commit_with_content`]. As
    /// [`Update::commit_with_content`].
    pub fn commit_fingerprinted(self) -> Result<(u64, [u8; 32])> {
        let fp = self.fingerprint()?;
        Ok((self.commit_with_content(fp)?, fp))
    }

    /// Publishes the generation with no content fingerprint; returns its number.
    ///
    /// # Errors
    /// As [`Update::commit_with_content`].
    pub fn commit(self) -> Result<u64> {
        self.commit_with_content([0; 32])
    }

    /// Publishes the generation with `content` (its content fingerprint, all zeros: none), which
    /// readers can demand ([`crate::tensorset::ReaderOptions::expect_content`]): readers waiting wake, and
    /// on a GPU set their streams wait for the writer's stream's ready word, written after the
    /// update's work. Returns the generation number.
    ///
    /// # Errors
    /// [`TensorSetError::Closed`] when a [`super::Closer`] withdrew the generations meanwhile
    /// (nothing is published; the buffer is given back); CUDA errors from enqueuing the ready
    /// word's write (the generation is published and marked ready from the host once the
    /// writer's stream drained).
    pub fn commit_with_content(self, content: [u8; 32]) -> Result<u64> {
        self.fork.check("tensor set update")?;
        let meta = encode_meta(self.generation(), &content, 0);
        // VMM sets: an event after the update's work, for the holders' whole-generation record.
        let event = match (&self.recorder, self.frame.producer_stream()) {
            (Some(r), Some(s)) => r.event_after(s),
            _ => None,
        };
        let state = self.state;
        let buffer = self.buffer;
        let seq = state.base
            + self
                .frame
                .publish(&meta)
                .map_err(|e| super::closed_error(self.name, e))?;
        state.generation = seq;
        state.head = Some(buffer);
        if let (Some(r), Some(ev)) = (self.recorder, event) {
            r.committed(ev, seq, buffer, content);
        }
        Ok(seq)
    }
}
