//! Platform probe: find out, before anything fails obscurely, whether this machine and device can
//! share memory and events between processes, and say how to fix it when not.
//!
//! Owns: the checks (driver present, device compute mode, integrated/Tegra GPUs, WSL, MIG, IPC event
//! support) and their actionable errors. Export and import call [`require_legacy_ipc`] /
//! [`require_ipc_events`] once per device and process (results are cached). Never touches shared
//! memory.

use crate::driver::{ComputeMode, Device, DeviceCapabilities};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// What the probe found about one device.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct DeviceReport {
    /// The device.
    pub device: Device,
    /// Its name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Its sharing capabilities.
    pub capabilities: DeviceCapabilities,
    /// `Ok` when legacy IPC (`cuIpc*` memory handles) can work; otherwise why not and the fix.
    pub legacy_ipc: std::result::Result<(), String>,
    /// `Ok` when interprocess events can work.
    pub ipc_events: std::result::Result<(), String>,
    /// True when the device is a MIG instance (its name says so, or `CUDA_VISIBLE_DEVICES` names
    /// `MIG-...` instances): no CUDA IPC there.
    pub mig: bool,
}

/// What the probe found about the machine.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Report {
    /// The driver's CUDA version (`major * 1000 + minor * 10`).
    pub driver_version: i32,
    /// True when running under WSL2 (no CUDA IPC there).
    pub wsl: bool,
    /// `CUDA_VISIBLE_DEVICES`, if set (MIG instances appear as `MIG-...`).
    pub visible_devices: Option<String>,
    /// One entry per visible device.
    pub devices: Vec<DeviceReport>,
}

/// Probes the driver and every visible device.
///
/// # Errors
/// [`Error::DriverNotFound`] without a driver; [`Error::Cuda`] when the driver cannot enumerate
/// devices (`CUDA_ERROR_NO_DEVICE` when none is visible).
pub fn report() -> Result<Report> {
    let driver_version = crate::driver::driver_version()?;
    let mut devices = Vec::new();
    for device in Device::all()? {
        let capabilities = device.capabilities()?;
        let name = device.name()?;
        devices.push(DeviceReport {
            legacy_ipc: legacy_ipc_verdict(&name, &capabilities).map_err(|e| e.to_string()),
            ipc_events: events_verdict(&name, &capabilities).map_err(|e| e.to_string()),
            mig: is_mig(&name),
            device,
            name,
            capabilities,
        });
    }
    Ok(Report {
        driver_version,
        wsl: is_wsl(),
        visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        devices,
    })
}

/// True when this Linux runs under WSL (`/proc/version` names Microsoft, or `WSL_DISTRO_NAME` is set).
pub fn is_wsl() -> bool {
    std::env::var_os("WSL_DISTRO_NAME").is_some()
        || std::fs::read_to_string("/proc/version")
            .map(|v| v.to_ascii_lowercase().contains("microsoft"))
            .unwrap_or(false)
}

/// The Yama LSM's ptrace rule (`/proc/sys/kernel/yama/ptrace_scope`), which also governs
/// `pidfd_getfd` (taking another process's file descriptor needs ptrace rights over it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PtraceScope {
    /// No Yama LSM (the file is absent): classic rules, a process may take the descriptors of
    /// any process of the same user.
    NoYama,
    /// 0: classic rules, as without Yama.
    Classic,
    /// 1: only descendants, or processes that allowed it with `PR_SET_PTRACER`, unless the caller
    /// has `CAP_SYS_PTRACE`.
    Restricted,
    /// 2: only with `CAP_SYS_PTRACE`.
    AdminOnly,
    /// 3: never, until reboot.
    NoAttach,
    /// A value this crate does not know, or a file that could not be read.
    Other(i64),
}

/// Reads the ptrace rule that decides whether `pidfd_getfd` can take a peer's descriptors.
///
/// `pidfd_getfd` is an optional fast path for passing VMM file descriptors; passing them over a
/// Unix socket (`SCM_RIGHTS`) works whatever this says.
pub fn ptrace_scope() -> PtraceScope {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => PtraceScope::NoYama,
        Err(_) => PtraceScope::Other(-1),
        Ok(t) => match t.trim().parse::<i64>() {
            Ok(0) => PtraceScope::Classic,
            Ok(1) => PtraceScope::Restricted,
            Ok(2) => PtraceScope::AdminOnly,
            Ok(3) => PtraceScope::NoAttach,
            Ok(v) => PtraceScope::Other(v),
            Err(_) => PtraceScope::Other(-1),
        },
    }
}

