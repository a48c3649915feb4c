//! Tensor-set guards that own their end: an [`OwnedHeld`] keeps its [`TensorSetReader`] alive
//! through an `Arc`, an [`OwnedUpdate`] owns its [`TensorSetWriter`] until it is committed or
//! given back.
//!
//! Owns: nothing of the protocol. Each type wraps the borrowed [`Held`] or [`Update`] unchanged,
//! so holds, releases and commits behave exactly as there; only who keeps the owner alive
//! differs. For bindings (Python) whose objects cannot carry a Rust lifetime, as
//! [`crate::channel::owned`] is for channel frames.

use super::{Held, StableSwitch, TensorSetReader, TensorSetWriter, Update};
use crate::error::{Error, Result};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

/// A held generation that keeps its reader alive; dropping it releases the generation as
/// dropping a [`Held`] does.
pub struct OwnedHeld {
    // Drop order: the guard (its release uses the reader) before the reader reference. The
    // `'static` is never handed out: `held()` shortens it to the borrow of `self`.
    held: Held<'static>,
    reader: Arc<TensorSetReader>,
}

impl std::fmt::Debug for OwnedHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.held.fmt(f)
    }
}

impl OwnedHeld {
    fn own(reader: &Arc<TensorSetReader>, held: Held<'_>) -> OwnedHeld {
        // The guard borrows `**reader` in the `Arc`'s allocation, which does not move, and the
        // clone stored beside it outlives the guard (field order); an `Arc` hands out no `&mut`.
        // `held()` returns `&Held<'_>` bounded by `&self` (`Held` is covariant).
        // SAFETY: as above, the extended shared borrow outlives nothing it points to.
        let held = unsafe { std::mem::transmute::<Held<'_>, Held<'static>>(held) };
        OwnedHeld {
            held,
            reader: reader.clone(),
        }
    }

    /// The newest generation of `reader`, as [`TensorSetReader::current`].
    ///
    /// # Errors
    /// As [`TensorSetReader::current`].
    pub fn current(reader: &Arc<TensorSetReader>) -> Result<Option<OwnedHeld>> {
        Ok(reader.current()?.map(|h| Self::own(reader, h)))
    }

    /// A generation of `reader` newer than `than`, waiting up to `timeout` (`None`: no bound);
    /// `Ok(None)` when the timeout ran out.
    ///
    /// # Errors
    /// As [`TensorSetReader::wait_newer`], except [`Error::Timeout`].
    pub fn wait_newer(
        reader: &Arc<TensorSetReader>,
        than: u64,
        timeout: Option<Duration>,
    ) -> Result<Option<OwnedHeld>> {
        match reader.wait_newer(than, timeout) {
            Ok(h) => Ok(Some(Self::own(reader, h))),
            Err(Error::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The guard.
    pub fn held(&self) -> &Held<'_> {
        &self.held
    }

    /// The reader it came from.
    pub fn reader(&self) -> &Arc<TensorSetReader> {
        &self.reader
    }

    /// Maps this generation at its reader's stable addresses, as
    /// [`TensorSetReader::switch_stable`], which consumes the guard: the reader keeps its hold
    /// while the generation is there.
    ///
    /// # Errors
    /// As [`TensorSetReader::switch_stable`] (the guard is released on an error).
    pub fn switch_stable(self) -> Result<StableSwitch> {
        // The guard borrows `*reader`; the local `reader` outlives the call that consumes it.
        let OwnedHeld { held, reader } = self;
        reader.switch_stable(held)
    }
}

/// A generation being written that owns its writer: [`commit`](OwnedUpdate::commit) or
/// [`into_writer`](OwnedUpdate::into_writer) hands the writer back. Dropping it gives the buffer
/// back uncommitted and frees the writer (which closes the set, as dropping a
/// [`TensorSetWriter`] does).
pub struct OwnedUpdate {
    // Drop order: the update (which gives the buffer back through the writer) before the writer,
    // which `Drop` frees last. `'static` never escapes (`update()` shortens it).
    update: Option<Update<'static>>,
    /// From `Box::leak`; turned back into the `Box` exactly once (`take_writer` or `Drop`). Never
    /// dereferenced while `update` holds its `&mut`.
    writer: NonNull<TensorSetWriter>,
}

// SAFETY: the value owns the writer (and the update borrowing it) uniquely, as a
// `Box<TensorSetWriter>` would; moving it to another thread moves that ownership, which is sound
// as `TensorSetWriter: Send` (asserted below).
unsafe impl Send for OwnedUpdate {}

const _: () = {
    const fn send<T: Send>() {}
    send::<TensorSetWriter>();
};

impl std::fmt::Debug for OwnedUpdate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedUpdate")
            .field("update", &self.update)
            .finish_non_exhaustive()
    }
}

impl OwnedUpdate {
    /// Takes a buffer of `writer` to write, as [`TensorSetWriter::begin`] (`timeout`: `None`
    /// waits forever).
    ///
    /// # Errors
    /// As [`TensorSetWriter::begin`]; the writer comes back with the error.
    pub fn begin(
        writer: Box<TensorSetWriter>,
        timeout: Option<Duration>,
    ) -> std::result::Result<OwnedUpdate, (Box<TensorSetWriter>, Error)> {
        Self::begin_with(writer, timeout, false)
    }

