//! The protocol's internals, tested beside the code: futex wakes on the hot path, the GPU words
//! and the gate, release words, a dead consumer's slot. The protocol as a consumer and a producer
//! see it is tested through `raw::channel::testing` in `tests/channel_protocol.rs`.

use super::*;
use crate::channel::control::tests::channel;
use crate::channel::wait::take_wakes;

#[test]
fn a_hand_off_nobody_sleeps_for_makes_no_futex_wake() {
    // Publish, take, release, abandon, a take that finds nothing: every bump of the hot
    // path, with no waiter counted, stays out of the kernel.
    let (c, _name) = channel(2);
    let slot = c.attach(Delivery::EveryFrame).unwrap();
    take_wakes();
    for _ in 0..100 {
        let Claim { index: i, .. } = c.try_acquire().unwrap();
        c.publish(i, b"frame").unwrap();
        let (j, _, meta) = c.try_take(slot).unwrap().expect("the frame");
        assert_eq!((j, meta.as_slice()), (i, &b"frame"[..]));
        assert!(c.try_take(slot).unwrap().is_none());
        c.release(slot, j);
    }
    let Claim { index: i, .. } = c.try_acquire().unwrap();
    c.abandon(i);
    assert_eq!(take_wakes(), (0, 0));
    // A consumer asleep in `take` is counted: the next publish wakes it.
    std::thread::scope(|s| {
        let consumer = s.spawn(|| {
            c.take(
                slot,
                WaitStrategy::Block,
                Some(Duration::from_secs(10)),
                &Default::default(),
            )
            .unwrap()
            .expect("woken for the frame")
        });
        while c.header().publish_sleepers.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let Claim { index: i, .. } = c.try_acquire().unwrap();
        c.publish(i, b"late").unwrap();
        let (calls, _) = take_wakes();
        assert_eq!(calls, 1, "the publish did not wake the counted consumer");
        let (j, _, meta) = consumer.join().unwrap();
        assert_eq!(meta, b"late");
        c.release(slot, j);
    });
    assert_eq!(c.header().publish_sleepers.load(Ordering::SeqCst), 0);
    assert_eq!(c.header().release_sleepers.load(Ordering::SeqCst), 0);
    c.unlink();
}

#[test]
fn the_gpu_words_are_page_aligned_and_closing_the_gate_lets_every_wait_go_without_lowering_a_word()
{
    let (c, _name) = channel(3);
    let (p, len) = c.gpu_words();
    assert_eq!(p as usize % crate::channel::layout::READY_PAGE, 0);
    assert_eq!(len, GPU_WORDS);
    assert_eq!(c.seg.len(), ready_offset(3, 4) + GPU_WORDS);
    assert_eq!(c.gate(), (GateState::Open.to_wire(), 0));
    // Buffer 0 published as frame 1, buffer 1 being written, buffer 2 never used.
    let Claim { index: i, .. } = c.try_acquire().unwrap();
    assert_eq!(c.next_seq(), 1);
    assert_eq!(c.publish(i, b"").unwrap(), 1);
    let Claim { index: j, .. } = c.try_acquire().unwrap();
    assert_ne!(i, j);
    // A word ahead of where the gate raises them (wrap-around order) is never lowered.
    c.ready_word(j)
        .store(1 + GATE_HORIZON + 5, Ordering::Relaxed);
    c.force_ready();
    assert_eq!(c.gate(), (GateState::ProducerGone.to_wire(), 1));
    for k in 0..3 {
        let want = if k == j {
            1 + GATE_HORIZON + 5
        } else {
            1 + GATE_HORIZON
        };
        assert_eq!(c.ready_value(k), want, "buffer {k}");
    }
    // The first closer's words stay.
    c.close_gate(GateState::Closed);
    assert_eq!(c.gate(), (GateState::ProducerGone.to_wire(), 1));
    // Wrap-around: u32::MAX is behind the raise, which moves it forward past 0.
    c.ready_word(i).store(u32::MAX, Ordering::Relaxed);
    c.close_gate(GateState::Closed);
    assert_eq!(c.ready_value(i), 1 + GATE_HORIZON);
    c.unlink();
}

