//! The remote lane: a channel's frames reach a channel on another host over NVIDIA NIXL, and
//! consumers there attach with the ordinary [`Consumer::attach`].
//!
//! Owns: the two bridges ([`send`] on the producer's host, [`recv`] on the consumers'), their
//! control connection ([`wire`], plain TCP) and the NIXL agent they move frames with ([`nixl`]);
//! and the tensor-set bridges ([`tensorset`]), which mirror a tensor set's generations to a set
//! of the same layout on another host over the same control connection and NIXL agent.
//!
//! The control connection proves the shared secret both ways without sending it (HMAC-SHA256
//! challenge-response over fresh nonces from each end, the whole exchange against one deadline)
//! and authenticates every later message with a key derived from the secret and both nonces and
//! a sequence number per direction, so a replayed, reordered or injected message, or a recorded
//! session, is refused ([`wire`]); it is not encrypted. The receiving bridge greets each
//! connection on a thread of its own (at most [`recv::MAX_HANDSHAKES`] at once), so a slow or
//! silent peer never delays another, and refuses a geometry out of bounds
//! ([`wire::check_geometry`]) and goes on waiting for the next sender. UCX's log, which the lane
//! reads for its transport report, is a file in a private folder ([`report::UcxLog`]).
//! Built on the channel's public API only ([`Producer`], [`Consumer`]); it never changes the
//! channel's segments or protocol.
//!
//! One frame:
//! 1. the receiving bridge, the far channel's [`Producer`], takes a buffer to lend (waiting, as
//!    any producer, for its consumers: back-pressure), and once the buffer's last readers are done
//!    with it on their GPUs (their release words, read on the host) registers it with NIXL once
//!    and sends a credit naming it over the control connection; it keeps up to
//!    [`recv::RecvOptions::credits`] buffers credited at once (lent ahead of the frames), so a
//!    credit travels while the WRITEs before it run;
//! 2. the sending bridge, a [`Consumer`] of the near channel, receives the next frame (every frame
//!    or the latest, by its delivery policy), waits for its ready word on the host (NIXL knows no
//!    stream), and WRITEs its bytes into the oldest credited far buffer (`postXferReq`) with a
//!    notification carrying the buffer index, the near sequence number, the length and the
//!    metadata ([`wire::FrameNote`]); it goes on to the next frame meanwhile (one WRITE in flight
//!    per credit), and drops each frame once its WRITE completed, releasing its hold on the near
//!    buffer from the host;
//! 3. the receiving bridge takes the notifications (`getNotifs`), which may come in any order,
//!    and publishes the buffers in the order it credited them, with each frame's metadata, its
//!    ready word written from the host; far consumers receive them as any frame.
//!
//! Neither bridge puts work on a stream; both may run as threads of the processes at their ends
//! ([`send::serve`], [`recv::serve`]), which on a GPU without MPS saves the context switches
//! between a bridge's transfers and its neighbour's kernels.
//!
//! A far consumer that dies has its holds reclaimed by the far producer (the receiving bridge) as
//! on one host; the near side is never held by more than the one frame being written. When the
//! near producer closes, the far channel is closed; when the near producer, the sending bridge or
//! the link dies, [`recv::serve`] returns [`recv::Ended::Lost`] holding the far producer, and the
//! caller ends its process without dropping it (what `cuda-ipc bridge recv` does), so far
//! consumers get [`ChannelError::ProducerGone`] within the liveness period (about 20 ms after the link
//! was seen lost: at once on a closed connection, after [`LaneOptions::link_timeout`] on a silent
//! one). The sending bridge detaches from the near channel while it has no link, so the near
//! producer never waits for it, and attaches again when a restarted receiving bridge accepts it.
//!
//! [`Consumer::attach`]: crate::channel::Consumer::attach
//! [`Consumer`]: crate::channel::Consumer
//! [`Producer`]: crate::channel::Producer
//! [`Producer::acquire`]: crate::channel::Producer::acquire
//! [`ChannelError::ProducerGone`]: crate::channel::ChannelError::ProducerGone

pub(crate) mod error;
mod link;
pub mod nixl;
pub mod recv;
pub mod report;
pub mod send;
pub mod tensorset;
pub mod wire;

pub(crate) use error::BUSY;
pub use error::RemoteError;

use std::time::Duration;

/// Timeouts and periods of a lane, both ends.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct LaneOptions {
    /// Connecting the control connection (per address tried); default 5 s.
    pub connect_timeout: Duration,
    /// A connection's whole handshake (one deadline for every message of it, however its bytes
    /// trickle in; on the receiving side the sender's channel geometry too), and the metadata
    /// step after it; default 5 s.
    pub handshake_timeout: Duration,
    /// How often each end sends a heartbeat; default 100 ms.
    pub heartbeat: Duration,
    /// Silence after which the link counts as lost; default 500 ms (a closed connection is seen
    /// at once).
    pub link_timeout: Duration,
    /// Longest a WRITE may take to complete; default 10 s.
    pub write_timeout: Duration,
    /// How long a bridge keeps polling without a pause after a frame before it blocks: the
    /// sending bridge's wait for the next near frame (then on the channel's futex), the receiving
    /// bridge's poll of NIXL for notifications (then on the control connection, which an
    /// announced WRITE wakes at once, with naps of 50 µs to 1 ms; at least 1 ms). UCX's TCP
    /// transport moves data only while both ends poll. Default 2 ms. Longer keeps a lane whose
    /// frames come further apart hot (lower hand-off latency) at the cost of a core per bridge;
    /// on a machine with fewer cores than busy processes, shorter is faster. An idle lane
    /// blocks whatever this is.
    pub spin: Duration,
}

