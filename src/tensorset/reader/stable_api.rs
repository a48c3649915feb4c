//! A tensor-set reader's stable addresses ([`ReaderOptions::stable_addresses`]): the checks at
//! open, the switch of a held generation to the stable ranges, the stable pointers, the release
//! of the stable generation, and the reader's drop that closes them first.

use super::*;

impl TensorSetReader {
    /// Refuses [`ReaderOptions::stable_addresses`] on a set whose memory cannot be mapped at a
    /// second address (before anything is imported).
    pub(super) fn check_stable(opts: &ReaderOptions, kind: u32) -> Result<()> {
        if !opts.stable_addresses || kind == KIND_VMM {
            return Ok(());
        }
        Err(TensorSetError::WrongKind(if kind == KIND_HOST {
            "a host tensor set has no device addresses to keep stable (stable addresses need a VMM set)"
        } else {
            "stable addresses need a VMM tensor set: pool and legacy memory cannot be mapped at a second address"
        })
        .into())
    }

    /// The stable addresses of a reader opened with [`ReaderOptions::stable_addresses`]: one
    /// reserved range per allocation of a buffer (after the imports, in the same context).
    pub(super) fn open_stable(
        ctx: Option<&Arc<Context>>,
        opts: &ReaderOptions,
        memory: &Memory,
        read_only: bool,
    ) -> Result<Option<Stable>> {
        match (opts.stable_addresses, ctx, memory) {
            (false, ..) => Ok(None),
            (true, Some(ctx), Memory::Gpu(imports)) => {
                Ok(Some(Stable::open(ctx, imports, read_only)?))
            }
            _ => Err(TensorSetError::WrongKind(
                "a host tensor set has no device addresses to keep stable",
            )
            .into()),
        }
    }

