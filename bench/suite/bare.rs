//! The bare floor: the thinnest hand-off between two processes that the hardware and the kernel
//! allow, from raw calls only (no `cuda_ipc` layer between `t0` and the consumer's ready).
//!
//! One shared page (`shm_open` + `mmap`, through rustix) holds a sequence word and a `t0` word; both
//! processes register it with the driver (`cuMemHostRegister_v2` with `DEVICEMAP`,
//! `cuMemHostGetDevicePointer_v2`). Per frame:
//! - producer: store `t0`, store the sequence number (Release), `FUTEX_WAKE` (shared) unless the
//!   consumer spins;
//! - consumer: spin on the sequence word, or sleep on it with `FUTEX_WAIT` (shared, 20 ms slices),
//!   or spin for the channel's default window then sleep; then `cuStreamWaitValue32_v2` (GEQ) of the
//!   sequence number on its stream, as the channel's `recv` enqueues a wait on the buffer's ready
//!   word: **ready** is taken here, the point where the channel's `recv` returns; later, in place of
//!   the channel's release, `cuStreamWriteValue32_v2` of the sequence number into an ack word of the
//!   page, which the consumer checks once its stream has drained.
//!
//! **With the hold** (`impl=bare_hold`, [`Consumer::open`]'s `hold`): the same, plus the steps the
//! channel's protocol adds to a consumer's take, on words of their own cache lines of the page: the
//! hold (a `SeqCst` `fetch_or` of the consumer's bit in a hold word, a `SeqCst` fence, a second read
//! of the sequence word: the consumer's half of the channel's Dekker pair, `src/channel/hold.rs`),
//! then its cursor (a store to a word the producer reads); the release clears the bit. The producer
//! reads the hold word and the cursor before each frame, outside the timed interval, as the
//! channel's claim of a buffer does, so those lines move between the two cores every frame as in
//! the channel. The difference between `bare_hold` and `bare_floor` is what the hold protocol costs
//! on this machine, measured apart from every other layer of the crate.
//!
//! The pacing around it (the host ack of the previous frame, in the suite's `Shared` segment as for
//! the others and outside the timed interval; the fill; the gap) and the clocks are those of the
//! other implementations (`handoff.rs`): only the hand-off itself differs.

use crate::Res;
use crate::clock::cu;
use cuda_ipc::channel::WaitStrategy;
use cuda_ipc::driver::Context;
use cudarc::driver::sys;
use rustix::fd::OwnedFd;
use rustix::mm::{MapFlags, ProtFlags};
use rustix::shm::{Mode, OFlags};
use rustix::thread::futex;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Bytes of the shared page.
pub const PAGE_LEN: usize = 4096;
/// Byte offset of the sequence word (`u32`): frames published; the futex word; what the consumer's
/// stream waits for.
const SEQ_OFF: usize = 0;
/// Byte offset of `t0` (`u64`, CLOCK_MONOTONIC ns of the latest publish), on the sequence word's
/// cache line: the consumer's wake brings both in one line transfer.
const T0_OFF: usize = 8;
/// Byte offset of the ack word (`u32`) the consumer's stream writes, on a cache line of its own.
const GPU_ACK_OFF: usize = 128;
/// Byte offset of the hold word (`u64`, the consumer's bit while it holds the frame), on a cache
/// line of its own (`bare_hold`).
const HOLD_OFF: usize = 384;
/// Byte offset of the consumer's cursor (`u32`, the last frame it took), on a cache line of its own
/// (`bare_hold`).
const CURSOR_OFF: usize = 512;
/// Byte offset of the ready word (`u32`) that the producer's stream writes in the posted floor
/// (`posted.rs`) and the consumer's stream waits for, on a cache line of its own.
pub const GPU_READY_OFF: usize = 256;
/// The longest single `FUTEX_WAIT`: between slices the waiter checks its peer and its deadline.
pub const SLICE: Duration = Duration::from_millis(20);
/// Between two looks at the clock, a spinning waiter reads the word this many times.
const SPINS_PER_CLOCK: u32 = 64;

/// How the consumer waits for the sequence word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BareWait {
    /// Spins on the word (the producer never calls `FUTEX_WAKE`).
    Spin,
    /// Sleeps on the word at once (`FUTEX_WAIT`).
    Futex,
    /// Spins this long, then sleeps (the channel's default, `spin-then-block`).
    SpinThenFutex(Duration),
}

