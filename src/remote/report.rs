//! What the lane reports: which UCX transport NIXL's backend chose (from what UCX itself prints
//! with `UCX_PROTO_INFO=y`; NIXL's C API names the backend only), whether a path asked to be
//! GPU-direct was staged through host memory, and the bridge's status file, which `cuda-ipc ls`
//! and `watch` read to show a channel as bridged.
//!
//! The status file is `/dev/shm/cuda-ipc.br.NAME` (mode 0644), `key=value` lines: `role`
//! (`send` or `recv`), `pid`, `start_time` (the bridge's identity, for liveness), `peer`, `memory`
//! (`host` or `device`), `transport` (UCX's words, or `unknown`), `path` (`gpu-direct`,
//! `host-staged`, `host` or `unknown`), `frames` (generations, for a tensor set) and `object`
//! (`channel` or `tensorset`: what NAME names; a tensor set `SET`'s bridge writes
//! `cuda-ipc.br.ts.SET`, [`tensorset_status_name`]). The bridge writes it (a temporary file
//! renamed over it) and removes it when its session ends, if it is still its own.

use super::nixl::Place;
use crate::identity::ProcessIdentity;
use std::path::{Path as FsPath, PathBuf};
use std::sync::OnceLock;

/// A bridge's end of the lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// On the producer's host.
    Send,
    /// On the consumers' host.
    Recv,
}

/// The path a transfer took between the two ends' memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Path {
    /// Host memory at both ends: no GPU involved.
    Host,
    /// Device memory reached directly (`cuda_ipc`, `gdr_copy`, RDMA from GPU memory).
    GpuDirect,
    /// Device memory copied through host buffers (`cuda_copy` with a host transport such as
    /// `tcp`): what a GPU-direct lane falls back to.
    HostStaged,
    /// UCX printed nothing this parser knows.
    Unknown,
}

impl Path {
    /// The status file's word.
    pub fn word(self) -> &'static str {
        match self {
            Path::Host => "host",
            Path::GpuDirect => "gpu-direct",
            Path::HostStaged => "host-staged",
            Path::Unknown => "unknown",
        }
    }
}

/// What UCX reported of the lane's transfers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transport {
    /// The UCX transports named in the protocol lines (`tcp`, `cuda_copy`, `rc_mlx5`, ...), in
    /// order of first appearance.
    pub transports: Vec<String>,
    /// The devices named with them (`lo`, `eth0`, `mlx5_0:1`), in order of first appearance.
    pub devices: Vec<String>,
    /// The protocol lines themselves (UCX's words), for the log.
    pub lines: Vec<String>,
    /// The path judged from them and from the memory at both ends.
    pub path: Path,
}

/// The transports of UCX this parser recognises in `UCX_PROTO_INFO` output.
const KNOWN: &[&str] = &[
    "cuda_ipc",
    "cuda_copy",
    "gdr_copy",
    "rc_mlx5",
    "rc_verbs",
    "dc_mlx5",
    "ud_mlx5",
    "ud_verbs",
    "rc",
    "dc",
    "ud",
    "tcp",
    "sysv",
    "posix",
    "cma",
    "knem",
    "xpmem",
    "self",
];

