//! Hand-off latency with an idle consumer: the channel, the floor built from the crate's lower
//! layers, and the bare floor built from raw calls only (`bare.rs`), with the same wait strategy,
//! the same pacing and the same clocks.
//!
//! One frame, paced so that it is the hand-off and not queueing that is measured:
//! 1. the producer waits until the consumer has finished the previous frame, its GPU work included
//!    (the `ack` word);
//! 2. it fills a pool buffer with a kernel and waits for it (`cuStreamSynchronize`), so no GPU work
//!    of its own is pending, then waits until `gap_us` after the ack, so the consumer is idle in its
//!    wait (`fill=false`, used with the short gap, skips the fill so the frame surely comes within
//!    the default 50 µs spin window);
//! 3. `t0` = CLOCK_MONOTONIC, then `publish` (channel: record the buffer's IPC event, write the
//!    metadata and the sequence number, wake; floor: record an IPC event, store `t0` and a sequence
//!    number in shared memory, `FUTEX_WAKE` unless spinning; bare floor: store `t0` and the
//!    sequence number in its own page, `FUTEX_WAKE` unless spinning). `t0` travels in the metadata;
//! 4. the consumer returns from its wait with the stream wait enqueued (`recv` / `cuStreamWaitEvent`
//!    / `cuStreamWaitValue32`): **ready** = now − `t0`; it launches the `stamp` kernel, whose
//!    `%globaltimer` converted to host time (see `clock`) gives **kernel start** − `t0`;
//! 5. it releases the frame (timed: **release call**; bare floor: `cuStreamWriteValue32` of its ack
//!    word), waits for its stream and stores the ack.
//!
//! With `cost=true` (the zero-copy case) every odd frame is instead taken only once its `publish`
//! has returned (the `published` word), so `recv` does not wait: **consumer cost** = that `recv`
//! call + the release, the consumer's whole per-frame price for a frame of any size.

