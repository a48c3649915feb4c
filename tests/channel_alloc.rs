//! The hand-off allocates nothing: a counting global allocator around `try_recv` and the frame's
//! drop (the release), and around `acquire` and `publish`, on a host-memory channel (no GPU
//! needed), after a warm-up.

use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

struct Counting;

thread_local! {
    /// Counting on this thread: allocations of other threads (the test harness's) never count.
    static COUNTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are atomics
// touched only when counting is on.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // `try_with`: a thread being torn down has no locals left; it does not count.
        if COUNTING.try_with(|c| c.get()).unwrap_or(false) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's obligations are the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with `layout` (above).
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The counters are process-wide: the tests take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn receiving_and_releasing_a_frame_allocates_nothing() {
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    ALLOCS.store(0, Ordering::Relaxed);
    let name = format!("alloc-{}", std::process::id());
    let mut tx = Producer::create_host(&name, &ChannelOptions::new(4096).buffers(4)).unwrap();
    let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
    let mut counted = 0u64;
    for i in 0u64..200 {
        let w = tx.acquire(Some(std::time::Duration::from_secs(5))).unwrap();
        w.publish(&i.to_le_bytes()).unwrap();
        let warm = i >= 20;
        if warm {
            COUNTING.with(|c| c.set(true));
        }
        let f = rx.try_recv().unwrap().expect("a frame is ready");
        assert_eq!(f.metadata(), &i.to_le_bytes()[..]);
        drop(f);
        COUNTING.with(|c| c.set(false));
        counted += u64::from(warm);
    }
    let n = ALLOCS.load(Ordering::Relaxed);
    assert_eq!(n, 0, "{n} allocations in {counted} receives and releases");
    drop(rx);
    tx.close(std::time::Duration::from_secs(5)).unwrap();
}

#[test]
fn acquiring_and_publishing_a_frame_allocates_nothing_in_either_order() {
    // Both buffer orders: the oldest free buffer (a stack array, not a sorted Vec) and the ring.
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    ALLOCS.store(0, Ordering::Relaxed);
    for ring in [false, true] {
        let name = format!("alloc-tx-{}-{ring}", std::process::id());
        let opts = ChannelOptions::new(4096).buffers(4).ring(ring);
        let mut tx = Producer::create_host(&name, &opts).unwrap();
        let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
        let mut counted = 0u64;
        for i in 0u64..200 {
            let warm = i >= 20;
            if warm {
                COUNTING.with(|c| c.set(true));
            }
            let w = tx.acquire(Some(std::time::Duration::from_secs(5))).unwrap();
            w.publish(&i.to_le_bytes()).unwrap();
            COUNTING.with(|c| c.set(false));
            counted += u64::from(warm);
            drop(rx.try_recv().unwrap().expect("a frame is ready"));
        }
        let n = ALLOCS.swap(0, Ordering::Relaxed);
        assert_eq!(
            n, 0,
            "ring {ring}: {n} allocations in {counted} acquires and publishes"
        );
        drop(rx);
        tx.close(std::time::Duration::from_secs(5)).unwrap();
    }
}
