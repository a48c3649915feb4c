//! The driver's floor for attaching a tensor set (docs/benchmarks.md): the fewest calls a reader
//! can make to map a set's memory read-only, in a fresh process that has its context.
//!
//! The parent allocates the allocations (`cuMemCreate` with POSIX-fd handles, `--allocations B`
//! of `--bytes` each, every one split into allocations of at most `--chunk-bytes` when given;
//! default one allocation of the Llama-3-8B shape's bytes, 291 bf16 tensors at 256-byte offsets,
//! 15.0 GiB), exports each (`cuMemExportToShareableHandle`), writes a pattern word at the start of
//! each, then runs `--children N` (default and at least 20) fresh child processes one after
//! another. Each child retains and binds its primary context first, says so over a connected Unix
//! socket, and then, timed: receives the file descriptors over that socket (`SCM_RIGHTS`), and per
//! allocation `cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap` and
//! `cuMemSetAccess` with `CU_MEM_ACCESS_FLAGS_PROT_READ`. Untimed, it reads each allocation's
//! pattern word back (the mapping works), then tears down, timed apart (unmap, free the range,
//! release). It prints its per-step µs as one JSON line; the parent prints (and with `--out DIR`
//! writes `DIR/tensorset_floor.json`) the medians and every child's figures.
//!
//! Both kinds of child also give where they ran and what they faulted over their timed attach:
//! `cpu_start` and `cpu_end` (`sched_getcpu` just before and just after it) and `minor_faults`
//! (the whole process's, from `/proc/self/stat`, read outside the timed region), so that runs can
//! be compared by placement (`taskset`) and by the pages a first use touches.
//!
//! ```text
//! cargo build --release -p cuda-ipc-bench --example tensorset_floor
//! target/release/examples/tensorset_floor [--quick] [--children N] [--bytes N] [--allocations B]
//!     [--chunk-bytes C] [--device D] [--out DIR] [--crate]
//! ```
//! `--quick`: 64 MiB instead of the Llama shape. Every wait is bounded (a child that does not
//! answer within 60 s is killed and the run fails).
//!
//! `--crate`: the same bytes through the crate instead of raw driver calls. The parent creates a
//! VMM `TensorSetWriter` (the Llama specs, bf16, one allocation; `--quick` or `--bytes`: one bf16
//! tensor of those bytes; `--allocations B` with B ≥ 2: buffered mode with B buffers;
//! `--chunk-bytes C`: in place over VMM chunks of at most C bytes, the tensors packed into them in
//! order, as a model built in `torch_mem_pool` (`create_over`)), writes the pattern word at the
//! start of buffer 0's first tensor and commits one generation. Each fresh child makes its context
//! first (with `TENSORSET_FLOOR_WARM_UP=1` in the environment, then also calls
//! `cuda_ipc::driver::warm_up()`, as Python's `import cuda_ipc` does: `warm_up`/`warmed` in its
//! figures), says so, and then, timed: `TensorSetReader::open(ctx, name, &ReaderOptions::new())`
//! (`open_us`: manifest, imports through the import cache, cold, with the fd fetch from the
//! writer, the generation channel's attach) and `reader.current()` holding generation 1
//! (`hold_us`); the reader's own phase timings (`TensorSetReader::open_timings`:
//! `open_manifest_us`, `open_tables_us`, `open_fingerprint_us`, `open_fd_fetch_us`, `open_map_us` and its driver
//! calls and descriptor closes apart (`open_map_import_us`, `open_map_reserve_us`,
//! `open_map_map_us`, `open_map_set_access_us`, `open_map_fd_close_us`, `open_map_identity_us`), `open_join_us`,
//! `open_join_gpu_us`, `open_join_wait_us`, the fd fetch's parts (`open_fd_peer_us`,
//! `open_fd_connect_us`, `open_fd_reply_us`), `open_spawn_us`, `open_finish_us`, `open_total_us`) go beside them. Untimed: the
//! pattern word reads back, then the hold and the reader drop (`release_us`). The parent prints
//! (and with `--out DIR` writes `DIR/tensorset_attach_rust.json`) the medians and every child's figures; a child whose reader
//! made another number of driver imports than the set's allocations, did not map read-only, held
//! another generation or read a wrong word fails the run.

