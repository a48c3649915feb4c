//! `tensorset_floor --crate`: the same bytes through the crate (a `TensorSetWriter` and fresh
//! `TensorSetReader::open` children) instead of raw driver calls; see the parent's docs.

use super::*;

/// The tensors of the crate mode's set: the Llama specs (bf16) for the Llama bytes, else one bf16
/// tensor of `bytes` (rounded up to whole elements).
pub(super) fn crate_specs(bytes: u64) -> Vec<TensorSpec> {
    if bytes == llama_bytes() {
        llama_shapes()
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let shape: Vec<i64> = s.iter().map(|&d| d as i64).collect();
                TensorSpec::new(format!("t{i}"), DType::BF16, &shape)
            })
            .collect()
    } else {
        vec![TensorSpec::new(
            "t0",
            DType::BF16,
            &[bytes.div_ceil(2) as i64],
        )]
    }
}

/// A tensor placed in a chunk: (spec, chunk, byte offset), as `create_over` takes them.
pub(super) type Placed = (TensorSpec, u32, u64);

/// Places `specs` (bf16, contiguous) in order into chunks of at most `chunk` bytes, each at a
/// [`TENSOR_ALIGN`]-aligned offset: (spec, chunk, offset) per tensor and each chunk's bytes.
pub(super) fn pack(specs: &[TensorSpec], chunk: u64) -> Res<(Vec<Placed>, Vec<u64>)> {
    let mut placed = Vec::with_capacity(specs.len());
    let mut sizes: Vec<u64> = Vec::new();
    for s in specs {
        let bytes = 2 * s.shape.iter().product::<i64>() as u64;
        if bytes > chunk {
            return Err(format!("tensor {} of {bytes} bytes exceeds --chunk-bytes", s.name).into());
        }
        let at = sizes
            .last()
            .map(|&used| used.next_multiple_of(TENSOR_ALIGN));
        match at {
            Some(at) if at + bytes <= chunk => {
                placed.push((s.clone(), (sizes.len() - 1) as u32, at));
                *sizes.last_mut().expect("a chunk") = at + bytes;
            }
            _ => {
                placed.push((s.clone(), sizes.len() as u32, 0));
                sizes.push(bytes.max(1));
            }
        }
    }
    Ok((placed, sizes))
}

/// A crate-mode child: context first, then the timed open and hold; prints one JSON line.
pub(super) fn crate_child(sock_fd: i32, name: &str, device: usize) -> Res<()> {
    // SAFETY: the parent passed this inherited descriptor for this process alone to own.
    let sock = UnixStream::from(unsafe { OwnedFd::from_raw_fd(sock_fd) });
    sock.set_read_timeout(Some(STEP))?;
    let t_ctx = Instant::now();
    let ctx = Context::primary(Device::get(device)?)?;
    ctx.bind()?;
    let ctx_us = t_ctx.elapsed().as_secs_f64() * 1e6;
    // With TENSORSET_FLOOR_WARM_UP=1, the process's one-time costs of a first attach
    // (`cuda_ipc::driver::warm_up`) are made here, before the clock, as Python's import makes them.
    let warm_up = std::env::var_os("TENSORSET_FLOOR_WARM_UP").is_some_and(|v| v == "1");
    let warmed = warm_up && cuda_ipc::driver::warm_up().is_some();
    (&sock).write_all(b"R")?;

    // Timed: the open (manifest, imports, generation channel), then the hold.
    let probe = Probe::start();
    let t0 = Instant::now();
    let reader = TensorSetReader::open(&ctx, name, &ReaderOptions::new())?;
    let t1 = Instant::now();
    let held = reader.current()?.ok_or("no generation to hold")?;
    let t2 = Instant::now();
    let open_us = (t1 - t0).as_secs_f64() * 1e6;
    let hold_us = (t2 - t1).as_secs_f64() * 1e6;
    let probe = probe.end();

    // Untimed: the pattern word reads back through the reader's mapping once its stream has the
    // generation.
    held.stream()?.synchronize()?;
    let ptr = held.device_ptr(0)?;
    let mut w = 0u32;
    // SAFETY: the reader's context is current (bound above); the first 4 bytes of tensor 0 are
    // mapped readable while `held` lives; `w` holds 4.
    cu("cuMemcpyDtoH_v2", unsafe {
        sys::cuMemcpyDtoH_v2((&mut w as *mut u32).cast(), ptr, 4)
    })?;
    let mismatches = u64::from(w != PATTERN);
    let generation = held.generation();
    let (imports, read_only) = (reader.imports(), reader.is_read_only());
    let phases = reader.open_timings();
    let t3 = Instant::now();
    drop(held);
    drop(reader);
    let release_us = t3.elapsed().as_secs_f64() * 1e6;
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let figures = json!({"context_us": ctx_us, "warm_up": warm_up, "warmed": warmed, "open_us": open_us, "hold_us": hold_us,
               "attach_us": open_us + hold_us, "release_us": release_us, "imports": imports,
               "read_only": read_only, "generation": generation, "mismatches": mismatches,
               "open_manifest_us": us(phases.manifest), "open_tables_us": us(phases.tables),
               "open_fingerprint_us": us(phases.fingerprint), "open_fd_fetch_us": us(phases.fd_fetch),
               "open_map_us": us(phases.map), "open_join_us": us(phases.join),
               "open_map_import_us": us(phases.map_import),
               "open_map_reserve_us": us(phases.map_reserve),
               "open_map_map_us": us(phases.map_map),
               "open_map_set_access_us": us(phases.map_set_access),
               "open_map_fd_close_us": us(phases.map_fd_close),
               "open_map_identity_us": us(phases.map_identity),
               "open_join_gpu_us": us(phases.join_gpu),
               "open_fd_peer_us": us(phases.fd_peer), "open_fd_connect_us": us(phases.fd_connect),
               "open_fd_reply_us": us(phases.fd_reply), "open_spawn_us": us(phases.spawn),
               "open_finish_us": us(phases.finish),
               "open_join_wait_us": us(phases.join_wait), "open_total_us": us(phases.total)});
    println!("{}", merged(figures, probe));
    Ok(())
}

