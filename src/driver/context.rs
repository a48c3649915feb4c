use super::Device;
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use crate::identity::ForkEpoch;
use std::mem::MaybeUninit;
use std::sync::Arc;

/// A device's primary context, retained for as long as this value lives (`cuDevicePrimaryCtxRetain`,
/// released with `cuDevicePrimaryCtxRelease_v2` on drop).
///
/// A context and every pointer in it belong to one process: two processes cannot share a context.
/// What they share is memory and events (see [`crate::ipc`]). Every object made in a context holds an
/// `Arc<Context>`, so the context outlives them.
///
/// Context hygiene: every driver call of this crate, drops included, runs inside
/// [`Context::enter`], which makes the context current only for that call and restores whatever
/// the thread had current before (another library's context, or none), on success, on error and
/// from any thread. Creating a `Context` does not make it current either. The one call that changes
/// the thread's current context for good is [`Context::bind`], for the user's own driver calls.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html>.
#[derive(Debug)]
pub struct Context {
    device: Device,
    raw: sys::CUcontext,
    /// The process (by fork) that retained it: CUDA does not survive `fork`, so a forked child
    /// makes no driver call on it (`identity::fork`).
    fork: ForkEpoch,
}

// SAFETY: a CUcontext is a process-wide driver handle, usable from any thread while current there
// (every method enters it first, see `Context::enter`); the driver synchronises its own state.
unsafe impl Send for Context {}
// SAFETY: as for Send; `&Context` only exposes driver calls that the driver makes thread-safe.
unsafe impl Sync for Context {}

// `Device`'s method that names `Context` lives here, beside `Context`, so that `device.rs` does
// not import this file (a context is made for a device: this file builds on `device.rs`).
impl Device {
    /// The device's primary context, retained (`cuDevicePrimaryCtxRetain`); see [`Context`].
    ///
    /// # Errors
    /// [`Error::Cuda`] when the retain fails (e.g. `CUDA_ERROR_DEVICE_UNAVAILABLE` in exclusive
    /// mode when another process holds the device).
    pub fn primary_context(&self) -> Result<Arc<Context>> {
        Context::primary(*self)
    }
}

/// Makes this crate's first driver calls in a process that has initialised CUDA already, so that
/// they are not part of its first real work (a tensor set's first attach, a channel's first
/// join): takes the driver library the process has loaded (`libcuda.so.1`, found without a
/// search), runs `cuInit` (a no-op there) and, where a context is current on the calling
/// thread and its device's primary context is active, looks the device up and retains and
/// releases that primary context once (the first use of those driver functions), then starts
/// and joins one thread, once per process (a process's first thread start is the dearest). Returns that device, or
/// `None` when there is nothing to prepare.
///
/// Skipped where `libcuda.so.1` is not in the process yet, or where this crate loaded another
/// library earlier (the soname did not load then). Never loads the driver into a process that has not, never initialises it (a process whose
/// children it forks keeps them free to use CUDA), never makes a primary context that is not
/// active, and leaves the thread's current context as it was. Takes tens to a few hundred µs
/// once; later calls cost about 10 µs. Errors are not returned: a failed step leaves the rest to
/// the first real use, which reports them.
pub fn warm_up() -> Option<Device> {
    if !crate::ffi::initialized_elsewhere() || crate::ffi::driver_api().is_err() {
        return None;
    }
    let mut ctx = MaybeUninit::<sys::CUcontext>::uninit();
    // SAFETY: driver loaded and initialised (`driver_api`); `ctx` is a valid out-pointer.
    check("cuCtxGetCurrent", unsafe {
        sys::cuCtxGetCurrent(ctx.as_mut_ptr())
    })
    .ok()?;
    // SAFETY: written on success.
    if unsafe { ctx.assume_init() }.is_null() {
        return None;
    }
    let mut raw = MaybeUninit::<sys::CUdevice>::uninit();
    // SAFETY: a context is current on this thread; `raw` is a valid out-pointer.
    check("cuCtxGetDevice", unsafe {
        sys::cuCtxGetDevice(raw.as_mut_ptr())
    })
    .ok()?;
    // SAFETY: written on success.
    let raw = unsafe { raw.assume_init() };
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: `raw` is the current context's device; both are valid out-pointers.
    check("cuDevicePrimaryCtxGetState", unsafe {
        sys::cuDevicePrimaryCtxGetState(raw, &mut flags, &mut active)
    })
    .ok()?;
    if active == 0 {
        return None; // retaining it would make it: tens of ms and device memory
    }
    let n = Device::count().ok()?;
    // The ordinal whose handle is the current context's device (`cuDeviceGet` maps ordinals to
    // handles; on every driver so far they are equal, which is not relied on).
    let device = (0..n)
        .filter_map(|i| Device::get(i).ok())
        .find(|d| d.raw() == raw)?;
    // Retained and released at once: the context is active, so its count goes back to where it
    // was (`Context`'s drop releases it).
    drop(Context::primary(device).ok()?);
    // A fresh process's first thread start costs more than a later one (a stack mapped, a malloc
    // arena made at the thread's first allocation; both kept for the next thread once it ends):
    // paid here, not by a first attach's join thread. A failed start only leaves it there.
    static THREAD: std::sync::Once = std::sync::Once::new();
    THREAD.call_once(|| {
        if let Ok(h) = std::thread::Builder::new()
            .name("cuda-ipc-warm".into())
            .spawn(|| drop(std::hint::black_box(vec![0u8; 64])))
        {
            let _ = h.join();
        }
    });
    Some(device)
}