#[test]
fn release_words_start_below_the_head_and_are_raised_when_a_slot_is_freed() {
    let (c, _name) = channel(2);
    for _ in 0..3 {
        let Claim { index: i, .. } = c.try_acquire().unwrap();
        c.publish(i, b"").unwrap();
    }
    let me = c.attach(Delivery::EveryFrame).unwrap();
    for i in 0..2 {
        assert_eq!(c.release_word(me, i).load(Ordering::Relaxed), 2);
        assert!(c.released(me, i, 2) && !c.released(me, i, 3));
    }
    // Frame 4 taken and (by its stream, here from the host) released.
    let Claim { index: i, .. } = c.try_acquire().unwrap();
    assert_eq!(c.publish(i, b"").unwrap(), 4);
    let (got, seq, _) = c.try_take(me).unwrap().unwrap();
    assert_eq!((got, seq), (i, 4));
    assert!(!c.released(me, i, 4));
    c.set_released(me, i, 4);
    assert!(c.released(me, i, 4));
    // Its next frame needs its word; it dies holding it: freeing the slot raises its words to
    // the head, so a producer stream waiting for them goes on.
    let Claim { index: k, .. } = c.try_acquire().unwrap();
    assert_eq!(c.publish(k, b"").unwrap(), 5);
    c.release(me, i);
    let (kk, seq, _) = c.try_take(me).unwrap().unwrap();
    assert_eq!((kk, seq), (k, 5));
    assert!(!c.released(me, k, 5));
    c.consumer(me).pid.store(u32::MAX, Ordering::Relaxed);
    assert_eq!(c.reclaim_dead_consumers(), 1);
    assert!(c.released(me, k, 5) && c.released(me, i, 5));
    // A second freer of the same (already freed) slot does nothing.
    assert_eq!(c.free_consumer_slot(me, ACTIVE), 0);
    // Wrap-around: a word just past u32::MAX is ahead of it.
    c.release_word(me, 0).store(2, Ordering::Relaxed);
    assert!(c.released(me, 0, u32::MAX as u64));
    c.unlink();
}

#[test]
fn a_latest_only_consumer_that_takes_the_frame_at_the_head_is_waited_for_by_the_next_write() {
    // The frame at the head when a latest-only consumer attaches is one it may take: once its
    // host hold is dropped (its kernels may still read), the producer's claim of that buffer
    // must find the consumer in `used` and its word not yet at the frame, so the producer's
    // stream waits for the word the consumer's stream writes after its reads.
    for head in [1u64, 2, 3] {
        let (c, _name) = channel(2);
        for _ in 0..head {
            let Claim { index: i, .. } = c.try_acquire().unwrap();
            c.publish(i, b"").unwrap();
        }
        let me = c.attach(Delivery::LatestOnly).unwrap();
        let (i, seq, _) = c
            .try_take_newer(me, 0)
            .unwrap()
            .expect("the frame at the head");
        assert_eq!(seq, head);
        assert!(
            !c.released(me, i, seq),
            "head {head}: released before its word"
        );
        c.release(me, i);
        // One write into the other buffer, then the claim of this one.
        let Claim { index: k, .. } = c.try_acquire().unwrap();
        assert_ne!(k, i);
        c.publish(k, b"").unwrap();
        let claim = c.try_acquire().unwrap();
        assert_eq!((claim.index, claim.old_seq), (i, seq));
        assert_ne!(
            claim.used & (1 << me),
            0,
            "head {head}: the consumer is not in used"
        );
        assert!(
            !c.released(me, i, claim.old_seq),
            "head {head}: no wait for its reads"
        );
        // Its stream's write (here from the host) lets the producer go.
        c.set_released(me, i, seq);
        assert!(c.released(me, i, claim.old_seq));
        c.abandon(claim.index);
        c.unlink();
    }
}

