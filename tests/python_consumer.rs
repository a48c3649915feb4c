//! The Python consumer (`python/cuda_ipc_consumer.py`) against the Rust side of the channel
//! protocol, without a GPU: a `ControlProducer` here, the module in its protocol-only mode in a
//! `python3` child (`python/tests/protocol_check.py`, driven line by line). Checks frames, metadata,
//! holds, cursors, release tokens and identities as the producer sees them, back-pressure,
//! latest-only delivery, dead peers on both sides (a consumer marks a dead producer's frames ready
//! in the ready page), a closed channel, and garbage segments; and the module's fd-passing client
//! (`fetch_fds`, used for VMM and memory-pool channels) against a Rust `FdExport` exporter serving
//! memfds.
//!
//! Needs `python3` (or the interpreter named by `PYTHON`) with `libatomic.so.1`; without them the
//! tests fail with a message saying so.

mod common;

use common::{Peer, parent_lines, role, tell};
use cuda_ipc::channel::testing::ControlProducer;
use cuda_ipc::driver::Uuid;
use cuda_ipc::identity::{Liveness, ProcessIdentity};
use cuda_ipc::token::{TOKEN_LEN, Token, TokenKind};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(20);
const BUFFER_BYTES: u64 = 4096;
const DEVICE: &str = "GPU-3298439a-810e-95f0-e3b8-da8e2434f657";

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// A file of the repository: from the working directory (cargo test and the GPU bundle's runner
/// both run from the repository root), else from the source tree this test was built from.
fn repo_file(rel: &str) -> PathBuf {
    let here = PathBuf::from(rel);
    if here.exists() {
        return here;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn require_python() {
    let py = python();
    match Command::new(&py).arg("--version").output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "{py} --version failed ({}): the Python consumer tests need python3 3.8 or newer \
             (set PYTHON to its path)",
            o.status
        ),
        Err(e) => panic!(
            "the Python consumer tests need python3 and could not run {py:?}: {e} \
             (install python3, or set PYTHON to its path)"
        ),
    }
}

/// A `protocol_check.py` child.
fn py() -> Peer {
    require_python();
    let script = repo_file("python/tests/protocol_check.py");
    assert!(script.exists(), "{} is missing", script.display());
    let mut cmd = Command::new(python());
    cmd.arg(script).env("PYTHONDONTWRITEBYTECODE", "1");
    Peer::from_command(cmd)
}

fn device() -> Uuid {
    DEVICE.parse().unwrap()
}

fn token(kind: TokenKind, i: u8, len: u64) -> [u8; TOKEN_LEN] {
    Token {
        kind,
        handle: [i; 64],
        offset: 0,
        len,
        device: device(),
        exporter: ProcessIdentity::current().unwrap(),
        export_id: u32::from(matches!(kind, TokenKind::VmmMemory | TokenKind::PoolMemory)),
    }
    .to_bytes()
}

/// The metadata of frame `seq`: 0 to 256 bytes (the formula of protocol_check.py).
fn meta(seq: u64) -> Vec<u8> {
    let n = (seq * 37) % 257;
    (0..n).map(|k| ((seq * 13 + k) & 0xff) as u8).collect()
}

fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "pytest-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A protocol-only producer whose segment is unlinked on drop.
struct Channel {
    p: ControlProducer,
    name: String,
}

impl Channel {
    fn new(tag: &str, buffers: u8, consumers: usize, mem_kind: TokenKind) -> Channel {
        let name = unique(tag);
        let tokens: Vec<_> = (0..buffers)
            .map(|i| {
                (
                    token(mem_kind, i, BUFFER_BYTES),
                    token(TokenKind::LegacyEvent, 100 + i, 0),
                )
            })
            .collect();
        let p = ControlProducer::create(&name, BUFFER_BYTES, consumers, &tokens).unwrap();
        Channel { p, name }
    }

    fn path(&self) -> String {
        format!("/dev/shm/cuda-ipc.ch.{}", self.name)
    }

    /// Overwrites bytes of the segment (through the file: the same pages the mappings see).
    fn poke(&self, offset: u64, bytes: &[u8]) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(self.path())
            .unwrap();
        f.write_all_at(bytes, offset).unwrap();
    }

    fn peek(&self, offset: u64, len: usize) -> Vec<u8> {
        let f = std::fs::File::open(self.path()).unwrap();
        let mut b = vec![0; len];
        f.read_exact_at(&mut b, offset).unwrap();
        b
    }

    fn publish(&self, seq: u64) {
        let (i, _) = self
            .p
            .acquire(Some(T))
            .unwrap()
            .expect("a free buffer in time");
        assert_eq!(self.p.publish(i, &meta(seq)).unwrap(), seq);
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.p.unlink();
    }
}

fn attach(c: &mut Peer, name: &str, delivery: &str) -> (usize, u32) {
    c.send(&format!("attach {name} {delivery}"));
    let r = c.expect("attached", T);
    let mut w = r.split_whitespace().map(|x| x.parse::<u64>().unwrap());
    (w.next().unwrap() as usize, w.next().unwrap() as u32)
}

