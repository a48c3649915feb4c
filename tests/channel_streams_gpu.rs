//! GPU tests of stream interop: work on streams other than the channel's own (a library's, such as
//! PyTorch's current stream) ordered with [`WriteFrame::ready_on`], [`WriteFrame::publish_after`],
//! [`Frame::ready_on`] and [`Frame::release_after`]. Separate processes; they need a CUDA GPU and fail without one.
//!
//! [`WriteFrame::ready_on`]: cuda_ipc::channel::WriteFrame::ready_on
//! [`WriteFrame::publish_after`]: cuda_ipc::channel::WriteFrame::publish_after
//! [`Frame::ready_on`]: cuda_ipc::channel::Frame::ready_on
//! [`Frame::release_after`]: cuda_ipc::channel::Frame::release_after

mod common;

use common::{Peer, ctx, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
use cuda_ipc::driver::Stream;
use cuda_ipc::raw::kernels::Kernels;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const FRAMES: u64 = 300;

/// The consumer: checks every frame on a stream of its own after a 300 µs spin there, so the check
/// is still running when the frame is dropped. `ordered`: with `ready_on` and `release_after`.
fn consume(ordered: bool) {
    let name = std::env::var("CUDA_IPC_TEST_CHANNEL").unwrap();
    let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
    let k = Kernels::load(rx.context().unwrap()).unwrap();
    let mine = Stream::new(rx.context().unwrap()).unwrap();
    let bad = zeroed_counter(rx.context().unwrap());
    tell("ready");
    let mut n = 0u64;
    loop {
        let f = match rx.recv_timeout(T) {
            Ok(f) => f,
            Err(Error::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => panic!("{e}"),
        };
        let seed = u64::from_le_bytes(f.metadata()[..8].try_into().unwrap());
        if ordered {
            f.ready_on(&mine).unwrap();
        }
        k.spin(300_000, &mine).unwrap();
        k.check_pattern(f.buffer().unwrap(), seed as u32, &bad, &mine)
            .unwrap();
        if ordered {
            f.release_after(&mine).unwrap();
        }
        drop(f);
        n += 1;
    }
    mine.synchronize().unwrap();
    tell(format!("done {n} {}", read_u64(&bad)));
}

/// The producer: fills every frame on a stream of its own after a 300 µs spin there, so the fill
/// is still running at `publish`. Returns (frames received, mismatched words) from the consumer.
fn produce(test: &str, ordered: bool) -> (u64, u64) {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let mine = Stream::new(&ctx).unwrap();
    let name = format!("streams-{}-{ordered}", std::process::id());
    let mut tx = Producer::create(&ctx, &name, &ChannelOptions::new(8 << 20).buffers(2)).unwrap();
    let mut c = Peer::spawn(test, "consumer", &[("CUDA_IPC_TEST_CHANNEL", &name)]);
    c.expect("ready", T);
    for i in 0..FRAMES {
        let f = tx.acquire(Some(T)).unwrap();
        if ordered {
            // The producer's stream waits for the buffer's last readers (their release words);
            // the writes on `mine` must too.
            f.ready_on(&mine).unwrap();
        }
        k.spin(300_000, &mine).unwrap();
        k.fill_pattern(f.buffer().unwrap(), i as u32, &mine)
            .unwrap();
        if ordered {
            f.publish_after(&mine).unwrap();
        }
        f.publish(&i.to_le_bytes()).unwrap();
    }
    mine.synchronize().unwrap();
    tx.close(T).unwrap();
    let done = c.expect("done", T);
    c.finish(T);
    println!("{test}: {done} (frames received, mismatched words)");
    let mut it = done.split(' ').map(|x| x.parse::<u64>().unwrap());
    (it.next().unwrap(), it.next().unwrap())
}

const ORDERED: &str =
    "work_on_other_streams_is_ordered_by_publish_after_ready_on_and_release_after";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn work_on_other_streams_is_ordered_by_publish_after_ready_on_and_release_after() {
    if role().as_deref() == Some("consumer") {
        return consume(true);
    }
    let (n, bad) = produce(ORDERED, true);
    assert_eq!(n, FRAMES, "every frame delivered");
    assert_eq!(bad, 0, "a read raced a write on another stream");
}

const UNORDERED: &str = "without_the_ordering_the_same_check_sees_the_race";

/// The control: the same work with no ordering calls must show mismatches, or the ordered test
/// above would prove nothing.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn without_the_ordering_the_same_check_sees_the_race() {
    if role().as_deref() == Some("consumer") {
        return consume(false);
    }
    let (n, bad) = produce(UNORDERED, false);
    assert_eq!(n, FRAMES, "every frame delivered");
    assert!(
        bad > 0,
        "the unordered control saw no race: the ordered test is not sensitive"
    );
}