impl BareWait {
    /// The bare equivalent of a channel wait strategy, with the same spin window.
    pub fn of(w: WaitStrategy) -> BareWait {
        match w {
            WaitStrategy::Spin => BareWait::Spin,
            WaitStrategy::Block => BareWait::Futex,
            WaitStrategy::SpinThenBlock(d) => BareWait::SpinThenFutex(d),
            // A strategy added later: sleep, the producer then always wakes.
            _ => BareWait::Futex,
        }
    }

    /// How long the consumer spins before it sleeps (`Duration::MAX`: it never sleeps).
    fn spin_for(self) -> Duration {
        match self {
            BareWait::Spin => Duration::MAX,
            BareWait::Futex => Duration::ZERO,
            BareWait::SpinThenFutex(d) => d,
        }
    }

    /// Whether the producer must call `FUTEX_WAKE` after publishing (the consumer may sleep).
    pub fn producer_wakes(self) -> bool {
        self != BareWait::Spin
    }
}

/// Whether sequence value `v` is at or after `target` in wrap-around order, as
/// `cuStreamWaitValue32` with `CU_STREAM_WAIT_VALUE_GEQ` compares.
pub fn reached(v: u32, target: u32) -> bool {
    (v.wrapping_sub(target) as i32) >= 0
}

/// The shared page, mapped (no driver involved): the creator makes and unlinks the name.
pub struct Page {
    ptr: *mut u8,
    name: String,
    owner: bool,
    _fd: OwnedFd,
}

// SAFETY: the mapping is shared memory that every process and thread accesses through atomics
// only (`u32_at`, `u64_at`); the pointer itself is never written after `map`.
unsafe impl Send for Page {}
// SAFETY: as for Send.
unsafe impl Sync for Page {}

impl Page {
    /// Creates `/cuda-ipc-bench-PID-bare-TAG` (zero-filled: `ftruncate` of a new object).
    pub fn create(tag: &str) -> Res<Page> {
        let name = format!("/cuda-ipc-bench-{}-bare-{tag}", std::process::id());
        let fd = rustix::shm::open(
            name.as_str(),
            OFlags::CREATE | OFlags::EXCL | OFlags::RDWR,
            Mode::RUSR | Mode::WUSR,
        )
        .map_err(|e| format!("shm_open {name}: {e}"))?;
        let page = Page::map(fd, name, true)?;
        Ok(page)
    }

    /// Opens a page another process created.
    pub fn open(name: &str) -> Res<Page> {
        let fd = rustix::shm::open(name, OFlags::RDWR, Mode::empty())
            .map_err(|e| format!("shm_open {name}: {e}"))?;
        let len = rustix::fs::fstat(&fd)?.st_size;
        if len < PAGE_LEN as i64 {
            return Err(format!("{name} is {len} bytes, not {PAGE_LEN}").into());
        }
        Page::map(fd, name.to_string(), false)
    }

    fn map(fd: OwnedFd, name: String, owner: bool) -> Res<Page> {
        if owner && let Err(e) = rustix::fs::ftruncate(&fd, PAGE_LEN as u64) {
            let _ = rustix::shm::unlink(name.as_str());
            return Err(format!("ftruncate {name}: {e}").into());
        }
        // SAFETY: a fresh shared mapping of PAGE_LEN bytes of the object (at least that long:
        // truncated above or checked in `open`), at an address the kernel picks; nothing else in
        // this process refers to that range.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                PAGE_LEN,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        };
        match ptr {
            Ok(p) => Ok(Page {
                ptr: p.cast(),
                name,
                owner,
                _fd: fd,
            }),
            Err(e) => {
                if owner {
                    let _ = rustix::shm::unlink(name.as_str());
                }
                Err(format!("mmap {name}: {e}").into())
            }
        }
    }

