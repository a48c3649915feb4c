//! The lane's shared secret ([`Secret`]), the handshake ([`handshake_send`], [`handshake_recv`])
//! and the session that seals every later message ([`Session`]), over the framing of the parent
//! module (`remote::wire`, which re-exports what is public here).
//!
//! The handshake proves the shared secret both ways without sending it: each end sends a fresh
//! random nonce ([`NONCE_LEN`] bytes), the sending bridge answers with HMAC-SHA256 of both nonces
//! keyed by the secret, and the receiving bridge, once that checked out (compared in constant
//! time), with its own (another label, so one proof is never the other). The whole exchange runs
//! against one deadline, not a timeout per read. Every later message is sealed by a [`Session`]:
//! the message is followed by HMAC-SHA256 ([`MAC_LEN`] bytes) of its sequence number in that
//! direction and its bytes, keyed by that direction's key, derived from the secret and both
//! nonces; so a message replayed, reordered, injected or altered is refused ([`Opener::open`]),
//! and a recorded session cannot be replayed (the other end's nonce differs).

use super::{
    MAC_LEN, MAX_MESSAGE, Msg, NONCE_LEN, PROTOCOL_VERSION, RemoteError, name_of, protocol,
    read_frame, recv_handshake, send, unexpected_msg, write_frame,
};
use crate::error::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::TcpStream;
use std::time::{Duration, Instant};

type HmacSha256 = Hmac<Sha256>;

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

/// Fresh random bytes from the kernel (`getrandom`), for a nonce.
///
/// # Errors
/// [`RemoteError::Link`] when the kernel gives none (a seccomp filter): a nonce is never made up
/// from time or pids.
pub fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut b = [0u8; NONCE_LEN];
    let mut filled = 0;
    while filled < b.len() {
        match rustix::rand::getrandom(&mut b[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                return Err(RemoteError::Link(format!("getrandom for a nonce: {e}")).into());
            }
        }
    }
    Ok(b)
}

/// The labels that keep each use of the secret apart.
const SENDER_PROOF: &[u8] = b"cuda-ipc lane 3: sender proof";
const RECEIVER_PROOF: &[u8] = b"cuda-ipc lane 3: receiver proof";
const SESSION_KEY: &[u8] = b"cuda-ipc lane 3: session key";
const TO_RECEIVER: &[u8] = b"cuda-ipc lane 3: sender to receiver";
const TO_SENDER: &[u8] = b"cuda-ipc lane 3: receiver to sender";

fn keyed(key: &[u8]) -> HmacSha256 {
    // HMAC takes a key of any length (longer ones are hashed first): `new_from_slice` never fails.
    <HmacSha256 as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC takes any key"))
}

/// HMAC-SHA256 of `parts`, one after the other, keyed by `key`.
fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; MAC_LEN] {
    let mut m = keyed(key);
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// Whether `tag` is HMAC-SHA256 of `parts` keyed by `key`, compared in constant time
/// (`Mac::verify_slice`).
fn verify(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    let mut m = keyed(key);
    for p in parts {
        m.update(p);
    }
    m.verify_slice(tag).is_ok()
}

/// Which end of the lane a [`Session`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum End {
    /// The sending bridge (it connects).
    Sender,
    /// The receiving bridge (it listens).
    Receiver,
}

/// The sending half of a [`Session`]: seals each message with its MAC and sequence number.
pub struct Sealer {
    key: [u8; MAC_LEN],
    seq: u64,
}

/// The receiving half of a [`Session`]: checks each message's MAC against the next sequence
/// number of the other end.
pub struct Opener {
    key: [u8; MAC_LEN],
    seq: u64,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sealer(seq {})", self.seq)
    }
}

impl std::fmt::Debug for Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Opener(seq {})", self.seq)
    }
}

impl Sealer {
    /// `m`'s bytes on the wire: a `u32` length, the message (tag and body) and HMAC-SHA256 of this
    /// direction's next sequence number (`u64`, little-endian) and the message; the sequence
    /// number goes up by one.
    pub fn seal(&mut self, m: &Msg) -> Vec<u8> {
        self.seal_bytes(&m.encode()[4..])
    }

