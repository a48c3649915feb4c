//! Host-memory tensor sets with the real writer and readers, in separate processes, on machines
//! without a GPU: every generation's bytes checked in both modes, holds that block an in-place
//! update and ones that do not block a buffered one, a reader and a writer killed, the layout and
//! content fingerprints, an open's phase timings, an open that fails half way, a set of 100,000
//! tensors, hostile files under the manifest's name, overwritten header and body words (a zeroed
//! stamp, a GPU kind over a host set's table), and `gc` of a dead writer's set: a file
//! planted under one part's name keeps no other part, and a segment of zeros is an abandoned
//! creation told without a wait.

mod common;

use common::{Peer, parent_lines, role, tell};
use cuda_ipc::Error;
use cuda_ipc::cleanup::{self, LeftoverKind, Scope};
use cuda_ipc::raw::shm::ShmError;
use cuda_ipc::tensorset::{
    DType, GenerationMode, Layout, ReaderOptions, TensorSetError, TensorSetOptions,
    TensorSetReader, TensorSetWriter, TensorSpec, inspect,
};
use std::process::Command;
use std::time::{Duration, Instant};

const ANSWER: Duration = Duration::from_secs(20);
const SET: &str = "CUDA_IPC_TEST_SET";
const MODE: &str = "CUDA_IPC_TEST_MODE";

fn set_name(tag: &str) -> String {
    format!("ts-{tag}-{}", std::process::id())
}

fn path(prefix: &str, name: &str) -> String {
    format!("/dev/shm/{prefix}{name}")
}

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("a.weight", DType::F32, &[100]),
        TensorSpec::new("b.weight", DType::BF16, &[7, 13]),
        TensorSpec::new("c.bias", DType::U8, &[1000]),
        TensorSpec::strided("d.t", DType::F8_E4M3FN, &[4, 8], &[1, 4]),
    ]
}

fn mode_opts(mode: &str) -> TensorSetOptions {
    let m = if mode == "buffered" {
        GenerationMode::Buffered(2)
    } else {
        GenerationMode::InPlace
    };
    TensorSetOptions::new().mode(m)
}

/// Byte `k` of tensor `t` in generation `g`.
fn pattern(g: u64, t: usize, k: usize) -> u8 {
    (g.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ (k as u8).wrapping_mul(31) ^ (t as u8 * 7)
}

/// Writes and commits the next generation; returns its number.
fn write_gen(w: &mut TensorSetWriter) -> u64 {
    let g = w.generation() + 1;
    let sizes: Vec<u64> = w.layout().tensors().iter().map(|t| t.bytes).collect();
    let mut u = w.begin(Some(ANSWER)).expect("begin");
    assert_eq!(u.generation(), g);
    for (t, n) in sizes.iter().enumerate() {
        let bytes: Vec<u8> = (0..*n as usize).map(|k| pattern(g, t, k)).collect();
        u.write_tensor(t, &bytes).unwrap();
    }
    assert_eq!(u.commit().unwrap(), g);
    g
}

fn check_gen(held: &cuda_ipc::tensorset::Held<'_>, n: usize) {
    let g = held.generation();
    for t in 0..n {
        let bytes = held.read_tensor(t).unwrap();
        for (k, b) in bytes.iter().enumerate() {
            assert_eq!(*b, pattern(g, t, k), "generation {g} tensor {t} byte {k}");
        }
    }
}

fn kill9(pid: u32) {
    let st = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

/// The child side of every test: the role names what to do.
#[test]
fn child() {
    let Some(r) = role() else { return };
    let name = std::env::var(SET).unwrap();
    let mode = std::env::var(MODE).unwrap_or_default();
    match r.as_str() {
        "reader" => {
            let rx = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
            let n = rx.layout().len();
            tell("opened");
            let (mut seen, mut last) = (0u64, 0u64);
            loop {
                match rx.wait_newer(last, Some(ANSWER)) {
                    Ok(h) => {
                        assert!(h.generation() > last, "{} after {last}", h.generation());
                        check_gen(&h, n);
                        last = h.generation();
                        seen += 1;
                    }
                    Err(Error::TensorSet(TensorSetError::Closed(_))) => break,
                    Err(e) => panic!("wait_newer: {e}"),
                }
            }
            tell(format!("ok {seen} {last}"));
        }
        "hold" => {
            let rx = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
            let h = rx.current().unwrap().expect("a generation");
            check_gen(&h, rx.layout().len());
            tell(format!("holding {}", h.generation()));
            let mut lines = parent_lines();
            match lines.next().as_deref() {
                Some("release") => {
                    drop(h);
                    tell("released");
                }
                Some("check") => {
                    // Buffered: the writer went on; what is held is unchanged, and the newest
                    // generation is there at once.
                    check_gen(&h, rx.layout().len());
                    let t = Instant::now();
                    let newer = rx.wait_newer(h.generation(), Some(ANSWER)).unwrap();
                    assert!(t.elapsed() < Duration::from_secs(1));
                    check_gen(&newer, rx.layout().len());
                    tell(format!("newest {}", newer.generation()));
                }
                _ => std::thread::sleep(Duration::from_secs(600)),
            }
            for _ in lines {}
        }
        "writer" => {
            let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts(&mode)).unwrap();
            tell(format!("published {}", write_gen(&mut w)));
            for line in parent_lines() {
                if line == "publish" {
                    tell(format!("published {}", write_gen(&mut w)));
                }
            }
            std::thread::sleep(Duration::from_secs(600));
        }
        other => panic!("unknown role {other}"),
    }
}

fn spawn(role: &str, name: &str, mode: &str) -> Peer {
    Peer::spawn("child", role, &[(SET, name), (MODE, mode)])
}

fn every_generation_checked(mode: &str) {
    let name = set_name(mode);
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts(mode)).unwrap();
    let mut a = spawn("reader", &name, mode);
    let mut b = spawn("reader", &name, mode);
    a.expect("opened", ANSWER);
    b.expect("opened", ANSWER);
    for _ in 0..200 {
        write_gen(&mut w);
    }
    // Let the readers see the last generation before the close withdraws it.
    std::thread::sleep(Duration::from_millis(300));
    w.close(ANSWER).unwrap();
    for mut p in [a, b] {
        let got = p.expect("ok", ANSWER);
        let mut it = got.split(' ').map(|v| v.parse::<u64>().unwrap());
        let (seen, last) = (it.next().unwrap(), it.next().unwrap());
        assert!(seen >= 1 && last == 200, "{got}");
        p.finish(ANSWER);
    }
    for prefix in ["cuda-ipc.ts.", "cuda-ipc.tg.", "cuda-ipc.td."] {
        assert!(
            std::fs::symlink_metadata(path(prefix, &name)).is_err(),
            "{prefix}"
        );
    }
}

#[test]
fn readers_in_other_processes_check_every_generation_in_place() {
    if role().is_some() {
        return;
    }
    every_generation_checked("inplace");
}

#[test]
fn readers_in_other_processes_check_every_generation_double_buffered() {
    if role().is_some() {
        return;
    }
    every_generation_checked("buffered");
}

#[test]
fn in_place_a_held_generation_blocks_begin_until_released() {
    if role().is_some() {
        return;
    }
    let name = set_name("block");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts("inplace")).unwrap();
    write_gen(&mut w);
    let mut p = spawn("hold", &name, "inplace");
    assert_eq!(p.expect("holding", ANSWER), "1");
    match w.begin(Some(Duration::from_millis(300))) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("begin while held: {other:?}"),
    }
    p.send("release");
    p.expect("released", ANSWER);
    let t = Instant::now();
    assert_eq!(write_gen(&mut w), 2);
    assert!(t.elapsed() < Duration::from_secs(2));
    p.finish(ANSWER);
}

#[test]
fn an_open_reports_where_its_time_went() {
    if role().is_some() {
        return;
    }
    let name = set_name("timings");
    let w = TensorSetWriter::create_host(&name, &specs(), &mode_opts("inplace")).unwrap();
    let t = Instant::now();
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let wall = t.elapsed();
    let p = r.open_timings();
    assert!(p.manifest > Duration::ZERO && p.map > Duration::ZERO && p.join > Duration::ZERO);
    // A host set fetches no fds, makes no GPU objects and joins on the opening thread.
    assert_eq!((p.fd_fetch, p.join_gpu), (Duration::ZERO, Duration::ZERO));
    assert_eq!(p.join_wait, p.join);
    assert!(
        p.fingerprint > Duration::ZERO,
        "a host set's fingerprint is checked inline"
    );
    assert!(
        p.tables > Duration::ZERO && p.tables <= p.manifest,
        "a host set's tensor tables are decoded inline, within the manifest's time: {p:?}"
    );
    assert!(
        p.manifest + p.fingerprint + p.map + p.join <= p.total,
        "{p:?}"
    );
    assert!(p.total <= wall, "{p:?} in {wall:?}");
    drop(r);
    w.close(ANSWER).unwrap();
}

#[test]
fn buffered_readers_of_an_old_generation_hold_back_only_its_buffer() {
    if role().is_some() {
        return;
    }
    // Three buffers: a reader that keeps generation 1 leaves the writer two to go on in.
    let name = set_name("nowait");
    let three = TensorSetOptions::new().mode(GenerationMode::Buffered(3));
    let mut w = TensorSetWriter::create_host(&name, &specs(), &three).unwrap();
    write_gen(&mut w);
    let mut p = spawn("hold", &name, "buffered");
    assert_eq!(p.expect("holding", ANSWER), "1");
    for _ in 0..10 {
        let t = Instant::now();
        let mut u = w
            .begin(Some(Duration::from_secs(1)))
            .expect("begin while a reader holds 1");
        assert!(t.elapsed() < Duration::from_millis(500));
        assert_ne!(u.buffer(), 0, "the held buffer was taken");
        u.copy_from_previous().unwrap();
        drop(u);
        write_gen(&mut w);
    }
    p.send("check");
    assert_eq!(p.expect("newest", ANSWER), w.generation().to_string());
    p.finish(ANSWER);
}