impl Context {
    /// Retains `device`'s primary context. The calling thread's current context is left as it was:
    /// nothing is made current (use [`Context::bind`] for that).
    ///
    /// # Errors
    /// [`Error::Cuda`] naming `cuDevicePrimaryCtxRetain` when it fails.
    #[doc(alias = "cuDevicePrimaryCtxRetain")]
    pub fn primary(device: Device) -> Result<Arc<Context>> {
        crate::ffi::driver_api()?;
        let mut raw = MaybeUninit::<sys::CUcontext>::uninit();
        // SAFETY: driver loaded; `device` came from `cuDeviceGet`; `raw` is a valid out-pointer.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(raw.as_mut_ptr(), device.raw())
        })?;
        // SAFETY: written on success.
        let raw = unsafe { raw.assume_init() };
        Ok(Arc::new(Context {
            device,
            raw,
            fork: ForkEpoch::now(),
        }))
    }

    /// The primary context of the device with ordinal 0 in this process.
    ///
    /// # Errors
    /// As [`Device::get`] and [`Context::primary`].
    pub fn default_device() -> Result<Arc<Context>> {
        Self::primary(Device::get(0)?)
    }

    /// The device this context belongs to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The raw `CUcontext`, for the user's own driver calls (make it current first, with
    /// [`Context::enter`] or [`Context::bind`]).
    pub fn as_raw(&self) -> sys::CUcontext {
        self.raw
    }

    /// Makes this context current on the calling thread for the life of the returned guard, and
    /// the caller's context current again when it drops: `cuCtxGetCurrent`, then, only when another
    /// context (or none) is current, `cuCtxPushCurrent_v2` now and `cuCtxPopCurrent_v2` at drop.
    /// When this context is current already, it costs one `cuCtxGetCurrent` and changes nothing.
    ///
    /// Every driver call of this crate runs inside such a guard, so code of other libraries on the
    /// thread finds its own context current afterwards, on success and on error.
    ///
    /// In a process forked from the one that made this context it fails with
    /// [`Error::ForkedChild`] before any driver call (CUDA does not survive `fork`), so every
    /// driver object made before the fork (stream, event, allocation, mapping) refuses its calls
    /// in the child and its drop there frees nothing.
    ///
    /// Guards nest like the driver's context stack: drop them in the reverse order of their
    /// creation (scopes do that), and do not hold one across code that pushes a context without
    /// popping it again. The guard is not `Send`: the stack belongs to the thread.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver refuses `cuCtxGetCurrent` or `cuCtxPushCurrent_v2`.
    ///
    /// # Examples
    /// ```no_run
    /// # fn main() -> cuda_ipc::Result<()> {
    /// let ctx = cuda_ipc::driver::Context::default_device()?;
    /// {
    ///     let _cur = ctx.enter()?;
    ///     // Raw driver calls on `ctx.as_raw()` go here.
    /// }
    /// // The thread's previous context (or none) is current again.
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html>.
    #[doc(alias = "cuCtxPushCurrent")]
    #[doc(alias = "cuCtxPopCurrent")]
    pub fn enter(&self) -> Result<CurrentGuard<'_>> {
        // Every driver object (stream, event, allocation, module, mapping) enters its context
        // first, so a forked child's copies make no driver call, in their calls or their drops.
        self.fork.check("CUDA context")?;
        let mut cur = MaybeUninit::<sys::CUcontext>::uninit();
        // SAFETY: driver loaded (a Context exists); `cur` is a valid out-pointer.
        check("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(cur.as_mut_ptr())
        })?;
        // SAFETY: written on success.
        let cur = unsafe { cur.assume_init() };
        if cur == self.raw {
            return Ok(CurrentGuard {
                ctx: self,
                pushed: false,
                _not_send: std::marker::PhantomData,
            });
        }
        // SAFETY: `raw` is a retained primary context, valid while `self` lives (the guard borrows
        // it); pushing makes it current on this thread until the matching pop in the guard's drop.
        check("cuCtxPushCurrent_v2", unsafe {
            sys::cuCtxPushCurrent_v2(self.raw)
        })?;
        Ok(CurrentGuard {
            ctx: self,
            pushed: true,
            _not_send: std::marker::PhantomData,
        })
    }

    /// Makes this context current on the calling thread (`cuCtxSetCurrent`) and leaves it so: the
    /// one call of this crate that changes the thread's state for good, for users who make their
    /// own driver calls afterwards. Everything else uses [`Context::enter`], which restores the
    /// caller's context.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver refuses.
    #[doc(alias = "cuCtxSetCurrent")]
    pub fn bind(&self) -> Result<()> {
        self.fork.check("CUDA context")?;
        // SAFETY: `raw` is a retained primary context, valid until drop.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.raw) })?;
        Ok(())
    }

    /// Waits for all work in this context to finish (`cuCtxSynchronize`).
    ///
    /// # Errors
    /// [`Error::Cuda`] when earlier asynchronous work failed.
    #[doc(alias = "cuCtxSynchronize")]
    pub fn synchronize(&self) -> Result<()> {
        let _cur = self.enter()?;
        // SAFETY: this context is current (entered above).
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
        Ok(())
    }

    /// Free and total device memory in bytes, as the driver sees it (`cuMemGetInfo_v2`).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the call fails.
    #[doc(alias = "cuMemGetInfo")]
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        let _cur = self.enter()?;
        let mut free = MaybeUninit::<usize>::uninit();
        let mut total = MaybeUninit::<usize>::uninit();
        // SAFETY: this context is current (entered above); both out-pointers valid.
        check("cuMemGetInfo_v2", unsafe {
            sys::cuMemGetInfo_v2(free.as_mut_ptr(), total.as_mut_ptr())
        })?;
        // SAFETY: written on success.
        Ok(unsafe { (free.assume_init(), total.assume_init()) })
    }

    /// Checks that `other` is this same context (objects from different contexts cannot be mixed).
    pub(crate) fn same_as(&self, other: &Context) -> Result<()> {
        if self.raw == other.raw {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "objects from different contexts mixed (devices {} and {})",
                self.device.uuid(),
                other.device.uuid()
            )))
        }
    }
}