fn frame_seq(c: &mut Peer) -> u64 {
    let r = c.expect("frame", T);
    r.split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn python_consumer_receives_every_frame_in_order_with_its_metadata_and_releases_them() {
    let ch = Channel::new("every", 3, 4, TokenKind::LegacyMemory);
    let mut c = py();
    let (slot, pid) = attach(&mut c, &ch.name, "every");
    assert_eq!(pid, c.child.id());

    // The slot carries the Python process's real identity and release tokens the producer can read.
    let st = ch.p.stats();
    assert_eq!(st.consumers.len(), 1);
    assert_eq!((st.consumers[0].index, st.consumers[0].pid), (slot, pid));
    let (_, tokens) =
        ch.p.consumer_release_tokens(slot)
            .expect("an attached consumer's tokens");
    assert_eq!(tokens.len(), 3);
    for t in &tokens {
        let t = Token::from_bytes(t).expect("a valid release token (magic, version, CRC)");
        assert_eq!(t.kind, TokenKind::LegacyEvent);
        assert_eq!((t.offset, t.len, t.device), (0, 0, device()));
        assert_eq!(t.exporter.pid, pid);
        assert_eq!(
            t.exporter.boot_id,
            ProcessIdentity::current().unwrap().boot_id
        );
        assert_eq!(
            t.exporter.liveness(),
            Liveness::Alive,
            "the token names the live Python process (pid, start time, boot id)"
        );
    }
    assert_eq!(
        ch.p.reclaim_dead_consumers(),
        0,
        "a live Python consumer must not be reclaimed"
    );

    // Nothing published: a bounded wait times out on time.
    c.send("recv 0.2");
    let waited: f64 = c.expect("timeout", T).parse().unwrap();
    assert!((0.19..3.0).contains(&waited), "waited {waited} s");

    // 50 frames through a pool of 3: each buffer's reuse waits on the consumer's release event.
    const N: u64 = 50;
    c.send(&format!("check {N} 10"));
    for seq in 1..=N {
        let (i, used) = ch.p.acquire(Some(T)).unwrap().expect("a free buffer");
        let want = if seq <= 3 { 0 } else { 1 << slot };
        assert_eq!(used, want, "frame {seq}: consumers that read buffer {i}");
        assert_eq!(ch.p.publish(i, &meta(seq)).unwrap(), seq);
    }
    assert_eq!(c.expect("checked", T), format!("{N} {N}"));
    let st = ch.p.stats();
    assert_eq!(st.published, N);
    let me = &st.consumers[0];
    assert_eq!(
        (me.received, me.dropped, me.in_flight, me.lag),
        (N, 0, 0, 0),
        "every frame received, every hold released, the cursor at the head"
    );

    // Back-pressure: a full pool of frames it has not received holds the producer back, and so
    // does a frame it holds.
    for seq in N + 1..=N + 3 {
        ch.publish(seq);
    }
    assert!(
        ch.p.try_acquire().is_none(),
        "overwrote an unreceived frame"
    );
    c.send("recv 5");
    assert_eq!(frame_seq(&mut c), N + 1);
    assert!(ch.p.try_acquire().is_none(), "overwrote a held frame");
    assert_eq!(ch.p.stats().consumers[0].in_flight, 1);
    c.send(&format!("release {}", N + 1));
    c.expect("released", T);
    let (i, used) = ch.p.try_acquire().expect("the released buffer");
    assert_eq!(used, 1 << slot);
    ch.p.abandon(i);

    // Closed: what was published is still delivered, then ChannelClosed.
    ch.p.close();
    c.send("check 2 5");
    assert_eq!(c.expect("checked", T), format!("2 {}", N + 3));
    c.send("recv 5");
    c.expect("closed", T);
    assert_eq!(ch.p.drain(Duration::from_secs(2)), 0, "no hold was left");
    c.send("stats");
    assert_eq!(c.expect("stats", T), format!("{} 0 0 0", N + 3));

    // Detaching frees the slot.
    c.send("close");
    c.expect("detached", T);
    assert!(ch.p.stats().consumers.is_empty());
    c.send("exit");
    c.finish(T);
}

#[test]
fn python_latest_only_consumer_gets_the_newest_frame_and_counts_the_skipped_ones() {
    let ch = Channel::new("latest", 3, 4, TokenKind::LegacyMemory);
    let mut c = py();
    let (slot, _) = attach(&mut c, &ch.name, "latest");
    for seq in 1..=5 {
        let (i, _) =
            ch.p.try_acquire()
                .expect("latest-only never blocks the producer");
        ch.p.publish(i, &meta(seq)).unwrap();
    }
    c.send("recv 5");
    let r = c.expect("frame", T);
    let w: Vec<&str> = r.split_whitespace().collect();
    assert_eq!(w[0], "5");
    let held: usize = w[1].parse().unwrap();
    let m = meta(5);
    let hex: String = m.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(w[2], if m.is_empty() { "-" } else { &hex });
    // While it holds frame 5, the producer goes on with the other buffers, never that one.
    for seq in 6..=15 {
        let (i, _) = ch.p.try_acquire().expect("a free buffer");
        assert_ne!(i, held, "overwrote the held buffer");
        ch.p.publish(i, &meta(seq)).unwrap();
    }
    c.send("release 5");
    c.expect("released", T);
    c.send("recv 5");
    assert_eq!(frame_seq(&mut c), 15);
    c.send("release 15");
    c.expect("released", T);
    let me = ch.p.stats().consumers[0];
    assert_eq!(me.index, slot);
    assert_eq!((me.received, me.dropped, me.in_flight), (2, 13, 0));
    c.send("exit");
    c.finish(T);
    assert!(
        ch.p.stats().consumers.is_empty(),
        "the consumer detached at exit"
    );
}

#[test]
fn a_killed_python_consumer_has_its_holds_reclaimed_by_the_producer() {
    let ch = Channel::new("killed", 1, 4, TokenKind::LegacyMemory);
    let mut c = py();
    let me = py_identity(&mut c);
    attach(&mut c, &ch.name, "every");
    ch.publish(1);
    c.send("recv 5");
    assert_eq!(frame_seq(&mut c), 1);
    assert!(ch.p.try_acquire().is_none(), "the frame is held");
    assert_eq!(ch.p.reclaim_dead_consumers(), 0, "it is alive");
    c.child.kill().unwrap();
    c.child.wait().unwrap(); // a zombie still shows its start time in /proc
    assert_eq!(
        me.liveness(),
        Liveness::Dead,
        "its liveness lock died with it"
    );
    assert_eq!(ch.p.reclaim_dead_consumers(), 1, "its one hold was forced");
    // A killed process leaves its liveness file behind, lock free (`cuda-ipc gc` removes it).
    let _ = std::fs::remove_file(me.liveness_path());
    let st = ch.p.stats();
    assert_eq!(st.forced_releases, 1);
    assert!(st.consumers.is_empty(), "its slot was freed");
    let (i, used) = ch.p.try_acquire().expect("the buffer is free again");
    assert_eq!(
        (i, used),
        (0, 0),
        "no waiting on a dead consumer's release event"
    );
}

const DEAD_PRODUCER: &str = "python_consumer_reports_a_dead_producer_promptly";

#[test]
fn python_consumer_reports_a_dead_producer_promptly() {
    if role().as_deref() == Some("producer") {
        let name = std::env::var("CUDA_IPC_TEST_CHANNEL").unwrap();
        let tokens = [(
            token(TokenKind::LegacyMemory, 1, BUFFER_BYTES),
            token(TokenKind::LegacyEvent, 2, 0),
        )];
        let _p = ControlProducer::create(&name, BUFFER_BYTES, 4, &tokens).unwrap();
        tell(format!(
            "ready {}",
            ProcessIdentity::current().unwrap().liveness_path()
        ));
        for _ in parent_lines() {} // until killed
        return;
    }
    let name = unique("gone");
    let mut producer = Peer::spawn(
        DEAD_PRODUCER,
        "producer",
        &[("CUDA_IPC_TEST_CHANNEL", &name)],
    );
    let producer_live = producer.expect("ready", T);
    let producer_pid = producer.child.id();
    let mut c = py();
    attach(&mut c, &name, "every");
    c.send("recv 30");
    std::thread::sleep(Duration::from_millis(100));
    producer.child.kill().unwrap();
    producer.child.wait().unwrap();
    let killed = Instant::now();
    assert_eq!(c.expect("gone", T), producer_pid.to_string());
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "ProducerGone came {:?} after the kill",
        killed.elapsed()
    );
    // Attaching to a dead producer's segment fails the same way.
    let mut d = py();
    d.send(&format!("attach {name} every"));
    assert_eq!(d.expect("gone", T), producer_pid.to_string());
    let _ = cuda_ipc::shm::Segment::unlink(&format!("cuda-ipc.ch.{name}"));
    // A killed process leaves its liveness file behind, lock free (`cuda-ipc gc` removes it).
    let _ = std::fs::remove_file(producer_live);
    c.send("exit");
    c.finish(T);
    d.send("exit");
    d.finish(T);
}

