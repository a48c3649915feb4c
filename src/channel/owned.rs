//! Frames that own their end of the channel: an [`OwnedFrame`] keeps its [`Consumer`] alive through
//! an `Arc`, an [`OwnedWriteFrame`] owns its [`Producer`] until it is published or given back, an
//! [`OwnedPosted`] (a receive posted ahead) keeps its [`Consumer`] alive through an `Arc`.
//!
//! Owns: nothing of the protocol. Each type wraps the borrowed [`Frame`] (`consumer.rs`),
//! [`Posted`] (`consumer/posted.rs`) or [`WriteFrame`] (`producer.rs`) unchanged, so holds, releases and publishing behave exactly as there; only who keeps
//! the owner alive differs. For bindings (Python, other languages) whose objects cannot carry a
//! Rust lifetime, and for frames that move between threads with their owner.

use super::{Consumer, Frame, Posted, PostedFrame, Producer, WriteFrame};
use crate::error::{Error, Result};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

/// A received frame that keeps its consumer alive; dropping it releases the frame as dropping a
/// [`Frame`] does (release event recorded on the consumer's stream, hold ended).
///
/// # Examples
/// ```no_run
/// use cuda_ipc::channel::{Consumer, ConsumerOptions, owned::OwnedFrame};
/// use std::sync::Arc;
/// let rx = Arc::new(Consumer::attach("frames", &ConsumerOptions::new())?);
/// if let Some(frame) = OwnedFrame::recv(&rx, Some(std::time::Duration::from_millis(100)))? {
///     println!("frame {} ({} bytes of metadata)", frame.frame().seq(), frame.frame().metadata().len());
/// }
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub struct OwnedFrame {
    // Drop order: the frame (its release, which uses the consumer) before the consumer reference.
    // The `'static` is never handed out: `frame()` shortens it to the borrow of `self`.
    frame: Frame<'static>,
    consumer: Arc<Consumer>,
}

impl std::fmt::Debug for OwnedFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.frame.fmt(f)
    }
}

impl OwnedFrame {
    fn own(consumer: &Arc<Consumer>, frame: Frame<'_>) -> OwnedFrame {
        // SAFETY: the frame borrows `**consumer`, which lives in the `Arc`'s allocation: its address
        // does not change when the `Arc` moves, and the clone stored beside the frame keeps it
        // alive until after the frame is dropped (field order). Only shared references to the
        // consumer exist (an `Arc` hands out no `&mut`), so extending the shared borrow aliases
        // nothing mutably. The extended lifetime never escapes: `frame()` returns `&Frame<'_>`
        // bounded by `&self` (`Frame` is covariant in its lifetime).
        let frame = unsafe { std::mem::transmute::<Frame<'_>, Frame<'static>>(frame) };
        OwnedFrame {
            frame,
            consumer: consumer.clone(),
        }
    }

    /// Waits up to `timeout` (`None`: forever) for the next frame of `consumer`; `Ok(None)` when
    /// the timeout ran out.
    ///
    /// # Errors
    /// As [`Consumer::recv_timeout`], except [`Error::Timeout`].
    pub fn recv(consumer: &Arc<Consumer>, timeout: Option<Duration>) -> Result<Option<OwnedFrame>> {
        let frame = match timeout {
            None => consumer.recv(),
            Some(t) => consumer.recv_timeout(t),
        };
        match frame {
            Ok(f) => Ok(Some(Self::own(consumer, f))),
            Err(Error::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The next frame of `consumer` if one is ready now.
    ///
    /// # Errors
    /// As [`Consumer::try_recv`].
    pub fn try_recv(consumer: &Arc<Consumer>) -> Result<Option<OwnedFrame>> {
        Ok(consumer.try_recv()?.map(|f| Self::own(consumer, f)))
    }

    /// The frame.
    pub fn frame(&self) -> &Frame<'_> {
        &self.frame
    }

    /// The consumer it came from.
    pub fn consumer(&self) -> &Arc<Consumer> {
        &self.consumer
    }
}

/// A buffer being written that owns its producer: [`publish`](OwnedWriteFrame::publish) or
/// [`into_producer`](OwnedWriteFrame::into_producer) hands the producer back. Dropping it gives the
/// buffer back unpublished and frees the producer (which closes the channel, as dropping a
/// [`Producer`] does).
///
/// # Examples
/// ```no_run
/// use cuda_ipc::channel::{ChannelOptions, Producer, owned::OwnedWriteFrame};
/// use cuda_ipc::driver::Context;
/// let ctx = Context::default_device()?;
/// let tx = Box::new(Producer::create(&ctx, "frames", &ChannelOptions::new(1 << 20))?);
/// let frame = OwnedWriteFrame::acquire(tx, None).map_err(|(_, e)| e)?;
/// let (tx, seq) = frame.publish(b"frame 0");
/// println!("published frame {}", seq?);
/// # drop(tx);
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub struct OwnedWriteFrame {
    // Drop order: the frame (which gives the buffer back through the producer) before the
    // producer, which `Drop` frees last. `'static` never escapes (`frame()` shortens it).
    frame: Option<WriteFrame<'static>>,
    /// From `Box::into_raw`; turned back into the `Box` exactly once (`take_producer` or `Drop`).
    /// Never dereferenced while `frame` holds its `&mut`.
    producer: NonNull<Producer>,
}

// SAFETY: the value owns the producer (and the frame borrowing it) uniquely, as a `Box<Producer>`
// would; moving it to another thread moves that ownership, which is sound as `Producer: Send`
// (asserted below).
unsafe impl Send for OwnedWriteFrame {}

const _: () = {
    const fn send<T: Send>() {}
    send::<Producer>();
};

impl std::fmt::Debug for OwnedWriteFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedWriteFrame")
            .field("index", &self.frame.as_ref().map(|w| w.index()))
            .finish_non_exhaustive()
    }
}

