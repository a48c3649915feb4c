//! Which driver library the crate loads, checked against fake drivers: small C libraries built here
//! with the C compiler (`cc`, or `$CC`), put in a temporary folder on `LD_LIBRARY_PATH` of a child
//! (this test binary re-executed in a role, so the parent never loads a driver). One is a working
//! driver named by its soname, `libcuda.so.1` (a recognisable version, one device with an active
//! primary context once initialised); the other is like a CUDA toolkit's stub `libcuda.so`, whose
//! every call returns `CUDA_ERROR_STUB_LIBRARY` (34).
//!
//! Checked: the soname is loaded before a stub `libcuda.so` beside it (cudarc's loader took the
//! stub); a stub alone is still found (the other candidate names stay) and its error reported; a
//! function the driver lacks is an error, not a panic; `warm_up` never loads the driver itself and
//! prepares it once another library loaded `libcuda.so.1` (before, it was skipped wherever
//! `libcuda.so` did not name the loaded driver). Runs without a GPU and needs a C compiler: without
//! one the tests fail and say so.

use cuda_ipc::driver::{Device, driver_version, warm_up};
use cuda_ipc::{CudaError, Error};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Environment variable naming the child's role.
const ROLE: &str = "CUDA_IPC_TEST_DRIVER_LOADER_ROLE";
/// Environment variable naming the folder of the fake libraries, for the child's checks.
const DIR: &str = "CUDA_IPC_TEST_DRIVER_LOADER_DIR";

/// What the fake driver's `cuDriverGetVersion` answers (no real driver's: 99.99).
const FAKE_VERSION: i32 = 99_990;
/// `CUDA_ERROR_STUB_LIBRARY`, every answer of the stub.
const STUB_LIBRARY: u32 = 34;
/// `CUDA_ERROR_NOT_FOUND`, the loader's answer for a function the library lacks.
const NOT_FOUND: u32 = 500;

/// The fake driver. `FAKE_RESULT` nonzero makes every function return it (the stub);
/// `WITHOUT_COUNT` leaves out `cuDeviceGetCount` (a driver older than a call).
const FAKE_DRIVER_C: &str = r#"
#include <string.h>
#ifndef FAKE_RESULT
#define FAKE_RESULT 0
#endif
typedef struct { char bytes[16]; } CUuuid;
static int initialised;
static int retained;
static int context;
int cuInit(unsigned flags) {
    (void)flags;
    if (FAKE_RESULT) return FAKE_RESULT;
    initialised = 1;
    return 0;
}
int cuDriverGetVersion(int *v) {
    if (FAKE_RESULT) return FAKE_RESULT;
    *v = FAKE_VERSION;
    return 0;
}
int cuGetErrorName(int e, const char **s) {
    if (FAKE_RESULT) return FAKE_RESULT;
    *s = e == 500 ? "CUDA_ERROR_NOT_FOUND" : "CUDA_ERROR_FAKE";
    return 0;
}
int cuGetErrorString(int e, const char **s) {
    if (FAKE_RESULT) return FAKE_RESULT;
    *s = e == 500 ? "named symbol not found" : "fake error";
    return 0;
}
/* Before cuInit every call answers CUDA_ERROR_NOT_INITIALIZED (3); after it, a context of
   device 0 is current and its primary context active, as in a process PyTorch set up. */
int cuCtxGetCurrent(void **ctx) {
    if (FAKE_RESULT) return FAKE_RESULT;
    if (!initialised) return 3;
    *ctx = &context;
    return 0;
}
int cuCtxGetDevice(int *dev) {
    if (FAKE_RESULT) return FAKE_RESULT;
    if (!initialised) return 3;
    *dev = 0;
    return 0;
}
int cuDevicePrimaryCtxGetState(int dev, unsigned *flags, int *active) {
    if (FAKE_RESULT) return FAKE_RESULT;
    if (!initialised) return 3;
    if (dev != 0) return 101;
    *flags = 0;
    *active = 1;
    return 0;
}
#ifndef WITHOUT_COUNT
int cuDeviceGetCount(int *n) {
    if (FAKE_RESULT) return FAKE_RESULT;
    if (!initialised) return 3;
    *n = 1;
    return 0;
}
#endif
int cuDeviceGet(int *dev, int ordinal) {
    if (FAKE_RESULT) return FAKE_RESULT;
    if (!initialised) return 3;
    if (ordinal != 0) return 101;
    *dev = 0;
    return 0;
}
int cuDeviceGetUuid_v2(CUuuid *uuid, int dev) {
    if (FAKE_RESULT) return FAKE_RESULT;
    if (!initialised) return 3;
    if (dev != 0) return 101;
    memset(uuid->bytes, 0x5a, sizeof uuid->bytes);
    return 0;
}
int cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    if (FAKE_RESULT) return FAKE_RESULT;
    if (!initialised) return 3;
    if (dev != 0) return 101;
    retained++;
    *ctx = &context;
    return 0;
}
int cuDevicePrimaryCtxRelease_v2(int dev) {
    if (FAKE_RESULT) return FAKE_RESULT;
    if (dev != 0) return 101;
    retained--;
    return 0;
}
/* For the test: the primary context's retains not released yet. */
int fake_retained(void) { return retained; }
"#;