/// The ready words as the Python consumer reads them.
fn py_ready(c: &mut Peer) -> Vec<u32> {
    c.send("ready");
    let r = c.expect("ready", T);
    r.split_whitespace().map(|w| w.parse().unwrap()).collect()
}

/// A Python consumer that finds the producer dead marks every published frame ready, as
/// `Control::force_ready` (on `recv`, on `try_recv` and at close), so that streams waiting for a
/// write that will never finish drain; it never lowers a word set ahead (wrap-around order) and
/// leaves a buffer being written alone.
#[test]
fn python_consumer_marks_a_dead_producers_frames_ready_and_never_lowers_a_word() {
    let ch = Channel::new("force", 4, 2, TokenKind::LegacyMemory);
    // Frames 1 to 3 in three buffers; the fourth is being written.
    let mut b = Vec::new();
    for seq in 1..=3 {
        assert_eq!(ch.p.next_seq(), seq);
        let (i, _) = ch.p.try_acquire().expect("a free buffer");
        assert_eq!(ch.p.publish(i, &meta(seq)).unwrap(), seq);
        b.push(i);
    }
    let (writing, _) = ch.p.try_acquire().expect("the fourth buffer");
    let ahead = ch.p.next_seq() as u32 + 5;
    // Frame 1: behind in wrap-around order (u32::MAX is before 1); frame 2: never written;
    // frame 3: ahead of its seq (a later write finished); the buffer being written: a word that
    // the low bits of its seq (WRITING, u64::MAX) would be ahead of.
    ch.p.set_ready(b[0], u32::MAX);
    ch.p.set_ready(b[2], ahead);
    ch.p.set_ready(writing, 0x8000_0000);
    let mut c = py();
    attach(&mut c, &ch.name, "every"); // at the head: nothing new to receive
    let mut want = vec![0u32; 4];
    want[b[0]] = u32::MAX;
    want[b[2]] = ahead;
    want[writing] = 0x8000_0000;
    assert_eq!(
        py_ready(&mut c),
        want,
        "Python finds the ready page where Rust put it"
    );

    // The producer dies: its pid now names a process that has exited.
    let mut gone = Command::new("true").spawn().unwrap();
    let dead = gone.id();
    gone.wait().unwrap();
    ch.poke(40, &dead.to_le_bytes());
    let forced = |ch: &Channel| (0..4).map(|i| ch.p.ready_value(i)).collect::<Vec<_>>();
    let mut want = vec![0u32; 4];
    want[b[0]] = 1;
    want[b[1]] = 2;
    want[b[2]] = ahead;
    want[writing] = 0x8000_0000;
    c.send("recv 5");
    assert_eq!(c.expect("gone", T), dead.to_string());
    assert_eq!(
        forced(&ch),
        want,
        "recv: published frames forced ready, none lowered"
    );
    assert_eq!(py_ready(&mut c), want);

    ch.p.set_ready(b[1], 0);
    c.send("try_recv");
    assert_eq!(c.expect("gone", T), dead.to_string());
    assert_eq!(forced(&ch), want, "try_recv forces too");

    ch.p.set_ready(b[0], 0);
    ch.p.set_ready(b[1], 1);
    c.send("close");
    c.expect("detached", T);
    assert_eq!(forced(&ch), want, "close forces too");
    c.send("exit");
    c.finish(T);
}

const GPU_PRODUCER_DIES: &str =
    "a_python_consumer_whose_producer_dies_with_its_write_pending_drains_its_stream";

/// On a GPU: a Rust producer enqueues 2 s of GPU work before a frame's write and publishes it; the
/// Python consumer (CUDA mode, its own stream) receives it, so its stream waits on the buffer's
/// ready word, and the producer is killed before its stream writes that word. The consumer must
/// get `ProducerGone`, mark the frame ready, and its stream must drain; then it closes cleanly.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_python_consumer_whose_producer_dies_with_its_write_pending_drains_its_stream() {
    use cuda_ipc::channel::{ChannelOptions, Producer};
    use cuda_ipc::driver::Context;
    use cuda_ipc::kernels::Kernels;
    if role().as_deref() == Some("producer") {
        let ctx = Context::default_device().expect("a CUDA GPU is needed for this test");
        let k = Kernels::load(&ctx).unwrap();
        let name = std::env::var("CUDA_IPC_TEST_CHANNEL").unwrap();
        let mut tx = Producer::create(&ctx, &name, &ChannelOptions::new(1 << 20)).unwrap();
        tell("ready");
        let mut lines = parent_lines();
        assert_eq!(lines.next().as_deref(), Some("go"));
        let f = tx.acquire(Some(T)).unwrap();
        k.spin(2_000_000_000, f.stream()).unwrap();
        k.fill_pattern(f.buffer(), 3, f.stream()).unwrap();
        f.publish(&[]).unwrap();
        tell("published");
        std::thread::sleep(T);
        return;
    }
    let name = unique("gpudeadp");
    let mut p = Peer::spawn(
        GPU_PRODUCER_DIES,
        "producer",
        &[("CUDA_IPC_TEST_CHANNEL", &name)],
    );
    p.expect("ready", T);
    let mut c = py();
    c.send(&format!("attach {name} every gpu"));
    c.expect("attached", T);
    p.send("go");
    p.expect("published", T);
    c.send("recv 30");
    assert_eq!(frame_seq(&mut c), 1);
    let pid = p.child.id();
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    c.send("release 1");
    c.expect("released", T);
    c.send("recv 5");
    assert_eq!(c.expect("gone", T), pid.to_string());
    c.send("drain 10");
    let r = c.recv(T);
    let _ = std::fs::remove_file(format!("/dev/shm/cuda-ipc.ch.{name}"));
    if !r.starts_with("drained") {
        // Closing would wait on the wedged stream: leave the child to be killed.
        c.child.kill().unwrap();
        panic!("the Python consumer's stream is wedged on the dead producer's ready word: {r}");
    }
    println!("producer killed with its write pending: the Python consumer's stream {r} s");
    c.send("close");
    c.expect("detached", T);
    c.send("exit");
    c.finish(T);
}

/// Expects `@@ error CLASS MESSAGE` with every `needle` in it.
fn expect_error(c: &mut Peer, class: &str, needles: &[&str]) {
    let r = c.expect("error", T);
    assert!(
        r.starts_with(class) && needles.iter().all(|n| r.contains(n)),
        "expected {class} naming {needles:?}, got {r:?}"
    );
}

