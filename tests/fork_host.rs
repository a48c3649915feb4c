//! A process forked from one that uses the crate inherits copies of its objects: a channel's
//! producer and consumer with a held frame, a tensor set's writer and reader with a held
//! generation, a registry handle. In the child, every call on them is refused with
//! `Error::ForkedChild`, and dropping them (what a child's normal exit does, Python's included)
//! changes nothing of the parent's: the channel and the set keep their names, the consumer its
//! slot, the reader its hold, the registry its participant. Objects the child makes itself work.
//!
//! Each case runs in a process of its own (this binary again, one test thread), so that the
//! fork happens where no other test's thread holds a lock.

mod common;

use common::{Peer, drop_copy, forked, refused, role, take_copy, unique};
use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
use cuda_ipc::registry::{Registry, RegistryOptions};
use cuda_ipc::tensorset::{
    DType, GenerationMode, ReaderOptions, TensorSetOptions, TensorSetReader, TensorSetWriter,
    TensorSpec,
};
use std::path::Path;
use std::time::Duration;

const ANSWER: Duration = Duration::from_secs(60);

/// Runs `test` of this binary in a process of its own with role `fork`, and waits for it.
fn in_own_process(test: &str) {
    let p = Peer::spawn(test, "fork", &[]);
    p.finish(ANSWER);
}

#[test]
fn a_forked_child_neither_uses_nor_drops_its_parents_channel() {
    match role().as_deref() {
        Some("fork") => {}
        Some(_) => return,
        None => return in_own_process("a_forked_child_neither_uses_nor_drops_its_parents_channel"),
    }
    let name = unique("fork-ch");
    let mut tx = Producer::create_host(&name, &ChannelOptions::new(4096).buffers(2)).unwrap();
    let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
    let mut f = tx.acquire(Some(ANSWER)).unwrap();
    f.write_at(0, b"one").unwrap();
    f.publish(b"").unwrap();
    let held = rx.recv_timeout(ANSWER).unwrap();
    let held_buffer = held.index();

    let wrong = forked(|| {
        let mut wrong = Vec::new();
        refused("try_recv", rx.try_recv().map(|_| ()), &mut wrong);
        refused(
            "recv_timeout",
            rx.recv_timeout(Duration::from_millis(10)).map(|_| ()),
            &mut wrong,
        );
        refused("read_at", held.read_at(0, &mut [0u8; 3]), &mut wrong);
        refused("to_vec", held.to_vec(), &mut wrong);
        // The accessors that hand out driver objects or addresses refuse before they tell a
        // host channel from a GPU one (the GPU form: tests/fork_gpu.rs).
        refused(
            "the held frame's stream",
            held.stream().map(|_| ()),
            &mut wrong,
        );
        // SAFETY: a null stream names the context's default stream; the call is refused before
        // any use of it.
        let raw = unsafe { held.ready_on_raw(std::ptr::null_mut()) };
        refused("the held frame's ready_on_raw", raw, &mut wrong);
        refused("the consumer's stream", rx.stream().map(|_| ()), &mut wrong);
        refused(
            "the consumer's context",
            rx.context().map(|_| ()),
            &mut wrong,
        );
        refused(
            "the gate words' address",
            rx.gate_device_ptr().map(|_| ()),
            &mut wrong,
        );
        refused("the producer's stream", tx.stream().map(|_| ()), &mut wrong);
        refused(
            "the producer's context",
            tx.context().map(|_| ()),
            &mut wrong,
        );
        refused("try_acquire", tx.try_acquire().map(|_| ()), &mut wrong);
        refused(
            "acquire",
            tx.acquire(Some(Duration::from_millis(10))).map(|_| ()),
            &mut wrong,
        );
        // What the child's exit does to what it inherited: drop it all.
        drop_copy(&held);
        drop_copy(&rx);
        refused(
            "close",
            take_copy(&tx).close(Duration::from_secs(1)),
            &mut wrong,
        );
        // Its own objects work: a channel of its own, end to end.
        let own = format!("{name}-child");
        match Producer::create_host(&own, &ChannelOptions::new(64).buffers(1)) {
            Ok(mut p) => {
                let c = Consumer::attach(&own, &ConsumerOptions::new()).unwrap();
                let f = p.acquire(Some(ANSWER)).unwrap();
                f.publish(b"own").unwrap();
                if c.recv_timeout(ANSWER).map(|f| f.metadata() == b"own").ok() != Some(true) {
                    wrong.push("the child's own channel did not deliver".into());
                }
                drop(c);
                p.close(Duration::from_secs(1)).unwrap();
            }
            Err(e) => wrong.push(format!("the child's own channel: {e}")),
        }
        wrong
    });
    assert!(wrong.is_empty(), "{wrong:?}");

    // The parent's channel is as it was: its name, the consumer's slot and its hold.
    assert!(Path::new(&format!("/dev/shm/cuda-ipc.ch.{name}")).exists());
    let snap = cuda_ipc::channel::inspect::inspect(&name).unwrap();
    assert_eq!(snap.consumers.len(), 1, "{snap:?}");
    assert_eq!(snap.consumers[0].holds, vec![held_buffer], "{snap:?}");
    // The held frame's buffer stays the consumer's: the other one is taken, then none is free.
    let f = tx.acquire(Some(ANSWER)).unwrap();
    assert_ne!(f.index(), held_buffer);
    f.publish(b"two").unwrap();
    assert!(matches!(
        tx.acquire(Some(Duration::from_millis(100))),
        Err(Error::Timeout { .. })
    ));
    // The parent's own copies still work: the frame it holds, then the next one.
    let mut one = [0u8; 3];
    held.read_at(0, &mut one).unwrap();
    assert_eq!(&one, b"one");
    drop(held);
    let two = rx.try_recv().unwrap().expect("frame two");
    assert_eq!(two.metadata(), b"two");
    drop(two);
    drop(rx);
    tx.close(Duration::from_secs(5)).unwrap();
    assert!(!Path::new(&format!("/dev/shm/cuda-ipc.ch.{name}")).exists());
}