#[test]
fn a_buffered_writer_never_takes_the_newest_generation_from_its_readers() {
    if role().is_some() {
        return;
    }
    // Two buffers, generation 1 held in one and 2 the newest in the other: `begin` waits for
    // the old one rather than rewrite the newest, which readers go on taking meanwhile; an
    // update dropped unpublished takes nothing from them either.
    let name = set_name("newest");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts("buffered")).unwrap();
    write_gen(&mut w);
    let mut p = spawn("hold", &name, "buffered");
    assert_eq!(p.expect("holding", ANSWER), "1");
    assert_eq!(write_gen(&mut w), 2);
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    match w.begin(Some(Duration::from_millis(200))) {
        Err(Error::Timeout { .. }) => {}
        Err(e) => panic!("begin while generation 1 is held: {e}"),
        Ok(u) => panic!(
            "begin took buffer {} while generation 1 is held",
            u.buffer()
        ),
    }
    let newest = r.current().unwrap().expect("the newest generation");
    assert_eq!(newest.generation(), 2);
    check_gen(&newest, r.layout().len());
    drop(newest);
    p.send("release");
    assert_eq!(p.expect("released", ANSWER), "");
    let mut u = w
        .begin(Some(ANSWER))
        .expect("begin once generation 1 is let go");
    assert_eq!(u.buffer(), 0, "generation 1's buffer");
    u.copy_from_previous().unwrap();
    drop(u);
    assert_eq!(r.current().unwrap().expect("still there").generation(), 2);
    p.finish(ANSWER);
    drop(r);
    w.close(ANSWER).unwrap();
}

#[test]
fn a_reader_killed_while_holding_is_freed_within_a_second() {
    if role().is_some() {
        return;
    }
    let name = set_name("rkill");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts("inplace")).unwrap();
    write_gen(&mut w);
    let mut p = spawn("hold", &name, "inplace");
    p.expect("holding", ANSWER);
    assert_eq!(inspect::inspect(&name).unwrap().holds, 1);
    kill9(p.child.id());
    let _ = p.child.wait();
    // gc lists the dead reader's slot of the live writer's set (and nothing else of it).
    let scope = Scope::only(vec![], vec![]).with_tensor_sets(vec![name.clone()]);
    let scan = cleanup::scan(&scope).unwrap();
    let kinds: Vec<_> = scan.leftovers.iter().map(|l| l.kind).collect();
    assert_eq!(
        kinds,
        vec![LeftoverKind::TensorSetReader],
        "{:?}",
        scan.leftovers
    );
    let t = Instant::now();
    let u = w.begin(Some(ANSWER)).expect("begin after the reader died");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(u.commit().unwrap(), 2);
}

#[test]
fn a_killed_writer_leaves_readers_their_bytes_and_waits_end_with_writer_gone() {
    if role().is_some() {
        return;
    }
    let name = set_name("wkill");
    let mut p = spawn("writer", &name, "inplace");
    assert_eq!(p.expect("published", ANSWER), "1");
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let h = r.current().unwrap().expect("generation 1");
    kill9(p.child.id());
    let _ = p.child.wait();
    check_gen(&h, r.layout().len());
    let t = Instant::now();
    match r.wait_newer(1, Some(ANSWER)) {
        Err(Error::TensorSet(TensorSetError::WriterGone { name: n, .. })) => assert_eq!(n, name),
        other => panic!("expected WriterGone, got {other:?}"),
    }
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    check_gen(&h, r.layout().len());
    drop(h);
    drop(r);
    // gc removes every part of the dead writer's set.
    let scope = Scope::only(vec![], vec![]).with_tensor_sets(vec![name.clone()]);
    let scan = cleanup::scan(&scope).unwrap();
    let kinds: Vec<_> = scan.leftovers.iter().map(|l| l.kind).collect();
    assert_eq!(
        kinds,
        vec![LeftoverKind::TensorSet; 3],
        "{:?}",
        scan.leftovers
    );
    assert!(
        scan.leftovers
            .iter()
            .all(|l| l.to_string().starts_with(&format!("tensorset {name}: ")))
    );
    let removal = cleanup::remove(&scan.leftovers);
    assert_eq!(removal.removed.len(), 3, "{removal:?}");
    for prefix in ["cuda-ipc.ts.", "cuda-ipc.tg.", "cuda-ipc.td."] {
        assert!(
            std::fs::symlink_metadata(path(prefix, &name)).is_err(),
            "{prefix}"
        );
    }
    assert!(cleanup::scan(&scope).unwrap().leftovers.is_empty());
}

#[test]
fn a_reader_in_another_pid_namespace_checks_every_generation() {
    if role().is_some() {
        return;
    }
    if let Err(why) = common::unshare_works(&["--pid", "--fork", "--mount-proc"]) {
        println!("skipped: {why}");
        return;
    }
    let name = set_name("pidns");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts("buffered")).unwrap();
    let mut p = Peer::spawn_under(
        &["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"],
        "child",
        "reader",
        &[(SET, &name), (MODE, "buffered")],
    );
    p.expect("opened", ANSWER);
    for _ in 0..100 {
        write_gen(&mut w);
    }
    std::thread::sleep(Duration::from_millis(300));
    w.close(ANSWER).unwrap();
    assert!(p.expect("ok", ANSWER).ends_with(" 100"));
    p.finish(ANSWER);
}

#[test]
fn abandoned_creations_are_replaced_and_collected() {
    if role().is_some() {
        return;
    }
    // An empty manifest (a creator killed before sizing it) and an empty host data segment.
    let (a, b) = (set_name("aband-a"), set_name("aband-b"));
    let _g = [
        common::Unlink(format!("cuda-ipc.ts.{a}")),
        common::Unlink(format!("cuda-ipc.td.{b}")),
    ];
    common::plant(path("cuda-ipc.ts.", &a), &[]);
    common::plant(path("cuda-ipc.td.", &b), &[]);
    // Young: a creator may be sizing it now.
    match TensorSetWriter::create_host(&a, &specs(), &TensorSetOptions::new()) {
        Err(Error::TensorSet(TensorSetError::CreationInProgress(_))) => {}
        other => panic!("over a young empty manifest: {other:?}"),
    }
    std::thread::sleep(Duration::from_millis(2100));
    let mut w = TensorSetWriter::create_host(&a, &specs(), &TensorSetOptions::new()).unwrap();
    assert_eq!(write_gen(&mut w), 1);
    let scope = Scope::only(vec![], vec![]).with_tensor_sets(vec![a.clone(), b.clone()]);
    let scan = cleanup::scan(&scope).unwrap();
    let kinds: Vec<_> = scan
        .leftovers
        .iter()
        .map(|l| (l.kind, l.object.clone()))
        .collect();
    assert_eq!(
        kinds,
        vec![(LeftoverKind::TensorSetCreation, b.clone())],
        "{:?}",
        scan.leftovers
    );
    assert_eq!(cleanup::remove(&scan.leftovers).removed.len(), 1);
    assert!(std::fs::symlink_metadata(path("cuda-ipc.td.", &b)).is_err());
}

/// A set's manifest cut short of the body its header records (`truncate -s 4096`) is said to be
/// truncated, with the file's real size and the size its header records, and garbage under its
/// generation channel's name is said not to be the set's generation channel. Before: "the body
/// at bytes 4096+N runs past the manifest's 0 bytes", and "not a cuda-ipc channel".
#[test]
fn a_truncated_manifest_and_garbage_under_the_generation_channel_are_named_as_such() {
    if role().is_some() {
        return;
    }
    let n = set_name("truncated");
    let w = TensorSetWriter::create_host(&n, &specs(), &TensorSetOptions::new()).unwrap();
    let manifest = path("cuda-ipc.ts.", &n);
    let len = std::fs::metadata(&manifest).unwrap().len();
    assert!(len > 4096, "{len}");
    // Another writer's file of this user cut short: the writer of `w` never reads its manifest
    // again, so it is cut here (a copy, not the writer's mapping).
    let cut = set_name("truncated-copy");
    let _g = [
        common::Unlink(format!("cuda-ipc.ts.{cut}")),
        common::Unlink(format!("cuda-ipc.tg.{cut}")),
    ];
    let bytes = std::fs::read(&manifest).unwrap();
    common::plant(path("cuda-ipc.ts.", &cut), &bytes[..4096]);
    let e = TensorSetReader::open_host(&cut, &ReaderOptions::new())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "the segment is 4096 bytes, cut short of the {} bytes its header records for its \
             body: truncated",
            // The header page and the body its `body_len` (offset 64) records.
            4096 + u64::from_le_bytes(bytes[64..72].try_into().unwrap())
        )),
        "{e}"
    );
    assert!(!e.contains("manifest's 0 bytes"), "{e}");
    // Garbage under a generation channel's name.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let garbage: Vec<u8> = (0..65536)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    common::plant(path("cuda-ipc.tg.", &cut), &garbage);
    std::fs::remove_file(path("cuda-ipc.ts.", &cut)).unwrap();
    let judged = cuda_ipc::tensorset::reclaim::parts_without_manifest(&cut)
        .unwrap()
        .into_iter()
        .map(|p| match p.judgement {
            cuda_ipc::tensorset::reclaim::Judgement::Unjudged(e) => e.to_string(),
            other => format!("{other:?}"),
        })
        .collect::<Vec<_>>()
        .join("; ");
    assert!(
        judged.contains("is not a cuda-ipc tensor set's generation channel (magic"),
        "{judged}"
    );
    assert!(!judged.contains("not a cuda-ipc channel"), "{judged}");
    drop(w);
}

/// A young empty manifest (a creator may be sizing it now) is a creation in progress that says to
/// try again, as a channel's does: the writer's create over it fails at once with that message.
#[test]
fn a_creation_in_progress_says_to_try_again_as_a_channels_does() {
    if role().is_some() {
        return;
    }
    let n = set_name("young");
    let _g = common::Unlink(format!("cuda-ipc.ts.{n}"));
    common::plant(path("cuda-ipc.ts.", &n), &[]);
    let e = TensorSetWriter::create_host(&n, &specs(), &TensorSetOptions::new())
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(e, Error::TensorSet(TensorSetError::CreationInProgress(_))),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        format!("tensor set {n:?} is being created by another process; try again")
    );
    let channel = cuda_ipc::channel::ChannelError::CreationInProgress(n.clone()).to_string();
    assert_eq!(
        channel,
        format!("channel {n:?} is being created by another process; try again")
    );
}

/// A count of one byte is said in the singular, others in the plural: a write of 2 bytes into a
/// tensor of 1 byte, and of 3 bytes into one of 2, name both counts so.
#[test]
fn a_write_past_a_one_byte_tensor_says_one_byte() {
    if role().is_some() {
        return;
    }
    let n = set_name("one-byte");
    let specs = [
        TensorSpec::new("one", DType::U8, &[1]),
        TensorSpec::new("two", DType::U8, &[2]),
    ];
    let mut w = TensorSetWriter::create_host(&n, &specs, &TensorSetOptions::new()).unwrap();
    let mut u = w.begin(Some(ANSWER)).unwrap();
    let e = u.write_tensor(0, &[1, 2]).unwrap_err().to_string();
    assert_eq!(e, "invalid argument: 2 bytes into tensor \"one\" of 1 byte");
    let e = u.write_tensor(1, &[1, 2, 3]).unwrap_err().to_string();
    assert_eq!(
        e,
        "invalid argument: 3 bytes into tensor \"two\" of 2 bytes"
    );
    u.write_tensor(0, &[7]).unwrap();
    assert_eq!(u.commit().unwrap(), 1);
}