impl OwnedWriteFrame {
    /// Takes a free buffer of `producer` to write, as [`Producer::acquire`] (`timeout`: `None`
    /// waits forever).
    ///
    /// # Errors
    /// As [`Producer::acquire`]; the producer comes back with the error.
    pub fn acquire(
        producer: Box<Producer>,
        timeout: Option<Duration>,
    ) -> std::result::Result<OwnedWriteFrame, (Box<Producer>, Error)> {
        Self::acquire_with(producer, timeout, false)
    }

    /// [`OwnedWriteFrame::acquire`] by [`Producer::acquire_slice`]: a timeout leaves a pool of one
    /// buffer reserved for the next slice (the producer that comes back gives it back with
    /// [`Producer::give_back_reservation`] when its caller stops waiting).
    ///
    /// # Errors
    /// As [`Producer::acquire_slice`]; the producer comes back with the error.
    pub fn acquire_slice(
        producer: Box<Producer>,
        timeout: Option<Duration>,
    ) -> std::result::Result<OwnedWriteFrame, (Box<Producer>, Error)> {
        Self::acquire_with(producer, timeout, true)
    }

    fn acquire_with(
        producer: Box<Producer>,
        timeout: Option<Duration>,
        slice: bool,
    ) -> std::result::Result<OwnedWriteFrame, (Box<Producer>, Error)> {
        let ptr = NonNull::from(Box::leak(producer));
        // SAFETY: `ptr` came from `Box::leak` just now and nothing else refers to the producer;
        // the `&mut` lives as long as the frame, which `OwnedWriteFrame` drops before it turns the
        // pointer back into a `Box` (field order, `take_producer`, `Drop`). On error the borrow
        // ends here, before `Box::from_raw`.
        let acquired = unsafe {
            if slice {
                (*ptr.as_ptr()).acquire_slice(timeout)
            } else {
                (*ptr.as_ptr()).acquire(timeout)
            }
        };
        match acquired {
            Ok(frame) => {
                // SAFETY: as above; the frame's borrow of `*ptr` is extended to the life of
                // `Self`, during which the pointer is not used (see the `producer` field).
                let frame =
                    unsafe { std::mem::transmute::<WriteFrame<'_>, WriteFrame<'static>>(frame) };
                Ok(OwnedWriteFrame {
                    frame: Some(frame),
                    producer: ptr,
                })
            }
            // SAFETY: `ptr` came from `Box::leak`; the borrow taken by `acquire` has ended.
            Err(e) => Err((unsafe { Box::from_raw(ptr.as_ptr()) }, e)),
        }
    }

