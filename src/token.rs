//! Tokens: the fixed, versioned byte record that names an exported buffer or event.
//!
//! Owns: the token's wire layout ([`TOKEN_LEN`] bytes, little-endian), its encoding and its
//! validation. A token is what the registry stores and what a user may send over their own channel
//! (a pipe, a socket, argv in hex). Decoding never trusts its input: garbage, truncated, corrupted or
//! newer-version bytes give [`Error::InvalidToken`], never a panic. Nothing here calls CUDA.
//!
//! Layout (all integers little-endian, offsets in bytes):
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | magic `CIPT` (`0x54504943`) |
//! | 4 | 2 | layout version ([`TOKEN_VERSION`]) |
//! | 6 | 2 | kind: 1 legacy memory, 2 legacy event, 3 VMM memory, 4 pool memory, 5 host memory |
//! | 8 | 64 | handle bytes: `CUipcMemHandle` or `CUipcEventHandle`; for VMM memory the exporter's fd number (i32) at 0 and the allocation's size (u64) at 8; for pool memory the `CUmemPoolPtrExportData`; for host memory the generation (u64) of the channel's host pool segment at 0, the rest zero |
//! | 72 | 8 | offset of the shared range from the base allocation, bytes |
//! | 80 | 8 | length of the shared range, bytes (0 for events) |
//! | 88 | 16 | device UUID |
//! | 104 | 4 | exporter pid |
//! | 108 | 4 | fd export id: the id under which the exporter serves the file descriptor ([`crate::ipc::fdpass`]) for VMM and pool memory; zero for other kinds |
//! | 112 | 8 | exporter start time, clock ticks since boot |
//! | 120 | 16 | exporter boot id |
//! | 136 | 4 | exporter pid namespace (inode number of `/proc/PID/ns/pid`; 0 unknown) |
//! | 140 | 4 | CRC-32 (IEEE) of bytes 0..140 |
//!
//! Kind 5 (host memory: a buffer of a channel's host pool, `/dev/shm/cuda-ipc.hp.NAME`, at byte
//! `offset`; device UUID zero) was added within version 2: the layout is unchanged, and a reader that
//! does not know the kind refuses it as an unknown kind.
//!
//! Version 2 added the pid namespace (bytes 136..140, reserved in version 1) and moved the CRC to
//! 140: the exporter's pid means something only in its own namespace ([`crate::identity`]).

use crate::driver::Uuid;
use crate::error::{Error, Result};
use crate::identity::ProcessIdentity;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Size of an encoded token in bytes.
pub const TOKEN_LEN: usize = 144;
/// The token layout version this crate writes. It reads this version only; a newer one is refused
/// with both versions named.
pub const TOKEN_VERSION: u16 = 2;
const TOKEN_MAGIC: u32 = u32::from_le_bytes(*b"CIPT");
const CRC_OFFSET: usize = 140;

/// The token checksum: CRC-32/ISO-HDLC (the zlib CRC-32) over the first [`CRC_OFFSET`] bytes,
/// from a table built at compile time (no CPU feature detection at a process's first token).
static TOKEN_CRC: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISO_HDLC);

/// What a token names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum TokenKind {
    /// A range of `cuMemAlloc` memory, shared through an `IpcMemHandle` (`cuIpcGetMemHandle`).
    LegacyMemory,
    /// An interprocess event, shared through an `IpcEventHandle` (`cuIpcGetEventHandle`).
    LegacyEvent,
    /// A VMM allocation (`cuMemCreate`) shared as a POSIX file descriptor.
    VmmMemory,
    /// An allocation from an exportable stream-ordered memory pool.
    PoolMemory,
    /// A buffer of a channel's host-memory pool (POSIX shared memory, no GPU): the handle holds
    /// the pool segment's generation, `offset` the buffer's byte offset in that segment.
    HostMemory,
}