/// A manifest of zeros (no writer recorded) 2 s old by `st_ctime`'s whole seconds (between 1 and
/// 3 s of real time) is a creation abandoned half-way, as an empty one of that age is: a reader's
/// open and an inspection (`cuda-ipc ls`) refuse it at once. Before, one at 2 by that count was
/// waited for (2 s), then said to be "being created by another process".
#[test]
fn a_manifest_of_zeros_two_seconds_old_by_its_ctime_is_refused_at_once() {
    if role().is_some() {
        return;
    }
    let n = set_name("zeros-at-two");
    let _g = common::Unlink(format!("cuda-ipc.ts.{n}"));
    // Planted just after a second began: 2 by `st_ctime`'s count from 1.95 s on, 3 from 2.95 s.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    std::thread::sleep(Duration::from_nanos(
        1_000_000_000 - u64::from(now.subsec_nanos()) + 50_000_000,
    ));
    let planted = Instant::now();
    common::plant(path("cuda-ipc.ts.", &n), &[0u8; 8192]);
    std::thread::sleep(Duration::from_millis(2300).saturating_sub(planted.elapsed()));
    let t = Instant::now();
    let open = TensorSetReader::open_host(&n, &ReaderOptions::default())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    let inspected = inspect::inspect(&n).map(|_| ()).unwrap_err().to_string();
    let took = t.elapsed();
    for e in [&open, &inspected] {
        assert!(e.contains("abandoned half-way"), "{e}");
    }
    assert!(took < Duration::from_secs(1), "took {took:?}");
}

#[test]
fn a_live_writers_set_is_not_taken_and_a_dead_ones_is_replaced() {
    if role().is_some() {
        return;
    }
    let name = set_name("replace");
    let w = TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).unwrap();
    match TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()) {
        Err(Error::TensorSet(TensorSetError::AlreadyExists { pid, .. })) => {
            assert_eq!(pid, std::process::id())
        }
        other => panic!("a second writer: {other:?}"),
    }
    drop(w);
    let mut p = spawn("writer", &name, "inplace");
    p.expect("published", ANSWER);
    kill9(p.child.id());
    let _ = p.child.wait();
    let mut w = TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).unwrap();
    assert_eq!(write_gen(&mut w), 1);
}

#[test]
fn readers_racing_a_writer_that_replaces_the_set_open_one_creation_or_none() {
    if role().is_some() {
        return;
    }
    // A writer publishes the set, drops it (a host set goes with its writer) and publishes it
    // again, over and over, while readers open it: an open that read the manifest of one creation
    // and found another's generation channel or data segment opens again, so a reader gets a
    // whole set (its generation's bytes checked) or hears that there is none, never a bad
    // manifest.
    let name = set_name("race");
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (opened, none) = std::thread::scope(|s| {
        let readers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let (mut opened, mut none) = (0u32, 0u32);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        match TensorSetReader::open_host(&name, &ReaderOptions::new()) {
                            Ok(r) => {
                                opened += 1;
                                if let Ok(Some(h)) = r.current() {
                                    check_gen(&h, specs().len());
                                }
                            }
                            Err(Error::TensorSet(
                                TensorSetError::NotFound(_)
                                | TensorSetError::WriterGone { .. }
                                | TensorSetError::Closed(_),
                            ))
                            | Err(Error::Shm(ShmError::NotFound { .. })) => none += 1,
                            Err(e) => panic!("a reader's open: {e}"),
                        }
                    }
                    (opened, none)
                })
            })
            .collect();
        for _ in 0..300 {
            let mut w =
                TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).unwrap();
            assert_eq!(write_gen(&mut w), 1);
            drop(w);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        readers
            .into_iter()
            .map(|h| h.join().unwrap())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    });
    println!("opened {opened}, found none {none}");
    assert!(opened + none > 0);
}

#[test]
fn an_open_that_fails_half_way_leaves_no_reader_and_no_mapping_behind() {
    if role().is_some() {
        return;
    }
    // The open maps the memory and attaches to the generation channel (a GPU set's at the same
    // time, on two threads): when one half fails, the other half's result is dropped (the channel
    // slot freed, the data segment unmapped) and the memory's error, else the channel's, returned.
    let name = set_name("half");
    let opts = TensorSetOptions::new().max_readers(1);
    let mut w = TensorSetWriter::create_host(&name, &specs(), &opts).unwrap();
    assert_eq!(write_gen(&mut w), 1);
    let data = path(cuda_ipc::tensorset::DATA_PREFIX, &name);
    let away = format!("{data}.away");
    // The memory half fails (the data segment is not there); the channel half attached.
    std::fs::rename(&data, &away).unwrap();
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new());
    std::fs::rename(&away, &data).unwrap();
    match r {
        Err(Error::Channel(e)) => panic!("the data segment's error expected, got {e:?}"),
        Err(_) => {}
        Ok(r) => panic!("opened without the data segment: {r:?}"),
    }
    // Its channel slot was freed: the set's one reader slot is free for this open.
    let r1 = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    check_gen(&r1.current().unwrap().unwrap(), specs().len());
    // The channel half fails (no slot left); the memory half's mapping is dropped.
    match TensorSetReader::open_host(&name, &ReaderOptions::new()) {
        Err(Error::TensorSet(TensorSetError::TooManyReaders { max: 1, .. })) => {}
        other => panic!("expected TooManyReaders {{ max: 1 }}, got {other:?}"),
    }
    drop(r1);
    let r2 = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    check_gen(&r2.current().unwrap().unwrap(), specs().len());
    drop(r2);
    assert_eq!(write_gen(&mut w), 2);
}

#[test]
fn fingerprints_refuse_the_wrong_layout_and_content_and_holds_count_per_buffer() {
    if role().is_some() {
        return;
    }
    let name = set_name("fp");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).unwrap();
    let fp = Layout::new(&specs()).unwrap().fingerprint();
    assert_eq!(w.layout().fingerprint(), fp);
    match TensorSetReader::open_host(&name, &ReaderOptions::new().expect_layout([1; 32])) {
        Err(Error::TensorSet(TensorSetError::LayoutMismatch { expected, found })) => {
            assert_eq!((expected, found), ([1; 32], fp));
        }
        other => panic!("expected LayoutMismatch, got {other:?}"),
    }
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new().expect_layout(fp)).unwrap();
    assert!(r.current().unwrap().is_none());
    assert!(!r.is_read_only());
    assert_eq!(r.imports(), 0);
    let u = w.begin(None).unwrap();
    u.commit_with_content([7; 32]).unwrap();
    let strict =
        TensorSetReader::open_host(&name, &ReaderOptions::new().expect_content([8; 32])).unwrap();
    match strict.current() {
        Err(Error::TensorSet(TensorSetError::ContentMismatch { generation: 1, .. })) => {}
        other => panic!("expected ContentMismatch, got {other:?}"),
    }
    // The refused generation was released: and one taken twice is held until both guards drop.
    let h1 = r.current().unwrap().unwrap();
    let h2 = r.current().unwrap().unwrap();
    assert_eq!(
        (h1.generation(), h2.generation(), h1.content()),
        (1, 1, [7; 32])
    );
    assert_eq!(h1.by_name("c.bias").unwrap().info.bytes, 1000);
    assert!(h1.device_ptr(0).is_err());
    drop(h1);
    assert!(matches!(
        w.begin(Some(Duration::from_millis(100))),
        Err(Error::Timeout { .. })
    ));
    drop(h2);
    assert_eq!(write_gen(&mut w), 2);
    let snap = inspect::inspect(&name).unwrap();
    assert_eq!(
        (
            snap.generation,
            snap.readers.len(),
            snap.tensors,
            snap.memory
        ),
        (2, 2, 4, "host")
    );
}

#[test]
fn a_hundred_thousand_tensors_are_published_and_opened() {
    if role().is_some() {
        return;
    }
    let name = set_name("big");
    let specs: Vec<TensorSpec> = (0..100_000)
        .map(|i| TensorSpec::new(format!("model.layers.{i}.w"), DType::BF16, &[2, 3]))
        .collect();
    let mut w = TensorSetWriter::create_host(&name, &specs, &TensorSetOptions::new()).unwrap();
    let mut u = w.begin(None).unwrap();
    u.write_tensor(99_999, &[9; 12]).unwrap();
    u.commit().unwrap();
    let t = Instant::now();
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    println!("open of 100,000 tensors: {:?}", t.elapsed());
    assert_eq!(r.layout().len(), 100_000);
    let h = r.current().unwrap().unwrap();
    let i = r.layout().index_of("model.layers.99999.w").unwrap();
    assert_eq!(h.read_tensor(i).unwrap(), vec![9; 12]);
}

fn mkfifo(p: &str) {
    let c = std::ffi::CString::new(p).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {p}");
}

