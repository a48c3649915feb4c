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
    let k = Kernels::load(rx.context()).unwrap();
    let bad = zeroed_counter(rx.context());
    tell(format!("ready {} {}", me.pid, me.pid_ns));
    let mut n = 0u64;
    loop {
        let f = match rx.recv_timeout(T) {
            Ok(f) => f,
            Err(Error::ChannelClosed) => break,
            Err(e) => {
                tell(format!("failed {e}"));
                return;
            }
        };
        let seed = u64::from_le_bytes(f.metadata()[..8].try_into().unwrap());
        k.check_pattern(f.buffer(), seed as u32, &bad, f.stream())
            .unwrap();
        n += 1;
    }
    rx.stream().synchronize().unwrap();
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
        k.fill_pattern(f.buffer(), i as u32, f.stream()).unwrap();
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
