//! GPU tensor sets between a writer and a reader that are each pid 1 of a pid namespace of their
//! own (two containers' main processes): VMM and pool sets deliver every generation intact (each
//! checked on the GPU), VMM mapped read-only; a legacy set is refused at open by the typed error
//! that names the cause and the fix. They need a CUDA GPU and root (`unshare`), and fail without
//! them; `cargo test` lists them as ignored.

mod common;

use common::{Peer, ctx, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::channel::MemoryKind;
use cuda_ipc::raw::kernels::Kernels;
use cuda_ipc::tensorset::{
    DType, GenerationMode, ReaderOptions, TensorSetError, TensorSetOptions, TensorSetReader,
    TensorSetWriter, TensorSpec,
};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const SET: &str = "CUDA_IPC_TEST_SET";
const KIND: &str = "CUDA_IPC_TEST_KIND";
const GENERATIONS: u64 = 50;
const TEST: &str =
    "tensor_sets_between_two_pid_1_processes_of_different_namespaces_work_or_are_refused_by_name";

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed", DType::F32, &[1024, 256]),
        TensorSpec::new("layer.0.w", DType::BF16, &[512, 512]),
        TensorSpec::new("head", DType::F8_E4M3FN, &[4096, 64]),
    ]
}

fn seed(g: u64, t: usize) -> u32 {
    (g as u32).wrapping_mul(16).wrapping_add(t as u32)
}

/// The writer: makes the set, says `created <pid> <pid ns>`, waits for `go` (writes and commits
/// `GENERATIONS` generations, closes, says `written`) or `stop` (closes).
fn write() {
    let name = std::env::var(SET).unwrap();
    let kind = match std::env::var(KIND).unwrap().as_str() {
        "pool" => MemoryKind::Pool,
        "legacy" => MemoryKind::Legacy,
        _ => MemoryKind::Vmm,
    };
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let me = cuda_ipc::identity::ProcessIdentity::current().unwrap();
    let opts = TensorSetOptions::new()
        .memory(kind)
        .mode(GenerationMode::Buffered(2));
    let mut w = match TensorSetWriter::create(&c, &name, &specs(), &opts) {
        Ok(w) => w,
        Err(e) => {
            tell(format!("failed {e}"));
            return;
        }
    };
    tell(format!("created {} {}", me.pid, me.pid_ns));
    let order = common::parent_lines().next().unwrap_or_default();
    if order == "go" {
        let n = w.layout().len();
        for _ in 0..GENERATIONS {
            let u = w.begin(Some(T)).unwrap();
            let g = u.generation();
            for t in 0..n {
                k.fill_pattern(
                    &u.device_tensor(t).unwrap(),
                    seed(g, t),
                    u.stream().unwrap(),
                )
                .unwrap();
            }
            u.commit().unwrap();
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    w.close(T).unwrap();
    tell("written");
}

/// The reader: says `ready <pid> <pid ns> <imports> <read-only>` (or `failed <error>`), then
/// checks every generation it sees until the set closes: `done <seen> <last> <bad words>`.
fn read() {
    let name = std::env::var(SET).unwrap();
    let c = ctx();
    let k = Kernels::load(&c).unwrap();
    let bad = zeroed_counter(&c);
    let me = cuda_ipc::identity::ProcessIdentity::current().unwrap();
    let r = match TensorSetReader::open(&c, &name, &ReaderOptions::new()) {
        Ok(r) => r,
        Err(e) => {
            tell(format!("failed {e}"));
            return;
        }
    };
    tell(format!(
        "ready {} {} {} {}",
        me.pid,
        me.pid_ns,
        r.imports(),
        r.is_read_only()
    ));
    let n = r.layout().len();
    let (mut seen, mut last) = (0u64, 0u64);
    loop {
        let h = match r.wait_newer(last, Some(T)) {
            Ok(h) => h,
            Err(Error::TensorSet(TensorSetError::Closed(_))) => break,
            Err(e) => {
                tell(format!("failed {e}"));
                return;
            }
        };
        let s = h.stream().unwrap();
        for t in 0..n {
            k.check_pattern(
                &h.device_tensor(t).unwrap(),
                seed(h.generation(), t),
                &bad,
                s,
            )
            .unwrap();
        }
        last = h.generation();
        seen += 1;
    }
    r.stream().unwrap().synchronize().unwrap();
    tell(format!("done {seen} {last} {}", read_u64(&bad)));
}

#[test]
#[ignore = "needs a CUDA GPU and root (scripts/gpu-test.sh)"]
fn tensor_sets_between_two_pid_1_processes_of_different_namespaces_work_or_are_refused_by_name() {
    if let Some(r) = role() {
        return match r.as_str() {
            "writer" => write(),
            _ => read(),
        };
    }
    let wrapper = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"];
    for kind in ["vmm", "pool", "legacy"] {
        let name = format!("ts-ns-{kind}-{}", std::process::id());
        let mut w = Peer::spawn_under(&wrapper, TEST, "writer", &[(SET, &name), (KIND, kind)]);
        let created = w.recv(T);
        let v: Vec<&str> = created.split_whitespace().collect();
        assert_eq!(v[0], "created", "{kind}: {created}");
        assert_eq!(v[1], "1", "{kind}: the writer is pid 1 of its namespace");
        let w_ns = v[2].to_string();
        let mut r = Peer::spawn_under(&wrapper, TEST, "reader", &[(SET, &name)]);
        let first = r.recv(T);
        println!("{kind}: reader says `{first}`");
        if kind == "legacy" {
            w.send("stop");
            assert!(
                first.starts_with("failed")
                    && first.contains("also pid 1")
                    && first.contains("MemoryKind::Vmm"),
                "legacy: {first}"
            );
            w.expect("written", T);
            w.finish(T);
            r.finish(T);
            continue;
        }
        let v: Vec<&str> = first.split_whitespace().collect();
        assert_eq!(v[0], "ready", "{kind}: {first}");
        assert_eq!(v[1], "1", "{kind}: the reader is pid 1 of its namespace");
        assert_ne!(
            v[2], w_ns,
            "{kind}: the two have pid namespaces of their own"
        );
        assert_eq!(v[3], "2", "{kind}: one import per buffer");
        assert_eq!(v[4], (kind == "vmm").to_string(), "{kind}: read-only");
        w.send("go");
        w.expect("written", T);
        w.finish(T);
        let done = r.expect("done", T);
        let d: Vec<u64> = done.split(' ').map(|x| x.parse().unwrap()).collect();
        assert!(d[0] >= 1, "{kind}: saw a generation");
        assert_eq!(d[1], GENERATIONS, "{kind}: the last generation seen");
        assert_eq!(
            d[2], 0,
            "{kind}: every byte of every generation seen intact"
        );
        r.finish(T);
        println!("{kind}: {done}");
    }
}
