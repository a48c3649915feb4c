//! Interop with [cudarc](https://docs.rs/cudarc/0.19) 0.19's safe driver API (feature `cudarc`):
//! candle, burn and other Rust GPU programs allocate and launch through it.
//!
//! Owns: the conversions between cudarc's objects and this crate's, each bound by a lifetime to
//! what it borrows. Makes no IPC call of its own: exports go through [`crate::ipc::ForeignBuffer`].
//!
//! - **Export a cudarc allocation**: [`export`] takes a `&CudaSlice<T>`, `&CudaView<T>` or
//!   `&CudaViewMut<T>` and gives a [`ForeignBuffer`] that borrows it: the slice cannot be dropped
//!   (and freed) while the export lives. cudarc 0.19 allocates every `CudaSlice` with
//!   `cuMemAllocAsync` from the device's *current* pool and has no allocate-from-this-pool call;
//!   the default pool cannot be exported ([`NotExportable::DefaultPool`](crate::ipc::NotExportable::DefaultPool)). So make an exportable
//!   pool current first ([`MemPool::make_device_current`](crate::ipc::MemPool::make_device_current),
//!   process-wide), then allocate with cudarc.
//! - **Give cudarc a view of this crate's memory**: [`slice()`] views any [`DeviceMemory`] (a
//!   `DeviceBuffer`, an `ImportedBuffer`, a channel `Frame`'s or `WriteFrame`'s buffer, a
//!   `PoolBuffer`, a `VmmBuffer`) as a [`CudarcSlice`]: a real `CudaSlice<T>` (so `as_view`,
//!   `slice`, kernel arguments, copies all work) that is never freed by cudarc, bound to the
//!   borrow of the memory. cudarc's `CudaView`/`CudaViewMut` can only be made from a `CudaSlice`,
//!   and the only `CudaSlice` over memory cudarc did not allocate is one from
//!   `CudaStream::upgrade_device_ptr`, which frees with `cuMemFreeAsync` on drop; a
//!   [`CudarcSlice`] holds it in `ManuallyDrop` and gives it back with `CudaSlice::leak` (which
//!   frees nothing) when it drops, and hands out only `&CudaSlice` and `CudaViewMut`, never the
//!   owning slice.
//! - **Use this crate's streams in cudarc**: [`stream`] wraps a [`Stream`] (a channel's
//!   `Producer::stream`, `Consumer::stream`, `Frame::stream`) with
//!   `CudaContext::wrap_borrowed_stream`, so cudarc's `launch_builder` enqueues on it, ordered with
//!   the channel's own stream work (ready-word waits, release events).
//!
//! Which to use: when you can choose where the memory comes from, let this crate allocate (a
//! channel's pool, a `DeviceBuffer`, `MemPool::alloc`) and give cudarc a [`slice()`]: nothing
//! process-wide changes. When the memory must come from cudarc itself (a framework allocates the
//! tensors), make an exportable pool the device's current pool and [`export`] the slices.
//!
//! Contexts: cudarc's `CudaContext::new(ordinal)` retains the device's primary context, which is
//! the context of this crate's [`Context::primary`]; every function here checks that the two are
//! the same `CUcontext` and refuses otherwise (a `CudaContext::new_non_primary` context).
//!
//! Driver library: cudarc's own calls (its `CudaContext`, `CudaStream`, launches, copies) go
//! through cudarc's loader, which tries `libcuda.so` before the soname `libcuda.so.1`; this crate's
//! calls go through its own loader, `libcuda.so.1` first. Both reach the one driver of the process
//! where `libcuda.so` is the driver's link to `libcuda.so.1` (the dynamic linker gives the library
//! already loaded); where a CUDA toolkit's stub `libcuda.so` is on `LD_LIBRARY_PATH`, cudarc's calls
//! reach the stub and fail with `CUDA_ERROR_STUB_LIBRARY` while this crate's work: take the stub's
//! folder off the search path.
//!
//! See <https://docs.rs/cudarc/0.19/cudarc/driver/safe/index.html>.