impl Transport {
    /// Judges UCX's `UCX_PROTO_INFO=y` text, for a lane from memory `near` to memory `far`. UCX
    /// prints one table per operation: a header naming it (`remote memory write by ucp_put* from
    /// host memory to host`, which is NIXL's WRITE) and rows of a size range, a description
    /// (`zero-copy`, `pipeline`, ...) and the transports (`tcp/lo`, `cuda_copy/cuda`). The tables of
    /// remote writes are judged; when there are none, every table is.
    pub fn parse(text: &str, near: Place, far: Place) -> Transport {
        let mut put = (Vec::new(), Vec::new(), Vec::new());
        let mut all = (Vec::new(), Vec::new(), Vec::new());
        let mut in_put = false;
        for line in text.lines() {
            // Table rows and headers: `| ... |` after UCX's log prefix.
            let Some(start) = line.find('|') else {
                continue;
            };
            let row = line[start..].trim();
            if row.contains(" by ucp_") {
                in_put = row.contains("remote memory write");
            }
            let cells: Vec<&str> = row
                .split('|')
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .collect();
            // A row: a size range (`0..inf`, `1..16515`, `0`), a description, the transports.
            let is_row = cells.len() == 3
                && cells[0]
                    .chars()
                    .all(|c| c.is_ascii_digit() || c == '.' || c == 'i' || c == 'n' || c == 'f');
            let words: Vec<&str> = if is_row {
                cells[2]
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|w| !w.is_empty())
                    .collect()
            } else {
                Vec::new()
            };
            // `tcp/lo, cuda_copy/cuda`: transport/device pairs.
            let pairs: Vec<(&str, &str)> = if is_row {
                cells[2]
                    .split([',', ' '])
                    .filter_map(|x| x.trim().split_once('/'))
                    .collect()
            } else {
                Vec::new()
            };
            for (ts, ls, ds) in [Some(&mut all), in_put.then_some(&mut put)]
                .into_iter()
                .flatten()
            {
                for w in &words {
                    // `tcp/lo`, `cuda_copy/cuda` split into words: a device name is no transport.
                    if KNOWN.contains(w) && !ts.iter().any(|t: &String| t == w) {
                        ts.push(w.to_string());
                    }
                }
                for (t, d) in &pairs {
                    if KNOWN.contains(t) && !ds.iter().any(|x: &String| x == d) {
                        ds.push(d.to_string());
                    }
                }
                if is_row || row.contains(" by ucp_") {
                    ls.push(row.to_string());
                }
            }
        }
        let no_put_table = put.0.is_empty();
        let (transports, lines, devices) = if no_put_table { all } else { put };
        let has = |t: &str| transports.iter().any(|x| x == t);
        let staged_words = lines
            .iter()
            .any(|l| l.contains("pipeline") || l.contains("staged") || l.contains("bounce"));
        let device = matches!(near, Place::Device(_)) || matches!(far, Place::Device(_));
        let path = if transports.is_empty() || (device && no_put_table) {
            // Device memory with no table of the WRITE itself: the other tables (the
            // notifications' active messages, from host memory) say nothing of its path. Seen on
            // an H200: the WRITEs ran GPU to GPU at 1.4 TB/s while only those tables, naming
            // `cuda_copy` and `tcp`, were in the log (docs/gpu-verification.md, run AX).
            Path::Unknown
        } else if !device {
            Path::Host
        } else if has("cuda_ipc") || has("gdr_copy") {
            Path::GpuDirect
        } else if has("cuda_copy") || staged_words {
            Path::HostStaged
        } else if ["rc_mlx5", "rc_verbs", "dc_mlx5", "rc", "dc"]
            .iter()
            .any(|t| has(t))
        {
            Path::GpuDirect
        } else {
            Path::HostStaged
        };
        Transport {
            transports,
            devices,
            lines,
            path,
        }
    }

    /// The transports and devices in one word (`tcp,cuda_copy@lo,cuda`), or `unknown`.
    pub fn summary(&self) -> String {
        if self.transports.is_empty() {
            "unknown".into()
        } else {
            format!("{}@{}", self.transports.join(","), self.devices.join(","))
        }
    }

    /// Logs the transport (at info), loudly (at error) when device memory went host-staged.
    pub fn log(&self, side: &str) {
        match self.path {
            Path::HostStaged => tracing::error!(
                "lane ({side}): device memory is HOST-STAGED, not GPU-direct: UCX used {} \
                 (see the UCX protocol lines at debug level; UCX_TLS, UCX_NET_DEVICES and the \
                 memory kind of the pool decide it)",
                self.summary()
            ),
            p => tracing::info!(
                "lane ({side}): UCX transport {} ({})",
                self.summary(),
                p.word()
            ),
        }
        for l in &self.lines {
            tracing::debug!("lane ({side}): UCX: {l}");
        }
    }
}

/// The file UCX logs to, as `UCX_LOG_FILE` names it (`%p` and `%h` expanded), if set.
pub fn ucx_log_path() -> Option<PathBuf> {
    let v = std::env::var("UCX_LOG_FILE").ok()?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    Some(PathBuf::from(
        v.replace("%p", &std::process::id().to_string())
            .replace("%h", host.trim()),
    ))
}