#[test]
fn hostile_files_under_the_manifests_name_are_refused_with_typed_errors() {
    if role().is_some() {
        return;
    }
    let name = set_name("hostile");
    let p = path("cuda-ipc.ts.", &name);
    // What a failed run leaves is removed all the same (a planted 0644 file is no leftover `gc`
    // removes).
    let _g = common::Unlink(format!("cuda-ipc.ts.{name}"));
    let open = || TensorSetReader::open_host(&name, &ReaderOptions::new());
    // Nothing there.
    assert!(matches!(
        open(),
        Err(Error::TensorSet(TensorSetError::NotFound(_)))
    ));
    // A FIFO: refused without blocking, also for a writer, and left alone.
    mkfifo(&p);
    assert!(matches!(
        open(),
        Err(Error::Shm(ShmError::NotASegment { .. }))
    ));
    assert!(TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).is_err());
    assert!(
        std::fs::symlink_metadata(&p)
            .unwrap()
            .file_type()
            .is_fifo_like()
    );
    std::fs::remove_file(&p).unwrap();
    // Another program's file (of this user, mode 0600, as the library's segments are).
    common::plant(&p, &vec![b'x'; 8192]);
    match open() {
        Err(Error::TensorSet(TensorSetError::BadManifest { .. })) => {}
        other => panic!("foreign file: {other:?}"),
    }
    // Truncated below the header page.
    common::plant(&p, &[0u8; 100]);
    assert!(matches!(open(), Err(Error::Shm(ShmError::TooSmall { .. }))));
    // Sparse: a size with no pages behind it.
    common::plant(&p, &[]).set_len(1 << 20).unwrap();
    assert!(
        matches!(open(), Err(Error::Shm(ShmError::Sparse { .. }))),
        "{:?}",
        open()
    );
    std::fs::remove_file(&p).unwrap();
    // Zeros open to other users (any of the mode bits 0o007), which the library never makes:
    // refused for the mode by a reader and a writer alike, at once, and left as it is.
    for mode in [0o644, 0o606] {
        use std::os::unix::fs::PermissionsExt;
        common::plant(&p, &[0u8; 16384]);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        let t = Instant::now();
        for r in [
            open().map(|_| ()),
            TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).map(|_| ()),
        ] {
            assert!(
                matches!(r, Err(Error::Shm(ShmError::InsecureMode { mode: m, .. })) if m == mode),
                "{mode:o}: {r:?}"
            );
        }
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 16384);
        std::fs::remove_file(&p).unwrap();
    }
    // A real manifest with a corrupted body: refused with the fault named.
    let _w = TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).unwrap();
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[4096 + 8..4096 + 12].copy_from_slice(&999u32.to_le_bytes());
    std::fs::write(&p, &bytes).unwrap();
    match open() {
        Err(Error::TensorSet(TensorSetError::BadManifest { fault, .. })) => {
            assert!(fault.to_string().contains("buffer count"), "{fault}")
        }
        other => panic!("corrupted body: {other:?}"),
    }
    // A tensor entry pointing outside the string area.
    bytes[4096 + 8..4096 + 12].copy_from_slice(&1u32.to_le_bytes());
    let t_off = u64::from_le_bytes(bytes[4096 + 48..4096 + 56].try_into().unwrap()) as usize;
    bytes[4096 + t_off..4096 + t_off + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&p, &bytes).unwrap();
    assert!(matches!(
        open(),
        Err(Error::TensorSet(TensorSetError::BadManifest { .. }))
    ));
}

trait FifoLike {
    fn is_fifo_like(&self) -> bool;
}

impl FifoLike for std::fs::FileType {
    fn is_fifo_like(&self) -> bool {
        use std::os::unix::fs::FileTypeExt;
        self.is_fifo()
    }
}

/// Host sets live in shared memory, which outlives the writer by itself: nothing to hold, and no
/// holders segment is made.
#[test]
fn host_sets_are_not_holdable() {
    let name = format!("ts-hold-host-{}", std::process::id());
    let specs = [TensorSpec::new("w", DType::F32, &[4])];
    let w = TensorSetWriter::create_host(&name, &specs, &TensorSetOptions::new()).unwrap();
    let e = cuda_ipc::tensorset::Holder::open(&name).unwrap_err();
    assert!(
        matches!(&e, Error::TensorSet(TensorSetError::NotHoldable { .. })),
        "{e}"
    );
    let e = TensorSetReader::open_host(&name, &ReaderOptions::new().serve(true)).unwrap_err();
    assert!(
        matches!(&e, Error::TensorSet(TensorSetError::NotHoldable { .. })),
        "{e}"
    );
    let holders = format!("{}{name}", cuda_ipc::tensorset::HOLDERS_PREFIX);
    assert!(
        cuda_ipc::raw::shm::Segment::stat(&holders).is_err(),
        "a host set has no holders segment"
    );
    let snap = cuda_ipc::tensorset::inspect::inspect(&name).unwrap();
    assert!(snap.holders.is_empty() && snap.whole_generation.is_none());
    drop(w);
}

/// A live set's manifest whose header stamp word was overwritten (neither 0 nor the stamp) is
/// refused at once as a bad segment naming the stamp, not waited for as a creation in progress;
/// the word put back, it opens again. A set name too long says it is the set's name.
#[test]
fn a_damaged_stamp_is_refused_at_once_and_names_are_the_sets() {
    use std::os::unix::fs::FileExt;
    let name = set_name("stamp");
    let w = TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path("cuda-ipc.ts.", &name))
        .unwrap();
    // The header: magic (8 bytes), version (4), then the stamp word (4).
    let mut stamp = [0u8; 4];
    file.read_exact_at(&mut stamp, 12).unwrap();
    file.write_all_at(&0xdead_beef_u32.to_le_bytes(), 12)
        .unwrap();
    let t = Instant::now();
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new());
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "waited {:?}",
        t.elapsed()
    );
    match r {
        Err(Error::TensorSet(e @ TensorSetError::BadManifest { .. })) => {
            assert!(e.to_string().contains("stamp"), "{e}");
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    file.write_all_at(&stamp, 12).unwrap();
    drop(TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap());
    drop(w);

    let long = "s".repeat(200);
    let e = TensorSetWriter::create_host(&long, &specs(), &TensorSetOptions::new()).unwrap_err();
    assert!(e.to_string().contains("tensor-set name"), "{e}");
}

/// A live writer's manifest or host data segment whose init stamp was zeroed (alone, or with the
/// layout version beside it) is a bad segment naming the file and the stamp after the opener's
/// wait, not a creation "being made by another process": a creation stamps its header within
/// milliseconds of recording its writer, and this one records a writer that runs. The words put
/// back, the set opens again.
#[test]
fn a_zeroed_stamp_under_a_live_writer_is_a_bad_segment_not_a_creation_in_progress() {
    use std::os::unix::fs::FileExt;
    if role().is_some() {
        return;
    }
    let name = set_name("zeroed");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).unwrap();
    write_gen(&mut w);
    // The header: magic (8 bytes), version (4), then the stamp word (4). Version 17 and stamp 0
    // as one word at 8.
    for (prefix, at, word) in [
        ("cuda-ipc.ts.", 12, vec![0u8; 4]),
        ("cuda-ipc.td.", 12, vec![0u8; 4]),
        ("cuda-ipc.ts.", 8, 17u64.to_le_bytes().to_vec()),
    ] {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path(prefix, &name))
            .unwrap();
        let mut was = vec![0u8; word.len()];
        file.read_exact_at(&mut was, at).unwrap();
        file.write_all_at(&word, at).unwrap();
        let r = TensorSetReader::open_auto(&name, &ReaderOptions::new());
        file.write_all_at(&was, at).unwrap();
        match r {
            Err(Error::TensorSet(e @ TensorSetError::BadManifest { .. })) => {
                let e = e.to_string();
                assert!(e.contains(&format!("{prefix}{name}")), "{e}");
                assert!(e.contains("init stamp") && e.contains("overwritten"), "{e}");
            }
            other => panic!("{prefix} at {at}: {:?}", other.map(|_| ())),
        }
        drop(TensorSetReader::open_auto(&name, &ReaderOptions::new()).unwrap());
    }
    drop(w);
}

/// A real creation stays a creation in progress: a manifest whose writer records itself late in
/// a reader's 2 s wait (less than 500 ms before its end) and has not stamped by then is "being
/// created by another process", not an overwritten header, by the one rule that makes a zeroed
/// stamp under a writer recorded long before a bad segment (the test above).
#[test]
fn a_writer_recording_itself_late_in_the_wait_is_still_a_creation_in_progress() {
    use std::os::unix::fs::FileExt;
    if role().is_some() {
        return;
    }
    let live = set_name("recorded-live");
    let w = TensorSetWriter::create_host(&live, &specs(), &TensorSetOptions::new()).unwrap();
    // The header: magic (8 bytes), version (4), stamp (4), generation (8), then the writer's
    // pid (4), stored last of its identity.
    const STAMP_AT: usize = 12;
    const PID_AT: usize = 24;
    let mut bytes = std::fs::read(path("cuda-ipc.ts.", &live)).unwrap();
    bytes[STAMP_AT..STAMP_AT + 4].fill(0);
    let pid = bytes[PID_AT..PID_AT + 4].to_vec();
    bytes[PID_AT..PID_AT + 4].fill(0);
    let n = set_name("recorded-late");
    let _g = common::Unlink(format!("cuda-ipc.ts.{n}"));
    // Planted just after a second began, so that its `st_ctime` does not come of age (2 by its
    // whole seconds, when a manifest that records no writer is abandoned) before the writer
    // records itself, 1.7 s into the wait.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    std::thread::sleep(Duration::from_nanos(
        1_000_000_000 - u64::from(now.subsec_nanos()) + 50_000_000,
    ));
    let file = common::plant(path("cuda-ipc.ts.", &n), &bytes);
    let recorder = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1700));
        file.write_all_at(&pid, PID_AT as u64).unwrap();
    });
    let r = TensorSetReader::open_host(&n, &ReaderOptions::new());
    recorder.join().unwrap();
    match r {
        Err(Error::TensorSet(TensorSetError::CreationInProgress(name))) => assert_eq!(name, n),
        other => panic!("{:?}", other.map(|_| ())),
    }
    drop(w);
}

/// A host set's manifest whose memory kind was overwritten with a GPU kind is a bad segment
/// naming the manifest and the allocation whose token does not decode (a host set's allocation
/// table holds no tokens), not a bare "invalid token", whichever open reads it.
#[test]
fn a_gpu_kind_over_a_host_sets_tokens_is_a_bad_manifest_naming_the_allocation() {
    use std::os::unix::fs::FileExt;
    if role().is_some() {
        return;
    }
    let name = set_name("kind");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).unwrap();
    write_gen(&mut w);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path("cuda-ipc.ts.", &name))
        .unwrap();
    // The body's first word, after the 4096-byte header page: the memory kind (1: host).
    const KIND_AT: u64 = 4096;
    for kind in 2u32..=4 {
        file.write_all_at(&kind.to_le_bytes(), KIND_AT).unwrap();
        let opens = [
            TensorSetReader::open_auto(&name, &ReaderOptions::new()),
            TensorSetReader::open_host(&name, &ReaderOptions::new()),
        ];
        for r in opens {
            match r {
                Err(Error::TensorSet(e @ TensorSetError::BadManifest { .. })) => {
                    let e = e.to_string();
                    assert!(e.contains(&format!("cuda-ipc.ts.{name}")), "{e}");
                    assert!(
                        e.contains("token of buffer 0, allocation 0: invalid token: bad magic"),
                        "{e}"
                    );
                }
                other => panic!("kind {kind}: {:?}", other.map(|_| ())),
            }
        }
        let e = inspect::inspect(&name).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("allocation 0: invalid token"), "{e}");
    }
    file.write_all_at(&1u32.to_le_bytes(), KIND_AT).unwrap();
    drop(TensorSetReader::open_auto(&name, &ReaderOptions::new()).unwrap());
    drop(w);
}

/// A set `writer` child published and that was then killed: its manifest, generation channel and
/// host data stay behind.
fn dead_writers_set(name: &str) {
    let mut w = spawn("writer", name, "buffered");
    w.expect("published", ANSWER);
    kill9(w.child.id());
    let _ = w.child.wait();
}