use cuda_ipc::channel::MemoryKind;
use cuda_ipc::driver::{Context, Device};
use cuda_ipc::ipc::VmmBuffer;
use cuda_ipc::tensorset::{
    DType, GenerationMode, ReaderOptions, TensorSetOptions, TensorSetReader, TensorSetWriter,
    TensorSpec,
};
use cudarc::driver::sys;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde_json::{Value, json};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "tensorset_floor/crate_mode.rs"]
mod crate_mode;
use crate_mode::{crate_child, crate_parent};
#[cfg(test)]
use crate_mode::{crate_specs, pack};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The longest any one wait (a child's answer, its exit) may take.
const STEP: Duration = Duration::from_secs(60);
/// File descriptors per `SCM_RIGHTS` message (the kernel's limit is 253).
const FDS_PER_MESSAGE: usize = 250;
/// The pattern word the parent writes at the start of allocation `i`: `PATTERN ^ i`.
const PATTERN: u32 = 0x7e45_0000;
/// Tensor offsets' alignment in a tensor set's allocation, in bytes.
const TENSOR_ALIGN: u64 = 256;

fn cu(call: &str, r: sys::CUresult) -> Res<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call} failed: {r:?}").into())
    }
}

/// The shapes of Llama-3-8B's 291 tensors (bf16).
fn llama_shapes() -> Vec<Vec<u64>> {
    let mut v = vec![vec![128_256, 4096]];
    for _ in 0..32 {
        v.extend([
            vec![4096, 4096],
            vec![1024, 4096],
            vec![1024, 4096],
            vec![4096, 4096],
            vec![14_336, 4096],
            vec![14_336, 4096],
            vec![4096, 14_336],
            vec![4096],
            vec![4096],
        ]);
    }
    v.push(vec![4096]);
    v.push(vec![128_256, 4096]);
    v
}

/// The bytes of the Llama shape laid out as a tensor set lays it out: each tensor at a
/// 256-byte-aligned offset.
fn llama_bytes() -> u64 {
    llama_shapes().iter().fold(0u64, |off, s| {
        off.next_multiple_of(TENSOR_ALIGN) + 2 * s.iter().product::<u64>()
    })
}

#[derive(Debug)]
struct Opts {
    children: usize,
    bytes: u64,
    allocations: usize,
    chunk_bytes: Option<u64>,
    device: usize,
    out: Option<std::path::PathBuf>,
    quick: bool,
    /// Through the crate's `TensorSetWriter` / `TensorSetReader` instead of raw driver calls.
    via_crate: bool,
}

const USAGE: &str = "usage: tensorset_floor [--quick] [--children N (>= 20)] [--bytes N] \
                     [--allocations B] [--chunk-bytes C] [--device D] [--out DIR] [--crate]";

fn parse(args: &[String]) -> Res<Opts> {
    let mut o = Opts {
        children: 20,
        bytes: 0,
        allocations: 1,
        chunk_bytes: None,
        device: 0,
        out: None,
        quick: false,
        via_crate: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{a} needs a value\n{USAGE}"))
        };
        match a.as_str() {
            "--quick" => o.quick = true,
            "--crate" => o.via_crate = true,
            "--children" => o.children = value()?.parse()?,
            "--bytes" => o.bytes = value()?.parse()?,
            "--allocations" => o.allocations = value()?.parse()?,
            "--chunk-bytes" => o.chunk_bytes = Some(value()?.parse()?),
            "--device" => o.device = value()?.parse()?,
            "--out" => o.out = Some(value()?.into()),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {a}\n{USAGE}").into()),
        }
    }
    if o.children < 20 {
        return Err(format!("--children {} is under 20\n{USAGE}", o.children).into());
    }
    if o.allocations == 0 || o.chunk_bytes == Some(0) {
        return Err(format!("--allocations and --chunk-bytes must be at least 1\n{USAGE}").into());
    }
    if o.via_crate && o.chunk_bytes.is_some() && o.allocations != 1 {
        return Err(format!(
            "--crate --chunk-bytes publishes chunks in place: no --allocations\n{USAGE}"
        )
        .into());
    }
    if o.via_crate && o.allocations > 16 {
        return Err(format!("--crate takes at most 16 buffers (--allocations)\n{USAGE}").into());
    }
    if o.bytes == 0 {
        o.bytes = if o.quick { 64 << 20 } else { llama_bytes() };
    }
    Ok(o)
}

