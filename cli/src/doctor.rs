//! `doctor`: can this machine share CUDA memory and events between processes? One line per check,
//! with the fix where something is missing.

use crate::Outcome;
use crate::text::bytes;
use cuda_ipc::Error;
use cuda_ipc::driver::{ComputeMode, MEMPOOL_HANDLE_FABRIC, MEMPOOL_HANDLE_POSIX_FD};
use cuda_ipc::probe::{self, PtraceScope};
use std::error::Error as StdError;

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    /// Works.
    Ok,
    /// Not needed for the main path, or a slower path is used instead.
    Warn,
    /// Facts without a verdict.
    Info,
    /// Sharing cannot work until this is fixed (exit status 1).
    Fail,
}

/// The checks' lines: printed as they come, or (`--json`) kept for one document at the end.
struct Report {
    failed: bool,
    /// `Some` with `--json`: the checks so far.
    json: Option<Vec<serde_json::Value>>,
}

impl Report {
    fn line(&mut self, status: Status, what: &str, detail: impl AsRef<str>) {
        let tag = match status {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Info => "info",
            Status::Fail => "FAIL",
        };
        if status == Status::Fail {
            self.failed = true;
        }
        match &mut self.json {
            Some(checks) => checks.push(serde_json::json!({
                "status": tag.to_ascii_lowercase(),
                "check": what,
                "detail": detail.as_ref(),
            })),
            None => out!("{tag:<5} {what:<20} {}", detail.as_ref()),
        }
    }
}

/// The kernel module's version (`/proc/driver/nvidia/version`: `NVRM version: ... Kernel Module
/// 580.159.04 ...`).
fn kernel_module_version() -> Option<String> {
    module_version_of(&std::fs::read_to_string("/proc/driver/nvidia/version").ok()?)
}

fn module_version_of(text: &str) -> Option<String> {
    let line = text.lines().next()?;
    let after = line.split("Kernel Module").nth(1)?;
    // "... Open Kernel Module for x86_64  580.159.04  Release Build ...": the first word that is a
    // dotted number.
    after
        .split_whitespace()
        .find(|w| w.contains('.') && w.chars().all(|c| c.is_ascii_digit() || c == '.'))
        .map(str::to_string)
}

/// A field of `/proc/self/status` (`Uid:`, `CapEff:`).
fn status_field(key: &str) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .map(|v| v.trim().to_string())
}

/// Whether this process has `CAP_SYS_PTRACE` (bit 19 of the effective capability set).
fn has_cap_sys_ptrace() -> bool {
    status_field("CapEff:")
        .and_then(|v| u64::from_str_radix(&v, 16).ok())
        .is_some_and(|caps| caps & (1 << 19) != 0)
}