#[test]
fn a_forked_child_neither_uses_nor_drops_its_parents_tensor_set() {
    match role().as_deref() {
        Some("fork") => {}
        Some(_) => return,
        None => {
            return in_own_process("a_forked_child_neither_uses_nor_drops_its_parents_tensor_set");
        }
    }
    let name = unique("fork-ts");
    let specs = [TensorSpec::new("w", DType::F32, &[4])];
    let opts = TensorSetOptions::new().mode(GenerationMode::InPlace);
    let mut w = TensorSetWriter::create_host(&name, &specs, &opts).unwrap();
    let mut u = w.begin(Some(ANSWER)).unwrap();
    u.write_tensor(0, &[1u8; 16]).unwrap();
    u.commit().unwrap();
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let hold = r.current().unwrap().expect("generation 1");
    assert_eq!(hold.generation(), 1);

    let wrong = forked(|| {
        let mut wrong = Vec::new();
        refused("current", r.current().map(|_| ()), &mut wrong);
        refused("read_tensor", hold.read_tensor(0), &mut wrong);
        refused("the hold's stream", hold.stream().map(|_| ()), &mut wrong);
        refused("the hold's context", hold.context().map(|_| ()), &mut wrong);
        refused("the reader's stream", r.stream().map(|_| ()), &mut wrong);
        refused("the reader's context", r.context().map(|_| ()), &mut wrong);
        refused("the writer's stream", w.stream().map(|_| ()), &mut wrong);
        refused(
            "the writer's tensor address",
            w.device_ptr(0, 0),
            &mut wrong,
        );
        refused(
            "wait_newer",
            r.wait_newer(1, Some(Duration::from_millis(10))).map(|_| ()),
            &mut wrong,
        );
        refused(
            "begin",
            w.begin(Some(Duration::from_millis(10))).map(|_| ()),
            &mut wrong,
        );
        drop_copy(&hold);
        drop_copy(&r);
        refused(
            "close",
            take_copy(&w).close(Duration::from_secs(1)),
            &mut wrong,
        );
        // A reader of its own opens the parent's set and reads generation 1.
        match TensorSetReader::open_host(&name, &ReaderOptions::new()) {
            Ok(own) => {
                if own.current().ok().flatten().map(|h| h.generation()) != Some(1) {
                    wrong.push("the child's own reader did not hold generation 1".into());
                }
            }
            Err(e) => wrong.push(format!("the child's own reader: {e}")),
        }
        wrong
    });
    assert!(wrong.is_empty(), "{wrong:?}");

    // The set stands, and the parent's reader still holds generation 1: an in-place `begin`
    // waits for that hold.
    let snap = cuda_ipc::tensorset::inspect::inspect(&name).unwrap();
    assert_eq!(snap.holds, 1, "{snap:?}");
    assert!(matches!(
        w.begin(Some(Duration::from_millis(200))).map(|_| ()),
        Err(Error::Timeout { .. })
    ));
    drop(hold);
    let mut u = w.begin(Some(ANSWER)).unwrap();
    u.write_tensor(0, &[2u8; 16]).unwrap();
    assert_eq!(u.commit().unwrap(), 2);
    let h = r.wait_newer(1, Some(ANSWER)).unwrap();
    assert_eq!(h.generation(), 2);
    drop(h);
    drop(r);
    w.close(Duration::from_secs(5)).unwrap();
}

