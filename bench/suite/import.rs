//! Import cost: `ImportedBuffer::open_in` of a handle the first time (a driver
//! `cuIpcOpenMemHandle`), again after the last import of it was dropped (the cache holds no mapping
//! then, so it is a driver open again), and while a mapping is held (served by the cache); the close
//! (`cuIpcCloseMemHandle` when the last user drops); `IpcEvent::open_in` (`cuIpcOpenEventHandle`,
//! not cached); `Token::from_bytes`. An exporter child owns the buffers, since a process's own
//! handles are served by its local table, not by the driver.

use crate::Res;
use crate::common::now_ns;
use crate::kv::Kv;
use crate::peer::Peer;
use crate::records::{Key, median};
use cuda_ipc::driver::{Context, DeviceBuffer};
use cuda_ipc::ipc::{ImportedBuffer, IpcEvent, cache_stats};
use cuda_ipc::token::Token;
use serde_json::{Value, json};
use std::io::BufRead;
use std::time::Duration;

/// The importing side: spawns the exporter, measures, returns the records.
pub fn run_case(kv: &Kv) -> Res<Value> {
    let handles: usize = kv.get("handles")?;
    let bytes: usize = kv.get("bytes")?;
    let cached_iters: usize = kv.get("cached_iters")?;
    let params = format!("handles={handles} bytes={bytes} cached_iters={cached_iters}");
    let key = Key::new("import", "cuda_ipc", "legacy", params);
    let ctx = Context::default_device()?;
    let mut peer = Peer::spawn(
        "exporter",
        "import-exporter",
        &[
            ("handles".into(), handles.to_string()),
            ("bytes".into(), bytes.to_string()),
        ],
    )?;
    let mut mem = Vec::new();
    let mut events = Vec::new();
    for _ in 0..handles {
        mem.push(Token::from_hex(
            &peer.expect("MEM ", Duration::from_secs(60))?,
        )?);
    }
    for _ in 0..handles {
        events.push(Token::from_hex(
            &peer.expect("EVENT ", Duration::from_secs(60))?,
        )?);
    }
    let stats0 = cache_stats();
    // The timer's own cost, to read the per-call medians against.
    let timer: Vec<f64> = (0..10_000)
        .map(|_| {
            let a = now_ns();
            (now_ns() - a) as f64
        })
        .collect();
    // First import of each distinct handle: a driver open.
    let mut first = Vec::new();
    let mut held = Vec::new();
    for t in &mem {
        let a = now_ns();
        let b = ImportedBuffer::open_in(&ctx, t)?;
        first.push((now_ns() - a) as f64);
        held.push(b);
    }
    // Cached: the mapping of handle 0 is held, so every further import is a cache hit.
    let mut cached = Vec::with_capacity(cached_iters);
    for _ in 0..cached_iters {
        let a = now_ns();
        let b = ImportedBuffer::open_in(&ctx, &mem[0])?;
        cached.push((now_ns() - a) as f64);
        drop(b);
    }
    let a = now_ns();
    for _ in 0..cached_iters {
        std::hint::black_box(ImportedBuffer::open_in(&ctx, &mem[0])?);
    }
    let cached_batch_mean = (now_ns() - a) as f64 / cached_iters as f64;
    // Parsing a token (what a consumer does with the registry's bytes before importing).
    let token_bytes = mem[0].to_bytes();
    let parse: Vec<f64> = (0..cached_iters.min(10_000))
        .map(|_| {
            let a = now_ns();
            std::hint::black_box(Token::from_bytes(std::hint::black_box(&token_bytes)).ok());
            (now_ns() - a) as f64
        })
        .collect();
    // Close: dropping the last import of each (cuCtxSynchronize + cuIpcCloseMemHandle).
    let mut close = Vec::new();
    for b in held.drain(..) {
        let a = now_ns();
        drop(b);
        close.push((now_ns() - a) as f64);
    }
    // Uncached again: open, drop (closes), open the same handle... each a driver open.
    let mut reopen = Vec::new();
    for _ in 0..handles {
        let a = now_ns();
        let b = ImportedBuffer::open_in(&ctx, &mem[0])?;
        reopen.push((now_ns() - a) as f64);
        drop(b);
    }
    // Events: each open is a driver call (events are not cached).
    let mut ev_open = Vec::new();
    let mut ev_held = Vec::new();
    for t in &events {
        let a = now_ns();
        let e = IpcEvent::open_in(&ctx, t)?;
        ev_open.push((now_ns() - a) as f64);
        ev_held.push(e);
    }
    drop(ev_held);
    let stats1 = cache_stats();
    peer.close_stdin(); // the exporter sees end of file and exits
    peer.result(Duration::from_secs(30))?;
    peer.finish(Duration::from_secs(30))?;
    let mut records = Vec::new();
    // The very first open of the process may pay one-time set-up; it is reported apart.
    records.push(key.rec("first_import_very_first", "value", first[0] / 1e3, "us", 1));
    records.extend(key.dist_us("first_import", &first[1.min(first.len())..]));
    records.extend(key.dist_us("reopen_after_close", &reopen));
    records.extend(key.dist_us("cached_import", &cached));
    records.push(key.rec(
        "cached_import_batch_mean",
        "value",
        cached_batch_mean / 1e3,
        "us",
        cached_iters,
    ));
    records.extend(key.dist_us("close", &close));
    records.extend(key.dist_us("event_open", &ev_open));
    records.extend(key.dist_us("token_parse", &parse));
    records.push(key.rec(
        "timer_overhead",
        "p50",
        median(&timer) / 1e3,
        "us",
        timer.len(),
    ));
    Ok(json!({
        "records": records,
        "info": {
            "handles": handles, "bytes": bytes, "cached_iters": cached_iters,
            "driver_opens": stats1.driver_opens - stats0.driver_opens,
            "cache_hits": stats1.hits - stats0.hits,
            "driver_closes": stats1.driver_closes - stats0.driver_closes,
            "note": "per-call times include one CLOCK_MONOTONIC read (timer_overhead)",
        },
    }))
}

/// The exporter: allocates `handles` buffers and IPC events, prints their tokens, then waits for
/// its stdin to close (the importer finished or died).
pub fn exporter(kv: &Kv) -> Res<Value> {
    let handles: usize = kv.get("handles")?;
    let bytes: usize = kv.get("bytes")?;
    let ctx = Context::default_device()?;
    let mut bufs = Vec::new();
    let mut evs = Vec::new();
    for _ in 0..handles {
        let b = DeviceBuffer::new(&ctx, bytes)?;
        println!("MEM {}", b.export()?.to_hex());
        bufs.push(b);
    }
    for _ in 0..handles {
        let e = IpcEvent::new(&ctx)?;
        println!("EVENT {}", e.export()?.to_hex());
        evs.push(e);
    }
    // Blocks until the parent closes the pipe (or dies); the buffers live until then.
    let mut line = String::new();
    while std::io::stdin().lock().read_line(&mut line)? > 0 {
        line.clear();
    }
    Ok(json!({"exported": handles}))
}