fn cu_device(ordinal: usize) -> Res<sys::CUdevice> {
    let mut d = MaybeUninit::<sys::CUdevice>::uninit();
    // SAFETY: the driver is loaded (a context exists); `d` is a valid out-pointer.
    cu("cuDeviceGet", unsafe {
        sys::cuDeviceGet(d.as_mut_ptr(), ordinal as i32)
    })?;
    // SAFETY: written on success.
    Ok(unsafe { d.assume_init() })
}

fn location(dev: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev,
    }
}

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// One of the parent's allocations: its handle, mapping and exported fd.
struct Alloc {
    handle: sys::CUmemGenericAllocationHandle,
    ptr: u64,
    size: usize,
    fd: OwnedFd,
}

impl Drop for Alloc {
    fn drop(&mut self) {
        // SAFETY: the context that made it is current on this (the main) thread; the range is
        // mapped by this struct alone and nothing uses it any more (every child has exited).
        unsafe {
            let _ = sys::cuMemUnmap(self.ptr, self.size);
            let _ = sys::cuMemAddressFree(self.ptr, self.size);
            let _ = sys::cuMemRelease(self.handle);
        }
    }
}

/// Creates, maps (read/write), exports and marks one allocation of `size` bytes (a multiple of the
/// granularity) with pattern word `word`.
fn parent_alloc(dev: sys::CUdevice, size: usize, word: u32) -> Res<Alloc> {
    let prop = sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: POSIX_FD,
        location: location(dev),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    };
    let mut h = MaybeUninit::<sys::CUmemGenericAllocationHandle>::uninit();
    // SAFETY: context current (bound in `parent`); `prop` fully initialised; `size` a multiple of
    // the granularity.
    cu("cuMemCreate", unsafe {
        sys::cuMemCreate(h.as_mut_ptr(), size, &prop, 0)
    })?;
    // SAFETY: written on success.
    let handle = unsafe { h.assume_init() };
    let mut fd: i32 = -1;
    // SAFETY: live handle; for POSIX fd handles the out-parameter is one `int`.
    let r = unsafe {
        sys::cuMemExportToShareableHandle((&mut fd as *mut i32).cast(), handle, POSIX_FD, 0)
    };
    if let Err(e) = cu("cuMemExportToShareableHandle", r) {
        // SAFETY: the handle was created above and is released once.
        let _ = unsafe { sys::cuMemRelease(handle) };
        return Err(e);
    }
    // SAFETY: the driver returned a new descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut a = Alloc {
        handle,
        ptr: 0,
        size,
        fd,
    };
    let mut p = MaybeUninit::<sys::CUdeviceptr>::uninit();
    // SAFETY: context current; `p` a valid out-pointer.
    cu("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(p.as_mut_ptr(), size, 0, 0, 0)
    })?;
    // SAFETY: written on success.
    a.ptr = unsafe { p.assume_init() };
    // SAFETY: the range was just reserved; the handle holds `size` bytes.
    cu("cuMemMap", unsafe {
        sys::cuMemMap(a.ptr, size, 0, handle, 0)
    })?;
    let desc = sys::CUmemAccessDesc {
        location: location(dev),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the range is mapped; one valid descriptor.
    cu("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(a.ptr, size, &desc, 1)
    })?;
    // SAFETY: the first 4 bytes of the mapped range are writable.
    cu("cuMemsetD32_v2", unsafe {
        sys::cuMemsetD32_v2(a.ptr, word, 1)
    })?;
    Ok(a)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Sends `fds` (in messages of at most [`FDS_PER_MESSAGE`]) with each message's count as its one
