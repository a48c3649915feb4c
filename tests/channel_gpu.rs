//! GPU tests of the channel, each with separate processes. They need a CUDA GPU and fail without
//! one; `cargo test` lists them as ignored.

mod common;

use common::{Peer, ctx, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
use cuda_ipc::raw::kernels::Kernels;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

fn channel_env() -> String {
    std::env::var("CUDA_IPC_TEST_CHANNEL").unwrap()
}

const RACE: &str = "producer_overwrite_never_races_a_consumer_still_reading";

/// Pool of 2, slow kernels on both sides: the consumer spins 300 µs before checking, the producer
/// spins 300 µs before filling. Without stream-ordered release the producer's fill would land while
/// the consumer's check still reads.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn producer_overwrite_never_races_a_consumer_still_reading() {
    const FRAMES: u64 = 1000;
    if role().as_deref() == Some("consumer") {
        let rx = Consumer::attach(&channel_env(), &ConsumerOptions::new()).unwrap();
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
            let seed = u64::from_le_bytes(f.metadata()[..8].try_into().unwrap());
            k.spin(300_000, f.stream().unwrap()).unwrap();
            k.check_pattern(f.buffer().unwrap(), seed as u32, &bad, f.stream().unwrap())
                .unwrap();
            n += 1;
        }
        rx.stream().unwrap().synchronize().unwrap();
        tell(format!("done {n} {}", read_u64(&bad)));
        return;
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let name = format!("race-{}", std::process::id());
    let mut tx = Producer::create(&ctx, &name, &ChannelOptions::new(8 << 20).buffers(2)).unwrap();
    let mut c = Peer::spawn(RACE, "consumer", &[("CUDA_IPC_TEST_CHANNEL", &name)]);
    c.expect("ready", T);
    for i in 0..FRAMES {
        let f = tx.acquire(Some(T)).unwrap();
        k.spin(300_000, f.stream().unwrap()).unwrap();
        k.fill_pattern(f.buffer().unwrap(), i as u32, f.stream().unwrap())
            .unwrap();
        f.publish(&i.to_le_bytes()).unwrap();
    }
    let report = tx.close(T).unwrap();
    let done = c.expect("done", T);
    c.finish(T);
    println!(
        "race: {done} (frames received, mismatched words); forced holds {}",
        report.forced_holds
    );
    let mut it = done.split(' ').map(|x| x.parse::<u64>().unwrap());
    assert_eq!(it.next().unwrap(), FRAMES, "every frame delivered");
    assert_eq!(
        it.next().unwrap(),
        0,
        "a consumer read a buffer the producer was overwriting"
    );
}