/// What a neighbour plants under one part's name of a dead writer's set (anyone may make a file
/// in `/dev/shm`): a FIFO, another user's file (when run as root), or a live holders segment that
/// the set's manifest does not name (a host set has none). `gc` reports it or leaves it, never
/// removes or follows it, and removes the dead writer's other parts all the same (it kept them
/// all, saying only why it could not read the planted one).
#[test]
fn a_file_planted_under_one_part_keeps_no_other_part_of_a_dead_writers_set() {
    use cuda_ipc::raw::tensorset::testing::HeldSetFixture;
    use cuda_ipc::tensorset::HolderRole;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    if role().is_some() {
        return;
    }
    const PREFIXES: [&str; 4] = [
        "cuda-ipc.ts.",
        "cuda-ipc.tg.",
        "cuda-ipc.td.",
        "cuda-ipc.th.",
    ];
    let mut cases: Vec<(&str, &str)> = Vec::new();
    for p in PREFIXES {
        cases.push((p, "FIFO"));
        if rustix::process::geteuid().is_root() {
            cases.push((p, "another user's file"));
        }
    }
    cases.push(("cuda-ipc.th.", "live holders segment"));
    for (k, (prefix, kind)) in cases.into_iter().enumerate() {
        let name = set_name(&format!("planted{k}"));
        dead_writers_set(&name);
        let planted = path(prefix, &name);
        let _ = std::fs::remove_file(&planted);
        let mut fixture = None;
        match kind {
            "FIFO" => mkfifo(&planted),
            "another user's file" => {
                common::plant(&planted, &[0u8; 8192]);
                std::os::unix::fs::chown(&planted, Some(65534), Some(65534)).unwrap();
            }
            _ => {
                let f = HeldSetFixture::create_holders(&name, 2).unwrap();
                f.claim(HolderRole::Holder).unwrap();
                fixture = Some(f);
            }
        }
        let others: Vec<String> = PREFIXES
            .iter()
            .filter(|p| **p != prefix)
            .map(|p| path(p, &name))
            .filter(|p| std::fs::symlink_metadata(p).is_ok())
            .collect();
        assert_eq!(others.len(), if prefix == "cuda-ipc.th." { 3 } else { 2 });
        let t = Instant::now();
        let scope = Scope::only(vec![], vec![]).with_tensor_sets(vec![name.clone()]);
        let scan = cleanup::scan(&scope).unwrap();
        assert_eq!(
            scan.leftovers.len(),
            others.len(),
            "{kind} under {prefix}: {scan:?}"
        );
        for l in &scan.leftovers {
            assert_eq!(l.kind, LeftoverKind::TensorSet, "{l}");
            assert!(l.what.contains("of dead writer"), "{l}");
        }
        if fixture.is_none() {
            let seg = planted.trim_start_matches("/dev/shm/");
            assert!(
                scan.problems
                    .iter()
                    .any(|p| p.error.to_string().contains(seg)),
                "{kind} under {prefix} named: {:?}",
                scan.problems
            );
        }
        let r = cleanup::remove(&scan.leftovers);
        assert_eq!(
            r.removed.len(),
            others.len(),
            "{kind} under {prefix}: {r:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        for p in &others {
            assert!(std::fs::symlink_metadata(p).is_err(), "{p} left");
        }
        let m = std::fs::symlink_metadata(&planted).unwrap();
        match kind {
            "FIFO" => assert!(m.file_type().is_fifo()),
            "another user's file" => assert_eq!(m.uid(), 65534),
            _ => assert!(m.file_type().is_file()),
        }
        match fixture {
            Some(f) => f.unlink(),
            None => std::fs::remove_file(&planted).unwrap(),
        }
    }
}

/// A manifest, host data or holders segment of zeros (a writer killed between sizing it and
/// writing its header, or any file of zeros of this user's) is a creation abandoned half-way once
/// older than 2 s: a reader, `inspect` (`cuda-ipc ls`) and `gc` say so at once instead of waiting
/// 2 s for each look at it (`gc` of one such set took 20 s) and calling it a creation in
/// progress. A younger one is still waited for: its writer may be about to record itself.
#[test]
fn a_segment_of_zeros_is_an_abandoned_creation_told_without_waiting() {
    if role().is_some() {
        return;
    }
    let name = set_name("zeros");
    let parts = ["cuda-ipc.ts.", "cuda-ipc.td.", "cuda-ipc.th."];
    for p in parts {
        common::plant(path(p, &name), &[0u8; 16384]);
    }
    // Young: waited for while a writer may still record itself (until it is 2 s old by
    // `st_ctime`'s whole seconds: more than 1 s from now), then refused: abandoned once of that
    // age, or a creation in progress should the 2 s wait end first.
    let t = Instant::now();
    match TensorSetReader::open_host(&name, &ReaderOptions::new()) {
        Err(Error::TensorSet(TensorSetError::CreationInProgress(_))) => {}
        Err(Error::TensorSet(e @ TensorSetError::BadManifest { .. }))
            if e.to_string().contains("abandoned") => {}
        other => panic!("a young manifest of zeros: {:?}", other.map(|_| ())),
    }
    assert!(
        t.elapsed() >= Duration::from_millis(900) && t.elapsed() < Duration::from_millis(2500),
        "{:?}",
        t.elapsed()
    );
    // `st_ctime` counts whole seconds: more than 2 s by its count.
    std::thread::sleep(Duration::from_millis(3100) - t.elapsed().min(Duration::from_secs(3)));
    let t = Instant::now();
    for e in [
        TensorSetReader::open_host(&name, &ReaderOptions::new()).map(|_| ()),
        inspect::inspect(&name).map(|_| ()),
    ] {
        match e {
            Err(Error::TensorSet(e @ TensorSetError::BadManifest { .. })) => {
                assert!(e.to_string().contains("abandoned"), "{e}")
            }
            other => panic!("an old manifest of zeros: {other:?}"),
        }
    }
    let scope = Scope::only(vec![], vec![]).with_tensor_sets(vec![name.clone()]);
    let scan = cleanup::scan(&scope).unwrap();
    assert_eq!(scan.leftovers.len(), parts.len(), "{scan:?}");
    assert!(
        scan.leftovers
            .iter()
            .all(|l| l.kind == LeftoverKind::TensorSetCreation),
        "{:?}",
        scan.leftovers
    );
    let r = cleanup::remove(&scan.leftovers);
    assert_eq!(r.removed.len(), parts.len(), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    for p in parts {
        assert!(std::fs::symlink_metadata(path(p, &name)).is_err());
    }
}

/// A set's own host data segment cut short of its buffers (`truncate`) is refused as too small,
/// naming both sizes, before anything is read: not "another creation than the manifest names",
/// which sent a reader looking for a writer that made the set again.
#[test]
fn a_host_data_segment_cut_short_is_too_small_not_another_creation() {
    if role().is_some() {
        return;
    }
    let name = set_name("cut");
    dead_writers_set(&name);
    let data = path("cuda-ipc.td.", &name);
    let len = std::fs::metadata(&data).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&data).unwrap();
    f.set_len(len - 4096).unwrap();
    match TensorSetReader::open_host(&name, &ReaderOptions::new()) {
        Err(Error::Shm(ShmError::TooSmall { len: l, min, .. })) => {
            assert_eq!((l, min), (len - 4096, len))
        }
        other => panic!("a cut data segment: {:?}", other.map(|_| ())),
    }
    let scope = Scope::only(vec![], vec![]).with_tensor_sets(vec![name.clone()]);
    let scan = cleanup::scan(&scope).unwrap();
    assert_eq!(cleanup::remove(&scan.leftovers).removed.len(), 3);
}

/// A manifest whose generation base (body bytes 160..168, outside the layout fingerprint) was
/// overwritten by a neighbour of this user: a reader opened on it never hands out a generation
/// no newer than the one it was asked to pass (`wait_newer(than)` took generation 1 for `than`
/// near `u64::MAX` before); it says the base is wrong, and keeps no hold that stops the writer.
#[test]
fn a_forged_generation_base_never_hands_out_an_older_generation_as_newer() {
    use std::os::unix::fs::FileExt;
    let name = set_name("base");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).unwrap();
    assert_eq!(write_gen(&mut w), 1);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path("cuda-ipc.ts.", &name))
        .unwrap();
    let at = 4096 + 160; // the header page, then the body's generation base
    let mut base = [0u8; 8];
    file.read_exact_at(&mut base, at).unwrap();
    assert_eq!(u64::from_le_bytes(base), 0, "a first writer's base");
    file.write_all_at(&u64::MAX.to_le_bytes(), at).unwrap();
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    for than in [u64::MAX - 1, 5, 1] {
        match r.wait_newer(than, Some(Duration::from_millis(200))) {
            Err(Error::TensorSet(e @ TensorSetError::BadManifest { .. })) => {
                assert!(e.to_string().contains("generation base"), "{e}");
            }
            other => panic!("than {than}: {:?}", other.map(|h| h.generation())),
        }
    }
    // No hold was kept: the in-place writer's next update goes through at once.
    let u = w.begin(Some(Duration::from_millis(500))).expect("begin");
    u.commit().unwrap();
    drop(r);
    file.write_all_at(&base, at).unwrap();
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    assert_eq!(r.wait_newer(1, Some(ANSWER)).unwrap().generation(), 2);
    assert!(matches!(
        r.wait_newer(2, Some(Duration::from_millis(100))),
        Err(Error::Timeout { .. })
    ));
    drop(r);
    drop(w);
}

#[test]
fn a_generation_channel_gone_under_an_open_is_the_writers_close_or_death_never_pid_0() {
    if role().is_some() {
        return;
    }
    use cuda_ipc::tensorset::GENERATION_PREFIX;
    // The instant of a close (or a `gc`) between an open's manifest and its join: the manifest is
    // there, the generation channel is not.
    let name = set_name("tg-gone");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).unwrap();
    write_gen(&mut w);
    std::fs::remove_file(path(GENERATION_PREFIX, &name)).unwrap();
    let e = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap_err();
    assert!(
        matches!(&e, Error::TensorSet(TensorSetError::Closed(n)) if *n == name),
        "a running writer's set: {e:?}"
    );
    drop(w);
    let e = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap_err();
    assert!(
        matches!(&e, Error::TensorSet(TensorSetError::NotFound(_))),
        "closed: {e:?}"
    );

    let name = set_name("tg-gone-dead");
    let mut w = spawn("writer", &name, "buffered");
    w.expect("published", ANSWER);
    let pid = w.child.id();
    kill9(pid);
    let _ = w.child.wait();
    std::fs::remove_file(path(GENERATION_PREFIX, &name)).unwrap();
    let e = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap_err();
    assert!(
        matches!(&e, Error::TensorSet(TensorSetError::WriterGone { pid: p, .. }) if *p == pid),
        "a dead writer's set: {e:?}"
    );
    assert!(e.to_string().contains(&format!("pid {pid}")), "{e}");
    // gc removes the dead writer's other parts.
    let scope = Scope::only(vec![], vec![]).with_tensor_sets(vec![name.clone()]);
    let scan = cleanup::scan(&scope).unwrap();
    let removal = cleanup::remove(&scan.leftovers);
    assert_eq!(removal.removed.len(), 2, "{removal:?}");
    for prefix in ["cuda-ipc.ts.", "cuda-ipc.td."] {
        assert!(
            std::fs::symlink_metadata(path(prefix, &name)).is_err(),
            "{prefix}"
        );
    }
}