use crate::bare::{self, BareWait};
use crate::clock::{self, GpuClock, View};
use crate::common::{FrameMeta, now_ns};
use crate::kv::{Kv, parse_wait};
use crate::peer::{Peer, Shared, parent_alive, spin_until};
use crate::records::Key;
use crate::{HEIGHT, Res, STEP, WIDTH};
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer, WaitStrategy};
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory, Stream};
use cuda_ipc::ipc::IpcEvent;
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::raw::shm::futex;
use cuda_ipc::token::Token;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Waits until `gap_us` µs after `since`: sleeping for gaps of 200 µs and more (the consumer is
/// idle either way), spinning below (a sleep would overshoot).
pub fn pace(since: Instant, gap_us: u64) {
    let end = since + Duration::from_micros(gap_us);
    if gap_us >= 200 {
        std::thread::sleep(end.saturating_duration_since(Instant::now()));
    } else {
        while Instant::now() < end {
            std::hint::spin_loop();
        }
    }
}

/// The producer side of one hand-off case; spawns the consumer and returns the records.
pub fn run_case(kv: &Kv) -> Res<Value> {
    let imp = kv.str("impl")?;
    let wait_name = kv.str("wait")?;
    let wait = parse_wait(&wait_name)?;
    let frames: u64 = kv.get("frames")?;
    let warmup: u64 = kv.get("warmup")?;
    let gap_us: u64 = kv.get("gap_us")?;
    let bytes: usize = kv.get("bytes")?;
    let cost: bool = kv.get_or("cost", false)?;
    let fill: bool = kv.get_or("fill", true)?;
    let key = Key::new(
        &kv.str("bench")?,
        &imp,
        &kv.str("scenario")?,
        format!(
            "wait={wait_name} frames={frames} warmup={warmup} gap_us={gap_us} bytes={bytes} fill={fill}"
        ),
    );
    let total = warmup + frames;
    let ctx = Context::default_device()?;
    // Every implementation runs with its context current on the calling thread, as a CUDA
    // application's thread has it and as the bare floor's raw calls need (the crate's calls then
    // skip the push and pop of `Context::enter`).
    ctx.bind()?;
    let kernels = Kernels::load(&ctx)?;
    let shared = Shared::create("handoff")?;
    let mut args = vec![
        ("impl".to_string(), imp.clone()),
        ("shared".into(), shared.name().to_string()),
        ("wait".into(), wait_name.clone()),
        ("total".into(), total.to_string()),
        ("warmup".into(), warmup.to_string()),
        ("cost".into(), cost.to_string()),
    ];
    let mut publish_ns = Vec::with_capacity(frames as usize);
    let consumer_result = match imp.as_str() {
        "channel" => {
            let name = format!("bench-{}", std::process::id());
            let opts = ChannelOptions::new(bytes).buffers(4).wait(wait);
            let mut tx = Producer::create(&ctx, &name, &opts)?;
            args.push(("channel".into(), name));
            let mut peer = Peer::spawn("consumer", "handoff-consumer", &args)?;
            peer.expect("READY", Duration::from_secs(60))?;
            for i in 0..total {
                wait_ack(&shared, i, &mut peer)?;
                let idle_since = Instant::now();
                let frame = tx.acquire(Some(STEP))?;
                if fill {
                    kernels.fill_pattern(frame.buffer()?, i as u32, frame.stream()?)?;
                }
                frame.stream()?.synchronize()?;
                pace(idle_since, gap_us);
                let t0 = now_ns();
                frame.publish(&meta(i, t0))?;
                let t1 = now_ns();
                // Release: pairs with the consumer's Acquire load in cost mode.
                shared.published().store(i + 1, Ordering::Release);
                if i >= warmup {
                    publish_ns.push((t1 - t0) as f64);
                }
            }
            wait_ack(&shared, total, &mut peer)?;
            let r = peer.result(STEP)?;
            peer.finish(STEP)?;
            tx.close(Duration::from_secs(5))?;
            r
        }
        "floor" => {
            let stream = Stream::new(&ctx)?;
            let buf = DeviceBuffer::new(&ctx, bytes)?;
            let event = IpcEvent::new(&ctx)?;
            args.push(("event".into(), event.export()?.to_hex()));
            let mut peer = Peer::spawn("floor consumer", "handoff-consumer", &args)?;
            peer.expect("READY", Duration::from_secs(60))?;
            let spin = matches!(wait, WaitStrategy::Spin);
            for i in 0..total {
                wait_ack(&shared, i, &mut peer)?;
                let idle_since = Instant::now();
                if fill {
                    kernels.fill_pattern(&buf, i as u32, &stream)?;
                }
                stream.synchronize()?;
                pace(idle_since, gap_us);
                let t0 = now_ns();
                // Relaxed: published by the Release store of seq below.
                shared.stamp().store(t0, Ordering::Relaxed);
                event.record(&stream)?;
                // Release: pairs with the consumer's Acquire load in `wait_seq`.
                shared.seq().store((i + 1) as u32, Ordering::Release);
                if !spin {
                    futex::wake(shared.seq(), u32::MAX);
                }
                let t1 = now_ns();
                if i >= warmup {
                    publish_ns.push((t1 - t0) as f64);
                }
            }
            wait_ack(&shared, total, &mut peer)?;
            let r = peer.result(STEP)?;
            peer.finish(STEP)?;
            r
        }
        "bare_floor" | "bare_hold" => {
            // Setup as the floor's (the fill's stream and buffer); the hand-off is `bare.rs`.
            let hold = imp == "bare_hold";
            let stream = Stream::new(&ctx)?;
            let buf = DeviceBuffer::new(&ctx, bytes)?;
            let page = bare::Producer::create(&ctx, "handoff", BareWait::of(wait))?;
            args.push(("bare".into(), page.name().to_string()));
            let mut peer = Peer::spawn("bare floor consumer", "handoff-consumer", &args)?;
            peer.expect("READY", Duration::from_secs(60))?;
            for i in 0..total {
                wait_ack(&shared, i, &mut peer)?;
                let idle_since = Instant::now();
                if hold && page.claim() {
                    return Err(format!("frame {i} is still held after its ack").into());
                }
                if fill {
                    kernels.fill_pattern(&buf, i as u32, &stream)?;
                }
                stream.synchronize()?;
                pace(idle_since, gap_us);
                let t0 = now_ns();
                page.publish(t0, (i + 1) as u32);
                let t1 = now_ns();
                if i >= warmup {
                    publish_ns.push((t1 - t0) as f64);
                }
            }
            wait_ack(&shared, total, &mut peer)?;
            let r = peer.result(STEP)?;
            peer.finish(STEP)?;
            r
        }
        x => {
            return Err(format!("unknown impl {x:?} (channel|floor|bare_floor|bare_hold)").into());
        }
    };
    let samples = |k: &str| -> Vec<f64> {
        consumer_result
            .get(k)
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default()
    };
    let mut records = Vec::new();
    records.extend(key.dist_us("ready", &samples("ready_ns")));
    records.extend(key.dist_us("kernel_start", &samples("kernel_ns")));
    // Cost mode only (empty otherwise): odd frames timed the consumer's per-frame cost.
    records.extend(key.dist_us("recv_call", &samples("recv_cost_ns")));
    records.extend(key.dist_us("consumer_cost", &samples("consumer_cost_ns")));
    records.extend(key.dist_us("publish_call", &publish_ns));
    records.extend(key.dist_us("release_call", &samples("release_ns")));
    Ok(json!({
        "records": records,
        "info": {
            "impl": imp, "wait": wait_name, "frames": frames, "warmup": warmup, "gap_us": gap_us,
            "bytes": bytes, "cost_mode": cost, "fill": fill,
            "clock": consumer_result.get("clock").cloned().unwrap_or(Value::Null),
            "out_of_order": consumer_result.get("out_of_order").cloned().unwrap_or(Value::Null),
        },
    }))
}

fn meta(index: u64, stamp_ns: u64) -> [u8; FrameMeta::LEN] {
    FrameMeta {
        index,
        width: WIDTH,
        height: HEIGHT,
        stamp_ns,
    }
    .encode()
}

/// Waits until the consumer acknowledged `n` frames (it is back in its wait for frame `n`).
pub fn wait_ack(shared: &Shared, n: u64, peer: &mut Peer) -> Res<()> {
    let what = format!("the consumer's ack of frame {n}");
    // SYNC POINT: handoff ack. Acquire: pairs with the consumer's Release store of the ack.
    spin_until(
        &what,
        STEP,
        || shared.ack().load(Ordering::Acquire) >= n,
        || peer.alive(),
    )
}

/// Waits by `wait` until `word` holds `target`, as the channel's own wait loop does: spin (reading
/// the clock each turn), then `FUTEX_WAIT` in slices of 20 ms, checking the parent between slices.
fn wait_seq(word: &AtomicU32, target: u32, wait: WaitStrategy) -> Res<()> {
    let start = Instant::now();
    let spin_for = match wait {
        WaitStrategy::Block => Duration::ZERO,
        WaitStrategy::SpinThenBlock(d) => d,
        _ => Duration::MAX,
    };
    let mut last_check = start;
    loop {
        // Acquire: pairs with the producer's Release store of the sequence number.
        let v = word.load(Ordering::Acquire);
        if v == target {
            return Ok(());
        }
        let now = Instant::now();
        if now - last_check >= Duration::from_millis(20) {
            last_check = now;
            if !parent_alive() {
                return Err("the producer is gone".into());
            }
            if now - start >= STEP {
                return Err(format!("no frame {target} within {STEP:?}").into());
            }
        }
        if now - start < spin_for {
            std::hint::spin_loop();
            continue;
        }
        futex::wait(word, v, Duration::from_millis(20));
    }
}

/// The consumer side (every implementation). Prints READY, then RESULT with the raw samples (ns).
pub fn consumer(kv: &Kv) -> Res<Value> {
    let imp = kv.str("impl")?;
    let wait = parse_wait(&kv.str("wait")?)?;
    let total: u64 = kv.get("total")?;
    let warmup: u64 = kv.get("warmup")?;
    let cost: bool = kv.get_or("cost", false)?;
    let shared = Shared::open(&kv.str("shared")?)?;
    let ctx = Context::default_device()?;
    // As in `run_case`: the context current on this thread for every implementation.
    ctx.bind()?;
    let kernels = Kernels::load(&ctx)?;
    let stamps = DeviceBuffer::new(&ctx, 8 * total as usize)?;
    let gpu_clock = GpuClock::new(&ctx, &kernels)?;
    let cal_a = gpu_clock.calibrate(200)?;
    let mut t0s = Vec::with_capacity(total as usize);
    let mut ready = Vec::with_capacity(total as usize);
    let mut release = Vec::new();
    let mut recv_cost = Vec::new();
    let mut consumer_cost = Vec::new();
    let mut measured = Vec::with_capacity(total as usize); // frames whose latency counts
    let mut out_of_order = 0u64;
    match imp.as_str() {
        "channel" => {
            let rx = Consumer::attach_in(
                &ctx,
                &kv.str("channel")?,
                &ConsumerOptions::new().wait(wait),
            )?;
            println!("READY");
            for k in 0..total {
                let timed = cost && k % 2 == 1;
                if timed {
                    // Acquire: pairs with the producer's Release store after `publish` returned.
                    spin_until(
                        "the producer's publish",
                        STEP,
                        || shared.published().load(Ordering::Acquire) > k,
                        parent_alive,
                    )?;
                }
                let t = now_ns();
                let frame = rx.recv_timeout(STEP)?;
                let t_ready = now_ns();
                let m = FrameMeta::decode(frame.metadata()).ok_or("short metadata")?;
                if m.index != k {
                    out_of_order += 1;
                }
                kernels.stamp(&View::slot(&stamps, k as usize)?, rx.stream()?)?;
                let tr = now_ns();
                drop(frame); // release: records our IPC event, ends the hold
                let t_rel = now_ns() - tr;
                if k >= warmup {
                    release.push(t_rel as f64);
                    if timed {
                        recv_cost.push((t_ready - t) as f64);
                        consumer_cost.push((t_ready - t + t_rel) as f64);
                    } else {
                        ready.push(t_ready as f64 - m.stamp_ns as f64);
                        measured.push(k);
                    }
                }
                t0s.push(m.stamp_ns);
                // Our kernel finishes before the producer's next GPU work can start (without MPS,
                // kernels of two processes do not overlap: it would delay the next stamp).
                rx.stream()?.synchronize()?;
                // SYNC POINT: handoff ack. Release: pairs with the Acquire load in `wait_ack`.
                shared.ack().store(k + 1, Ordering::Release);
            }
            rx.stream()?.synchronize()?;
        }
        "floor" => {
            let token = Token::from_hex(&kv.str("event")?)?;
            let event = IpcEvent::open_in(&ctx, &token)?;
            let stream = Stream::new(&ctx)?;
            println!("READY");
            for k in 0..total {
                wait_seq(shared.seq(), (k + 1) as u32, wait)?;
                stream.wait_event(&event)?;
                let t_ready = now_ns();
                // Relaxed: ordered after the Acquire load of seq in `wait_seq`.
                let t0 = shared.stamp().load(Ordering::Relaxed);
                kernels.stamp(&View::slot(&stamps, k as usize)?, &stream)?;
                if k >= warmup {
                    ready.push(t_ready as f64 - t0 as f64);
                    measured.push(k);
                }
                t0s.push(t0);
                stream.synchronize()?; // as in the channel branch
                // SYNC POINT: handoff ack. Release: pairs with the Acquire load in `wait_ack`.
                shared.ack().store(k + 1, Ordering::Release);
            }
            stream.synchronize()?;
        }
        "bare_floor" | "bare_hold" => {
            let stream = Stream::new(&ctx)?;
            // Drops before the stream: drains it, then unregisters and unmaps the page.
            let rx = bare::Consumer::open(
                &ctx,
                &kv.str("bare")?,
                BareWait::of(wait),
                stream.as_raw(),
                imp == "bare_hold",
            )?;
            println!("READY");
            for k in 0..total {
                let seq = (k + 1) as u32;
                let t0 = rx.take(seq, parent_alive)?;
                let t_ready = now_ns();
                kernels.stamp(&View::slot(&stamps, k as usize)?, &stream)?;
                let tr = now_ns();
                rx.release(seq)?;
                let t_rel = now_ns() - tr;
                if k >= warmup {
                    ready.push(t_ready as f64 - t0 as f64);
                    release.push(t_rel as f64);
                    measured.push(k);
                }
                t0s.push(t0);
                rx.drain(seq)?; // as in the channel branch, and the ack word checked
                // SYNC POINT: handoff ack. Release: pairs with the Acquire load in `wait_ack`.
                shared.ack().store(k + 1, Ordering::Release);
            }
        }
        x => return Err(format!("unknown impl {x:?}").into()),
    }
    let cal_b = gpu_clock.calibrate(200)?;
    let mut raw = vec![0u8; 8 * total as usize];
    stamps.copy_to_host(0, &mut raw)?;
    let kernel: Vec<f64> = measured
        .iter()
        .map(|&k| {
            let k = k as usize;
            let g = u64::from_le_bytes(raw[8 * k..8 * k + 8].try_into().unwrap_or_default());
            (clock::to_host(g, &cal_a, &cal_b) - t0s[k] as i128) as f64
        })
        .collect();
    let mut clock_info = clock::describe(&cal_a, &cal_b);
    if let Some(r) = &gpu_clock.fallback_reason {
        clock_info["fallback_reason"] = json!(r);
    }
    Ok(json!({
        "ready_ns": ready,
        "kernel_ns": kernel,
        "release_ns": release,
        "recv_cost_ns": recv_cost,
        "consumer_cost_ns": consumer_cost,
        "out_of_order": out_of_order,
        "clock": clock_info,
    }))
}
