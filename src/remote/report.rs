//! What the lane reports: which UCX transport NIXL's backend chose (from what UCX itself prints
//! with `UCX_PROTO_INFO=y`; NIXL's C API names the backend only), whether a path asked to be
//! GPU-direct was staged through host memory, and the bridge's status file, which `cuda-ipc ls`
//! and `watch` read to show a channel as bridged.
//!
//! The status file is `/dev/shm/cuda-ipc.br.NAME` (mode 0644), `key=value` lines: `role`
//! (`send` or `recv`), `pid`, `start_time` (the bridge's identity, for liveness), `peer`, `memory`
//! (`host` or `device`), `transport` (UCX's words, or `unknown`), `path` (`gpu-direct`,
//! `host-staged`, `host` or `unknown`) and `frames`. The bridge writes it (a temporary file
//! renamed over it) and removes it when its session ends, if it is still its own.

use super::nixl::Place;
use crate::identity::ProcessIdentity;
use std::path::PathBuf;

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
        let (transports, lines, devices) = if put.0.is_empty() { all } else { put };
        let has = |t: &str| transports.iter().any(|x| x == t);
        let staged_words = lines
            .iter()
            .any(|l| l.contains("pipeline") || l.contains("staged") || l.contains("bounce"));
        let device = matches!(near, Place::Device(_)) || matches!(far, Place::Device(_));
        let path = if transports.is_empty() {
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

/// Reads UCX's log (see [`ucx_log_path`]) and judges it ([`Transport::parse`]); `None` when UCX
/// logs elsewhere (stdout) or the file cannot be read. Warnings and errors UCX wrote there are
/// passed on to the log.
pub fn from_ucx_log(near: Place, far: Place) -> Option<Transport> {
    let text = std::fs::read_to_string(ucx_log_path()?).ok()?;
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
    /// Frames carried.
    pub frames: u64,
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
            me: ProcessIdentity::current().ok(),
        }
    }

    /// The file's text.
    pub fn text(&self) -> String {
        let (pid, start) = self.me.map_or((0, 0), |m| (m.pid, m.start_time));
        format!(
            "role={}\npid={pid}\nstart_time={start}\nchannel={}\npeer={}\nmemory={}\ntransport={}\npath={}\nframes={}\n",
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
            self.frames
        )
    }

    /// Writes the status file (a temporary file in the same folder renamed over it); failures
    /// are logged at debug level, as the file only informs.
    pub fn write(&self) {
        let path = status_path(&self.channel);
        let mut tmp = path.clone().into_os_string();
        tmp.push(format!(".tmp-lane-{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let r = std::fs::write(&tmp, self.text()).and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = r {
            let _ = std::fs::remove_file(&tmp);
            tracing::debug!("lane status {}: {e}", path.display());
        }
    }

    /// Removes the status file if it is still this process's (its pid and start time).
    pub fn remove(&self) {
        let path = status_path(&self.channel);
        let Some(me) = self.me else { return };
        let Ok(text) = std::fs::read_to_string(&path) else {
            return;
        };
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