/// The crate mode's parent: the writer, one committed generation, then the children.
pub(super) fn crate_parent(o: &Opts) -> Res<()> {
    let ctx = Context::primary(Device::get(o.device)?)?;
    ctx.bind()?;
    let name = format!("tsfloor-{}", std::process::id());
    let specs = crate_specs(o.bytes);
    let mode = if o.allocations == 1 {
        GenerationMode::InPlace
    } else {
        GenerationMode::Buffered(o.allocations)
    };
    let t = Instant::now();
    let opts = TensorSetOptions::new().memory(MemoryKind::Vmm).mode(mode);
    let mut writer = match o.chunk_bytes {
        None => TensorSetWriter::create(&ctx, &name, &specs, &opts)?,
        Some(chunk) => {
            // In place over VMM chunks of at most `chunk` bytes (as a model built in an arena).
            let (placed, sizes) = pack(&specs, chunk)?;
            let chunks = sizes
                .iter()
                .map(|&n| VmmBuffer::new(&ctx, n as usize))
                .collect::<Result<Vec<_>, _>>()?;
            TensorSetWriter::create_over(&ctx, &name, &placed, chunks, &opts)?
        }
    };
    let bytes = writer.layout().bytes_per_buffer();
    let allocations = writer.layout().allocations().len() * o.allocations;
    {
        let u = writer.begin(Some(STEP))?;
        let ptr = u.tensor_ptr(0)?;
        // SAFETY: the writer's context is current (bound above); the first 4 bytes of tensor 0 of
        // the update's buffer are mapped read-write in it.
        cu("cuMemsetD32_v2", unsafe {
            sys::cuMemsetD32_v2(ptr, PATTERN, 1)
        })?;
        // The legacy stream's memset is done before the generation is published.
        ctx.synchronize()?;
        let g = u.commit()?;
        if g != 1 {
            return Err(format!("the first commit made generation {g}").into());
        }
    }
    eprintln!(
        "tensorset_floor --crate: set {name}, {} tensors, {bytes} bytes per buffer, {} buffer(s), \
         made in {:.1} ms; {} children",
        specs.len(),
        o.allocations,
        t.elapsed().as_secs_f64() * 1e3,
        o.children
    );
    let mut runs = Vec::new();
    for c in 0..o.children {
        let v = run_crate_child(&name, o.device).map_err(|e| format!("child {c}: {e}"))?;
        let ok = v["mismatches"].as_u64() == Some(0)
            && v["generation"].as_u64() == Some(1)
            && v["imports"].as_u64() == Some(allocations as u64)
            && v["read_only"].as_bool() == Some(true);
        if !ok {
            return Err(format!(
                "child {c}: expected generation 1, {allocations} driver imports, read-only and \
                 the pattern word: {v}"
            )
            .into());
        }
        runs.push(v);
    }
    let keys = [
        "context_us",
        "open_us",
        "hold_us",
        "attach_us",
        "release_us",
        "open_manifest_us",
        "open_tables_us",
        "open_fingerprint_us",
        "open_fd_fetch_us",
        "open_map_us",
        "open_map_import_us",
        "open_map_reserve_us",
        "open_map_map_us",
        "open_map_set_access_us",
        "open_map_fd_close_us",
        "open_map_identity_us",
        "open_join_us",
        "open_join_gpu_us",
        "open_join_wait_us",
        "open_fd_peer_us",
        "open_fd_connect_us",
        "open_fd_reply_us",
        "open_spawn_us",
        "open_finish_us",
        "open_total_us",
        "minor_faults",
    ];
    let mut med = serde_json::Map::new();
    for k in keys {
        let mut v: Vec<f64> = runs.iter().filter_map(|r| r[k].as_f64()).collect();
        med.insert(k.into(), json!(median(&mut v)));
    }
    med.insert("imports".into(), json!(allocations));
    med.insert("read_only".into(), json!(true));
    let out = json!({
        "name": "tensorset_attach_rust",
        "what": "fresh processes with their context: TensorSetReader::open (manifest, imports \
                 through the import cache, cold, fd fetch, read-only cuMemSetAccess, generation \
                 channel attach) = open_us, then reader.current() holding generation 1 = hold_us; \
                 attach_us = open_us + hold_us; open_*_us: the reader's OpenTimings (manifest \
                 open+decode on the opening thread, the tensor tables' decode on the join thread, \
                 fingerprint check, fd fetch, driver import+map+set-access, the channel \
                 join on its thread and its GPU objects, the wait for it, the whole open)",
        "shape": if o.quick { "quick" } else if o.bytes == llama_bytes() { "llama-8b" } else { "custom" },
        "tensors": specs.len(),
        "bytes_per_buffer": bytes,
        "buffers": o.allocations,
        "allocations": allocations,
        "children": o.children,
        "median": Value::Object(med),
        "runs": runs,
    });
    let text = serde_json::to_string_pretty(&out)?;
    println!("{text}");
    if let Some(dir) = &o.out {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("tensorset_attach_rust.json"), text + "\n")?;
    }
    writer.close(STEP)?;
    Ok(())
}

/// Runs one crate-mode child on set `name` and returns its JSON figures; every wait bounded by
/// [`STEP`].
fn run_crate_child(name: &str, device: usize) -> Res<Value> {
    run_ready_child("--child-crate", name, device, |_| Ok(()))
}
