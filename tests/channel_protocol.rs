//! The channel's hand-off protocol on its control segment alone, without a GPU, driven through
//! `raw::channel::testing`: delivery policies and back-pressure, ring order, close and drain. The
//! protocol's internals (futex wake counts, the GPU words, a dead consumer's slot) are tested beside
//! the code, in `src/channel/handoff/tests.rs`.

use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelError, Delivery};
use cuda_ipc::raw::channel::testing::{ControlConsumer, ControlProducer};
use cuda_ipc::token::TOKEN_LEN;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// A channel of `buffers` 64-byte buffers and 4 consumer slots (in ring order when `ring`), under a
/// name of its own.
fn channel(buffers: usize, ring: bool) -> (ControlProducer, String) {
    static N: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "proto-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    let tokens = vec![[0u8; TOKEN_LEN]; buffers];
    let p = ControlProducer::create_with(&name, 64, 4, &tokens, ring).unwrap();
    (p, name)
}

fn attach(name: &str, delivery: Delivery) -> ControlConsumer {
    ControlConsumer::attach(name, delivery).unwrap()
}

fn is_closed<T>(r: &cuda_ipc::Result<T>) -> bool {
    matches!(r, Err(Error::Channel(ChannelError::Closed)))
}

const LONG: Option<Duration> = Some(Duration::from_secs(10));

#[test]
fn frames_published_just_before_close_are_still_delivered() {
    // The interleaving that lost frames: the consumer finds nothing new, then the producer
    // publishes and closes, then the consumer sees the channel closed.
    for policy in [Delivery::EveryFrame, Delivery::LatestOnly] {
        let (p, name) = channel(2, false);
        let c = attach(&name, policy);
        assert!(c.try_take().unwrap().is_none());
        let (i, _) = p.try_acquire().unwrap();
        p.publish(i, b"last").unwrap();
        p.close();
        let (_, seq, meta) = c.try_take().unwrap().expect("the last frame");
        assert_eq!((seq, meta.as_slice()), (1, &b"last"[..]));
        c.release(i);
        assert!(is_closed(&c.try_take()));
        drop(c);
        p.unlink();
    }
}

#[test]
fn a_consumer_racing_the_producers_close_always_gets_the_last_frame() {
    // Full speed on a pool of 2, both policies, many short runs: the close lands at every point of
    // the consumer's take.
    const N: u64 = 40;
    for policy in [Delivery::EveryFrame, Delivery::LatestOnly] {
        for _ in 0..300 {
            let (p, name) = channel(2, false);
            let c = attach(&name, policy);
            let last = std::thread::scope(|sc| {
                let consumer = sc.spawn(|| {
                    let mut last = 0;
                    loop {
                        match c.take(LONG) {
                            Ok(Some((i, seq, _))) => {
                                assert!(seq > last);
                                last = seq;
                                c.release(i);
                            }
                            Ok(None) => panic!("timed out"),
                            Err(Error::Channel(ChannelError::Closed)) => return last,
                            Err(e) => panic!("{e}"),
                        }
                    }
                });
                for _ in 0..N {
                    let (i, _) = p.acquire(LONG).unwrap().unwrap();
                    p.publish(i, b"").unwrap();
                }
                p.close();
                consumer.join().unwrap()
            });
            assert_eq!(last, N, "{policy:?}: the last frame was lost to the close");
            drop(c);
            p.unlink();
        }
    }
}