/// data byte pair.
fn send_fds(sock: &UnixStream, fds: &[BorrowedFd<'_>]) -> Res<()> {
    for batch in fds.chunks(FDS_PER_MESSAGE) {
        let mut space =
            vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(batch.len()))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !control.push(SendAncillaryMessage::ScmRights(batch)) {
            return Err("the control buffer is too small".into());
        }
        let n = (batch.len() as u16).to_le_bytes();
        let sent =
            rustix::net::sendmsg(sock, &[IoSlice::new(&n)], &mut control, SendFlags::NOSIGNAL)?;
        if sent != n.len() {
            return Err(format!("sendmsg sent {sent} of 2 bytes").into());
        }
    }
    Ok(())
}

/// Receives `count` fds sent by [`send_fds`].
fn recv_fds(sock: &UnixStream, count: usize) -> Res<Vec<OwnedFd>> {
    let mut fds = Vec::with_capacity(count);
    let mut space =
        vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_MESSAGE))];
    while fds.len() < count {
        let mut n = [0u8; 2];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(&mut n)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        let before = fds.len();
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = msg {
                fds.extend(rights);
            }
        }
        let got = got?;
        if got.bytes != 2 || fds.len() - before != u16::from_le_bytes(n) as usize {
            return Err(format!(
                "a message of {} bytes with {} fds (expected {})",
                got.bytes,
                fds.len() - before,
                u16::from_le_bytes(n)
            )
            .into());
        }
    }
    Ok(fds)
}

/// This process's minor page faults so far (`/proc/self/stat`, field 10, all threads), or 0
/// where it cannot be read: read before and after a timed region, outside it.
fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // The fields after the command name, which may hold spaces, start past its `)`.
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace().nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

/// A child's placement and page faults over its timed attach: the CPU it started and ended on
/// (`sched_getcpu`) and the minor faults of the whole process in between.
struct Probe {
    cpu: usize,
    faults: u64,
}

impl Probe {
    /// Taken just before the timed region.
    fn start() -> Probe {
        let faults = minor_faults();
        Probe {
            cpu: rustix::thread::sched_getcpu(),
            faults,
        }
    }

    /// Taken just after it: the JSON fields `cpu_start`, `cpu_end`, `minor_faults`.
    fn end(self) -> Value {
        let cpu_end = rustix::thread::sched_getcpu();
        json!({"cpu_start": self.cpu, "cpu_end": cpu_end,
               "minor_faults": minor_faults().saturating_sub(self.faults)})
    }
}

/// `a`'s fields with `b`'s added (both JSON objects).
fn merged(mut a: Value, b: Value) -> Value {
    if let (Some(a), Value::Object(b)) = (a.as_object_mut(), b) {
        a.extend(b);
    }
    a
}