impl TokenKind {
    fn to_wire(self) -> u16 {
        match self {
            TokenKind::LegacyMemory => 1,
            TokenKind::LegacyEvent => 2,
            TokenKind::VmmMemory => 3,
            TokenKind::PoolMemory => 4,
            TokenKind::HostMemory => 5,
        }
    }
    fn from_wire(v: u16) -> Option<Self> {
        Some(match v {
            1 => TokenKind::LegacyMemory,
            2 => TokenKind::LegacyEvent,
            3 => TokenKind::VmmMemory,
            4 => TokenKind::PoolMemory,
            5 => TokenKind::HostMemory,
            _ => return None,
        })
    }
}

/// A decoded token: what was exported, where, and by whom.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Token {
    /// What the handle names.
    pub kind: TokenKind,
    /// The driver's 64 handle bytes (zero for fd-based kinds).
    #[cfg_attr(feature = "serde", serde(with = "handle_bytes"))]
    pub handle: [u8; 64],
    /// Offset of the shared range from the base allocation, in bytes.
    pub offset: u64,
    /// Length of the shared range in bytes (0 for events).
    pub len: u64,
    /// UUID of the device that holds the memory or event.
    pub device: Uuid,
    /// The exporting process.
    pub exporter: ProcessIdentity,
    /// For VMM and pool memory: the id under which the exporter serves the file descriptor
    /// ([`crate::ipc::fdpass`]), never zero; zero for the other kinds.
    pub export_id: u32,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct Wire {
    magic: U32,
    version: U16,
    kind: U16,
    handle: [u8; 64],
    offset: U64,
    len: U64,
    device: [u8; 16],
    pid: U32,
    export_id: U32,
    start_time: U64,
    boot_id: [u8; 16],
    pid_ns: U32,
    crc: U32,
}

const _: () = assert!(size_of::<Wire>() == TOKEN_LEN);
const _: () = assert!(std::mem::offset_of!(Wire, handle) == 8);
const _: () = assert!(std::mem::offset_of!(Wire, offset) == 72);
const _: () = assert!(std::mem::offset_of!(Wire, device) == 88);
const _: () = assert!(std::mem::offset_of!(Wire, pid) == 104);
const _: () = assert!(std::mem::offset_of!(Wire, start_time) == 112);
const _: () = assert!(std::mem::offset_of!(Wire, boot_id) == 120);
const _: () = assert!(std::mem::offset_of!(Wire, crc) == CRC_OFFSET);