#[test]
fn a_forked_child_neither_writes_nor_leaves_its_parents_registry() {
    match role().as_deref() {
        Some("fork") => {}
        Some(_) => return,
        None => {
            return in_own_process("a_forked_child_neither_writes_nor_leaves_its_parents_registry");
        }
    }
    let name = unique("fork-reg");
    let reg = Registry::create(&name, &RegistryOptions::new()).unwrap();
    reg.publish("before", 1, b"t", b"").unwrap();
    let me = reg.identity();

    let wrong = forked(|| {
        let mut wrong = Vec::new();
        refused("publish", reg.publish("child", 1, b"t", b""), &mut wrong);
        refused("remove", reg.remove("before"), &mut wrong);
        // Reading is harmless.
        if reg.get("before").ok().flatten().is_none() {
            wrong.push("get: the parent's record was not read".into());
        }
        drop_copy(&reg);
        wrong
    });
    assert!(wrong.is_empty(), "{wrong:?}");
    assert!(reg.participants().contains(&me), "the parent left");
    assert!(reg.get("child").unwrap().is_none());
    assert!(reg.get("before").unwrap().is_some());
    reg.publish("after", 1, b"t", b"").unwrap();
    let _ = std::fs::remove_file(format!("/dev/shm/{}", reg.name()));
}

/// An update and a write frame open at the fork: the child's copies write, copy and publish
/// nothing; the parent publishes its own bytes.
#[test]
fn a_forked_child_writes_nothing_through_its_parents_open_update_or_frame() {
    match role().as_deref() {
        Some("fork") => {}
        Some(_) => return,
        None => {
            return in_own_process(
                "a_forked_child_writes_nothing_through_its_parents_open_update_or_frame",
            );
        }
    }
    let name = unique("fork-open");
    let specs = [TensorSpec::new("w", DType::U8, &[4])];
    let opts = TensorSetOptions::new().mode(GenerationMode::Buffered(2));
    let mut w = TensorSetWriter::create_host(&name, &specs, &opts).unwrap();
    let mut u = w.begin(Some(ANSWER)).unwrap();
    u.write_tensor(0, b"GEN1").unwrap();
    u.commit().unwrap();
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let mut tx = Producer::create_host(&name, &ChannelOptions::new(4).buffers(1)).unwrap();
    let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
    let mut u = w.begin(Some(ANSWER)).unwrap();
    u.write_tensor(0, b"PPPP").unwrap();
    let mut f = tx.acquire(Some(ANSWER)).unwrap();
    f.write_at(0, b"PPPP").unwrap();

    let wrong = forked(|| {
        let mut wrong = Vec::new();
        let mut uc = take_copy(&u);
        refused("write_tensor", uc.write_tensor(0, b"CHLD"), &mut wrong);
        refused("copy_from_previous", uc.copy_from_previous(), &mut wrong);
        refused("as_mut_ptr", uc.as_mut_ptr(), &mut wrong);
        refused("the update's stream", uc.stream().map(|_| ()), &mut wrong);
        refused("commit", uc.commit(), &mut wrong);
        let mut fc = take_copy(&f);
        refused("write_at", fc.write_at(0, b"CHLD"), &mut wrong);
        refused("read_at", fc.read_at(0, &mut [0u8; 4]), &mut wrong);
        refused("the frame's stream", fc.stream().map(|_| ()), &mut wrong);
        // SAFETY: a null stream names the context's default stream; the call is refused before
        // any use of it.
        let raw = unsafe { fc.ready_on_raw(std::ptr::null_mut()) };
        refused("ready_on_raw", raw, &mut wrong);
        // SAFETY: as above.
        let raw = unsafe { fc.publish_after_raw(std::ptr::null_mut()) };
        refused("publish_after_raw", raw, &mut wrong);
        refused("publish", fc.publish(b""), &mut wrong);
        wrong
    });
    assert!(wrong.is_empty(), "{wrong:?}");
    assert_eq!(u.commit().unwrap(), 2);
    f.publish(b"").unwrap();
    assert_eq!(
        r.current().unwrap().unwrap().read_tensor(0).unwrap(),
        b"PPPP"
    );
    assert_eq!(rx.recv_timeout(ANSWER).unwrap().to_vec().unwrap(), b"PPPP");
    drop(rx);
    tx.close(Duration::from_secs(5)).unwrap();
    drop(r);
    w.close(Duration::from_secs(5)).unwrap();
}
