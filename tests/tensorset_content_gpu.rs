//! GPU tests of content fingerprints: the kernel's digests equal the host twin's for the same
//! bytes (sizes around the word and item boundaries, an unaligned start, a 4 GiB tensor), a
//! writer's fingerprinted commit verified by a reader in another process, a stray write or a
//! wrong fingerprint refused, and one changed byte anywhere told apart. They need a CUDA GPU and
//! fail without one; `cargo test` lists them as ignored.

mod common;

use common::{Peer, ctx, role, tell};
use cuda_ipc::Error;
use cuda_ipc::driver::{Context, DeviceBuffer, DeviceMemory, Stream};
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::tensorset::content::{Fingerprinter, digest_bytes, set_fingerprint};
use cuda_ipc::tensorset::{
    DType, GenerationMode, ReaderOptions, TensorSetError, TensorSetOptions, TensorSetReader,
    TensorSetWriter, TensorSpec,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
const SET: &str = "CUDA_IPC_TEST_SET";

/// A window of a device buffer at any byte offset: the kernel's unaligned path.
struct Window<'a> {
    buf: &'a DeviceBuffer,
    at: usize,
    len: usize,
}

impl DeviceMemory for Window<'_> {
    fn device_ptr(&self) -> u64 {
        self.buf.device_ptr() + self.at as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn context(&self) -> &Arc<Context> {
        self.buf.context()
    }
}

