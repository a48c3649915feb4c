//! The control connection: a plain TCP stream carrying the handshake, NIXL agent metadata,
//! credits (a far buffer free to be written) and heartbeats. Frames never travel here; they go by
//! NIXL WRITE, their notification carrying [`FrameNote`].
//!
//! A message is a `u32` little-endian length, a one-byte tag and its body; integers are
//! little-endian, strings and byte strings a `u32` length and their bytes. Anything else is
//! [`RemoteError::Protocol`], never a panic.
//!
//! The handshake ([`handshake_send`], [`handshake_recv`]) proves the shared secret both ways
//! without sending it: each end sends a fresh random nonce ([`NONCE_LEN`] bytes), the sending
//! bridge answers with HMAC-SHA256 of both nonces keyed by the secret, and the receiving bridge,
//! once that checked out (compared in constant time), with its own (another label, so one proof is
//! never the other). Before the proofs, messages are at most [`MAX_HANDSHAKE_MESSAGE`] bytes and
//! only the handshake's tags parse ([`Msg::decode_handshake`]); the whole exchange runs against one
//! deadline, not a timeout per read. Every later message is sealed by a [`Session`]: the message is
//! followed by HMAC-SHA256 ([`MAC_LEN`] bytes) of its sequence number in that direction and its
//! bytes, keyed by that direction's key, derived from the secret and both nonces; so a message
//! replayed, reordered, injected or altered is refused ([`Opener::open`]), and a recorded session
//! cannot be replayed (the other end's nonce differs). Nothing is encrypted: metadata, credits and
//! frame notifications can be read on the wire, not forged.
//!
//! This file holds the framing, [`Msg`], the geometry check and [`FrameNote`]; the secret, the
//! handshake and the session live in `session.rs`, re-exported here.

mod session;
mod set;

pub use session::{
    End, Opener, Sealer, Secret, Session, handshake_recv, handshake_send, nonce, recv_sealed,
    send_sealed,
};
pub use set::{FarRegion, MAX_WIRE_TENSORS, SetMsg, SetNote, WireLayout};

use super::RemoteError;
use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The first bytes of a lane's handshake.
pub const MAGIC: [u8; 8] = *b"CIPCLANE";
/// The control protocol's version; both ends must speak the same (2: several credits
/// outstanding, [`Msg::Ready`] says how many; 3: the secret proven by challenge-response, every
/// later message authenticated).
pub const PROTOCOL_VERSION: u32 = 3;
/// The most credits a receiving bridge may have outstanding ([`Msg::Ready`]'s `credits`).
pub const MAX_CREDITS: u32 = crate::channel::MAX_BUFFERS as u32;
/// A WRITE posted more than this after the last one is announced ([`Msg::Posting`]); the
/// receiving bridge polls without a pause at least this long after each notification.
pub const POSTING_AFTER: Duration = Duration::from_micros(500);
/// The largest message in bytes after the handshake, its MAC included (NIXL metadata of one agent
/// is a few KiB).
pub const MAX_MESSAGE: usize = 4 << 20;
/// The largest handshake message in bytes (before the peer proved the secret; a hello is 45).
pub const MAX_HANDSHAKE_MESSAGE: usize = 1024;
/// Bytes of a handshake nonce (random, from the kernel's `getrandom`).
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof and of a message's MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;

