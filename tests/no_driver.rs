//! Without the NVIDIA driver every entry point returns `Error::DriverNotFound`; it never panics.
//! On a machine with a driver the same calls succeed, so each test checks whichever case applies.

use cuda_ipc::Error;
use cuda_ipc::driver::{Context, Device};

fn driver_present() -> bool {
    ["libcuda.so", "libcuda.so.1"].iter().any(|n| {
        // Probe the way the crate does, without going through it.
        // SAFETY: dlopen of a shared library by name; the handle is closed at once.
        unsafe {
            let c = std::ffi::CString::new(*n).unwrap();
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY);
            if !h.is_null() {
                libc::dlclose(h);
            }
            !h.is_null()
        }
    })
}

#[test]
fn every_entry_point_reports_driver_not_found_without_a_driver() {
    if driver_present() {
        assert!(Device::count().is_ok() || matches!(Device::count(), Err(Error::Cuda(_))));
        return;
    }
    let check = |r: Result<(), Error>| match r {
        Err(Error::DriverNotFound { searched }) => {
            assert!(searched.contains("libcuda.so"), "{searched}");
        }
        other => panic!("expected DriverNotFound, got {other:?}"),
    };
    check(Device::count().map(|_| ()));
    check(Device::get(0).map(|_| ()));
    check(Device::all().map(|_| ()));
    check(Context::default_device().map(|_| ()));
    check(cuda_ipc::driver::driver_version().map(|_| ()));
    check(cuda_ipc::probe::report().map(|_| ()));
    let e = Device::count().unwrap_err().to_string();
    assert!(
        e.starts_with("CUDA driver not found") && e.contains("LD_LIBRARY_PATH"),
        "{e}"
    );
}