    /// The frame being written.
    pub fn frame(&self) -> &WriteFrame<'_> {
        self.frame
            .as_ref()
            .expect("an OwnedWriteFrame holds its frame until it is consumed")
    }

    /// Copies `src` into the frame's host buffer at byte `offset`, as [`WriteFrame::write_at`].
    /// (No `frame_mut`: a `&mut` of the frame would let two owned frames swap the producers they
    /// borrow.)
    ///
    /// # Errors
    /// As [`WriteFrame::write_at`]: [`Error::InvalidArgument`] past the buffer's end or on a GPU
    /// channel.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.frame
            .as_mut()
            .expect("an OwnedWriteFrame holds its frame until it is consumed")
            .write_at(offset, src)
    }

    /// Publishes the frame as [`WriteFrame::publish`] and hands the producer back with the result.
    pub fn publish(mut self, metadata: &[u8]) -> (Box<Producer>, Result<u64>) {
        let frame = self.frame.take().expect("frame present until consumed");
        let seq = frame.publish(metadata);
        (self.take_producer(), seq)
    }

    /// Gives the buffer back unpublished and hands the producer back.
    pub fn into_producer(mut self) -> Box<Producer> {
        drop(self.frame.take());
        self.take_producer()
    }

    fn take_producer(self) -> Box<Producer> {
        debug_assert!(self.frame.is_none());
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: the pointer came from `Box::leak` in `acquire`; the frame that borrowed it is
        // gone (callers take it first), and `ManuallyDrop` keeps `Drop` from freeing it again.
        unsafe { Box::from_raw(this.producer.as_ptr()) }
    }
}

impl Drop for OwnedWriteFrame {
    fn drop(&mut self) {
        drop(self.frame.take());
        // SAFETY: the pointer came from `Box::leak` in `acquire` and was not turned back into a
        // `Box` (`take_producer` skips this `Drop`); the frame that borrowed it was dropped above.
        drop(unsafe { Box::from_raw(self.producer.as_ptr()) });
    }
}

/// A receive posted ahead ([`Consumer::post`]) that keeps its consumer alive, for bindings whose
/// objects cannot carry a Rust lifetime. Dropping it without waiting leaves the frame to the next
/// wait or receive, as dropping a [`Posted`] does.
///
/// # Examples
/// ```no_run
/// use cuda_ipc::channel::{Consumer, ConsumerOptions, owned::OwnedPosted};
/// use std::sync::Arc;
/// let rx = Arc::new(Consumer::attach("frames", &ConsumerOptions::new())?);
/// let posted = OwnedPosted::post(&rx, |p| {
///     // enqueue the kernels that read `p.buffer()` on `p.stream()` here
///     Ok(())
/// })?;
/// if let Some(frame) = posted.wait(Some(std::time::Duration::from_secs(1)))? {
///     println!("frame {}", frame.seq());
/// }
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub struct OwnedPosted {
    // Drop order: the receive (which borrows the consumer) before the consumer reference.
    // The `'static` is never handed out: `posted()` shortens it to the borrow of `self`.
    posted: Posted<'static>,
    consumer: Arc<Consumer>,
}

impl std::fmt::Debug for OwnedPosted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.posted.fmt(f)
    }
}

impl OwnedPosted {
    /// Posts the receive of the next frame of `consumer` ahead of its publication, as
    /// [`Consumer::post`] (`work` enqueues what reads the frame on [`Posted::stream`]).
    ///
    /// # Errors
    /// As [`Consumer::post`].
    pub fn post<F>(consumer: &Arc<Consumer>, work: F) -> Result<OwnedPosted>
    where
        F: FnOnce(&Posted<'_>) -> Result<()>,
    {
        let posted = consumer.post(work)?;
        // SAFETY: as in `OwnedFrame::own`: the receive borrows `**consumer`, which lives in the
        // `Arc`'s allocation (its address does not change when the `Arc` moves), and the clone
        // stored beside it keeps it alive until after the receive is dropped (field order). Only
        // shared references to the consumer exist. The extended lifetime never escapes:
        // `posted()` returns `&Posted<'_>` bounded by `&self` (`Posted` is covariant in it).
        let posted = unsafe { std::mem::transmute::<Posted<'_>, Posted<'static>>(posted) };
        Ok(OwnedPosted {
            posted,
            consumer: consumer.clone(),
        })
    }

    /// The receive posted.
    pub fn posted(&self) -> &Posted<'_> {
        &self.posted
    }

    /// The consumer it was posted on.
    pub fn consumer(&self) -> &Arc<Consumer> {
        &self.consumer
    }

    /// Waits on the host up to `timeout` (`None`: no bound) for the frame and takes it, as
    /// [`Posted::wait`], but keeps the receive: `Ok(None)` when the timeout ran out, and it can be
    /// waited for again (so a binding can wait in bounded slices).
    ///
    /// # Errors
    /// As [`Posted::wait`], except [`Error::Timeout`]; [`Error::InvalidArgument`] when waited for
    /// again after it returned the frame.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Option<PostedFrame>> {
        match self.posted.take(timeout) {
            Ok(f) => Ok(Some(f)),
            Err(Error::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
}
