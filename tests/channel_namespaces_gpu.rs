//! GPU channels between a producer and a consumer in different pid namespaces (and, for the fd
//! based kinds, different network namespaces), as containers of one pod run them: every frame
//! checked on the GPU. They need a CUDA GPU and root (`unshare`), and fail without them; `cargo
//! test` lists them as ignored.

mod common;

use common::{Peer, ctx, read_u64, role, tell, zeroed_counter};
use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, MemoryKind, Producer};
use cuda_ipc::raw::kernels::Kernels;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const FRAMES: u64 = 2000;
const CHANNEL: &str = "CUDA_IPC_TEST_CHANNEL";

/// Runs `test` as `role` under `unshare` with the given namespace flags.
fn spawn_in(namespaces: &[&str], test: &str, role: &str, channel: &str) -> Peer {
    let mut wrapper = vec!["unshare"];
    wrapper.extend_from_slice(namespaces);
    wrapper.extend_from_slice(&["--fork", "--mount-proc", "--kill-child"]);
    Peer::spawn_under(&wrapper, test, role, &[(CHANNEL, channel)])
}

/// The consumer: every frame checked against the pattern its metadata names; reports
/// `done <frames> <mismatched words>` or `failed <error>`.
fn consume() {
    let me = cuda_ipc::identity::ProcessIdentity::current().unwrap();
    let rx = match Consumer::attach(&std::env::var(CHANNEL).unwrap(), &ConsumerOptions::new()) {
        Ok(rx) => rx,
        Err(e) => {
            tell(format!("failed {e}"));
            return;
        }
    };
    let k = Kernels::load(rx.context().unwrap()).unwrap();
    let bad = zeroed_counter(rx.context().unwrap());
    tell(format!("ready {} {}", me.pid, me.pid_ns));
    let mut n = 0u64;
    loop {
        let f = match rx.recv_timeout(T) {
            Ok(f) => f,
            Err(Error::Channel(cuda_ipc::channel::ChannelError::Closed)) => break,
            Err(e) => {
                tell(format!("failed {e}"));
                return;
            }
        };
        let seed = u64::from_le_bytes(f.metadata()[..8].try_into().unwrap());
        k.check_pattern(f.buffer().unwrap(), seed as u32, &bad, f.stream().unwrap())
            .unwrap();
        n += 1;
    }
    rx.stream().unwrap().synchronize().unwrap();
    tell(format!("done {n} {}", read_u64(&bad)));
}

/// Produces `FRAMES` frames of `kind` for a consumer started in `namespaces`; returns the
/// consumer's last line.
fn produce_for(kind: MemoryKind, namespaces: &[&str], test: &str) -> String {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let name = format!("ns-gpu-{kind:?}-{}", std::process::id()).to_lowercase();
    let mut tx = Producer::create(
        &ctx,
        &name,
        &ChannelOptions::new(4 << 20).buffers(4).memory(kind),
    )
    .unwrap();
    let mut c = spawn_in(namespaces, test, "consumer", &name);
    let first = c.recv(T);
    if let Some(e) = first.strip_prefix("failed ") {
        let _ = tx.close(Duration::from_secs(1));
        return format!("failed {e}");
    }
    let w: Vec<&str> = first.split_whitespace().collect();
    assert_eq!(w[0], "ready", "{first}");
    let their_ns: u32 = w[2].parse().unwrap();
    assert_ne!(
        their_ns,
        cuda_ipc::identity::own_pid_ns(),
        "the consumer runs in another pid namespace"
    );
    for i in 0..FRAMES {
        let f = match tx.acquire(Some(T)) {
            Ok(f) => f,
            Err(e) => panic!("{kind:?}: acquire: {e}"),
        };
        k.fill_pattern(f.buffer().unwrap(), i as u32, f.stream().unwrap())
            .unwrap();
        f.publish(&i.to_le_bytes()).unwrap();
    }
    let report = tx.close(T).unwrap();
    let last = c.recv(T);
    c.finish(T);
    println!(
        "{kind:?} across {namespaces:?}: consumer says `{last}`; forced holds {}",
        report.forced_holds
    );
    last
}

