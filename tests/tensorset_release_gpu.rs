//! GPU tests of a tensor-set reader's releases: a reader that never uses its stream takes and
//! releases generations while the writer writes (the writer's `begin` never waits for good), and a
//! reader that enqueues long work on its stream has its release ordered after that work (the
//! writer never rewrites a buffer the work still reads). They need a CUDA GPU and fail without one;
//! `cargo test` lists them as ignored.

mod common;

use common::{ctx, read_u64, zeroed_counter};
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::tensorset::{
    DType, GenerationMode, ReaderOptions, TensorSetOptions, TensorSetReader, TensorSetWriter,
    TensorSpec,
};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed", DType::F32, &[1024, 256]),
        TensorSpec::new("head", DType::BF16, &[512, 512]),
    ]
}

fn seed(g: u64, t: usize) -> u32 {
    (g as u32).wrapping_mul(16).wrapping_add(t as u32)
}

/// Writes and commits the next generation on the writer's stream (`begin` bounded by `T`).
fn write_gen(w: &mut TensorSetWriter, k: &Kernels) -> u64 {
    let n = w.layout().len();
    let u = w
        .begin(Some(T))
        .expect("begin: the reader's releases reach the writer");
    let g = u.generation();
    for t in 0..n {
        k.fill_pattern(
            &u.device_tensor(t).unwrap(),
            seed(g, t),
            u.stream().unwrap(),
        )
        .unwrap();
    }
    assert_eq!(u.commit().unwrap(), g);
    g
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_reader_that_never_uses_its_stream_takes_and_releases_while_the_writer_writes() {
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let name = format!("tsrel-host-{}", std::process::id());
    let opts = TensorSetOptions::new().mode(GenerationMode::Buffered(2));
    let mut w = TensorSetWriter::create(&c, &name, &specs(), &opts).unwrap();
    write_gen(&mut w, &k);
    w.stream().unwrap().synchronize().unwrap();
    let r = TensorSetReader::open(&c, &name, &ReaderOptions::new()).unwrap();
    let last_written = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut g = 0;
            for _ in 0..100 {
                g = write_gen(&mut w, &k);
            }
            g
        });
        let mut last = 0u64;
        // Every generation taken is held, then released, with nothing enqueued on the stream,
        // up to the writer's last (101: the first and 100 more). Not "until the writer's thread
        // has finished": a reader that took 101 while that thread was still returning would
        // wait for a 102nd that never comes.
        while last < 101 {
            let h = r.wait_newer(last, Some(T)).expect("a newer generation");
            last = h.generation();
            drop(h);
        }
        writer.join().unwrap()
    });
    assert_eq!(last_written, 101);
    // The last generation is still taken and released after the writer stopped.
    let h = r.current().unwrap().expect("the last generation");
    assert_eq!(h.generation(), 101);
    drop(h);
    drop(r);
    w.close(Duration::from_secs(5)).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_reader_that_works_on_its_stream_has_its_release_ordered_after_the_work() {
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let bad = zeroed_counter(&c);
    let name = format!("tsrel-stream-{}", std::process::id());
    let opts = TensorSetOptions::new().mode(GenerationMode::Buffered(2));
    let mut w = TensorSetWriter::create(&c, &name, &specs(), &opts).unwrap();
    write_gen(&mut w, &k);
    w.stream().unwrap().synchronize().unwrap();
    let r = TensorSetReader::open(&c, &name, &ReaderOptions::new()).unwrap();
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            for _ in 0..40 {
                write_gen(&mut w, &k);
            }
        });
        let mut last = 0u64;
        // Up to the writer's last generation (41), not until its thread has finished (see above).
        while last < 41 {
            let h = r.wait_newer(last, Some(T)).expect("a newer generation");
            last = h.generation();
            let st = h.stream().unwrap();
            // Long work first: a release not ordered after it lets the writer rewrite the
            // buffer under the check below.
            k.spin(20_000_000, st).unwrap();
            for t in 0..r.layout().len() {
                k.check_pattern(&h.device_tensor(t).unwrap(), seed(last, t), &bad, st)
                    .unwrap();
            }
            drop(h);
        }
        writer.join().unwrap();
    });
    r.stream().unwrap().synchronize().unwrap();
    assert_eq!(
        read_u64(&bad),
        0,
        "the writer rewrote a buffer the reader still read"
    );
    drop(r);
    w.close(Duration::from_secs(5)).unwrap();
}