/// The running kernel's (major, minor) version from `/proc/sys/kernel/osrelease`.
fn kernel_version() -> Option<(u32, u32)> {
    let text = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    let mut it = text.trim().split(['.', '-']);
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

fn yes(b: bool) -> Status {
    if b { Status::Ok } else { Status::Warn }
}

fn devices(r: &mut Report) {
    let rep = match probe::report() {
        Ok(rep) => rep,
        Err(e @ Error::DriverNotFound { .. }) => {
            r.line(Status::Fail, "driver", e.to_string());
            return;
        }
        Err(Error::Cuda(e)) if e.code == 100 => {
            r.line(
                Status::Fail,
                "devices",
                format!("the driver sees no GPU ({e}); fix: check `nvidia-smi`, and that CUDA_VISIBLE_DEVICES does not hide every device"),
            );
            return;
        }
        Err(e) => {
            r.line(
                Status::Fail,
                "driver",
                format!("cannot query the driver: {e}"),
            );
            return;
        }
    };
    let v = rep.driver_version;
    r.line(
        Status::Ok,
        "driver",
        format!(
            "CUDA {}.{} (cuDriverGetVersion {v}){}",
            v / 1000,
            (v % 1000) / 10,
            kernel_module_version()
                .map(|k| format!(", kernel module {k}"))
                .unwrap_or_default()
        ),
    );
    if let Some(vis) = &rep.visible_devices {
        r.line(Status::Info, "CUDA_VISIBLE_DEVICES", vis);
    }
    if rep.devices.is_empty() {
        r.line(
            Status::Fail,
            "devices",
            "no GPU is visible; fix: check `nvidia-smi` and CUDA_VISIBLE_DEVICES",
        );
    }
    for d in &rep.devices {
        let c = &d.capabilities;
        let gpu = format!("GPU {}", d.device.ordinal());
        r.line(
            Status::Ok,
            &gpu,
            format!(
                "{}, {}, compute {}.{}, {}, PCI {}",
                d.name,
                d.device.uuid(),
                c.compute_capability.0,
                c.compute_capability.1,
                bytes(c.total_memory as u64),
                c.pci_bus_id
            ),
        );
        let sub = |s: &str| format!("  {s}");
        match &d.legacy_ipc {
            Ok(()) => r.line(
                Status::Ok,
                &sub("IPC memory"),
                "cuIpcGetMemHandle works here",
            ),
            Err(why) => r.line(Status::Fail, &sub("IPC memory"), why),
        }
        match &d.ipc_events {
            Ok(()) => r.line(Status::Ok, &sub("IPC events"), "supported"),
            Err(why) => r.line(Status::Fail, &sub("IPC events"), why),
        }
        r.line(
            yes(c.vmm),
            &sub("VMM"),
            if c.vmm {
                "supported (cuMemCreate / cuMemMap)"
            } else {
                "not supported; legacy IPC handles are used instead"
            },
        );
        r.line(
            yes(c.posix_fd_handles),
            &sub("POSIX-fd handles"),
            if c.posix_fd_handles {
                "supported (VMM memory can be exported as a file descriptor)"
            } else {
                "not supported; fix: a driver of CUDA 10.2 or newer on Linux"
            },
        );
        // The attribute says the hardware could; exporting also needs an IMEX channel, so try it.
        match (c.fabric_handles, cuda_ipc::ipc::fabric_handles(&d.device)) {
            (true, Ok(())) => r.line(
                Status::Ok,
                &sub("fabric handles"),
                "supported and exportable (only needed to share across nodes)",
            ),
            (true, Err(why)) => r.line(
                Status::Info,
                &sub("fabric handles"),
                format!(
                    "refused: {why}; not needed on one host (POSIX fds are used); across nodes: run the IMEX daemon"
                ),
            ),
            (false, _) => r.line(
                Status::Info,
                &sub("fabric handles"),
                "not supported (only needed to share across nodes over NVLink)",
            ),
        }
        let mut kinds = Vec::new();
        if c.mempool_handle_types & MEMPOOL_HANDLE_POSIX_FD != 0 {
            kinds.push("POSIX fd");
        }
        if c.mempool_handle_types & MEMPOOL_HANDLE_FABRIC != 0 {
            kinds.push("fabric");
        }
        r.line(
            yes(c.memory_pools),
            &sub("memory pools"),
            match (c.memory_pools, kinds.is_empty()) {
                (true, false) => format!("supported; pools export {}", kinds.join(", ")),
                (true, true) => "supported; pools cannot be exported".to_string(),
                (false, _) => "not supported (stream-ordered allocation cannot be shared)".into(),
            },
        );
        let (st, mode) = match c.compute_mode {
            ComputeMode::Default => (Status::Ok, "DEFAULT".to_string()),
            ComputeMode::ExclusiveProcess => (
                Status::Fail,
                "EXCLUSIVE_PROCESS: one process at a time; fix: `nvidia-smi -c DEFAULT` (root)"
                    .to_string(),
            ),
            ComputeMode::Prohibited => (
                Status::Fail,
                "PROHIBITED; fix: `nvidia-smi -c DEFAULT` (root)".to_string(),
            ),
            other => (Status::Warn, format!("{other:?}")),
        };
        r.line(st, &sub("compute mode"), mode);
        if d.mig {
            r.line(
                Status::Fail,
                &sub("MIG"),
                "a MIG instance: no CUDA IPC; fix: use a full GPU (MIG disabled) for the processes that share memory",
            );
        } else {
            r.line(Status::Ok, &sub("MIG"), "not a MIG instance");
        }
        if c.mps_enabled {
            r.line(
                Status::Info,
                &sub("MPS"),
                "an MPS server serves this device (each client still has its own address space)",
            );
        }
    }
}

fn host(r: &mut Report) {
    if probe::is_wsl() {
        r.line(
            Status::Fail,
            "WSL",
            "running under WSL2, whose CUDA driver has no IPC; fix: run on native Linux",
        );
    } else {
        r.line(Status::Ok, "WSL", "native Linux");
    }
    match probe::shm_space() {
        Ok((total, free)) => {
            let detail = format!("{} total, {} free", bytes(total), bytes(free));
            if let Err(e) = probe::shm_writable() {
                r.line(
                    Status::Fail,
                    "/dev/shm",
                    format!("{detail}, but nothing can be created there: {e}; fix: a writable tmpfs on /dev/shm, mode 1777 (`mount -o remount,rw /dev/shm`; `--shm-size=1g` for a container)"),
                );
            } else if free < 16 << 20 {
                r.line(
                    Status::Warn,
                    "/dev/shm",
                    format!("{detail}; registries and channels need a little room; fix: `mount -o remount,size=1G /dev/shm`, or `--shm-size=1g` for a container"),
                );
            } else {
                r.line(Status::Ok, "/dev/shm", format!("{detail}, writable"));
            }
        }
        Err(e) => r.line(
            Status::Fail,
            "/dev/shm",
            format!("{e}; fix: mount a tmpfs on /dev/shm (POSIX shared memory lives there)"),
        ),
    }
    let root = status_field("Uid:")
        .and_then(|v| v.split_whitespace().nth(1).map(|e| e == "0"))
        .unwrap_or(false);
    let privileged = root || has_cap_sys_ptrace();
    let fd_passing = "file descriptors still pass over Unix sockets (SCM_RIGHTS)";
    let (st, detail) = match probe::ptrace_scope() {
        PtraceScope::NoYama => (
            Status::Ok,
            "no Yama: pidfd_getfd works between processes of one user".to_string(),
        ),
        PtraceScope::Classic => (
            Status::Ok,
            "ptrace_scope 0: pidfd_getfd works between processes of one user".to_string(),
        ),
        PtraceScope::Restricted if privileged => (
            Status::Ok,
            "ptrace_scope 1, and this process has CAP_SYS_PTRACE: pidfd_getfd works".to_string(),
        ),
        PtraceScope::Restricted => (
            Status::Warn,
            format!(
                "ptrace_scope 1: pidfd_getfd only on descendants; {fd_passing}; fix: `sysctl kernel.yama.ptrace_scope=0` or give the processes CAP_SYS_PTRACE"
            ),
        ),
        PtraceScope::AdminOnly if privileged => (
            Status::Ok,
            "ptrace_scope 2, and this process has CAP_SYS_PTRACE: pidfd_getfd works".to_string(),
        ),
        PtraceScope::AdminOnly => (
            Status::Warn,
            format!(
                "ptrace_scope 2: pidfd_getfd needs CAP_SYS_PTRACE; {fd_passing}; fix: give the processes CAP_SYS_PTRACE"
            ),
        ),
        PtraceScope::NoAttach => (
            Status::Warn,
            format!("ptrace_scope 3: pidfd_getfd never works (until reboot); {fd_passing}"),
        ),
        other => (
            Status::Warn,
            format!("cannot read /proc/sys/kernel/yama/ptrace_scope ({other:?}); {fd_passing}"),
        ),
    };
    r.line(st, "ptrace", detail);
    match kernel_version() {
        Some(v) if v < (5, 6) => r.line(
            Status::Warn,
            "kernel",
            format!(
                "Linux {}.{}: no pidfd_getfd before 5.6; {fd_passing}",
                v.0, v.1
            ),
        ),
        Some(v) => r.line(
            Status::Ok,
            "kernel",
            format!("Linux {}.{} (pidfd_getfd since 5.6)", v.0, v.1),
        ),
        None => r.line(
            Status::Warn,
            "kernel",
            "cannot read /proc/sys/kernel/osrelease",
        ),
    }
}

/// What this process can see of MPS (the CUDA Multi-Process Service).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct MpsFacts {
    /// The pipe directory (`CUDA_MPS_PIPE_DIRECTORY`, default `/tmp/nvidia-mps`).
    pipe_dir: String,
    /// The control daemon's endpoint (`<pipe dir>/control`): a Unix socket (current daemons) or
    /// a named pipe (older ones), and whether the daemon answers there.
    control: Control,
    /// `nvidia-cuda-mps-control` on `PATH`, when found.
    control_binary: Option<String>,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` of this process.
    thread_percentage: Option<String>,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` of this process.
    pinned_mem_limit: Option<String>,
}