    /// [`OwnedUpdate::begin`] by [`TensorSetWriter::begin_slice`]: a timeout leaves an in-place
    /// generation reserved for the next slice (the writer that comes back gives it back with
    /// [`TensorSetWriter::give_back_reservation`] when its caller stops waiting).
    ///
    /// # Errors
    /// As [`TensorSetWriter::begin_slice`]; the writer comes back with the error.
    pub fn begin_slice(
        writer: Box<TensorSetWriter>,
        timeout: Option<Duration>,
    ) -> std::result::Result<OwnedUpdate, (Box<TensorSetWriter>, Error)> {
        Self::begin_with(writer, timeout, true)
    }

    fn begin_with(
        writer: Box<TensorSetWriter>,
        timeout: Option<Duration>,
        slice: bool,
    ) -> std::result::Result<OwnedUpdate, (Box<TensorSetWriter>, Error)> {
        let ptr = NonNull::from(Box::leak(writer));
        // The `&mut` lives as long as the update, which `OwnedUpdate` drops before it turns the
        // pointer back into a `Box` (field order, `take_writer`, `Drop`); on error it ends here.
        // SAFETY: `ptr` came from `Box::leak` just now and nothing else refers to the writer.
        let begun = unsafe {
            if slice {
                (*ptr.as_ptr()).begin_slice(timeout)
            } else {
                (*ptr.as_ptr()).begin(timeout)
            }
        };
        match begun {
            Ok(update) => {
                // SAFETY: as above; the update's borrow of `*ptr` is extended to the life of
                // `Self`, during which the pointer is not used (see the `writer` field).
                let update = unsafe { std::mem::transmute::<Update<'_>, Update<'static>>(update) };
                Ok(OwnedUpdate {
                    update: Some(update),
                    writer: ptr,
                })
            }
            // SAFETY: `ptr` came from `Box::leak`; the borrow taken by `begin` has ended.
            Err(e) => Err((unsafe { Box::from_raw(ptr.as_ptr()) }, e)),
        }
    }

    /// The update.
    pub fn update(&self) -> &Update<'_> {
        self.update
            .as_ref()
            .expect("an OwnedUpdate holds its update until it is consumed")
    }

    /// Copies the last committed generation into this buffer, as [`Update::copy_from_previous`].
    /// (No `update_mut`: a `&mut` of the update would let two owned updates swap the writers
    /// they borrow.)
    ///
    /// # Errors
    /// As [`Update::copy_from_previous`].
    pub fn copy_from_previous(&mut self) -> Result<()> {
        self.update
            .as_mut()
            .expect("an OwnedUpdate holds its update until it is consumed")
            .copy_from_previous()
    }

    /// Copies `src` into tensor `i` (host sets), as [`Update::write_tensor`].
    ///
    /// # Errors
    /// As [`Update::write_tensor`].
    pub fn write_tensor(&mut self, i: usize, src: &[u8]) -> Result<()> {
        self.update
            .as_mut()
            .expect("an OwnedUpdate holds its update until it is consumed")
            .write_tensor(i, src)
    }

    /// Copies `src` into the host buffer at byte `offset`, as [`Update::write_at`].
    ///
    /// # Errors
    /// As [`Update::write_at`].
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.update
            .as_mut()
            .expect("an OwnedUpdate holds its update until it is consumed")
            .write_at(offset, src)
    }

    /// Commits as [`Update::commit_with_content`] and hands the writer back with the result.
    pub fn commit(mut self, content: [u8; 32]) -> (Box<TensorSetWriter>, Result<u64>) {
        let update = self.update.take().expect("update present until consumed");
        let generation = update.commit_with_content(content);
        (self.take_writer(), generation)
    }

    /// Commits as [`Update::commit_fingerprinted`] and hands the writer back with the result
    /// (nothing is published when the fingerprint fails).
    pub fn commit_fingerprinted(mut self) -> (Box<TensorSetWriter>, Result<(u64, [u8; 32])>) {
        let update = self.update.take().expect("update present until consumed");
        let r = update.commit_fingerprinted();
        (self.take_writer(), r)
    }

    /// Gives the buffer back uncommitted and hands the writer back.
    pub fn into_writer(mut self) -> Box<TensorSetWriter> {
        drop(self.update.take());
        self.take_writer()
    }

    fn take_writer(self) -> Box<TensorSetWriter> {
        debug_assert!(self.update.is_none());
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: the pointer came from `Box::leak` in `begin`; the update that borrowed it is
        // gone (callers take it first), and `ManuallyDrop` keeps `Drop` from freeing it again.
        unsafe { Box::from_raw(this.writer.as_ptr()) }
    }
}

impl Drop for OwnedUpdate {
    fn drop(&mut self) {
        drop(self.update.take());
        // SAFETY: the pointer came from `Box::leak` in `begin` and was not turned back into a
        // `Box` (`take_writer` skips this `Drop`); the update that borrowed it was dropped above.
        drop(unsafe { Box::from_raw(self.writer.as_ptr()) });
    }
}
