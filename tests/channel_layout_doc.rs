//! docs/channel-layout.md against the code: its offset tables against the constants of
//! `cuda_ipc::raw::channel::layout` (which const asserts tie to the `#[repr(C)]` structs), its codes
//! against the wire codes, its pairing table against the `SYNC POINT` labels in `src/channel`, and
//! the bytes of a real segment read at the offsets the doc gives.

mod common;

use common::{Unlink, unique};
use cuda_ipc::channel::Delivery;
use cuda_ipc::raw::channel::layout::{
    self, BUFFER_SLOT_SIZE, CONSUMER_SLOT_SIZE, ConsumerState, FIELDS, GPU_WORDS, HEADER_SIZE,
    MAGIC, ProducerState, READY_PAGE, RELEASE_PAGE, STAMP_READY, VERSION, WRITING,
};
use cuda_ipc::raw::channel::testing::{ControlConsumer, ControlProducer};
use cuda_ipc::token::TOKEN_LEN;
use std::collections::{BTreeMap, BTreeSet};

const DOC: &str = include_str!("../docs/channel-layout.md");

/// The rows (offset, size, field) of the first table after the heading that starts with
/// `## {area} (`, and the byte count the heading gives.
fn table(area: &str) -> (usize, Vec<(usize, usize, String)>) {
    let lines: Vec<&str> = DOC.lines().collect();
    let at = lines
        .iter()
        .position(|l| {
            l.to_lowercase()
                .starts_with(&format!("## {} (", area.to_lowercase()))
        })
        .unwrap_or_else(|| panic!("no section for the {area}"));
    let heading = lines[at];
    let bytes: usize = heading[heading.find('(').unwrap() + 1..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("no byte count in {heading:?}"));
    let rows = lines[at + 1..]
        .iter()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let offset = cells.get(1)?.parse().ok()?;
            let size = cells.get(2)?.parse().ok()?;
            Some((offset, size, cells.get(3)?.trim_matches('`').to_string()))
        })
        .collect();
    (bytes, rows)
}

#[test]
fn the_docs_offset_tables_match_the_layout_constants() {
    for &(area, size, fields) in FIELDS {
        let (bytes, rows) = table(area);
        assert_eq!(bytes, size, "the {area}'s size in the doc's heading");
        let want: Vec<(usize, usize, String)> = fields
            .iter()
            .map(|f| (f.offset, f.size, f.name.to_string()))
            .collect();
        assert_eq!(rows, want, "the doc's {area} table");
        // Every byte, once: each row starts where the one before ended.
        let mut at = 0;
        for (offset, len, name) in &rows {
            assert_eq!(*offset, at, "{area}: {name} leaves a gap or overlaps");
            at += len;
        }
        assert_eq!(at, size, "{area}: the rows do not cover it");
    }
}