/// One control message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Msg {
    /// Sender → receiver, first (handshake): magic, version and the sender's nonce.
    Hello {
        /// [`PROTOCOL_VERSION`] of the sender.
        version: u32,
        /// Fresh random bytes of this connection.
        nonce: [u8; NONCE_LEN],
    },
    /// Receiver → sender (handshake): magic, version and the receiver's nonce.
    Challenge {
        /// [`PROTOCOL_VERSION`] of the receiver.
        version: u32,
        /// Fresh random bytes of this connection.
        nonce: [u8; NONCE_LEN],
    },
    /// Sender → receiver (handshake): HMAC-SHA256 of both nonces keyed by the secret, with the
    /// sender's label.
    Proof {
        /// The MAC.
        mac: [u8; MAC_LEN],
    },
    /// Receiver → sender (handshake): the sender's proof was accepted; the receiver's own proof
    /// (with the receiver's label), which the sender checks.
    Welcome {
        /// [`PROTOCOL_VERSION`] of the receiver.
        version: u32,
        /// The MAC.
        mac: [u8; MAC_LEN],
    },
    /// Either way: the peer is refused, and why (never the secret).
    Refused {
        /// Why.
        reason: String,
    },
    /// Sender → receiver: the near channel's geometry and the sender's agent name.
    Channel {
        /// Buffers in the near pool.
        buffers: u32,
        /// Bytes per buffer.
        buffer_bytes: u64,
        /// 0 host memory, 1 device memory.
        kind: u8,
        /// The sender's NIXL agent name.
        agent: String,
    },
    /// Receiver → sender: the far channel exists; its agent's name and metadata.
    Ready {
        /// The receiver's NIXL agent name.
        agent: String,
        /// Bytes per far buffer.
        buffer_bytes: u64,
        /// How many credits the receiver keeps outstanding at most (1 to [`MAX_CREDITS`]): far
        /// buffers lent ahead of the frames, written in the order they were credited.
        credits: u32,
        /// The receiver's NIXL metadata (`getLocalMD`).
        md: Vec<u8>,
    },
    /// Receiver → sender: far buffer `index` is free to be written; `md` is the receiver's
    /// metadata again when this buffer was just registered, else empty.
    Credit {
        /// The far buffer's index.
        index: u32,
        /// Its address in the receiver.
        addr: u64,
        /// Its length in bytes.
        len: u64,
        /// 0 host memory, 1 device memory.
        kind: u8,
        /// Device ordinal in the receiver (0 for host memory).
        device: u32,
        /// Reloaded metadata, or empty.
        md: Vec<u8>,
    },
    /// Either way, every heartbeat period: the peer lives.
    Ping,
    /// Sender → receiver: the WRITE into credited buffer `index` is being posted after the lane
    /// was idle (no WRITE for over [`POSTING_AFTER`]); the receiver, which may have stopped
    /// polling, polls NIXL without a pause until its notification (a TCP transfer advances only
    /// while both ends poll). WRITEs that follow each other closer are not announced: the
    /// receiver polls without a pause for at least [`POSTING_AFTER`] after each notification.
    Posting {
        /// The credited far buffer.
        index: u32,
    },
    /// Sender → receiver: the near channel ended.
    Upstream {
        /// True when its producer closed it (every frame delivered); false when it died.
        closed: bool,
        /// Frames the sender wrote in this session: the receiver publishes the one still on its
        /// way (its notification may come after this message) before it ends.
        sent: u64,
        /// What the sender saw.
        reason: String,
    },
    /// Either way, on a tensor-set bridge's session: see [`SetMsg`].
    Set(SetMsg),
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.0.len() < n {
            return Err(protocol("a message ends early"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self) -> Result<u64> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    fn bytes(&mut self) -> Result<Vec<u8>> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn string(&mut self) -> Result<String> {
        String::from_utf8(self.bytes()?).map_err(|_| protocol("a string is not UTF-8"))
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        b.copy_from_slice(self.take(N)?);
        Ok(b)
    }
}

fn protocol(what: &str) -> Error {
    RemoteError::Protocol(what.to_string()).into()
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

impl Msg {
    /// The message's bytes, length prefix included.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; 4];
        match self {
            Msg::Hello { version, nonce } => {
                b.push(1);
                b.extend_from_slice(&MAGIC);
                b.extend_from_slice(&version.to_le_bytes());
                b.extend_from_slice(nonce);
            }
            Msg::Challenge { version, nonce } => {
                b.push(10);
                b.extend_from_slice(&MAGIC);
                b.extend_from_slice(&version.to_le_bytes());
                b.extend_from_slice(nonce);
            }
            Msg::Proof { mac } => {
                b.push(11);
                b.extend_from_slice(mac);
            }
            Msg::Welcome { version, mac } => {
                b.push(2);
                b.extend_from_slice(&MAGIC);
                b.extend_from_slice(&version.to_le_bytes());
                b.extend_from_slice(mac);
            }
            Msg::Refused { reason } => {
                b.push(3);
                put_bytes(&mut b, reason.as_bytes());
            }
            Msg::Channel {
                buffers,
                buffer_bytes,
                kind,
                agent,
            } => {
                b.push(4);
                b.extend_from_slice(&buffers.to_le_bytes());
                b.extend_from_slice(&buffer_bytes.to_le_bytes());
                b.push(*kind);
                put_bytes(&mut b, agent.as_bytes());
            }
            Msg::Ready {
                agent,
                buffer_bytes,
                credits,
                md,
            } => {
                b.push(5);
                put_bytes(&mut b, agent.as_bytes());
                b.extend_from_slice(&buffer_bytes.to_le_bytes());
                b.extend_from_slice(&credits.to_le_bytes());
                put_bytes(&mut b, md);
            }
            Msg::Credit {
                index,
                addr,
                len,
                kind,
                device,
                md,
            } => {
                b.push(6);
                b.extend_from_slice(&index.to_le_bytes());
                b.extend_from_slice(&addr.to_le_bytes());
                b.extend_from_slice(&len.to_le_bytes());
                b.push(*kind);
                b.extend_from_slice(&device.to_le_bytes());
                put_bytes(&mut b, md);
            }
            Msg::Ping => b.push(7),
            Msg::Posting { index } => {
                b.push(9);
                b.extend_from_slice(&index.to_le_bytes());
            }
            Msg::Upstream {
                closed,
                sent,
                reason,
            } => {
                b.push(8);
                b.push(u8::from(*closed));
                b.extend_from_slice(&sent.to_le_bytes());
                put_bytes(&mut b, reason.as_bytes());
            }
            Msg::Set(m) => {
                b.push(12);
                m.encode(&mut b);
            }
        }
        let n = (b.len() - 4) as u32;
        b[..4].copy_from_slice(&n.to_le_bytes());
        b
    }

    /// True for the messages of the handshake (and [`Msg::Refused`], which either phase may send).
    pub fn is_handshake(&self) -> bool {
        matches!(
            self,
            Msg::Hello { .. }
                | Msg::Challenge { .. }
                | Msg::Proof { .. }
                | Msg::Welcome { .. }
                | Msg::Refused { .. }
        )
    }

    /// Parses one handshake message body (tag and fields, without the length prefix): what a peer
    /// that has not proven the secret may send. A message of the session (a credit, the
    /// channel's geometry, ...) is refused here: it is only ever read sealed ([`Opener::open`]).
    ///
    /// # Errors
    /// As [`Msg::decode`], and [`RemoteError::Protocol`] for a body over
    /// [`MAX_HANDSHAKE_MESSAGE`] or a message that is not the handshake's.
    pub fn decode_handshake(body: &[u8]) -> Result<Msg> {
        if body.len() > MAX_HANDSHAKE_MESSAGE {
            return Err(protocol(&format!(
                "a handshake message of {} bytes (at most {MAX_HANDSHAKE_MESSAGE})",
                body.len()
            )));
        }
        let m = Msg::decode(body)?;
        if !m.is_handshake() {
            return Err(protocol(&format!(
                "{} before the handshake ended",
                name_of(&m)
            )));
        }
        Ok(m)
    }

    /// Parses one message body (tag and fields, without the length prefix), of either phase.
    ///
    /// # Errors
    /// [`RemoteError::Protocol`] for an unknown tag, a wrong magic, a short body or bytes left
    /// over.
    pub fn decode(body: &[u8]) -> Result<Msg> {
        let mut c = Cursor(body);
        let magic = |c: &mut Cursor<'_>| -> Result<()> {
            if c.take(8)? != MAGIC {
                return Err(protocol(
                    "the peer does not speak the cuda-ipc lane protocol",
                ));
            }
            Ok(())
        };
        let m = match c.u8()? {
            1 => {
                magic(&mut c)?;
                Msg::Hello {
                    version: c.u32()?,
                    nonce: c.array()?,
                }
            }
            10 => {
                magic(&mut c)?;
                Msg::Challenge {
                    version: c.u32()?,
                    nonce: c.array()?,
                }
            }
            11 => Msg::Proof { mac: c.array()? },
            2 => {
                magic(&mut c)?;
                Msg::Welcome {
                    version: c.u32()?,
                    mac: c.array()?,
                }
            }
            3 => Msg::Refused {
                reason: c.string()?,
            },
            4 => Msg::Channel {
                buffers: c.u32()?,
                buffer_bytes: c.u64()?,
                kind: c.u8()?,
                agent: c.string()?,
            },
            5 => Msg::Ready {
                agent: c.string()?,
                buffer_bytes: c.u64()?,
                credits: c.u32()?,
                md: c.bytes()?,
            },
            6 => Msg::Credit {
                index: c.u32()?,
                addr: c.u64()?,
                len: c.u64()?,
                kind: c.u8()?,
                device: c.u32()?,
                md: c.bytes()?,
            },
            7 => Msg::Ping,
            9 => Msg::Posting { index: c.u32()? },
            8 => Msg::Upstream {
                closed: c.u8()? != 0,
                sent: c.u64()?,
                reason: c.string()?,
            },
            12 => Msg::Set(SetMsg::decode(&mut c)?),
            t => return Err(protocol(&format!("unknown message tag {t}"))),
        };
        if !c.0.is_empty() {
            return Err(protocol("bytes left over after a message"));
        }
        Ok(m)
    }
}