fn mps_facts() -> MpsFacts {
    let pipe_dir = std::env::var("CUDA_MPS_PIPE_DIRECTORY")
        .ok()
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| "/tmp/nvidia-mps".to_string());
    let control = control_state(std::path::Path::new(&format!("{pipe_dir}/control")));
    let control_binary = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("nvidia-cuda-mps-control"))
            .find(|f| f.is_file())
            .map(|f| f.display().to_string())
    });
    MpsFacts {
        pipe_dir,
        control,
        control_binary,
        thread_percentage: std::env::var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").ok(),
        pinned_mem_limit: std::env::var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").ok(),
    }
}

/// What stands at the MPS control daemon's endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Control {
    /// Nothing (or something that is neither a socket nor a named pipe).
    #[default]
    Absent,
    /// A socket or named pipe nobody serves: a daemon that quit or died left it.
    Stale,
    /// A socket that accepted a connection, or a named pipe with a reader: the daemon runs.
    Live,
}

/// Whether the MPS control daemon answers at `path`: a Unix socket (current daemons; seen with
/// driver 580) is connected to and closed at once (refused: stale); a named pipe (older daemons)
/// is opened for writing without blocking (no reader, `ENXIO`: stale). Nothing is written.
fn control_state(path: &std::path::Path) -> Control {
    use std::os::unix::fs::FileTypeExt;
    let Ok(m) = std::fs::symlink_metadata(path) else {
        return Control::Absent;
    };
    let t = m.file_type();
    if t.is_socket() {
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Control::Live,
            Err(_) => Control::Stale,
        }
    } else if t.is_fifo() {
        use rustix::fs::{Mode, OFlags};
        match rustix::fs::open(
            path,
            OFlags::WRONLY | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(_) => Control::Live,
            Err(_) => Control::Stale,
        }
    } else {
        Control::Absent
    }
}