#[test]
fn the_docs_overall_layout_constants_and_codes_match_the_code() {
    let overall = [
        format!("| 0 | {HEADER_SIZE} | header |"),
        format!(
            "| {HEADER_SIZE} | {BUFFER_SLOT_SIZE} × B | buffer slots, slot `i` at {HEADER_SIZE} + {BUFFER_SLOT_SIZE} i |"
        ),
        format!(
            "| {HEADER_SIZE} + {BUFFER_SLOT_SIZE} B | {CONSUMER_SLOT_SIZE} × C | consumer slots, slot `k` at {HEADER_SIZE} + {BUFFER_SLOT_SIZE} B + {CONSUMER_SLOT_SIZE} k |"
        ),
        format!(
            "| R = round_up({HEADER_SIZE} + {BUFFER_SLOT_SIZE} B + {CONSUMER_SLOT_SIZE} C, {READY_PAGE}) | {READY_PAGE} |"
        ),
        format!("| R + {READY_PAGE} | {RELEASE_PAGE} |"),
        format!("| total | R + {GPU_WORDS} |"),
    ];
    for row in &overall {
        assert!(DOC.contains(row.as_str()), "the doc lacks {row:?}");
    }
    // The formula is the code's.
    for (b, c) in [(1, 1), (3, 4), (16, 64)] {
        let r = (HEADER_SIZE + BUFFER_SLOT_SIZE * b + CONSUMER_SLOT_SIZE * c)
            .next_multiple_of(READY_PAGE);
        assert_eq!(layout::ready_offset(b, c), r);
        assert_eq!(layout::segment_len(b, c), r + GPU_WORDS);
    }
    for needle in [
        format!("`{MAGIC:#x}`"),
        format!("`{STAMP_READY:#x}`"),
        format!("`{WRITING:#x}` (WRITING)"),
        format!("# Channel control segment layout (layout version {VERSION})"),
        format!("| 8 | 4 | `version` | once | `{VERSION}` |"),
        format!(
            "{} FREE, {} CLAIMING (a consumer is writing its fields), {} ACTIVE (attached)",
            ConsumerState::Free.to_wire(),
            ConsumerState::Claiming.to_wire(),
            ConsumerState::Active.to_wire()
        ),
        format!(
            "delivery: {} every frame, {} latest only",
            Delivery::EveryFrame.to_wire(),
            Delivery::LatestOnly.to_wire()
        ),
        format!(
            "{} open, {} closed",
            ProducerState::Open.to_wire(),
            ProducerState::Closed.to_wire()
        ),
        format!(
            "{} FREE, {} CLAIMING (a consumer is writing its fields), {} ACTIVE (attached), {} LEAVING (being freed)",
            ConsumerState::Free.to_wire(),
            ConsumerState::Claiming.to_wire(),
            ConsumerState::Active.to_wire(),
            ConsumerState::Leaving.to_wire()
        ),
        format!(
            "R + 64 `state`: {} open, {} closed, {} producer gone",
            layout::GateState::Open.to_wire(),
            layout::GateState::Closed.to_wire(),
            layout::GateState::ProducerGone.to_wire()
        ),
        "R + 4096 + 4 (16 k + i)".to_string(),
        format!("end + 2^{}", layout::GATE_HORIZON.trailing_zeros()),
        format!(
            "B = `buffers` (1 to {}), C = `consumers` (1 to {})",
            layout::MAX_BUFFERS,
            layout::MAX_CONSUMERS
        ),
    ] {
        assert!(DOC.contains(needle.as_str()), "the doc lacks {needle:?}");
    }
    assert_eq!(MAGIC.to_le_bytes(), *b"CIPCCHAN");
}

/// The labels of `SYNC POINT: a, b. ...` (or `(SYNC POINT: a)`) comments in `src`, with how often
/// each occurs.
fn labels_in(src: &str, out: &mut BTreeMap<String, usize>) {
    for part in src.split("SYNC POINT: ").skip(1) {
        // A label ends with a period, or with the parenthesis around it.
        let end = part.find(['.', ')']).expect("a label ends with a period");
        for label in part[..end].split(", ") {
            let label = label.split(" (").next().unwrap().trim();
            *out.entry(label.to_string()).or_default() += 1;
        }
    }
}

#[test]
fn every_sync_point_label_in_the_channel_code_is_in_the_docs_pairing_table() {
    let mut used = BTreeMap::new();
    // Every file of the layer, so that a file split off later is read too.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/channel");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "src/channel holds {files:?}");
    for f in &files {
        labels_in(&std::fs::read_to_string(f).unwrap(), &mut used);
    }
    let start = DOC
        .find("## Which store pairs with which load")
        .expect("pairing section");
    let documented: BTreeSet<String> = DOC[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| l.split('|').nth(1).unwrap().trim().to_string())
        .collect();
    let in_code: BTreeSet<String> = used.keys().cloned().collect();
    assert_eq!(
        in_code, documented,
        "labels in src/channel vs. the doc's pairing table"
    );
    for (label, n) in &used {
        assert!(*n >= 2, "SYNC POINT: {label} names only one end");
    }
}

/// The offset of `field` in the doc's table of `area`.
fn doc_offset(area: &str, field: &str) -> usize {
    table(area)
        .1
        .into_iter()
        .find(|(_, _, name)| name == field)
        .unwrap_or_else(|| panic!("{area} has no {field} in the doc"))
        .0
}