    /// The name another process opens.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The page's address in this process (page aligned).
    pub fn host_ptr(&self) -> *mut u8 {
        self.ptr
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= PAGE_LEN);
        // Every process (and the GPU, through the registration) accesses the word atomically only.
        // SAFETY: the mapping is page aligned and PAGE_LEN long, so `off` (checked above) is an
        // aligned 4-byte word inside it; the reference lives no longer than `self` (the mapping).
        unsafe { &*(self.ptr.add(off) as *const AtomicU32) }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= PAGE_LEN);
        // SAFETY: as in `u32_at`, for an aligned 8-byte word.
        unsafe { &*(self.ptr.add(off) as *const AtomicU64) }
    }

    /// The sequence word: frames published so far; the futex word.
    pub fn seq(&self) -> &AtomicU32 {
        self.u32_at(SEQ_OFF)
    }

    /// The latest frame's `t0` (ns, CLOCK_MONOTONIC).
    pub fn t0(&self) -> &AtomicU64 {
        self.u64_at(T0_OFF)
    }

    /// The hold word (`bare_hold`).
    fn hold(&self) -> &AtomicU64 {
        self.u64_at(HOLD_OFF)
    }

    /// The consumer's cursor (`bare_hold`).
    fn cursor(&self) -> &AtomicU32 {
        self.u32_at(CURSOR_OFF)
    }

    /// The ack word the consumer's stream writes (`cuStreamWriteValue32`).
    pub fn gpu_ack(&self) -> &AtomicU32 {
        self.u32_at(GPU_ACK_OFF)
    }

    /// Publishes frame `seq` stamped `t0`: the producer's whole per-frame hand-off.
    #[inline]
    pub fn publish(&self, t0: u64, seq: u32, wake: bool) {
        // Relaxed: published by the Release store of the sequence word just after.
        self.t0().store(t0, Ordering::Relaxed);
        // SYNC POINT: bare seq. Release: pairs with the Acquire loads in `wait_seq` (the
        // consumer's `t0` load is ordered after them).
        self.seq().store(seq, Ordering::Release);
        if wake {
            // Shared (no FUTEX_PRIVATE_FLAG): the sleeper is in another process. One consumer.
            // A failure (only a bad address, which a reference excludes) is caught by the
            // sleeper's 20 ms slices.
            let _ = futex::wake(self.seq(), futex::Flags::empty(), 1);
        }
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        // SAFETY: `ptr` is the PAGE_LEN mapping made in `map`, unmapped once; every reference into
        // it borrowed `self` and is gone.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), PAGE_LEN) };
        if self.owner {
            let _ = rustix::shm::unlink(self.name.as_str());
        }
    }
}

/// Waits until the sequence word is at or after `target`: spins for `wait`'s window (reading the
/// clock every 64 turns), then sleeps in `FUTEX_WAIT` slices of [`SLICE`] (shared). Between slices,
/// and about every millisecond of spinning, it asks `alive` whether the producer still runs and
/// checks `timeout`; the woken path reads neither.
pub fn wait_seq(
    word: &AtomicU32,
    target: u32,
    wait: BareWait,
    timeout: Duration,
    mut alive: impl FnMut() -> bool,
) -> Res<()> {
    let start = Instant::now();
    let spin_for = wait.spin_for();
    let mut last_check = start;
    let mut check = |now: Instant| -> Res<()> {
        if now.duration_since(last_check) < Duration::from_millis(1) {
            return Ok(());
        }
        last_check = now;
        if !alive() {
            return Err(format!("the producer is gone while waiting for frame {target}").into());
        }
        if now.duration_since(start) >= timeout {
            return Err(format!("no frame {target} within {timeout:?}").into());
        }
        Ok(())
    };
    if !spin_for.is_zero() {
        let mut turns = 0u32;
        loop {
            // SYNC POINT: bare seq. Acquire: pairs with the Release store in `Page::publish`.
            if reached(word.load(Ordering::Acquire), target) {
                return Ok(());
            }
            turns = turns.wrapping_add(1);
            if turns.is_multiple_of(SPINS_PER_CLOCK) {
                let now = Instant::now();
                if now.duration_since(start) >= spin_for {
                    break;
                }
                check(now)?;
            }
            std::hint::spin_loop();
        }
    }
    let ts = rustix::time::Timespec {
        tv_sec: SLICE.as_secs() as i64,
        tv_nsec: i64::from(SLICE.subsec_nanos()),
    };
    loop {
        // SYNC POINT: bare seq. Acquire: pairs with the Release store in `Page::publish`.
        let v = word.load(Ordering::Acquire);
        if reached(v, target) {
            return Ok(());
        }
        // Before sleeping (never between a wake and the return above): the peer and the deadline.
        // The first slice always runs; a slice that ends without a wake is followed by a check.
        check(Instant::now())?;
        // Sleeps while the word still holds `v`; returns at once when it changed (EAGAIN), when
        // woken, interrupted or timed out, or failed (then this loop spins, still bounded by the
        // checks): every case re-checks above.
        let _ = futex::wait(word, futex::Flags::empty(), v, Some(&ts));
    }
}

