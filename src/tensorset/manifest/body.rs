//! The manifest body's codec: [`Manifest`] (a decoded body), [`encode`], and
//! [`decode_head_within`] with the tensor tables it locates ([`TensorTables`], decoded by
//! `tables.rs`), which check every offset, length, count and code before they read (the body
//! layout is `manifest.rs`'s module documentation); the tests' whole-body decoders (`decode`,
//! `decode_unverified`, `decode_head`) are built on them.

use super::{
    ALLOC_ENTRY, ALLOC_TABLE_AT, BODY_HEADER, FLAG_BUFFERED, KIND_HOST, KIND_POOL, Layout,
    MAX_ALLOCATIONS, MAX_SET_BUFFERS, MAX_TENSORS, ManifestFault, TENSOR_ENTRY,
};
use crate::token::{TOKEN_LEN, Token};

/// A decoded manifest body.
#[derive(Clone, Debug)]
pub(crate) struct Manifest {
    pub(crate) kind: u32,
    pub(crate) flags: u32,
    pub(crate) buffers: usize,
    pub(crate) layout: Layout,
    /// `tokens[b][a]`: the token of allocation `a` of buffer `b`.
    pub(crate) tokens: Vec<Vec<[u8; TOKEN_LEN]>>,
    pub(crate) channel_generation: u64,
    pub(crate) data_generation: u64,
    pub(crate) max_readers: u32,
    /// The holders segment's creation generation (0: none).
    pub(crate) holders_generation: u64,
    /// Added to the generation channel's sequence numbers (a resumed set's; 0 otherwise).
    pub(crate) generation_base: u64,
}

/// Offsets of the body's parts for `m`: (alloc table, tensor table, dims, strings, total).
fn plan(m: &Manifest) -> (usize, usize, usize, usize, usize) {
    let a = BODY_HEADER;
    let t = a + m.buffers * m.layout.allocations.len() * ALLOC_ENTRY;
    let d = t + m.layout.tensors.len() * TENSOR_ENTRY;
    let dims: usize = m.layout.tensors.iter().map(|x| 2 * x.shape.len()).sum();
    let s = d + 8 * dims;
    let names: usize = m.layout.tensors.iter().map(|x| x.name.len()).sum();
    (a, t, d, s, s + names)
}

/// Encodes `m` as a manifest body.
pub(crate) fn encode(m: &Manifest) -> Vec<u8> {
    let (a_off, t_off, d_off, s_off, total) = plan(m);
    let mut b = vec![0u8; total];
    let put32 = |b: &mut [u8], at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    let put64 = |b: &mut [u8], at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    put32(&mut b, 0, m.kind);
    put32(&mut b, 4, m.flags);
    put32(&mut b, 8, m.buffers as u32);
    put32(&mut b, 12, m.layout.allocations.len() as u32);
    put64(&mut b, 16, m.layout.tensors.len() as u64);
    put64(&mut b, 24, m.layout.bytes_per_buffer());
    for (k, (off, end)) in [
        (a_off, t_off),
        (t_off, d_off),
        (d_off, s_off),
        (s_off, total),
    ]
    .into_iter()
    .enumerate()
    {
        put64(&mut b, ALLOC_TABLE_AT + 16 * k, off as u64);
        put64(&mut b, ALLOC_TABLE_AT + 8 + 16 * k, (end - off) as u64);
    }
    b[96..128].copy_from_slice(&m.layout.fingerprint);
    put64(&mut b, 128, m.channel_generation);
    put64(&mut b, 136, m.data_generation);
    put32(&mut b, 144, m.max_readers);
    put64(&mut b, 152, m.holders_generation);
    put64(&mut b, 160, m.generation_base);
    let mut at = a_off;
    for toks in &m.tokens {
        for (tok, &len) in toks.iter().zip(&m.layout.allocations) {
            b[at..at + TOKEN_LEN].copy_from_slice(tok);
            put64(&mut b, at + TOKEN_LEN, len);
            at += ALLOC_ENTRY;
        }
    }
    let (mut dims, mut names) = (0u64, 0u64);
    for (i, t) in m.layout.tensors.iter().enumerate() {
        let e = t_off + i * TENSOR_ENTRY;
        put64(&mut b, e, names);
        put32(&mut b, e + 8, t.name.len() as u32);
        b[e + 12] = t.dtype.code;
        b[e + 13] = t.dtype.bits;
        b[e + 14..e + 16].copy_from_slice(&t.dtype.lanes.to_le_bytes());
        put32(&mut b, e + 16, t.shape.len() as u32);
        put64(&mut b, e + 24, dims);
        put32(&mut b, e + 32, t.allocation);
        put64(&mut b, e + 40, t.offset);
        put64(&mut b, e + 48, t.bytes);
        for v in t.shape.iter().chain(&t.strides) {
            put64(&mut b, d_off + 8 * dims as usize, *v as u64);
            dims += 1;
        }
        let s = s_off + names as usize;
        b[s..s + t.name.len()].copy_from_slice(t.name.as_bytes());
        names += t.name.len() as u64;
    }
    b
}