#[test]
fn ring_order_broadcasts_to_every_frame_and_latest_only_consumers_with_back_pressure() {
    let (p, name) = channel(3, true);
    let a = attach(&name, Delivery::EveryFrame);
    let b = attach(&name, Delivery::EveryFrame);
    let l = attach(&name, Delivery::LatestOnly);
    let (mut got_a, mut got_b, mut got_l) = (Vec::new(), Vec::new(), Vec::new());
    let mut s = 0u64;
    while s < 12 {
        match p.try_acquire() {
            Some((index, _)) => {
                s += 1;
                assert_eq!(index as u64, (s - 1) % 3, "ring order");
                p.publish(index, &s.to_le_bytes()).unwrap();
            }
            None => {
                // Back-pressure: the ring's next buffer holds a frame `b` (the slower one) has not
                // received; `a` keeps up, the latest-only consumer never holds back.
                assert!(
                    got_b.len() as u64 + 3 <= s,
                    "held back with b at {}",
                    got_b.len()
                );
                while let Some((i, seq, _)) = b.try_take().unwrap() {
                    got_b.push(seq);
                    b.release(i);
                }
            }
        }
        while let Some((i, seq, _)) = a.try_take().unwrap() {
            got_a.push(seq);
            a.release(i);
        }
        if let Some((i, seq, _)) = l.try_take().unwrap() {
            got_l.push(seq);
            l.release(i);
        }
    }
    while let Some((i, seq, _)) = b.try_take().unwrap() {
        got_b.push(seq);
        b.release(i);
    }
    let all: Vec<u64> = (1..=12).collect();
    assert_eq!((got_a, got_b), (all.clone(), all));
    assert_eq!(got_l.last(), Some(&12));
    assert!(got_l.windows(2).all(|w| w[0] < w[1]));
    drop((a, b, l));
    p.unlink();
}

#[test]
fn ring_order_puts_frame_s_in_buffer_s_minus_one_mod_b_and_waits_for_that_buffer() {
    let (p, name) = channel(3, true);
    let c = attach(&name, Delivery::EveryFrame);
    for s in 1..=3u64 {
        let (index, _) = p.try_acquire().unwrap();
        assert_eq!(index as u64, (s - 1) % 3);
        assert_eq!(p.publish(index, b"").unwrap(), s);
    }
    // Frame 4 goes to buffer 0, which the consumer has not received: no buffer, even though none
    // is held.
    assert!(p.try_acquire().is_none());
    let (i, seq, _) = c.try_take().unwrap().unwrap();
    assert_eq!((i, seq), (0, 1));
    // Held: still none.
    assert!(p.try_acquire().is_none());
    c.release(i);
    assert_eq!(p.try_acquire().unwrap(), (0, 1 << c.slot()));
    // Given back unpublished, the ring stays where it was.
    p.abandon(0);
    assert_eq!(p.try_acquire().unwrap().0, 0);
    drop(c);
    p.unlink();
}

#[test]
fn every_frame_consumer_gets_every_frame_in_order_and_back_pressure_holds_the_producer() {
    let (p, name) = channel(2, false);
    let c = attach(&name, Delivery::EveryFrame);
    // Two frames fill the pool; a third must wait for the consumer.
    for k in 1..=2u64 {
        let (i, _) = p.try_acquire().expect("free buffer");
        assert_eq!(p.publish(i, &k.to_le_bytes()).unwrap(), k);
    }
    assert!(
        p.try_acquire().is_none(),
        "overwrote a frame the consumer had not received"
    );
    let (i1, s1, m1) = c.try_take().unwrap().unwrap();
    assert_eq!((s1, m1.as_slice()), (1, &1u64.to_le_bytes()[..]));
    // Received but still held: the buffer is not free yet.
    assert!(p.try_acquire().is_none(), "overwrote a held buffer");
    c.release(i1);
    let (i, used) = p.try_acquire().expect("released buffer");
    assert_eq!(i, i1);
    assert_eq!(
        used,
        1 << c.slot(),
        "the write must wait on this consumer's release word"
    );
    p.publish(i, b"3").unwrap();
    let (_, s2, _) = c.try_take().unwrap().unwrap();
    assert_eq!(s2, 2);
    let st = p.stats();
    assert_eq!(st.published, 3);
    assert_eq!(st.consumers[0].received, 2);
    assert_eq!(st.consumers[0].in_flight, 1);
    assert_eq!(st.consumers[0].lag, 1);
    drop(c);
    p.unlink();
}

