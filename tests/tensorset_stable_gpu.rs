//! GPU tests of a tensor-set reader's stable addresses: one CUDA graph captured once over the
//! stable addresses, replayed for 100 generations of a buffered VMM set written by another
//! process, each replay's reads checked on the GPU; in place, the stable addresses are the
//! buffer's own and the hold keeps the writer out until released; the option refused on pool
//! sets; another reader's guard refused. They need a CUDA GPU and fail without one; `cargo test`
//! lists them as ignored.

mod common;

use common::{Peer, ctx, parent_lines, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::channel::MemoryKind;
use cuda_ipc::driver::{DeviceBuffer, Graph, Stream};
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::tensorset::{
    DType, GenerationMode, ReaderOptions, TensorSetError, TensorSetOptions, TensorSetReader,
    TensorSetWriter, TensorSpec,
};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const SET: &str = "CUDA_IPC_TEST_SET";
const GENERATIONS: u64 = 100;

fn set_env() -> String {
    std::env::var(SET).unwrap()
}

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed", DType::F32, &[1024, 256]),
        TensorSpec::new("layer.0.w", DType::BF16, &[512, 512]),
        TensorSpec::new("layer.0.b", DType::F32, &[512]),
        TensorSpec::new("head", DType::F8_E4M3FN, &[4096, 64]),
    ]
}

/// The pattern seed of tensor `t` in generation `g`.
fn seed(g: u64, t: usize) -> u32 {
    (g as u32).wrapping_mul(16).wrapping_add(t as u32)
}