/// Removes a name in `/dev/shm` (a file, a FIFO or an empty directory) when dropped, whatever the
/// test left.
struct Remove(String);

impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Every part of a set standing without its manifest (generation channel, host data, holders) is
/// judged by one rule, whatever its kind: empty (a creator killed before sizing it) or sparse
/// (before reserving its pages), younger than 2 s it is a creation that may be under way, kept
/// and no problem (`gc`'s scan lists nothing and reports nothing; `ls` keeps it "for now"); once
/// 2 s old it is a creation abandoned half-way, which `gc` removes. An empty generation channel
/// or holders segment was "cannot judge" while young (and `gc` failed on the holders segment),
/// where an empty host data segment was kept. What is not ours to judge stays, young or old and
/// of any kind: a file open to other users (mode 0644), a FIFO and a directory are reported;
/// (run as root) another user's empty file, the only part of a set of that name, is passed over
/// into `Scan::skipped` as a scan of every set passes over it, no problem; none is removed.
#[test]
fn every_part_without_its_manifest_is_judged_by_one_rule_of_age_and_ownership() {
    use cuda_ipc::tensorset::reclaim::{Judgement, Part, parts_without_manifest};
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if role().is_some() {
        return;
    }
    let parts = [
        ("cuda-ipc.tg.", Part::Generation),
        ("cuda-ipc.td.", Part::Data),
        ("cuda-ipc.th.", Part::Holders),
    ];
    let mut kinds = vec!["empty", "sparse", "mode", "fifo", "dir"];
    let root = rustix::process::geteuid().is_root();
    if root {
        kinds.push("other");
    }
    let ours = |kind: &str| matches!(kind, "empty" | "sparse");
    // (set, prefix, part, kind) of every file planted.
    let mut planted = Vec::new();
    let mut _guards = Vec::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    // At a second's start: `st_ctime` counts whole seconds, so the files stay younger than 2 s by
    // its count for almost 2 s.
    std::thread::sleep(Duration::from_nanos(
        1_000_000_000 - u64::from(now.subsec_nanos()) + 20_000_000,
    ));
    let at = Instant::now();
    for (k, (prefix, part)) in parts.iter().enumerate() {
        for kind in &kinds {
            let set = set_name(&format!("onerule{k}-{kind}"));
            let p = path(prefix, &set);
            _guards.push(Remove(p.clone()));
            match *kind {
                "empty" => drop(common::plant(&p, &[])),
                "sparse" => common::plant(&p, &[]).set_len(16384).unwrap(),
                "mode" => {
                    drop(common::plant(&p, &[]));
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
                }
                "fifo" => mkfifo(&p),
                "dir" => std::fs::create_dir(&p).unwrap(),
                _ => {
                    drop(common::plant(&p, &[]));
                    std::os::unix::fs::chown(&p, Some(65534), Some(65534)).unwrap();
                }
            }
            planted.push((set, *prefix, *part, *kind));
        }
    }
    let sets: Vec<String> = planted.iter().map(|(s, ..)| s.clone()).collect();
    let scope = Scope::only(vec![], vec![]).with_tensor_sets(sets.clone());
    let named = |subject: &str, set: &str| subject == format!("tensorset {set}");

    // Young: ours kept as creations under way, the rest reported; nothing listed for removal.
    let judged: Vec<_> = planted
        .iter()
        .map(|(set, ..)| parts_without_manifest(set).unwrap())
        .collect();
    let scan = cleanup::scan(&scope).unwrap();
    if at.elapsed() < Duration::from_millis(1800) {
        for ((set, prefix, part, kind), judged) in planted.iter().zip(&judged) {
            assert_eq!(judged.len(), 1, "{kind} under {prefix}: {judged:?}");
            let j = &judged[0];
            assert_eq!(j.part, *part, "{kind} under {prefix}");
            if ours(kind) {
                assert!(j.young, "{kind} under {prefix}: {j:?}");
                let kept_young = |why: &str| why.starts_with("younger than 2 s");
                assert!(
                    matches!(&j.judgement, Judgement::Kept(why) if kept_young(why)),
                    "a young {kind} part under {prefix}: {j:?}"
                );
                assert!(
                    !scan.problems.iter().any(|p| named(&p.subject, set)),
                    "a young {kind} part under {prefix} is no problem: {:?}",
                    scan.problems
                );
            } else {
                assert!(
                    matches!(j.judgement, Judgement::Unjudged(_)),
                    "{kind} under {prefix}: {j:?}"
                );
            }
        }
        assert!(scan.leftovers.is_empty(), "{:?}", scan.leftovers);
    } else {
        println!("young checks skipped: the machine took more than 1.8 s");
    }

    // Old (2 s by `st_ctime`'s whole seconds): ours abandoned creations, removed; the rest stays.
    std::thread::sleep(Duration::from_millis(3100).saturating_sub(at.elapsed()));
    let scan = cleanup::scan(&scope).unwrap();
    for (set, prefix, part, kind) in &planted {
        let judged = parts_without_manifest(set).unwrap();
        assert_eq!(judged.len(), 1, "{kind} under {prefix}: {judged:?}");
        let j = &judged[0];
        assert!(!j.young, "{kind} under {prefix}: {j:?}");
        let listed: Vec<_> = scan.leftovers.iter().filter(|l| l.object == *set).collect();
        let reported = scan.problems.iter().any(|p| named(&p.subject, set));
        if ours(kind) {
            match &j.judgement {
                Judgement::Stale(s) => {
                    assert_eq!((s.part, s.writer), (*part, None), "{kind} under {prefix}");
                    assert_eq!(
                        s.why, "a creation abandoned before its pages were reserved",
                        "{kind} under {prefix}"
                    );
                }
                other => panic!("an old {kind} part under {prefix}: {other:?}"),
            }
            assert_eq!(listed.len(), 1, "{kind} under {prefix}: {listed:?}");
            assert_eq!(listed[0].kind, LeftoverKind::TensorSetCreation);
            assert!(!reported, "{kind} under {prefix}: {:?}", scan.problems);
        } else {
            assert!(
                matches!(j.judgement, Judgement::Unjudged(_)),
                "{kind} under {prefix}: {j:?}"
            );
            assert!(listed.is_empty(), "{kind} under {prefix}: {listed:?}");
            let name = format!("{prefix}{set}");
            let skipped = scan.skipped.iter().find(|s| s.name == name);
            if *kind == "other" {
                // Another user's set (its only part theirs): theirs to clean, no problem.
                assert!(!reported, "{kind} under {prefix}: {:?}", scan.problems);
                let s = skipped.unwrap_or_else(|| panic!("{name}: {:?}", scan.skipped));
                assert_eq!((s.uid, s.what), (65534, "tensor set part"), "{s:?}");
            } else {
                assert!(reported, "{kind} under {prefix}: {:?}", scan.problems);
                assert!(skipped.is_none(), "{kind} under {prefix}: {skipped:?}");
            }
        }
    }
    let r = cleanup::remove(&scan.leftovers);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(
        r.removed.len(),
        planted.iter().filter(|(.., k)| ours(k)).count(),
        "{r:?}"
    );
    for (set, prefix, _, kind) in &planted {
        let m = std::fs::symlink_metadata(path(prefix, set));
        if ours(kind) {
            assert!(m.is_err(), "an abandoned {kind} part under {prefix} stays");
        } else {
            let m = m.unwrap_or_else(|e| panic!("{kind} under {prefix} removed: {e}"));
            match *kind {
                "mode" => assert_eq!(m.mode() & 0o777, 0o644),
                "fifo" => assert!(std::os::unix::fs::FileTypeExt::is_fifo(&m.file_type())),
                "dir" => assert!(m.is_dir()),
                _ => assert_eq!(m.uid(), 65534),
            }
        }
    }
}

#[test]
fn in_place_readers_whose_holds_overlap_without_pause_do_not_starve_the_writer() {
    if role().is_some() {
        return;
    }
    // Two readers, each shared by three threads whose holds overlap (a server's requests): some
    // hold is always there. `begin` reserves the buffer (no new hold from then on) and gets it
    // once the holds there end; every hold reads one whole generation.
    let name = set_name("overlap");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts("inplace")).unwrap();
    write_gen(&mut w);
    let n = w.layout().tensors().len();
    let readers: Vec<TensorSetReader> = (0..2)
        .map(|_| TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap())
        .collect();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let last = 20;
    /// Stops the reading threads however the writer's loop ends (a failed check included, so
    /// that the scope's join does not wait for them forever).
    struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        let stopping = Stop(&stop);
        let threads: Vec<_> = (0..6)
            .map(|k| {
                let (r, stop) = (&readers[k % 2], &stop);
                s.spawn(move || {
                    std::thread::sleep(Duration::from_micros(300 * k as u64));
                    let (mut holds, mut newest) = (0u64, 0u64);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let held = match r.wait_newer(0, Some(Duration::from_millis(200))) {
                            Ok(h) => h,
                            Err(Error::Timeout { .. }) => continue,
                            Err(e) => panic!("take: {e}"),
                        };
                        assert!(held.generation() >= newest, "went back a generation");
                        newest = held.generation();
                        check_gen(&held, n);
                        std::thread::sleep(Duration::from_millis(2));
                        check_gen(&held, n);
                        holds += 1;
                    }
                    (holds, newest)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        for g in 2..=last {
            let t = Instant::now();
            assert_eq!(write_gen(&mut w), g);
            assert!(
                t.elapsed() < Duration::from_secs(2),
                "generation {g} took {:?} against readers that hold without pause",
                t.elapsed()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(50));
        drop(stopping);
        for t in threads {
            let (holds, newest) = t.join().unwrap();
            assert!(
                holds > 0 && newest == last,
                "{holds} holds, newest {newest}"
            );
        }
    });
    // A begin that timed out against a hold gives the generation back: a fresh take gets it.
    let held = readers[0].current().unwrap().expect("generation");
    match w.begin(Some(Duration::from_millis(100))) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("begin while held: {other:?}"),
    }
    let again = readers[1]
        .current()
        .unwrap()
        .expect("the generation, given back");
    assert_eq!(again.generation(), last);
    check_gen(&again, n);
    drop((held, again));
    assert_eq!(write_gen(&mut w), last + 1);
    drop(readers);
    w.close(ANSWER).unwrap();
}

