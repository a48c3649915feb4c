//! The control connection: a plain TCP stream carrying the handshake (magic, version, the shared
//! secret), NIXL agent metadata, credits (a far buffer free to be written) and heartbeats. Frames
//! never travel here; they go by NIXL WRITE, their notification carrying [`FrameNote`].
//!
//! A message is a `u32` little-endian length (tag and body, at most [`MAX_MESSAGE`] bytes), a
//! one-byte tag and its body; integers are little-endian, strings and byte strings a `u32` length
//! and their bytes. Anything else is [`RemoteError::Protocol`], never a panic.

use super::RemoteError;
use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// The first bytes of a lane's handshake.
pub const MAGIC: [u8; 8] = *b"CIPCLANE";
/// The control protocol's version; both ends must speak the same (2: several credits
/// outstanding, [`Msg::Ready`] says how many).
pub const PROTOCOL_VERSION: u32 = 2;
/// The most credits a receiving bridge may have outstanding ([`Msg::Ready`]'s `credits`).
pub const MAX_CREDITS: u32 = crate::channel::MAX_BUFFERS as u32;
/// A WRITE posted more than this after the last one is announced ([`Msg::Posting`]); the
/// receiving bridge polls without a pause at least this long after each notification.
pub const POSTING_AFTER: Duration = Duration::from_micros(500);
/// The largest message in bytes (NIXL metadata of one agent is a few KiB).
pub const MAX_MESSAGE: usize = 4 << 20;

/// A shared secret, from a file or an environment variable. Its bytes are never printed: `Debug`
/// shows its length only.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

impl Secret {
    /// A secret of these bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `bytes` is empty or over 4096 bytes.
    pub fn new(bytes: Vec<u8>) -> Result<Secret> {
        if bytes.is_empty() || bytes.len() > 4096 {
            return Err(Error::InvalidArgument(format!(
                "a lane secret is 1 to 4096 bytes, got {}",
                bytes.len()
            )));
        }
        Ok(Secret(bytes))
    }

    /// Reads the secret from file `path` (its bytes, less one trailing newline). The file must be
    /// a regular file that no other user may read or write (mode 0600 or 0400, as for an SSH
    /// key): a secret others can read is no secret. Opened without blocking, so a FIFO under the
    /// name is refused rather than waited on.
    ///
    /// # Errors
    /// [`Error::Os`] when the file cannot be opened or read; [`Error::InvalidArgument`] for what
    /// is not a regular file, for a mode that gives other users access (the error says
    /// `chmod 600`), and as [`Secret::new`] (1 to 4096 bytes).
    pub fn from_file(path: &std::path::Path) -> Result<Secret> {
        use std::io::Read as _;
        use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
        let shown = path.display().to_string();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| crate::OsError::io("open", shown.clone(), e))?;
        let m = f
            .metadata()
            .map_err(|e| crate::OsError::io("fstat", shown.clone(), e))?;
        if !m.is_file() {
            return Err(Error::InvalidArgument(format!(
                "lane secret file {shown} is not a regular file"
            )));
        }
        let mode = m.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(Error::InvalidArgument(format!(
                "lane secret file {shown} can be read or written by other users (mode {mode:o}): \
                 chmod 600 it"
            )));
        }
        let mut bytes = Vec::new();
        f.take(4098)
            .read_to_end(&mut bytes)
            .map_err(|e| crate::OsError::io("read", shown, e))?;
        Secret::new(trim_newline(bytes))
    }

    /// Reads the secret from environment variable `var`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when it is not set, or as [`Secret::new`].
    pub fn from_env(var: &str) -> Result<Secret> {
        let Some(v) = std::env::var_os(var) else {
            return Err(Error::InvalidArgument(format!(
                "environment variable {var} (the lane secret) is not set"
            )));
        };
        use std::os::unix::ffi::OsStringExt as _;
        Secret::new(trim_newline(v.into_vec()))
    }

    /// True when `other` equals this secret; takes the same time for every `other` of a given
    /// length and never stops at the first differing byte.
    pub fn matches(&self, other: &[u8]) -> bool {
        let n = self.0.len().max(other.len());
        let mut diff = (self.0.len() ^ other.len()) as u64;
        for i in 0..n {
            let a = self.0.get(i).copied().unwrap_or(0);
            let b = other.get(i).copied().unwrap_or(0);
            diff |= u64::from(a ^ b);
        }
        // Keep the compiler from turning the loop into an early exit.
        std::hint::black_box(diff) == 0
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

fn trim_newline(mut b: Vec<u8>) -> Vec<u8> {
    if b.last() == Some(&b'\n') {
        b.pop();
        if b.last() == Some(&b'\r') {
            b.pop();
        }
    }
    b
}

/// One control message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Sender → receiver, first: magic, version and the secret.
    Hello {
        /// [`PROTOCOL_VERSION`] of the sender.
        version: u32,
        /// The secret's bytes.
        secret: Vec<u8>,
    },
    /// Receiver → sender: the secret and version were accepted.
    Welcome {
        /// [`PROTOCOL_VERSION`] of the receiver.
        version: u32,
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
            Msg::Hello { version, secret } => {
                b.push(1);
                b.extend_from_slice(&MAGIC);
                b.extend_from_slice(&version.to_le_bytes());
                put_bytes(&mut b, secret);
            }
            Msg::Welcome { version } => {
                b.push(2);
                b.extend_from_slice(&MAGIC);
                b.extend_from_slice(&version.to_le_bytes());
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
        }
        let n = (b.len() - 4) as u32;
        b[..4].copy_from_slice(&n.to_le_bytes());
        b
    }

    /// Parses one message body (tag and fields, without the length prefix).
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
                    secret: c.bytes()?,
                }
            }
            2 => {
                magic(&mut c)?;
                Msg::Welcome { version: c.u32()? }
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
            t => return Err(protocol(&format!("unknown message tag {t}"))),
        };
        if !c.0.is_empty() {
            return Err(protocol("bytes left over after a message"));
        }
        Ok(m)
    }
}

