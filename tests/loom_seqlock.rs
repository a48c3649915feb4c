//! Loom model of the seqlock: under every interleaving (within the preemption bound) a reader
//! either gets a consistent copy or an error, never a torn copy, and never spins forever on a
//! writer that died inside its write.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test --release --test loom_seqlock` (see .ci/run).
#![cfg(loom)]

use cuda_ipc::raw::shm::SeqLock;
use loom::sync::Arc;
use loom::sync::atomic::AtomicU64;

const WORDS: usize = 2;

struct Block {
    seq: AtomicU64,
    words: [AtomicU64; WORDS],
}

impl Block {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            seq: AtomicU64::new(0),
            words: [AtomicU64::new(0), AtomicU64::new(0)],
        })
    }
    fn lock(&self) -> SeqLock<'_> {
        SeqLock::new(&self.seq, &self.words)
    }
}

fn builder() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b
}

#[test]
fn loom_reader_never_sees_a_torn_copy() {
    builder().check(|| {
        let b = Block::new();
        let b2 = b.clone();
        let writer = loom::thread::spawn(move || {
            for v in 1..=2u64 {
                let w = b2.lock().try_write().expect("single writer");
                for i in 0..WORDS {
                    w.store(i, v);
                }
                w.finish();
            }
        });
        let mut out = [0u64; WORDS];
        if let Ok(seq) = b.lock().read(&mut out, 3) {
            assert_eq!(out[0], out[1], "torn copy {out:?} at sequence {seq}");
            assert_eq!(
                out[0],
                seq / 2,
                "copy {out:?} does not match sequence {seq}"
            );
        }
        writer.join().unwrap();
        let mut out = [0u64; WORDS];
        assert_eq!(b.lock().read(&mut out, 1).unwrap(), 4);
        assert_eq!(out, [2, 2]);
    });
}

#[test]
fn loom_two_writers_exclude_each_other() {
    builder().check(|| {
        let b = Block::new();
        let handles: Vec<_> = (1..=2u64)
            .map(|v| {
                let b = b.clone();
                loom::thread::spawn(move || {
                    if let Some(w) = b.lock().try_write() {
                        w.store(0, v);
                        w.store(1, v);
                        w.finish();
                        true
                    } else {
                        false
                    }
                })
            })
            .collect();
        let wrote: Vec<bool> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(wrote.iter().any(|w| *w));
        let mut out = [0u64; WORDS];
        b.lock().read(&mut out, 1).unwrap();
        assert_eq!(out[0], out[1]);
    });
}

#[test]
fn loom_writer_dying_inside_gives_readers_an_error_not_a_hang() {
    builder().check(|| {
        let b = Block::new();
        let b2 = b.clone();
        let writer = loom::thread::spawn(move || {
            let w = b2.lock().try_write().unwrap();
            w.store(0, 9);
            // Dies here: the write is never closed.
            std::mem::forget(w);
        });
        let mut out = [0u64; WORDS];
        if let Ok(seq) = b.lock().read(&mut out, 2) {
            assert_eq!((seq, out), (0, [0, 0]));
        }
        writer.join().unwrap();
        assert!(b.lock().read(&mut out, 2).is_err());
        let w = b.lock().adopt_open_write().unwrap();
        w.store(0, 0);
        w.store(1, 0);
        assert_eq!(w.finish(), 2);
        assert_eq!(b.lock().read(&mut out, 1).unwrap(), 2);
        assert_eq!(out, [0, 0]);
    });
}

/// The repair of a dead writer's half-written payload, beside a reader: the repairer adopts the
/// open write (the sequence stays odd), overwrites the payload and only then closes it. The reader
/// gets the old whole copy, the repaired (zero) copy, or an error; never the half-written one.
#[test]
fn loom_reader_beside_a_repairer_never_sees_the_half_written_payload() {
    builder().check(|| {
        let b = Block::new();
        // A whole record [1, 1] at sequence 2.
        let w = b.lock().try_write().unwrap();
        w.store(0, 1);
        w.store(1, 1);
        w.finish();
        // The writer of [2, 2] dies after its first store.
        let w = b.lock().try_write().unwrap();
        w.store(0, 2);
        std::mem::forget(w);
        let b2 = b.clone();
        let repairer = loom::thread::spawn(move || {
            let w = b2.lock().adopt_open_write().expect("an open write");
            w.store(0, 0);
            w.store(1, 0);
            w.finish();
        });
        let mut out = [0u64; WORDS];
        if let Ok(seq) = b.lock().read(&mut out, 3) {
            assert_eq!(
                (seq, out),
                (4, [0, 0]),
                "a copy that is not the repaired one"
            );
        }
        repairer.join().unwrap();
    });
}
