//! Tensor sets across hosts: a bridge pair mirrors each new generation of a local tensor set into
//! a tensor set of the same layout on another host, over the lane's control connection (its
//! handshake and sealed messages, [`super::wire`]) and NIXL WRITEs ([`super::nixl`]); far readers
//! attach with the ordinary [`TensorSetReader`](crate::tensorset::TensorSetReader).
//!
//! Owns: the sending bridge ([`send`], a reader of the near set) and the receiving bridge
//! ([`recv`], the far set's writer) and the byte ranges a generation moves ([`runs`],
//! [`chunks`]); the changed-only mode compares the tensors' content digests
//! ([`crate::tensorset::content`]). It uses the lane's pieces as they are (session, link, NIXL agent, transport report) and the tensor sets' public API, plus
//! two crate-internal accessors (an allocation's address in a reader or writer) and
//! [`Update::copy_ranges_from_previous`](crate::tensorset::Update::copy_ranges_from_previous).
//!
//! One session:
//! 1. the sending bridge connects and proves the secret; its first message is the near set's
//!    layout ([`SetMsg::Hello`](super::wire::SetMsg::Hello): every tensor's name, dtype, shape, strides, allocation and
//!    offset, the allocations' sizes, the layout fingerprint);
//! 2. the receiving bridge rebuilds the layout (every field checked, the fingerprint
//!    recomputed), creates the far set with it, buffered (B ≥ 2), or keeps the one it has when
//!    the layout is the same (another layout is refused with both fingerprints), registers every
//!    allocation of every far buffer with NIXL once, and answers with their addresses, its NIXL
//!    metadata and the near generation its newest far generation mirrors ([`SetMsg::Ready`](super::wire::SetMsg::Ready));
//! 3. per near generation (the newest; older ones the bridge had no time for are skipped), the
//!    sending bridge holds it (its hold keeps the near writer off the buffer), says which tensors
//!    it will write ([`SetMsg::Begin`](super::wire::SetMsg::Begin): all, or with `changed_only` those whose content digest differs
//!    from the generation the far set mirrors); the receiving bridge takes a far buffer
//!    ([`TensorSetWriter::begin`](crate::tensorset::TensorSetWriter::begin): the oldest no far
//!    reader holds), fills the tensors that will not be written from its newest generation, waits
//!    (GPU sets) for its stream (the far readers' release words, the fill), and names the buffer
//!    ([`SetMsg::Buffer`](super::wire::SetMsg::Buffer)); the sending bridge WRITEs the byte runs of the tensors, in pieces of
//!    at most [`SendOptions::chunk`](send::SendOptions::chunk) bytes, up to
//!    [`SendOptions::in_flight`](send::SendOptions::in_flight) at once, each with a notification
//!    naming the generation and the piece ([`SetNote`](super::wire::SetNote)), and once all
//!    completed says so ([`SetMsg::Done`](super::wire::SetMsg::Done)); the receiving bridge publishes the far generation
//!    only when it has that message AND every piece's notification, and says so
//!    ([`SetMsg::Published`](super::wire::SetMsg::Published)); only then does the sending bridge let the near generation go.
//!
//! A far reader never sees a mix of two generations: the far set is buffered, a far generation is
//! published only whole, and an abandoned one is never published (its
//! [`Update`](crate::tensorset::Update) is dropped: the buffer goes back, the newest generation
//! stays the newest). When the link breaks mid generation, the receiving bridge abandons it,
//! drops the session's NIXL agent (nothing more lands in its registrations) and waits for the
//! next sender; a sending bridge that connects again starts with the newest near generation.
//! A receiving bridge that dies leaves far readers their mappings and the generation they hold;
//! a new one replaces the set (host sets, or VMM sets nobody holds) or resumes it (VMM sets kept
//! by holders), and the first generation it receives is a whole one.

pub mod recv;
pub mod send;

use crate::tensorset::Layout;

/// The default largest WRITE, in bytes (64 MiB).
pub const DEFAULT_CHUNK: u64 = 64 << 20;

/// The default count of WRITEs in flight at once.
pub const DEFAULT_IN_FLIGHT: usize = 8;

/// A byte range of one buffer: (allocation, offset, bytes).
pub type Span = (usize, u64, u64);

