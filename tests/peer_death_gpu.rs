//! A peer killed while its GPU work on a shared buffer is still running must not wedge the survivor:
//! the survivor's stream must drain, and its next operations must work. Separate processes; they
//! need a CUDA GPU and fail without one; `cargo test` lists them as ignored.

mod common;

use common::{Peer, ctx, drains_within, parent_lines, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
use cuda_ipc::driver::{DeviceBuffer, Stream};
use cuda_ipc::raw::kernels::Kernels;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
/// GPU work the victim leaves running when it is killed.
const PENDING_NS: u64 = 2_000_000_000;

fn env(k: &str) -> String {
    std::env::var(k).unwrap()
}

const CONSUMER_DIES: &str =
    "a_consumer_killed_with_gpu_work_pending_on_a_released_frame_does_not_wedge_the_producer";

/// The consumer enqueues 2 s of GPU work on a frame, drops it (the write of its release word is
/// enqueued after that work) and is killed at once. The producer then takes the buffer back (its
/// host does not wait) and writes it: its stream waits for the dead consumer's release word, which
/// the producer's watchdog raises once it sees the death, so the stream must drain.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_consumer_killed_with_gpu_work_pending_on_a_released_frame_does_not_wedge_the_producer() {
    if role().as_deref() == Some("consumer") {
        let rx = Consumer::attach(&env("CUDA_IPC_TEST_CHANNEL"), &ConsumerOptions::new()).unwrap();
        let k = Kernels::load(rx.context().unwrap()).unwrap();
        tell("ready");
        let f = rx.recv_timeout(T).unwrap();
        k.spin(PENDING_NS, f.stream().unwrap()).unwrap();
        drop(f);
        tell("released");
        std::thread::sleep(T);
        return;
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let name = format!("deadc-{}", std::process::id());
    let mut tx = Producer::create(&ctx, &name, &ChannelOptions::new(1 << 20).buffers(1)).unwrap();
    let mut c = Peer::spawn(
        CONSUMER_DIES,
        "consumer",
        &[("CUDA_IPC_TEST_CHANNEL", &name)],
    );
    c.expect("ready", T);
    let f = tx.acquire(Some(T)).unwrap();
    k.fill_pattern(f.buffer().unwrap(), 1, f.stream().unwrap())
        .unwrap();
    f.publish(&[]).unwrap();
    c.expect("released", T);
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    let t = Instant::now();
    let f = tx
        .acquire(Some(Duration::from_secs(10)))
        .expect("the buffer comes back");
    let got = t.elapsed();
    k.fill_pattern(f.buffer().unwrap(), 2, f.stream().unwrap())
        .unwrap();
    f.publish(&[]).unwrap();
    let drained = drains_within(tx.stream().unwrap(), Duration::from_secs(10));
    println!(
        "consumer killed with {PENDING_NS} ns of GPU work pending: buffer back after {got:?}; producer stream drained: {drained:?}"
    );
    match drained {
        Some(_) => tx.close(Duration::from_secs(1)).map(drop).unwrap(),
        None => {
            // The stream is wedged; tearing it down could hang too. Leave without destructors.
            let _ = std::fs::remove_file(format!("/dev/shm/cuda-ipc.ch.{name}"));
            std::mem::forget(tx);
            panic!("the producer's stream is wedged on the dead consumer's release word");
        }
    }
}

const PRODUCER_DIES: &str = "a_producer_killed_with_its_write_pending_does_not_wedge_the_consumer";

/// The producer enqueues 2 s of GPU work before a frame's write and publishes it; the consumer
/// receives it (its stream waits for the producer's write) and the producer is killed. The consumer
/// must get `ProducerGone` and its stream must drain, so it can drop everything and go on.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_producer_killed_with_its_write_pending_does_not_wedge_the_consumer() {
    if role().as_deref() == Some("producer") {
        let ctx = ctx();
        let k = Kernels::load(&ctx).unwrap();
        let mut tx = Producer::create(
            &ctx,
            &env("CUDA_IPC_TEST_CHANNEL"),
            &ChannelOptions::new(1 << 20),
        )
        .unwrap();
        tell("ready");
        let mut lines = parent_lines();
        assert_eq!(lines.next().as_deref(), Some("go"));
        let f = tx.acquire(Some(T)).unwrap();
        k.spin(PENDING_NS, f.stream().unwrap()).unwrap();
        k.fill_pattern(f.buffer().unwrap(), 3, f.stream().unwrap())
            .unwrap();
        f.publish(&[]).unwrap();
        tell("published");
        std::thread::sleep(T);
        return;
    }
    let ctx = ctx();
    let name = format!("deadp-{}", std::process::id());
    let mut p = Peer::spawn(
        PRODUCER_DIES,
        "producer",
        &[("CUDA_IPC_TEST_CHANNEL", &name)],
    );
    p.expect("ready", T);
    let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
    let k = Kernels::load(rx.context().unwrap()).unwrap();
    let bad = zeroed_counter(&ctx);
    p.send("go");
    p.expect("published", T);
    let f = rx.recv_timeout(T).unwrap();
    k.check_pattern(f.buffer().unwrap(), 3, &bad, f.stream().unwrap())
        .unwrap();
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    // Without calling into the channel again (a user blocked synchronising the stream would not):
    // the consumer's watchdog closes the dead producer's gate (every ready word raised), so the
    // stream drains.
    let drained = drains_within(rx.stream().unwrap(), Duration::from_secs(10));
    drop(f);
    let e = rx.recv_timeout(Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Channel(cuda_ipc::channel::ChannelError::ProducerGone { .. })
        ),
        "{e}"
    );
    println!(
        "producer killed with its write pending: the consumer's stream drained after {drained:?} without a recv; then recv gave `{e}`"
    );
    let _ = std::fs::remove_file(format!("/dev/shm/cuda-ipc.ch.{name}"));
    if drained.is_none() {
        std::mem::forget(rx);
        panic!("the consumer's stream is wedged on the dead producer's ready word");
    }
    drop(rx);
    // Whatever the GPU did with the dead producer's half-written frame, this context still works.
    let s = Stream::new(&ctx).unwrap();
    let buf = DeviceBuffer::new(&ctx, 1 << 20).unwrap();
    let bad2 = zeroed_counter(&ctx);
    k.fill_pattern(&buf, 9, &s).unwrap();
    k.check_pattern(&buf, 9, &bad2, &s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(read_u64(&bad2), 0);
    println!(
        "the consumer's context works after the producer's death (pattern check: 0 mismatches; the dead producer's frame had {} mismatched words)",
        read_u64(&bad)
    );
}
