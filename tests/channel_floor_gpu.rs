//! GPU tests of the event-free hand-off (layout version 5): releases stream-ordered through
//! release words (the producer's host never waits for consumers' GPU work), receives posted ahead
//! in ring order, the gate words that tell posted work whether its frame came, and peers killed
//! with posted work pending, and the owned form of a posted receive (one process). Separate
//! processes otherwise; they need a CUDA GPU and fail without one;
//! `cargo test` lists them as ignored.

mod common;

use common::{Peer, ctx, drains_within, parent_lines, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory};
use cuda_ipc::raw::kernels::Kernels;
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

fn env(k: &str) -> String {
    std::env::var(k).unwrap()
}

/// One `u32` of the gate words, as device memory the test kernels can read on a stream.
struct GateWord {
    ptr: u64,
    ctx: Arc<Context>,
}

impl DeviceMemory for GateWord {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        4
    }
    fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

const SLOW: &str =
    "a_slow_consumer_never_blocks_the_producers_host_and_its_reads_are_never_overwritten";

/// The consumer spends 20 ms of GPU work on every frame (a spin, then the check) and drops the
/// frame at once; the producer (two buffers) rewrites each buffer as soon as its host may. Its
/// `acquire` must not wait for the consumer's GPU work (the wait is its stream's), and no read
/// may see a later frame's bytes.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_slow_consumer_never_blocks_the_producers_host_and_its_reads_are_never_overwritten() {
    const FRAMES: u64 = 40;
    const WORK_NS: u64 = 20_000_000;
    if role().as_deref() == Some("consumer") {
        let rx = Consumer::attach(&env("CUDA_IPC_TEST_CHANNEL"), &ConsumerOptions::new()).unwrap();
        let k = Kernels::load(rx.context().unwrap()).unwrap();
        let bad = zeroed_counter(rx.context().unwrap());
        tell("ready");
        let mut n = 0u64;
        loop {
            let f = match rx.recv_timeout(T) {
                Ok(f) => f,
                Err(Error::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
                Err(e) => panic!("{e}"),
            };
            k.spin(WORK_NS, f.stream().unwrap()).unwrap();
            k.check_pattern(
                f.buffer().unwrap(),
                f.seq() as u32,
                &bad,
                f.stream().unwrap(),
            )
            .unwrap();
            n += 1;
        }
        rx.stream().unwrap().synchronize().unwrap();
        tell(format!("done {n} {}", read_u64(&bad)));
        return;
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let name = format!("slow-{}", std::process::id());
    let mut tx = Producer::create(&ctx, &name, &ChannelOptions::new(4 << 20).buffers(2)).unwrap();
    let mut c = Peer::spawn(SLOW, "consumer", &[("CUDA_IPC_TEST_CHANNEL", &name)]);
    c.expect("ready", T);
    let mut longest = Duration::ZERO;
    let t0 = Instant::now();
    for s in 1..=FRAMES {
        let t = Instant::now();
        let f = tx.acquire(Some(T)).unwrap();
        longest = longest.max(t.elapsed());
        k.fill_pattern(f.buffer().unwrap(), s as u32, f.stream().unwrap())
            .unwrap();
        assert_eq!(f.publish(&[]).unwrap(), s);
        // Let the consumer take it (every-frame: the producer's host waits for its cursor, never
        // for its GPU).
    }
    let enqueued = t0.elapsed();
    tx.close(T).unwrap();
    let done = c.expect("done", T);
    c.finish(T);
    let mut it = done.split(' ').map(|x| x.parse::<u64>().unwrap());
    let (n, bad) = (it.next().unwrap(), it.next().unwrap());
    println!(
        "{FRAMES} frames, consumer GPU work {} ms each: producer enqueued all in {enqueued:?} (longest acquire {longest:?}); consumer got {n}, {bad} mismatched words",
        WORK_NS / 1_000_000
    );
    assert_eq!((n, bad), (FRAMES, 0));
    // The consumer's GPU work alone takes FRAMES × 20 ms = 800 ms; a host-ordered release would
    // have kept the producer's host at least that long.
    assert!(
        enqueued < Duration::from_millis(FRAMES * WORK_NS / 1_000_000 / 2),
        "the producer's host waited for the consumer's GPU work ({enqueued:?})"
    );
}

const POSTED: &str =
    "receives_posted_ahead_get_every_frame_and_the_gate_tells_the_ones_that_never_came";

/// A ring channel; the consumer posts 8 receives ahead, each a pattern check plus reads of the
/// gate words into per-frame counters, and waits for them in order. The producer publishes 64
/// frames and closes: frames 1..=64 are checked with 0 mismatches and read the gate as "came"; the
/// receives posted past the end end in `ChannelClosed`, and their work reads the gate closed at 64.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn receives_posted_ahead_get_every_frame_and_the_gate_tells_the_ones_that_never_came() {
    const FRAMES: u64 = 64;
    const AHEAD: u64 = 8;
    if role().as_deref() == Some("consumer") {
        let rx = Consumer::attach(&env("CUDA_IPC_TEST_CHANNEL"), &ConsumerOptions::new()).unwrap();
        let k = Kernels::load(rx.context().unwrap()).unwrap();
        let gate = rx.gate_device_ptr().unwrap();
        let state = GateWord {
            ptr: gate,
            ctx: rx.context().unwrap().clone(),
        };
        let end = GateWord {
            ptr: gate + 4,
            ctx: rx.context().unwrap().clone(),
        };
        let total = FRAMES + AHEAD;
        let states: Vec<DeviceBuffer> = (0..total)
            .map(|_| zeroed_counter(rx.context().unwrap()))
            .collect();
        let ends: Vec<DeviceBuffer> = (0..total)
            .map(|_| zeroed_counter(rx.context().unwrap()))
            .collect();
        let bad: Vec<DeviceBuffer> = (0..total)
            .map(|_| zeroed_counter(rx.context().unwrap()))
            .collect();
        tell("ready");
        let mut posted = std::collections::VecDeque::new();
        let mut next = 1u64;
        let mut took = 0u64;
        let mut closed_at = None;
        loop {
            while next <= total && next - took <= AHEAD {
                let i = (next - 1) as usize;
                let p = rx
                    .post(|p| {
                        k.check_pattern(p.buffer()?, p.seq() as u32, &bad[i], p.stream()?)?;
                        k.sum(&state, &states[i], p.stream()?)?;
                        k.sum(&end, &ends[i], p.stream()?)
                    })
                    .unwrap();
                assert_eq!(p.seq(), next);
                assert_eq!(p.index() as u64, (next - 1) % 4);
                posted.push_back(p);
                next += 1;
            }
            let Some(p) = posted.pop_front() else { break };
            let seq = p.seq();
            match p.wait(Some(T)) {
                Ok(f) => {
                    assert_eq!(f.seq(), seq);
                    assert_eq!(f.metadata(), seq.to_le_bytes());
                    took = seq;
                }
                Err(Error::Channel(cuda_ipc::channel::ChannelError::Closed)) => {
                    closed_at.get_or_insert(seq);
                    took = seq;
                }
                Err(e) => panic!("frame {seq}: {e}"),
            }
            if next > total && posted.is_empty() {
                break;
            }
        }
        let drained = drains_within(rx.stream().unwrap(), Duration::from_secs(10));
        assert!(drained.is_some(), "the consumer's stream is wedged");
        // The kernels' rule: frame s came when the state is 0 or s <= end.
        let mut came = 0u64;
        let mut not = 0u64;
        let mut mismatched = 0u64;
        for s in 1..=total {
            let st = read_u64(&states[(s - 1) as usize]);
            let e = read_u64(&ends[(s - 1) as usize]);
            let c = st == 0 || s <= e;
            assert_eq!(c, s <= FRAMES, "frame {s}: gate state {st}, end {e}");
            if c {
                // Only a frame that came holds its bytes.
                mismatched += read_u64(&bad[(s - 1) as usize]);
                came += 1;
            } else {
                not += 1;
            }
            if s > FRAMES {
                assert_eq!(
                    (st, e),
                    (1, FRAMES),
                    "frame {s} read the gate closed at the end"
                );
            }
        }
        tell(format!(
            "done {came} {not} {mismatched} {}",
            closed_at.unwrap_or(0)
        ));
        return;
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let name = format!("posted-{}", std::process::id());
    let mut tx = Producer::create(
        &ctx,
        &name,
        &ChannelOptions::new(1 << 20).buffers(4).ring(true),
    )
    .unwrap();
    let mut c = Peer::spawn(POSTED, "consumer", &[("CUDA_IPC_TEST_CHANNEL", &name)]);
    c.expect("ready", T);
    for s in 1..=FRAMES {
        let f = tx.acquire(Some(T)).unwrap();
        assert_eq!(f.index() as u64, (s - 1) % 4, "ring order");
        k.fill_pattern(f.buffer().unwrap(), s as u32, f.stream().unwrap())
            .unwrap();
        f.publish(&s.to_le_bytes()).unwrap();
    }
    tx.close(T).unwrap();
    let done = c.expect("done", T);
    c.finish(T);
    println!("posted receives: {done} (came, never came, mismatched words, first ChannelClosed)");
    let v: Vec<u64> = done.split(' ').map(|x| x.parse().unwrap()).collect();
    assert_eq!(v, [FRAMES, AHEAD, 0, FRAMES + 1]);
}

const POSTED_DEATH: &str = "a_producer_killed_under_posted_receives_lets_the_consumers_stream_go";

/// The consumer posts 6 receives ahead; the producer publishes 2 frames (its second write pending
/// behind a 2 s spin) and is killed. The consumer's stream must drain without any call into the
/// channel (its watchdog closes the gate), the posted waits end in `ProducerGone`, and the work of
/// the frames that never came reads the gate state 2.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_producer_killed_under_posted_receives_lets_the_consumers_stream_go() {
    if role().as_deref() == Some("producer") {
        let ctx = ctx();
        let k = Kernels::load(&ctx).unwrap();
        let mut tx = Producer::create(
            &ctx,
            &env("CUDA_IPC_TEST_CHANNEL"),
            &ChannelOptions::new(1 << 20).buffers(4).ring(true),
        )
        .unwrap();
        tell("ready");
        let mut lines = parent_lines();
        assert_eq!(lines.next().as_deref(), Some("go"));
        for s in 1..=2u64 {
            let f = tx.acquire(Some(T)).unwrap();
            if s == 2 {
                k.spin(2_000_000_000, f.stream().unwrap()).unwrap();
            }
            k.fill_pattern(f.buffer().unwrap(), s as u32, f.stream().unwrap())
                .unwrap();
            f.publish(&[]).unwrap();
        }
        tell("published");
        std::thread::sleep(T);
        return;
    }
    let ctx = ctx();
    let name = format!("posteddeath-{}", std::process::id());
    let mut p = Peer::spawn(
        POSTED_DEATH,
        "producer",
        &[("CUDA_IPC_TEST_CHANNEL", &name)],
    );
    p.expect("ready", T);
    let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
    let k = Kernels::load(rx.context().unwrap()).unwrap();
    let gate = GateWord {
        ptr: rx.gate_device_ptr().unwrap(),
        ctx: ctx.clone(),
    };
    let states: Vec<DeviceBuffer> = (0..6).map(|_| zeroed_counter(&ctx)).collect();
    let posted: Vec<_> = (0..6)
        .map(|i| rx.post(|p| k.sum(&gate, &states[i], p.stream()?)).unwrap())
        .collect();
    p.send("go");
    p.expect("published", T);
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    let t = Instant::now();
    let drained = drains_within(rx.stream().unwrap(), Duration::from_secs(10));
    println!(
        "producer killed under 6 posted receives: the consumer's stream drained after {drained:?} (no call into the channel)"
    );
    assert!(drained.is_some(), "the consumer's stream is wedged");
    let mut outcomes = Vec::new();
    for p in posted {
        outcomes.push(match p.wait(Some(Duration::from_secs(5))) {
            Ok(f) => format!("frame {}", f.seq()),
            Err(Error::Channel(cuda_ipc::channel::ChannelError::ProducerGone { .. })) => {
                "gone".into()
            }
            Err(e) => panic!("{e}"),
        });
    }
    println!("posted waits: {outcomes:?}, after {:?}", t.elapsed());
    assert!(outcomes.iter().skip(2).all(|o| o == "gone"), "{outcomes:?}");
    for (i, s) in states.iter().enumerate().skip(2) {
        assert_eq!(
            read_u64(s),
            2,
            "frame {} read the gate: producer gone",
            i + 1
        );
    }
    let _ = std::fs::remove_file(format!("/dev/shm/cuda-ipc.ch.{name}"));
    drop(rx);
}