#[test]
fn a_real_segment_holds_what_the_doc_says_where_it_says() {
    let name = unique("layout-doc");
    let seg_name = format!("cuda-ipc.ch.{name}");
    let _u = Unlink(seg_name.clone());
    let tokens: Vec<_> = (0..3u8).map(|i| [i + 1; TOKEN_LEN]).collect();
    let tx = ControlProducer::create_with(&name, 12345, 4, &tokens, true).unwrap();
    let rx = ControlConsumer::attach(&name, Delivery::LatestOnly).unwrap();
    let (i, _) = tx.try_acquire().unwrap();
    assert_eq!(i, 0, "ring order: frame 1 in buffer 0");
    tx.publish(i, b"hello").unwrap();
    let (_, seq, _) = rx.try_take().unwrap().unwrap();
    rx.set_released(i, seq);
    let bytes = std::fs::read(format!("/dev/shm/{seg_name}")).unwrap();
    let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap());
    let h = |f: &str| doc_offset("header", f);
    assert_eq!(&bytes[h("magic")..h("magic") + 8], b"CIPCCHAN");
    assert_eq!(u32_at(h("version")), VERSION);
    assert_eq!(u32_at(h("stamp")), 0x5245_4459);
    assert_eq!((u32_at(h("buffers")), u32_at(h("consumers"))), (3, 4));
    assert_eq!(u64_at(h("buffer_bytes")), 12345);
    assert_eq!(u64_at(h("segment_bytes")), bytes.len() as u64);
    assert_eq!(u32_at(h("producer_pid")), std::process::id());
    let uid = rustix::process::geteuid().as_raw();
    assert_eq!(u32_at(h("producer_uid")), uid);
    assert_eq!(u32_at(h("producer_state")), 0);
    assert_eq!((u64_at(h("head")), u32_at(h("head_index"))), (1, 0));
    assert_ne!(u64_at(h("generation")), 0);
    assert_eq!(u32_at(h("flags")), 1, "ring order");
    assert_eq!(u32_at(h("transport")), 0);
    // Nobody sleeps on either futex word now.
    assert_eq!(
        (u32_at(h("publish_sleepers")), u32_at(h("release_sleepers"))),
        (0, 0)
    );
    // Buffer slot `i` at 136 + 576 i.
    let b = |k: usize, f: &str| HEADER_SIZE + k * BUFFER_SLOT_SIZE + doc_offset("buffer slot", f);
    assert_eq!(u64_at(b(i, "seq")), 1);
    assert_eq!(u32_at(b(i, "meta_len")), 5);
    assert_eq!(&bytes[b(i, "meta")..b(i, "meta") + 5], b"hello");
    assert_ne!(u32_at(b(i, "publish_us")), 0);
    for k in 0..3 {
        let t = b(k, "memory_token");
        assert_eq!(bytes[t..t + TOKEN_LEN], [k as u8 + 1; TOKEN_LEN]);
    }
    // Consumer slot `k` at 136 + 576 B + 512 k.
    let c = |f: &str| {
        HEADER_SIZE
            + 3 * BUFFER_SLOT_SIZE
            + rx.slot() * CONSUMER_SLOT_SIZE
            + doc_offset("consumer slot", f)
    };
    assert_eq!(u32_at(c("state")), 2);
    assert_eq!(u32_at(c("policy")), 1);
    assert_eq!(u32_at(c("pid")), std::process::id());
    assert_eq!(u32_at(c("uid")), uid);
    assert_eq!(u64_at(c("generation")), 1);
    assert_eq!((u64_at(c("cursor")), u64_at(c("received"))), (1, 1));
    // One hand-off counted in the latency histogram (its 32 buckets sum to 1).
    let l = c("latency");
    assert_eq!((0..32).map(|k| u64_at(l + 8 * k)).sum::<u64>(), 1);
    // The GPU words: the last 8192 bytes, page aligned; the ready page, then the release page.
    let r = layout::ready_offset(3, 4);
    assert_eq!(bytes.len() % READY_PAGE, 0);
    assert_eq!(bytes.len() - GPU_WORDS, r);
    // Consumer k's release word for buffer i at R + 4096 + 4 (16 k + i).
    assert_eq!(u32_at(r + 4096 + 4 * (16 * rx.slot() + i)), 1);
    tx.set_ready(1, 77);
    tx.close_gate();
    let bytes = std::fs::read(format!("/dev/shm/{seg_name}")).unwrap();
    let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
    // The gate: state 1 (closed) at R + 64, end 1 (the head) at R + 68; every ready word raised
    // 2^30 past the head.
    assert_eq!((u32_at(r + 64), u32_at(r + 68)), (1, 1));
    for k in 0..3 {
        assert_eq!(u32_at(r + 4 * k), 1 + (1 << 30));
    }
    drop(rx);
    tx.unlink();
}
