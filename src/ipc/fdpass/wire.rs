//! The fd server's wire format: the request an importer sends and the replies the server answers
//! with, over one `SOCK_SEQPACKET` connection (every `send` is one whole message).
//!
//! Owns: the byte layout, the protocol version, the status codes, and their encoding and decoding.
//! Calls nothing: no socket, no fd. The fds travel beside a reply's bytes (`SCM_RIGHTS`): one per
//! entry of status [`ENTRY_OK`], in the order of the entries.
//!
//! Every integer is little-endian. Magic and version sit at the same offsets in every protocol
//! version, so each side can name the other's version when they differ; everything after them
//! belongs to version [`PROTOCOL_VERSION`].
//!
//! Request, importer to server: `8 + 4 × count` bytes, at most [`MAX_REQUEST_BYTES`].
//!
//! | offset | bytes | field |
//! | --- | --- | --- |
//! | 0 | 4 | magic `CIFQ` ([`REQUEST_MAGIC`]) |
//! | 4 | 2 | protocol version ([`PROTOCOL_VERSION`], 1) |
//! | 6 | 2 | id count, 1 ..= [`MAX_IDS_PER_REQUEST`] (1024) |
//! | 8 | 4 × count | the export ids asked for, `u32` each |
//!
//! Reply, server to importer: `12 + 8 × count` bytes, at most [`MAX_REPLY_BYTES`], with the fds
//! attached.
//!
//! | offset | bytes | field |
//! | --- | --- | --- |
//! | 0 | 4 | magic `CIFR` ([`REPLY_MAGIC`]) |
//! | 4 | 2 | protocol version (the server's) |
//! | 6 | 2 | request status: [`REQUEST_OK`] 0, [`REQUEST_REFUSED`] 1, [`REQUEST_MALFORMED`] 2, [`REQUEST_VERSION`] 3 |
//! | 8 | 4 | entry count, 0 ..= [`MAX_FDS_PER_MESSAGE`] (253) |
//! | 12 | 8 × count | entries: export id `u32`, entry status `u32` ([`ENTRY_OK`] 0, [`ENTRY_NOT_OFFERED`] 1) |
//!
//! A request of n ids is answered by ⌈n / 253⌉ replies of status [`REQUEST_OK`], whose entries are,
//! in order, the ids asked for. A refusal, a malformed request or another version gets one reply
//! without entries, and the server closes the connection.

use std::mem::size_of;

/// Request magic, `CIFQ` in little-endian byte order.
pub(super) const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"CIFQ");
/// Reply magic, `CIFR` in little-endian byte order.
pub(super) const REPLY_MAGIC: u32 = u32::from_le_bytes(*b"CIFR");
/// Wire protocol version. Both headers start with magic (u32) and version (u16) in every version.
pub(super) const PROTOCOL_VERSION: u16 = 1;

/// Offset of the magic (u32) in both headers.
const MAGIC_AT: usize = 0;
/// Offset of the protocol version (u16) in both headers.
const VERSION_AT: usize = 4;
/// Offset of the request's id count (u16).
const REQUEST_COUNT_AT: usize = 6;
/// Request header bytes: magic u32, version u16, id count u16; the ids (u32 each) follow.
const REQUEST_HEADER: usize = 8;
/// Bytes per id in a request.
const REQUEST_ID: usize = size_of::<u32>();
/// Offset of the reply's request status (u16).
const REPLY_STATUS_AT: usize = 6;
/// Offset of the reply's entry count (u32).
const REPLY_COUNT_AT: usize = 8;
/// Reply header bytes: magic u32, version u16, request status u16, entry count u32.
const REPLY_HEADER: usize = 12;
/// Offset of an entry's export id (u32) within the entry.
const ENTRY_ID_AT: usize = 0;
/// Offset of an entry's status (u32) within the entry.
const ENTRY_STATUS_AT: usize = 4;
/// Bytes per reply entry: id u32, status u32.
const REPLY_ENTRY: usize = 8;

/// Most ids in one request; [`fetch_many`](super::fetch_many) splits longer lists into several
/// requests.
pub(super) const MAX_IDS_PER_REQUEST: usize = 1024;
/// Largest request in bytes.
pub(super) const MAX_REQUEST_BYTES: usize = REQUEST_HEADER + REQUEST_ID * MAX_IDS_PER_REQUEST;
/// Most fds the kernel accepts in one `SCM_RIGHTS` message (`SCM_MAX_FD`).
pub(super) const MAX_FDS_PER_MESSAGE: usize = 253;
/// Largest reply message in bytes.
pub(super) const MAX_REPLY_BYTES: usize = REPLY_HEADER + REPLY_ENTRY * MAX_FDS_PER_MESSAGE;

