//! Pipelines across two GPUs: a producer on one device and a consumer on the other, through the
//! channel, with legacy and VMM pools, and with the consumer seeing the devices in the opposite order
//! (`CUDA_VISIBLE_DEVICES`). They need two CUDA GPUs with peer access and fail on a machine with
//! fewer; `cargo test` lists them as ignored.

mod common;

use common::{Peer, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, MemoryKind, Producer};
use cuda_ipc::driver::{Device, DeviceMemory, Uuid};
use cuda_ipc::raw::kernels::Kernels;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
const FRAMES: u64 = 1000;
const BYTES: usize = 3840 * 2160 * 4;
const TEST: &str = "a_consumer_on_the_other_gpu_checks_every_frame";

fn consumer() {
    let name = std::env::var("CUDA_IPC_TEST_CHANNEL").unwrap();
    let producer: Uuid = std::env::var("CUDA_IPC_TEST_PRODUCER_UUID")
        .unwrap()
        .parse()
        .unwrap();
    // The device that is not the producer's, found by UUID whatever the order here.
    let dev = Device::all()
        .unwrap()
        .into_iter()
        .find(|d| d.uuid() != producer)
        .expect("a second GPU");
    let producer_ordinal = Device::by_uuid(producer).unwrap().ordinal();
    let ctx = dev.primary_context().unwrap();
    let rx = Consumer::attach_in(&ctx, &name, &ConsumerOptions::new()).unwrap();
    let k = Kernels::load(&ctx).unwrap();
    let bad = zeroed_counter(&ctx);
    tell(format!(
        "ready {} {} {producer_ordinal}",
        dev.uuid(),
        dev.ordinal()
    ));
    let mut n = 0u64;
    loop {
        let f = match rx.recv_timeout(T) {
            Ok(f) => f,
            Err(Error::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(f.buffer().unwrap().context().device().uuid(), dev.uuid());
        let seed = u64::from_le_bytes(f.metadata()[..8].try_into().unwrap());
        k.check_pattern(f.buffer().unwrap(), seed as u32, &bad, f.stream().unwrap())
            .unwrap();
        n += 1;
    }
    rx.stream().unwrap().synchronize().unwrap();
    tell(format!("done {n} {}", read_u64(&bad)));
}

fn run(kind: MemoryKind, reversed: bool) {
    let devices = Device::all().expect("a CUDA driver");
    assert!(
        devices.len() >= 2,
        "this test needs two CUDA GPUs, {} visible",
        devices.len()
    );
    let ctx = devices[0].primary_context().unwrap();
    let k = Kernels::load(&ctx).unwrap();
    let name = format!("xgpu-{}-{kind:?}-{reversed}", std::process::id());
    let opts = ChannelOptions::new(BYTES).memory(kind);
    let mut tx = Producer::create(&ctx, &name, &opts).unwrap();
    let uuid = devices[0].uuid().to_string();
    // The parent sees the devices in the default order; the child sees them as given here.
    let order = if reversed { "1,0" } else { "0,1" };
    let mut c = Peer::spawn(
        TEST,
        "consumer",
        &[
            ("CUDA_IPC_TEST_CHANNEL", &name),
            ("CUDA_IPC_TEST_PRODUCER_UUID", &uuid),
            ("CUDA_VISIBLE_DEVICES", order),
        ],
    );
    let ready = c.expect("ready", T);
    let mut it = ready.split(' ');
    let (cu, co, po) = (
        it.next().unwrap().to_string(),
        it.next().unwrap().to_string(),
        it.next().unwrap().to_string(),
    );
    assert_ne!(cu, uuid, "the consumer must run on the other GPU");
    let t = Instant::now();
    for i in 0..FRAMES {
        let f = tx.acquire(Some(T)).unwrap();
        k.fill_pattern(f.buffer().unwrap(), i as u32, f.stream().unwrap())
            .unwrap();
        f.publish(&i.to_le_bytes()).unwrap();
    }
    tx.close(T).unwrap();
    let done = c.expect("done", T);
    c.finish(T);
    let secs = t.elapsed().as_secs_f64();
    println!(
        "{kind:?} pool, CUDA_VISIBLE_DEVICES={order} in the consumer: producer on {uuid} (ordinal 0 here, {po} there), \
         consumer on {cu} (ordinal {co} there); {FRAMES} 4K frames in {secs:.2} s ({:.0} frames/s); (received, mismatched words) = {done}",
        FRAMES as f64 / secs
    );
    if reversed {
        assert_eq!(po, "1", "the consumer sees the producer's GPU as ordinal 1");
        assert_eq!(co, "0");
    }
    assert_eq!(done, format!("{FRAMES} 0"));
}

#[test]
#[ignore = "needs two CUDA GPUs (scripts/gpu-test.sh on a two-GPU machine)"]
fn a_consumer_on_the_other_gpu_checks_every_frame() {
    if role().as_deref() == Some("consumer") {
        return consumer();
    }
    for kind in [MemoryKind::Legacy, MemoryKind::Vmm] {
        for reversed in [false, true] {
            run(kind, reversed);
        }
    }
}