/// The page registered with the driver in this process (`cuMemHostRegister_v2`, `DEVICEMAP`), and
/// its device address; unregistered on drop. Declare it after the [`Page`] so it drops first.
pub struct Registration {
    host: *mut c_void,
    /// The page's device address in `ctx` (`cuMemHostGetDevicePointer_v2`).
    pub dev: u64,
    ctx: Arc<Context>,
}

impl Registration {
    /// Registers `page` in `ctx`, which it makes current on this thread (`cuCtxSetCurrent`) for
    /// the raw calls that follow.
    pub fn new(ctx: &Arc<Context>, page: &Page) -> Res<Registration> {
        ctx.bind()?;
        let host: *mut c_void = page.host_ptr().cast();
        // SAFETY: context current (bound above); `host` is a page-aligned mapping of PAGE_LEN
        // bytes that outlives this registration (the caller drops the registration first, as the
        // type's documentation says); DEVICEMAP is a defined flag.
        cu("cuMemHostRegister_v2", unsafe {
            sys::cuMemHostRegister_v2(host, PAGE_LEN, sys::CU_MEMHOSTREGISTER_DEVICEMAP)
        })?;
        // Unregisters on drop if the query below fails.
        let mut reg = Registration {
            host,
            dev: 0,
            ctx: ctx.clone(),
        };
        let mut d = MaybeUninit::<sys::CUdeviceptr>::uninit();
        // SAFETY: context current; `host` was registered with DEVICEMAP just above; flags must be 0.
        cu("cuMemHostGetDevicePointer_v2", unsafe {
            sys::cuMemHostGetDevicePointer_v2(d.as_mut_ptr(), host, 0)
        })?;
        // SAFETY: written on success.
        reg.dev = unsafe { d.assume_init() };
        Ok(reg)
    }

    /// The device address of the word at byte `off` of the page.
    pub fn word(&self, off: usize) -> u64 {
        self.dev + off as u64
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: context current; `host` was registered by `new` and is unregistered once; no
            // GPU work on the page is pending (the consumer drains its stream first, the producer
            // enqueues none).
            let _ = unsafe { sys::cuMemHostUnregister(self.host) };
        }
    }
}

/// The consumer's side of the bare floor: the page, its registration and the stream's raw calls.
/// Drop drains the stream before the page is unregistered and unmapped.
pub struct Consumer {
    stream: sys::CUstream,
    // Drop order: the registration goes before the mapping it covers.
    reg: Registration,
    page: Page,
    wait: BareWait,
    hold: bool,
}

impl Consumer {
    /// Opens the producer's page and registers it in `ctx`; the stream's per-frame calls go to
    /// `stream`, a live stream of `ctx` that outlives this value. With `hold`, each take and
    /// release also runs the channel's hold protocol on the page (`bare_hold`, see the module).
    pub fn open(
        ctx: &Arc<Context>,
        name: &str,
        wait: BareWait,
        stream: sys::CUstream,
        hold: bool,
    ) -> Res<Self> {
        let page = Page::open(name)?;
        let reg = Registration::new(ctx, &page)?;
        Ok(Consumer {
            stream,
            reg,
            page,
            wait,
            hold,
        })
    }