/// Request status: served; each entry has its own status.
pub(super) const REQUEST_OK: u16 = 0;
/// Request status: the client's uid is neither the exporter's nor root.
pub(super) const REQUEST_REFUSED: u16 = 1;
/// Request status: the request could not be parsed.
pub(super) const REQUEST_MALFORMED: u16 = 2;
/// Request status: the request has another protocol version (the reply carries the server's).
pub(super) const REQUEST_VERSION: u16 = 3;
/// Entry status: the fd is attached.
pub(super) const ENTRY_OK: u32 = 0;
/// Entry status: no such export (never made, or withdrawn).
pub(super) const ENTRY_NOT_OFFERED: u32 = 1;

// The layout of the tables above, checked: each field follows the one before it, the headers end
// where their last field does, the limits fit their count fields, and the version-1 sizes.
const _: () = {
    assert!(MAGIC_AT == 0);
    assert!(VERSION_AT == MAGIC_AT + size_of::<u32>());
    assert!(REQUEST_COUNT_AT == VERSION_AT + size_of::<u16>());
    assert!(REQUEST_HEADER == REQUEST_COUNT_AT + size_of::<u16>());
    assert!(REPLY_STATUS_AT == VERSION_AT + size_of::<u16>());
    assert!(REPLY_COUNT_AT == REPLY_STATUS_AT + size_of::<u16>());
    assert!(REPLY_HEADER == REPLY_COUNT_AT + size_of::<u32>());
    assert!(ENTRY_ID_AT == 0);
    assert!(ENTRY_STATUS_AT == ENTRY_ID_AT + size_of::<u32>());
    assert!(REPLY_ENTRY == ENTRY_STATUS_AT + size_of::<u32>());
    assert!(MAX_IDS_PER_REQUEST <= u16::MAX as usize);
    assert!(MAX_FDS_PER_MESSAGE <= u32::MAX as usize);
    assert!(MAX_REQUEST_BYTES == 4104);
    assert!(MAX_REPLY_BYTES == 2036);
    assert!(REQUEST_MAGIC == 0x5146_4943);
    assert!(REPLY_MAGIC == 0x5246_4943);
};

/// Encodes a request for `ids` (1 ..= [`MAX_IDS_PER_REQUEST`] of them).
pub(super) fn encode_request(ids: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(REQUEST_HEADER + REQUEST_ID * ids.len());
    out.extend_from_slice(&REQUEST_MAGIC.to_le_bytes());
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&(ids.len() as u16).to_le_bytes());
    for id in ids {
        out.extend_from_slice(&id.to_le_bytes());
    }
    out
}

/// Decodes a request into its ids, or the status to reply with when it is malformed.
pub(super) fn decode_request(bytes: &[u8]) -> std::result::Result<Vec<u32>, u16> {
    let (Some(magic), Some(version), Some(count)) = (
        le_u32(bytes, MAGIC_AT),
        le_u16(bytes, VERSION_AT),
        le_u16(bytes, REQUEST_COUNT_AT),
    ) else {
        return Err(REQUEST_MALFORMED);
    };
    if magic != REQUEST_MAGIC {
        return Err(REQUEST_MALFORMED);
    }
    if version != PROTOCOL_VERSION {
        return Err(REQUEST_VERSION);
    }
    let count = usize::from(count);
    if count == 0
        || count > MAX_IDS_PER_REQUEST
        || bytes.len() != REQUEST_HEADER + REQUEST_ID * count
    {
        return Err(REQUEST_MALFORMED);
    }
    (0..count)
        .map(|i| le_u32(bytes, REQUEST_HEADER + REQUEST_ID * i).ok_or(REQUEST_MALFORMED))
        .collect()
}

/// Encodes one reply message.
pub(super) fn encode_reply(status: u16, entries: &[(u32, u32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(REPLY_HEADER + REPLY_ENTRY * entries.len());
    out.extend_from_slice(&REPLY_MAGIC.to_le_bytes());
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&status.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (id, st) in entries {
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&st.to_le_bytes());
    }
    out
}

/// One decoded reply message.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Reply {
    pub(super) version: u16,
    pub(super) status: u16,
    pub(super) entries: Vec<(u32, u32)>,
}