const CONSUMER_DEATH: &str = "a_consumer_killed_with_posted_work_pending_never_wedges_the_producer";

/// The consumer posts 3 receives, each with 2 s of GPU work, and is killed once the first frame
/// was published. The producer goes on publishing (it needs the dead consumer's release words for
/// the buffers it reuses): its watchdog frees the dead consumer's slot, raising the words, so its
/// stream drains and every acquire returns.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_consumer_killed_with_posted_work_pending_never_wedges_the_producer() {
    if role().as_deref() == Some("consumer") {
        let rx = Consumer::attach(&env("CUDA_IPC_TEST_CHANNEL"), &ConsumerOptions::new()).unwrap();
        let k = Kernels::load(rx.context().unwrap()).unwrap();
        let posted: Vec<_> = (0..3)
            .map(|_| rx.post(|p| k.spin(2_000_000_000, p.stream()?)).unwrap())
            .collect();
        tell("posted");
        let f = posted.into_iter().next().unwrap().wait(Some(T)).unwrap();
        tell(format!("took {}", f.seq()));
        std::thread::sleep(T);
        return;
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let name = format!("postedc-{}", std::process::id());
    let mut tx = Producer::create(
        &ctx,
        &name,
        &ChannelOptions::new(1 << 20).buffers(2).ring(true),
    )
    .unwrap();
    let mut c = Peer::spawn(
        CONSUMER_DEATH,
        "consumer",
        &[("CUDA_IPC_TEST_CHANNEL", &name)],
    );
    c.expect("posted", T);
    let f = tx.acquire(Some(T)).unwrap();
    k.fill_pattern(f.buffer().unwrap(), 1, f.stream().unwrap())
        .unwrap();
    f.publish(&[]).unwrap();
    c.expect("took 1", T);
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    let t = Instant::now();
    for s in 2..=6u32 {
        let f = tx
            .acquire(Some(Duration::from_secs(10)))
            .expect("the ring goes on");
        k.fill_pattern(f.buffer().unwrap(), s, f.stream().unwrap())
            .unwrap();
        f.publish(&[]).unwrap();
    }
    let drained = drains_within(tx.stream().unwrap(), Duration::from_secs(10));
    println!(
        "consumer killed with 3 posted receives of 2 s GPU work: 5 more frames published and the producer's stream drained {drained:?} after the kill ({:?} in all)",
        t.elapsed()
    );
    match drained {
        Some(d) => {
            assert!(d < Duration::from_secs(1), "drained only after {d:?}");
            tx.close(Duration::from_secs(1)).map(drop).unwrap();
        }
        None => {
            let _ = std::fs::remove_file(format!("/dev/shm/cuda-ipc.ch.{name}"));
            std::mem::forget(tx);
            panic!("the producer's stream is wedged on the dead consumer's release words");
        }
    }
}