/// The MPS lines: whether the daemon runs, and this client's limits.
fn mps_lines(f: &MpsFacts) -> Vec<(Status, String)> {
    let mut v = Vec::new();
    let binary = f
        .control_binary
        .as_deref()
        .map_or("nvidia-cuda-mps-control is not on PATH".to_string(), |b| {
            format!("control program {b}")
        });
    let line = match f.control {
        Control::Live => format!(
            "running: control pipe {}/control; {binary}; kernels of several processes share the GPU at once (each still has its own address space, so IPC is still needed)",
            f.pipe_dir
        ),
        Control::Stale => format!(
            "not running (a stale control pipe {}/control answers nobody: a daemon quit or died); {binary}; processes time-share the GPU",
            f.pipe_dir
        ),
        Control::Absent => format!(
            "not running (no control pipe in {}); {binary}; processes time-share the GPU",
            f.pipe_dir
        ),
    };
    v.push((Status::Info, line));
    let limit = |what: &str, val: &Option<String>, unset: &str| match val {
        Some(x) => format!("{what}={x}"),
        None => format!("{what} unset ({unset})"),
    };
    v.push((
        Status::Info,
        format!(
            "this client: {}; {}",
            limit(
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                &f.thread_percentage,
                "all SMs"
            ),
            limit(
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                &f.pinned_mem_limit,
                "no device memory limit"
            )
        ),
    ));
    v
}