use crate::driver::{Context, Device, DeviceMemory, Stream};
use crate::error::{CudaError, Error, Result};
use crate::ipc::ForeignBuffer;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaViewMut, DevicePtr, DeviceRepr};
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::{Deref, RangeBounds};
use std::sync::Arc;

/// A cudarc error as this crate's [`Error::Cuda`], naming the cudarc call.
fn cudarc_err(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| {
        Error::Cuda(CudaError {
            call,
            code: e.0 as u32,
        })
    }
}

/// Checks that cudarc's context is `ours` (the same `CUcontext`).
fn same_context(ours: &Context, theirs: &CudaContext) -> Result<()> {
    if theirs.cu_ctx() == ours.as_raw() {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "the cudarc context (device ordinal {}) is not the primary context of device {}; \
             use CudaContext::new (the primary context) on the same device",
            theirs.ordinal(),
            ours.device().uuid()
        )))
    }
}

/// This crate's [`Context`] for cudarc's `cx`: the primary context of the same device
/// (`cuDevicePrimaryCtxRetain`), checked to be the very `CUcontext` cudarc uses.
///
/// # Errors
/// [`Error::InvalidArgument`] when `cx` is not its device's primary context; as
/// [`Context::primary`].
pub fn context(cx: &CudaContext) -> Result<Arc<Context>> {
    let ctx = Context::primary(Device::get(cx.ordinal())?)?;
    same_context(&ctx, cx)?;
    Ok(ctx)
}

// ------------------------------------------------------------------------------------ streams

/// A [`Stream`] of this crate seen as a cudarc stream, for `launch_builder`, events, `join` and
/// `wait`; borrows the stream for `'a`. Made by [`stream`]. Dereferences to `&CudaStream` only:
/// the `Arc` that cudarc's copies and allocations take is behind the `unsafe`
/// [`CudarcStream::as_arc`], since a clone of it, or a slice allocated on it, could outlive the
/// borrowed stream. Allocate with cudarc on a stream of its own.
#[derive(Debug)]
pub struct CudarcStream<'a> {
    inner: Arc<CudaStream>,
    _stream: PhantomData<&'a Stream>,
}

impl CudarcStream<'_> {
    /// The wrapper as cudarc's `Arc<CudaStream>`, for the cudarc calls that take one (the copies
    /// `memcpy_htod`, `memcpy_dtoh`, ..., and allocations).
    ///
    /// # Safety
    /// 1. No clone of the `Arc` outlives this wrapper (and so the borrowed [`Stream`]).
    /// 2. No `CudaSlice` allocated on it (`alloc`, `alloc_zeros`, `clone_htod`, ...) outlives this
    ///    wrapper: cudarc frees a slice on its stream (`cuMemFreeAsync`) when it drops, which would
    ///    be a destroyed stream by then. Allocate on a stream of cudarc's own instead.
    pub unsafe fn as_arc(&self) -> &Arc<CudaStream> {
        &self.inner
    }
}

impl Deref for CudarcStream<'_> {
    type Target = CudaStream;
    fn deref(&self) -> &CudaStream {
        &self.inner
    }
}

/// Wraps `s` as a cudarc stream of `cx` (`CudaContext::wrap_borrowed_stream`); the stream stays
/// this crate's (not destroyed by cudarc). Work launched on it is ordered with the work this crate
/// enqueues on `s` (a channel's ready-word waits and release events).
///
/// # Errors
/// [`Error::InvalidArgument`] when `cx` is not the context of `s`.
pub fn stream<'a>(cx: &Arc<CudaContext>, s: &'a Stream) -> Result<CudarcStream<'a>> {
    same_context(s.context(), cx)?;
    // SAFETY: (1) `s` is a valid stream of this very context (checked above); (2) its owner keeps
    // it alive while the wrapper may be used: the wrapper borrows `s` for `'a` and hands out only
    // `&CudaStream`, so no clone of the `Arc` escapes; (3) ordering with work on `s` submitted by
    // this crate is the stream's own order.
    let inner = unsafe { cx.wrap_borrowed_stream(s.as_raw()) };
    Ok(CudarcStream {
        inner,
        _stream: PhantomData,
    })
}