/// A file for UCX's log that no other user can predict, plant or replace: a folder of a fresh
/// random name in the temp folder (`$TMPDIR`, else `/tmp`), created with mode 0700 by this user
/// (`mkdir` fails on a name that exists, so a planted one is never taken), and `ucx.log` in it
/// created with `O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600. UCX writes it by its path
/// (`UCX_LOG_FILE`, see [`environment`](super::environment)); the lane reads it back through
/// [`from_ucx_log`], only from a folder no other user may write to. Dropping it removes the file
/// and the folder.
#[derive(Debug)]
pub struct UcxLog {
    dir: PathBuf,
    path: PathBuf,
}

impl UcxLog {
    /// Creates the private folder and the empty log file in it.
    ///
    /// # Errors
    /// [`crate::Error::Os`] (`mkdir` or `open`, with the path) when either cannot be created.
    pub fn create() -> crate::Result<UcxLog> {
        use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
        let tmp = std::env::temp_dir();
        let dir = tempfile::Builder::new()
            .prefix("cuda-ipc-ucx-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir_in(&tmp)
            .map_err(|e| crate::OsError::io("mkdir", tmp.display().to_string(), e))?
            .keep();
        let log = UcxLog {
            path: dir.join("ucx.log"),
            dir,
        };
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&log.path)
            .map_err(|e| crate::OsError::io("open", log.path.display().to_string(), e))?;
        Ok(log)
    }

    /// Takes over the log that `UCX_LOG_FILE` names when it is one [`UcxLog::create`] made for
    /// this user (the process that started this one with [`environment`](super::environment)):
    /// `ucx.log` in a folder that only this user may enter (mode 0700, owned by this user), so
    /// that dropping it removes them. `None` for any other file.
    pub fn adopt_from_env() -> Option<UcxLog> {
        use std::os::unix::fs::MetadataExt as _;
        let path = ucx_log_path()?;
        let dir = path.parent()?.to_path_buf();
        let ours = |m: &std::fs::Metadata| m.uid() == rustix::process::geteuid().as_raw();
        let d = std::fs::symlink_metadata(&dir).ok()?;
        let named = dir
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("cuda-ipc-ucx-"));
        (named
            && path.file_name() == Some(std::ffi::OsStr::new("ucx.log"))
            && d.is_dir()
            && ours(&d)
            && d.mode() & 0o077 == 0
            && open_private(&path).is_ok())
        .then_some(UcxLog { dir, path })
    }

    /// The log file's path, for `UCX_LOG_FILE`.
    pub fn path(&self) -> &FsPath {
        &self.path
    }
}