const KILL_CONSUMER: &str =
    "a_consumer_killed_mid_frame_releases_its_hold_and_the_producer_goes_on";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_consumer_killed_mid_frame_releases_its_hold_and_the_producer_goes_on() {
    if role().as_deref() == Some("consumer") {
        let rx = Consumer::attach(&channel_env(), &ConsumerOptions::new()).unwrap();
        let k = Kernels::load(rx.context().unwrap()).unwrap();
        tell("ready");
        let f = rx.recv_timeout(T).unwrap();
        k.spin(10_000_000_000, f.stream().unwrap()).unwrap(); // mid-frame: 10 s of GPU work on it
        tell("holding");
        std::thread::sleep(T);
        return;
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let name = format!("killc-{}", std::process::id());
    let mut tx = Producer::create(&ctx, &name, &ChannelOptions::new(1 << 20).buffers(1)).unwrap();
    let mut c = Peer::spawn(
        KILL_CONSUMER,
        "consumer",
        &[("CUDA_IPC_TEST_CHANNEL", &name)],
    );
    c.expect("ready", T);
    let f = tx.acquire(Some(T)).unwrap();
    k.fill_pattern(f.buffer().unwrap(), 1, f.stream().unwrap())
        .unwrap();
    f.publish(&[]).unwrap();
    c.expect("holding", T);
    assert!(
        matches!(
            tx.acquire(Some(Duration::from_millis(100))),
            Err(Error::Timeout { .. })
        ),
        "the hold must block the only buffer"
    );
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    let t = Instant::now();
    let f = tx
        .acquire(Some(Duration::from_secs(5)))
        .expect("the dead consumer's hold must be released");
    let took = t.elapsed();
    k.fill_pattern(f.buffer().unwrap(), 2, f.stream().unwrap())
        .unwrap();
    f.publish(&[]).unwrap();
    let st = tx.stats();
    println!(
        "kill -9 consumer: producer got the buffer back {took:?} after the kill; forced releases {}",
        st.forced_releases
    );
    assert_eq!(st.forced_releases, 1);
    assert!(st.consumers.is_empty());
    assert!(took < Duration::from_secs(1));
    tx.close(Duration::from_secs(1)).unwrap();
}

const KILL_PRODUCER: &str = "consumers_of_a_producer_killed_mid_stream_get_producer_gone_promptly";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn consumers_of_a_producer_killed_mid_stream_get_producer_gone_promptly() {
    if role().as_deref() == Some("producer") {
        let ctx = ctx();
        let k = Kernels::load(&ctx).unwrap();
        let mut tx = Producer::create(
            &ctx,
            &channel_env(),
            &ChannelOptions::new(1 << 20).buffers(2),
        )
        .unwrap();
        tell("ready");
        for i in 0u64.. {
            let f = tx.acquire(None).unwrap();
            k.fill_pattern(f.buffer().unwrap(), i as u32, f.stream().unwrap())
                .unwrap();
            f.publish(&i.to_le_bytes()).unwrap();
        }
        return;
    }
    let ctx = ctx();
    let (free0, _) = ctx.memory_info().unwrap();
    let name = format!("killp-{}", std::process::id());
    let mut p = Peer::spawn(
        KILL_PRODUCER,
        "producer",
        &[("CUDA_IPC_TEST_CHANNEL", &name)],
    );
    p.expect("ready", T);
    let pid = p.child.id();
    {
        let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
        let k = Kernels::load(rx.context().unwrap()).unwrap();
        let bad = zeroed_counter(rx.context().unwrap());
        for _ in 0..200 {
            let f = rx.recv_timeout(T).unwrap();
            let seed = u64::from_le_bytes(f.metadata()[..8].try_into().unwrap());
            k.check_pattern(f.buffer().unwrap(), seed as u32, &bad, f.stream().unwrap())
                .unwrap();
        }
        rx.stream().unwrap().synchronize().unwrap();
        assert_eq!(read_u64(&bad), 0);
        p.child.kill().unwrap();
        p.child.wait().unwrap();
        let t = Instant::now();
        let e = loop {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(f) => drop(f), // frames published before the kill
                Err(e) => break e,
            }
        };
        let took = t.elapsed();
        println!("kill -9 producer: consumer got `{e}` {took:?} after the kill");
        assert!(
            matches!(e, Error::Channel(cuda_ipc::channel::ChannelError::ProducerGone { pid: x }) if x == pid),
            "{e}"
        );
        assert!(took < Duration::from_secs(1));
    }
    // A restarted producer replaces the dead one's segment.
    let tx = Producer::create(&ctx, &name, &ChannelOptions::new(1 << 20)).unwrap();
    drop(tx);
    let (free1, _) = ctx.memory_info().unwrap();
    let diff = free0 as i64 - free1 as i64;
    println!("device memory in use after every process exited differs by {diff} bytes");
    assert!(diff.abs() <= 4 << 20, "{diff} bytes not returned");
}

/// Durations too long for an `Instant` (`Duration::MAX`) mean "no bound", never a panic: a posted
/// receive waited for with one, then a close with one.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn unbounded_durations_wait_and_close_without_panicking() {
    let name = common::unique("maxdur");
    let ctx = ctx();
    let opts = ChannelOptions::new(4096).buffers(2).ring(true);
    let mut tx = Producer::create(&ctx, &name, &opts).unwrap();
    let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
    let posted = rx.post(|_| Ok(())).unwrap();
    assert_eq!(tx.acquire(Some(T)).unwrap().publish(b"m").unwrap(), 1);
    let f = posted.wait(Some(Duration::MAX)).unwrap();
    assert_eq!((f.seq(), f.metadata()), (1, b"m".as_slice()));
    drop(rx);
    let report = tx.close(Duration::MAX).unwrap();
    assert_eq!(report.forced_holds, 0);
}
