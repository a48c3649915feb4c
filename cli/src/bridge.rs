//! `cuda-ipc bridge send|recv`: the two ends of the remote lane (`cuda_ipc::remote`, NIXL), and the
//! bridge status that `ls` and `watch` show beside a channel.

use std::path::PathBuf;

/// What a bridge's status file (`/dev/shm/cuda-ipc.br.NAME`, written by `cuda_ipc::remote`) says.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BridgeStatus {
    /// `send` (the channel is carried to another host) or `recv` (filled from another host).
    pub role: String,
    /// The bridge process.
    pub pid: u32,
    /// Whether the bridge process still runs (its pid with the same start time).
    pub alive: bool,
    /// The other bridge's control address.
    pub peer: String,
    /// This end's memory: `host` or `device`.
    pub memory: String,
    /// UCX's transports and devices (`tcp@lo`), or `unknown`.
    pub transport: String,
    /// `host`, `gpu-direct`, `host-staged` or `unknown`.
    pub path: String,
    /// Frames carried so far (updated about once a second); generations, for a tensor set.
    pub frames: u64,
    /// What it carries: `channel` or `tensorset`.
    pub object: String,
}

/// The status file of a bridge of `channel` (`ts.SET` for tensor set SET's).
pub fn status_path(channel: &str) -> PathBuf {
    PathBuf::from(format!("/dev/shm/cuda-ipc.br.{channel}"))
}