impl Drop for UcxLog {
    fn drop(&mut self) {
        // Only ours: the folder is this user's alone, so nothing else can be under these names.
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Opens UCX's log `path` for reading when no other user can have planted or rewritten it: its
/// folder (not a link) is owned by this user or root and writable by no one else, and the file,
/// opened without following a link, is a regular file of this user writable by no one else.
fn open_private(path: &FsPath) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
    let refuse = |why: String| std::io::Error::new(std::io::ErrorKind::PermissionDenied, why);
    let me = rustix::process::geteuid().as_raw();
    let dir = path.parent().unwrap_or(FsPath::new("."));
    let d = std::fs::symlink_metadata(dir)?;
    if !d.is_dir() || (d.uid() != me && d.uid() != 0) || d.mode() & 0o022 != 0 {
        return Err(refuse(format!(
            "its folder {} is not this user's alone (mode {:o}, owner {}): other users could \
             plant or replace the file",
            dir.display(),
            d.mode() & 0o7777,
            d.uid()
        )));
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let m = f.metadata()?;
    if !m.is_file() || m.uid() != me || m.mode() & 0o022 != 0 {
        return Err(refuse(format!(
            "not a regular file of this user writable by it alone (mode {:o}, owner {})",
            m.mode() & 0o7777,
            m.uid()
        )));
    }
    Ok(f)
}

/// Reads the whole of `f` from its start (by its descriptor, whatever its offset).
fn read_all(f: &std::fs::File) -> std::io::Result<String> {
    use std::os::unix::fs::FileExt as _;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match f.read_at(&mut buf, out.len() as u64) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        // UCX's protocol tables are a few KiB; a log grown past 16 MiB is cut there.
        if out.len() > 16 << 20 {
            break;
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// UCX's log as this process opened it, once: see [`open_private`].
fn ucx_log_file() -> Option<&'static std::fs::File> {
    static LOG: OnceLock<Option<std::fs::File>> = OnceLock::new();
    LOG.get_or_init(|| {
        let path = ucx_log_path()?;
        match open_private(&path) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!(
                    "lane: UCX's log {} is not read ({e}); make it with remote::report::UcxLog",
                    path.display()
                );
                None
            }
        }
    })
    .as_ref()
}

/// Flushes what UCX has written to its log so far. UCX writes its log through a C `FILE` (fully
/// buffered for a file) and flushes it only for errors, so a protocol table printed at the first
/// WRITE can sit in that buffer when the lane reads the file: device memory was then judged from
/// the other tables alone (an H200 run showed only the notifications' tables, docs/
/// gpu-verification.md, run AX). This calls UCX's own `ucs_log_flush` (libucs, exported), found in
/// the libucs this process already loaded (NIXL's UCX plugin loads it; its file may carry a
/// wheel's hash, `libucs-1a2b3c4d.so.0`), never loading one. Nothing happens when none is loaded.
fn flush_ucx_log() {
    type Flush = unsafe extern "C" fn();
    static FLUSH: OnceLock<Flush> = OnceLock::new();
    let f = match FLUSH.get() {
        Some(f) => Some(*f),
        None => loaded_libucs_flush().map(|f| *FLUSH.get_or_init(|| f)),
    };
    if let Some(f) = f {
        // SAFETY: `ucs_log_flush(void)` takes nothing and returns nothing; it flushes UCX's log
        // stream under the C library's stream lock (safe beside UCX's own writers) and
        // `fsync`s it. Its library stays loaded: the handle that found it is never closed.
        unsafe { f() };
    }
}

/// `ucs_log_flush` of the libucs loaded in this process, if one is.
fn loaded_libucs_flush() -> Option<unsafe extern "C" fn()> {
    use std::ffi::{CStr, CString, c_int, c_void};
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: the loader passes a valid `dl_phdr_info` for the call's duration; `data` is
        // the `Option<CString>` below, borrowed mutably by this call alone.
        let (info, found) = unsafe { (&*info, &mut *data.cast::<Option<CString>>()) };
        if info.dlpi_name.is_null() {
            return 0;
        }
        // SAFETY: a NUL-terminated path owned by the loader, valid during the call.
        let path = unsafe { CStr::from_ptr(info.dlpi_name) };
        let file = path
            .to_bytes()
            .rsplit(|&b| b == b'/')
            .next()
            .unwrap_or_default();
        let is_ucs = file
            .strip_prefix(b"libucs")
            .is_some_and(|rest| rest.starts_with(b".so") || rest.starts_with(b"-"));
        if is_ucs {
            *found = Some(path.to_owned());
            return 1;
        }
        0
    }
    let mut found: Option<CString> = None;
    // SAFETY: `visit` matches the callback type and only reads what the loader passes; `found`
    // outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(visit), (&raw mut found).cast()) };
    let path = found?;
    // SAFETY: RTLD_NOLOAD only returns a handle to a library already loaded (no initialiser
    // runs); the handle is kept (never `dlclose`d), so the symbol stays valid.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    // SAFETY: `handle` is live; the name is NUL-terminated.
    let sym = unsafe { libc::dlsym(handle, c"ucs_log_flush".as_ptr()) };
    if sym.is_null() {
        return None;
    }
    // SAFETY: UCX declares `void ucs_log_flush(void)` (ucs/debug/log_def.h).
    Some(unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn()>(sym) })
}