    /// As [`Sealer::seal`] for `body`, bytes that need not be a message: what a peer holding the
    /// secret could send, for tests and fuzzing of the parser behind the MAC
    /// ([`Opener::open`]).
    pub fn seal_bytes(&mut self, body: &[u8]) -> Vec<u8> {
        let mut b = Vec::with_capacity(4 + body.len() + MAC_LEN);
        b.extend_from_slice(&((body.len() + MAC_LEN) as u32).to_le_bytes());
        b.extend_from_slice(body);
        b.extend_from_slice(&mac(&self.key, &[&self.seq.to_le_bytes(), body]));
        self.seq += 1;
        b
    }
}

impl Opener {
    /// Checks and parses one sealed message `frame` (the message and its MAC, without the length
    /// prefix): its MAC must be this direction's next sequence number's, which then goes up by
    /// one. A handshake message is refused here, as is anything replayed, reordered, injected or
    /// altered.
    ///
    /// # Errors
    /// [`RemoteError::Protocol`] for a frame shorter than a MAC, a MAC that does not check out
    /// (the sequence number is not advanced), a message that does not parse, and a handshake
    /// message other than [`Msg::Refused`].
    pub fn open(&mut self, frame: &[u8]) -> Result<Msg> {
        if frame.len() <= MAC_LEN {
            return Err(protocol(&format!(
                "a sealed message of {} (more than its {MAC_LEN}-byte MAC needed)",
                crate::error::bytes(frame.len())
            )));
        }
        let (body, tag) = frame.split_at(frame.len() - MAC_LEN);
        if !verify(&self.key, &[&self.seq.to_le_bytes(), body], tag) {
            return Err(protocol(&format!(
                "message {} failed its authentication (replayed, reordered, injected or altered)",
                self.seq
            )));
        }
        self.seq += 1;
        let m = Msg::decode(body)?;
        if m.is_handshake() && !matches!(m, Msg::Refused { .. }) {
            return Err(protocol(&format!(
                "{} after the handshake ended",
                name_of(&m)
            )));
        }
        Ok(m)
    }
}

/// An authenticated control connection's keys: every message after the handshake is sealed
/// ([`Sealer`]) and checked ([`Opener`]) with the key of its direction, derived from the secret
/// and both nonces (HMAC-SHA256: a session key from the secret, then one key per direction from
/// it), and the direction's sequence number.
#[derive(Debug)]
pub struct Session {
    /// Seals what this end sends.
    pub sealer: Sealer,
    /// Checks what the other end sends.
    pub opener: Opener,
}

impl Session {
    /// The session of `end` after a handshake with nonces `sender` and `receiver`.
    pub fn new(
        secret: &Secret,
        end: End,
        sender: &[u8; NONCE_LEN],
        receiver: &[u8; NONCE_LEN],
    ) -> Session {
        let key = mac(secret.bytes(), &[SESSION_KEY, sender, receiver]);
        let to_receiver = mac(&key, &[TO_RECEIVER]);
        let to_sender = mac(&key, &[TO_SENDER]);
        let (tx, rx) = match end {
            End::Sender => (to_receiver, to_sender),
            End::Receiver => (to_sender, to_receiver),
        };
        Session {
            sealer: Sealer { key: tx, seq: 0 },
            opener: Opener { key: rx, seq: 0 },
        }
    }

    /// Seals `m` and writes it to `s`.
    ///
    /// # Errors
    /// [`RemoteError::Link`] when the write fails or times out.
    pub fn send(&mut self, s: &mut TcpStream, m: &Msg) -> Result<()> {
        send_sealed(&mut self.sealer, s, m)
    }

    /// Reads one sealed message from `s`, whole within `timeout`, and checks it
    /// ([`Opener::open`]).
    ///
    /// # Errors
    /// As [`recv_sealed`].
    pub fn recv(
        &mut self,
        s: &mut TcpStream,
        timeout: Duration,
        what: &'static str,
    ) -> Result<Msg> {
        recv_sealed(&mut self.opener, s, timeout, what)
    }
}