/// Range-checked little-endian reads of a body, or of its first bytes (`have`) where the rest is
/// only located (`len`: the whole body's length, which every range is checked against).
pub(super) struct Body<'a> {
    have: &'a [u8],
    len: u64,
}

impl<'a> Body<'a> {
    /// The whole body, `bytes`.
    pub(super) fn of(bytes: &'a [u8]) -> Body<'a> {
        Body {
            have: bytes,
            len: bytes.len() as u64,
        }
    }

    /// `len` bytes at `off`: within the body, else [`ManifestFault::OutOfBounds`] (also for a
    /// range within the body but past the bytes at hand, which a caller that copied the head
    /// covering what it reads never asks for).
    pub(super) fn bytes(
        &self,
        what: &'static str,
        off: u64,
        len: u64,
    ) -> std::result::Result<&'a [u8], ManifestFault> {
        self.within(what, off, len)?;
        self.have
            .get(off as usize..(off + len) as usize)
            .ok_or(ManifestFault::OutOfBounds {
                what,
                offset: off,
                len,
                body: self.have.len() as u64,
            })
    }

    /// Checks that `len` bytes at `off` lie within the body, without reading them.
    pub(super) fn within(
        &self,
        what: &'static str,
        off: u64,
        len: u64,
    ) -> std::result::Result<(), ManifestFault> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(ManifestFault::OutOfBounds {
                what,
                offset: off,
                len,
                body: self.len,
            }),
        }
    }
    pub(super) fn u32(
        &self,
        what: &'static str,
        off: u64,
    ) -> std::result::Result<u32, ManifestFault> {
        Ok(u32::from_le_bytes(
            self.bytes(what, off, 4)?.try_into().expect("4 bytes"),
        ))
    }
    pub(super) fn u64(
        &self,
        what: &'static str,
        off: u64,
    ) -> std::result::Result<u64, ManifestFault> {
        Ok(u64::from_le_bytes(
            self.bytes(what, off, 8)?.try_into().expect("8 bytes"),
        ))
    }
}

fn field(what: &'static str, found: u64, allowed: &'static str) -> ManifestFault {
    ManifestFault::Field {
        what,
        found,
        allowed,
    }
}

impl Manifest {
    /// Recomputes the layout fingerprint and compares it with the one the body stores (which a
    /// manifest from [`decode_head_within`] and [`TensorTables::decode`] carries until then): SHA-256 over the whole tensor
    /// table's canonical encoding, the costly part of a decode (about 0.2 ms for 4,608 tensors).
    pub(crate) fn verify_fingerprint(&self) -> std::result::Result<(), ManifestFault> {
        self.layout.verify_fingerprint()
    }
}

/// Decodes a manifest body, checking every range, count, code, tensor and the fingerprint (the
/// tests' whole decode; openers take [`decode_head_within`] and [`TensorTables::decode`] and verify
/// when it suits them).
#[cfg(test)]
pub(crate) fn decode(bytes: &[u8]) -> std::result::Result<Manifest, ManifestFault> {
    let m = decode_unverified(bytes)?;
    m.verify_fingerprint()?;
    Ok(m)
}

/// [`decode`] but for the fingerprint: the layout carries the body's stored fingerprint, to be
/// checked with [`Manifest::verify_fingerprint`] before anything relies on the manifest (a reader
/// does it on another thread while it maps the memory). Openers take [`decode_head_within`] and
/// [`TensorTables::decode`], its two halves.
#[cfg(test)]
pub(crate) fn decode_unverified(bytes: &[u8]) -> std::result::Result<Manifest, ManifestFault> {
    let (mut m, tables) = decode_head(bytes)?;
    m.layout = tables.decode(bytes)?;
    Ok(m)
}

/// Where a manifest body's tensor tables lie, found by [`decode_head_within`] (every range checked
/// against the body), with what the layout is made of besides them.
#[derive(Clone, Debug)]
pub(crate) struct TensorTables {
    pub(super) tensors: usize,
    pub(super) table: (u64, u64),
    pub(super) dims: (u64, u64),
    pub(super) strings: (u64, u64),
    pub(super) allocations: Vec<u64>,
    pub(super) fingerprint: [u8; 32],
}

/// [`decode_head_within`] of a whole body (the tests' first half of [`decode_unverified`]).
#[cfg(test)]
pub(crate) fn decode_head(
    bytes: &[u8],
) -> std::result::Result<(Manifest, TensorTables), ManifestFault> {
    decode_head_within(bytes, bytes.len() as u64)
}

