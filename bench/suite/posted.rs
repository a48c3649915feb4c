//! Receives posted ahead: how soon the consumer's first kernel on a frame starts after the
//! producer's write of it ended, both on the GPU, while the consumer's host thread is asleep. The
//! channel (`impl=posted`: a ring channel, [`Consumer::post`]) beside its raw floor
//! (`impl=bare_posted`: raw driver calls only), with the same pacing and the same clocks.
//!
//! Per frame `k` (after the consumer acknowledged frame `k - 1`, and `gap_us` later):
//! - producer: a fill kernel writes the buffer, a `stamp` kernel writes `%globaltimer` (**write
//!   end**), then the ready word's write (channel: `WriteFrame::publish`, which also stores the
//!   sequence number and wakes sleepers; floor: `cuStreamWriteValue32` of `k + 1` into its page);
//! - consumer, enqueued `ahead` frames in advance: the stream's wait for that word
//!   (`cuStreamWaitValue32`, GEQ), a `stamp` kernel (**kernel start**), an event; the channel's post
//!   also enqueues the release word's write. Its host sleeps (channel: in `Posted::wait`, a futex;
//!   both: `cuEventSynchronize` of frame `k`'s event), acknowledges `k`, and posts frame `k + ahead`.
//!
//! **posted_kernel_start** = kernel start − write end, two `%globaltimer` readings of one GPU (no
//! clock mapping involved).

use crate::Res;
use crate::STEP;
use crate::bare::{self, GPU_READY_OFF};
use crate::clock::{View, cu};
use crate::handoff::{pace, wait_ack};
use crate::kv::{Kv, parse_wait};
use crate::peer::{Peer, Shared, parent_alive};
use crate::records::Key;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory, Event, Stream};
use cuda_ipc::raw::kernels::Kernels;
use cudarc::driver::sys;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Buffers of the channel's ring (and receives posted ahead: one less).
const RING: usize = 4;

/// The producer side of one case; spawns the consumer and returns the records.
pub fn run_case(kv: &Kv) -> Res<Value> {
    let imp = kv.str("impl")?;
    let wait_name = kv.str("wait")?;
    let wait = parse_wait(&wait_name)?;
    let frames: u64 = kv.get("frames")?;
    let warmup: u64 = kv.get("warmup")?;
    let gap_us: u64 = kv.get("gap_us")?;
    let bytes: usize = kv.get("bytes")?;
    let key = Key::new(
        "posted",
        &imp,
        &kv.str("scenario")?,
        format!("wait={wait_name} frames={frames} warmup={warmup} gap_us={gap_us} bytes={bytes}"),
    );
    let total = warmup + frames;
    let ctx = Context::default_device()?;
    // The context current on this thread for both implementations (as in `handoff.rs`).
    ctx.bind()?;
    let kernels = Kernels::load(&ctx)?;
    let shared = Shared::create("posted")?;
    let stamps = DeviceBuffer::new(&ctx, 8 * total as usize)?;
    let mut args = vec![
        ("impl".to_string(), imp.clone()),
        ("shared".into(), shared.name().to_string()),
        ("wait".into(), wait_name.clone()),
        ("total".into(), total.to_string()),
        ("ahead".into(), (RING - 1).to_string()),
    ];
    let consumer_result = match imp.as_str() {
        "posted" => {
            let name = format!("bench-posted-{}", std::process::id());
            let opts = ChannelOptions::new(bytes)
                .buffers(RING)
                .ring(true)
                .wait(wait);
            let mut tx = Producer::create(&ctx, &name, &opts)?;
            args.push(("channel".into(), name));
            let mut peer = Peer::spawn("posted consumer", "posted-consumer", &args)?;
            peer.expect("READY", Duration::from_secs(60))?;
            for i in 0..total {
                wait_ack(&shared, i, &mut peer)?;
                let idle_since = Instant::now();
                let frame = tx.acquire(Some(STEP))?;
                pace(idle_since, gap_us);
                kernels.fill_pattern(frame.buffer()?, i as u32, frame.stream()?)?;
                kernels.stamp(&View::slot(&stamps, i as usize)?, frame.stream()?)?;
                frame.publish(&i.to_le_bytes())?;
            }
            wait_ack(&shared, total, &mut peer)?;
            let r = peer.result(STEP)?;
            peer.finish(STEP)?;
            tx.close(Duration::from_secs(5))?;
            r
        }
        "bare_posted" => {
            let stream = Stream::new(&ctx)?;
            let buf = DeviceBuffer::new(&ctx, bytes)?;
            let page = bare::Page::create("posted")?;
            // Drops before the page (declared after it).
            let reg = bare::Registration::new(&ctx, &page)?;
            args.push(("bare".into(), page.name().to_string()));
            let mut peer = Peer::spawn("posted floor consumer", "posted-consumer", &args)?;
            peer.expect("READY", Duration::from_secs(60))?;
            for i in 0..total {
                wait_ack(&shared, i, &mut peer)?;
                let idle_since = Instant::now();
                pace(idle_since, gap_us);
                kernels.fill_pattern(&buf, i as u32, &stream)?;
                kernels.stamp(&View::slot(&stamps, i as usize)?, &stream)?;
                ctx.bind()?;
                // SAFETY: context current (bound above); the word lies in the page registered in
                // this context, which stays registered until the stream drained (below); DEFAULT is
                // a defined flag.
                cu("cuStreamWriteValue32_v2", unsafe {
                    sys::cuStreamWriteValue32_v2(
                        stream.as_raw(),
                        reg.word(GPU_READY_OFF),
                        (i + 1) as u32,
                        sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                    )
                })?;
            }
            wait_ack(&shared, total, &mut peer)?;
            let r = peer.result(STEP)?;
            peer.finish(STEP)?;
            stream.synchronize()?;
            drop(reg);
            r
        }
        x => return Err(format!("unknown impl {x:?} (posted|bare_posted)").into()),
    };
    let produced = read_stamps(&stamps, total)?;
    let consumed: Vec<u64> = consumer_result
        .get("stamps")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    if consumed.len() != total as usize {
        return Err(format!("{} consumer stamps for {total} frames", consumed.len()).into());
    }
    let lat: Vec<f64> = (warmup as usize..total as usize)
        .map(|k| consumed[k] as f64 - produced[k] as f64)
        .collect();
    let early = lat.iter().filter(|&&d| d < 0.0).count();
    let mut records = Vec::new();
    records.extend(key.dist_us("posted_kernel_start", &lat));
    Ok(json!({
        "records": records,
        "info": {
            "impl": imp, "wait": wait_name, "frames": frames, "warmup": warmup, "gap_us": gap_us,
            "bytes": bytes, "ahead": RING - 1,
            "started_before_write_end": early,
        },
    }))
}