/// The name of `m`'s kind (`Credit`, `Hello`), for errors and logs: never its fields.
pub(super) fn name_of(m: &Msg) -> String {
    let tag = format!("{m:?}");
    if let Some(inner) = tag.strip_prefix("Set(") {
        return inner
            .split([' ', '{', ')'])
            .next()
            .unwrap_or("?")
            .to_string();
    }
    tag.split([' ', '{']).next().unwrap_or("?").to_string()
}

/// Writes `m` to `s` as it is (handshake messages and the busy refusal; a session's messages go
/// through [`Session::send`]).
///
/// # Errors
/// [`RemoteError::Link`] when the write fails or times out.
pub fn send(s: &mut TcpStream, m: &Msg) -> Result<()> {
    write_frame(s, &m.encode())
}

fn write_frame(s: &mut TcpStream, b: &[u8]) -> Result<()> {
    s.write_all(b)
        .map_err(|e| RemoteError::Link(format!("sending to the peer: {e}")).into())
}

/// Fills `buf` from `s` by `deadline`: however the bytes trickle in, the read ends then (each
/// read waits only for what is left of the time).
fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant, what: &'static str) -> Result<()> {
    let started = Instant::now();
    let timeout = |_| Error::Timeout {
        what,
        after: started.elapsed(),
    };
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timeout(()));
        }
        s.set_read_timeout(Some(left))
            .map_err(|e| RemoteError::Link(format!("setting a read timeout: {e}")))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(RemoteError::Link("the peer closed the connection".into()).into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(timeout(()));
            }
            Err(e) => return Err(RemoteError::Link(format!("reading from the peer: {e}")).into()),
        }
    }
    Ok(())
}