/// Size and free space of the file system holding POSIX shared memory (`statvfs` of `/dev/shm`),
/// in bytes: `(total, available to this user)`.
///
/// # Errors
/// [`crate::Error::Os`] when `statvfs` fails (e.g. no `/dev/shm` in a minimal container).
pub fn shm_space() -> Result<(u64, u64)> {
    let st = rustix::fs::statvfs(crate::shm::SHM_DIR)
        .map_err(|e| crate::error::OsError::new("statvfs", crate::shm::SHM_DIR, e))?;
    Ok((
        st.f_blocks.saturating_mul(st.f_frsize),
        st.f_bavail.saturating_mul(st.f_frsize),
    ))
}

/// Whether this process can create POSIX shared memory: a file of its own made in `/dev/shm`
/// (`O_CREAT | O_EXCL`, mode 0600, 4096 bytes written) and removed at once. Free space alone
/// ([`shm_space`]) says nothing of a read-only mount or a directory this user may not write.
///
/// # Errors
/// [`crate::Error::Os`] naming the call that failed (`open`: `EROFS` for a read-only mount,
/// `EACCES` for a directory this user may not write; `write`: `ENOSPC`).
pub fn shm_writable() -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let path = format!(
        "{}/cuda-ipc.probe.{}.{nanos}",
        crate::shm::SHM_DIR,
        std::process::id()
    );
    let os =
        |call: &'static str, e: std::io::Error| crate::error::OsError::io(call, path.as_str(), e);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| os("open", e))?;
    let written = f.write_all(&[0u8; 4096]).map_err(|e| os("write", e));
    drop(f);
    // Ours, just made: removed whatever the write did.
    let removed = std::fs::remove_file(&path).map_err(|e| os("unlink", e));
    written.and(removed).map_err(Into::into)
}

fn is_mig(name: &str) -> bool {
    name.contains("MIG") || std::env::var("CUDA_VISIBLE_DEVICES").is_ok_and(|v| v.contains("MIG-"))
}

fn common_verdict(what: &'static str, name: &str, caps: &DeviceCapabilities) -> Result<()> {
    let unsupported = |reason: String, fix: &'static str| Error::Unsupported { what, reason, fix };
    if is_wsl() {
        return Err(unsupported(
            "running under WSL2, whose CUDA driver has no IPC".into(),
            "run on native Linux",
        ));
    }
    match caps.compute_mode {
        ComputeMode::ExclusiveProcess => {
            return Err(unsupported(
                "the device is in EXCLUSIVE_PROCESS compute mode, so only one process can use it"
                    .into(),
                "set the default mode with `nvidia-smi -c DEFAULT` (needs root), or run all stages in one process",
            ));
        }
        ComputeMode::Prohibited => {
            return Err(unsupported(
                "the device is in PROHIBITED compute mode".into(),
                "set the default mode with `nvidia-smi -c DEFAULT` (needs root)",
            ));
        }
        _ => {}
    }
    if is_mig(name) {
        return Err(unsupported(
            "the device is a MIG instance, which does not support CUDA IPC".into(),
            "use a full GPU (MIG disabled) for the processes that share memory",
        ));
    }
    if caps.integrated {
        return Err(unsupported(
            "the device is an integrated (Tegra) GPU, which has no legacy CUDA IPC".into(),
            "share memory through VMM file descriptors or NvSciBuf on this platform",
        ));
    }
    Ok(())
}

fn legacy_ipc_verdict(name: &str, caps: &DeviceCapabilities) -> Result<()> {
    common_verdict("CUDA IPC", name, caps)?;
    if !caps.unified_addressing {
        return Err(Error::Unsupported {
            what: "CUDA IPC",
            reason: "the device has no unified addressing".into(),
            fix: "use a 64-bit Linux process on a discrete GPU",
        });
    }
    Ok(())
}