const VMM: &str =
    "a_vmm_channel_to_a_consumer_in_other_pid_and_network_namespaces_delivers_every_frame_intact";

#[test]
#[ignore = "needs a CUDA GPU and root (scripts/gpu-test.sh)"]
fn a_vmm_channel_to_a_consumer_in_other_pid_and_network_namespaces_delivers_every_frame_intact() {
    if role().is_some() {
        return consume();
    }
    let last = produce_for(MemoryKind::Vmm, &["--pid", "--net"], VMM);
    assert_eq!(last, format!("done {FRAMES} 0"), "every frame, no mismatch");
}

const POOL: &str =
    "a_pool_channel_to_a_consumer_in_another_pid_namespace_delivers_every_frame_intact";

#[test]
#[ignore = "needs a CUDA GPU and root (scripts/gpu-test.sh)"]
fn a_pool_channel_to_a_consumer_in_another_pid_namespace_delivers_every_frame_intact() {
    if role().is_some() {
        return consume();
    }
    let last = produce_for(MemoryKind::Pool, &["--pid", "--net"], POOL);
    assert_eq!(last, format!("done {FRAMES} 0"), "every frame, no mismatch");
}

const LEGACY: &str = "a_legacy_channel_across_pid_namespaces_works_or_fails_with_a_clear_error";

/// Legacy IPC handles across pid namespaces: what the driver does is recorded, and either every
/// frame arrives intact or the consumer fails at once with an error naming the driver call.
#[test]
#[ignore = "needs a CUDA GPU and root (scripts/gpu-test.sh)"]
fn a_legacy_channel_across_pid_namespaces_works_or_fails_with_a_clear_error() {
    if role().is_some() {
        return consume();
    }
    let last = produce_for(MemoryKind::Legacy, &["--pid"], LEGACY);
    assert!(
        last == format!("done {FRAMES} 0") || (last.starts_with("failed") && last.contains("cu")),
        "{last}"
    );
}

const KIND: &str = "CUDA_IPC_TEST_KIND";
const PAIR_FRAMES: u64 = 1000;

fn kind_named(s: &str) -> MemoryKind {
    match s {
        "auto" => MemoryKind::Auto,
        "vmm" => MemoryKind::Vmm,
        "pool" => MemoryKind::Pool,
        "legacy" => MemoryKind::Legacy,
        other => panic!("unknown kind {other}"),
    }
}

/// The producer of a pair whose two sides each have a pid namespace of their own: makes the
/// channel, says `created <pid> <pid ns> <kind chosen>`, then waits for `go` (fills and publishes
/// `PAIR_FRAMES` frames, closes, says `produced <frames>`) or `stop`.
fn produce_in_own_namespace() {
    let name = std::env::var(CHANNEL).unwrap();
    let kind = kind_named(&std::env::var(KIND).unwrap());
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let me = cuda_ipc::identity::ProcessIdentity::current().unwrap();
    let mut tx = match Producer::create(
        &ctx,
        &name,
        &ChannelOptions::new(4 << 20).buffers(4).memory(kind),
    ) {
        Ok(tx) => tx,
        Err(e) => {
            tell(format!("failed {e}"));
            return;
        }
    };
    tell(format!(
        "created {} {} {:?}",
        me.pid,
        me.pid_ns,
        tx.memory_kind()
    ));
    let order = common::parent_lines().next().unwrap_or_default();
    if order == "go" {
        for i in 0..PAIR_FRAMES {
            let f = tx.acquire(Some(T)).unwrap();
            k.fill_pattern(f.buffer().unwrap(), i as u32, f.stream().unwrap())
                .unwrap();
            f.publish(&i.to_le_bytes()).unwrap();
        }
    }
    tx.close(T).unwrap();
    tell(format!(
        "produced {}",
        if order == "go" { PAIR_FRAMES } else { 0 }
    ));
}