#[test]
fn latest_only_consumer_skips_and_counts_dropped_frames_without_holding_the_producer_back() {
    let (p, name) = channel(3, false);
    let c = attach(&name, Delivery::LatestOnly);
    for k in 1..=10u64 {
        let (i, _) = p
            .try_acquire()
            .expect("latest-only must never block the producer");
        p.publish(i, &[]).unwrap();
        assert_eq!(k, p.stats().head);
    }
    let (i, seq, _) = c.try_take().unwrap().unwrap();
    assert_eq!(seq, 10);
    assert_eq!(p.stats().consumers[0].dropped, 9);
    // While held, the producer keeps going with the other buffers, never this one.
    for _ in 0..10 {
        let (j, _) = p.try_acquire().unwrap();
        assert_ne!(j, i);
        p.publish(j, &[]).unwrap();
    }
    c.release(i);
    assert_eq!(c.try_take().unwrap().unwrap().1, 20);
    drop(c);
    p.unlink();
}

#[test]
fn broadcast_waits_for_the_slowest_every_frame_consumer() {
    let (p, name) = channel(2, false);
    let a = attach(&name, Delivery::EveryFrame);
    let b = attach(&name, Delivery::EveryFrame);
    assert_ne!(a.slot(), b.slot());
    for _ in 0..2 {
        let (i, _) = p.try_acquire().unwrap();
        p.publish(i, &[]).unwrap();
    }
    let (ia, _, _) = a.try_take().unwrap().unwrap();
    a.release(ia);
    assert!(p.try_acquire().is_none(), "b has not received frame 1");
    let (ib, _, _) = b.try_take().unwrap().unwrap();
    b.release(ib);
    let (_, used) = p.try_acquire().unwrap();
    assert_eq!(used, (1 << a.slot()) | (1 << b.slot()));
    drop((a, b));
    p.unlink();
}

#[test]
fn closed_channel_delivers_what_was_published_then_reports_closed() {
    let (p, name) = channel(2, false);
    let c = attach(&name, Delivery::EveryFrame);
    let (i, _) = p.try_acquire().unwrap();
    p.publish(i, &[]).unwrap();
    p.close();
    let (i, _, _) = c.take(Some(Duration::from_secs(1))).unwrap().unwrap();
    assert!(is_closed(&c.take(Some(Duration::from_secs(1)))));
    // A hold still out is forced at the drain deadline and counted.
    assert_eq!(p.drain(Duration::from_millis(50)), 1);
    c.release(i);
    drop(c);
    p.unlink();
}

#[test]
fn a_waiting_consumer_is_woken_by_a_publish_from_another_thread() {
    let (p, name) = channel(2, false);
    let c = attach(&name, Delivery::EveryFrame);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            let (i, _) = p.try_acquire().unwrap();
            p.publish(i, b"x").unwrap();
        });
        let got = c.take(Some(Duration::from_secs(5))).unwrap().unwrap();
        assert_eq!(got.2, b"x");
    });
    assert!(c.take(Some(Duration::from_millis(10))).unwrap().is_none());
    drop(c);
    p.unlink();
}

#[test]
fn close_waits_for_frames_published_but_not_yet_received_then_withdraws_them() {
    let (p, name) = channel(2, false);
    let c = attach(&name, Delivery::EveryFrame);
    for _ in 0..2 {
        let (i, _) = p.try_acquire().unwrap();
        p.publish(i, &[]).unwrap();
    }
    p.close();
    std::thread::scope(|s| {
        let drained = s.spawn(|| p.drain(Duration::from_secs(5)));
        for want in 1..=2 {
            std::thread::sleep(Duration::from_millis(20));
            let (i, seq, _) = c.take(Some(Duration::from_secs(1))).unwrap().unwrap();
            assert_eq!(seq, want);
            c.release(i);
        }
        assert_eq!(drained.join().unwrap(), 0, "the consumer got both frames");
    });
    assert!(is_closed(&c.take(Some(Duration::from_secs(1)))));
    drop(c);
    p.unlink();
    // After a drain that timed out, frames left are withdrawn, never delivered from freed memory.
    let (p, name) = channel(2, false);
    let c = attach(&name, Delivery::EveryFrame);
    let (i, _) = p.try_acquire().unwrap();
    p.publish(i, &[]).unwrap();
    p.close();
    assert_eq!(p.drain(Duration::from_millis(30)), 0);
    assert!(is_closed(&c.take(Some(Duration::from_secs(1)))));
    drop(c);
    p.unlink();
}