/// NVML, the quota budgets beside each device's free memory, and MPS.
fn monitoring(r: &mut Report) {
    let gpu = crate::gpu::query();
    match gpu.missing() {
        Some(why) => r.line(Status::Warn, "NVML", why),
        None => {
            for g in gpu.gpus() {
                r.line(
                    Status::Ok,
                    "NVML",
                    format!(
                        "GPU {} {}: utilization {}, memory {} used of {} ({} free), {} compute processes",
                        g.index,
                        g.uuid,
                        g.utilization_percent.map_or("?".into(), |u| format!("{u}%")),
                        bytes(g.memory_used),
                        bytes(g.memory_total),
                        bytes(g.memory_total.saturating_sub(g.memory_used)),
                        g.processes.len()
                    ),
                );
            }
        }
    }
    let (ledgers, errors) = crate::quota::collect();
    if ledgers.is_empty() && errors.is_empty() {
        r.line(
            Status::Info,
            "quota",
            "no budgets set (`cuda-ipc quota set --device UUID|host|all --bytes SIZE`); pools are bounded only by each producer's own ChannelOptions::quota_bytes",
        );
    }
    for s in &ledgers {
        let free = if s.device.0 == [0; 16] {
            match probe::shm_space() {
                Ok((_, free)) => format!("/dev/shm has {} free", bytes(free)),
                Err(e) => format!("/dev/shm free space unknown: {e}"),
            }
        } else {
            let uuid = s.device.to_string();
            match (gpu.missing(), gpu.gpus().iter().find(|g| g.uuid == uuid)) {
                (_, Some(g)) => format!(
                    "device has {} free of {} (NVML)",
                    bytes(g.memory_total.saturating_sub(g.memory_used)),
                    bytes(g.memory_total)
                ),
                (Some(why), None) => format!("device free memory unknown: {why}"),
                (None, None) => "device free memory unknown: NVML does not see this device".into(),
            }
        };
        let dead = s.holders.iter().filter(|h| h.left_in.is_some()).count();
        let dead = if dead == 0 {
            String::new()
        } else {
            format!(
                " ({dead} dead, their host memory still in /dev/shm until their user's `cuda-ipc gc`)"
            )
        };
        r.line(
            Status::Info,
            "quota",
            format!(
                "{} on {}: {}, {} holders{dead}; {free}; advisory: memory allocated outside cuda-ipc is not counted",
                s.scope,
                crate::quota::device_name(&s.device),
                crate::quota::used_of(s),
                s.holders.len()
            ),
        );
    }
    for (n, e) in &errors {
        r.line(
            Status::Warn,
            "quota",
            format!("ledger {n} cannot be read: {e}"),
        );
    }
    for (st, line) in mps_lines(&mps_facts()) {
        r.line(st, "MPS", line);
    }
}