const LEAVES: &str = "a_consumer_dropped_with_receives_posted_for_unpublished_frames_neither_blocks_nor_holds_the_producer";

/// A consumer posts 4 receives past the last frame and is dropped: the drop returns at once, and
/// the producer goes on (8 more frames through 2 buffers, more than an every-frame consumer that
/// stopped taking would allow) and closes cleanly.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_consumer_dropped_with_receives_posted_for_unpublished_frames_neither_blocks_nor_holds_the_producer()
 {
    let _ = LEAVES;
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let name = format!("leaves-{}", std::process::id());
    let mut tx = Producer::create(
        &ctx,
        &name,
        &ChannelOptions::new(1 << 20).buffers(2).ring(true),
    )
    .unwrap();
    let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
    for _ in 0..4 {
        rx.post(|_| Ok(())).unwrap();
    }
    let t = Instant::now();
    drop(rx);
    let dropped = t.elapsed();
    for s in 1..=8u32 {
        let f = tx
            .acquire(Some(Duration::from_secs(10)))
            .expect("not held back by the consumer that left");
        k.fill_pattern(f.buffer().unwrap(), s, f.stream().unwrap())
            .unwrap();
        f.publish(&[]).unwrap();
    }
    let r = tx.close(Duration::from_secs(5)).unwrap();
    println!(
        "dropped with 4 posted receives in {dropped:?}; 8 frames then published; close: {r:?}"
    );
    assert!(dropped < Duration::from_millis(100), "{dropped:?}");
    assert_eq!(r.forced_holds, 0);
}