/// Decodes one reply message; `Err` says what is wrong with it.
pub(super) fn decode_reply(bytes: &[u8]) -> std::result::Result<Reply, String> {
    let (Some(magic), Some(version)) = (le_u32(bytes, MAGIC_AT), le_u16(bytes, VERSION_AT)) else {
        return Err(format!(
            "a reply of {} is too short",
            crate::error::bytes(bytes.len())
        ));
    };
    if magic != REPLY_MAGIC {
        return Err(format!("bad reply magic {magic:#010x}"));
    }
    if version != PROTOCOL_VERSION {
        // Only magic and version are fixed across versions.
        return Ok(Reply {
            version,
            status: REQUEST_VERSION,
            entries: Vec::new(),
        });
    }
    let (Some(status), Some(count)) = (
        le_u16(bytes, REPLY_STATUS_AT),
        le_u32(bytes, REPLY_COUNT_AT),
    ) else {
        return Err(format!(
            "a reply of {} is too short",
            crate::error::bytes(bytes.len())
        ));
    };
    let count = count as usize;
    if count > MAX_FDS_PER_MESSAGE || bytes.len() != REPLY_HEADER + REPLY_ENTRY * count {
        return Err(format!(
            "a reply of {} claims {}",
            crate::error::bytes(bytes.len()),
            crate::error::plural(count, "entry")
        ));
    }
    let entries = (0..count)
        .map(|i| {
            let at = REPLY_HEADER + REPLY_ENTRY * i;
            le_u32(bytes, at + ENTRY_ID_AT).zip(le_u32(bytes, at + ENTRY_STATUS_AT))
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| "truncated reply entries".to_string())?;
    Ok(Reply {
        version,
        status,
        entries,
    })
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn le_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        b.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_bad_requests_get_a_status() {
        let ids = [1, 7, u32::MAX];
        assert_eq!(decode_request(&encode_request(&ids)), Ok(ids.to_vec()));
        assert_eq!(decode_request(b""), Err(REQUEST_MALFORMED));
        assert_eq!(decode_request(b"garbage!garbage!"), Err(REQUEST_MALFORMED));
        let mut v2 = encode_request(&ids);
        v2[4] = 2;
        assert_eq!(decode_request(&v2), Err(REQUEST_VERSION));
        let mut short = encode_request(&ids);
        short.pop();
        assert_eq!(decode_request(&short), Err(REQUEST_MALFORMED));
        assert_eq!(decode_request(&encode_request(&[])), Err(REQUEST_MALFORMED));
    }

    #[test]
    fn reply_round_trips_and_bad_replies_are_errors() {
        let entries = [(1, ENTRY_OK), (2, ENTRY_NOT_OFFERED)];
        assert_eq!(
            decode_reply(&encode_reply(REQUEST_OK, &entries)),
            Ok(Reply {
                version: PROTOCOL_VERSION,
                status: REQUEST_OK,
                entries: entries.to_vec()
            })
        );
        assert!(decode_reply(b"").is_err());
        assert!(decode_reply(b"CIFQ\x01\x00\x00\x00\x00\x00\x00\x00").is_err());
        let mut long = encode_reply(REQUEST_OK, &entries);
        long.push(0);
        assert!(decode_reply(&long).is_err());
        let mut other_version = encode_reply(REQUEST_OK, &entries);
        other_version[4] = 9;
        assert_eq!(
            decode_reply(&other_version).unwrap().status,
            REQUEST_VERSION
        );
    }

    #[test]
    fn the_wire_bytes_are_pinned() {
        // Protocol version 1, byte for byte: a change here is a protocol change.
        assert_eq!(
            encode_request(&[1, 0x0403_0201]),
            b"CIFQ\x01\x00\x02\x00\x01\x00\x00\x00\x01\x02\x03\x04"
        );
        assert_eq!(
            encode_reply(
                REQUEST_OK,
                &[(7, ENTRY_OK), (0x0102_0304, ENTRY_NOT_OFFERED)]
            ),
            b"CIFR\x01\x00\x00\x00\x02\x00\x00\x00\
              \x07\x00\x00\x00\x00\x00\x00\x00\x04\x03\x02\x01\x01\x00\x00\x00"
        );
        assert_eq!(
            encode_reply(REQUEST_REFUSED, &[]),
            b"CIFR\x01\x00\x01\x00\x00\x00\x00\x00"
        );
        assert_eq!(
            (
                REQUEST_OK,
                REQUEST_REFUSED,
                REQUEST_MALFORMED,
                REQUEST_VERSION
            ),
            (0, 1, 2, 3)
        );
        assert_eq!((ENTRY_OK, ENTRY_NOT_OFFERED), (0, 1));
        assert_eq!((MAX_IDS_PER_REQUEST, MAX_FDS_PER_MESSAGE), (1024, 253));
    }

    proptest::proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let _ = decode_request(&bytes);
            let _ = decode_reply(&bytes);
            let mut req = REQUEST_MAGIC.to_le_bytes().to_vec();
            req.extend_from_slice(&bytes);
            let _ = decode_request(&req);
            let mut rep = REPLY_MAGIC.to_le_bytes().to_vec();
            rep.extend_from_slice(&bytes);
            let _ = decode_reply(&rep);
        }
    }
}
