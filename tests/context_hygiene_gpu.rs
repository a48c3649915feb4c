//! GPU tests of context hygiene: every call of the crate, on success and on error, and every drop,
//! on the thread that made the object or on another, leaves the calling thread's current context as
//! it found it: its own non-primary context (made here with `cuCtxCreate`), or none.
//!
//! Each test re-executes this binary as an exporter child (role `exporter`) that exports a legacy,
//! a VMM and a pool buffer and an event, produces on one channel per memory kind and consumes from
//! the parent's channel; the parent also writes and reads a tensor set of its own. They need a CUDA
//! GPU and fail without one; `cargo test` lists them as ignored. Run them with
//! `scripts/gpu-test.sh context_hygiene_gpu` or the GPU bundle (`run.sh tests
//! context_hygiene_gpu`).

mod common;

use common::{Peer, ctx, parent_lines, role, tell};
use cuda_ipc::Error;
use cuda_ipc::channel::{
    ChannelError, ChannelOptions, Consumer, ConsumerOptions, MemoryKind, Producer,
};
use cuda_ipc::driver::{Context, Device, DeviceBuffer, DeviceMemory, Event, Module, Stream};
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::ipc::{ImportedBuffer, IpcEvent, IpcEventHandle, MemPool, VmmBuffer};
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::tensorset::{
    DType, ReaderOptions, TensorSetOptions, TensorSetReader, TensorSetWriter, TensorSpec,
};
use cuda_ipc::token::{Token, TokenKind};
use cudarc::driver::sys;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
/// Bytes of each exported buffer and of each channel buffer.
const LEN: usize = 1 << 20;
/// The byte the exporter fills each of its buffers with.
const LEGACY_BYTE: u8 = 0x11;
const VMM_BYTE: u8 = 0x22;
const POOL_BYTE: u8 = 0x33;
/// The environment variable giving the exporter the base name of its channels.
const CHANNEL: &str = "CUDA_IPC_TEST_CHANNEL";
/// The memory kinds of the exporter's channels, one channel each (`<base>-<index>`).
const KINDS: [MemoryKind; 3] = [MemoryKind::Legacy, MemoryKind::Vmm, MemoryKind::Pool];

// ------------------------------------------------------------------------------ the driver's view

/// Loads and initialises the driver through the crate (so that cudarc's loader finds it) and
/// fails the test plainly without a GPU.
fn driver_ready() {
    let n = Device::count().expect("a CUDA GPU is needed for this test");
    assert!(n > 0, "a CUDA GPU is needed for this test (none visible)");
}

