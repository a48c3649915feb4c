//! A child forked from a process with a GPU channel and a GPU tensor set (VMM, the defaults):
//! CUDA does not survive `fork`, so every call on the inherited objects, the context included, is
//! refused with `Error::ForkedChild` before any driver call, and dropping them (the child's exit)
//! makes no driver call and changes nothing of the parent's: its consumer keeps its slot and the
//! frame it holds, its reader its hold, and both go on with their data checked on the GPU. They
//! need a CUDA GPU and fail without one; `cargo test` lists them as ignored.

mod common;

use common::{Peer, ctx, drop_copy, forked, read_u64, refused, role, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::tensorset::{
    DType, ReaderOptions, TensorSetOptions, TensorSetReader, TensorSetWriter, TensorSpec,
};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const TEST: &str = "a_forked_child_makes_no_driver_call_and_leaves_the_parents_gpu_objects_alone";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_forked_child_makes_no_driver_call_and_leaves_the_parents_gpu_objects_alone() {
    match role().as_deref() {
        Some("fork") => {}
        Some(_) => return,
        None => return Peer::spawn(TEST, "fork", &[]).finish(T),
    }
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let bad = zeroed_counter(&ctx);
    let pid = std::process::id();

    // A channel of two 1 MiB buffers, its consumer holding frame 1.
    let name = format!("fork-gpu-{pid}");
    let mut tx = Producer::create(&ctx, &name, &ChannelOptions::new(1 << 20).buffers(2)).unwrap();
    let rx = Consumer::attach_in(&ctx, &name, &ConsumerOptions::new()).unwrap();
    let f = tx.acquire(Some(T)).unwrap();
    k.fill_pattern(f.buffer().unwrap(), 1, f.stream().unwrap())
        .unwrap();
    f.publish(b"").unwrap();
    let held = rx.recv_timeout(T).unwrap();

    // A tensor set in place, its reader holding generation 1.
    let set = format!("fork-gpu-set-{pid}");
    let specs = [TensorSpec::new("w", DType::F32, &[1 << 18])];
    let mut w = TensorSetWriter::create(&ctx, &set, &specs, &TensorSetOptions::new()).unwrap();
    let u = w.begin(Some(T)).unwrap();
    k.fill_pattern(&u.device_tensor(0).unwrap(), 11, u.stream().unwrap())
        .unwrap();
    u.commit().unwrap();
    let r = TensorSetReader::open(&ctx, &set, &ReaderOptions::new()).unwrap();
    let hold = r.current().unwrap().expect("generation 1");

    let wrong = forked(|| {
        let mut wrong = Vec::new();
        refused("the context's synchronize", ctx.synchronize(), &mut wrong);
        refused(
            "the held frame's stream",
            held.stream().map(|_| ()),
            &mut wrong,
        );
        refused("try_recv", rx.try_recv().map(|_| ()), &mut wrong);
        refused(
            "acquire",
            tx.acquire(Some(Duration::from_millis(10))).map(|_| ()),
            &mut wrong,
        );
        refused("current", r.current().map(|_| ()), &mut wrong);
        refused(
            "begin",
            w.begin(Some(Duration::from_millis(10))).map(|_| ()),
            &mut wrong,
        );
        drop_copy(&hold);
        drop_copy(&r);
        drop_copy(&w);
        drop_copy(&held);
        drop_copy(&rx);
        drop_copy(&tx);
        drop_copy(&k);
        drop_copy(&bad);
        wrong
    });
    assert!(wrong.is_empty(), "{wrong:?}");

    // The parent's frame is still its consumer's and still frame 1 on the GPU.
    let s = held.stream().unwrap();
    k.check_pattern(held.buffer().unwrap(), 1, &bad, s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(read_u64(&bad), 0, "frame 1 changed");
    let f = tx.acquire(Some(T)).unwrap();
    assert_ne!(f.index(), held.index(), "the held buffer was handed out");
    k.fill_pattern(f.buffer().unwrap(), 2, f.stream().unwrap())
        .unwrap();
    f.publish(b"").unwrap();
    assert!(matches!(
        tx.acquire(Some(Duration::from_millis(200))),
        Err(Error::Timeout { .. })
    ));
    drop(held);
    let two = rx.recv_timeout(T).unwrap();
    let s = two.stream().unwrap();
    k.check_pattern(two.buffer().unwrap(), 2, &bad, s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(read_u64(&bad), 0, "frame 2 is wrong");
    drop(two);

    // The reader still holds generation 1: an in-place begin waits for it; then generation 2.
    let s = hold.stream().unwrap();
    k.check_pattern(&hold.device_tensor(0).unwrap(), 11, &bad, s)
        .unwrap();
    s.synchronize().unwrap();
    assert_eq!(read_u64(&bad), 0, "generation 1 changed");
    assert!(matches!(
        w.begin(Some(Duration::from_millis(200))).map(|_| ()),
        Err(Error::Timeout { .. })
    ));
    drop(hold);
    let u = w.begin(Some(T)).unwrap();
    k.fill_pattern(&u.device_tensor(0).unwrap(), 12, u.stream().unwrap())
        .unwrap();
    assert_eq!(u.commit().unwrap(), 2);
    let h = r.wait_newer(1, Some(T)).unwrap();
    let s = h.stream().unwrap();
    k.check_pattern(&h.device_tensor(0).unwrap(), 12, &bad, s)
        .unwrap();
    s.synchronize().unwrap();
    assert_eq!(read_u64(&bad), 0, "generation 2 is wrong");
    drop(h);
    drop(r);
    w.close(Duration::from_secs(5)).unwrap();
    drop(rx);
    tx.close(Duration::from_secs(5)).unwrap();
}