#[test]
fn garbage_segments_and_tokens_are_refused_with_a_clear_error() {
    let ch = Channel::new("garbage", 1, 1, TokenKind::LegacyMemory);
    let mut c = py();
    let attach_cmd = format!("attach {} every", ch.name);
    let mut refuse = |offset: u64, bytes: &[u8], class: &str, needles: &[&str]| {
        let old = ch.peek(offset, bytes.len());
        ch.poke(offset, bytes);
        c.send(&attach_cmd);
        expect_error(&mut c, class, needles);
        ch.poke(offset, &old);
    };
    refuse(
        0,
        &7u64.to_le_bytes(),
        "BadSegment",
        &["not a cuda-ipc channel"],
    );
    refuse(
        8,
        &2u32.to_le_bytes(),
        "BadSegment",
        &["layout version 2", "reads version 3"],
    );
    refuse(
        8,
        &4u32.to_le_bytes(),
        "BadSegment",
        &["layout version 4", "reads version 3"],
    );
    refuse(
        16,
        &999u32.to_le_bytes(),
        "BadSegment",
        &["999 buffers", "corrupted"],
    );
    refuse(
        32,
        &(1u64 << 40).to_le_bytes(),
        "BadSegment",
        &["truncated"],
    );
    refuse(12, &0u32.to_le_bytes(), "BadSegment", &["never finished"]);
    // A foreign magic with no init stamp: refused at once, not after the 2 s wait for a creator.
    let mut foreign = 7u64.to_le_bytes().to_vec();
    foreign.extend_from_slice(&2u32.to_le_bytes());
    foreign.extend_from_slice(&0u32.to_le_bytes());
    let t0 = Instant::now();
    refuse(0, &foreign, "BadSegment", &["not a cuda-ipc channel"]);
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "a foreign segment took {:?} to refuse",
        t0.elapsed()
    );
    // The buffer's memory token (after the 136-byte header and 288 bytes of slot): a flipped bit.
    let tok = 136 + 288;
    let b = ch.peek(tok + 80, 1)[0] ^ 1;
    refuse(
        tok + 80,
        &[b],
        "InvalidToken",
        &["buffer 0", "checksum mismatch"],
    );
    refuse(tok, b"XXXX", "InvalidToken", &["not a cuda-ipc token"]);

    // Intact again: it attaches; the only slot is then taken.
    let (slot, _) = attach(&mut c, &ch.name, "every");
    assert_eq!(slot, 0);
    c.send(&attach_cmd);
    expect_error(&mut c, "NoConsumerSlot", &["all 1 consumer slots"]);

    // VMM and pool memory tokens are accepted (protocol only: no fds are fetched without CUDA).
    for kind in [TokenKind::VmmMemory, TokenKind::PoolMemory] {
        let other = Channel::new("fdkind", 1, 1, kind);
        let mut d = py();
        attach(&mut d, &other.name, "every");
        assert_eq!(other.p.stats().consumers.len(), 1, "{kind:?}");
        d.send("close");
        d.expect("detached", T);
        d.send("exit");
        d.finish(T);
    }

    // No such channel; a name that is not one; a file too small to be a channel.
    c.send(&format!("attach {} every", unique("nosuch")));
    expect_error(&mut c, "ChannelNotFound", &["start its producer first"]);
    c.send("attach ../etc every");
    expect_error(&mut c, "ValueError", &["bad channel name"]);
    let tiny = unique("tiny");
    let tiny_path = format!("/dev/shm/cuda-ipc.ch.{tiny}");
    std::fs::write(&tiny_path, b"0123456789").unwrap();
    c.send(&format!("attach {tiny} every"));
    expect_error(&mut c, "BadSegment", &["10 bytes", "header"]);
    std::fs::remove_file(&tiny_path).unwrap();
    c.send(&format!("attach {} sometimes", ch.name));
    expect_error(&mut c, "ValueError", &["unknown delivery"]);

    c.send("exit");
    c.finish(T);
}

#[test]
fn the_python_module_imports_neither_torch_nor_cupy_and_needs_the_driver_for_gpu_frames() {
    require_python();
    // The pool's device (a made-up UUID) is never visible: without a driver the attach says the
    // driver is missing, with one that the device is not there; both before claiming a slot.
    let ch = Channel::new("nodriver", 2, 4, TokenKind::LegacyMemory);
    let dir = repo_file("python");
    let code = "import sys, cuda_ipc_consumer as c\n\
                assert 'torch' not in sys.modules and 'cupy' not in sys.modules\n\
                assert c.LAYOUT_VERSION == 3 and c.TOKEN_VERSION == 2\n\
                try:\n    c.Consumer.attach(sys.argv[1])\n    print('attached')\n\
                except c.CudaUnavailable as e:\n    print('ok', e)";
    let out = Command::new(python())
        .args(["-c", code, &ch.name])
        .env("PYTHONPATH", &dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.starts_with("ok "),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("CUDA driver not found") || text.contains(DEVICE),
        "{text}"
    );
    assert!(
        ch.p.stats().consumers.is_empty(),
        "a failed attach claims no slot"
    );
}

#[test]
fn python_reference_pattern_matches_the_kernels_pattern() {
    require_python();
    let script = repo_file("python/examples/torch_consumer.py");
    let seeds = [0u32, 1, 7, 0xdead_beef, u32::MAX];
    let idx = [0u64, 1, 2, 1000, 8_294_399, (1 << 32) + 5, u64::MAX >> 1];
    let mut args = vec![script.display().to_string(), "--print-pattern".into()];
    for s in seeds {
        args.push(format!("{s}"));
    }
    args.push("--at".into());
    for i in idx {
        args.push(format!("{i}"));
    }
    let out = Command::new(python())
        .args(&args)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Vec<u32> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    let want: Vec<u32> = seeds
        .iter()
        .flat_map(|&s| idx.iter().map(move |&i| cuda_ipc::kernels::pattern(s, i)))
        .collect();
    assert_eq!(got, want);
}

/// Producer and Python consumer at full speed on a pool of 2: every frame arrives once, in order,
/// with its own metadata (a frame taken while being overwritten would show another's); latest-only
/// frames come in increasing order without tearing.
#[test]
fn python_consumer_keeps_up_with_a_full_speed_producer_without_torn_frames() {
    for (delivery, frames) in [("every", 2000u64), ("latest", 20_000)] {
        let ch = Channel::new("speed", 2, 4, TokenKind::LegacyMemory);
        let mut c = py();
        attach(&mut c, &ch.name, delivery);
        c.send("until_closed 10");
        for seq in 1..=frames {
            // (`try_acquire` may miss a buffer freed during its scan; `acquire` retries.)
            let (i, _) = ch.p.acquire(Some(T)).unwrap().expect("a free buffer");
            assert_eq!(ch.p.publish(i, &meta(seq)).unwrap(), seq);
        }
        ch.p.close();
        let r = c.expect("received", T);
        let mut w = r.split_whitespace().map(|x| x.parse::<u64>().unwrap());
        let (count, last) = (w.next().unwrap(), w.next().unwrap());
        assert_eq!(ch.p.drain(Duration::from_secs(5)), 0);
        let me = ch.p.stats().consumers[0];
        assert_eq!(me.received, count);
        assert_eq!(
            me.received + me.dropped,
            last,
            "{delivery}: every frame counted once"
        );
        assert_eq!(
            last, frames,
            "{delivery}: the last frame is always delivered"
        );
        if delivery == "every" {
            assert_eq!(count, frames);
        }
        println!("{delivery}: {count} of {frames} frames received");
        c.send("exit");
        c.finish(T);
    }
}