/// The byte runs of the tensors `chosen[i] == true` of `layout`: tensors in one allocation that
/// follow each other by offset (no tensor between them) are merged into one run, the alignment gap
/// between them included; empty tensors are left out. Runs come sorted by allocation and
/// offset.
pub fn runs(layout: &Layout, chosen: &[bool]) -> Vec<Span> {
    let t = layout.tensors();
    let mut order: Vec<usize> = (0..t.len()).collect();
    order.sort_by_key(|&i| (t[i].allocation, t[i].offset));
    let mut out: Vec<Span> = Vec::new();
    let mut open = false;
    for i in order {
        let x = &t[i];
        if !chosen.get(i).copied().unwrap_or(false) {
            // A tensor not chosen lies between: the next chosen one starts a new run.
            open = false;
            continue;
        }
        if x.bytes == 0 {
            continue;
        }
        let (a, start, end) = (x.allocation as usize, x.offset, x.offset + x.bytes);
        match out.last_mut() {
            Some((la, lo, len)) if open && *la == a && start <= *lo + *len => {
                *len = (*len).max(end - *lo);
            }
            Some((la, lo, len)) if open && *la == a => *len = end - *lo,
            _ => out.push((a, start, end - start)),
        }
        open = true;
    }
    out
}

/// `spans` cut into pieces of at most `max` bytes (`max` 0 counts as 1).
pub fn chunks(spans: &[Span], max: u64) -> Vec<Span> {
    let max = max.max(1);
    let mut out = Vec::new();
    for &(a, off, len) in spans {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(max);
            out.push((a, off + at, n));
            at += n;
        }
    }
    out
}

/// The bytes of `spans` that none of `minus` covers, as spans sorted by allocation and offset
/// (both may overlap themselves). The receiving bridge's fill copies these, so that it never
/// touches a byte a WRITE of the same generation writes, even where tensors alias or a WRITE's
/// run includes an alignment gap.
pub fn subtract(spans: &[Span], minus: &[Span]) -> Vec<Span> {
    let mut cut: Vec<Span> = minus.iter().copied().filter(|s| s.2 > 0).collect();
    cut.sort_unstable();
    let mut out: Vec<Span> = Vec::new();
    for &(a, off, len) in spans {
        let end = off.saturating_add(len);
        let mut at = off;
        for &(_, co, cl) in cut.iter().filter(|c| c.0 == a) {
            let ce = co.saturating_add(cl);
            if ce <= at || co >= end {
                continue;
            }
            if co > at {
                out.push((a, at, co - at));
            }
            at = at.max(ce);
            if at >= end {
                break;
            }
        }
        if at < end {
            out.push((a, at, end - at));
        }
    }
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensorset::{DType, TensorSpec};

    #[test]
    fn subtract_leaves_exactly_the_bytes_no_other_span_covers() {
        // Allocation 0: [0, 100) minus [10, 20) and [15, 30) and [90, 200); allocation 1 untouched
        // by a span of allocation 0.
        let got = subtract(
            &[(0, 0, 100), (1, 0, 10)],
            &[
                (0, 15, 15),
                (0, 10, 10),
                (0, 90, 110),
                (1, 20, 5),
                (0, 50, 0),
            ],
        );
        assert_eq!(got, [(0, 0, 10), (0, 30, 60), (1, 0, 10)]);
        // Wholly covered, or nothing to cut.
        assert!(subtract(&[(0, 5, 5)], &[(0, 0, 100)]).is_empty());
        assert_eq!(subtract(&[(0, 5, 5)], &[]), [(0, 5, 5)]);
        // Brute force over small cases: a byte is kept iff no cut covers it.
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for _ in 0..500 {
            let spans: Vec<Span> = (0..3)
                .map(|_| (next(2) as usize, next(40), next(20)))
                .collect();
            let cuts: Vec<Span> = (0..4)
                .map(|_| (next(2) as usize, next(40), next(20)))
                .collect();
            let got = subtract(&spans, &cuts);
            for a in 0..2usize {
                for b in 0..70u64 {
                    let inside =
                        |v: &[Span]| v.iter().any(|&(x, o, l)| x == a && o <= b && b < o + l);
                    let want = inside(&spans) && !inside(&cuts);
                    assert_eq!(inside(&got), want, "{spans:?} - {cuts:?}: byte {b} of {a}");
                }
            }
        }
    }

    #[test]
    fn runs_merge_neighbours_and_stop_at_a_tensor_left_out() {
        // Offsets 0, 256, 512, 768 (256-byte alignment), 16 bytes each.
        let l = Layout::new(&[
            TensorSpec::new("a", DType::F32, &[4]),
            TensorSpec::new("b", DType::F32, &[4]),
            TensorSpec::new("c", DType::F32, &[4]),
            TensorSpec::new("d", DType::F32, &[4]),
            TensorSpec::new("e", DType::F32, &[0]),
        ])
        .unwrap();
        assert_eq!(runs(&l, &[true; 5]), vec![(0, 0, 784)]);
        assert_eq!(
            runs(&l, &[true, true, false, true, true]),
            vec![(0, 0, 272), (0, 768, 16)]
        );
        assert_eq!(runs(&l, &[false; 5]), vec![]);
        assert_eq!(
            chunks(&[(0, 0, 272), (0, 768, 16)], 100),
            vec![(0, 0, 100), (0, 100, 100), (0, 200, 72), (0, 768, 16)]
        );
    }
}
