//! The limits and the registry: a raw cross-process futex ping-pong and a spinning one (the floor of
//! any wake-up between two processes), a device-to-device copy of the same frame timed with CUDA
//! events (what a copying hand-off would pay at least), and the registry's `publish` / `get`.

use crate::Res;
use crate::STEP;
use crate::clock::cu;
use crate::common::now_ns;
use crate::kv::Kv;
use crate::peer::{Peer, Shared, parent_alive};
use crate::records::{Key, median};
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory, Stream};
use cuda_ipc::raw::shm::futex;
use cuda_ipc::registry::{Registry, RegistryOptions};
use cudarc::driver::sys;
use serde_json::{Value, json};
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// `publish` of an existing name (64-byte token, 32 bytes of metadata, nobody waiting) and `get`
/// of it, timed per call and as a batch; in this process, no GPU.
pub fn registry(iters: usize) -> Res<Value> {
    let name = format!("cuda-ipc-bench-reg-{}", std::process::id());
    let reg = Registry::create(&name, &RegistryOptions::new())?;
    // The mapping stays valid after the name goes; nothing is left behind if we are killed.
    Registry::unlink(&name)?;
    for i in 0..16 {
        reg.publish(&format!("name-{i}"), 1, &[7; 64], &[1; 32])?;
    }
    let key = Key::new(
        "registry",
        "registry",
        "existing-name",
        format!("iters={iters} token=64B metadata=32B"),
    );
    let mut publish = Vec::with_capacity(iters);
    let mut get = Vec::with_capacity(iters);
    for _ in 0..iters {
        let a = now_ns();
        reg.publish("name-3", 1, std::hint::black_box(&[7; 64]), &[1; 32])?;
        publish.push((now_ns() - a) as f64);
    }
    for _ in 0..iters {
        let a = now_ns();
        std::hint::black_box(reg.get(std::hint::black_box("name-3"))?);
        get.push((now_ns() - a) as f64);
    }
    let t = Instant::now();
    for _ in 0..iters {
        reg.publish("name-3", 1, &[7; 64], &[1; 32])?;
    }
    let publish_mean = t.elapsed().as_nanos() as f64 / iters as f64;
    let t = Instant::now();
    for _ in 0..iters {
        std::hint::black_box(reg.get("name-3")?);
    }
    let get_mean = t.elapsed().as_nanos() as f64 / iters as f64;
    let mut records = key.dist_us("publish", &publish);
    records.extend(key.dist_us("get", &get));
    records.push(key.rec(
        "publish_batch_mean",
        "value",
        publish_mean / 1e3,
        "us",
        iters,
    ));
    records.push(key.rec("get_batch_mean", "value", get_mean / 1e3, "us", iters));
    Ok(json!({"records": records, "info": {"iters": iters}}))
}

const STOP: u32 = u32::MAX;

/// A cross-process ping-pong through one shared word: `futex` (sleep on it, wake the peer) or
/// `spin` (both spin). Round trips in µs; one way = half a round trip.
pub fn pingpong(mode: &str, iters: usize, timeout: Duration) -> Res<Value> {
    let use_futex = match mode {
        "futex" => true,
        "spin" => false,
        x => return Err(format!("unknown ping-pong mode {x:?}").into()),
    };
    let shared = Shared::create(&format!("pingpong-{mode}"))?;
    let mut peer = Peer::spawn(
        "ping-pong peer",
        "pingpong-peer",
        &[
            ("shared".into(), shared.name().to_string()),
            ("mode".into(), mode.to_string()),
        ],
    )?;
    peer.expect("READY", Duration::from_secs(30))?;
    let word = shared.seq();
    let warmup = iters / 10 + 10;
    let mut rtt = Vec::with_capacity(iters);
    let deadline = Instant::now() + timeout;
    let mut v = 0u32;
    for k in 0..warmup + iters {
        let a = now_ns();
        let ping = v + 1;
        // Release: pairs with the peer's Acquire load.
        word.store(ping, Ordering::Release);
        if use_futex {
            futex::wake(word, 1);
        }
        let mut turns = 0u32;
        loop {
            // Acquire: pairs with the peer's Release store of the answer.
            let w = word.load(Ordering::Acquire);
            if w == ping + 1 {
                break;
            }
            turns = turns.wrapping_add(1);
            if use_futex {
                futex::wait(word, w, Duration::from_millis(20));
            } else {
                std::hint::spin_loop();
            }
            if (use_futex || turns.is_multiple_of(65_536))
                && (Instant::now() > deadline || !peer.alive())
            {
                return Err(format!("ping-pong ({mode}) stalled at round trip {k}").into());
            }
        }
        if k >= warmup {
            rtt.push((now_ns() - a) as f64);
        }
        v = ping + 1;
    }
    // Release: the peer's Acquire load sees it and exits.
    word.store(STOP, Ordering::Release);
    futex::wake(word, 1);
    peer.result(STEP)?;
    peer.finish(STEP)?;
    let imp = if use_futex {
        "futex_pingpong"
    } else {
        "spin_pingpong"
    };
    let key = Key::new("limits", imp, "cross-process", format!("iters={iters}"));
    let mut records = key.dist_us("round_trip", &rtt);
    records.push(key.rec("one_way", "p50", median(&rtt) / 2e3, "us", rtt.len()));
    Ok(json!({"records": records, "info": {"iters": iters, "warmup": warmup}}))
}