const FD_EXPORTER: &str = "python_fetches_memfds_from_a_rust_fd_exporter_and_leaks_none";

/// The content of export `i` of the fd exporter child.
fn fd_content(i: usize) -> String {
    format!("memfd-content-{i}")
}

/// The Python fd-passing client (`cuda_ipc_consumer.fetch_fds`, what VMM and pool imports use)
/// against a Rust exporter child serving memfds through `FdExport`: several ids in one request (in
/// any order, one twice), each fd's content read back; an unknown or withdrawn id and a process
/// that serves no fds refused with `FdNotOffered`; a stale identity, a zombie exporter and a
/// reaped one refused promptly with `ProducerGone`; and the Python process holds exactly as many
/// fds afterwards as before.
#[test]
fn python_fetches_memfds_from_a_rust_fd_exporter_and_leaks_none() {
    use cuda_ipc::ipc::fdpass::FdExport;
    use std::collections::BTreeMap;
    if role().as_deref() == Some("fd-exporter") {
        let mut exports = BTreeMap::new();
        for i in 0..3 {
            let fd =
                rustix::fs::memfd_create("py-fdpass", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
            let file = std::fs::File::from(fd);
            file.write_all_at(fd_content(i).as_bytes(), 0).unwrap();
            let e = FdExport::new(file.into()).unwrap();
            exports.insert(e.id(), e);
        }
        let me = ProcessIdentity::current().unwrap();
        let ids: Vec<String> = exports.keys().map(|id| id.to_string()).collect();
        tell(format!(
            "exports {} {} {}",
            me.pid,
            me.start_time,
            ids.join(" ")
        ));
        for line in parent_lines() {
            if let Some(id) = line.strip_prefix("withdraw ") {
                exports.remove(&id.parse::<u32>().unwrap());
                tell("withdrawn");
            }
        }
        return;
    }
    let mut x = Peer::spawn(FD_EXPORTER, "fd-exporter", &[]);
    let r = x.expect("exports", T);
    let w: Vec<u64> = r.split_whitespace().map(|v| v.parse().unwrap()).collect();
    let (pid, start, ids) = (w[0], w[1], &w[2..]);
    assert_eq!(ids.len(), 3);
    let mut c = py();
    let fetch = |c: &mut Peer, start: u64, want: &[u64]| {
        let list: Vec<String> = want.iter().map(|v| v.to_string()).collect();
        c.send(&format!("fetch {pid} {start} 10 {}", list.join(" ")));
    };
    c.send("nfds");
    let before = c.expect("nfds", T);

    // Several ids in one request, in any order, one of them twice: each fd is the export's file.
    fetch(&mut c, start, &[ids[2], ids[0], ids[1], ids[0]]);
    assert_eq!(
        c.expect("fetched", T),
        [2, 0, 1, 0].map(fd_content).join(" ")
    );
    // An unknown id among known ones: refused, naming it; the fds sent with it are closed.
    fetch(&mut c, start, &[ids[0], 999_999, ids[1]]);
    expect_error(
        &mut c,
        "FdNotOffered",
        &[&format!("process {pid}"), "export 999999", "never exported"],
    );
    // A withdrawn id.
    x.send(&format!("withdraw {}", ids[1]));
    x.expect("withdrawn", T);
    fetch(&mut c, start, &[ids[0], ids[1]]);
    expect_error(&mut c, "FdNotOffered", &[&format!("export {}", ids[1])]);
    fetch(&mut c, start, &[ids[2]]);
    assert_eq!(c.expect("fetched", T), fd_content(2));
    // A live process that exported nothing (the Python process itself).
    c.send("fetch self 0 10 1");
    expect_error(&mut c, "FdNotOffered", &["serves no fds"]);
    // The exporter's pid with another start time: a reused pid, gone without connecting.
    fetch(&mut c, start + 1, &[ids[0]]);
    assert_eq!(c.expect("gone", T), pid.to_string());

    // Killed: a zombie (not reaped yet) and then a reaped exporter are reported gone promptly.
    x.child.kill().unwrap();
    let zombie = Instant::now();
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next();
        if state == Some("Z") {
            break;
        }
        assert!(
            zombie.elapsed() < T,
            "the killed exporter never became a zombie"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    for reaped in [false, true] {
        if reaped {
            x.child.wait().unwrap();
        }
        let t = Instant::now();
        fetch(&mut c, start, &[ids[0]]);
        assert_eq!(c.expect("gone", T), pid.to_string(), "reaped {reaped}");
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "reaped {reaped}: ProducerGone took {:?}",
            t.elapsed()
        );
    }
    c.send("nfds");
    assert_eq!(c.expect("nfds", T), before, "the Python process leaked fds");
    c.send("exit");
    c.finish(T);
    let ns = cuda_ipc::identity::own_pid_ns();
    let _ = std::fs::remove_file(format!("/dev/shm/cuda-ipc.live.{ns}.{pid}.{start}"));
}

/// On a GPU: a Rust producer whose pool is VMM memory, then one whose pool is memory-pool memory,
/// each hands 200 frames of 1 MiB (every word written by the `fill_pattern` kernel, seeded by the
/// frame index in the metadata) to a Python consumer in CUDA mode, which imports the buffers
/// through fds fetched from the producer's fd server and checks every word on the GPU (PyTorch,
/// else CuPy). Fails on any mismatched word, a frame out of order or missing, or a forced hold.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_python_consumer_checks_every_frame_of_vmm_and_pool_channels() {
    use cuda_ipc::channel::{ChannelOptions, MemoryKind, Producer};
    use cuda_ipc::kernels::Kernels;
    const FRAMES: u64 = 200;
    // Importing PyTorch and starting CUDA in the child may take a while on a cold machine.
    const SLOW: Duration = Duration::from_secs(120);
    let ctx = common::ctx();
    let k = Kernels::load(&ctx).unwrap();
    let mut results = Vec::new();
    for (kind, word) in [(MemoryKind::Vmm, "VMM"), (MemoryKind::Pool, "pool")] {
        let name = unique(&format!("gpu{word}"));
        let opts = ChannelOptions::new(1 << 20).memory(kind);
        let mut tx = Producer::create(&ctx, &name, &opts).unwrap();
        assert_eq!(tx.memory_kind(), kind);
        let mut c = py();
        c.send(&format!("attach {name} every gpu"));
        c.expect("attached", SLOW);
        c.send(&format!("verify {FRAMES} 60"));
        let t = Instant::now();
        for i in 0..FRAMES {
            let f = tx.acquire(Some(SLOW)).unwrap();
            k.fill_pattern(f.buffer(), i as u32, f.stream()).unwrap();
            f.publish(&i.to_le_bytes()).unwrap();
        }
        let got = c.expect("verified", SLOW);
        // The consumer frees its imports before the producer frees the pool, as the driver wants.
        c.send("close");
        c.expect("detached", T);
        c.send("exit");
        c.finish(T);
        let report = tx.close(T).unwrap();
        println!(
            "{word} channel: {FRAMES} frames of 1 MiB to a Python consumer in {:?}; (received, mismatched words, kind) = {got}",
            t.elapsed()
        );
        results.push((word, got, report.forced_holds));
    }
    for (word, got, forced) in results {
        assert_eq!(got, format!("{FRAMES} 0 {word}"), "{word} channel");
        assert_eq!(forced, 0, "{word} channel: holds forced at close");
    }
}