fn events_verdict(name: &str, caps: &DeviceCapabilities) -> Result<()> {
    common_verdict("IPC events", name, caps)?;
    if !caps.ipc_events {
        return Err(Error::Unsupported {
            what: "IPC events",
            reason: "the device reports CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED = 0".into(),
            fix: "use a discrete GPU on Linux without MPS restrictions",
        });
    }
    Ok(())
}

type Verdicts = BTreeMap<(i32, bool), std::result::Result<(), String>>;
static CACHE: Mutex<Verdicts> = Mutex::new(BTreeMap::new());

fn cached(device: &Device, events: bool) -> Result<()> {
    let key = (device.ordinal() as i32, events);
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(v) = cache.get(&key) {
        return v.clone().map_err(|reason| Error::Unsupported {
            what: if events { "IPC events" } else { "CUDA IPC" },
            reason,
            fix: "see the first error of this kind in this process",
        });
    }
    let caps = device.capabilities()?;
    let name = device.name()?;
    let v = if events {
        events_verdict(&name, &caps)
    } else {
        legacy_ipc_verdict(&name, &caps)
    };
    cache.insert(
        key,
        v.as_ref().map(|_| ()).map_err(|e| match e {
            Error::Unsupported { reason, .. } => reason.clone(),
            other => other.to_string(),
        }),
    );
    v
}

/// Checks once per device and process that legacy IPC memory handles can work on `device`.
///
/// # Errors
/// [`Error::Unsupported`] naming the reason (WSL, exclusive or prohibited compute mode, MIG,
/// integrated GPU) and the fix; [`Error::Cuda`] when an attribute query fails.
pub fn require_legacy_ipc(device: &Device) -> Result<()> {
    cached(device, false)
}

/// Checks once per device and process that interprocess events can work on `device`.
///
/// # Errors
/// As [`require_legacy_ipc`], and when the device reports no IPC event support.
pub fn require_ipc_events(device: &Device) -> Result<()> {
    cached(device, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> DeviceCapabilities {
        DeviceCapabilities {
            compute_capability: (9, 0),
            compute_mode: ComputeMode::Default,
            integrated: false,
            ipc_events: true,
            vmm: true,
            posix_fd_handles: true,
            fabric_handles: true,
            memory_pools: true,
            mempool_handle_types: crate::driver::MEMPOOL_HANDLE_POSIX_FD,
            unified_addressing: true,
            mps_enabled: false,
            total_memory: 1 << 30,
            pci_bus_id: "0000:00:00.0".into(),
        }
    }

    #[test]
    fn exclusive_process_mode_is_refused_with_the_fix() {
        let mut c = caps();
        c.compute_mode = ComputeMode::ExclusiveProcess;
        let e = legacy_ipc_verdict("NVIDIA H200", &c)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("EXCLUSIVE_PROCESS") && e.contains("nvidia-smi -c DEFAULT"),
            "{e}"
        );
    }

    #[test]
    fn mig_integrated_and_missing_event_support_are_refused() {
        assert!(legacy_ipc_verdict("NVIDIA A100 MIG 1g.10gb", &caps()).is_err());
        let mut c = caps();
        c.integrated = true;
        assert!(
            legacy_ipc_verdict("Orin", &c)
                .unwrap_err()
                .to_string()
                .contains("Tegra")
        );
        let mut c = caps();
        c.ipc_events = false;
        assert!(events_verdict("GPU", &c).is_err());
        if !is_wsl() {
            assert!(legacy_ipc_verdict("NVIDIA H200", &caps()).is_ok());
        }
    }

    #[test]
    fn host_checks_read_dev_shm_and_the_ptrace_rule() {
        let (total, free) = shm_space().unwrap();
        assert!(total > 0 && free <= total);
        let scope = ptrace_scope();
        let present = std::path::Path::new("/proc/sys/kernel/yama/ptrace_scope").exists();
        assert_eq!(scope == PtraceScope::NoYama, !present, "{scope:?}");
        assert!(!matches!(scope, PtraceScope::Other(_)), "{scope:?}");
    }

    #[test]
    fn report_without_a_driver_is_driver_not_found() {
        match report() {
            Err(Error::DriverNotFound { searched }) => assert!(searched.contains("libcuda.so")),
            Ok(r) => assert!(r.driver_version > 0),
            Err(Error::Cuda(_)) => {}
            Err(e) => panic!("unexpected {e}"),
        }
    }
}