/// Writes generation `w.generation() + 1` on the writer's stream and commits it.
fn write_gen(w: &mut TensorSetWriter, k: &Kernels) -> u64 {
    let n = w.layout().len();
    let u = w.begin(Some(T)).expect("begin");
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

/// Enqueues a check of every tensor at the reader's stable addresses against generation `g`.
fn check_stable(r: &TensorSetReader, k: &Kernels, g: u64, bad: &DeviceBuffer, s: &Stream) {
    for t in 0..r.layout().len() {
        k.check_pattern(&r.stable_tensor(t).unwrap(), seed(g, t), bad, s)
            .unwrap();
    }
}

const GRAPH: &str = "a_graph_captured_once_over_stable_addresses_reads_every_generation";

/// The engine's case: a reader in another process captures one CUDA graph over its stable
/// addresses (a copy kernel per tensor into scratch memory of its own) and replays it after each
/// switch; the copies are checked against the generation's pattern outside the graph. The writer
/// publishes each next generation as soon as the reader has taken the last one, so it writes
/// while the reader switches (the buffer it gets is the one the switch lets go).
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn a_graph_captured_once_over_stable_addresses_reads_every_generation() {
    if role().as_deref() == Some("reader") {
        let c = ctx();
        let k = Kernels::load(&c).unwrap();
        let opts = ReaderOptions::new().stable_addresses(true);
        let r = TensorSetReader::open(&c, &set_env(), &opts).unwrap();
        let n = r.layout().len();
        let ptrs: Vec<u64> = (0..n).map(|t| r.stable_ptr(t).unwrap()).collect();
        let scratch: Vec<DeviceBuffer> = r
            .layout()
            .tensors()
            .iter()
            .map(|t| DeviceBuffer::new(&c, t.bytes as usize).unwrap())
            .collect();
        let bad = zeroed_counter(&c);
        let replay = Stream::new(&c).unwrap();
        tell(format!("opened {}", r.is_read_only()));
        let mut graph: Option<Graph> = None;
        let (mut last, mut checked, mut remapped, mut moved) = (0u64, 0u64, 0u64, 0u64);
        let mut micros = Vec::new();
        for line in parent_lines() {
            if line == "end" {
                break;
            }
            let want: u64 = line.parse().unwrap();
            let h = r.wait_newer(last, Some(T)).unwrap();
            assert_eq!(h.generation(), want, "lock-step: the writer's newest");
            let own: Vec<u64> = (0..n).map(|t| h.device_ptr(t).unwrap()).collect();
            tell(format!("took {want}"));
            let sw = r.switch_stable(h).unwrap();
            assert_eq!(sw.generation, want);
            assert_eq!(r.stable_generation(), Some(want));
            remapped += u64::from(sw.remapped);
            micros.push(sw.micros);
            for t in 0..n {
                moved += u64::from(r.stable_ptr(t).unwrap() != ptrs[t]);
                assert_ne!(ptrs[t], own[t], "buffered: the stable range is its own");
            }
            if graph.is_none() {
                // Captured once, after the first switch, over the stable addresses.
                let g = Graph::capture(&replay, |s| {
                    for (t, dst) in scratch.iter().enumerate() {
                        k.xor(&r.stable_tensor(t)?, dst, 0, s)?;
                    }
                    Ok(())
                })
                .unwrap();
                graph = Some(g);
            }
            let g = graph.as_ref().unwrap();
            // SAFETY: the graph reads the stable ranges (mapped to the generation just switched
            // to, held until the next switch, which waits for this replay) and writes `scratch`,
            // which lives past the final synchronisation below.
            unsafe { g.launch(&replay) }.unwrap();
            for (t, dst) in scratch.iter().enumerate() {
                k.check_pattern(dst, seed(want, t), &bad, &replay).unwrap();
            }
            // And the stable addresses directly, on the reader's stream.
            check_stable(&r, &k, want, &bad, r.stream().unwrap());
            checked += 1;
            last = want;
        }
        replay.synchronize().unwrap();
        r.stream().unwrap().synchronize().unwrap();
        micros.sort_unstable();
        let median = micros.get(micros.len() / 2).copied().unwrap_or(0);
        tell(format!(
            "done {checked} {} {remapped} {moved} {median}",
            read_u64(&bad)
        ));
        drop(graph);
        return;
    }
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let name = format!("tsstable-{}", std::process::id());
    let opts = TensorSetOptions::new().mode(GenerationMode::Buffered(2));
    let mut w = TensorSetWriter::create(&c, &name, &specs(), &opts).unwrap();
    let mut p = Peer::spawn(GRAPH, "reader", &[(SET, &name)]);
    assert_eq!(p.expect("opened", T), "true", "read-only");
    for _ in 0..GENERATIONS {
        let g = write_gen(&mut w, &k);
        p.send(&g.to_string());
        assert_eq!(p.expect("took", T), g.to_string());
    }
    p.send("end");
    let done = p.expect("done", T);
    let v: Vec<u64> = done.split(' ').map(|x| x.parse().unwrap()).collect();
    assert_eq!(v[0], GENERATIONS, "generations checked");
    assert_eq!(
        v[1], 0,
        "mismatches read through the graph at the stable addresses"
    );
    assert_eq!(
        v[2], GENERATIONS,
        "every switch remapped (the buffers alternate)"
    );
    assert_eq!(v[3], 0, "a stable address moved");
    println!(
        "switch_stable median {} us over {GENERATIONS} switches",
        v[4]
    );
    w.close(T).unwrap();
    p.finish(T);
}

/// In one process (the reader imports the writer's own allocations): in place the stable
/// addresses are the buffer's own, a switch maps nothing and keeps the writer out until
/// `release_stable`; buffered, the same generation switched twice maps once, and after
/// `release_stable` a switch maps again; pool sets and another reader's guard are refused.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn in_place_stable_addresses_are_the_buffers_own_and_other_kinds_are_refused() {
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let bad = zeroed_counter(&c);
    let stable = ReaderOptions::new().stable_addresses(true);

    let name = format!("tsstable-ip-{}", std::process::id());
    let mut w = TensorSetWriter::create(&c, &name, &specs(), &TensorSetOptions::new()).unwrap();
    write_gen(&mut w, &k);
    w.stream().unwrap().synchronize().unwrap();
    let r = TensorSetReader::open(&c, &name, &stable).unwrap();
    let h = r.current().unwrap().expect("generation 1");
    let own = h.device_ptr(0).unwrap();
    let sw = r.switch_stable(h).unwrap();
    assert_eq!((sw.generation, sw.remapped), (1, false));
    assert_eq!(
        r.stable_ptr(0).unwrap(),
        own,
        "in place: the buffer's own address"
    );
    assert!(matches!(
        w.begin(Some(Duration::from_millis(200))),
        Err(Error::Timeout { .. })
    ));
    check_stable(&r, &k, 1, &bad, r.stream().unwrap());
    r.stream().unwrap().synchronize().unwrap();
    assert!(r.release_stable().unwrap());
    assert_eq!(r.stable_generation(), None);
    assert_eq!(write_gen(&mut w, &k), 2);
    let h = r.wait_newer(1, Some(T)).unwrap();
    assert_eq!(r.switch_stable(h).unwrap().generation, 2);
    check_stable(&r, &k, 2, &bad, r.stream().unwrap());
    r.stream().unwrap().synchronize().unwrap();
    assert_eq!(read_u64(&bad), 0, "in place");
    // Another reader's guard is refused (and released).
    let other = TensorSetReader::open(&c, &name, &ReaderOptions::new()).unwrap();
    let foreign = other.current().unwrap().expect("generation 2");
    assert!(matches!(
        r.switch_stable(foreign),
        Err(Error::InvalidArgument(_))
    ));
    drop(other);
    drop(r);
    w.close(T).unwrap();

    let name = format!("tsstable-b2-{}", std::process::id());
    let opts = TensorSetOptions::new().mode(GenerationMode::Buffered(2));
    let mut w = TensorSetWriter::create(&c, &name, &specs(), &opts).unwrap();
    write_gen(&mut w, &k);
    let r = TensorSetReader::open(&c, &name, &stable).unwrap();
    let p0 = r.stable_ptr(0).unwrap();
    let sw = r.switch_stable(r.current().unwrap().unwrap()).unwrap();
    assert_eq!((sw.generation, sw.remapped), (1, true));
    let sw = r.switch_stable(r.current().unwrap().unwrap()).unwrap();
    assert_eq!(
        (sw.generation, sw.remapped),
        (1, false),
        "the same buffer again"
    );
    check_stable(&r, &k, 1, &bad, r.stream().unwrap());
    for g in 2..=4 {
        assert_eq!(write_gen(&mut w, &k), g);
        let sw = r
            .switch_stable(r.wait_newer(g - 1, Some(T)).unwrap())
            .unwrap();
        assert_eq!((sw.generation, sw.remapped), (g, true));
        check_stable(&r, &k, g, &bad, r.stream().unwrap());
    }
    assert!(r.release_stable().unwrap());
    assert!(!r.release_stable().unwrap());
    // Both buffers are free for the writer now.
    assert_eq!(write_gen(&mut w, &k), 5);
    assert_eq!(write_gen(&mut w, &k), 6);
    let sw = r.switch_stable(r.wait_newer(4, Some(T)).unwrap()).unwrap();
    assert_eq!((sw.generation, sw.remapped), (6, true));
    check_stable(&r, &k, 6, &bad, r.stream().unwrap());
    assert_eq!(r.stable_ptr(0).unwrap(), p0);
    r.stream().unwrap().synchronize().unwrap();
    assert_eq!(read_u64(&bad), 0, "buffered");
    drop(r);
    w.close(T).unwrap();

    let name = format!("tsstable-pool-{}", std::process::id());
    let opts = TensorSetOptions::new().memory(MemoryKind::Pool);
    let w = TensorSetWriter::create(&c, &name, &specs(), &opts).unwrap();
    match TensorSetReader::open(&c, &name, &stable) {
        Err(Error::TensorSet(TensorSetError::WrongKind(why))) => assert!(why.contains("VMM")),
        other => panic!("pool set: expected WrongKind, got {other:?}"),
    }
    w.close(T).unwrap();
}