/// The module's command line: a bad channel name, or one that does not exist, ends with status 1
/// and a one-line error, never a traceback.
#[test]
fn the_python_command_line_reports_bad_and_missing_channels_in_one_line() {
    require_python();
    let long = "x".repeat(300);
    let missing = unique("missing");
    for (name, want) in [
        ("../etc", "bad channel name"),
        ("", "bad channel name"),
        (long.as_str(), "bad channel name"),
        (missing.as_str(), "ChannelNotFound"),
    ] {
        let o = Command::new(python())
            .arg(repo_file("python/cuda_ipc_consumer.py"))
            .args([name, "--no-cuda", "--timeout", "1"])
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{name:?}: {err}");
        assert!(
            err.starts_with("cuda_ipc_consumer: ") && err.contains(want),
            "{name:?}: {err}"
        );
        assert!(!err.contains("Traceback"), "{name:?}: {err}");
    }
}

/// Runs `cmd` with a time limit; kills it (and fails the test) when it runs past `limit`.
fn output_within(mut cmd: Command, limit: Duration) -> std::process::Output {
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} ran past {limit:?}: it hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

/// Whatever sits under a channel's segment name that is not a fully created segment (a symbolic
/// link, which is never followed; a directory; a FIFO, whose open must not block; a socket; a
/// sparse file, sized with `ftruncate` as `truncate -s` does, which must never be mapped: touching
/// a hole in a full /dev/shm raises SIGBUS) is refused with a `BadSegment` naming what it is:
/// status 1 and one line, within a time limit, never a hang, a signal or a traceback.
#[test]
fn the_python_consumer_refuses_links_directories_fifos_sockets_and_sparse_files_as_channels() {
    require_python();
    let ch = Channel::new("link-target", 1, 1, TokenKind::LegacyMemory);
    let path = |name: &str| format!("/dev/shm/cuda-ipc.ch.{name}");
    let (link, dir, fifo, sock, sparse, sparse_header) = (
        unique("link"),
        unique("dir"),
        unique("fifo"),
        unique("sock"),
        unique("sparse"),
        unique("sparsehdr"),
    );
    std::os::unix::fs::symlink(ch.path(), path(&link)).unwrap();
    std::fs::create_dir(path(&dir)).unwrap();
    let st = Command::new("mkfifo").arg(path(&fifo)).status().unwrap();
    assert!(st.success(), "mkfifo failed");
    let _listener = std::os::unix::net::UnixListener::bind(path(&sock)).unwrap();
    // `truncate -s 1M`: a file of a plausible size and no backed page at all.
    std::fs::File::create(path(&sparse))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    // A real channel's first page (a valid, stamped header) and holes after it: only the sparse
    // check stands between this and a mapping whose slots are holes.
    let len = std::fs::metadata(ch.path()).unwrap().len();
    let f = std::fs::File::create(path(&sparse_header)).unwrap();
    f.set_len(len).unwrap();
    f.write_all_at(&ch.peek(0, 4096), 0).unwrap();
    drop(f);
    let cases = [
        (link.as_str(), "is a symbolic link"),
        (dir.as_str(), "is a directory"),
        (fifo.as_str(), "is a FIFO"),
        (sock.as_str(), "is a socket"),
        (sparse.as_str(), "is sparse"),
        (sparse_header.as_str(), "is sparse"),
    ];
    let mut results = Vec::new();
    for (name, want) in cases {
        let mut cmd = Command::new(python());
        cmd.arg(repo_file("python/cuda_ipc_consumer.py"))
            .args([name, "--no-cuda", "--timeout", "1"])
            .env("PYTHONDONTWRITEBYTECODE", "1");
        let t = Instant::now();
        let o = output_within(cmd, Duration::from_secs(10));
        results.push((name, want, o, t.elapsed()));
    }
    for name in [&link, &fifo, &sock, &sparse, &sparse_header] {
        let _ = std::fs::remove_file(path(name));
    }
    let _ = std::fs::remove_dir(path(&dir));
    for (name, want, o, took) in results {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{name}: {:?} {err}", o.status);
        assert!(
            err.starts_with("cuda_ipc_consumer: BadSegment: ") && err.contains(want),
            "{name}: {err}"
        );
        if want == "is sparse" {
            assert!(err.contains("not fully created"), "{name}: {err}");
        }
        assert!(!err.contains("Traceback"), "{name}: {err}");
        assert!(took < Duration::from_secs(5), "{name}: took {took:?}");
    }
    // The channel itself was not attached to through the link.
    assert!(ch.p.consumer_release_tokens(0).is_none());
}

/// A channel removed and made again under the same name while a Python consumer waits in `recv`:
/// the consumer raises `Superseded` (naming the channel, saying to attach again) within about a
/// second, not at its timeout, and a new attach reaches the new channel.
#[test]
fn a_python_consumer_waiting_on_a_superseded_channel_is_told_to_attach_again() {
    let old = Channel::new("superseded", 2, 4, TokenKind::LegacyMemory);
    let name = old.name.clone();
    let mut c = py();
    attach(&mut c, &name, "every");
    c.send("recv 30");
    std::thread::sleep(Duration::from_millis(300));
    drop(old); // unlinks the name; the consumer's mapping stays
    let tokens: Vec<_> = (0..2)
        .map(|i| {
            (
                token(TokenKind::LegacyMemory, i, BUFFER_BYTES),
                token(TokenKind::LegacyEvent, 100 + i, 0),
            )
        })
        .collect();
    let p = ControlProducer::create(&name, BUFFER_BYTES, 4, &tokens).unwrap();
    let new = Channel { p, name };
    let t = Instant::now();
    expect_error(
        &mut c,
        "Superseded",
        &[&format!("{:?}", new.name), "attach again"],
    );
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "Superseded came {:?} after the channel was made again",
        t.elapsed()
    );
    c.send("close");
    c.expect("detached", T);
    let (slot, _) = attach(&mut c, &new.name, "every");
    assert_eq!(new.p.stats().consumers[0].index, slot);
    new.publish(1);
    c.send("recv 5");
    assert_eq!(frame_seq(&mut c), 1);
    c.send("exit");
    c.finish(T);
}