fn bytes_of(m: &impl DeviceMemory) -> Vec<u8> {
    let mut v = vec![0u8; m.len()];
    m.copy_to_host(0, &mut v).unwrap();
    v
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn the_kernels_digests_are_the_host_twins_for_every_size_and_alignment() {
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let s = Stream::new(&c).unwrap();
    let f = Fingerprinter::new(&c).unwrap();
    // Filled with the pattern, whose words all differ: any word read twice, skipped, or at the
    // wrong index changes the digest.
    let buf = DeviceBuffer::new(&c, (3 << 20) + 64).unwrap();
    k.fill_pattern(&buf, 11, &s).unwrap();
    s.synchronize().unwrap();
    let host = bytes_of(&buf);
    let mut windows = Vec::new();
    for len in [
        0,
        1,
        15,
        16,
        17,
        255,
        4096,
        (1 << 20) - 1,
        1 << 20,
        (1 << 20) + 17,
        3 << 20,
    ] {
        for at in [0usize, 1, 8, 16, 256] {
            if at + len <= buf.len() {
                windows.push(Window { buf: &buf, at, len });
            }
        }
    }
    let t0 = Instant::now();
    let device = f.digests(&windows, &s).unwrap();
    let took = t0.elapsed();
    for (w, d) in windows.iter().zip(&device) {
        assert_eq!(
            *d,
            digest_bytes(&host[w.at..w.at + w.len]),
            "{} bytes at +{}",
            w.len,
            w.at
        );
    }
    println!(
        "{} windows checked against the host twin ({took:?} on the GPU)",
        windows.len()
    );

    // 4 GiB in one tensor (4,096 items): the same 16 bytes as the host, and its time.
    let big = DeviceBuffer::new(&c, 4 << 30).unwrap();
    k.fill_pattern(&big, 5, &s).unwrap();
    s.synchronize().unwrap();
    let mut times = Vec::new();
    let mut d = [0u8; 16];
    for _ in 0..3 {
        let t0 = Instant::now();
        d = f.digests(std::slice::from_ref(&big), &s).unwrap()[0];
        times.push(t0.elapsed());
    }
    assert_eq!(d, digest_bytes(&bytes_of(&big)), "4 GiB");
    times.sort();
    println!(
        "4 GiB digest: median {:?} ({:.0} GB/s)",
        times[1],
        (4u64 << 30) as f64 / times[1].as_secs_f64() / 1e9
    );

    // One byte changed anywhere in a tensor changes its digest and no other tensor's.
    let parts: Vec<Window> = (0..3)
        .map(|i| Window {
            buf: &big,
            at: i << 30,
            len: 1 << 30,
        })
        .collect();
    let before = f.digests(&parts, &s).unwrap();
    for at in [0u64, 1 << 29, (1 << 30) + 12_345, (3 << 30) - 1] {
        let mut b = [0u8; 1];
        big.copy_to_host(at as usize, &mut b).unwrap();
        big.copy_from_host(at as usize, &[b[0] ^ 0x80]).unwrap();
        // The copy ran on the legacy stream, which `s` (non-blocking) does not wait for.
        c.synchronize().unwrap();
        let after = f.digests(&parts, &s).unwrap();
        let hit = (at >> 30) as usize;
        for (i, (x, y)) in before.iter().zip(&after).enumerate() {
            assert_eq!(x != y, i == hit, "byte {at}: tensor {i}");
        }
        big.copy_from_host(at as usize, &b).unwrap();
        c.synchronize().unwrap();
    }
    assert_eq!(f.digests(&parts, &s).unwrap(), before);
}

const VERIFY: &str = "a_fingerprinted_generation_is_verified_in_another_process";

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed", DType::BF16, &[4096, 1024]),
        TensorSpec::new("norm", DType::F32, &[3]),
        TensorSpec::new("w", DType::F8_E4M3FN, &[1000, 333]),
        TensorSpec::new("empty", DType::F32, &[0]),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_fingerprinted_generation_is_verified_in_another_process() {
    if role().as_deref() == Some("reader") {
        let c = ctx();
        let name = std::env::var(SET).unwrap();
        let r = TensorSetReader::open(&c, &name, &ReaderOptions::new()).unwrap();
        let mut last = 0;
        loop {
            let h = match r.wait_newer(last, Some(T)) {
                Ok(h) => h,
                Err(Error::TensorSet(TensorSetError::Closed(_))) => break,
                Err(e) => panic!("{e}"),
            };
            last = h.generation();
            let verdict = match h.verify_content() {
                Ok(()) => "ok".to_string(),
                Err(Error::TensorSet(TensorSetError::ContentUnverified { .. })) => {
                    "mismatch".to_string()
                }
                Err(e) => format!("error {e}"),
            };
            let fp: String = h.content().iter().map(|b| format!("{b:02x}")).collect();
            tell(format!("gen {last} {verdict} {fp}"));
        }
        return;
    }
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    for kind in ["vmm", "pool", "legacy"] {
        let name = format!("tscontent-{kind}-{}", std::process::id());
        let mem = match kind {
            "pool" => cuda_ipc::channel::MemoryKind::Pool,
            "legacy" => cuda_ipc::channel::MemoryKind::Legacy,
            _ => cuda_ipc::channel::MemoryKind::Vmm,
        };
        let opts = TensorSetOptions::new()
            .memory(mem)
            .mode(GenerationMode::Buffered(2));
        let mut w = TensorSetWriter::create(&c, &name, &specs(), &opts).unwrap();
        let mut reader = Peer::spawn(VERIFY, "reader", &[(SET, &name)]);
        let n = w.layout().len();
        let layout = w.layout().clone();
        let mut want = Vec::new();
        for g in 1..=4u64 {
            let u = w.begin(Some(T)).unwrap();
            for t in 0..n {
                let d = u.device_tensor(t).unwrap();
                if d.len().is_multiple_of(4) && !d.is_empty() {
                    k.fill_pattern(&d, (g * 10 + t as u64) as u32, u.stream().unwrap())
                        .unwrap();
                }
            }
            // The writer's digests against the host twin over the same bytes.
            let digests = u.tensor_digests().unwrap();
            u.stream().unwrap().synchronize().unwrap();
            let host: Vec<[u8; 16]> = (0..n)
                .map(|t| digest_bytes(&bytes_of(&u.device_tensor(t).unwrap())))
                .collect();
            assert_eq!(digests, host, "{kind} generation {g}");
            let expect = set_fingerprint(&layout, &host).unwrap();
            let committed = match g {
                // Generation 3 claims another generation's content: readers must say so.
                3 => {
                    let wrong = want[0];
                    assert_eq!(u.commit_with_content(wrong).unwrap(), g);
                    wrong
                }
                _ => {
                    let (committed_gen, fp) = u.commit_fingerprinted().unwrap();
                    assert_eq!((committed_gen, fp), (g, expect), "{kind}");
                    fp
                }
            };
            want.push(committed);
            let line = reader.expect(&format!("gen {g} "), T);
            let hex: String = committed.iter().map(|b| format!("{b:02x}")).collect();
            let verdict = if g == 3 { "mismatch" } else { "ok" };
            assert_eq!(line, format!("{verdict} {hex}"), "{kind} generation {g}");
        }
        w.close(T).unwrap();
        reader.finish(T);
    }
}