/// Reads one length-prefixed message body of at most `max` bytes, whole, by `deadline`.
fn read_frame(
    s: &mut TcpStream,
    deadline: Instant,
    max: usize,
    what: &'static str,
) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_by(s, &mut len, deadline, what)?;
    let n = u32::from_le_bytes(len) as usize;
    if n == 0 || n > max {
        return Err(protocol(&format!(
            "a message of {n} bytes (1 to {max} allowed)"
        )));
    }
    let mut body = vec![0u8; n];
    read_by(s, &mut body, deadline, what)?;
    Ok(body)
}

/// Reads one handshake message from `s`, whole by `deadline` (however slowly its bytes come):
/// at most [`MAX_HANDSHAKE_MESSAGE`] bytes, parsed by [`Msg::decode_handshake`].
///
/// # Errors
/// [`Error::Timeout`] when it was not whole by `deadline`; [`RemoteError::Link`] when the peer
/// closed the connection or it failed; [`RemoteError::Protocol`] for a longer message, one that
/// does not parse, or one that is not the handshake's.
pub fn recv_handshake(s: &mut TcpStream, deadline: Instant, what: &'static str) -> Result<Msg> {
    let body = read_frame(s, deadline, MAX_HANDSHAKE_MESSAGE, what)?;
    Msg::decode_handshake(&body)
}