/// A fake driver library to build: its file name and the C compiler's extra definitions.
struct Fake {
    file: &'static str,
    defines: &'static [&'static str],
}

/// The working driver under its soname.
const DRIVER: Fake = Fake {
    file: "libcuda.so.1",
    defines: &[],
};
/// The toolkit's stub library (its soname is the driver's, as the real stub's is).
const STUB: Fake = Fake {
    file: "libcuda.so",
    defines: &["-DFAKE_RESULT=34"],
};
/// A driver that lacks `cuDeviceGetCount`.
const OLD_DRIVER: Fake = Fake {
    file: "libcuda.so.1",
    defines: &["-DWITHOUT_COUNT"],
};

/// A temporary folder of fake libraries, removed when dropped.
struct FakeDir(PathBuf);

impl Drop for FakeDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Builds `fakes` into a new temporary folder named after `tag`.
fn build(tag: &str, fakes: &[Fake]) -> FakeDir {
    let dir =
        std::env::temp_dir().join(format!("cuda-ipc-fake-driver-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let dir = FakeDir(dir);
    let source = dir.0.join("fake_driver.c");
    std::fs::write(&source, FAKE_DRIVER_C).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    for fake in fakes {
        let out = dir.0.join(fake.file);
        let result = Command::new(&cc)
            .args(["-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1"])
            .arg(format!("-DFAKE_VERSION={FAKE_VERSION}"))
            .args(fake.defines)
            .arg("-o")
            .arg(&out)
            .arg(&source)
            .output();
        let output = match result {
            Ok(o) => o,
            Err(e) => panic!(
                "this test builds fake driver libraries with a C compiler, and `{cc}` could not \
                 be run ({e}): install one (e.g. gcc) or name it in CC"
            ),
        };
        assert!(
            output.status.success(),
            "`{cc}` failed to build {}: {}",
            fake.file,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    dir
}

/// Runs `test` of this binary as a child in `role` with `dir` first on `LD_LIBRARY_PATH`, and
/// checks that it succeeded and printed `@@ ok`.
fn run_child(test: &str, role: &str, dir: &FakeDir) -> String {
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", dir.0.display()),
        _ => dir.0.display().to_string(),
    };
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(DIR, &dir.0)
        .env("LD_LIBRARY_PATH", path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.lines().any(|l| l.contains("@@ ok")),
        "child {role} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    stdout
}

/// The child's role, when this process is one.
fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// The files of the fake folder mapped into this process (`/proc/self/maps`), by file name.
fn mapped_fakes() -> Vec<String> {
    let dir = PathBuf::from(std::env::var(DIR).unwrap());
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let mut names: Vec<String> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(Path::new)
        .filter(|p| p.parent() == Some(dir.as_path()))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Whether a `libcuda.so.1` from outside the fake folder is mapped (a real driver of this machine).
fn system_driver_mapped() -> bool {
    let dir = PathBuf::from(std::env::var(DIR).unwrap());
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(Path::new)
        .any(|p| p.file_name().is_some_and(|n| n == "libcuda.so.1") && p.parent() != Some(&dir))
}

#[test]
fn the_driver_soname_is_loaded_before_a_stub_library_on_the_search_path() {
    if role().as_deref() == Some("stub-beside-driver") {
        // The first driver call: cudarc's loader took `libcuda.so`, the stub, here, and this
        // answered CUDA_ERROR_STUB_LIBRARY from cuInit.
        assert_eq!(driver_version().unwrap(), FAKE_VERSION);
        assert_eq!(Device::count().unwrap(), 1);
        assert_eq!(mapped_fakes(), ["libcuda.so.1"], "the stub was loaded");
        println!("@@ ok");
        return;
    }
    let dir = build("stub-beside-driver", &[DRIVER, STUB]);
    run_child(
        "the_driver_soname_is_loaded_before_a_stub_library_on_the_search_path",
        "stub-beside-driver",
        &dir,
    );
}

#[test]
fn a_stub_library_alone_is_loaded_by_the_other_names_and_its_error_reported() {
    if role().as_deref() == Some("stub-alone") {
        let r = Device::count();
        if system_driver_mapped() {
            // This machine has a driver: its soname comes before the stub's name, as it should.
            assert!(
                mapped_fakes().is_empty(),
                "the stub was loaded beside the driver"
            );
            println!("@@ ok (this machine's libcuda.so.1 was loaded first)");
            return;
        }
        match r {
            Err(Error::Cuda(CudaError { call, code })) => {
                assert_eq!((call, code), ("cuInit", STUB_LIBRARY));
            }
            other => panic!("expected cuInit's CUDA_ERROR_STUB_LIBRARY, got {other:?}"),
        }
        let text = Device::count().unwrap_err().to_string();
        assert!(text.starts_with("cuInit failed: "), "{text}");
        // The stub names and describes nothing: the message does, from the bindings and the
        // loader (which file it is, what to do).
        assert!(
            text.contains("CUDA_ERROR_STUB_LIBRARY")
                && text.contains("libcuda.so, is a CUDA toolkit's stub")
                && text.contains("LD_LIBRARY_PATH"),
            "{text}"
        );
        assert_eq!(mapped_fakes(), ["libcuda.so"]);
        println!("@@ ok");
        return;
    }
    let dir = build("stub-alone", &[STUB]);
    run_child(
        "a_stub_library_alone_is_loaded_by_the_other_names_and_its_error_reported",
        "stub-alone",
        &dir,
    );
}

#[test]
fn a_function_the_driver_lacks_is_an_error_naming_it_not_a_panic() {
    if role().as_deref() == Some("old-driver") {
        assert_eq!(driver_version().unwrap(), FAKE_VERSION);
        match Device::count() {
            Err(Error::Cuda(CudaError { call, code })) => {
                assert_eq!((call, code), ("cuDeviceGetCount", NOT_FOUND));
            }
            other => panic!("expected cuDeviceGetCount's CUDA_ERROR_NOT_FOUND, got {other:?}"),
        }
        // Resolved once: the second call answers the same from the cache.
        let text = Device::count().unwrap_err().to_string();
        assert_eq!(
            text,
            "cuDeviceGetCount failed: CUDA_ERROR_NOT_FOUND (named symbol not found)"
        );
        println!("@@ ok");
        return;
    }
    let dir = build("old-driver", &[OLD_DRIVER]);
    run_child(
        "a_function_the_driver_lacks_is_an_error_naming_it_not_a_panic",
        "old-driver",
        &dir,
    );
}

/// The child of the warm-up test: `warm_up` before and after "another library" (this code, through
/// `dlopen`) loaded and initialised `libcuda.so.1`.
fn warm_up_child() {
    assert_eq!(
        warm_up(),
        None,
        "nothing to prepare before the driver is loaded"
    );
    assert!(mapped_fakes().is_empty(), "warm_up loaded the driver");
    // What PyTorch does: load the driver by its soname and initialise it.
    // SAFETY: the name is NUL-terminated; the fake library has no initialiser.
    let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!lib.is_null(), "the fake libcuda.so.1 did not load");
    // SAFETY: `lib` is a live handle; the symbol names are NUL-terminated.
    let (init, retained) = unsafe {
        (
            libc::dlsym(lib, c"cuInit".as_ptr()),
            libc::dlsym(lib, c"fake_retained".as_ptr()),
        )
    };
    assert!(!init.is_null() && !retained.is_null());
    // SAFETY: both are the fake library's functions with these C prototypes.
    let (init, retained) = unsafe {
        (
            std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(u32) -> i32>(init),
            std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn() -> i32>(retained),
        )
    };
    // SAFETY: the fake's cuInit takes a flags word and touches nothing else.
    assert_eq!(unsafe { init(0) }, 0);
    let device = warm_up().expect("warm_up skipped a driver loaded by its soname");
    assert_eq!(device.ordinal(), 0);
    // SAFETY: the fake's counter takes nothing.
    let left = unsafe { retained() };
    assert_eq!(left, 0, "the primary context stays retained");
    assert_eq!(mapped_fakes(), ["libcuda.so.1"], "the stub was loaded");
    println!("@@ ok");
}

#[test]
fn warm_up_prepares_a_driver_another_library_loaded_by_its_soname() {
    if role().as_deref() == Some("warm-up") {
        warm_up_child();
        return;
    }
    // A container's driver (the soname alone), and a machine with a toolkit's stub on the search
    // path: `warm_up` acted in neither before.
    for (tag, fakes) in [
        ("warm-up", &[DRIVER][..]),
        ("warm-up-stub", &[DRIVER, STUB][..]),
    ] {
        let dir = build(tag, fakes);
        run_child(
            "warm_up_prepares_a_driver_another_library_loaded_by_its_soname",
            "warm-up",
            &dir,
        );
    }
}