#[test]
fn a_consumer_attached_before_any_frame_waits_for_nothing_it_never_held() {
    let (c, _name) = channel(2);
    let me = c.attach(Delivery::LatestOnly).unwrap();
    // Words one below head 0 (wrapped): frame 1 and later need its word, and no claim of a
    // buffer it never held lists it.
    assert!(!c.released(me, 0, 1));
    let Claim { index: i, used, .. } = c.try_acquire().unwrap();
    assert_eq!(used, 0);
    c.publish(i, b"").unwrap();
    c.unlink();
}

#[test]
fn dead_consumer_holds_are_released_and_its_slot_reused() {
    let (p, name) = channel(1);
    let c = Control::open(&name).unwrap();
    let me = c.attach(Delivery::EveryFrame).unwrap();
    let Claim { index: i, .. } = p.try_acquire().unwrap();
    p.publish(i, &[]).unwrap();
    c.try_take(me).unwrap().unwrap();
    assert!(p.try_acquire().is_none());
    // Make the slot's owner a process that has exited.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    let st = crate::identity::start_time_of(pid).unwrap().unwrap_or(1);
    child.wait().unwrap();
    let s = c.consumer(me);
    s.pid.store(pid, Ordering::Relaxed);
    s.start_time.store(st, Ordering::Relaxed);
    assert_eq!(p.reclaim_dead_consumers(), 1);
    let Claim { index: _, used, .. } = p
        .try_acquire()
        .expect("the dead consumer's hold was released");
    assert_eq!(used, 0, "no waiting on a dead consumer's events");
    assert_eq!(p.stats().forced_releases, 1);
    assert!(matches!(
        c.try_take(me),
        Err(Error::Channel(super::super::ChannelError::Detached))
    ));
    let again = c.attach(Delivery::EveryFrame).unwrap();
    assert_eq!(again, me);
    p.unlink();
}

#[test]
fn a_claim_that_keeps_the_newest_frame_waits_for_an_older_buffer_instead() {
    // Two buffers: frame 1 in one, held by a latest-only consumer; frame 2 (the newest) in the
    // other, unheld. A plain claim takes the newest frame's buffer (the only free one); a claim
    // that keeps the newest frame takes nothing until the older buffer is released, so a
    // writer that may give its buffer back unpublished never takes the newest frame from
    // consumers that way.
    let (c, _name) = channel(2);
    let Claim { index: a, .. } = c.try_acquire().unwrap();
    c.publish(a, b"").unwrap();
    let me = c.attach(Delivery::LatestOnly).unwrap();
    let (held, seq, _) = c.try_take_newer(me, 0).unwrap().expect("frame 1");
    assert_eq!((held, seq), (a, 1));
    let Claim { index: b, .. } = c.try_acquire().unwrap();
    assert_ne!(a, b);
    c.publish(b, b"").unwrap();
    assert!(
        c.try_acquire_keeping(true).is_none(),
        "the newest frame's buffer was taken"
    );
    assert!(
        c.acquire_keeping(WaitStrategy::Spin, Some(Duration::from_millis(20)), true)
            .unwrap()
            .is_none()
    );
    // Released: the older buffer is taken, the newest frame stays.
    c.release(me, held);
    let claim = c.try_acquire_keeping(true).expect("the older buffer");
    assert_eq!(claim.index, a);
    c.abandon(claim.index);
    // The plain claim takes the newest frame's buffer when it is the only free one.
    let (held, _, _) = c.try_take_newer(me, 0).unwrap().expect("frame 2");
    assert_eq!(held, b);
    c.release(me, held);
    let Claim { index: x, .. } = c.try_acquire().unwrap();
    assert_eq!(x, a, "the emptied buffer first");
    c.abandon(x);
    c.unlink();
}