/// Reads UCX's log (see [`ucx_log_path`]) and judges it ([`Transport::parse`]); `None` when UCX
/// logs elsewhere (stdout) or the file cannot be read. The file is opened once per process
/// (without following a link) and read by that descriptor, and only when no other user can have
/// planted or rewritten it: its folder is writable by its owner alone, this user or root (as the
/// folder of a [`UcxLog`]), and it is this user's regular file; any other is not read, with a
/// warning. Warnings and errors UCX wrote there are passed on to the log.
pub fn from_ucx_log(near: Place, far: Place) -> Option<Transport> {
    let file = ucx_log_file()?;
    flush_ucx_log();
    let text = read_all(file).ok()?;
    for l in text.lines() {
        if l.contains(" WARN ") || l.contains(" ERROR ") {
            tracing::warn!("UCX: {}", l.trim());
        }
    }
    Some(Transport::parse(&text, near, far))
}

/// The status file of a bridge of channel `name`: `/dev/shm/cuda-ipc.br.NAME`.
pub fn status_path(name: &str) -> PathBuf {
    PathBuf::from(format!("/dev/shm/cuda-ipc.br.{name}"))
}

/// The name a tensor-set bridge's status goes by: `ts.SET` (its file is
/// `/dev/shm/cuda-ipc.br.ts.SET`, so it never takes the place of a channel's of the same name).
pub fn tensorset_status_name(set: &str) -> String {
    format!("ts.{set}")
}

/// A bridge's status, as its status file holds it.
#[derive(Clone, Debug)]
pub struct Status {
    /// Which end.
    pub role: Role,
    /// The channel on this host.
    pub channel: String,
    /// The other bridge's control address.
    pub peer: String,
    /// This end's memory.
    pub place: Place,
    /// The transport, once seen.
    pub transport: Option<Transport>,
    /// Frames carried (generations, for a tensor set's bridge).
    pub frames: u64,
    /// What the bridge carries: `channel` (the default) or `tensorset`; the file's `object`
    /// line.
    pub object: &'static str,
    me: Option<ProcessIdentity>,
}

impl Status {
    /// A status with no frames yet.
    pub fn new(role: Role, channel: &str, peer: &str, place: Place) -> Status {
        Status {
            role,
            channel: channel.to_string(),
            peer: peer.to_string(),
            place,
            transport: None,
            frames: 0,
            object: "channel",
            me: ProcessIdentity::current().ok(),
        }
    }

    /// The file's text.
    pub fn text(&self) -> String {
        let (pid, start) = self.me.map_or((0, 0), |m| (m.pid, m.start_time));
        format!(
            "role={}\npid={pid}\nstart_time={start}\nchannel={}\npeer={}\nmemory={}\ntransport={}\npath={}\nframes={}\nobject={}\n",
            match self.role {
                Role::Send => "send",
                Role::Recv => "recv",
            },
            self.channel,
            self.peer,
            match self.place {
                Place::Host => "host",
                Place::Device(_) => "device",
            },
            self.transport
                .as_ref()
                .map_or("unknown".into(), |t| t.summary()),
            self.transport.as_ref().map_or("unknown", |t| t.path.word()),
            self.frames,
            self.object
        )
    }

    /// Writes the status file: a temporary file of a fresh random name in the same folder
    /// (`NAME.tmp-lane-XXXXXX`, created with `O_EXCL`, so never a file or link planted there),
    /// made readable to all (0644) and renamed over the name (which replaces a link there, never
    /// writes through it). Failures are logged at debug level, as the file only informs.
    pub fn write(&self) {
        use std::io::Write as _;
        use std::os::unix::fs::PermissionsExt as _;
        let path = status_path(&self.channel);
        let r = (|| -> std::io::Result<()> {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            let mut tmp = tempfile::Builder::new()
                .prefix(&format!("{name}.tmp-lane-"))
                .rand_bytes(8)
                .tempfile_in(path.parent().unwrap_or(FsPath::new("/dev/shm")))?;
            tmp.write_all(self.text().as_bytes())?;
            tmp.as_file()
                .set_permissions(std::fs::Permissions::from_mode(0o644))?;
            tmp.persist(&path).map_err(|e| e.error)?;
            Ok(())
        })();
        if let Err(e) = r {
            tracing::debug!("lane status {}: {e}", path.display());
        }
    }