impl Token {
    /// Encodes the token into its [`TOKEN_LEN`]-byte wire form.
    pub fn to_bytes(&self) -> [u8; TOKEN_LEN] {
        let w = Wire {
            magic: TOKEN_MAGIC.into(),
            version: TOKEN_VERSION.into(),
            kind: self.kind.to_wire().into(),
            handle: self.handle,
            offset: self.offset.into(),
            len: self.len.into(),
            device: self.device.0,
            pid: self.exporter.pid.into(),
            export_id: self.export_id.into(),
            start_time: self.exporter.start_time.into(),
            boot_id: self.exporter.boot_id,
            pid_ns: self.exporter.pid_ns.into(),
            crc: 0.into(),
        };
        let mut out = [0u8; TOKEN_LEN];
        out.copy_from_slice(w.as_bytes());
        let crc = TOKEN_CRC.checksum(&out[..CRC_OFFSET]);
        out[CRC_OFFSET..CRC_OFFSET + 4].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes and validates a token.
    ///
    /// # Errors
    /// [`Error::InvalidToken`] when `bytes` is not exactly [`TOKEN_LEN`] long, the magic is wrong
    /// (not a token), the version is newer than [`TOKEN_VERSION`] (both named), the checksum does not
    /// match (corrupted), the kind is unknown, the fd export id is missing
    /// from an fd-based kind (or set on another), or `offset + len` overflows.
    pub fn from_bytes(bytes: &[u8]) -> Result<Token> {
        let bad = |m: String| Error::InvalidToken(m);
        if bytes.len() != TOKEN_LEN {
            return Err(bad(format!(
                "expected {TOKEN_LEN} bytes, got {}",
                bytes.len()
            )));
        }
        let w = Wire::read_from_bytes(bytes)
            .map_err(|_| bad("could not read the token layout".into()))?;
        if w.magic.get() != TOKEN_MAGIC {
            return Err(bad(format!(
                "bad magic {:#010x} (not a cuda-ipc token)",
                w.magic.get()
            )));
        }
        let v = w.version.get();
        if v != TOKEN_VERSION {
            return Err(bad(format!(
                "token layout version {v}, this build reads version {TOKEN_VERSION}{}",
                if v > TOKEN_VERSION {
                    " (written by a newer cuda-ipc)"
                } else {
                    ""
                }
            )));
        }
        let crc = TOKEN_CRC.checksum(&bytes[..CRC_OFFSET]);
        if crc != w.crc.get() {
            return Err(bad(format!(
                "checksum mismatch (stored {:#010x}, computed {crc:#010x}): corrupted",
                w.crc.get()
            )));
        }
        let kind = TokenKind::from_wire(w.kind.get())
            .ok_or_else(|| bad(format!("unknown kind {}", w.kind.get())))?;
        let fd_kind = matches!(kind, TokenKind::VmmMemory | TokenKind::PoolMemory);
        if fd_kind != (w.export_id.get() != 0) {
            return Err(bad(format!(
                "fd export id {} does not fit a {kind:?} token",
                w.export_id.get()
            )));
        }
        if w.offset.get().checked_add(w.len.get()).is_none() {
            return Err(bad("offset + len overflows".into()));
        }
        Ok(Token {
            kind,
            handle: w.handle,
            offset: w.offset.get(),
            len: w.len.get(),
            device: Uuid(w.device),
            exporter: ProcessIdentity {
                pid: w.pid.get(),
                start_time: w.start_time.get(),
                boot_id: w.boot_id,
                pid_ns: w.pid_ns.get(),
            },
            export_id: w.export_id.get(),
        })
    }

    /// The token as lowercase hex (2 × [`TOKEN_LEN`] characters), for argv or text channels.
    pub fn to_hex(&self) -> String {
        self.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Decodes the hex form written by [`Token::to_hex`].
    ///
    /// Surrounding whitespace is ignored; anything else but the digits `0-9a-fA-F` is refused.
    ///
    /// # Errors
    /// [`Error::InvalidToken`] for non-hex text (the first bad character and its byte position
    /// named), text of odd length, or any error of [`Token::from_bytes`].
    pub fn from_hex(s: &str) -> Result<Token> {
        let s = s.trim();
        // Checked digit by digit: `u8::from_str_radix` alone would accept a sign (`"+f"`).
        if let Some((at, c)) = s.char_indices().find(|(_, c)| !c.is_ascii_hexdigit()) {
            return Err(Error::InvalidToken(format!("not hex: {c:?} at byte {at}")));
        }
        if !s.len().is_multiple_of(2) {
            return Err(Error::InvalidToken(format!(
                "hex text of odd length {}",
                s.len()
            )));
        }
        let bytes: std::result::Result<Vec<u8>, _> = (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16))
            .collect();
        let bytes = bytes.map_err(|e| Error::InvalidToken(format!("not hex: {e}")))?;
        Token::from_bytes(&bytes)
    }
}

#[cfg(feature = "serde")]
mod handle_bytes {
    use serde::{Deserialize, Deserializer, Serializer};
    pub(super) fn serialize<S: Serializer>(h: &[u8; 64], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(h)
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 64], D::Error> {
        let v: Vec<u8> = Vec::deserialize(d)?;
        v.try_into()
            .map_err(|_| serde::de::Error::custom("handle must be 64 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compile-time table gives the zlib CRC-32 that tokens were always stamped with
    /// (`crc32fast`, computed apart): tokens of earlier builds still check, and theirs ours.
    #[test]
    fn the_token_checksum_is_the_zlib_crc32() {
        let mut seed = 0x9e37_79b9_u32;
        for len in [0usize, 1, 7, 64, 139, CRC_OFFSET, 1000] {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 24) as u8
                })
                .collect();
            assert_eq!(
                TOKEN_CRC.checksum(&bytes),
                crc32fast::hash(&bytes),
                "{len} bytes"
            );
        }
        // The check value of CRC-32/ISO-HDLC.
        assert_eq!(TOKEN_CRC.checksum(b"123456789"), 0xcbf4_3926);
    }
}
