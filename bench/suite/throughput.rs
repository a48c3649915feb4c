//! Throughput through the channel, saturated: the producer fills every frame with a kernel
//! (`fill_pattern`) and publishes as fast as the pool of 4 lets it; each consumer checks every word
//! of every frame with a kernel (`check_pattern`) and releases it. Zero mismatches are required.
//!
//! Frames/s = frames / (the last consumer's end − the start), where the start is taken after a
//! warm-up once every consumer has received and released the warm-up frames, and a consumer's end
//! is after its stream finished the check of the last frame. GB/s counts the bytes handed over
//! (written once, read once by each consumer, never copied). The hand-off latency of these frames
//! is the saturated case: it includes the time a frame waits in the ring for a busy consumer.
//!
//! `posted=true`: a ring channel of 8 buffers whose consumers post their receives 7 frames ahead
//! (`Consumer::post`: the check is enqueued before the frame exists), so the producer runs ahead
//! through the ring and the GPU can run several frames of one process before switching to the
//! other.

use crate::STEP;
use crate::common::{FrameMeta, now_ns};
use crate::kv::{Kv, parse_wait};
use crate::peer::{Peer, spin_until};
use crate::records::Key;
use crate::{HEIGHT, Res, WIDTH};
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory};
use cuda_ipc::raw::kernels::Kernels;
use serde_json::{Value, json};
use std::time::Duration;

/// Buffers of the ring in the posted mode (its consumers post one less ahead).
const POSTED_RING: usize = 8;

/// The producer side: spawns the consumers, streams the frames, returns the records.
pub fn run_case(kv: &Kv) -> Res<Value> {
    let consumers: usize = kv.get("consumers")?;
    let frames: u64 = kv.get("frames")?;
    let warmup: u64 = kv.get("warmup")?;
    let wait_name = kv.str("wait")?;
    let wait = parse_wait(&wait_name)?;
    let bytes: usize = kv.get("bytes")?;
    let posted: bool = kv.get_or("posted", false)?;
    let params = format!(
        "consumers={consumers} wait={wait_name} frames={frames} warmup={warmup} bytes={bytes} posted={posted}"
    );
    let total = warmup + frames;
    let ctx = Context::default_device()?;
    let kernels = Kernels::load(&ctx)?;
    let name = format!("bench-tput-{}", std::process::id());
    let opts = ChannelOptions::new(bytes)
        .buffers(if posted { POSTED_RING } else { 4 })
        .ring(posted)
        .max_consumers(consumers.max(8))
        .wait(wait);
    let mut tx = Producer::create(&ctx, &name, &opts)?;
    let mut peers = Vec::new();
    for c in 0..consumers {
        let args = vec![
            ("channel".to_string(), name.clone()),
            ("wait".into(), wait_name.clone()),
            ("total".into(), total.to_string()),
            ("warmup".into(), warmup.to_string()),
            ("posted".into(), posted.to_string()),
        ];
        peers.push(Peer::spawn(
            &format!("consumer {c}"),
            "throughput-consumer",
            &args,
        )?);
    }
    for p in &mut peers {
        p.expect("READY", Duration::from_secs(60))?;
    }
    let mut t_start = now_ns();
    for i in 0..total {
        if i == warmup {
            let mut dead = None;
            spin_until(
                "the consumers to finish the warm-up",
                STEP,
                || {
                    let s = tx.stats();
                    s.consumers.len() == consumers
                        && s.consumers
                            .iter()
                            .all(|c| c.received >= warmup && c.in_flight == 0)
                },
                || {
                    for p in peers.iter_mut() {
                        if !p.alive() {
                            dead = Some(p.name().to_string());
                            return false;
                        }
                    }
                    true
                },
            )
            .map_err(|e| format!("{e} ({})", dead.unwrap_or_default()))?;
            t_start = now_ns();
        }
        let frame = tx.acquire(Some(STEP))?;
        kernels.fill_pattern(frame.buffer()?, i as u32, frame.stream()?)?;
        let m = FrameMeta {
            index: i,
            width: WIDTH,
            height: HEIGHT,
            stamp_ns: now_ns(),
        };
        frame.publish(&m.encode())?;
    }
    tx.stream()?.synchronize()?;
    let mut results = Vec::new();
    for p in &mut peers {
        results.push(p.result(Duration::from_secs(60))?);
    }
    for p in &mut peers {
        p.finish(STEP)?;
    }
    let report = tx.close(Duration::from_secs(5))?;
    let num = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let t_end = results
        .iter()
        .map(|r| num(r, "t_done_ns"))
        .fold(0.0, f64::max);
    let secs = (t_end - t_start as f64) / 1e9;
    let fps = frames as f64 / secs;
    let mismatches: f64 = results.iter().map(|r| num(r, "mismatches")).sum();
    let out_of_order: f64 = results.iter().map(|r| num(r, "out_of_order")).sum();
    let mut lat = Vec::new();
    for r in &results {
        if let Some(a) = r.get("lat_ns").and_then(Value::as_array) {
            lat.extend(a.iter().filter_map(Value::as_f64));
        }
    }
    let tag = if posted { "-posted" } else { "" };
    let key = Key::new(
        "throughput",
        "channel",
        &format!("c{consumers}{tag}.{wait_name}"),
        params.clone(),
    );
    let n = frames as usize;
    let mut records = vec![
        key.rec("frames_per_s", "value", fps, "frames/s", n),
        key.rec("gb_per_s", "value", fps * bytes as f64 / 1e9, "GB/s", n),
        key.rec(
            "consumer_read_gb_per_s",
            "value",
            fps * bytes as f64 * consumers as f64 / 1e9,
            "GB/s",
            n,
        ),
        key.rec("mismatches", "value", mismatches, "words", n * consumers),
        key.rec(
            "out_of_order",
            "value",
            out_of_order,
            "frames",
            n * consumers,
        ),
    ];
    let sat = if consumers == 1 {
        format!("{wait_name}.saturated{tag}")
    } else {
        format!("{wait_name}.saturated-c{consumers}{tag}")
    };
    records.extend(Key::new("handoff", "channel", &sat, params).dist_us("ready", &lat));
    let ok = mismatches == 0.0 && out_of_order == 0.0;
    let mut out = json!({
        "records": records,
        "info": {
            "consumers": consumers, "frames": frames, "warmup": warmup, "wait": wait_name,
            "bytes": bytes, "seconds": secs, "forced_holds_at_close": report.forced_holds,
            "mismatched_words": mismatches, "out_of_order": out_of_order, "ok": ok,
        },
    });
    if !ok {
        out["error"] = json!(format!(
            "{mismatches} mismatched words, {out_of_order} frames out of order"
        ));
    }
    Ok(out)
}