    /// Removes the status file if it is still this process's: a regular file of this user (opened
    /// without following a link) naming its pid and start time.
    pub fn remove(&self) {
        use std::io::Read as _;
        use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
        let path = status_path(&self.channel);
        let Some(me) = self.me else { return };
        let Ok(mut f) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
        else {
            return;
        };
        let mine = f
            .metadata()
            .is_ok_and(|m| m.is_file() && m.uid() == rustix::process::geteuid().as_raw());
        let mut text = String::new();
        if !mine || f.read_to_string(&mut text).is_err() {
            return;
        }
        let ours = text.lines().any(|l| l == format!("pid={}", me.pid))
            && text
                .lines()
                .any(|l| l == format!("start_time={}", me.start_time));
        if ours {
            let _ = std::fs::remove_file(&path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ucx_s_log_flush_is_found_in_the_libucs_nixl_loaded() {
        crate::remote::nixl::probe().expect("NIXL (libnixl_capi.so) must be on LD_LIBRARY_PATH");
        // An agent loads NIXL's UCX plugin, and with it libucs (a wheel's `libucs-HASH.so.0`).
        let _lane = crate::remote::nixl::Lane::new("cuda-ipc-report-flush-test").unwrap();
        assert!(loaded_libucs_flush().is_some());
        // Flushing with no log file of UCX's (it logs to stdout here) is harmless.
        flush_ucx_log();
    }

    #[test]
    fn ucx_logs_live_in_private_folders_and_planted_files_are_never_read() {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        let a = UcxLog::create().unwrap();
        let b = UcxLog::create().unwrap();
        assert_ne!(a.path(), b.path(), "a fresh name each time");
        let dir = a.path().parent().unwrap().to_path_buf();
        let d = std::fs::symlink_metadata(&dir).unwrap();
        assert!(d.is_dir() && d.mode() & 0o777 == 0o700, "{:o}", d.mode());
        let f = std::fs::symlink_metadata(a.path()).unwrap();
        assert!(f.is_file() && f.mode() & 0o777 == 0o600, "{:o}", f.mode());
        // What UCX writes by the path is read back by the descriptor.
        std::fs::write(a.path(), "| 0..inf | zero-copy | tcp/lo |\n").unwrap();
        let text = read_all(&open_private(a.path()).unwrap()).unwrap();
        assert_eq!(
            Transport::parse(&text, Place::Host, Place::Host).path,
            Path::Host
        );
        // A file in a folder others may write (the shared temp folder), and a link, are refused.
        let shared = dir.join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let planted = shared.join("ucx.log");
        std::fs::write(&planted, "planted").unwrap();
        assert!(open_private(&planted).is_err(), "a file in a shared folder");
        let link = dir.join("link.log");
        std::os::unix::fs::symlink(a.path(), &link).unwrap();
        assert!(open_private(&link).is_err(), "a link");
        // A file others may write, in a private folder.
        let open = dir.join("open.log");
        std::fs::write(&open, "x").unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(open_private(&open).is_err(), "a file open to all");
        for p in [&planted, &link, &open] {
            std::fs::remove_file(p).unwrap();
        }
        std::fs::remove_dir(&shared).unwrap();
        // Dropping a log removes its file and folder.
        drop(a);
        assert!(!dir.exists());
        let other = b.path().parent().unwrap().to_path_buf();
        drop(b);
        assert!(!other.exists());
    }

    #[test]
    fn a_status_file_is_written_through_a_temporary_of_a_fresh_name_never_through_a_link() {
        let channel = format!("report-status-unit-{}", std::process::id());
        let path = status_path(&channel);
        // A link planted at the status file's name, to a file of ours that must keep its bytes.
        let victim = UcxLog::create().unwrap();
        std::fs::write(victim.path(), "victim").unwrap();
        let _ = std::fs::remove_file(&path);
        std::os::unix::fs::symlink(victim.path(), &path).unwrap();
        let s = Status::new(Role::Recv, &channel, "peer:1", Place::Host);
        s.write();
        assert_eq!(std::fs::read_to_string(victim.path()).unwrap(), "victim");
        let m = std::fs::symlink_metadata(&path).unwrap();
        assert!(m.is_file(), "the link was replaced, not written through");
        assert!(
            std::fs::read_to_string(&path)
                .unwrap()
                .contains("role=recv")
        );
        // No temporary left beside it.
        let tmp = std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok())
            .any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("cuda-ipc.br.{channel}.tmp-lane-"))
            });
        assert!(!tmp);
        s.remove();
        assert!(!path.exists(), "its own status file is removed");
    }

    #[test]
    fn a_staged_device_path_is_told_apart_from_a_direct_one() {
        let put = "| remote memory write by ucp_put* from cuda/GPU0 to cuda |";
        let staged = format!("{put}\n| 0..inf | pipeline | cuda_copy/cuda, tcp/lo |");
        let t = Transport::parse(&staged, Place::Device(0), Place::Device(0));
        assert_eq!(t.path, Path::HostStaged);
        assert_eq!(t.transports, ["cuda_copy", "tcp"]);
        let direct = format!("{put}\n| 0..inf | zero-copy | cuda_ipc/cuda |");
        let t = Transport::parse(&direct, Place::Device(0), Place::Device(0));
        assert_eq!(t.path, Path::GpuDirect);
        let rdma = format!("{put}\n| 0..inf | zero-copy | rc_mlx5/mlx5_0:1 |");
        let t = Transport::parse(&rdma, Place::Device(0), Place::Device(0));
        assert_eq!(t.path, Path::GpuDirect);
        let host = "| 0..inf | zero-copy | tcp/lo |";
        assert_eq!(
            Transport::parse(host, Place::Host, Place::Host).path,
            Path::Host
        );
        assert_eq!(
            Transport::parse("nothing", Place::Host, Place::Host).path,
            Path::Unknown
        );
    }

    #[test]
    fn device_memory_without_a_table_of_the_write_is_unknown_not_staged() {
        // The notifications' tables only, as a near process's log on an H200 held them while its
        // WRITEs ran GPU to GPU (run AX).
        let text = "\
[1.5] [vm:1:0]   | agent intra-node cfg#2                                                 |
[1.5] [vm:1:0]   | active message by ucp_am_send* with reply flag(multi) from host memory |
[1.5] [vm:1:0]   |   0..626 | short              | tcp/lo                                 |
[1.5] [vm:1:0]   | 627..inf | multi-frag copy-in | tcp/lo                                 |
[1.5] [vm:1:0]   | active message by ucp_am_send* from cuda/GPU0 |
[1.5] [vm:1:0]   | 0..inf | multi-frag copy-in | cuda_copy/cuda, cma/memory |
";
        let t = Transport::parse(text, Place::Device(0), Place::Device(0));
        assert_eq!(t.path, Path::Unknown);
        assert_eq!(t.transports, ["tcp", "cuda_copy", "cma"]);
        // Host memory on both ends: any table is the host path.
        assert_eq!(
            Transport::parse(text, Place::Host, Place::Host).path,
            Path::Host
        );
    }

    #[test]
    fn the_write_table_of_real_ucx_output_is_the_one_judged() {
        // UCX with UCX_PROTO_INFO=y, two agents over loopback TCP (as tests/remote_lane.rs).
        let text = "\
[1.5] [vm:1:0]   | agent self cfg#0               |
[1.5] [vm:1:0]   | remote memory write by ucp_put* from host memory to host |
[1.5] [vm:1:0]   +--------+-------------+-----------------------------------+
[1.5] [vm:1:0]   | Range  | Description |              Config               |
[1.5] [vm:1:0]   | 0..inf | zero-copy   | tcp/lo                            |
[1.5] [vm:1:0]   | agent self cfg#0      |
[1.5] [vm:1:0]   | active message by ucp_am_send* from host memory |
[1.5] [vm:1:0]   |          0 | short              | self/memory        |
";
        let t = Transport::parse(text, Place::Host, Place::Host);
        assert_eq!(t.transports, ["tcp"]);
        assert_eq!(t.devices, ["lo"]);
        assert_eq!(t.path, Path::Host);
        assert_eq!(t.lines.len(), 2, "{:?}", t.lines);
    }
}