/// The error for message `m` where `wanted` belongs.
pub(super) fn unexpected_msg(m: &Msg, wanted: &str) -> Error {
    RemoteError::Protocol(format!("got {} where {wanted} belongs", name_of(m))).into()
}

/// The largest buffer a sending bridge may announce, in bytes (1 TiB): a far pool of
/// [`crate::channel::MAX_BUFFERS`] of them still counts in a `u64` after page rounding.
pub const MAX_BUFFER_BYTES: u64 = 1 << 40;

/// A near channel's geometry as a sending bridge announced it ([`Msg::Channel`]), checked by
/// [`check_geometry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Geometry {
    /// Buffers in the near pool, 1 to [`crate::channel::MAX_BUFFERS`].
    pub buffers: usize,
    /// Bytes per buffer, 1 to [`MAX_BUFFER_BYTES`].
    pub buffer_bytes: usize,
    /// The near pool's memory: 0 host, 1 device.
    pub kind: u8,
}

/// Checks a sending bridge's announced geometry ([`Msg::Channel`]'s fields) before anything is
/// made of it.
///
/// # Errors
/// [`RemoteError::Protocol`] saying which field and the bounds: 0 or more than
/// [`crate::channel::MAX_BUFFERS`] buffers, 0 or more than [`MAX_BUFFER_BYTES`] bytes per buffer
/// (or more than this platform's `usize`), a memory kind other than 0 (host) or 1 (device).
pub fn check_geometry(buffers: u32, buffer_bytes: u64, kind: u8) -> Result<Geometry> {
    let most = crate::channel::MAX_BUFFERS;
    if buffers == 0 || buffers as usize > most {
        return Err(protocol(&format!(
            "a channel of {buffers} buffers (1 to {most} allowed)"
        )));
    }
    let Some(bytes) = usize::try_from(buffer_bytes)
        .ok()
        .filter(|&b| b > 0 && buffer_bytes <= MAX_BUFFER_BYTES)
    else {
        return Err(protocol(&format!(
            "buffers of {buffer_bytes} bytes (1 to {MAX_BUFFER_BYTES} allowed)"
        )));
    };
    if kind > 1 {
        return Err(protocol(&format!(
            "memory kind {kind} (0 host or 1 device allowed)"
        )));
    }
    Ok(Geometry {
        buffers: buffers as usize,
        buffer_bytes: bytes,
        kind,
    })
}

/// What a frame's NIXL notification says: ASCII text
/// `cipc-lane 1 INDEX SEQ LEN HEXMETA` (the far buffer written, the near sequence number, the
/// bytes written and the frame's metadata in hex).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrameNote {
    /// The far buffer the WRITE filled.
    pub index: u32,
    /// The frame's sequence number in the near channel.
    pub seq: u64,
    /// Bytes written.
    pub len: u64,
    /// The frame's metadata (at most `META_BYTES`).
    pub meta: Vec<u8>,
}