/// Seals `m` with `sealer` and writes it to `s`.
///
/// # Errors
/// [`RemoteError::Link`] when the write fails or times out.
pub fn send_sealed(sealer: &mut Sealer, s: &mut TcpStream, m: &Msg) -> Result<()> {
    write_frame(s, &sealer.seal(m))
}

/// Reads one sealed message from `s`, whole within `timeout` (its first byte and the rest), and
/// checks it with `opener`.
///
/// # Errors
/// [`Error::Timeout`] when it was not whole in time; [`RemoteError::Link`] when the peer closed the
/// connection or it failed; [`RemoteError::Protocol`] for a message over [`MAX_MESSAGE`] and as
/// [`Opener::open`].
pub fn recv_sealed(
    opener: &mut Opener,
    s: &mut TcpStream,
    timeout: Duration,
    what: &'static str,
) -> Result<Msg> {
    let body = read_frame(s, Instant::now() + timeout, MAX_MESSAGE, what)?;
    opener.open(&body)
}

/// The sending bridge's handshake on `s`, whole by `deadline`: a hello with a fresh nonce, the
/// receiver's challenge, the sender's proof of the secret, and the receiver's proof checked.
///
/// # Errors
/// [`RemoteError::Refused`] when the receiver refused us (its reason: a wrong secret, another
/// version, busy), speaks another version, or failed to prove the secret;
/// [`RemoteError::Protocol`] for another message; [`Error::Timeout`] past `deadline`;
/// [`RemoteError::Link`] when the connection failed.
pub fn handshake_send(s: &mut TcpStream, secret: &Secret, deadline: Instant) -> Result<Session> {
    let mine = nonce()?;
    let _ = s.set_write_timeout(Some(deadline.saturating_duration_since(Instant::now())));
    send(
        s,
        &Msg::Hello {
            version: PROTOCOL_VERSION,
            nonce: mine,
        },
    )?;
    let theirs = match recv_handshake(s, deadline, "the receiving bridge's challenge")? {
        Msg::Challenge { version, nonce } if version == PROTOCOL_VERSION => nonce,
        Msg::Challenge { version, .. } => return Err(other_version(version)),
        Msg::Refused { reason } => return Err(RemoteError::refused(reason).into()),
        m => return Err(unexpected_msg(&m, "a challenge")),
    };
    let proof = mac(secret.bytes(), &[SENDER_PROOF, &mine, &theirs]);
    send(s, &Msg::Proof { mac: proof })?;
    match recv_handshake(s, deadline, "the receiving bridge's welcome")? {
        Msg::Welcome { version, mac } if version == PROTOCOL_VERSION => {
            if !verify(secret.bytes(), &[RECEIVER_PROOF, &mine, &theirs], &mac) {
                return Err(RemoteError::Refused(
                    "the receiving bridge failed to prove the secret (wrong secret on its side, \
                     or not the bridge named)"
                        .into(),
                )
                .into());
            }
        }
        Msg::Welcome { version, .. } => return Err(other_version(version)),
        Msg::Refused { reason } => return Err(RemoteError::refused(reason).into()),
        m => return Err(unexpected_msg(&m, "a welcome")),
    }
    Ok(Session::new(secret, End::Sender, &mine, &theirs))
}