/// The owned form of a posted receive (`channel::owned::OwnedPosted`, what the Python `Posted`
/// holds), in one process: its wait in short slices times out (and can be waited for again)
/// before the frame comes, takes the frame once it is published, and a second wait is the
/// `InvalidArgument` of a frame received already.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn an_owned_posted_receive_waits_in_slices_and_takes_its_frame_once() {
    use cuda_ipc::channel::owned::OwnedPosted;
    let name = format!("owned-posted-{}", std::process::id());
    let ctx = ctx();
    let mut tx = Producer::create(
        &ctx,
        &name,
        &ChannelOptions::new(4096).buffers(2).ring(true),
    )
    .unwrap();
    let rx = Arc::new(Consumer::attach(&name, &ConsumerOptions::new()).unwrap());
    let mut worked = None;
    let p = OwnedPosted::post(&rx, |p| {
        worked = Some((p.seq(), p.index()));
        Ok(())
    })
    .unwrap();
    assert_eq!(worked, Some((1, 0)));
    assert_eq!((p.posted().seq(), p.posted().index()), (1, 0));
    for _ in 0..3 {
        assert!(p.wait(Some(Duration::from_millis(20))).unwrap().is_none());
    }
    tx.acquire(Some(T)).unwrap().publish(b"first").unwrap();
    let f = p.wait(Some(T)).unwrap().expect("the frame was published");
    assert_eq!((f.seq(), f.index(), f.metadata()), (1, 0, &b"first"[..]));
    assert!(matches!(
        p.wait(Some(Duration::ZERO)),
        Err(Error::InvalidArgument(_))
    ));
    drop(p);
    assert!(drains_within(rx.stream().unwrap(), T).is_some());
    drop(rx);
    tx.close(T).unwrap();
}