/// The consumer side (both implementations). Prints READY, then RESULT with its `%globaltimer`
/// stamps, one per frame.
pub fn consumer(kv: &Kv) -> Res<Value> {
    let imp = kv.str("impl")?;
    let wait = parse_wait(&kv.str("wait")?)?;
    let total: u64 = kv.get("total")?;
    let ahead: u64 = kv.get("ahead")?;
    let shared = Shared::open(&kv.str("shared")?)?;
    let ctx = Context::default_device()?;
    ctx.bind()?;
    let kernels = Kernels::load(&ctx)?;
    let stamps = DeviceBuffer::new(&ctx, 8 * total as usize)?;
    let events: Vec<Event> = (0..=ahead)
        .map(|_| Event::new(&ctx))
        .collect::<cuda_ipc::Result<_>>()?;
    let event = |k: u64| &events[(k % (ahead + 1)) as usize];
    let ack = |k: u64| {
        // SYNC POINT: handoff ack. Release: pairs with the Acquire load in `wait_ack`.
        shared.ack().store(k + 1, Ordering::Release);
    };
    match imp.as_str() {
        "posted" => {
            let rx = Consumer::attach_in(
                &ctx,
                &kv.str("channel")?,
                &ConsumerOptions::new().wait(wait),
            )?;
            let post = |k: u64| {
                rx.post(|p| {
                    kernels.stamp(
                        &View::slot(&stamps, k as usize).map_err(other)?,
                        p.stream()?,
                    )?;
                    event(k).record(p.stream()?)
                })
            };
            let mut posted = VecDeque::new();
            for k in 0..ahead.min(total) {
                posted.push_back(post(k)?);
            }
            println!("READY");
            for k in 0..total {
                let p = posted.pop_front().ok_or("no posted receive")?;
                let f = p.wait(Some(STEP))?;
                if f.seq() != k + 1 {
                    return Err(format!("frame {} where {} was posted", f.seq(), k + 1).into());
                }
                sleep_until_complete(event(k), k)?;
                ack(k);
                if k + ahead < total {
                    posted.push_back(post(k + ahead)?);
                }
            }
            rx.stream()?.synchronize()?;
        }
        "bare_posted" => {
            let stream = Stream::new(&ctx)?;
            let page = bare::Page::open(&kv.str("bare")?)?;
            let reg = bare::Registration::new(&ctx, &page)?;
            let post = |k: u64| -> Res<()> {
                ctx.bind()?;
                // SAFETY: context current (bound above); the word lies in the page registered
                // in this context, which stays registered until the stream drained (below); GEQ
                // is a defined flag.
                cu("cuStreamWaitValue32_v2", unsafe {
                    sys::cuStreamWaitValue32_v2(
                        stream.as_raw(),
                        reg.word(GPU_READY_OFF),
                        (k + 1) as u32,
                        sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                    )
                })?;
                kernels.stamp(&View::slot(&stamps, k as usize)?, &stream)?;
                event(k).record(&stream)?;
                Ok(())
            };
            for k in 0..ahead.min(total) {
                post(k)?;
            }
            println!("READY");
            for k in 0..total {
                sleep_until_complete(event(k), k)?;
                ack(k);
                if k + ahead < total {
                    post(k + ahead)?;
                }
            }
            stream.synchronize()?;
            drop(reg);
        }
        x => return Err(format!("unknown impl {x:?}").into()),
    }
    let stamps = read_stamps(&stamps, total)?;
    Ok(json!({ "stamps": stamps }))
}

/// The `total` `%globaltimer` stamps (`u64`, ns) the stamp kernels wrote into `stamps`.
fn read_stamps(stamps: &DeviceBuffer, total: u64) -> Res<Vec<u64>> {
    let mut raw = vec![0u8; 8 * total as usize];
    stamps.copy_to_host(0, &mut raw)?;
    Ok(raw
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect())
}

/// Waits for frame `k`'s event with the host asleep between looks (50 µs), the same in both
/// implementations, bounded by [`STEP`] and the producer's life.
fn sleep_until_complete(e: &Event, k: u64) -> Res<()> {
    let t = Instant::now();
    while !e.is_complete()? {
        if t.elapsed() > STEP || !parent_alive() {
            return Err(format!("frame {} never came", k + 1).into());
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    Ok(())
}

fn other(e: Box<dyn std::error::Error>) -> cuda_ipc::Error {
    cuda_ipc::Error::InvalidArgument(e.to_string())
}