impl FrameNote {
    /// The notification text.
    pub fn encode(&self) -> String {
        use std::fmt::Write as _;
        const HEX: &[u8; 16] = b"0123456789abcdef";
        // One allocation: the numbers are at most 20 digits each.
        let mut s = String::with_capacity(80 + 2 * self.meta.len());
        let _ = write!(s, "cipc-lane 1 {} {} {} ", self.index, self.seq, self.len);
        for b in &self.meta {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 15)]));
        }
        s
    }

    /// Parses a notification.
    ///
    /// # Errors
    /// [`RemoteError::Protocol`] when `s` is not a lane notification of this version (an index
    /// past `u32::MAX` included).
    pub fn decode(s: &str) -> Result<FrameNote> {
        let bad = || protocol("a NIXL notification that is not a frame of this lane");
        let mut it = s.split(' ');
        if it.next() != Some("cipc-lane") || it.next() != Some("1") {
            return Err(bad());
        }
        let mut num = || -> Result<u64> { it.next().and_then(|x| x.parse().ok()).ok_or_else(bad) };
        let index = u32::try_from(num()?).map_err(|_| bad())?;
        let seq = num()?;
        let len = num()?;
        let hex = it.next().unwrap_or("");
        if !hex.is_ascii()
            || it.next().is_some()
            || !hex.len().is_multiple_of(2)
            || hex.len() > 2 * crate::channel::META_BYTES
        {
            return Err(bad());
        }
        let meta = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad()))
            .collect::<Result<Vec<u8>>>()?;
        Ok(FrameNote {
            index,
            seq,
            len,
            meta,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips_and_garbage_is_an_error() {
        let all = [
            Msg::Hello {
                version: 1,
                nonce: [7; NONCE_LEN],
            },
            Msg::Challenge {
                version: 3,
                nonce: [9; NONCE_LEN],
            },
            Msg::Proof { mac: [1; MAC_LEN] },
            Msg::Welcome {
                version: 1,
                mac: [2; MAC_LEN],
            },
            Msg::Refused {
                reason: "no".into(),
            },
            Msg::Channel {
                buffers: 4,
                buffer_bytes: 1 << 20,
                kind: 1,
                agent: "a".into(),
            },
            Msg::Ready {
                agent: "b".into(),
                buffer_bytes: 9,
                credits: 2,
                md: vec![1, 2, 3],
            },
            Msg::Credit {
                index: 3,
                addr: 0xdead,
                len: 64,
                kind: 0,
                device: 0,
                md: vec![],
            },
            Msg::Ping,
            Msg::Posting { index: 2 },
            Msg::Upstream {
                closed: false,
                sent: 12,
                reason: "gone".into(),
            },
        ];
        for m in all {
            let b = m.encode();
            assert_eq!(
                u32::from_le_bytes(b[..4].try_into().unwrap()) as usize,
                b.len() - 4
            );
            assert_eq!(Msg::decode(&b[4..]).unwrap(), m);
            // Every truncation and one extra byte are errors, never panics.
            for n in 0..b.len() - 4 {
                assert!(Msg::decode(&b[4..4 + n]).is_err());
            }
            let mut long = b[4..].to_vec();
            long.push(0);
            assert!(Msg::decode(&long).is_err());
        }
        assert!(Msg::decode(&[99]).is_err());
        let mut wrong = Msg::Welcome {
            version: 1,
            mac: [0; MAC_LEN],
        }
        .encode();
        wrong[5] = b'X';
        assert!(Msg::decode(&wrong[4..]).is_err());
    }

    /// Two ends of a loopback TCP connection.
    pub(super) fn pair() -> (TcpStream, TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn the_handshake_parser_takes_only_small_handshake_messages() {
        let channel = Msg::Channel {
            buffers: 1,
            buffer_bytes: 1,
            kind: 0,
            agent: "a".into(),
        }
        .encode();
        assert!(Msg::decode_handshake(&channel[4..]).is_err());
        let long = Msg::Refused {
            reason: "x".repeat(MAX_HANDSHAKE_MESSAGE),
        }
        .encode();
        assert!(Msg::decode_handshake(&long[4..]).is_err());
        let short = Msg::Refused { reason: "x".into() }.encode();
        assert!(Msg::decode_handshake(&short[4..]).is_ok());
    }

    #[test]
    fn a_handshake_message_trickled_byte_by_byte_ends_at_the_deadline() {
        let (mut a, mut b) = pair();
        // A hello announcing 60 bytes, one byte every 100 ms: a timeout per read would wait 6 s.
        let t = std::thread::spawn(move || {
            let _ = a.write_all(&60u32.to_le_bytes());
            for _ in 0..60 {
                if a.write_all(&[1]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let start = Instant::now();
        let e = recv_handshake(&mut b, start + Duration::from_millis(500), "a hello").unwrap_err();
        let took = start.elapsed();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        // Generous: a loaded machine may be late to wake, never by seconds.
        assert!(took < Duration::from_secs(3), "{took:?}");
        drop(b);
        t.join().unwrap();
        // A length over the handshake's limit is refused before anything is read or allocated.
        let (mut a, mut b) = pair();
        a.write_all(&(4u32 << 20).to_le_bytes()).unwrap();
        let e = recv_handshake(&mut b, Instant::now() + Duration::from_secs(5), "a hello");
        assert!(matches!(e, Err(Error::Remote(RemoteError::Protocol(_)))));
    }

    #[test]
    fn a_geometry_out_of_bounds_or_of_an_unknown_kind_is_refused() {
        let most = crate::channel::MAX_BUFFERS as u32;
        for (b, n, k) in [
            (0, 4096, 0),
            (u32::MAX, 4096, 0),
            (most + 1, 4096, 0),
            (4, 0, 0),
            (4, 1 << 63, 0),
            (4, u64::MAX, 1),
            (4, MAX_BUFFER_BYTES + 1, 0),
            (4, 4096, 2),
            (4, 4096, 255),
        ] {
            let e = check_geometry(b, n, k).unwrap_err().to_string();
            assert!(e.contains("allowed"), "{e}");
        }
        let g = check_geometry(most, MAX_BUFFER_BYTES, 1).unwrap();
        assert_eq!(
            (g.buffers, g.buffer_bytes as u64, g.kind),
            (most as usize, MAX_BUFFER_BYTES, 1)
        );
    }

    #[test]
    fn frame_notes_round_trip_and_foreign_text_is_refused() {
        let n = FrameNote {
            index: 2,
            seq: 77,
            len: 4096,
            meta: vec![0, 255, 16],
        };
        assert_eq!(FrameNote::decode(&n.encode()).unwrap(), n);
        for bad in [
            "",
            "hello",
            "cipc-lane 2 1 1 1 ",
            "cipc-lane 1 x 1 1 ",
            "cipc-lane 1 1 1 1 abc",
            "cipc-lane 1 1 1 1 zz",
            "cipc-lane 1 1 1 1 00 extra",
            // Two bytes that are not two ASCII digits (slicing there would split a character).
            "cipc-lane 1 1 1 1 a\u{e9}b",
            // An index past `u32` (it would name buffer 0 cut to 32 bits).
            "cipc-lane 1 4294967296 1 1 ",
        ] {
            assert!(FrameNote::decode(bad).is_err(), "{bad:?}");
        }
        let long = format!(
            "cipc-lane 1 0 0 0 {}",
            "00".repeat(crate::channel::META_BYTES + 1)
        );
        assert!(FrameNote::decode(&long).is_err());
    }
}