// ----------------------------------------------------------------------------- views for cudarc

/// Memory of this crate seen as a cudarc `CudaSlice<T>` (`len` elements of `T`), borrowed for
/// `'a` and never freed by cudarc. Made by [`slice()`].
///
/// Dereferences to `&CudaSlice<T>` (for `as_view`, `slice`, kernel arguments, copies from the
/// device); [`CudarcSlice::view_mut`] gives the `CudaViewMut<T>` a kernel writing it needs. The
/// owning slice itself is never handed out, so cudarc cannot drop (free) it, and it cannot be
/// swapped for another.
///
/// The slice's own stream is its context's default stream; launch on the stream that orders the
/// memory (a channel frame's stream, wrapped by [`stream`]) or join your streams into it before the
/// borrowed memory is given back (for a channel frame: before the frame drops, when its release
/// is recorded on the frame's stream).
#[derive(Debug)]
pub struct CudarcSlice<'a, T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    /// The memory's context, entered around cudarc's calls at drop (cudarc makes its context
    /// current with `cuCtxSetCurrent` unless it is current already).
    ctx: Arc<Context>,
    _mem: PhantomData<&'a ()>,
}

impl<T> Deref for CudarcSlice<'_, T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> CudarcSlice<'_, T> {
    /// The whole slice as a mutable cudarc view (for a kernel argument that writes it).
    pub fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice.as_view_mut()
    }

    /// Elements `range` as a mutable cudarc view.
    ///
    /// # Panics
    /// When the range leaves the slice (as `CudaSlice::slice_mut`).
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> CudaViewMut<'_, T> {
        self.slice.slice_mut(range)
    }
}

impl<T> Drop for CudarcSlice<'_, T> {
    fn drop(&mut self) {
        // SAFETY: `slice` is taken once, here, and never used again.
        let s = unsafe { ManuallyDrop::take(&mut self.slice) };
        // Entered, so cudarc finds its context current and the caller's is back afterwards.
        let cur = self.ctx.enter();
        // `leak` waits (stream-ordered) for the slice's recorded reads and writes, drops its events
        // and stream handle, and frees nothing: the memory stays this crate's.
        let _ = s.leak();
        drop(cur);
    }
}

/// Views `mem` (device memory of this crate: a buffer, an import, a channel frame's buffer) as a
/// cudarc slice of `mem.len() / size_of::<T>()` elements of `T`, in cudarc's context `cx`
/// (`CudaStream::upgrade_device_ptr` on `cx`'s default stream; see [`CudarcSlice`] for why it is
/// never freed). `T` must accept every bit pattern (`zerocopy::FromBytes`): other processes write
/// this memory.
///
/// # Errors
/// [`Error::InvalidArgument`] when `cx` is not the context of `mem`, `T` is zero-sized, or the
/// length or address does not fit `T` (a multiple of its size, aligned to its alignment).
///
/// # Panics
/// When cudarc tracks events (its default) and cannot create the two events a slice carries:
/// `upgrade_device_ptr` unwraps that creation.
pub fn slice<'a, T, M>(cx: &Arc<CudaContext>, mem: &'a M) -> Result<CudarcSlice<'a, T>>
where
    T: DeviceRepr + zerocopy::FromBytes,
    M: DeviceMemory + ?Sized,
{
    same_context(mem.context(), cx)?;
    let (size, align) = (size_of::<T>(), align_of::<T>());
    if size == 0 {
        return Err(Error::InvalidArgument(
            "a cudarc view needs an element type of at least 1 byte".into(),
        ));
    }
    let (ptr, len) = (mem.device_ptr(), mem.len());
    if len % size != 0 || ptr % align as u64 != 0 {
        return Err(Error::InvalidArgument(format!(
            "{} at {ptr:#x} cannot be viewed as a whole number of aligned {size}-byte elements \
             ({align} alignment)",
            crate::error::bytes(len)
        )));
    }
    let s = {
        // Entered: cudarc binds its context with `cuCtxSetCurrent` unless it is current already.
        let _cur = mem.context().enter()?;
        // SAFETY: (1) `ptr` is a valid allocation of `len` bytes in `cx`'s context (a `DeviceMemory`
        // of this context, checked above), borrowed for `'a`, which the returned value cannot outlive;
        // (2) it holds `len / size * size_of::<T>()` bytes; (3) every bit pattern is a valid `T`
        // (`FromBytes`). The slice is never dropped, only leaked (`CudarcSlice`'s drop), so cudarc
        // never frees it.
        unsafe { cx.default_stream().upgrade_device_ptr::<T>(ptr, len / size) }
    };
    Ok(CudarcSlice {
        slice: ManuallyDrop::new(s),
        ctx: mem.context().clone(),
        _mem: PhantomData,
    })
}