/// Runs a producer of `kind` and a consumer, each under `wrapper` (a new pid namespace, and in it
/// a pid of the wrapper's choosing), `PAIR_FRAMES` frames checked on the GPU; returns the pids
/// each side had, the kind the producer chose and the consumer's last line.
fn pair_in_own_namespaces(wrapper: &[&str], test: &str, kind: &str) -> (u32, u32, String, String) {
    let name = format!("ns-pair-{kind}-{}", std::process::id());
    let mut p = Peer::spawn_under(wrapper, test, "producer", &[(CHANNEL, &name), (KIND, kind)]);
    let created = p.recv(T);
    let w: Vec<&str> = created.split_whitespace().collect();
    assert_eq!(w[0], "created", "{kind}: {created}");
    let (p_pid, p_ns): (u32, u32) = (w[1].parse().unwrap(), w[2].parse().unwrap());
    let chosen = w[3].to_string();
    let mut c = Peer::spawn_under(wrapper, test, "consumer", &[(CHANNEL, &name)]);
    let first = c.recv(T);
    let c_pid = if let Some(rest) = first.strip_prefix("ready ") {
        let w: Vec<&str> = rest.split_whitespace().collect();
        let c_ns: u32 = w[1].parse().unwrap();
        assert_ne!(c_ns, p_ns, "the two sides have pid namespaces of their own");
        p.send("go");
        w[0].parse().unwrap()
    } else {
        p.send("stop");
        p_pid
    };
    let produced = p.recv(T);
    assert!(produced.starts_with("produced"), "{kind}: {produced}");
    p.finish(T);
    let last = if first.starts_with("failed") {
        first
    } else {
        c.recv(T)
    };
    c.finish(T);
    println!("{kind} (chose {chosen}), pids {p_pid} and {c_pid}: consumer says `{last}`");
    (p_pid, c_pid, chosen, last)
}

/// Every memory kind between a producer and a consumer that have the same pid, each in a pid
/// namespace of its own (two containers' main processes): VMM, pool and `Auto` deliver every
/// frame intact and `Auto` chooses VMM; legacy is refused at attach with the typed error naming
/// the cause and the fix.
fn every_kind_between_equal_pids(wrapper: &[&str], test: &str, pid: u32) {
    if let Some(r) = role() {
        return match r.as_str() {
            "producer" => produce_in_own_namespace(),
            _ => consume(),
        };
    }
    for kind in ["auto", "vmm", "pool", "legacy"] {
        let (p_pid, c_pid, chosen, last) = pair_in_own_namespaces(wrapper, test, kind);
        assert_eq!(
            (p_pid, c_pid),
            (pid, pid),
            "{kind}: both sides are pid {pid}"
        );
        if kind == "legacy" {
            assert!(
                last.starts_with("failed")
                    && last.contains(&format!("also pid {pid}"))
                    && last.contains("MemoryKind::Vmm"),
                "legacy: {last}"
            );
        } else {
            assert_eq!(
                last,
                format!("done {PAIR_FRAMES} 0"),
                "{kind}: every frame intact"
            );
        }
        if kind == "auto" {
            assert_eq!(chosen, "Vmm", "auto chooses a kind that works for the pair");
        }
    }
}

const PID1: &str = "every_memory_kind_between_two_pid_1_processes_of_different_namespaces_works_or_is_refused_by_name";

#[test]
#[ignore = "needs a CUDA GPU and root (scripts/gpu-test.sh)"]
fn every_memory_kind_between_two_pid_1_processes_of_different_namespaces_works_or_is_refused_by_name()
 {
    let wrapper = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"];
    every_kind_between_equal_pids(&wrapper, PID1, 1);
}

const PID2: &str = "every_memory_kind_between_two_pid_2_processes_of_different_namespaces_works_or_is_refused_by_name";

#[test]
#[ignore = "needs a CUDA GPU and root (scripts/gpu-test.sh)"]
fn every_memory_kind_between_two_pid_2_processes_of_different_namespaces_works_or_is_refused_by_name()
 {
    // A shell is each namespace's pid 1 and runs the test binary as its first child, pid 2.
    let wrapper = [
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        "--kill-child",
        "sh",
        "-c",
        "\"$@\"; exit $?",
        "sh",
    ];
    every_kind_between_equal_pids(&wrapper, PID2, 2);
}