/// The context current on the calling thread (`cuCtxGetCurrent`); null when none is.
fn current() -> sys::CUcontext {
    driver_ready();
    let mut c: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the driver is loaded and initialised (`driver_ready`); `c` is a valid out-pointer.
    let r = unsafe { sys::cuCtxGetCurrent(&mut c) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuCtxGetCurrent");
    c
}

/// A context of this test's own on device 0 (`cuCtxCreate`), not the primary one: made current on
/// the creating thread (pushed), destroyed by [`OwnContext::destroy`].
struct OwnContext {
    raw: sys::CUcontext,
}

impl OwnContext {
    fn new() -> OwnContext {
        driver_ready();
        let mut dev: sys::CUdevice = 0;
        // SAFETY: driver initialised; `dev` a valid out-pointer; ordinal 0 exists (checked).
        let r = unsafe { sys::cuDeviceGet(&mut dev, 0) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuDeviceGet");
        let mut raw: sys::CUcontext = std::ptr::null_mut();
        #[cfg(not(feature = "cuda-13000"))]
        // SAFETY: `raw` a valid out-pointer; flags 0 (automatic scheduling); `dev` from cuDeviceGet.
        let r = unsafe { sys::cuCtxCreate_v2(&mut raw, 0, dev) };
        #[cfg(feature = "cuda-13000")]
        let r = {
            // SAFETY: an all-zero CUctxCreateParams (both parameter pointers null) asks for a
            // regular context.
            let mut params: sys::CUctxCreateParams = unsafe { std::mem::zeroed() };
            // SAFETY: `raw` a valid out-pointer; `params` valid for the call; flags 0.
            unsafe { sys::cuCtxCreate_v4(&mut raw, &mut params, 0, dev) }
        };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuCtxCreate");
        assert!(!raw.is_null());
        assert_eq!(current(), raw, "cuCtxCreate makes the new context current");
        OwnContext { raw }
    }

    /// Destroys the context (`cuCtxDestroy_v2`, which pops it as it is current here) and checks
    /// that nothing the crate pushed was left under it.
    fn destroy(self) {
        assert_eq!(current(), self.raw);
        // SAFETY: the context was made by `new` on this thread and is destroyed once.
        let r = unsafe { sys::cuCtxDestroy_v2(self.raw) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuCtxDestroy_v2");
        assert!(
            current().is_null(),
            "a context was left under the thread's own one: {:?}",
            current()
        );
    }
}

/// What the calling thread must have current after every call.
struct Expect {
    ctx: sys::CUcontext,
    what: &'static str,
}

impl Expect {
    /// The calling thread's own context, current now.
    fn own(own: &OwnContext) -> Expect {
        Expect {
            ctx: own.raw,
            what: "its own context",
        }
    }

    /// No context: the calling thread has none current now.
    fn none() -> Expect {
        assert!(current().is_null(), "the test thread starts with a context");
        Expect {
            ctx: std::ptr::null_mut(),
            what: "no context",
        }
    }

    /// Fails the test unless the thread's current context is what it was.
    fn after(&self, call: &str) {
        let now = current();
        assert_eq!(
            now, self.ctx,
            "{call} changed the current context of a thread that had {} ({:?}) to {now:?}",
            self.what, self.ctx
        );
    }
}

/// Fails the test unless `r` is an error; returns its text.
fn expect_err<T>(r: cuda_ipc::Result<T>, call: &str) -> Error {
    match r {
        Ok(_) => panic!("{call} succeeded; an error was expected"),
        Err(e) => {
            println!("{call}: {e}");
            e
        }
    }
}

// ------------------------------------------------------------------------------------ the exporter

/// The exporter child's tokens.
struct Tokens {
    legacy: Token,
    vmm: Token,
    pool: Token,
    event: Token,
}

fn channel_name(base: &str, i: usize) -> String {
    format!("{base}-{i}")
}

/// The child: exports a legacy, a VMM and a pool buffer (filled with their bytes) and an event,
/// serves one channel per memory kind, and follows the parent's orders on stdin:
/// `publish I N` (a frame of bytes N on channel I), `attach NAME`, `recv`, `detach`, `quit`.
fn exporter() {
    let base = std::env::var(CHANNEL).unwrap();
    let ctx = ctx();
    let s = Stream::new(&ctx).unwrap();
    let legacy = DeviceBuffer::new(&ctx, LEN).unwrap();
    legacy.copy_from_host(0, &vec![LEGACY_BYTE; LEN]).unwrap();
    let vmm = VmmBuffer::new(&ctx, LEN).unwrap();
    vmm.copy_from_host(0, &vec![VMM_BYTE; LEN]).unwrap();
    let pool = MemPool::exportable(&ctx).unwrap();
    let pb = pool.alloc(LEN, &s).unwrap();
    pb.copy_from_host(0, &vec![POOL_BYTE; LEN]).unwrap();
    let ev = IpcEvent::new(&ctx).unwrap();
    ev.record(&s).unwrap();
    let mut tx: Vec<Producer> = KINDS
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let opts = ChannelOptions::new(LEN).buffers(2).memory(*k);
            Producer::create(&ctx, &channel_name(&base, i), &opts).unwrap()
        })
        .collect();
    tell(format!(
        "tokens {} {} {} {}",
        legacy.export().unwrap().to_hex(),
        vmm.export().unwrap().to_hex(),
        pb.export().unwrap().to_hex(),
        ev.export().unwrap().to_hex()
    ));
    let mut rx: Option<Consumer> = None;
    for line in parent_lines() {
        let w: Vec<&str> = line.split(' ').collect();
        match w[..] {
            ["publish", i, n] => {
                let (i, n): (usize, u8) = (i.parse().unwrap(), n.parse().unwrap());
                let f = tx[i].acquire(Some(T)).unwrap();
                f.buffer().unwrap().copy_from_host(0, &[n; 64]).unwrap();
                let seq = f.publish(&[n]).unwrap();
                tell(format!("published {seq}"));
            }
            ["attach", name] => {
                rx = Some(Consumer::attach(name, &ConsumerOptions::new()).unwrap());
                tell("attached");
            }
            ["recv"] => {
                let f = rx.as_ref().unwrap().recv_timeout(T).unwrap();
                let seq = f.seq();
                drop(f);
                tell(format!("received {seq}"));
            }
            ["detach"] => {
                rx = None;
                tell("detached");
            }
            ["quit"] => break,
            _ => panic!("unknown order {line:?}"),
        }
    }
    drop(rx);
    for p in tx.drain(..) {
        p.close(T).unwrap();
    }
    tell("bye");
}

/// Starts the exporter (running `test` in this binary) and reads its tokens.
fn start_exporter(test: &str) -> (Peer, Tokens, String) {
    let base = common::unique("hygiene");
    let mut peer = Peer::spawn(test, "exporter", &[(CHANNEL, &base)]);
    let line = peer.expect("tokens", T);
    let t: Vec<Token> = line
        .split(' ')
        .map(|h| Token::from_hex(h).unwrap())
        .collect();
    let tokens = Tokens {
        legacy: t[0],
        vmm: t[1],
        pool: t[2],
        event: t[3],
    };
    (peer, tokens, base)
}

/// Ends the exporter normally (its exports are freed and its channels closed).
fn quit(mut peer: Peer) {
    peer.send("quit");
    peer.expect("bye", T);
    peer.finish(T);
}

// ------------------------------------------------------------------------------- the calls checked

/// Every kind of call that succeeds, each followed by the check.
fn every_call(test: &str, x: &Expect) {
    let ctx = ctx();
    x.after("Context::default_device");
    let dev = ctx.device();
    drop(Context::primary(dev).unwrap());
    x.after("Context::primary and its drop");
    dev.capabilities().unwrap();
    x.after("Device::capabilities");
    cuda_ipc::probe::require_legacy_ipc(&dev).unwrap();
    x.after("probe::require_legacy_ipc");
    cuda_ipc::probe::report().unwrap();
    x.after("probe::report");
    ctx.synchronize().unwrap();
    x.after("Context::synchronize");
    ctx.memory_info().unwrap();
    x.after("Context::memory_info");

    // Streams, events, memory and kernels of the driver layer.
    let s = Stream::new(&ctx).unwrap();
    x.after("Stream::new");
    let e = Event::new(&ctx).unwrap();
    x.after("Event::new");
    e.record(&s).unwrap();
    x.after("Event::record");
    s.wait_event(&e).unwrap();
    x.after("Stream::wait_event");
    s.synchronize().unwrap();
    x.after("Stream::synchronize");
    assert!(s.is_idle().unwrap());
    x.after("Stream::is_idle");
    assert!(e.is_complete().unwrap());
    x.after("Event::is_complete");
    e.synchronize().unwrap();
    x.after("Event::synchronize");
    let buf = DeviceBuffer::new(&ctx, LEN).unwrap();
    x.after("DeviceBuffer::new");
    buf.memset_u32_async(0x0707_0707, &s).unwrap();
    x.after("DeviceMemory::memset_u32_async");
    s.synchronize().unwrap();
    buf.copy_from_host(0, &[9; 64]).unwrap();
    x.after("DeviceMemory::copy_from_host");
    let mut host = [0u8; 128];
    buf.copy_to_host(0, &mut host).unwrap();
    x.after("DeviceMemory::copy_to_host");
    assert_eq!(host[..64], [9; 64]);
    assert_eq!(host[64..], [7; 64]);
    let k = Kernels::load(&ctx).unwrap();
    x.after("Kernels::load (Module::from_ptx, Module::function)");
    k.fill_pattern(&buf, 3, &s).unwrap();
    x.after("Kernels::fill_pattern (Function::launch)");
    s.synchronize().unwrap();

    // Exports of this process, and imports of them.
    let tok = buf.export_range(4096, 4096).unwrap();
    x.after("DeviceBuffer::export_range");
    buf.export().unwrap();
    x.after("DeviceBuffer::export");
    let h = buf.ipc_handle().unwrap();
    x.after("DeviceBuffer::ipc_handle");
    let own = ImportedBuffer::open(&tok).unwrap();
    x.after("ImportedBuffer::open of a self-export");
    assert!(own.is_local());
    drop(own);
    x.after("drop of a self-import");
    drop(h.open(&ctx).unwrap());
    x.after("IpcMemHandle::open of a self-export and its drop");
    let vmm = VmmBuffer::new(&ctx, LEN).unwrap();
    x.after("VmmBuffer::new");
    vmm.copy_from_host(0, &[5; 64]).unwrap();
    let vtok = vmm.export().unwrap();
    x.after("VmmBuffer::export");
    drop(ImportedBuffer::open(&vtok).unwrap());
    x.after("ImportedBuffer::open of a VMM self-export and its drop");
    // The fd is closed again; the VMM import path proper runs below, with the exporter's token.
    drop(vmm.export_fd().unwrap());
    x.after("VmmBuffer::export_fd");
    let pool = MemPool::exportable(&ctx).unwrap();
    x.after("MemPool::exportable");
    let pb = pool.alloc(LEN, &s).unwrap();
    x.after("MemPool::alloc");
    let ptok = pb.export().unwrap();
    x.after("PoolBuffer::export");
    drop(ImportedBuffer::open(&ptok).unwrap());
    x.after("ImportedBuffer::open of a pool self-export and its drop");
    let ev = IpcEvent::new(&ctx).unwrap();
    x.after("IpcEvent::new");
    ev.record_on(&s).unwrap();
    x.after("IpcEvent::record_on");
    let etok = ev.export().unwrap();
    x.after("IpcEvent::export");
    drop(IpcEvent::open(&etok).unwrap());
    x.after("IpcEvent::open of a self-export and its drop");

    // Imports from the exporter, each driver open and close.
    let (mut peer, t, base) = start_exporter(test);
    x.after("starting the exporter");
    for (tok, byte, what) in [
        (t.legacy, LEGACY_BYTE, "legacy"),
        (t.vmm, VMM_BYTE, "VMM"),
        (t.pool, POOL_BYTE, "pool"),
    ] {
        let b = ImportedBuffer::open(&tok).unwrap();
        x.after(&format!(
            "ImportedBuffer::open of the exporter's {what} buffer"
        ));
        assert!(!b.is_local());
        let mut h = vec![0u8; 4096];
        b.copy_to_host(0, &mut h).unwrap();
        x.after(&format!("copy_to_host from an imported {what} buffer"));
        assert!(h.iter().all(|&v| v == byte), "{what} bytes");
        let again = ImportedBuffer::open_in(&ctx, &tok).unwrap();
        x.after(&format!(
            "ImportedBuffer::open_in of a cached {what} import"
        ));
        drop(again);
        drop(b);
        x.after(&format!("drop of an imported {what} buffer (driver close)"));
    }
    let pe = IpcEvent::open(&t.event).unwrap();
    x.after("IpcEvent::open of the exporter's event");
    s.wait_event(&pe).unwrap();
    x.after("Stream::wait_event on an imported event");
    pe.is_complete().unwrap();
    x.after("Event::is_complete of an imported event");
    drop(pe);
    x.after("drop of an imported event");

    // Consuming the exporter's channels, one per memory kind.
    for (i, kind) in KINDS.iter().enumerate() {
        let rx = Consumer::attach(&channel_name(&base, i), &ConsumerOptions::new()).unwrap();
        x.after(&format!("Consumer::attach ({kind:?})"));
        for n in 1..=3u8 {
            peer.send(&format!("publish {i} {n}"));
            peer.expect("published", T);
            let f = rx.recv_timeout(T).unwrap();
            x.after(&format!("Consumer::recv_timeout ({kind:?})"));
            f.stream().unwrap().synchronize().unwrap();
            let mut h = [0u8; 64];
            f.buffer().unwrap().copy_to_host(0, &mut h).unwrap();
            assert_eq!(h, [n; 64], "frame {n} of the {kind:?} channel");
            drop(f);
            x.after(&format!("drop of a received frame ({kind:?}, release)"));
        }
        assert!(rx.try_recv().unwrap().is_none());
        x.after("Consumer::try_recv");
        drop(rx);
        x.after(&format!("drop of a Consumer ({kind:?})"));
    }

    // Producing for the exporter, one channel per memory kind.
    for (i, kind) in KINDS.iter().enumerate() {
        let name = format!("{base}-parent-{i}");
        let opts = ChannelOptions::new(LEN).buffers(2).memory(*kind);
        let mut tx = Producer::create(&ctx, &name, &opts).unwrap();
        x.after(&format!("Producer::create ({kind:?})"));
        peer.send(&format!("attach {name}"));
        peer.expect("attached", T);
        // The third frame reuses a buffer the exporter read: the acquire opens and queries its
        // release events.
        for n in 1..=3u8 {
            let f = tx.acquire(Some(T)).unwrap();
            x.after(&format!("Producer::acquire ({kind:?})"));
            f.buffer().unwrap().copy_from_host(0, &[n; 64]).unwrap();
            f.publish(&[n]).unwrap();
            x.after(&format!("WriteFrame::publish ({kind:?})"));
            peer.send("recv");
            peer.expect("received", T);
        }
        drop(tx.acquire(Some(T)).unwrap());
        x.after("drop of an unpublished frame");
        peer.send("detach");
        peer.expect("detached", T);
        if i == 0 {
            drop(tx);
            x.after(&format!("drop of a Producer ({kind:?})"));
        } else {
            tx.close(T).unwrap();
            x.after(&format!("Producer::close ({kind:?})"));
        }
    }

    // A tensor set of this process's own: the reader's open attaches the generation channel on a
    // second thread while this one imports the memory.
    let set = format!("{base}-set");
    let specs = [TensorSpec::new("w", DType::F32, &[1024])];
    let mut w = TensorSetWriter::create(&ctx, &set, &specs, &TensorSetOptions::new()).unwrap();
    x.after("TensorSetWriter::create");
    w.begin(Some(T)).unwrap().commit().unwrap();
    x.after("TensorSetWriter::begin and Update::commit");
    let r = TensorSetReader::open(&ctx, &set, &ReaderOptions::new()).unwrap();
    x.after("TensorSetReader::open (the channel attach on a second thread)");
    let held = r.current().unwrap().unwrap();
    x.after("TensorSetReader::current");
    assert_eq!(held.generation(), 1);
    drop(held);
    drop(r);
    x.after("drop of a TensorSetReader");
    w.close(T).unwrap();
    x.after("TensorSetWriter::close");

    // Drops of this process's exports.
    drop(pb);
    x.after("drop of a PoolBuffer");
    drop(pool);
    x.after("drop of a MemPool");
    drop(vmm);
    x.after("drop of a VmmBuffer");
    drop(buf);
    x.after("drop of a DeviceBuffer");
    drop(ev);
    x.after("drop of an IpcEvent");
    drop(k);
    x.after("drop of Kernels (cuModuleUnload)");
    drop(e);
    x.after("drop of an Event");
    drop(s);
    x.after("drop of a Stream");
    quit(peer);
    // Last, as it is the one query made without entering a context: it must need none.
    cuda_ipc::ipc::vmm_granularity(&dev).unwrap();
    x.after("ipc::vmm_granularity");
    drop(ctx);
    x.after("drop of the last Context (primary context released)");
}

/// Every kind of call that fails, each followed by the check.
fn error_paths(test: &str, x: &Expect) {
    let ctx = ctx();
    let me = ProcessIdentity::current().unwrap();
    let other = ProcessIdentity { pid: 1, ..me };
    let garbage = |kind, len| Token {
        kind,
        handle: [0x5A; 64],
        offset: 0,
        len,
        device: ctx.device().uuid(),
        exporter: other,
        export_id: 7,
    };

    // The driver refuses.
    expect_err(
        ImportedBuffer::open(&garbage(TokenKind::LegacyMemory, 64)),
        "ImportedBuffer::open of a garbage legacy token",
    );
    x.after("ImportedBuffer::open of a garbage legacy token");
    expect_err(
        IpcEvent::open(&garbage(TokenKind::LegacyEvent, 0)),
        "IpcEvent::open of a garbage event token",
    );
    x.after("IpcEvent::open of a garbage event token");
    expect_err(
        IpcEventHandle([0xA5; 64]).open(&ctx),
        "IpcEventHandle::open of garbage",
    );
    x.after("IpcEventHandle::open of garbage");
    let null = std::fs::File::open("/dev/null").unwrap();
    expect_err(
        ImportedBuffer::from_vmm_fd(&ctx, null.as_fd(), 4096),
        "ImportedBuffer::from_vmm_fd of /dev/null",
    );
    x.after("ImportedBuffer::from_vmm_fd of a descriptor that is no CUDA allocation");
    expect_err(
        Module::from_ptx(&ctx, "this is not PTX"),
        "Module::from_ptx of garbage",
    );
    x.after("Module::from_ptx of garbage");
    let m = Module::from_ptx(&ctx, cuda_ipc::raw::kernels::PTX).unwrap();
    expect_err(
        m.function("no_such_kernel"),
        "Module::function of a missing name",
    );
    x.after("Module::function of a missing name");
    drop(m);
    expect_err(
        DeviceBuffer::new(&ctx, 1 << 50),
        "DeviceBuffer::new of 1 PiB",
    );
    x.after("DeviceBuffer::new out of memory");
    expect_err(VmmBuffer::new(&ctx, 1 << 50), "VmmBuffer::new of 1 PiB");
    x.after("VmmBuffer::new out of memory");
    let s = Stream::new(&ctx).unwrap();
    let pool = MemPool::exportable(&ctx).unwrap();
    // Stream-ordered allocation may report it late; either way the context must be restored.
    match pool.alloc(1 << 50, &s) {
        Ok(b) => println!("MemPool::alloc of 1 PiB succeeded ({} bytes)", b.len()),
        Err(e) => println!("MemPool::alloc of 1 PiB: {e}"),
    }
    x.after("MemPool::alloc out of memory");
    // Refused before the driver is called.
    let buf = DeviceBuffer::new(&ctx, 4096).unwrap();
    expect_err(
        buf.copy_to_host(4096, &mut [0; 1]),
        "copy_to_host past the end",
    );
    x.after("copy_to_host past the end");
    expect_err(DeviceBuffer::new(&ctx, 0), "DeviceBuffer::new of 0 bytes");
    x.after("DeviceBuffer::new of 0 bytes");

    let (mut peer, t, base) = start_exporter(test);
    // A range past the allocation: opened by the driver, refused, closed again.
    let mut long = t.legacy;
    long.len = 1 << 40;
    expect_err(
        ImportedBuffer::open(&long),
        "a legacy range past the allocation",
    );
    x.after("ImportedBuffer::open of a range past the allocation (open, then close)");
    // A pool the driver imports, with pointer export data it refuses.
    let mut bad_ptr = t.pool;
    bad_ptr.handle = [0x5A; 64];
    expect_err(
        ImportedBuffer::open(&bad_ptr),
        "a pool token with garbage export data",
    );
    x.after("ImportedBuffer::open of a pool token with garbage export data");
    // A VMM export id the exporter does not serve.
    let mut bad_id = t.vmm;
    bad_id.export_id ^= 0xFFFF;
    expect_err(
        ImportedBuffer::open(&bad_id),
        "a VMM token of an unserved id",
    );
    x.after("ImportedBuffer::open of a VMM token of an unserved id");

    // Channel errors.
    expect_err(
        Consumer::attach(&format!("{base}-missing"), &ConsumerOptions::new()),
        "Consumer::attach to a missing channel",
    );
    x.after("Consumer::attach to a missing channel");
    let rx = Consumer::attach(&channel_name(&base, 0), &ConsumerOptions::new()).unwrap();
    let e = expect_err(
        rx.recv_timeout(Duration::from_millis(50)),
        "Consumer::recv_timeout without a frame",
    );
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    x.after("Consumer::recv_timeout that times out");
    let e = expect_err(
        Producer::create(&ctx, &channel_name(&base, 0), &ChannelOptions::new(LEN)),
        "Producer::create of a channel a live producer serves",
    );
    assert!(
        matches!(e, Error::Channel(ChannelError::AlreadyExists { .. })),
        "{e}"
    );
    x.after("Producer::create of a channel a live producer serves");
    expect_err(
        Producer::create(
            &ctx,
            &format!("{base}-zero"),
            &ChannelOptions::new(LEN).buffers(0),
        ),
        "Producer::create of 0 buffers",
    );
    x.after("Producer::create of 0 buffers");
    drop(rx);
    x.after("drop of a Consumer");

    // The exporter dies (killed: nothing of it is cleaned up).
    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    for (tok, what, must_fail) in [
        (t.legacy, "legacy", false),
        (t.vmm, "VMM", true),
        (t.pool, "pool", true),
    ] {
        let call = format!("ImportedBuffer::open of a dead exporter's {what} token");
        match ImportedBuffer::open(&tok) {
            Ok(b) => {
                assert!(!must_fail, "{call} succeeded");
                println!("{call}: opened");
                drop(b);
            }
            Err(e) => println!("{call}: {e}"),
        }
        x.after(&call);
    }
    match IpcEvent::open(&t.event) {
        Ok(e) => drop(e),
        Err(e) => println!("IpcEvent::open of a dead exporter's event: {e}"),
    }
    x.after("IpcEvent::open of a dead exporter's event");
    for i in 0..KINDS.len() {
        let name = channel_name(&base, i);
        let e = expect_err(
            Consumer::attach(&name, &ConsumerOptions::new()),
            "Consumer::attach to a dead producer's channel",
        );
        assert!(
            matches!(e, Error::Channel(ChannelError::ProducerGone { .. })),
            "{e}"
        );
        x.after("Consumer::attach to a dead producer's channel");
        // Replacing the dead producer's segment also removes it.
        let opts = ChannelOptions::new(4096).buffers(1);
        Producer::create(&ctx, &name, &opts)
            .unwrap()
            .close(T)
            .unwrap();
        x.after("Producer::create over a dead producer's channel, and close");
    }
    drop((buf, pool, s, ctx));
    x.after("drops after the errors");
}

// ----------------------------------------------------------------------------------------- tests

const OWN_CALLS: &str = "every_call_leaves_the_threads_own_context_current";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn every_call_leaves_the_threads_own_context_current() {
    if role().as_deref() == Some("exporter") {
        return exporter();
    }
    let own = OwnContext::new();
    every_call(OWN_CALLS, &Expect::own(&own));
    own.destroy();
}

const NONE_CALLS: &str = "every_call_on_a_thread_without_a_context_leaves_none_current";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn every_call_on_a_thread_without_a_context_leaves_none_current() {
    if role().as_deref() == Some("exporter") {
        return exporter();
    }
    driver_ready();
    every_call(NONE_CALLS, &Expect::none());
}

const OWN_ERRORS: &str = "every_error_path_leaves_the_threads_own_context_current";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn every_error_path_leaves_the_threads_own_context_current() {
    if role().as_deref() == Some("exporter") {
        return exporter();
    }
    let own = OwnContext::new();
    error_paths(OWN_ERRORS, &Expect::own(&own));
    own.destroy();
}

const NONE_ERRORS: &str = "every_error_path_on_a_thread_without_a_context_leaves_none_current";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn every_error_path_on_a_thread_without_a_context_leaves_none_current() {
    if role().as_deref() == Some("exporter") {
        return exporter();
    }
    driver_ready();
    error_paths(NONE_ERRORS, &Expect::none());
}

/// One of everything that does driver work in its drop, made on the calling thread.
fn objects(ctx: &Arc<Context>, t: &Tokens, base: &str) -> Vec<(&'static str, Box<dyn Send>)> {
    let s = Stream::new(ctx).unwrap();
    let pool = MemPool::exportable(ctx).unwrap();
    let pb = pool.alloc(LEN, &s).unwrap();
    let vmm = VmmBuffer::new(ctx, LEN).unwrap();
    vmm.export().unwrap();
    let buf = DeviceBuffer::new(ctx, LEN).unwrap();
    buf.export().unwrap();
    vec![
        (
            "an imported legacy buffer",
            Box::new(ImportedBuffer::open(&t.legacy).unwrap()),
        ),
        (
            "an imported VMM buffer",
            Box::new(ImportedBuffer::open(&t.vmm).unwrap()),
        ),
        (
            "an imported pool buffer",
            Box::new(ImportedBuffer::open(&t.pool).unwrap()),
        ),
        (
            "an imported event",
            Box::new(IpcEvent::open(&t.event).unwrap()),
        ),
        (
            "a Consumer",
            Box::new(Consumer::attach(&channel_name(base, 0), &ConsumerOptions::new()).unwrap()),
        ),
        (
            "a Producer",
            Box::new(
                Producer::create(ctx, &format!("{base}-moved"), &ChannelOptions::new(LEN)).unwrap(),
            ),
        ),
        ("an IpcEvent", Box::new(IpcEvent::new(ctx).unwrap())),
        ("an Event", Box::new(Event::new(ctx).unwrap())),
        ("Kernels", Box::new(Kernels::load(ctx).unwrap())),
        ("a PoolBuffer", Box::new(pb)),
        ("a MemPool", Box::new(pool)),
        ("a VmmBuffer", Box::new(vmm)),
        ("a DeviceBuffer", Box::new(buf)),
        ("a Stream", Box::new(s)),
        ("a Context", Box::new(ctx.clone())),
    ]
}

/// Drops `objects` one by one on a new thread, which has its own context when `own`, else none;
/// after each drop that thread's current context must be unchanged.
fn drop_on_another_thread(objects: Vec<(&'static str, Box<dyn Send>)>, own: bool) {
    std::thread::spawn(move || {
        let mine = own.then(OwnContext::new);
        let x = match &mine {
            Some(c) => Expect::own(c),
            None => Expect::none(),
        };
        for (what, o) in objects {
            drop(o);
            x.after(&format!(
                "drop of {what} on another thread than its maker's"
            ));
        }
        if let Some(c) = mine {
            c.destroy();
        }
    })
    .join()
    .expect("the dropping thread failed");
}

const OTHER_THREAD: &str = "drops_on_another_thread_leave_both_threads_contexts_as_they_were";

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn drops_on_another_thread_leave_both_threads_contexts_as_they_were() {
    if role().as_deref() == Some("exporter") {
        return exporter();
    }
    let own = OwnContext::new();
    let x = Expect::own(&own);
    let ctx = ctx();
    let (peer, t, base) = start_exporter(OTHER_THREAD);
    // Made here, dropped on a thread with a context of its own; then made anew (the imports are
    // opened again, the first ones being closed) and dropped on a thread with none.
    for own_there in [true, false] {
        let objs = objects(&ctx, &t, &base);
        x.after("making the objects");
        drop_on_another_thread(objs, own_there);
        x.after("drops on another thread");
    }
    quit(peer);
    drop(ctx);
    x.after("drop of the last Context");
    own.destroy();
}