    fn stable(&self) -> Result<&Stable> {
        self.stable.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "the reader was opened without stable addresses (ReaderOptions::stable_addresses; stable_addresses=True in Python)".into(),
            )
        })
    }

    /// Maps `held`'s generation at this reader's stable addresses (the same addresses for the
    /// reader's life: [`TensorSetReader::stable_ptr`]), so that CUDA graphs captured over them
    /// read it; consumes the guard, whose hold the reader keeps while the generation is there.
    ///
    /// Buffered sets (B ≥ 2): when `held` lies in another buffer than the generation mapped
    /// there, waits for all work of the reader's context to finish (`cuCtxSynchronize`: every
    /// stream, so no kernel still reads the old generation, and the new one is ready), then per
    /// allocation takes the allocation handle behind the buffer's own mapping
    /// (`cuMemRetainAllocationHandle`), unmaps the stable range (`cuMemUnmap`), maps the handle
    /// there (`cuMemMap`), grants the reader's access again (`cuMemSetAccess`, read-only when
    /// [`TensorSetReader::is_read_only`]) and releases the retained handle (`cuMemRelease`), and
    /// only then releases the previous stable generation's hold (its release word on the
    /// reader's stream). The same buffer again (the same generation, since a held buffer is not
    /// rewritten) maps nothing. In-place sets (B = 1): the stable addresses are the buffer's own
    /// (the same as [`Held::device_ptr`]); nothing is mapped, the hold is kept all the same.
    /// When the call returns, the generation at the stable addresses is ready for work on any
    /// stream of the context.
    ///
    /// The hold kept: the writer never rewrites the stable generation while it is there. A
    /// buffered writer has B − 1 buffers left (a reader that also holds a newer guard pins two);
    /// an in-place writer waits in [`TensorSetWriter::begin`](crate::tensorset::TensorSetWriter::begin) until the reader lets it go
    /// ([`TensorSetReader::release_stable`]), takes the newer generation and switches to it.
    ///
    /// The caller must not launch work over the stable addresses from other threads during
    /// the call (the wait covers the work enqueued before it). The wait is the whole
    /// context's: switch when no work of the context waits on the GPU for another process
    /// (a posted channel receive, a collective whose peers have not joined), or the switch
    /// waits with it. Other guards of the old stable
    /// generation may stay alive (the reader counts its holds per buffer); switches from several
    /// threads are serialised. Before the first switch nothing is mapped at the stable addresses
    /// (graphs may be captured over them, not run).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the reader was opened without
    /// [`ReaderOptions::stable_addresses`], or `held` is another reader's (the guard is released);
    /// [`Error::Cuda`] naming `cuCtxSynchronize` / `cuStreamSynchronize` (failed work of the
    /// context: nothing changed, the guard released), or `cuMemRetainAllocationHandle`, `cuMemUnmap`, `cuMemMap`,
    /// `cuMemSetAccess`: then nothing is left at the stable addresses (their reads fault, they
    /// do not read memory the writer may rewrite), both holds are released and
    /// [`TensorSetReader::stable_generation`] is `None`; a later switch maps again.
    ///
    /// # Examples
    /// ```no_run
    /// use cuda_ipc::driver::Context;
    /// use cuda_ipc::tensorset::{ReaderOptions, TensorSetReader};
    /// let ctx = Context::default_device()?;
    /// let r = TensorSetReader::open(&ctx, "weights", &ReaderOptions::new().stable_addresses(true))?;
    /// let first = r.wait_newer(0, None)?;
    /// let mut last = first.generation();
    /// r.switch_stable(first)?;
    /// let w0 = r.stable_ptr(0)?; // capture graphs over the stable addresses once
    /// for _ in 0..100 {
    ///     let next = r.wait_newer(last, None)?;
    ///     last = next.generation();
    ///     let s = r.switch_stable(next)?; // between steps, never under the graphs' kernels
    ///     assert_eq!(r.stable_ptr(0)?, w0);
    ///     println!("generation {} in {} us", s.generation, s.micros);
    /// }
    /// # Ok::<(), cuda_ipc::Error>(())
    /// ```
    #[doc(alias = "cuMemMap")]
    #[doc(alias = "cuMemRetainAllocationHandle")]
    pub fn switch_stable(&self, held: Held<'_>) -> Result<StableSwitch> {
        let stable = self.stable()?;
        if !std::ptr::eq(held.reader, self) {
            return Err(Error::InvalidArgument(
                "switch_stable takes a generation this reader holds, not another reader's".into(),
            ));
        }
        let Memory::Gpu(imports) = &self.memory else {
            return Err(
                TensorSetError::WrongKind("a host tensor set has no stable addresses").into(),
            );
        };
        let stream = self.stream()?;
        let Some(detached) = held.detach() else {
            return Err(Error::InvalidArgument(
                "a writerless reader (opened after its writer died) keeps its one generation at \
                 the addresses it has: there is nothing to switch"
                    .into(),
            ));
        };
        stable.switch(imports, stream, detached, &|b, h| {
            self.release_detached(b, h)
        })
    }

    /// The stable device address of tensor `i` (readers opened with
    /// [`ReaderOptions::stable_addresses`]): the same for the reader's life; the generation
    /// [`TensorSetReader::switch_stable`] mapped there is [`TensorSetReader::stable_generation`].
    ///
    /// # Errors
    /// [`TensorSetError::NoSuchTensor`]; [`Error::InvalidArgument`] without stable addresses.
    pub fn stable_ptr(&self, i: usize) -> Result<u64> {
        self.stable()?.ptr(&self.layout, i)
    }

    /// Tensor `i` at its stable address as device memory in the reader's context, for kernels
    /// and graph captures; what it reads is the generation switched there (nothing before the
    /// first switch, or after [`TensorSetReader::release_stable`]).
    ///
    /// # Errors
    /// As [`TensorSetReader::stable_ptr`].
    pub fn stable_tensor(&self, i: usize) -> Result<crate::tensorset::DeviceTensor<'_>> {
        let ptr = self.stable_ptr(i)?;
        Ok(crate::tensorset::DeviceTensor {
            ptr,
            len: self.layout.tensors()[i].bytes as usize,
            ctx: self.context()?,
        })
    }

    /// The generation at the stable addresses; `None` before the first switch, after
    /// [`TensorSetReader::release_stable`] or a failed switch, and without stable addresses.
    pub fn stable_generation(&self) -> Option<u64> {
        self.stable.as_ref().and_then(Stable::generation)
    }

    /// Lets the stable generation go: waits for all work of the reader's context
    /// (`cuCtxSynchronize`), unmaps the stable ranges (buffered sets; in place the addresses are
    /// the buffer's own and stay mapped, but the writer may now rewrite them) and releases the
    /// hold. The reservation stays for the next switch. `Ok(false)` when nothing was held.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] without stable addresses; [`Error::Cuda`] naming
    /// `cuCtxSynchronize` or `cuMemUnmap` (the hold is then kept).
    pub fn release_stable(&self) -> Result<bool> {
        self.stable()?.release(&|b, h| self.release_detached(b, h))
    }

    /// Releases a hold detached from a guard of buffer `buffer` (as [`Held`]'s drop does).
    fn release_detached(&self, buffer: usize, hold: FrameHold) {
        let mut holds = self.holds.lock().unwrap_or_else(|p| p.into_inner());
        holds[buffer] = holds[buffer].saturating_sub(1);
        if holds[buffer] == 0 {
            // Under the lock, so a take of the same buffer waits for the release. (A writerless
            // reader's guards hold nothing: no hold is detached from them.)
            if let Source::Channel(c) = &self.consumer {
                c.release_hold(hold);
            }
        }
        // Otherwise a guard of this reader holds the same generation: its last drop releases.
    }
}

impl Held<'_> {
    /// (buffer, generation, the frame's hold) without releasing anything: the reader's count of
    /// holds of the buffer now counts the returned hold ([`TensorSetReader::release_detached`]).
    /// `None` for a writerless reader's guard, which holds nothing.
    fn detach(self) -> Option<(usize, u64, FrameHold)> {
        let mut me = ManuallyDrop::new(self);
        let frame = me.frame.take()?;
        Some((
            me.buffer,
            me.generation,
            ManuallyDrop::into_inner(frame).detach(),
        ))
    }
}

impl Drop for TensorSetReader {
    fn drop(&mut self) {
        if self.fork.inherited() {
            return; // the parent's mappings and holds (`identity::fork`)
        }
        if let Some(stable) = self.stable.take() {
            stable.close(&|b, h| self.release_detached(b, h));
        }
    }
}