/// `cuda-ipc doctor [--json]`. JSON (docs/cli.md): `{"ok": bool, "checks": [{"status", "check",
/// "detail"}]}`, `status` one of `ok`, `warn`, `info`, `fail`; exit status 1 when `ok` is false.
pub fn run(json: bool) -> Result<Outcome, Box<dyn StdError>> {
    let mut r = Report {
        failed: false,
        json: json.then(Vec::new),
    };
    devices(&mut r);
    host(&mut r);
    monitoring(&mut r);
    if let Some(checks) = r.json.take() {
        let v = serde_json::json!({"ok": !r.failed, "checks": checks});
        out!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(if r.failed {
            Outcome::Problems
        } else {
            Outcome::Ok
        });
    }
    if r.failed {
        out!("problems found: CUDA IPC cannot work here until the FAIL lines are fixed");
        Ok(Outcome::Problems)
    } else {
        out!("no problems found");
        Ok(Outcome::Ok)
    }
}

#[cfg(test)]
mod tests {
    use super::{Control, MpsFacts, control_state, module_version_of, mps_lines};

    #[test]
    fn mps_is_reported_with_its_pipe_and_this_clients_limits() {
        let on = MpsFacts {
            pipe_dir: "/run/mps".into(),
            control: Control::Live,
            control_binary: Some("/usr/bin/nvidia-cuda-mps-control".into()),
            thread_percentage: Some("25".into()),
            pinned_mem_limit: Some("0=2G".into()),
        };
        let l = mps_lines(&on);
        assert!(
            l[0].1.starts_with("running: control pipe /run/mps/control"),
            "{l:?}"
        );
        assert!(l[0].1.contains("/usr/bin/nvidia-cuda-mps-control"));
        assert!(l[1].1.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"));
        assert!(l[1].1.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2G"));
        let off = MpsFacts {
            pipe_dir: "/tmp/nvidia-mps".into(),
            ..Default::default()
        };
        let l = mps_lines(&off);
        assert!(
            l[0].1
                .starts_with("not running (no control pipe in /tmp/nvidia-mps)")
        );
        assert!(l[0].1.contains("not on PATH"));
        let stale = MpsFacts {
            control: Control::Stale,
            ..off.clone()
        };
        assert!(
            mps_lines(&stale)[0]
                .1
                .starts_with("not running (a stale control pipe /tmp/nvidia-mps/control")
        );
        assert!(
            l[1].1
                .contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE unset (all SMs)")
        );
    }

    #[test]
    fn a_control_socket_or_pipe_nobody_serves_is_stale_and_one_served_is_live() {
        // A folder of this test's alone (mode 0700): `mkdir` fails on a name someone else made
        // first, and nothing of another user's is removed.
        use std::os::unix::fs::DirBuilderExt as _;
        let dir = std::env::temp_dir().join(format!("doctor-mps-{}", std::process::id()));
        std::fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        let sock = dir.join("control");
        assert_eq!(control_state(&sock), Control::Absent);
        let l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        assert_eq!(control_state(&sock), Control::Live);
        drop(l);
        // The socket file stays after its listener is gone, as after `quit`.
        assert!(sock.exists());
        // A child that another test of this binary forks at this moment holds a copy of the
        // listening socket until its `exec` (close-on-exec): for that instant the socket is still
        // served. It goes stale once no copy is left.
        let start = std::time::Instant::now();
        while control_state(&sock) != Control::Stale {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(5),
                "the socket is still served 5 s after its listener was dropped"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        std::fs::remove_file(&sock).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &sock,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert_eq!(control_state(&sock), Control::Stale);
        let reader = rustix::fs::open(
            &sock,
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        assert_eq!(control_state(&sock), Control::Live);
        drop(reader);
        std::fs::write(dir.join("plain"), b"x").unwrap();
        assert_eq!(control_state(&dir.join("plain")), Control::Absent);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_module_version_is_the_dotted_number_after_kernel_module() {
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)  Thu Oct  2 2025\nGCC version: gcc 12";
        assert_eq!(module_version_of(open).as_deref(), Some("580.159.04"));
        let closed = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 2024";
        assert_eq!(module_version_of(closed).as_deref(), Some("550.54.15"));
        assert_eq!(module_version_of("garbage"), None);
    }
}