/// A `protocol_check.py` child in a pid namespace of its own (`unshare --pid --fork --mount-proc`;
/// `--kill-child`, so killing the peer kills the Python process too), or `None`, with the reason
/// printed, when this machine does not let us make one (EPERM: not root, or user namespaces off).
fn py_in_new_pid_namespace() -> Option<Peer> {
    require_python();
    let probe = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--kill-child", "true"])
        .output();
    match probe {
        Err(e) => panic!("unshare (util-linux) is needed for the pid-namespace tests: {e}"),
        Ok(o) if !o.status.success() => {
            let err = String::from_utf8_lossy(&o.stderr);
            if err.contains("Operation not permitted") {
                println!(
                    "skipped: unshare --pid is not permitted here ({})",
                    err.trim()
                );
                return None;
            }
            panic!(
                "unshare --pid --fork --mount-proc failed: {:?} {err}",
                o.status
            );
        }
        Ok(_) => {}
    }
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc", "--kill-child"])
        .arg(python())
        .arg(repo_file("python/tests/protocol_check.py"))
        .env("PYTHONDONTWRITEBYTECODE", "1");
    Some(Peer::from_command(cmd))
}

/// The identity a `protocol_check.py` child reports (`whoami`), with this boot's id.
fn py_identity(c: &mut Peer) -> ProcessIdentity {
    c.send("whoami");
    let r = c.expect("me", T);
    let w: Vec<u64> = r.split_whitespace().map(|x| x.parse().unwrap()).collect();
    ProcessIdentity {
        pid: w[0] as u32,
        start_time: w[1],
        boot_id: ProcessIdentity::current().unwrap().boot_id,
        pid_ns: w[2] as u32,
    }
}

const NS_PRODUCER: &str =
    "a_python_consumer_in_another_pid_namespace_is_judged_by_its_liveness_lock";