/// A child: context first, then the timed attach; prints one JSON line.
fn child(sock_fd: i32, sizes: &[usize], device: usize) -> Res<()> {
    // SAFETY: the parent passed this inherited descriptor for this process alone to own.
    let sock = UnixStream::from(unsafe { OwnedFd::from_raw_fd(sock_fd) });
    sock.set_read_timeout(Some(STEP))?;
    let t_ctx = Instant::now();
    let ctx = Context::primary(Device::get(device)?)?;
    ctx.bind()?;
    let dev = cu_device(device)?;
    let ctx_us = t_ctx.elapsed().as_secs_f64() * 1e6;
    (&sock).write_all(b"R")?;

    // Timed: from "ready" to every allocation mapped read-only.
    let probe = Probe::start();
    let t0 = Instant::now();
    let fds = recv_fds(&sock, sizes.len())?;
    let recv_us = t0.elapsed().as_secs_f64() * 1e6;
    let (mut import, mut reserve, mut map, mut access) = (0f64, 0f64, 0f64, 0f64);
    let mut maps: Vec<(sys::CUmemGenericAllocationHandle, u64, usize)> = Vec::new();
    let desc = sys::CUmemAccessDesc {
        location: location(dev),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
    };
    for (fd, &size) in fds.iter().zip(sizes) {
        let t = Instant::now();
        let mut h = MaybeUninit::<sys::CUmemGenericAllocationHandle>::uninit();
        // SAFETY: context current; for POSIX fd handles the OS handle is the descriptor's value
        // as a pointer-sized integer; the driver does not take the descriptor.
        cu("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                h.as_mut_ptr(),
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                POSIX_FD,
            )
        })?;
        // SAFETY: written on success.
        let handle = unsafe { h.assume_init() };
        let t1 = Instant::now();
        let mut p = MaybeUninit::<sys::CUdeviceptr>::uninit();
        // SAFETY: context current; `p` a valid out-pointer.
        cu("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(p.as_mut_ptr(), size, 0, 0, 0)
        })?;
        // SAFETY: written on success.
        let ptr = unsafe { p.assume_init() };
        let t2 = Instant::now();
        // SAFETY: the range was just reserved; the handle holds `size` bytes.
        cu("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size, 0, handle, 0)
        })?;
        let t3 = Instant::now();
        // SAFETY: the range is mapped; one valid descriptor.
        cu("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, size, &desc, 1)
        })?;
        let t4 = Instant::now();
        import += (t1 - t).as_secs_f64() * 1e6;
        reserve += (t2 - t1).as_secs_f64() * 1e6;
        map += (t3 - t2).as_secs_f64() * 1e6;
        access += (t4 - t3).as_secs_f64() * 1e6;
        maps.push((handle, ptr, size));
    }
    let total_us = t0.elapsed().as_secs_f64() * 1e6;
    let probe = probe.end();
    // Outside the attach, as the floor defines it, but timed apart: closing the descriptors of
    // imported allocations is the driver's work too (a crate that closes them inside its open pays
    // it there).
    let tc = Instant::now();
    drop(fds);
    let close_us = tc.elapsed().as_secs_f64() * 1e6;

    // Untimed: the pattern word of every allocation reads back through the read-only mapping.
    let mut mismatches = 0u64;
    for (i, &(_, ptr, _)) in maps.iter().enumerate() {
        let mut w = 0u32;
        // SAFETY: context current; the first 4 bytes of the range are mapped readable; `w` holds 4.
        cu("cuMemcpyDtoH_v2", unsafe {
            sys::cuMemcpyDtoH_v2((&mut w as *mut u32).cast(), ptr, 4)
        })?;
        if w != PATTERN ^ i as u32 {
            mismatches += 1;
        }
    }
    let t5 = Instant::now();
    for (handle, ptr, size) in maps {
        // SAFETY: context current; each range was mapped above and nothing uses it any more.
        unsafe {
            cu("cuMemUnmap", sys::cuMemUnmap(ptr, size))?;
            cu("cuMemAddressFree", sys::cuMemAddressFree(ptr, size))?;
            cu("cuMemRelease", sys::cuMemRelease(handle))?;
        }
    }
    let release_us = t5.elapsed().as_secs_f64() * 1e6;
    let figures = json!({"context_us": ctx_us, "recv_us": recv_us, "import_us": import,
               "reserve_us": reserve, "map_us": map, "set_access_read_us": access,
               "attach_us": total_us, "close_us": close_us, "release_us": release_us,
               "mismatches": mismatches});
    println!("{}", merged(figures, probe));
    Ok(())
}

/// Runs one child over `sizes` and returns its JSON figures; every wait bounded by [`STEP`].
fn run_child(allocs: &[Alloc], sizes_arg: &str, device: usize) -> Res<Value> {
    run_ready_child("--child", sizes_arg, device, |sock| {
        let fds: Vec<BorrowedFd<'_>> = allocs.iter().map(|a| a.fd.as_fd()).collect();
        send_fds(sock, &fds)
    })
}