// ------------------------------------------------------------------------------------- exports

/// Exports a cudarc allocation: `s` is a `&CudaSlice<T>`, `&CudaView<T>` or `&CudaViewMut<T>`,
/// borrowed for as long as the returned [`ForeignBuffer`] lives (so it cannot be freed meanwhile).
/// Classifies the memory first (see [`crate::ipc::classify`]): a slice cudarc allocated from the
/// default pool is refused with [`crate::ipc::NotExportable::DefaultPool`]; make an exportable
/// pool current before allocating ([`crate::ipc::MemPool::make_device_current`]). Waits for `s`'s
/// stream (`cuStreamSynchronize`), so its allocation and the writes enqueued there are complete
/// before any importer can read.
///
/// Importers must still drop their imports before the slice is freed (the driver's rule for pool
/// memory, as for every export of this crate): the borrow ends when this export drops, not when
/// the importers are done.
///
/// # Errors
/// [`Error::InvalidArgument`] when `ctx` is not the slice's context; [`Error::NotExportable`]
/// naming the kind and the fix; [`Error::Cuda`] from the stream synchronisation or the queries.
///
/// # Examples
/// ```no_run
/// use cuda_ipc::cudarc_interop;
/// use cuda_ipc::ipc::MemPool;
/// use cudarc::driver::CudaContext;
/// let cx = CudaContext::new(0).unwrap();
/// let ctx = cudarc_interop::context(&cx)?;
/// let pool = MemPool::exportable(&ctx)?;
/// let current = pool.make_device_current()?; // process-wide: every cuMemAllocAsync uses `pool`
/// let stream = cx.new_stream().unwrap();
/// let data = stream.alloc_zeros::<f32>(1 << 20).unwrap();
/// let export = cudarc_interop::export(&ctx, &data)?;
/// let token = export.export()?; // send token.to_hex() to the other process
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub fn export<'a, T, S>(ctx: &Arc<Context>, s: &'a S) -> Result<ForeignBuffer<'a>>
where
    S: DevicePtr<T>,
{
    let st = s.stream();
    same_context(ctx, st.context())?;
    // Entered: cudarc binds its context with `cuCtxSetCurrent` unless it is current already.
    let cur = ctx.enter()?;
    let (ptr, record) = s.device_ptr(st);
    drop(record);
    st.synchronize()
        .map_err(cudarc_err("cuStreamSynchronize (cudarc)"))?;
    drop(cur);
    // SAFETY: (1) the memory is borrowed for `'a` through `s`, which the export cannot outlive, so
    // cudarc cannot free it before the export drops; importers' part is the documented rule above;
    // (2) as (1); (3) cudarc allocates no VMM memory (a VMM slice from elsewhere is classified and
    // refused when its reservation is shared); (4) its stream was synchronised just above.
    unsafe { ForeignBuffer::borrowed(ctx, ptr, s.num_bytes()) }
}