/// The receiving bridge's handshake on `s`, whole by `deadline`: the sender's hello, a challenge
/// with a fresh nonce, the sender's proof checked (a wrong one or another version is told to the
/// peer, never with the secret), then the receiver's proof.
///
/// # Errors
/// [`RemoteError::Refused`] for a wrong proof (`wrong secret`) or another version;
/// [`RemoteError::Protocol`] for another message; [`Error::Timeout`] past `deadline`;
/// [`RemoteError::Link`] when the connection failed.
pub fn handshake_recv(s: &mut TcpStream, secret: &Secret, deadline: Instant) -> Result<Session> {
    let _ = s.set_write_timeout(Some(deadline.saturating_duration_since(Instant::now())));
    let theirs = match recv_handshake(s, deadline, "the sending bridge's hello")? {
        Msg::Hello { version, nonce } if version == PROTOCOL_VERSION => nonce,
        Msg::Hello { version, .. } => {
            let why = format!("protocol version {version}; this bridge speaks {PROTOCOL_VERSION}");
            let _ = send(
                s,
                &Msg::Refused {
                    reason: why.clone(),
                },
            );
            return Err(RemoteError::Refused(why).into());
        }
        m => return Err(unexpected_msg(&m, "a hello")),
    };
    let mine = nonce()?;
    send(
        s,
        &Msg::Challenge {
            version: PROTOCOL_VERSION,
            nonce: mine,
        },
    )?;
    match recv_handshake(s, deadline, "the sending bridge's proof")? {
        Msg::Proof { mac } => {
            if !verify(secret.bytes(), &[SENDER_PROOF, &theirs, &mine], &mac) {
                let _ = send(
                    s,
                    &Msg::Refused {
                        reason: "wrong secret".into(),
                    },
                );
                return Err(RemoteError::Refused(
                    "wrong secret (its proof did not match: another secret, or a replayed session)"
                        .into(),
                )
                .into());
            }
        }
        m => return Err(unexpected_msg(&m, "a proof")),
    }
    send(
        s,
        &Msg::Welcome {
            version: PROTOCOL_VERSION,
            mac: mac(secret.bytes(), &[RECEIVER_PROOF, &theirs, &mine]),
        },
    )?;
    Ok(Session::new(secret, End::Receiver, &theirs, &mine))
}

fn other_version(version: u32) -> Error {
    RemoteError::Refused(format!(
        "the receiving bridge speaks protocol version {version}, this one {PROTOCOL_VERSION}"
    ))
    .into()
}

#[cfg(test)]
mod tests {
    use super::super::tests::pair;
    use super::*;