/// Writes `m` to `s`.
///
/// # Errors
/// [`RemoteError::Link`] when the write fails or times out.
pub fn send(s: &mut TcpStream, m: &Msg) -> Result<()> {
    s.write_all(&m.encode())
        .map_err(|e| RemoteError::Link(format!("sending to the peer: {e}")).into())
}

/// Reads one message from `s`, waiting at most `timeout` for its first byte and for the rest.
///
/// # Errors
/// [`Error::Timeout`] when nothing arrived in time; [`RemoteError::Link`] when the peer closed the
/// connection or it failed; [`RemoteError::Protocol`] for a message over [`MAX_MESSAGE`] or one
/// that does not parse.
pub fn recv(s: &mut TcpStream, timeout: Duration, what: &'static str) -> Result<Msg> {
    s.set_read_timeout(Some(timeout))
        .map_err(|e| RemoteError::Link(format!("setting a read timeout: {e}")))?;
    let io = |e: std::io::Error| -> Error {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::Timeout {
                what,
                after: timeout,
            },
            std::io::ErrorKind::UnexpectedEof => {
                RemoteError::Link("the peer closed the connection".into()).into()
            }
            _ => RemoteError::Link(format!("reading from the peer: {e}")).into(),
        }
    };
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(io)?;
    let n = u32::from_le_bytes(len) as usize;
    if n == 0 || n > MAX_MESSAGE {
        return Err(protocol(&format!(
            "a message of {n} bytes (1 to {MAX_MESSAGE} allowed)"
        )));
    }
    let mut body = vec![0u8; n];
    s.read_exact(&mut body).map_err(io)?;
    Msg::decode(&body)
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
    /// [`RemoteError::Protocol`] when `s` is not a lane notification of this version.
    pub fn decode(s: &str) -> Result<FrameNote> {
        let bad = || protocol("a NIXL notification that is not a frame of this lane");
        let mut it = s.split(' ');
        if it.next() != Some("cipc-lane") || it.next() != Some("1") {
            return Err(bad());
        }
        let mut num = || -> Result<u64> { it.next().and_then(|x| x.parse().ok()).ok_or_else(bad) };
        let index = num()? as u32;
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
    fn a_secret_file_must_be_a_regular_file_only_its_owner_can_read() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("lane-secret-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("secret");
        std::fs::write(&f, b"s3cret\n").unwrap();
        for mode in [0o644, 0o640, 0o606, 0o660] {
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = Secret::from_file(&f).unwrap_err().to_string();
            assert!(
                e.contains("chmod 600") && e.contains(&format!("{mode:o}")),
                "{e}"
            );
        }
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Secret::from_file(&f).unwrap().matches(b"s3cret"));
        // A FIFO under the name is refused at once, never waited on for a writer.
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let t = std::time::Instant::now();
        let e = Secret::from_file(&fifo).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(1));
        assert!(Secret::from_file(&dir).is_err());
        assert!(matches!(
            Secret::from_file(&dir.join("missing")),
            Err(Error::Os(_))
        ));
        std::fs::write(&f, vec![b'x'; 5000]).unwrap();
        assert!(Secret::from_file(&f).is_err(), "over 4096 bytes");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn every_message_round_trips_and_garbage_is_an_error() {
        let all = [
            Msg::Hello {
                version: 1,
                secret: b"s3".to_vec(),
            },
            Msg::Welcome { version: 1 },
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
        let mut wrong = Msg::Welcome { version: 1 }.encode();
        wrong[5] = b'X';
        assert!(Msg::decode(&wrong[4..]).is_err());
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
        ] {
            assert!(FrameNote::decode(bad).is_err(), "{bad:?}");
        }
        let long = format!(
            "cipc-lane 1 0 0 0 {}",
            "00".repeat(crate::channel::META_BYTES + 1)
        );
        assert!(FrameNote::decode(&long).is_err());
    }

    #[test]
    fn secrets_compare_whole_and_never_print() {
        let s = Secret::new(b"correct horse".to_vec()).unwrap();
        assert!(s.matches(b"correct horse"));
        assert!(!s.matches(b"correct hors"));
        assert!(!s.matches(b"correct horse!"));
        assert!(!s.matches(b"Correct horse"));
        assert!(!s.matches(b""));
        assert!(!format!("{s:?}").contains("horse"));
        assert!(Secret::new(vec![]).is_err());
    }
}