/// Runs this binary as a child (`mode FD arg DEVICE`, FD its end of a connected socket pair),
/// waits for the byte it sends once it has its context, runs `ready` on this end, then waits for
/// the child and returns the JSON line it printed; every wait bounded by [`STEP`]. A child that
/// fails a step is killed and reaped.
fn run_ready_child(
    mode: &str,
    arg: &str,
    device: usize,
    ready: impl FnOnce(&UnixStream) -> Res<()>,
) -> Res<Value> {
    let (ours, theirs) = UnixStream::pair()?;
    ours.set_read_timeout(Some(STEP))?;
    // The child's end must survive exec: clear close-on-exec on it (this process's copy closes
    // once the child is spawned).
    rustix::io::fcntl_setfd(&theirs, rustix::io::FdFlags::empty())?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args([
        mode,
        &theirs.as_raw_fd().to_string(),
        arg,
        &device.to_string(),
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    let mut ch = cmd.spawn()?;
    drop(theirs);
    let result = (|| -> Res<Value> {
        let mut r = [0u8; 1];
        (&ours)
            .read_exact(&mut r)
            .map_err(|e| format!("the child did not say it was ready: {e}"))?;
        ready(&ours)?;
        wait_child(&mut ch)
    })();
    if result.is_err() {
        let _ = ch.kill();
        let _ = ch.wait();
    }
    result
}

/// Waits (at most [`STEP`]) for child `ch` to exit and parses the last line it printed.
fn wait_child(ch: &mut std::process::Child) -> Res<Value> {
    let deadline = Instant::now() + STEP;
    loop {
        if let Some(st) = ch.try_wait()? {
            let mut out = String::new();
            ch.stdout
                .take()
                .ok_or("no stdout")?
                .read_to_string(&mut out)?;
            if !st.success() {
                return Err(format!("the child failed: {st}").into());
            }
            let line = out.lines().last().ok_or("the child printed nothing")?;
            return Ok(serde_json::from_str(line)?);
        }
        if Instant::now() > deadline {
            return Err("the child did not exit within 60 s".into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn parent(o: &Opts) -> Res<()> {
    let ctx = Context::primary(Device::get(o.device)?)?;
    ctx.bind()?;
    let dev = cu_device(o.device)?;
    let g = cuda_ipc::ipc::vmm_granularity(&Device::get(o.device)?)? as u64;
    // Every buffer's bytes, split into chunks of at most `chunk_bytes`.
    let mut sizes = Vec::new();
    for _ in 0..o.allocations {
        let mut left = o.bytes;
        while left > 0 {
            let n = o.chunk_bytes.map_or(left, |c| c.min(left));
            sizes.push(n.next_multiple_of(g) as usize);
            left -= n;
        }
    }
    let t = Instant::now();
    let mut allocs = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        allocs.push(parent_alloc(dev, s, PATTERN ^ i as u32)?);
    }
    ctx.synchronize()?;
    eprintln!(
        "tensorset_floor: {} allocations, {} bytes, made in {:.1} ms; {} children",
        sizes.len(),
        sizes.iter().sum::<usize>(),
        t.elapsed().as_secs_f64() * 1e3,
        o.children
    );
    let sizes_arg = sizes
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut runs = Vec::new();
    for c in 0..o.children {
        let v = run_child(&allocs, &sizes_arg, o.device).map_err(|e| format!("child {c}: {e}"))?;
        if v["mismatches"].as_u64() != Some(0) {
            return Err(format!("child {c} read wrong pattern words: {v}").into());
        }
        runs.push(v);
    }
    let keys = [
        "context_us",
        "recv_us",
        "import_us",
        "reserve_us",
        "map_us",
        "set_access_read_us",
        "attach_us",
        "close_us",
        "release_us",
        "minor_faults",
    ];
    let mut med = serde_json::Map::new();
    for k in keys {
        let mut v: Vec<f64> = runs.iter().filter_map(|r| r[k].as_f64()).collect();
        med.insert(k.into(), json!(median(&mut v)));
    }
    let out = json!({
        "name": "tensorset_floor",
        "what": "fresh processes with their context: fds over a connected Unix socket (SCM_RIGHTS), \
                 then per allocation cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap, \
                 cuMemSetAccess PROT_READ; attach_us = from ready to all mapped",
        "shape": if o.quick { "quick" } else if o.bytes == llama_bytes() { "llama-8b" } else { "custom" },
        "bytes_per_buffer": o.bytes,
        "buffers": o.allocations,
        "chunk_bytes": o.chunk_bytes,
        "allocations": sizes.len(),
        "granularity": g,
        "children": o.children,
        "median": Value::Object(med),
        "runs": runs,
    });
    let text = serde_json::to_string_pretty(&out)?;
    println!("{text}");
    if let Some(dir) = &o.out {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("tensorset_floor.json"), text + "\n")?;
    }
    drop(allocs);
    Ok(())
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let r = if argv.first().map(String::as_str) == Some("--child") {
        (|| -> Res<()> {
            let [_, fd, sizes, device] = argv.as_slice() else {
                return Err("--child FD SIZES DEVICE".into());
            };
            let sizes: Vec<usize> = sizes.split(',').map(str::parse).collect::<Result<_, _>>()?;
            child(fd.parse()?, &sizes, device.parse()?)
        })()
    } else if argv.first().map(String::as_str) == Some("--child-crate") {
        (|| -> Res<()> {
            let [_, fd, name, device] = argv.as_slice() else {
                return Err("--child-crate FD NAME DEVICE".into());
            };
            crate_child(fd.parse()?, name, device.parse()?)
        })()
    } else {
        parse(&argv).and_then(|o| {
            if o.via_crate {
                crate_parent(&o)
            } else {
                parent(&o)
            }
        })
    };
    if let Err(e) = r {
        eprintln!("tensorset_floor: {e}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_llama_shape_has_291_tensors_of_15_gib() {
        let s = llama_shapes();
        assert_eq!(s.len(), 291);
        let gib = llama_bytes() as f64 / (1u64 << 30) as f64;
        assert!((14.9..15.1).contains(&gib), "{gib}");
        // The same bytes as bench/tensorset_baseline.py's layout of the shape.
        assert_eq!(llama_bytes(), 16_060_522_496);
    }

    #[test]
    fn fds_cross_a_socket_pair_in_batches() {
        let (a, b) = UnixStream::pair().unwrap();
        let files: Vec<std::fs::File> = (0..300)
            .map(|_| std::fs::File::open("/dev/null").unwrap())
            .collect();
        let fds: Vec<BorrowedFd<'_>> = files.iter().map(|f| f.as_fd()).collect();
        let t = std::thread::spawn(move || recv_fds(&b, 300).map_err(|e| e.to_string()));
        send_fds(&a, &fds).unwrap();
        let got = t.join().unwrap().unwrap();
        assert_eq!(got.len(), 300);
    }

    #[test]
    fn options() {
        let a = |v: &[&str]| parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert!(a(&["--children", "5"]).is_err());
        assert_eq!(a(&["--quick"]).unwrap().bytes, 64 << 20);
        assert_eq!(a(&[]).unwrap().bytes, llama_bytes());
        assert!(a(&["--chunk-bytes", "0"]).is_err());
        assert!(!a(&["--quick"]).unwrap().via_crate);
        let c = a(&["--crate", "--quick", "--out", "x"]).unwrap();
        assert!(c.via_crate && c.quick && c.bytes == 64 << 20 && c.allocations == 1);
        assert!(a(&["--crate"]).unwrap().bytes == llama_bytes());
        assert!(a(&["--crate", "--chunk-bytes", "1024"]).is_ok());
        assert!(a(&["--crate", "--chunk-bytes", "1024", "--allocations", "2"]).is_err());
        assert!(a(&["--crate", "--allocations", "17"]).is_err());
    }

    #[test]
    fn the_llama_shape_packs_into_1_gib_chunks_in_order() {
        let (placed, sizes) = pack(&crate_specs(llama_bytes()), 1 << 30).unwrap();
        assert_eq!(placed.len(), 291);
        assert!(sizes.iter().all(|&n| n <= 1 << 30));
        assert!((15..=18).contains(&sizes.len()), "{} chunks", sizes.len());
        for w in placed.windows(2) {
            assert!(w[0].1 <= w[1].1 && (w[0].1 < w[1].1 || w[0].2 < w[1].2));
        }
        assert!(pack(&crate_specs(llama_bytes()), 1 << 20).is_err());
    }

    #[test]
    fn crate_specs_are_the_llama_bytes() {
        let specs = crate_specs(llama_bytes());
        assert_eq!(specs.len(), 291);
        let layout = cuda_ipc::tensorset::Layout::new(&specs).unwrap();
        assert_eq!(layout.bytes_per_buffer(), llama_bytes());
        let quick = cuda_ipc::tensorset::Layout::new(&crate_specs(64 << 20)).unwrap();
        assert_eq!(quick.bytes_per_buffer(), 64 << 20);
    }
}