impl Default for LaneOptions {
    fn default() -> Self {
        LaneOptions {
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            heartbeat: Duration::from_millis(100),
            link_timeout: Duration::from_millis(500),
            write_timeout: Duration::from_secs(10),
            spin: Duration::from_millis(2),
        }
    }
}

/// The network interface that owns address `ip` (`getifaddrs`), e.g. `lo` for 127.0.0.1; `None`
/// for an unspecified address (0.0.0.0, ::) or one no interface has.
pub fn interface_of(ip: std::net::IpAddr) -> Option<String> {
    if ip.is_unspecified() {
        return None;
    }
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `head` is a valid out-pointer; on success the list is freed below with
    // `freeifaddrs` and not used after.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut p = head;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list `getifaddrs` returned, alive until `freeifaddrs`.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: `ifa_addr` is non-null and points to a sockaddr whose family says its layout.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let addr = match family {
            libc::AF_INET => {
                // SAFETY: family AF_INET: the sockaddr is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                std::net::IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes())
            }
            libc::AF_INET6 => {
                // SAFETY: family AF_INET6: the sockaddr is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                std::net::IpAddr::from(sin6.sin6_addr.s6_addr)
            }
            _ => continue,
        };
        if addr == ip {
            // SAFETY: `ifa_name` is a non-null NUL-terminated string owned by the list.
            let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
            found = Some(name.to_string_lossy().into_owned());
            break;
        }
    }
    // SAFETY: `head` came from a successful `getifaddrs` and is freed once.
    unsafe { libc::freeifaddrs(head) };
    found
}

/// The local address this host uses to reach `peer` (a UDP socket connected to it; nothing is
/// sent), for [`environment`] on the connecting side.
///
/// # Errors
/// [`RemoteError::Link`] when no route leads there.
pub fn local_address_towards(peer: std::net::SocketAddr) -> crate::Result<std::net::IpAddr> {
    let any: std::net::SocketAddr = if peer.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s = std::net::UdpSocket::bind(any)
        .and_then(|s| s.connect(peer).map(|()| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| RemoteError::Link(format!("no route to {peer}: {e}")))?;
    Ok(s.ip())
}

/// The environment a bridge's process needs before NIXL creates its UCX backend
/// ([`nixl::Lane::new`]), as (variable, value) pairs for `std::process::Command::env` (`cuda-ipc
/// bridge` starts itself again with them), leaving out what is set already:
/// - `UCX_NET_DEVICES`: the interface owning `ip` (the control connection's local address), so
///   UCX's TCP transport listens and connects there alone, not on every interface. RDMA users
///   name their devices themselves (`UCX_NET_DEVICES=mlx5_0:1,eth0`). An unspecified `ip`
///   (0.0.0.0) names no interface: left out, with a warning;
/// - `UCX_PROTO_INFO=y` and `UCX_LOG_FILE` naming `log`'s file, when `log` is given: UCX prints
///   its protocol choices there, where [`report::from_ucx_log`] reads which transport carried the
///   lane. A [`report::UcxLog`] is a file in a private folder of this user: UCX opens it by its
///   path (following links, truncating), so a name others could predict or plant in a shared
///   folder is never given.
pub fn environment(
    ip: std::net::IpAddr,
    log: Option<&report::UcxLog>,
) -> Vec<(&'static str, std::ffi::OsString)> {
    let mut v = Vec::new();
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        match interface_of(ip) {
            Some(dev) => v.push(("UCX_NET_DEVICES", dev.into())),
            None => tracing::warn!(
                "{ip} names no single interface: UCX's TCP transport may listen on every \
                 interface (name the address, or set UCX_NET_DEVICES)"
            ),
        }
    }
    if let Some(log) = log {
        if std::env::var_os("UCX_PROTO_INFO").is_none() {
            v.push(("UCX_PROTO_INFO", "y".into()));
        }
        if std::env::var_os("UCX_LOG_FILE").is_none() {
            v.push(("UCX_LOG_FILE", log.path().as_os_str().to_owned()));
        }
    }
    v
}

/// Warns when UCX is not bound to the interface of the control connection's local address `ip`
/// (`UCX_NET_DEVICES` unset): its TCP transport then listens on every interface.
fn check_binding(ip: std::net::IpAddr) {
    match std::env::var("UCX_NET_DEVICES") {
        Ok(d) => tracing::info!("lane: UCX network devices: {d}"),
        Err(_) => tracing::warn!(
            "lane: UCX_NET_DEVICES is not set: UCX's TCP transport listens on every interface, not \
             only {} ({ip}); set it (remote::environment, or run through `cuda-ipc bridge`)",
            interface_of(ip).unwrap_or_else(|| "the named one".into())
        ),
    }
}