/// The ping-pong peer: answers every odd value with the next even one.
pub fn pingpong_peer(kv: &Kv) -> Res<Value> {
    let shared = Shared::open(&kv.str("shared")?)?;
    let use_futex = kv.str("mode")? == "futex";
    let word = shared.seq();
    println!("READY");
    let mut answered = 0u64;
    let mut turns = 0u32;
    loop {
        // Acquire: pairs with the parent's Release store of the ping.
        let w = word.load(Ordering::Acquire);
        if w == STOP {
            break;
        }
        if w % 2 == 1 {
            // Release: pairs with the parent's Acquire load.
            word.store(w + 1, Ordering::Release);
            if use_futex {
                futex::wake(word, 1);
            }
            answered += 1;
            continue;
        }
        turns = turns.wrapping_add(1);
        if use_futex {
            futex::wait(word, w, Duration::from_millis(20));
        } else {
            std::hint::spin_loop();
        }
        if (use_futex || turns.is_multiple_of(65_536)) && !parent_alive() {
            return Err("the parent is gone".into());
        }
    }
    Ok(json!({"answered": answered}))
}

/// A CUDA event with timing enabled (`cuEventCreate` with `CU_EVENT_DEFAULT`), destroyed on drop.
struct TimingEvent {
    raw: sys::CUevent,
    ctx: Arc<Context>,
}

impl TimingEvent {
    fn new(ctx: &Arc<Context>) -> Res<TimingEvent> {
        ctx.bind()?;
        let mut e = MaybeUninit::<sys::CUevent>::uninit();
        // SAFETY: context bound; `e` is a valid out-pointer; 0 = CU_EVENT_DEFAULT (timing on).
        cu("cuEventCreate", unsafe {
            sys::cuEventCreate(e.as_mut_ptr(), 0)
        })?;
        Ok(TimingEvent {
            // SAFETY: written on success.
            raw: unsafe { e.assume_init() },
            ctx: ctx.clone(),
        })
    }

    fn record(&self, s: &Stream) -> Res<()> {
        self.ctx.bind()?;
        // SAFETY: context bound; event and stream belong to it and live for the call.
        cu("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, s.as_raw())
        })
    }

    /// Milliseconds from `self` to `end`, once `end` completed.
    fn elapsed_ms(&self, end: &TimingEvent) -> Res<f32> {
        self.ctx.bind()?;
        // SAFETY: context bound; `end` is valid.
        cu("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(end.raw)
        })?;
        let mut ms = 0f32;
        // SAFETY: context bound; both events were recorded with timing enabled and completed.
        cu("cuEventElapsedTime_v2", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, self.raw, end.raw)
        })?;
        Ok(ms)
    }
}

impl Drop for TimingEvent {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: context bound; the event was created by `new` and is destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}

/// Device-to-device copies (`cuMemcpyDtoDAsync_v2`) of each size in `sizes`
/// (`label:bytes,label:bytes...`), timed on the GPU with events; `iters` per size.
pub fn d2d_case(kv: &Kv) -> Res<Value> {
    let iters: usize = kv.get("iters")?;
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let (start, stop) = (TimingEvent::new(&ctx)?, TimingEvent::new(&ctx)?);
    let mut records = Vec::new();
    for item in kv.str("sizes")?.split(',') {
        let (label, bytes) = item
            .split_once(':')
            .ok_or_else(|| format!("size {item:?} is not label:bytes"))?;
        let bytes: usize = bytes.parse()?;
        let src = DeviceBuffer::new(&ctx, bytes)?;
        let dst = DeviceBuffer::new(&ctx, bytes)?;
        src.memset_u32_async(0x5a5a_5a5a, &stream)?;
        let mut us = Vec::with_capacity(iters);
        for k in 0..iters + 3 {
            start.record(&stream)?;
            ctx.bind()?;
            // SAFETY: context bound; both ranges are `bytes` long inside live allocations of this
            // context; the stream belongs to it.
            cu("cuMemcpyDtoDAsync_v2", unsafe {
                sys::cuMemcpyDtoDAsync_v2(
                    dst.device_ptr(),
                    src.device_ptr(),
                    bytes,
                    stream.as_raw(),
                )
            })?;
            stop.record(&stream)?;
            let ms = start.elapsed_ms(&stop)?;
            if k >= 3 {
                us.push(f64::from(ms) * 1e3);
            }
        }
        stream.synchronize()?;
        let key = Key::new(
            "limits",
            "d2d_copy",
            label,
            format!("bytes={bytes} iters={iters}"),
        );
        let med = median(&us);
        records.extend(key.dist("copy_time", &us, 1.0, "us"));
        records.push(key.rec(
            "gb_per_s",
            "p50",
            bytes as f64 / med / 1e3,
            "GB/s",
            us.len(),
        ));
        records.push(key.rec("bytes", "value", bytes as f64, "bytes", 1));
    }
    Ok(json!({"records": records, "info": {"iters": iters}}))
}