/// The first part of a manifest's decode: the body header and the allocation table, every range,
/// count and code checked, the tensor tables located but not read, from the body's first bytes,
/// `head` (at least the body header and the allocation table, where they lie within the body), of
/// a body of `body_len` bytes: every range is checked against `body_len`, and only the header and
/// the allocation table are read. The manifest's layout is provisional: its allocations and stored
/// fingerprint, no tensors ([`Layout::provisional`]); what maps the memory needs nothing more.
/// [`TensorTables::decode`] makes the real one from the whole body.
pub(crate) fn decode_head_within(
    head: &[u8],
    body_len: u64,
) -> std::result::Result<(Manifest, TensorTables), ManifestFault> {
    let b = Body {
        have: head,
        len: body_len,
    };
    b.bytes("the body header", 0, BODY_HEADER as u64)?;
    let kind = b.u32("kind", 0)?;
    if !(KIND_HOST..=KIND_POOL).contains(&kind) {
        return Err(field("the memory kind", kind.into(), "1 to 4"));
    }
    let flags = b.u32("flags", 4)?;
    if flags & !FLAG_BUFFERED != 0 {
        return Err(field("the flags", flags.into(), "0 or 1"));
    }
    let buffers = b.u32("buffers", 8)? as usize;
    if !(1..=MAX_SET_BUFFERS).contains(&buffers) {
        return Err(field(
            "the buffer count",
            buffers as u64,
            "1 to the channel's buffer limit",
        ));
    }
    let allocs = b.u32("allocations", 12)? as usize;
    if !(1..=MAX_ALLOCATIONS).contains(&allocs) {
        return Err(field("the allocation count", allocs as u64, "1 to 4096"));
    }
    let n = b.u64("tensors", 16)?;
    if n > MAX_TENSORS as u64 {
        return Err(field("the tensor count", n, "at most 2^24"));
    }
    let n = n as usize;
    let total = b.u64("bytes", 24)?;
    let part = |k: u64| -> std::result::Result<(u64, u64), ManifestFault> {
        Ok((
            b.u64("a table offset", ALLOC_TABLE_AT as u64 + 16 * k)?,
            b.u64("a table length", ALLOC_TABLE_AT as u64 + 8 + 16 * k)?,
        ))
    };
    let (a_off, a_len) = part(0)?;
    let (t_off, t_len) = part(1)?;
    let (d_off, d_len) = part(2)?;
    let (s_off, s_len) = part(3)?;
    if a_len != (buffers * allocs * ALLOC_ENTRY) as u64 {
        return Err(field(
            "the allocation table's length",
            a_len,
            "buffers × allocations × 160",
        ));
    }
    if t_len != (n * TENSOR_ENTRY) as u64 {
        return Err(field("the tensor table's length", t_len, "tensors × 64"));
    }
    if d_len % 8 != 0 {
        return Err(field("the dims area's length", d_len, "a multiple of 8"));
    }
    let a_tab = b.bytes("the allocation table", a_off, a_len)?;
    b.within("the tensor table", t_off, t_len)?;
    b.within("the dims area", d_off, d_len)?;
    b.within("the string area", s_off, s_len)?;
    let mut fp = [0u8; 32];
    fp.copy_from_slice(b.bytes("the fingerprint", 96, 32)?);
    let channel_generation = b.u64("the channel generation", 128)?;
    let data_generation = b.u64("the data generation", 136)?;
    let max_readers = b.u32("the reader limit", 144)?;
    let holders_generation = b.u64("the holders generation", 152)?;
    let generation_base = b.u64("the generation base", 160)?;
    let mut tokens = Vec::with_capacity(buffers);
    let mut lens: Vec<u64> = Vec::with_capacity(allocs);
    for bi in 0..buffers {
        let mut toks = Vec::with_capacity(allocs);
        for ai in 0..allocs {
            let e = &a_tab[(bi * allocs + ai) * ALLOC_ENTRY..][..ALLOC_ENTRY];
            let mut tok = [0u8; TOKEN_LEN];
            tok.copy_from_slice(&e[..TOKEN_LEN]);
            // A GPU set's allocations are imported by their tokens: one that does not decode is
            // said here, naming the manifest's allocation, not later as a bare token error. A
            // host set's table holds none.
            if kind != KIND_HOST
                && let Err(e) = Token::from_bytes(&tok)
            {
                return Err(ManifestFault::Token {
                    buffer: bi as u64,
                    allocation: ai as u64,
                    why: e.to_string(),
                });
            }
            let len = u64::from_le_bytes(e[TOKEN_LEN..TOKEN_LEN + 8].try_into().expect("8 bytes"));
            if bi == 0 {
                lens.push(len);
            } else if lens[ai] != len {
                return Err(field(
                    "an allocation's length",
                    len,
                    "the same in every buffer",
                ));
            }
            toks.push(tok);
        }
        tokens.push(toks);
    }
    if lens.iter().try_fold(0u64, |s, &l| s.checked_add(l)) != Some(total) {
        return Err(field(
            "the bytes per buffer",
            total,
            "the sum of one buffer's allocations",
        ));
    }
    let tables = TensorTables {
        tensors: n,
        table: (t_off, t_len),
        dims: (d_off, d_len),
        strings: (s_off, s_len),
        allocations: lens.clone(),
        fingerprint: fp,
    };
    let manifest = Manifest {
        kind,
        flags,
        buffers,
        layout: Layout::provisional(lens, fp),
        tokens,
        channel_generation,
        data_generation,
        max_readers,
        holders_generation,
        generation_base,
    };
    Ok((manifest, tables))
}