    #[test]
    fn a_secret_file_must_be_a_regular_file_only_its_owner_can_read() {
        use std::os::unix::fs::DirBuilderExt as _;
        use std::os::unix::fs::PermissionsExt as _;
        // A folder of this test's alone: `mkdir` fails on a name someone else made first.
        let dir = std::env::temp_dir().join(format!("lane-secret-{}", std::process::id()));
        std::fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
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

    fn secret(s: &str) -> Secret {
        Secret::new(s.as_bytes().to_vec()).unwrap()
    }

    /// One end after its handshake.
    type Shook = Result<(Session, TcpStream)>;

    /// Runs both handshakes over loopback, the receiver on a thread: (sender's, receiver's) result.
    fn handshake(sender: &str, receiver: &str) -> (Shook, Shook) {
        let (mut a, mut b) = pair();
        let r = secret(receiver);
        let t = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(5);
            handshake_recv(&mut b, &r, deadline).map(|s| (s, b))
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        let s = handshake_send(&mut a, &secret(sender), deadline).map(|s| (s, a));
        (s, t.join().unwrap())
    }

    #[test]
    fn the_handshake_proves_the_secret_both_ways_without_sending_it() {
        let (s, r) = handshake("correct horse", "correct horse");
        let ((mut ss, mut sa), (mut rs, mut rb)) = (s.unwrap(), r.unwrap());
        // Sealed messages cross both ways, in order.
        for i in 0..3u32 {
            ss.send(&mut sa, &Msg::Posting { index: i }).unwrap();
        }
        for i in 0..3u32 {
            let m = rs.recv(&mut rb, Duration::from_secs(5), "test").unwrap();
            assert_eq!(m, Msg::Posting { index: i });
        }
        rs.send(&mut rb, &Msg::Ping).unwrap();
        assert_eq!(
            ss.recv(&mut sa, Duration::from_secs(5), "test").unwrap(),
            Msg::Ping
        );
        // The secret's bytes appear in no handshake message.
        let hello = Msg::Hello {
            version: PROTOCOL_VERSION,
            nonce: nonce().unwrap(),
        }
        .encode();
        assert!(!hello.windows(13).any(|w| w == b"correct horse"));
        // Two nonces are never the same.
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[test]
    fn a_wrong_secret_is_refused_on_both_sides() {
        let (s, r) = handshake("wrong horse", "correct horse");
        let e = s.unwrap_err().to_string();
        assert!(e.contains("wrong secret"), "{e}");
        assert!(!e.contains("horse"), "{e}");
        assert!(matches!(
            r.unwrap_err(),
            Error::Remote(RemoteError::Refused(why)) if why.contains("wrong secret")
        ));
    }

    #[test]
    fn a_receiver_that_cannot_prove_the_secret_is_refused_by_the_sender() {
        // A receiver that answers the proof with a made-up MAC (it does not know the secret).
        let (mut a, mut b) = pair();
        let t = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(5);
            let Msg::Hello { .. } = recv_handshake(&mut b, deadline, "hello").unwrap() else {
                panic!("a hello")
            };
            let challenge = Msg::Challenge {
                version: PROTOCOL_VERSION,
                nonce: [5; NONCE_LEN],
            };
            send(&mut b, &challenge).unwrap();
            let Msg::Proof { .. } = recv_handshake(&mut b, deadline, "proof").unwrap() else {
                panic!("a proof")
            };
            let welcome = Msg::Welcome {
                version: PROTOCOL_VERSION,
                mac: [0; MAC_LEN],
            };
            send(&mut b, &welcome).unwrap();
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        let e = handshake_send(&mut a, &secret("s"), deadline).unwrap_err();
        assert!(e.to_string().contains("failed to prove the secret"), "{e}");
        t.join().unwrap();
    }

    #[test]
    fn a_replayed_reordered_injected_or_altered_message_is_refused() {
        let k = secret("k");
        let (ns, nr) = ([1; NONCE_LEN], [2; NONCE_LEN]);
        let mut tx = Session::new(&k, End::Sender, &ns, &nr);
        let mut rx = Session::new(&k, End::Receiver, &ns, &nr);
        let m0 = tx.sealer.seal(&Msg::Posting { index: 0 });
        let m1 = tx.sealer.seal(&Msg::Posting { index: 1 });
        let m2 = tx.sealer.seal(&Msg::Posting { index: 2 });
        // Reordered: the second before the first.
        assert!(rx.opener.open(&m1[4..]).is_err());
        assert_eq!(rx.opener.open(&m0[4..]).unwrap(), Msg::Posting { index: 0 });
        // Replayed.
        assert!(rx.opener.open(&m0[4..]).is_err());
        // Altered: any byte flipped.
        for i in 4..m1.len() {
            let mut bad = m1.clone();
            bad[i] ^= 1;
            assert!(rx.opener.open(&bad[4..]).is_err(), "byte {i}");
        }
        assert_eq!(rx.opener.open(&m1[4..]).unwrap(), Msg::Posting { index: 1 });
        // Injected: sealed with another session's key (other nonces), or the other direction's.
        let mut other = Session::new(&k, End::Sender, &ns, &[3; NONCE_LEN]);
        let _ = other.sealer.seal(&Msg::Ping);
        let _ = other.sealer.seal(&Msg::Ping);
        assert!(rx.opener.open(&other.sealer.seal(&Msg::Ping)[4..]).is_err());
        let mut back = Session::new(&k, End::Receiver, &ns, &nr);
        let _ = back.sealer.seal(&Msg::Ping);
        let _ = back.sealer.seal(&Msg::Ping);
        assert!(rx.opener.open(&back.sealer.seal(&Msg::Ping)[4..]).is_err());
        // A handshake message inside the session, and a frame shorter than a MAC.
        let mut h = Session::new(&k, End::Sender, &ns, &nr);
        let hello = h.sealer.seal(&Msg::Proof { mac: [0; MAC_LEN] });
        let mut r2 = Session::new(&k, End::Receiver, &ns, &nr);
        assert!(r2.opener.open(&hello[4..]).is_err());
        assert!(r2.opener.open(&[0; MAC_LEN]).is_err());
        assert_eq!(rx.opener.open(&m2[4..]).unwrap(), Msg::Posting { index: 2 });
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
