//! The producer's unit tests.

use super::super::{Consumer, ConsumerOptions};
use super::*;

#[test]
fn a_memoryless_channel_hands_out_generations_and_takes_the_head_again() {
    let ch = format!("memless-unit-{}", std::process::id());
    let prefix = "cuda-ipc.tg.";
    let opts = ChannelOptions::new(0).buffers(2);
    let mut tx = Producer::create_memoryless(None, prefix, &ch, &opts).unwrap();
    assert!(crate::shm::Segment::stat(&format!("{prefix}{ch}")).is_ok());
    assert!(crate::shm::Segment::stat(&format!("cuda-ipc.ch.{ch}")).is_err());
    assert!(crate::shm::Segment::stat(&format!("cuda-ipc.hp.{ch}")).is_err());
    // Not a user channel: attach refuses it, the memoryless attach takes it.
    assert!(Consumer::attach(&ch, &ConsumerOptions::new()).is_err());
    let co = ConsumerOptions::new().delivery(super::super::Delivery::LatestOnly);
    let rx =
        Consumer::attach_memoryless(None, prefix, &ch, &co, &mut std::time::Duration::default())
            .unwrap();
    let lock = std::sync::Mutex::new(());
    assert!(
        rx.take_newer(0, Some(Duration::ZERO), &lock, |_, _| false)
            .unwrap()
            .is_none()
    );
    let w = tx.acquire(Some(Duration::ZERO)).unwrap();
    assert_eq!(w.len(), 0);
    assert_eq!(w.publish(b"g1").unwrap(), 1);
    let (f, g) = rx
        .take_newer(0, Some(Duration::ZERO), &lock, |_, _| false)
        .unwrap()
        .unwrap();
    drop(g);
    assert_eq!((f.seq(), f.metadata()), (1, &b"g1"[..]));
    drop(f);
    // The same generation again, regardless of the cursor.
    let (f, g) = rx
        .take_newer(0, None, &lock, |_, _| false)
        .unwrap()
        .unwrap();
    drop(g);
    assert_eq!(f.seq(), 1);
    // Newer than 1: none within the timeout.
    assert!(
        rx.take_newer(1, Some(Duration::from_millis(20)), &lock, |_, _| false)
            .unwrap()
            .is_none()
    );
    drop(f);
    tx.acquire(None).unwrap().publish(b"g2").unwrap();
    let (f, _g) = rx
        .take_newer(1, Some(Duration::from_secs(1)), &lock, |_, _| false)
        .unwrap()
        .unwrap();
    assert_eq!(f.seq(), 2);
}

#[test]
fn lent_buffers_are_out_at_once_published_in_resume_order_and_given_back_when_dropped() {
    let ch = format!("lent-unit-{}", std::process::id());
    let mut tx = Producer::create_host(&ch, &ChannelOptions::new(64).buffers(4)).unwrap();
    let rx = Consumer::attach(&ch, &ConsumerOptions::new()).unwrap();
    let a = tx.lend(Some(Duration::ZERO)).unwrap().unwrap();
    let b = tx.lend(Some(Duration::ZERO)).unwrap().unwrap();
    let c = tx.lend(Some(Duration::ZERO)).unwrap().unwrap();
    assert_ne!(a.index(), b.index());
    assert_ne!(b.index(), c.index());
    assert_ne!(a.index(), c.index());
    // Published in the order resumed: b first, then a; c is given back unpublished.
    let (ia, ib) = (a.index(), b.index());
    let mut w = tx.resume(b).unwrap();
    w.write_at(0, b"second lent").unwrap();
    assert_eq!(w.publish(b"b").unwrap(), 1);
    assert_eq!(tx.resume(a).unwrap().publish(b"a").unwrap(), 2);
    drop(c);
    let f = rx.recv_timeout(Duration::from_secs(1)).unwrap();
    assert_eq!((f.seq(), f.index(), f.metadata()), (1, ib, &b"b"[..]));
    let mut got = [0u8; 11];
    f.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"second lent");
    drop(f);
    let f = rx.recv_timeout(Duration::from_secs(1)).unwrap();
    assert_eq!((f.seq(), f.index()), (2, ia));
    drop(f);
    // Every buffer is free again: four acquires in a row succeed.
    let lent: Vec<LentFrame> = (0..4)
        .map(|_| tx.lend(Some(Duration::ZERO)).unwrap().unwrap())
        .collect();
    assert!(tx.try_acquire().unwrap().is_none());
    drop(lent);
    assert!(tx.try_acquire().unwrap().is_some());
    // A buffer lent by another producer is refused, and goes back to its own channel.
    let ch2 = format!("lent-unit-other-{}", std::process::id());
    let mut other = Producer::create_host(&ch2, &ChannelOptions::new(64).buffers(1)).unwrap();
    let foreign = other.lend(Some(Duration::ZERO)).unwrap().unwrap();
    assert!(matches!(tx.resume(foreign), Err(Error::InvalidArgument(_))));
    assert!(other.try_acquire().unwrap().is_some());
}