/// A Python consumer in a pid namespace of its own, attached to Rust producers in this one: its
/// pid means nothing here (it is 1 or 2 there), so only its liveness lock tells whether it runs.
/// While it lives, the producer never reclaims it, and it receives every frame; it sees the
/// producer (whose pid means nothing to it) die within a second of the kill; and when it is
/// killed itself, the producer reclaims its slot and holds.
#[test]
fn a_python_consumer_in_another_pid_namespace_is_judged_by_its_liveness_lock() {
    if role().as_deref() == Some("producer") {
        let name = std::env::var("CUDA_IPC_TEST_CHANNEL").unwrap();
        let tokens: Vec<_> = (0..2)
            .map(|i| {
                (
                    token(TokenKind::LegacyMemory, i, BUFFER_BYTES),
                    token(TokenKind::LegacyEvent, 100 + i, 0),
                )
            })
            .collect();
        let p = ControlProducer::create(&name, BUFFER_BYTES, 4, &tokens).unwrap();
        tell(format!(
            "ready {}",
            ProcessIdentity::current().unwrap().liveness_path()
        ));
        for line in parent_lines() {
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                ["publish", n] => {
                    for _ in 0..n.parse::<u64>().unwrap() {
                        let (i, _) = p.acquire(Some(T)).unwrap().expect("a free buffer");
                        let seq = p.next_seq();
                        p.publish(i, &meta(seq)).unwrap();
                    }
                    tell("published");
                }
                ["reclaim"] => tell(format!(
                    "reclaimed {} {}",
                    p.reclaim_dead_consumers(),
                    p.stats().consumers.len()
                )),
                _ => panic!("unknown command {line:?}"),
            }
        }
        return;
    }
    let Some(mut c) = py_in_new_pid_namespace() else {
        return;
    };
    let own_ns = cuda_ipc::identity::own_pid_ns();
    let name = unique("pidns");
    let mut p = Peer::spawn(NS_PRODUCER, "producer", &[("CUDA_IPC_TEST_CHANNEL", &name)]);
    let producer_live = p.expect("ready", T);
    let producer_pid = p.child.id();

    let me = py_identity(&mut c);
    assert_ne!(
        me.pid_ns, own_ns,
        "the Python consumer runs in a pid namespace of its own"
    );
    assert_ne!(
        me.pid,
        c.child.id(),
        "its pid is counted in its own namespace"
    );
    let live = std::fs::symlink_metadata(me.liveness_path())
        .unwrap_or_else(|e| panic!("no liveness file {}: {e}", me.liveness_path()));
    assert!(live.file_type().is_file());
    assert_eq!(me.liveness(), Liveness::Alive, "its liveness lock is held");

    let (_, pid) = attach(&mut c, &name, "every");
    assert_eq!(pid, me.pid);
    // Not reclaimed while it lives, however often the producer looks.
    for _ in 0..3 {
        p.send("reclaim");
        assert_eq!(
            p.expect("reclaimed", T),
            "0 1",
            "a live consumer was reclaimed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Frames arrive, in order, with their metadata.
    c.send("check 20 10");
    p.send("publish 20");
    p.expect("published", T);
    assert_eq!(c.expect("checked", T), "20 20");
    p.send("reclaim");
    assert_eq!(p.expect("reclaimed", T), "0 1");

    // The producer is killed while the consumer waits: ProducerGone within a second.
    c.send("recv 30");
    std::thread::sleep(Duration::from_millis(100));
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    let killed = Instant::now();
    assert_eq!(c.expect("gone", T), producer_pid.to_string());
    assert!(
        killed.elapsed() < Duration::from_secs(1),
        "ProducerGone came {:?} after the kill",
        killed.elapsed()
    );
    let _ = cuda_ipc::shm::Segment::unlink(&format!("cuda-ipc.ch.{name}"));
    c.send("close");
    c.expect("detached", T);
    // A killed process leaves its liveness file behind, lock free (`cuda-ipc gc` removes it).
    let _ = std::fs::remove_file(producer_live);

    // The consumer is killed holding a frame: the producer (this process) reclaims it.
    let ch = Channel::new("pidns-reclaim", 1, 4, TokenKind::LegacyMemory);
    attach(&mut c, &ch.name, "every");
    ch.publish(1);
    c.send("recv 5");
    assert_eq!(frame_seq(&mut c), 1);
    assert_eq!(ch.p.reclaim_dead_consumers(), 0, "it is alive");
    assert!(ch.p.try_acquire().is_none(), "the frame is held");
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    // `--kill-child` kills the Python process when unshare dies; give the kernel a moment.
    let t = Instant::now();
    while me.liveness() != Liveness::Dead {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the Python process outlived its unshare"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(ch.p.reclaim_dead_consumers(), 1, "its one hold was forced");
    assert!(ch.p.stats().consumers.is_empty(), "its slot was freed");
    assert_eq!(ch.p.try_acquire(), Some((0, 0)));
    let _ = std::fs::remove_file(me.liveness_path());
}

/// The fd-passing client over the exporter's socket file in /dev/shm
/// (`cuda_ipc_consumer._fd_socket_path`), against a stand-in server in another Python process
/// (`serve` in protocol_check.py): from this pid namespace (the listener's pid checked with
/// `SO_PEERCRED`) and from another one (its pid means nothing there: the listener's uid and the
/// socket file's owner are checked instead). A FIFO or a plain file under an exporter's socket
/// name is refused at once with `NotSupported` naming it, never a hang; an exporter in another
/// namespace with no socket file serves no fds; a killed exporter is reported gone; no fd leaks.
#[test]
fn python_fetches_fds_over_the_socket_file_from_this_and_another_pid_namespace() {
    let mut s = py();
    s.send("serve 2");
    let r = s.expect("serving", T);
    let w: Vec<u64> = r.split_whitespace().map(|x| x.parse().unwrap()).collect();
    let (pid, start, ns) = (w[0], w[1], w[2]);
    let sock = format!("/dev/shm/cuda-ipc.fd.{ns}.{pid}.{start}");
    let meta = std::fs::symlink_metadata(&sock).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()));
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
        0o600
    );

    // The same pid namespace.
    let mut a = py();
    a.send("nfds");
    let a_fds = a.expect("nfds", T);
    a.send(&format!("fetch {pid} {start} 5 2 1 2"));
    assert_eq!(a.expect("fetched", T), "py-memfd-1 py-memfd-0 py-memfd-1");
    a.send(&format!("fetch {pid} {start} 5 1 7"));
    expect_error(&mut a, "FdNotOffered", &["export 7"]);

    // Something else under an exporter's socket name (the live Python process `a`, which serves
    // nothing): refused at once, naming what it is.
    let me = py_identity(&mut a);
    let squat = format!(
        "/dev/shm/cuda-ipc.fd.{}.{}.{}",
        me.pid_ns, me.pid, me.start_time
    );
    let st = Command::new("mkfifo").arg(&squat).status().unwrap();
    assert!(st.success());
    for (kind, make) in [("FIFO", false), ("regular file", true)] {
        if make {
            std::fs::remove_file(&squat).unwrap();
            std::fs::write(&squat, b"not a socket").unwrap();
        }
        let t = Instant::now();
        a.send("fetch self 0 5 1");
        expect_error(&mut a, "NotSupported", &[&squat, &format!("is a {kind}")]);
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{kind}: took {:?}",
            t.elapsed()
        );
    }
    std::fs::remove_file(&squat).unwrap();
    a.send("fetch self 0 5 1");
    expect_error(&mut a, "FdNotOffered", &["serves no fds"]);
    a.send("nfds");
    assert_eq!(a.expect("nfds", T), a_fds, "the Python process leaked fds");

    // Another pid namespace.
    if let Some(mut b) = py_in_new_pid_namespace() {
        b.send("nfds");
        let b_fds = b.expect("nfds", T);
        b.send(&format!("fetch_ns {pid} {start} {ns} 5 1 2"));
        assert_eq!(b.expect("fetched", T), "py-memfd-0 py-memfd-1");
        // A live exporter there with no socket file (`a`, which exported nothing).
        b.send(&format!(
            "fetch_ns {} {} {} 5 1",
            me.pid, me.start_time, me.pid_ns
        ));
        expect_error(&mut b, "FdNotOffered", &["serves no fds"]);
        // The server is killed (its socket file stays behind): gone, without a connect.
        s.child.kill().unwrap();
        s.child.wait().unwrap();
        let t = Instant::now();
        b.send(&format!("fetch_ns {pid} {start} {ns} 5 1"));
        assert_eq!(b.expect("gone", T), pid.to_string());
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "took {:?}",
            t.elapsed()
        );
        b.send("nfds");
        assert_eq!(b.expect("nfds", T), b_fds, "the Python process leaked fds");
        b.send("exit");
        b.finish(T);
    } else {
        s.child.kill().unwrap();
        s.child.wait().unwrap();
    }
    a.send(&format!("fetch {pid} {start} 5 1"));
    assert_eq!(a.expect("gone", T), pid.to_string());
    // The killed server's files stay behind (`cuda-ipc gc` removes them).
    let _ = std::fs::remove_file(&sock);
    let _ = std::fs::remove_file(format!("/dev/shm/cuda-ipc.live.{ns}.{pid}.{start}"));
    a.send("exit");
    a.finish(T);
}

/// The Python consumer judges liveness as the Rust side does, including the two ways the lock
/// could mislead: a read lock another user takes on a dead process's 0644 file must not make it
/// alive, and a running process whose file someone removed makes and locks it again.
#[test]
fn python_liveness_ignores_foreign_read_locks_and_remakes_a_removed_liveness_file() {
    require_python();
    let script = r#"
import os, sys, time, fcntl, struct
sys.path.insert(0, sys.argv[1])
import cuda_ipc_consumer as c
me = c.ProcessIdentity.current()
# A process of another namespace that died: its file, no write lock, and a read lock of ours.
dead = me._replace(pid_ns=me.pid_ns + 17, start_time=me.start_time + 4321)
path = dead.liveness_path()
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
reader = os.open(path, os.O_RDONLY)
fcntl.fcntl(reader, c._F_OFD_SETLK, struct.pack(c._FLOCK.format, fcntl.F_RDLCK, 0, 0, 1, 0))
print("dead-with-read-lock", dead.liveness())
os.unlink(path)
# Our own file removed while we run: made and locked again within half a second.
os.unlink(me.liveness_path())
t = time.monotonic()
while c._probe_lock(me.liveness_path()) != c._HELD and time.monotonic() - t < 2:
    time.sleep(0.01)
print("remade-after", round(time.monotonic() - t, 2), c._probe_lock(me.liveness_path()))
"#;
    let out = Command::new(python())
        .arg("-c")
        .arg(script)
        .arg(repo_file("python"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("dead-with-read-lock False"), "{text}");
    let remade = text
        .lines()
        .find_map(|l| l.strip_prefix("remade-after "))
        .unwrap_or_else(|| panic!("{text}"));
    let (secs, state) = remade.split_once(' ').unwrap();
    assert_eq!(state, "held", "{text}");
    assert!(secs.parse::<f64>().unwrap() < 1.0, "{text}");
}