/// What one reading thread of `close_grants_no_hold_and_waits_only_for_the_holds_before_it`
/// saw: holds granted, those whose take began with the set's names already gone, and the error
/// its loop ended with.
struct Reading {
    holds: u64,
    after_close: u64,
    ended: Option<Error>,
}

fn close_grants_no_hold_and_waits_only_for_the_holds_before_it(mode: &str) {
    // Two readers, each shared by two threads whose 20 ms holds overlap: some hold is always
    // there. The close's first visible step removes the names; a take that begins once the
    // manifest is gone must not be granted, and the close returns as soon as the holds taken
    // before it end, far below its timeout.
    let name = set_name(&format!("close-{mode}"));
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts(mode)).unwrap();
    write_gen(&mut w);
    write_gen(&mut w);
    let n = w.layout().tensors().len();
    let manifest = path("cuda-ipc.ts.", &name);
    let readers: Vec<TensorSetReader> = (0..2)
        .map(|_| TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap())
        .collect();
    let timeout = Duration::from_secs(6);
    let (took, readings) = std::thread::scope(|s| {
        let threads: Vec<_> = (0..4)
            .map(|k| {
                let (r, manifest) = (&readers[k % 2], &manifest);
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(5 * k as u64));
                    let mut seen = Reading {
                        holds: 0,
                        after_close: 0,
                        ended: None,
                    };
                    let start = Instant::now();
                    while start.elapsed() < ANSWER {
                        let closing = std::fs::symlink_metadata(manifest).is_err();
                        // `current` and `wait_newer` in turns: both take a hold.
                        let got = if seen.holds.is_multiple_of(2) {
                            r.current()
                        } else {
                            r.wait_newer(0, Some(Duration::ZERO)).map(Some)
                        };
                        let held = match got {
                            Ok(Some(h)) => h,
                            Ok(None) | Err(Error::Timeout { .. }) => {
                                std::thread::sleep(Duration::from_millis(1));
                                continue;
                            }
                            Err(e) => {
                                seen.ended = Some(e);
                                break;
                            }
                        };
                        seen.holds += 1;
                        seen.after_close += u64::from(closing);
                        check_gen(&held, n);
                        std::thread::sleep(Duration::from_millis(20));
                        check_gen(&held, n);
                    }
                    seen
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(150));
        let t = Instant::now();
        w.close(timeout).unwrap();
        let took = t.elapsed();
        let readings: Vec<Reading> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        (took, readings)
    });
    for (k, r) in readings.iter().enumerate() {
        assert!(r.holds > 0, "thread {k} took no hold before the close");
        assert_eq!(
            r.after_close, 0,
            "thread {k} was granted {} holds after the close began",
            r.after_close
        );
        assert!(
            matches!(
                r.ended,
                Some(Error::TensorSet(TensorSetError::Closed(ref s))) if *s == name
            ),
            "thread {k} ended with {:?}",
            r.ended
        );
    }
    assert!(
        took < Duration::from_secs(2),
        "close took {took:?} (timeout {timeout:?}) against holds of 20 ms"
    );
    // After the close every take says so.
    for r in &readers {
        assert!(matches!(
            r.current(),
            Err(Error::TensorSet(TensorSetError::Closed(_)))
        ));
        assert!(matches!(
            r.wait_newer(0, Some(Duration::from_millis(50))),
            Err(Error::TensorSet(TensorSetError::Closed(_)))
        ));
    }
}

#[test]
fn in_place_close_grants_no_new_hold_and_waits_only_for_the_holds_before_it() {
    if role().is_some() {
        return;
    }
    close_grants_no_hold_and_waits_only_for_the_holds_before_it("inplace");
}

#[test]
fn buffered_close_grants_no_new_hold_and_waits_only_for_the_holds_before_it() {
    if role().is_some() {
        return;
    }
    close_grants_no_hold_and_waits_only_for_the_holds_before_it("buffered");
}

/// `wait_readers`: a writer about to close lets its readers take the last generation first. A
/// reader that has not taken it keeps the wait until its timeout (`false`); once it took it the
/// wait returns `true`; a reader waiting in `wait_newer` when the writer commits and then waits
/// gets the generation, where a close right after the commit would have given it `Closed`; a
/// reader that died holds nothing up; a reader opened after the commit starts at it.
#[test]
fn wait_readers_lets_readers_take_the_last_generation_before_the_close() {
    if role().is_some() {
        return;
    }
    let name = set_name("waitreaders");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts("inplace")).unwrap();
    write_gen(&mut w);
    let a = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let b = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    // Opened after generation 1's commit: they start at it.
    assert!(w.wait_readers(Some(Duration::ZERO)).unwrap());
    write_gen(&mut w);
    // Neither took generation 2.
    let t = Instant::now();
    assert!(!w.wait_readers(Some(Duration::from_millis(100))).unwrap());
    assert!(t.elapsed() >= Duration::from_millis(100));
    drop(a.current().unwrap().expect("generation 2"));
    assert!(
        !w.wait_readers(Some(Duration::ZERO)).unwrap(),
        "b has not taken it"
    );
    // b waits in another thread for a generation after 2; the writer commits 3 and waits for
    // its readers: b gets generation 3 before the close.
    let got = std::thread::scope(|s| {
        let waiting = s.spawn(|| b.wait_newer(2, Some(ANSWER)).map(|h| h.generation()));
        std::thread::sleep(Duration::from_millis(50));
        write_gen(&mut w);
        drop(a.current().unwrap().expect("generation 3"));
        assert!(w.wait_readers(Some(ANSWER)).unwrap());
        waiting.join().unwrap()
    });
    assert_eq!(got.unwrap(), 3);
    drop((a, b));
    // A reader that died (its slot left attached) holds nothing up.
    let mut c = Peer::spawn(
        "waitreaders_reader_role",
        "waitreaders-reader",
        &[(SET, name.as_str())],
    );
    c.expect("opened", ANSWER);
    write_gen(&mut w);
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    let t = Instant::now();
    assert!(w.wait_readers(Some(ANSWER)).unwrap());
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    w.close(Duration::from_secs(5)).unwrap();
    assert!(matches!(
        TensorSetReader::open_host(&name, &ReaderOptions::new()),
        Err(Error::TensorSet(TensorSetError::NotFound(_)))
    ));
}

#[test]
fn waitreaders_reader_role() {
    if role().as_deref() != Some("waitreaders-reader") {
        return;
    }
    let name = std::env::var(SET).unwrap();
    let _r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    tell("opened");
    std::thread::sleep(Duration::from_secs(60));
}

/// A `Closer` takes the generations from readers from another thread while the writer is busy
/// (a binding's close during another thread's `begin`): no hold is granted after it, the hold
/// taken before stays readable, and the writer's own close then finds the step done.
#[test]
fn a_closer_takes_the_generations_from_readers_while_the_writer_is_busy() {
    if role().is_some() {
        return;
    }
    let name = set_name("closer");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts("buffered")).unwrap();
    write_gen(&mut w);
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let held = r.current().unwrap().expect("generation 1");
    let closer = w.closer();
    std::thread::scope(|s| s.spawn(|| closer.withdraw()).join().unwrap());
    assert!(matches!(
        r.current(),
        Err(Error::TensorSet(TensorSetError::Closed(_)))
    ));
    check_gen(&held, specs().len());
    closer.withdraw(); // once, however often
    drop(held);
    let t = Instant::now();
    w.close(Duration::from_secs(5)).unwrap();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    closer.withdraw(); // after the close: nothing
}

/// After a [`cuda_ipc::tensorset::Closer`] withdrew the generations (from another thread, while
/// the writer was busy), the writer publishes nothing: an update open at the withdrawal commits
/// nothing, a `begin` waiting for readers' holds ends at once, later `begin`s and `wait_readers`
/// say `Closed` without waiting, and no reader is granted a hold again.
fn a_closer_leaves_the_writer_nothing_to_publish(mode: &str) {
    let name = set_name(&format!("closer-busy-{mode}"));
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts(mode)).unwrap();
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let closed = |e: &Error| matches!(e, Error::TensorSet(TensorSetError::Closed(s)) if *s == name);
    let taken = |r: &TensorSetReader| r.current().map(|h| h.map(|h| h.generation()));
    // An update open when the withdrawal comes.
    write_gen(&mut w);
    let closer = w.closer();
    let u = w.begin(Some(ANSWER)).unwrap();
    std::thread::scope(|s| s.spawn(|| closer.withdraw()).join().unwrap());
    let e = u.commit().expect_err("a commit after the withdrawal");
    assert!(closed(&e), "the commit after the withdrawal: {e:?}");
    match taken(&r) {
        Err(ref e) if closed(e) => {}
        got => panic!("a take after the withdrawal and the commit: {got:?}"),
    }
    let t = Instant::now();
    match w.begin(Some(Duration::from_secs(5))) {
        Err(ref e) if closed(e) => {}
        got => panic!(
            "a begin after the withdrawal: {:?}",
            got.map(|u| u.generation())
        ),
    }
    match w.wait_readers(Some(Duration::from_secs(5))) {
        Err(ref e) if closed(e) => {}
        got => panic!("wait_readers after the withdrawal: {got:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    w.close(Duration::from_secs(5)).unwrap();

    // A begin waiting for the readers' holds when the withdrawal comes.
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts(mode)).unwrap();
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let mut held = Vec::new();
    for _ in 0..w.buffers() {
        write_gen(&mut w);
        held.push(r.current().unwrap().expect("the generation just committed"));
    }
    let closer = w.closer();
    let t = Instant::now();
    let got = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            closer.withdraw();
        });
        w.begin(Some(Duration::from_secs(10)))
            .map(|u| u.generation())
    });
    match got {
        Err(ref e) if closed(e) => {}
        got => panic!("a begin waiting when the withdrawal came: {got:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    for h in &held {
        check_gen(h, specs().len());
    }
    drop(held);
    w.close(Duration::from_secs(5)).unwrap();
}

#[test]
fn in_place_a_closer_leaves_the_writer_nothing_to_publish() {
    if role().is_some() {
        return;
    }
    a_closer_leaves_the_writer_nothing_to_publish("inplace");
}

#[test]
fn buffered_a_closer_leaves_the_writer_nothing_to_publish() {
    if role().is_some() {
        return;
    }
    a_closer_leaves_the_writer_nothing_to_publish("buffered");
}