/// One consumer: checks every frame, reports its counts, end time and latencies.
pub fn consumer(kv: &Kv) -> Res<Value> {
    let wait = parse_wait(&kv.str("wait")?)?;
    let total: u64 = kv.get("total")?;
    let warmup: u64 = kv.get("warmup")?;
    let ctx = Context::default_device()?;
    let rx = Consumer::attach_in(
        &ctx,
        &kv.str("channel")?,
        &ConsumerOptions::new().wait(wait),
    )?;
    let kernels = Kernels::load(&ctx)?;
    let counter = DeviceBuffer::new(&ctx, 8)?;
    counter.copy_from_host(0, &[0; 8])?;
    let mut lat = Vec::with_capacity(total as usize);
    let mut out_of_order = 0u64;
    if kv.get_or("posted", false)? {
        // Frame s (index s - 1) is checked against the seed the producer filled it with.
        let post = || {
            rx.post(|p| {
                kernels.check_pattern(p.buffer()?, (p.seq() - 1) as u32, &counter, p.stream()?)
            })
        };
        let ahead = (POSTED_RING as u64 - 1).min(total);
        let mut posted = std::collections::VecDeque::new();
        for _ in 0..ahead {
            posted.push_back(post()?);
        }
        println!("READY");
        for k in 0..total {
            let p = posted.pop_front().ok_or("no posted receive")?;
            let f = p.wait(Some(STEP))?;
            let t_ready = now_ns();
            let m = FrameMeta::decode(f.metadata()).ok_or("short metadata")?;
            if m.index != k {
                out_of_order += 1;
            }
            if k >= warmup {
                lat.push(t_ready.saturating_sub(m.stamp_ns));
            }
            if k + ahead < total {
                posted.push_back(post()?);
            }
        }
        rx.stream()?.synchronize()?;
        let t_done = now_ns();
        let mut b = [0u8; 8];
        counter.copy_to_host(0, &mut b)?;
        return Ok(json!({
            "received": total,
            "mismatches": u64::from_le_bytes(b),
            "out_of_order": out_of_order,
            "t_done_ns": t_done,
            "lat_ns": lat,
        }));
    }
    println!("READY");
    for k in 0..total {
        let frame = rx.recv_timeout(STEP)?;
        let t_ready = now_ns();
        let m = FrameMeta::decode(frame.metadata()).ok_or("short metadata")?;
        if m.index != k {
            out_of_order += 1;
        }
        kernels.check_pattern(frame.buffer()?, m.index as u32, &counter, rx.stream()?)?;
        if k >= warmup {
            lat.push(t_ready.saturating_sub(m.stamp_ns));
        }
        drop(frame); // release, ordered after the check on our stream
    }
    rx.stream()?.synchronize()?;
    let t_done = now_ns();
    let mut b = [0u8; 8];
    counter.copy_to_host(0, &mut b)?;
    Ok(json!({
        "received": total,
        "mismatches": u64::from_le_bytes(b),
        "out_of_order": out_of_order,
        "t_done_ns": t_done,
        "lat_ns": lat,
    }))
}
