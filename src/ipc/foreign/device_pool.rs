//! [`MemPool`] as the device's current pool ([`MemPool::make_device_current`]) and the guard
//! that restores the previous one.

use crate::driver::Context;
use crate::error::Result;
use crate::ffi::{check, sys};
use crate::ipc::pool::MemPool;
use std::mem::MaybeUninit;

// ------------------------------------------------------------------- the device's current pool

/// [`MemPool`] as the device's current pool, made by [`MemPool::make_device_current`]: while it
/// lives, every `cuMemAllocAsync` on the device, in every library of this process, allocates from
/// the pool. Dropping it (or [`DevicePoolGuard::restore`]) makes the pool the device had before
/// current again, unless someone else changed the device's pool meanwhile (then theirs stays).
/// Allocations made meanwhile stay in the pool and exportable after the restore.
#[derive(Debug)]
#[must_use = "the pool is the device's current pool only while the guard lives"]
pub struct DevicePoolGuard {
    previous: sys::CUmemoryPool,
    pool: MemPool,
    restored: bool,
}

// SAFETY: the raw pool is a process-wide driver handle only passed back to the driver
// (`cuDeviceSetMemPool`), which synchronises its own state; `MemPool` is Send and Sync.
unsafe impl Send for DevicePoolGuard {}
// SAFETY: as for Send; `&DevicePoolGuard` exposes no driver call.
unsafe impl Sync for DevicePoolGuard {}

impl MemPool {
    /// Makes this pool the current memory pool of its device (`cuDeviceGetMemPool`, then
    /// `cuDeviceSetMemPool`), until the returned guard drops.
    ///
    /// **This is process-wide**: it changes the pool that every `cuMemAllocAsync` on this device
    /// uses, in every thread and every library of the process (cudarc's `CudaStream::alloc`,
    /// frameworks on top of it, your own calls), not only in the caller. Use it when another
    /// library allocates the memory you want to export and cannot be told which pool to use
    /// (cudarc 0.19 has no allocate-from-pool call); keep the pool alive as long as you export
    /// from it. When you can allocate yourself, prefer a [`crate::driver::DeviceBuffer`],
    /// [`MemPool::alloc`] or a channel's buffers, and give the other library a view of them.
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] naming `cuDeviceGetMemPool` or `cuDeviceSetMemPool`.
    ///
    /// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>.
    #[doc(alias = "cuDeviceSetMemPool")]
    pub fn make_device_current(&self) -> Result<DevicePoolGuard> {
        let ctx = &self.inner.ctx;
        let _cur = ctx.enter()?;
        let previous = current_pool(ctx)?;
        // SAFETY: valid device of a loaded driver; the pool is live (held by `self`, and by the
        // guard from here on) and was created for this device.
        check("cuDeviceSetMemPool", unsafe {
            sys::cuDeviceSetMemPool(ctx.device().raw(), self.inner.pool)
        })?;
        Ok(DevicePoolGuard {
            previous,
            pool: self.clone(),
            restored: false,
        })
    }
}

/// The device's current pool (`cuDeviceGetMemPool`).
fn current_pool(ctx: &Context) -> Result<sys::CUmemoryPool> {
    let mut p = MaybeUninit::<sys::CUmemoryPool>::uninit();
    // SAFETY: driver loaded; valid device; `p` a valid out-pointer.
    check("cuDeviceGetMemPool", unsafe {
        sys::cuDeviceGetMemPool(p.as_mut_ptr(), ctx.device().raw())
    })?;
    // SAFETY: written on success.
    Ok(unsafe { p.assume_init() })
}

impl DevicePoolGuard {
    /// The pool made current.
    pub fn pool(&self) -> &MemPool {
        &self.pool
    }

    /// Makes the device's previous pool current again now (`cuDeviceSetMemPool`), when this pool
    /// is still the current one; reports what drop would only log.
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] naming `cuDeviceGetMemPool` or `cuDeviceSetMemPool`.
    pub fn restore(mut self) -> Result<()> {
        self.restored = true;
        self.restore_now()
    }

    fn restore_now(&self) -> Result<()> {
        let ctx = &self.pool.inner.ctx;
        let _cur = ctx.enter()?;
        if current_pool(ctx)? != self.pool.inner.pool {
            tracing::info!("the device's memory pool was changed by someone else; left as it is");
            return Ok(());
        }
        // SAFETY: valid device; `previous` was the device's current pool when the guard was made
        // (the default pool, or a pool its owner keeps alive while it is current, as the driver
        // requires of every current pool).
        check("cuDeviceSetMemPool", unsafe {
            sys::cuDeviceSetMemPool(ctx.device().raw(), self.previous)
        })?;
        Ok(())
    }
}

impl Drop for DevicePoolGuard {
    fn drop(&mut self) {
        if self.restored {
            return;
        }
        if let Err(e) = self.restore_now() {
            // Safe to go on: the pool stays current and alive while allocations use it (the
            // driver makes the default pool current again when a current pool is destroyed).
            tracing::warn!("{e}; the exportable pool stays the device's current pool");
        }
    }
}