#[test]
fn copy_ranges_outside_their_allocation_are_refused_in_every_mode_and_before_the_first_commit() {
    if role().is_some() {
        return;
    }
    for mode in ["inplace", "buffered"] {
        let name = set_name(&format!("ranges-{mode}"));
        let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts(mode)).unwrap();
        let len = w.layout().bytes_per_buffer();
        let bad = [(1, 0, 1), (0, u64::MAX, 2), (0, 0, len + 1), (0, len, 1)];
        for first in [true, false] {
            let mut u = w.begin(Some(ANSWER)).unwrap();
            for r in bad {
                match u.copy_ranges_from_previous(&[(0, 0, 8), r]) {
                    Err(Error::InvalidArgument(why)) => {
                        assert!(why.contains("allocation"), "{mode} {r:?}: {why}")
                    }
                    got => panic!("{mode}, first update {first}: range {r:?} gave {got:?}"),
                }
            }
            u.copy_ranges_from_previous(&[(0, 0, len), (0, len, 0)])
                .unwrap();
            u.commit().unwrap();
        }
        w.close(Duration::from_secs(5)).unwrap();
    }
}

/// `close` says how many holds it forced at its timeout: one that a reader kept past it, none
/// when every hold ended in time.
#[test]
fn close_reports_the_holds_it_forced() {
    for mode in ["in_place", "buffered"] {
        let name = set_name(&format!("forced-{mode}"));
        let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts(mode)).unwrap();
        let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
        write_gen(&mut w);
        let held = r.current().unwrap().expect("the first generation");
        let report = w.close(Duration::from_millis(100)).unwrap();
        assert_eq!(
            report.forced_holds, 1,
            "{mode}: the hold kept past the timeout"
        );
        drop(held);
        drop(r);

        let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts(mode)).unwrap();
        let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
        write_gen(&mut w);
        drop(r.current().unwrap().expect("the first generation"));
        let report = w.close(ANSWER).unwrap();
        assert_eq!(report.forced_holds, 0, "{mode}: every hold ended in time");
    }
}

/// A buffered set's `current` never says "nothing" once a generation is out, however fast the
/// writer commits: the newest generation's buffer is never the one rewritten, so a take that
/// finds the generation it looked for replaced looks again at the newer one.
#[test]
fn a_buffered_sets_current_finds_a_generation_while_the_writer_commits_back_to_back() {
    for buffers in [2, 3] {
        let name = set_name(&format!("current-{buffers}"));
        let opts = TensorSetOptions::new().mode(GenerationMode::Buffered(buffers));
        let mut w = TensorSetWriter::create_host(&name, &specs(), &opts).unwrap();
        write_gen(&mut w);
        let readers: Vec<_> = (0..4)
            .map(|_| TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap())
            .collect();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let nones = std::thread::scope(|s| {
            let writer = s.spawn(|| {
                let t = Instant::now();
                while t.elapsed() < Duration::from_millis(1500) {
                    write_gen(&mut w);
                }
                stop.store(true, std::sync::atomic::Ordering::SeqCst);
            });
            let counts: Vec<_> = readers
                .iter()
                .map(|r| {
                    let stop = &stop;
                    s.spawn(move || {
                        let (mut nones, mut holds) = (0u64, 0u64);
                        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                            match r.current().unwrap() {
                                Some(h) => {
                                    holds += 1;
                                    // Keep it a moment, as a reader reading it would.
                                    std::hint::black_box(h.generation());
                                    drop(h);
                                }
                                None => nones += 1,
                            }
                        }
                        assert!(holds > 0);
                        nones
                    })
                })
                .collect();
            writer.join().unwrap();
            counts.into_iter().map(|t| t.join().unwrap()).sum::<u64>()
        });
        assert_eq!(
            nones, 0,
            "{buffers} buffers: `current` said nothing {nones} times"
        );
        drop(readers);
        w.close(ANSWER).unwrap();
    }
}

/// A reader whose open finds the manifest but not the host data segment (the writer closed the
/// set, or another replaced it, in between) gets `NotFound`, the error an opener retries on,
/// not the segment's own "does not exist".
#[test]
fn an_open_that_finds_the_data_segment_gone_says_the_set_is_not_found() {
    let name = set_name("data-gone");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts("inplace")).unwrap();
    write_gen(&mut w);
    std::fs::remove_file(path("cuda-ipc.td.", &name)).unwrap();
    match TensorSetReader::open_host(&name, &ReaderOptions::new()) {
        Err(Error::TensorSet(TensorSetError::NotFound(n))) => assert_eq!(n, name),
        Err(e) => panic!("open with the data segment gone: {e:?}"),
        Ok(_) => panic!("opened a set whose data segment is gone"),
    }
    w.close(ANSWER).unwrap();
}

/// `close_at_exit` forces the holds of this process's own readers at once (an exiting process
/// releases nothing more), where `close` waits for them to its timeout; it reports them forced.
#[test]
fn close_at_exit_does_not_wait_for_this_processs_own_holds() {
    for mode in ["in_place", "buffered"] {
        let name = set_name(&format!("atexit-{mode}"));
        let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts(mode)).unwrap();
        let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
        write_gen(&mut w);
        let held = r.current().unwrap().expect("the first generation");
        let started = Instant::now();
        let report = w.close_at_exit(ANSWER).unwrap();
        let took = started.elapsed();
        assert!(
            took < ANSWER / 2,
            "{mode}: waited {took:?} for its own hold"
        );
        assert_eq!(report.forced_holds, 1, "{mode}: the own reader's hold");
        drop(held);
        drop(r);
        // The name is free again.
        let w = TensorSetWriter::create_host(&name, &specs(), &mode_opts(mode)).unwrap();
        w.close(ANSWER).unwrap();
    }
}

/// `writer_alive` is how a reader that only polls `current` learns that no newer generation
/// comes: true while the writer runs, false once it closed the set (a writer killed reads the
/// same: `python/tests/test_tensorset_host.py` kills one), while `current` keeps answering as
/// documented.
#[test]
fn writer_alive_turns_false_once_the_writer_closed() {
    if role().is_some() {
        return;
    }
    let name = set_name("alive");
    let mut w = TensorSetWriter::create_host(&name, &specs(), &mode_opts("buffered")).unwrap();
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    assert!(r.writer_alive());
    let u = w.begin(Some(ANSWER)).unwrap();
    assert_eq!(u.commit().unwrap(), 1);
    assert!(r.writer_alive());
    assert!(!r.is_writerless());
    w.close(ANSWER).unwrap();
    assert!(!r.writer_alive(), "a closed writer is gone");
}

/// Overwrites the header of the tensor-set segment at `path` as a hostile peer could, or as a
/// writer killed between recording itself and stamping leaves it: the init stamp zeroed and the
/// writer's identity words (pid, uid, start time, boot id, pid namespace) replaced by a dead
/// process's, of this user.
fn unstamp_with_dead_writer(path: &str) {
    use std::os::unix::fs::FileExt;
    let mut child = Command::new("true").spawn().unwrap();
    child.wait().unwrap();
    let me = cuda_ipc::identity::ProcessIdentity::current().unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let uid = rustix::process::geteuid().as_raw();
    for (at, bytes) in [
        (12, &0u32.to_le_bytes()[..]),
        (24, &child.id().to_le_bytes()[..]),
        (28, &uid.to_le_bytes()[..]),
        (32, &1u64.to_le_bytes()[..]),
        (40, &me.boot_id[..]),
        (56, &me.pid_ns.to_le_bytes()[..]),
    ] {
        f.write_all_at(bytes, at).unwrap();
    }
}

/// A holders segment in use (a holder's slot claimed, which only follows the stamp) whose header
/// says its writer died before stamping it is no abandoned creation: a writer's create over it
/// and `gc`'s scan refuse it as a segment whose header was overwritten, and keep it, where they
/// used to remove it under its holders. One never used, overwritten the same way (a writer killed
/// between recording itself and stamping), is still an abandoned creation: `gc` removes it, a
/// writer's create replaces it.
#[test]
fn a_holders_segment_in_use_whose_stamp_and_writer_were_overwritten_is_kept_never_abandoned() {
    use cuda_ipc::raw::tensorset::testing::HeldSetFixture;
    use cuda_ipc::tensorset::HolderRole;
    if role().is_some() {
        return;
    }
    let (used, fresh) = (set_name("th-in-use"), set_name("th-fresh"));
    let _g = [
        common::Unlink(format!("cuda-ipc.th.{used}")),
        common::Unlink(format!("cuda-ipc.th.{fresh}")),
    ];
    let f = HeldSetFixture::create_holders(&used, 2).unwrap();
    f.claim(HolderRole::Holder).unwrap();
    unstamp_with_dead_writer(&path("cuda-ipc.th.", &used));
    let t = Instant::now();
    let e = HeldSetFixture::create_holders(&used, 2).unwrap_err();
    assert!(
        matches!(e, Error::TensorSet(TensorSetError::BadManifest { .. })),
        "{e:?}"
    );
    let e = e.to_string();
    assert!(
        e.contains(&format!("cuda-ipc.th.{used}"))
            && e.contains("was overwritten")
            && e.contains("left as it is"),
        "{e}"
    );
    let scope = Scope::only(vec![], vec![]).with_tensor_sets(vec![used.clone(), fresh.clone()]);
    let _fresh = HeldSetFixture::create_holders(&fresh, 2).unwrap();
    unstamp_with_dead_writer(&path("cuda-ipc.th.", &fresh));
    let scan = cleanup::scan(&scope).unwrap();
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // Listed with the dead writer it records, as a creation abandoned.
    assert!(
        scan.leftovers.len() == 1
            && scan.leftovers[0].object == fresh
            && scan.leftovers[0].what.contains("a creation abandoned"),
        "{:?}",
        scan.leftovers
    );
    assert!(
        scan.problems
            .iter()
            .any(|p| p.error.to_string().contains("was overwritten")),
        "{:?}",
        scan.problems
    );
    assert_eq!(cleanup::remove(&scan.leftovers).removed.len(), 1);
    assert!(std::fs::symlink_metadata(path("cuda-ipc.th.", &fresh)).is_err());
    assert!(
        std::fs::symlink_metadata(path("cuda-ipc.th.", &used)).is_ok(),
        "the holders segment in use was removed"
    );
    // A writer's create over a never-used one overwritten so: replaced.
    let again = HeldSetFixture::create_holders(&fresh, 2).unwrap();
    unstamp_with_dead_writer(&path("cuda-ipc.th.", &fresh));
    drop(again);
    HeldSetFixture::create_holders(&fresh, 2).unwrap().unlink();
    drop(f);
}