    /// Waits for frame `seq`, then enqueues the stream's wait for it; returns the frame's `t0`.
    /// The caller reads the clock right after: that is the consumer's ready.
    #[inline]
    pub fn take(&self, seq: u32, alive: impl FnMut() -> bool) -> Res<u64> {
        wait_seq(self.page.seq(), seq, self.wait, crate::STEP, alive)?;
        if self.hold {
            // SYNC POINT: bare hold. SeqCst, a SeqCst fence, then the second read of the sequence
            // word: the consumer's half of the channel's Dekker pair (`HoldWords::hold`); the
            // producer's loads in `Producer::claim` are the other side.
            self.page.hold().fetch_or(1, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            if !reached(self.page.seq().load(Ordering::SeqCst), seq) {
                return Err(format!("frame {seq} was withdrawn under the hold").into());
            }
        }
        // SAFETY: context current (bound in `Registration::new`, on this thread); the sequence
        // word lies in the registered page, which stays registered until this value drops, after
        // the stream drained (Drop); GEQ is a defined flag.
        cu("cuStreamWaitValue32_v2", unsafe {
            sys::cuStreamWaitValue32_v2(
                self.stream,
                self.reg.word(SEQ_OFF),
                seq,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        })?;
        if self.hold {
            // SYNC POINT: bare cursor. Release: pairs with the Acquire load in `Producer::claim`.
            self.page.cursor().store(seq, Ordering::Release);
        }
        // Relaxed: ordered after the Acquire load of the sequence word in `wait_seq` (SYNC POINT:
        // bare seq).
        Ok(self.page.t0().load(Ordering::Relaxed))
    }

    /// Enqueues the write of `seq` into the ack word, after the work enqueued so far (in place of
    /// the channel's release).
    #[inline]
    pub fn release(&self, seq: u32) -> Res<()> {
        // SYNC POINT: bare gpu ack. The stream's write (after a memory barrier: DEFAULT) pairs with
        // the Acquire load in `drain`, made once the stream has finished.
        // SAFETY: as in `take`, for the ack word; DEFAULT is a defined flag.
        cu("cuStreamWriteValue32_v2", unsafe {
            sys::cuStreamWriteValue32_v2(
                self.stream,
                self.reg.word(GPU_ACK_OFF),
                seq,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        })?;
        if self.hold {
            // SYNC POINT: bare hold. SeqCst (a release): pairs with the producer's load of the
            // hold word in `Producer::claim`, as the channel's release clears its bit.
            self.page.hold().fetch_and(!1, Ordering::SeqCst);
        }
        Ok(())
    }

    /// Waits for the stream (`cuStreamSynchronize`) and checks that its ack of `seq` landed.
    pub fn drain(&self, seq: u32) -> Res<()> {
        // SAFETY: context current; the stream is live (`open`'s contract).
        cu("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.stream)
        })?;
        // SYNC POINT: bare gpu ack. Acquire: pairs with the stream's `cuStreamWriteValue32` (with
        // its memory barrier), finished once `cuStreamSynchronize` returned.
        let got = self.page.gpu_ack().load(Ordering::Acquire);
        if got != seq {
            return Err(format!(
                "the stream's ack of frame {seq} did not land (the ack word holds {got})"
            )
            .into());
        }
        Ok(())
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        // The page must not be unregistered under a pending write: drain first (every enqueued
        // wait is for a value the page already holds, so this ends).
        // SAFETY: context current on this thread (bound in `Registration::new`); the stream is
        // live (`open`'s contract).
        let _ = unsafe { sys::cuStreamSynchronize(self.stream) };
    }
}

/// The producer's side: the page, registered in its context as in the consumer's.
pub struct Producer {
    // Drop order: the registration goes before the mapping it covers.
    _reg: Registration,
    page: Page,
    wake: bool,
}

impl Producer {
    /// Creates and registers the page; `wait` is the consumer's.
    pub fn create(ctx: &Arc<Context>, tag: &str, wait: BareWait) -> Res<Producer> {
        let page = Page::create(tag)?;
        let reg = Registration::new(ctx, &page)?;
        Ok(Producer {
            _reg: reg,
            page,
            wake: wait.producer_wakes(),
        })
    }

    /// The page's name, for the consumer.
    pub fn name(&self) -> &str {
        self.page.name()
    }

    /// The channel's claim of a buffer before writing it, in the bare hold's words (`bare_hold`):
    /// reads the hold word and the consumer's cursor; returns whether the frame before is still
    /// held (it never is once the consumer acked it). Outside the timed interval.
    pub fn claim(&self) -> bool {
        // SYNC POINT: bare cursor. Acquire: pairs with the consumer's Release store in `take`.
        let _ = self.page.cursor().load(Ordering::Acquire);
        // SYNC POINT: bare hold. SeqCst: pairs with the consumer's `fetch_or` / `fetch_and`.
        self.page.hold().load(Ordering::SeqCst) != 0
    }

    /// Publishes frame `seq` stamped `t0` (see [`Page::publish`]).
    #[inline]
    pub fn publish(&self, t0: u64, seq: u32) {
        self.page.publish(t0, seq, self.wake);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn sequence_values_compare_with_wrap_around() {
        assert!(reached(1, 1));
        assert!(reached(2, 1));
        assert!(!reached(0, 1));
        assert!(reached(0, u32::MAX)); // wrapped past
        assert!(!reached(u32::MAX, 0));
    }

    #[test]
    fn wait_strategies_map_to_the_same_spin_window() {
        assert_eq!(BareWait::of(WaitStrategy::Spin), BareWait::Spin);
        assert_eq!(BareWait::of(WaitStrategy::Block), BareWait::Futex);
        let d = match WaitStrategy::default() {
            WaitStrategy::SpinThenBlock(d) => d,
            other => panic!("the default is {other:?}"),
        };
        assert_eq!(
            BareWait::of(WaitStrategy::default()),
            BareWait::SpinThenFutex(d)
        );
        assert!(!BareWait::Spin.producer_wakes());
        assert!(BareWait::Futex.producer_wakes());
        assert!(BareWait::SpinThenFutex(d).producer_wakes());
    }

    /// Two mappings of one page stand for the two processes: a wake through one must reach a
    /// sleeper on the other, which only a shared futex does (a private one keys on the address).
    fn hand_off(tag: &str, wait: BareWait, frames: u32) {
        let tx = Page::create(&format!("test-{tag}")).unwrap();
        let rx = Page::open(tx.name()).unwrap();
        assert_ne!(tx.host_ptr(), rx.host_ptr());
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            let consumer = s.spawn(|| {
                let mut t0s = Vec::new();
                for k in 1..=frames {
                    wait_seq(rx.seq(), k, wait, Duration::from_secs(10), || true).unwrap();
                    t0s.push(rx.t0().load(Ordering::Relaxed));
                    // Acks through the other word, as the stream would.
                    rx.gpu_ack().store(k, Ordering::Release);
                }
                done.store(true, Ordering::Release);
                t0s
            });
            for k in 1..=frames {
                // Let the consumer get into its wait (and asleep, past a short spin window).
                std::thread::sleep(Duration::from_millis(2));
                tx.publish(1000 + u64::from(k), k, wait.producer_wakes());
                let t = Instant::now();
                while tx.gpu_ack().load(Ordering::Acquire) != k {
                    assert!(t.elapsed() < Duration::from_secs(10), "no ack of {k}");
                    std::thread::yield_now();
                }
            }
            let t0s = consumer.join().unwrap();
            assert_eq!(
                t0s,
                (1..=frames)
                    .map(|k| 1000 + u64::from(k))
                    .collect::<Vec<_>>()
            );
        });
        assert!(done.load(Ordering::Acquire));
    }

    #[test]
    fn spinning_consumer_sees_every_frame() {
        hand_off("spin", BareWait::Spin, 20);
    }

    #[test]
    fn sleeping_consumer_is_woken_through_another_mapping() {
        // Each frame comes 2 ms after the consumer went to sleep, well before its 20 ms slice ends:
        // a lost wake-up would show as a 20 ms stall per frame, so bound the whole run well below.
        let t = Instant::now();
        hand_off("futex", BareWait::Futex, 20);
        assert!(
            t.elapsed() < Duration::from_millis(20 * 15),
            "{:?}: the wakes did not reach the sleeper",
            t.elapsed()
        );
    }

    #[test]
    fn spin_then_sleep_consumer_sees_every_frame() {
        hand_off(
            "spin-then-futex",
            BareWait::SpinThenFutex(Duration::from_micros(50)),
            20,
        );
    }

    #[test]
    fn waits_are_bounded() {
        let page = Page::create("test-timeout").unwrap();
        for wait in [
            BareWait::Spin,
            BareWait::Futex,
            BareWait::SpinThenFutex(Duration::from_micros(50)),
        ] {
            let t = Instant::now();
            let e = wait_seq(page.seq(), 1, wait, Duration::from_millis(50), || true).unwrap_err();
            assert!(e.to_string().contains("no frame 1 within"), "{e}");
            assert!(
                t.elapsed() < Duration::from_secs(1),
                "{wait:?}: {:?}",
                t.elapsed()
            );
            let t = Instant::now();
            let e = wait_seq(page.seq(), 1, wait, Duration::from_secs(10), || false).unwrap_err();
            assert!(e.to_string().contains("producer is gone"), "{e}");
            assert!(
                t.elapsed() < Duration::from_secs(1),
                "{wait:?}: {:?}",
                t.elapsed()
            );
        }
    }

    #[test]
    fn a_published_frame_is_taken_without_waiting() {
        let page = Page::create("test-ready").unwrap();
        page.publish(7, 1, false);
        wait_seq(page.seq(), 1, BareWait::Futex, Duration::ZERO, || false).unwrap();
        assert_eq!(page.t0().load(Ordering::Relaxed), 7);
    }

    #[test]
    fn the_creator_unlinks_the_page() {
        let page = Page::create("test-unlink").unwrap();
        let name = page.name().to_string();
        let other = Page::open(&name).unwrap();
        drop(other); // an opener leaves the name alone
        assert!(Page::open(&name).is_ok());
        drop(page);
        assert!(Page::open(&name).is_err());
    }
}