/// This context current on this thread until dropped; made by [`Context::enter`]. Not `Send`: the
/// driver's context stack belongs to one thread.
#[derive(Debug)]
#[must_use = "the context is current only while the guard lives"]
pub struct CurrentGuard<'a> {
    ctx: &'a Context,
    pushed: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl CurrentGuard<'_> {
    /// The context made current.
    pub fn context(&self) -> &Context {
        self.ctx
    }
}

impl Drop for CurrentGuard<'_> {
    fn drop(&mut self) {
        if !self.pushed {
            return;
        }
        let mut popped = MaybeUninit::<sys::CUcontext>::uninit();
        // SAFETY: this guard pushed `ctx` on this thread (the guard is not Send) and nothing
        // pushed by this crate is left above it: guards are dropped in reverse order of creation.
        let r = unsafe { sys::cuCtxPopCurrent_v2(popped.as_mut_ptr()) };
        match check("cuCtxPopCurrent_v2", r) {
            // SAFETY: written on success.
            Ok(()) if unsafe { popped.assume_init() } == self.ctx.raw => {}
            Ok(()) => {
                // Someone replaced the top of the stack while the guard lived (a `cuCtxSetCurrent`
                // inside the guard's scope); what was under it is current again, as intended.
                tracing::warn!(
                    "cuCtxPopCurrent_v2 popped another context than the one entered; the thread's \
                     previous context is current again"
                );
            }
            Err(e) => {
                // The caller's context may stay hidden under ours; nothing else can be done in
                // drop.
                tracing::warn!("{e}; the thread's previous context may not be current again");
            }
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if self.fork.inherited() {
            return; // the parent's retain (`identity::fork`)
        }
        // SAFETY: the device's primary context was retained once by this value.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device.raw()) };
        if let Err(e) = check("cuDevicePrimaryCtxRelease_v2", r) {
            // Nothing to recover: the retain count stays one too high, which only delays the
            // context's teardown to process exit.
            tracing::warn!("{e}; the primary context stays retained until exit");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    /// Every `.rs` file under `dir`, recursively.
    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// The code lines of `text` (comment and doc lines left out), with their line numbers.
    fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
        text.lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l))
            .filter(|(_, l)| !l.trim_start().starts_with("//"))
    }

    /// The lint for context hygiene: a `.bind()` in the crate's own code would leave a context
    /// current on the user's thread, and a raw `cuCtxSetCurrent` / push / pop outside this file
    /// would bypass `Context::enter`. Both are only allowed here, in `Context::bind` itself and
    /// in the guard.
    #[test]
    fn no_code_in_src_changes_the_threads_current_context_except_context_rs() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let here = src.join("driver").join("context.rs");
        // The driver loader defines these functions (with cudarc's names) and calls none.
        let loader = src.join("ffi").join("sys.rs");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        assert!(files.len() > 10, "found only {files:?} under {src:?}");
        // Spelt in two parts so that this line does not match itself.
        let bind_call = format!(".{}()", "bind");
        let mut found = Vec::new();
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            for (n, line) in code_lines(&text) {
                let rebinds = line.contains(&bind_call);
                let raw = ["cuCtxSetCurrent(", "cuCtxPushCurrent", "cuCtxPopCurrent"]
                    .iter()
                    .any(|c| line.contains(c));
                if rebinds || (raw && *f != here && *f != loader) {
                    let name = f.strip_prefix(&src).unwrap_or(f).display();
                    found.push(format!("src/{name}:{n}: {}", line.trim()));
                }
            }
        }
        assert!(
            found.is_empty(),
            "use `let _cur = ctx.enter()?;` (Context::enter) instead; found:\n{}",
            found.join("\n")
        );
    }
}