/// Field 22 of `/proc/PID/stat` (start time in clock ticks), after the command's closing `)`.
fn start_time(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Parses a status file's text; `None` when it lacks the role or pid.
pub fn parse(text: &str) -> Option<(BridgeStatus, u64)> {
    let mut b = BridgeStatus::default();
    let mut start = 0;
    for line in text.lines() {
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        match k {
            "role" => b.role = v.to_string(),
            "pid" => b.pid = v.parse().ok()?,
            "start_time" => start = v.parse().ok()?,
            "peer" => b.peer = v.to_string(),
            "memory" => b.memory = v.to_string(),
            "transport" => b.transport = v.to_string(),
            "path" => b.path = v.to_string(),
            "frames" => b.frames = v.parse().unwrap_or(0),
            "object" => b.object = v.to_string(),
            _ => {}
        }
    }
    (!b.role.is_empty() && b.pid != 0).then_some((b, start))
}

/// The status of `channel`'s bridge, if one wrote a status file.
pub fn read(channel: &str) -> Option<BridgeStatus> {
    let text = std::fs::read_to_string(status_path(channel)).ok()?;
    let (mut b, start) = parse(&text)?;
    b.alive = start_time(b.pid) == Some(start);
    Some(b)
}

/// The line `ls` prints under a bridged channel, and a loud second one for a host-staged GPU path.
pub fn describe(b: &BridgeStatus) -> String {
    let what = if b.role == "recv" {
        format!("filled from {}", b.peer)
    } else {
        format!("carried to {}", b.peer)
    };
    let mut s = format!(
        "  bridged over NIXL: {what}; UCX {} ({}); {} memory; bridge pid {} {}; {} {}\n",
        b.transport,
        b.path,
        b.memory,
        b.pid,
        if b.alive { "alive" } else { "dead" },
        b.frames,
        if b.object == "tensorset" {
            "generations"
        } else {
            "frames"
        }
    );
    if b.path == "host-staged" {
        s.push_str(
            "  WARNING: device memory goes HOST-STAGED over this lane, not GPU-direct \
             (see the bridge's log)\n",
        );
    }
    s
}

#[cfg(feature = "remote")]
pub use run::{BridgeCommand, run};

/// The largest `bridge send --chunk-mib`: its bytes (MiB × 2^20) still count in a `u64`.
#[cfg(feature = "remote")]
pub const MAX_CHUNK_MIB: u64 = u64::MAX >> 20;

#[cfg(feature = "remote")]
mod run {
    use super::MAX_CHUNK_MIB;
    use crate::Outcome;
    use cuda_ipc::channel::Delivery;
    use cuda_ipc::remote::nixl::Place;
    use cuda_ipc::remote::report::UcxLog;
    use cuda_ipc::remote::tensorset::{recv as ts_recv, send as ts_send};
    use cuda_ipc::remote::wire::Secret;
    use cuda_ipc::remote::{LaneOptions, RemoteError, recv, send};
    use std::error::Error;
    use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
    use std::os::unix::process::CommandExt as _;
    use std::path::PathBuf;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    /// Where the secret comes from: exactly one of a file or an environment variable.
    #[derive(clap::Args, Debug)]
    #[group(required = true, multiple = false)]
    pub struct SecretArgs {
        /// A file holding the shared secret (mode 0600 or 0400: a file others may read or write is
        /// refused; one trailing newline is ignored).
        #[arg(long)]
        secret_file: Option<PathBuf>,
        /// An environment variable holding the shared secret.
        #[arg(long)]
        secret_env: Option<String>,
    }

    impl SecretArgs {
        fn load(&self) -> cuda_ipc::Result<Secret> {
            match (&self.secret_file, &self.secret_env) {
                (Some(f), _) => Secret::from_file(f),
                (None, Some(v)) => Secret::from_env(v),
                (None, None) => Err(cuda_ipc::Error::InvalidArgument(
                    "a secret is needed (--secret-file or --secret-env)".into(),
                )),
            }
        }
    }

    /// The two ends of a lane.
    #[derive(clap::Subcommand, Debug)]
    pub enum BridgeCommand {
        /// On the producer's host: attach to CHANNEL as a consumer and WRITE each frame to the
        /// receiving bridge at --connect. Reconnects (and detaches from CHANNEL meanwhile) when the
        /// link is lost, unless --once. With --tensorset SET instead: read SET and mirror each of
        /// its new generations into the far set (whole, or with --changed-only the tensors whose
        /// content changed).
        Send {
            /// The channel on this host whose frames are sent.
            #[arg(
                long,
                required_unless_present = "tensorset",
                conflicts_with = "tensorset"
            )]
            channel: Option<String>,
            /// The tensor set on this host whose generations are mirrored.
            #[arg(long)]
            tensorset: Option<String>,
            /// Tensor sets: WRITE only the tensors whose content digest changed since the
            /// generation the far set mirrors (16 bytes per tensor, computed on the GPU for a
            /// device set: one read of the set per generation; not a cryptographic hash).
            #[arg(long, requires = "tensorset")]
            changed_only: bool,
            /// Tensor sets: `gpu-direct` fails at the first WRITE (before the bulk) when UCX
            /// reaches the far memory only through host buffers.
            #[arg(long, default_value = "any", value_parser = ["any", "gpu-direct"])]
            require: String,
            /// Tensor sets: the largest WRITE, in MiB (0 counts as 1; at most 2^44 - 1, so that
            /// its bytes count in 64 bits).
            #[arg(long, default_value_t = 64,
                  value_parser = clap::value_parser!(u64).range(..=MAX_CHUNK_MIB))]
            chunk_mib: u64,
            /// Tensor sets: WRITEs in flight at once.
            #[arg(long, default_value_t = 8)]
            in_flight: usize,
            /// The receiving bridge's address, HOST:PORT.
            #[arg(long)]
            connect: String,
            #[command(flatten)]
            secret: SecretArgs,
            /// This bridge's delivery policy on CHANNEL: every frame (back-pressure end to end)
            /// or the latest (frames the lane cannot carry in time are dropped here).
            #[arg(long, default_value = "every", value_parser = ["every", "latest"])]
            delivery: String,
            /// End after one session instead of reconnecting.
            #[arg(long)]
            once: bool,
            /// Silence on the control connection after which the link counts as lost, in ms.
            #[arg(long, default_value_t = 500)]
            link_timeout_ms: u64,
        },
        /// On the consumers' host: listen on --listen for one sending bridge, create CHANNEL with
        /// the far channel's geometry and keep it filled. When the link, the sending bridge or
        /// the far producer dies, this process exits (status 3) so CHANNEL's consumers get
        /// ProducerGone; run it again (e.g. under a supervisor) to resume.
        ///
        /// With --tensorset SET instead: create SET with the sending bridge's layout (buffered,
        /// --buffers, default 2) and publish each generation once every byte of it landed; a
        /// lost sender leaves SET's last whole generation and the next one is awaited.
        Recv {
            /// The channel this bridge creates on this host.
            #[arg(
                long,
                required_unless_present = "tensorset",
                conflicts_with = "tensorset"
            )]
            channel: Option<String>,
            /// The tensor set this bridge creates and keeps mirrored on this host.
            #[arg(long)]
            tensorset: Option<String>,
            /// The address to listen on, ADDR:PORT (UCX's data is bound to the same interface).
            #[arg(long)]
            listen: String,
            #[command(flatten)]
            secret: SecretArgs,
            /// The far channel's or far tensor set's memory.
            #[arg(long, default_value = "host", value_parser = ["host", "device"])]
            memory: String,
            /// The CUDA device (ordinal) for --memory device.
            #[arg(long, default_value_t = 0)]
            device: u32,
            /// Buffers in the channel (default: as many as the near channel has), or in the
            /// tensor set (default 2).
            #[arg(long)]
            buffers: Option<usize>,
            /// Silence on the control connection after which the link counts as lost, in ms.
            #[arg(long, default_value_t = 500)]
            link_timeout_ms: u64,
        },
    }

    /// Set in the environment of the bridge once it started itself again with UCX's environment.
    const READY: &str = "CUDA_IPC_BRIDGE_ENV";

    fn first_addr(a: &str) -> Result<SocketAddr, Box<dyn Error>> {
        a.to_socket_addrs()
            .map_err(|e| format!("address {a}: {e}"))?
            .next()
            .ok_or_else(|| format!("address {a} resolves to nothing").into())
    }

    /// Starts this program again with UCX's environment for a lane whose control connection
    /// uses local address `ip` (`cuda_ipc::remote::environment`), unless that was done already.
    /// UCX's log goes into a private folder made for it (`UcxLog`: mode 0700, a fresh random
    /// name), never to a name others could predict or plant in the shared temp folder. Returns
    /// that log once restarted (dropping it removes the folder); `None` when `UCX_LOG_FILE` was
    /// the user's own.
    fn with_environment(ip: std::net::IpAddr) -> Result<Option<UcxLog>, Box<dyn Error>> {
        if std::env::var_os(READY).is_some() {
            return Ok(UcxLog::adopt_from_env());
        }
        let log = match std::env::var_os("UCX_LOG_FILE") {
            Some(_) => None,
            None => Some(UcxLog::create()?),
        };
        let env = cuda_ipc::remote::environment(ip, log.as_ref());
        let exe = std::env::current_exe()?;
        let err = std::process::Command::new(exe)
            .args(std::env::args_os().skip(1))
            .envs(env)
            .env(READY, "1")
            .exec();
        Err(format!("starting the bridge again with UCX's environment: {err}").into())
    }

    fn lane(link_timeout_ms: u64) -> LaneOptions {
        let mut l = LaneOptions::default();
        l.link_timeout = Duration::from_millis(link_timeout_ms.max(50));
        l
    }

    /// `cuda-ipc bridge send --tensorset`: sessions until the near set closes (or, with `once`,
    /// one session).
    fn send_set(opts: &ts_send::SendOptions, once: bool) -> Result<Outcome, Box<dyn Error>> {
        let stop = AtomicBool::new(false);
        let mut totals = ts_send::Totals::default();
        loop {
            let r = ts_send::serve(opts, &stop, &mut totals);
            eprintln!(
                "cuda-ipc bridge send: {} mirrored ({} written) so far",
                crate::text::plural(totals.generations, "generation"),
                crate::text::plural(totals.bytes, "byte")
            );
            match r {
                Ok(ts_send::Ended::Closed) => return Ok(Outcome::Ok),
                Ok(e) => {
                    eprintln!("cuda-ipc bridge send: {e:?}");
                    if once {
                        return Ok(Outcome::Problems);
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
                Err(e @ cuda_ipc::Error::Remote(RemoteError::Refused(_)))
                | Err(e @ cuda_ipc::Error::Unsupported { .. }) => return Err(e.into()),
                // `Busy` (the receiving bridge has not yet seen that our last session is gone)
                // and every other failure: tried again.
                Err(e) => {
                    eprintln!("cuda-ipc bridge send: {e}");
                    if once {
                        return Err(e.into());
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
            }
        }
    }

    /// `cuda-ipc bridge recv --tensorset`: until the near set closes (the far set is closed
    /// then).
    fn recv_set(
        opts: &ts_recv::RecvOptions,
        listener: &TcpListener,
    ) -> Result<Outcome, Box<dyn Error>> {
        let mut totals = ts_recv::Totals::default();
        let r = ts_recv::serve(opts, listener, &AtomicBool::new(false), &mut totals)?;
        eprintln!(
            "cuda-ipc bridge recv: {} generations published from {} senders ({} abandoned)",
            totals.generations, totals.sessions, totals.abandoned
        );
        match r {
            ts_recv::Ended::Closed(w) => {
                w.close(Duration::from_secs(5))?;
                Ok(Outcome::Ok)
            }
            _ => Ok(Outcome::Problems),
        }
    }

    /// `cuda-ipc bridge send|recv`.
    pub fn run(cmd: BridgeCommand) -> Result<Outcome, Box<dyn Error>> {
        match cmd {
            BridgeCommand::Send {
                channel,
                tensorset,
                changed_only,
                require,
                chunk_mib,
                in_flight,
                connect,
                secret,
                delivery,
                once,
                link_timeout_ms,
            } => {
                let peer = first_addr(&connect)?;
                let ip = cuda_ipc::remote::local_address_towards(peer)?;
                let log = with_environment(ip)?;
                let channel = match (channel, tensorset) {
                    (Some(c), _) => c,
                    (None, Some(set)) => {
                        let mut opts = ts_send::SendOptions::new(&set, &connect, secret.load()?);
                        opts.changed_only = changed_only;
                        opts.require_gpu_direct = require == "gpu-direct";
                        opts.chunk = chunk_mib.max(1) << 20;
                        opts.in_flight = in_flight.max(1);
                        opts.lane = lane(link_timeout_ms);
                        let r = send_set(&opts, once);
                        drop(log);
                        return r;
                    }
                    (None, None) => return Err("--channel or --tensorset is needed".into()),
                };
                let mut opts = send::SendOptions::new(&channel, &connect, secret.load()?);
                opts.delivery = if delivery == "latest" {
                    Delivery::LatestOnly
                } else {
                    Delivery::EveryFrame
                };
                opts.lane = lane(link_timeout_ms);
                let stop = AtomicBool::new(false);
                loop {
                    let mut totals = send::Totals::default();
                    let r = send::serve(&opts, &stop, &mut totals);
                    eprintln!(
                        "cuda-ipc bridge send: {} frames sent this session",
                        totals.frames
                    );
                    match r {
                        Ok(send::Ended::Closed) => {
                            drop(log);
                            return Ok(Outcome::Ok);
                        }
                        Ok(e) => {
                            eprintln!("cuda-ipc bridge send: {e:?}");
                            if once {
                                return Ok(Outcome::Problems);
                            }
                            std::thread::sleep(Duration::from_secs(1));
                        }
                        Err(e @ cuda_ipc::Error::Remote(RemoteError::Refused(_)))
                        | Err(e @ cuda_ipc::Error::Unsupported { .. }) => return Err(e.into()),
                        // `Busy` and every other failure: tried again.
                        Err(e) => {
                            eprintln!("cuda-ipc bridge send: {e}");
                            if once {
                                return Err(e.into());
                            }
                            std::thread::sleep(Duration::from_millis(500));
                        }
                    }
                }
            }
            BridgeCommand::Recv {
                channel,
                tensorset,
                listen,
                secret,
                memory,
                device,
                buffers,
                link_timeout_ms,
            } => {
                let addr = first_addr(&listen)?;
                let log = with_environment(addr.ip())?;
                let place = if memory == "device" {
                    Place::Device(device)
                } else {
                    Place::Host
                };
                let channel = match (channel, tensorset) {
                    (Some(c), _) => c,
                    (None, Some(set)) => {
                        let mut opts = ts_recv::RecvOptions::new(&set, secret.load()?);
                        opts.place = place;
                        opts.buffers = buffers.unwrap_or(2);
                        let most = cuda_ipc::channel::MAX_BUFFERS;
                        if !(2..=most).contains(&opts.buffers) {
                            // Said before anything listens.
                            return Err(format!(
                                "--buffers {}: a far tensor set takes 2 to {most}",
                                opts.buffers
                            )
                            .into());
                        }
                        opts.lane = lane(link_timeout_ms);
                        let listener = listen_on(addr)?;
                        eprintln!("cuda-ipc bridge recv: listening on {addr} for tensor set {set}");
                        let r = recv_set(&opts, &listener);
                        drop(log);
                        return r;
                    }
                    (None, None) => return Err("--channel or --tensorset is needed".into()),
                };
                // Said before anything listens: no peer could be served otherwise.
                recv::check_buffers(buffers).map_err(|e| format!("--buffers: {e}"))?;
                let mut opts = recv::RecvOptions::new(&channel, secret.load()?);
                opts.place = place;
                opts.buffers = buffers;
                opts.lane = lane(link_timeout_ms);
                let listener = listen_on(addr)?;
                eprintln!("cuda-ipc bridge recv: listening on {addr} for channel {channel}");
                let mut frames = 0;
                match recv::serve(&opts, &listener, &AtomicBool::new(false), &mut frames)? {
                    recv::Ended::Closed(r) => {
                        eprintln!(
                            "cuda-ipc bridge recv: the near channel closed after {frames} frames"
                        );
                        r?;
                        drop(log);
                        Ok(Outcome::Ok)
                    }
                    recv::Ended::Lost { producer, reason } => {
                        eprintln!(
                            "cuda-ipc bridge recv: LANE LOST after {frames} frames: {reason}; \
                             exiting so that the consumers of {channel} see the producer gone"
                        );
                        // The producer is not dropped (that would close the channel): the process
                        // ends with it open, and consumers see ProducerGone.
                        let _keep = producer;
                        // `exit` runs no destructor: UCX's private log folder is removed first.
                        drop(log);
                        std::process::exit(3)
                    }
                    _ => Ok(Outcome::Problems),
                }
            }
        }
    }

    /// How long `bridge recv` waits for its address while another process holds it.
    const LISTEN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

    /// Listens on `addr`. While the address is in use it tries again for up to [`LISTEN_WAIT`]: a
    /// supervisor restarting a killed bridge at once finds the old process still exiting (a process
    /// with a CUDA context takes a while to go), holding the port until it is gone.
    fn listen_on(addr: SocketAddr) -> Result<TcpListener, String> {
        let start = std::time::Instant::now();
        let mut said = false;
        loop {
            match TcpListener::bind(addr) {
                Ok(l) => return Ok(l),
                Err(e)
                    if e.kind() == std::io::ErrorKind::AddrInUse
                        && start.elapsed() < LISTEN_WAIT =>
                {
                    if !said {
                        eprintln!(
                            "cuda-ipc bridge recv: {addr} is in use (a bridge before this one may \
                             still be exiting); trying again for up to {} s",
                            LISTEN_WAIT.as_secs()
                        );
                        said = true;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                Err(e) => return Err(format!("listening on {addr}: {e}")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_file_parses_and_a_host_staged_gpu_lane_is_flagged() {
        let text = "role=recv\npid=42\nstart_time=7\nchannel=c\npeer=10.0.0.1:5000\n\
                    memory=device\ntransport=tcp,cuda_copy@eth0,cuda\npath=host-staged\nframes=9\n";
        let (b, start) = parse(text).unwrap();
        assert_eq!(start, 7);
        assert_eq!((b.role.as_str(), b.pid, b.frames), ("recv", 42, 9));
        let d = describe(&b);
        assert!(d.contains("filled from 10.0.0.1:5000"), "{d}");
        assert!(d.contains("HOST-STAGED"), "{d}");
        assert!(parse("pid=1\n").is_none());
        assert!(parse("garbage").is_none());
    }
}
