//! The channel's control protocol between processes in different pid namespaces that share
//! /dev/shm (containers of one pod): nobody is taken for dead while alive, a killed producer is
//! noticed within 1 s, a killed consumer's holds are reclaimed, and the gc functions from either
//! side remove only what a killed process left. A host channel with a pool of one buffer whose
//! producer (pid 1 of its namespace) reserves the buffer against consumers in another namespace
//! (pid 1 of theirs): the acquire waits for their hold, new holds are turned away meanwhile, and
//! it completes once the hold ends or its holder is killed. Runs without a GPU; needs root for
//! `unshare --pid` (CI runs as root); where the kernel refuses new namespaces the tests say so and
//! skip.

mod common;

use common::{Peer, parent_lines, role, tell};
use cuda_ipc::Error;
use cuda_ipc::channel::Delivery;
use cuda_ipc::channel::inspect::BufferState;
use cuda_ipc::channel::{
    ChannelOptions, Consumer, ConsumerOptions, Frame, Producer, inspect, reclaim,
};
use cuda_ipc::identity::{Liveness, ProcessIdentity};
use cuda_ipc::raw::channel::testing::{ControlConsumer, ControlProducer};
use cuda_ipc::token::TOKEN_LEN;
use std::process::Command;
use std::time::{Duration, Instant};

const ANSWER: Duration = Duration::from_secs(20);
const CHANNEL: &str = "CUDA_IPC_TEST_CHANNEL";
/// A host channel's buffer size.
const BYTES: usize = 4096;
/// How soon a dead consumer's hold is released for a producer waiting on it: its wait checks
/// liveness every 20 ms, and docs/ARCHITECTURE.md promises a killed holder freed "within about
/// 20 ms of its death being seen, well under 1 s".
const DEAD_PEER: Duration = Duration::from_secs(1);

/// Whether this machine lets us make pid namespaces; prints why not.
fn namespaces_work() -> bool {
    match common::unshare_works(&["--pid", "--fork", "--mount-proc"]) {
        Ok(()) => true,
        Err(why) => {
            println!("skipped: {why}");
            false
        }
    }
}

/// Runs `test` of this binary as `role` in a new pid namespace (with its own /proc), sharing
/// /dev/shm with us.
fn spawn_in_new_pid_namespace(test: &str, role: &str, env: &[(&str, &str)]) -> Peer {
    Peer::spawn_under(
        &["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"],
        test,
        role,
        env,
    )
}

/// The pid, in our namespace, of the first process `unshare` (pid `wrapper`) forked: the new
/// namespace's pid 1. Killing it kills the whole namespace.
fn namespace_init(wrapper: u32) -> u32 {
    let t = Instant::now();
    loop {
        let children = std::fs::read_to_string(format!("/proc/{wrapper}/task/{wrapper}/children"))
            .unwrap_or_default();
        if let Some(p) = children.split_whitespace().next() {
            return p.parse().unwrap();
        }
        assert!(t.elapsed() < ANSWER, "unshare forked nothing");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn kill9(pid: u32) {
    let st = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

fn tokens() -> Vec<[u8; TOKEN_LEN]> {
    vec![[0u8; TOKEN_LEN]; 2]
}

fn channel_name(tag: &str) -> String {
    format!("ns-{tag}-{}", std::process::id())
}

/// What `inspect` says of each participant's liveness: (producer, consumers).
fn liveness_seen_here(channel: &str) -> (Liveness, Vec<Liveness>) {
    let s = inspect::inspect(channel).unwrap();
    (
        s.producer_liveness,
        s.consumers.iter().map(|c| c.liveness).collect(),
    )
}

/// Child roles: a producer and a consumer that obey the parent's lines.
fn run_role(role: &str) {
    let channel = std::env::var(CHANNEL).unwrap();
    match role {
        "producer" => {
            let p = ControlProducer::create(&channel, 4096, 4, &tokens()).unwrap();
            let me = ProcessIdentity::current().unwrap();
            tell(format!("ready {} {}", me.pid, me.pid_ns));
            for line in parent_lines() {
                let w: Vec<&str> = line.split_whitespace().collect();
                match w.as_slice() {
                    ["publish", n] => {
                        for k in 0..n.parse::<u32>().unwrap() {
                            let (i, _) = p.acquire(Some(ANSWER)).unwrap().expect("a free buffer");
                            p.publish(i, format!("frame {k}").as_bytes()).unwrap();
                        }
                        tell("published");
                    }
                    ["reclaim"] => tell(format!("reclaimed {}", p.reclaim_dead_consumers())),
                    ["gc"] => tell(gc_here(&channel)),
                    ["quit"] => break,
                    _ => panic!("unknown line {line:?}"),
                }
            }
            p.close();
            p.unlink();
        }
        "consumer" => {
            let c = ControlConsumer::attach(&channel, Delivery::EveryFrame).unwrap();
            let me = ProcessIdentity::current().unwrap();
            tell(format!("attached {} {}", me.pid, me.pid_ns));
            for line in parent_lines() {
                let w: Vec<&str> = line.split_whitespace().collect();
                match w.as_slice() {
                    ["take", n] => {
                        for _ in 0..n.parse::<u32>().unwrap() {
                            let (i, _, _) = c.take(Some(ANSWER)).unwrap().expect("a frame");
                            c.release(i);
                        }
                        tell("took");
                    }
                    ["hold"] => {
                        // Take one frame and keep it: a hold a killed consumer leaves behind.
                        let (i, seq, _) = c.take(Some(ANSWER)).unwrap().expect("a frame");
                        tell(format!("holding {i} {seq}"));
                    }
                    ["gc"] => tell(gc_here(&channel)),
                    ["wait-gone"] => {
                        // Block in take until the producer is found dead.
                        let r = c.take(Some(ANSWER));
                        match r {
                            Err(Error::Channel(
                                cuda_ipc::channel::ChannelError::ProducerGone { .. },
                            )) => tell("gone"),
                            other => tell(format!("unexpected {other:?}")),
                        }
                    }
                    ["quit"] => break,
                    _ => panic!("unknown line {line:?}"),
                }
            }
        }
        "host-producer" => host_producer(&channel),
        "host-consumers" => host_consumers(&channel),
        _ => panic!("unknown role {role}"),
    }
}

/// Byte `k` of frame `seq`.
fn pattern(seq: u64, k: usize) -> u8 {
    (seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ (k as u8).wrapping_mul(31)
}

/// Checks a frame's metadata (its sequence number) and bytes (`pattern`).
fn check_frame(f: &Frame<'_>) {
    assert_eq!(f.metadata(), f.seq().to_le_bytes());
    for (k, b) in f.to_vec().unwrap().iter().enumerate() {
        assert_eq!(*b, pattern(f.seq(), k), "frame {} byte {k}", f.seq());
    }
}

/// The producer of a host channel with a pool of one buffer: on "publish" a frame; on "acquire"
/// an acquire (bounded), said before it starts and once it got the buffer, then the frame
/// written and published in it.
fn host_producer(channel: &str) {
    let mut tx = Producer::create_host(channel, &ChannelOptions::new(BYTES).buffers(1)).unwrap();
    let me = ProcessIdentity::current().unwrap();
    tell(format!("ready {} {}", me.pid, me.pid_ns));
    let mut acquire = |announce: bool| {
        let seq = tx.stats().head + 1;
        if announce {
            tell("acquiring");
        }
        let mut w = match tx.acquire(Some(ANSWER)) {
            Ok(w) => w,
            Err(e) => {
                tell(format!("failed {e}"));
                return;
            }
        };
        if announce {
            tell("acquired");
        }
        let bytes: Vec<u8> = (0..w.len()).map(|k| pattern(seq, k)).collect();
        w.write_at(0, &bytes).unwrap();
        tell(format!(
            "published {}",
            w.publish(&seq.to_le_bytes()).unwrap()
        ));
    };
    for line in parent_lines() {
        match line.as_str() {
            "publish" => acquire(false),
            "acquire" => acquire(true),
            "quit" => break,
            _ => panic!("unknown line {line:?}"),
        }
    }
    tx.close(ANSWER).unwrap();
}

/// Two latest-only consumers of a host channel in one process: `a` holds a frame on "hold" until
/// "release"; `b` tries to take one on "try" (at once, then waiting 100 ms) and takes the next on
/// "take".
fn host_consumers(channel: &str) {
    let opts = ConsumerOptions::new().delivery(Delivery::LatestOnly);
    let a = Consumer::attach(channel, &opts).unwrap();
    let b = Consumer::attach(channel, &opts).unwrap();
    let me = ProcessIdentity::current().unwrap();
    tell(format!("ready {} {}", me.pid, me.pid_ns));
    let mut held = None;
    for line in parent_lines() {
        match line.as_str() {
            "hold" => {
                let f = a.recv_timeout(ANSWER).unwrap();
                check_frame(&f);
                tell(format!("holding {}", f.seq()));
                held = Some(f);
            }
            "try" => {
                let now = match b.try_recv().unwrap() {
                    None => "none".to_string(),
                    Some(f) => format!("frame {}", f.seq()),
                };
                let waiting = match b.recv_timeout(Duration::from_millis(100)) {
                    Err(Error::Timeout { .. }) => "timeout".to_string(),
                    Ok(f) => format!("frame {}", f.seq()),
                    Err(e) => format!("error {e}"),
                };
                tell(format!("tried now={now} waiting={waiting}"));
            }
            "release" => {
                let f = held.take().expect("a frame held");
                check_frame(&f);
                drop(f);
                tell("released");
            }
            "take" => {
                let f = b.recv_timeout(ANSWER).unwrap();
                check_frame(&f);
                let seq = f.seq();
                // Released before it is told: the parent then sees no hold.
                drop(f);
                tell(format!("took {seq}"));
            }
            "quit" => break,
            _ => panic!("unknown line {line:?}"),
        }
    }
}

/// Starts the host channel's producer in a pid namespace of its own and the consumers in
/// another, both as pid 1 there (checked), and attaches a latest-only consumer here (a third
/// namespace); then frame 1 is held by consumer `a` and the producer's acquire is under way.
/// Returns (producer, consumers, the consumer here) once the buffer is reserved. `b` and the
/// consumer here attached before frame 1: they would take it, were it not reserved.
fn reserving_across_namespaces(test: &str, channel: &str) -> (Peer, Peer, Consumer) {
    let env = [(CHANNEL, channel)];
    let mut p = spawn_in_new_pid_namespace(test, "host-producer", &env);
    let ready = p.expect("ready", ANSWER);
    let here = Consumer::attach(
        channel,
        &ConsumerOptions::new().delivery(Delivery::LatestOnly),
    )
    .unwrap();
    let mut c = spawn_in_new_pid_namespace(test, "host-consumers", &env);
    let attached = c.expect("ready", ANSWER);
    let ids = |line: &str| -> (u32, u32) {
        let w: Vec<u32> = line
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        (w[0], w[1])
    };
    let ((p_pid, p_ns), (c_pid, c_ns)) = (ids(&ready), ids(&attached));
    assert_eq!(
        (p_pid, c_pid),
        (1, 1),
        "both sides are pid 1 of their namespace"
    );
    let own = cuda_ipc::identity::own_pid_ns();
    assert!(
        p_ns != c_ns && p_ns != own && c_ns != own,
        "namespaces: producer {p_ns}, consumers {c_ns}, here {own}"
    );
    p.send("publish");
    assert_eq!(p.expect("published", ANSWER), "1");
    c.send("hold");
    assert_eq!(c.expect("holding", ANSWER), "1");
    p.send("acquire");
    p.expect("acquiring", ANSWER);
    // Reserved: WRITING with the hold still there (the claim completes only once no hold is
    // left, so the producer's acquire is still waiting).
    let t = Instant::now();
    loop {
        let b = &inspect::inspect(channel).unwrap().buffers[0];
        let seen = format!("{:?}, hold mask {:#x}", b.state, b.hold_mask);
        if b.state == BufferState::Writing {
            assert_eq!(b.hold_mask.count_ones(), 1, "the hold is kept: {seen}");
            break;
        }
        assert_eq!(b.state, BufferState::Frame(1), "{seen}");
        assert!(t.elapsed() < ANSWER, "never reserved: {seen}");
        std::thread::sleep(Duration::from_millis(1));
    }
    (p, c, here)
}

/// Runs the gc functions on `channel` from this process: what they removed.
fn gc_here(channel: &str) -> String {
    let freed = reclaim::release_dead_consumers(channel).unwrap().len();
    let removed = reclaim::remove_stale(channel).unwrap().is_some();
    format!("gc freed={freed} removed={removed}")
}

#[test]
fn participants_in_other_pid_namespaces_are_alive_until_killed_and_gc_removes_only_their_leftovers()
{
    if let Some(r) = role() {
        return run_role(&r);
    }
    if !namespaces_work() {
        return;
    }
    let test = "participants_in_other_pid_namespaces_are_alive_until_killed_and_gc_removes_only_their_leftovers";
    let channel = channel_name("alive");
    let env = [(CHANNEL, channel.as_str())];
    // Producer in namespace A, consumer in namespace B, this process in a third (the parent's).
    let mut p = spawn_in_new_pid_namespace(test, "producer", &env);
    let ready = p.expect("ready", ANSWER);
    let p_ns: u32 = ready.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_ne!(
        p_ns,
        cuda_ipc::identity::own_pid_ns(),
        "the producer runs in a pid namespace of its own"
    );
    let mut c = spawn_in_new_pid_namespace(test, "consumer", &env);
    let attached = c.expect("attached", ANSWER);
    let c_ns: u32 = attached.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_ne!(c_ns, p_ns);

    // Frames flow both ways across the namespaces (every-frame delivery: back-pressure).
    p.send("publish 20");
    c.send("take 20");
    p.expect("published", ANSWER);
    c.expect("took", ANSWER);

    // Nobody is taken for dead: not by the producer, not by inspection here, not by gc run in
    // either namespace or here.
    p.send("reclaim");
    assert_eq!(p.expect("reclaimed", ANSWER), "0");
    assert_eq!(
        liveness_seen_here(&channel),
        (Liveness::Alive, vec![Liveness::Alive])
    );
    p.send("gc");
    assert_eq!(p.expect("gc", ANSWER), "freed=0 removed=false");
    c.send("gc");
    assert_eq!(c.expect("gc", ANSWER), "freed=0 removed=false");
    assert_eq!(gc_here(&channel), "gc freed=0 removed=false");

    // A consumer killed while holding a frame is reclaimed by the producer in the other namespace.
    let mut c2 = spawn_in_new_pid_namespace(test, "consumer", &env);
    c2.expect("attached", ANSWER);
    p.send("publish 1");
    p.expect("published", ANSWER);
    c.send("take 1");
    c.expect("took", ANSWER);
    c2.send("hold");
    c2.expect("holding", ANSWER);
    kill9(namespace_init(c2.child.id()));
    let _ = c2.child.wait();
    let t = Instant::now();
    loop {
        let (_, consumers) = liveness_seen_here(&channel);
        if consumers.contains(&Liveness::Dead) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(1), "{consumers:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    // gc run in the surviving consumer's namespace frees the dead one's slot and hold, and only it.
    c.send("gc");
    assert_eq!(c.expect("gc", ANSWER), "freed=1 removed=false");
    assert_eq!(
        liveness_seen_here(&channel),
        (Liveness::Alive, vec![Liveness::Alive])
    );

    // The producer killed: the consumer in the other namespace gets ProducerGone within 1 s.
    c.send("wait-gone");
    std::thread::sleep(Duration::from_millis(100));
    let killed = Instant::now();
    kill9(namespace_init(p.child.id()));
    let _ = p.child.wait();
    c.expect("gone", ANSWER);
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(1), "ProducerGone after {took:?}");

    // gc from here removes the dead producer's segment.
    assert_eq!(gc_here(&channel), "gc freed=0 removed=true");
    assert!(matches!(
        inspect::inspect(&channel),
        Err(Error::Channel(cuda_ipc::channel::ChannelError::NotFound(_)))
    ));
    c.send("quit");
    c.finish(ANSWER);
}

#[test]
fn a_consumer_in_another_namespace_of_a_producer_here_is_served_and_reclaimed_when_killed() {
    if let Some(r) = role() {
        return run_role(&r);
    }
    if !namespaces_work() {
        return;
    }
    let test =
        "a_consumer_in_another_namespace_of_a_producer_here_is_served_and_reclaimed_when_killed";
    let channel = channel_name("here");
    let env = [(CHANNEL, channel.as_str())];
    let p = ControlProducer::create(&channel, 4096, 4, &tokens()).unwrap();
    let mut c = spawn_in_new_pid_namespace(test, "consumer", &env);
    c.expect("attached", ANSWER);
    // Two buffers, every-frame: the producer can only run ahead by what the consumer received.
    for k in 0..10u32 {
        if k % 2 == 0 {
            c.send("take 2");
        }
        let (i, _) = p.acquire(Some(ANSWER)).unwrap().expect("buffer");
        p.publish(i, b"x").unwrap();
        if k % 2 == 1 {
            c.expect("took", ANSWER);
        }
    }
    assert_eq!(p.reclaim_dead_consumers(), 0, "alive in its own namespace");
    c.send("hold");
    let (i, _) = p.acquire(Some(ANSWER)).unwrap().expect("buffer");
    p.publish(i, b"held").unwrap();
    c.expect("holding", ANSWER);
    kill9(namespace_init(c.child.id()));
    let _ = c.child.wait();
    // The producer finds its hold free again within its own liveness period.
    let t = Instant::now();
    let mut freed = 0;
    while freed == 0 {
        freed = p.reclaim_dead_consumers();
        assert!(t.elapsed() < Duration::from_secs(1), "never reclaimed");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(freed, 1);
    p.close();
    p.unlink();
}

#[test]
fn a_one_buffer_pool_reserved_across_pid_namespaces_turns_holds_away_until_the_hold_ends() {
    if let Some(r) = role() {
        return run_role(&r);
    }
    if !namespaces_work() {
        return;
    }
    let test =
        "a_one_buffer_pool_reserved_across_pid_namespaces_turns_holds_away_until_the_hold_ends";
    let channel = channel_name("reserve");
    let (mut p, mut c, here) = reserving_across_namespaces(test, &channel);
    // New holds are turned away while the producer waits: from the consumers' namespace (at once
    // and waiting) and from here.
    c.send("try");
    assert_eq!(c.expect("tried", ANSWER), "now=none waiting=timeout");
    assert!(
        here.try_recv().unwrap().is_none(),
        "a take here while reserved"
    );
    // The producer still waits: the buffer is reserved with only `a`'s hold, nobody was taken
    // for dead (both sides are pid 1, in different namespaces), and nothing was forced.
    let snap = inspect::inspect(&channel).unwrap();
    assert_eq!(snap.buffers[0].state, BufferState::Writing);
    assert_eq!(snap.buffers[0].hold_mask.count_ones(), 1);
    assert_eq!(snap.producer_liveness, Liveness::Alive);
    assert_eq!(
        snap.consumers
            .iter()
            .map(|s| s.liveness)
            .collect::<Vec<_>>(),
        vec![Liveness::Alive; 3]
    );
    assert_eq!(snap.forced_releases, 0);
    // The hold ends: the acquire completes, and the frame written then reaches both namespaces.
    let releasing = Instant::now();
    c.send("release");
    c.expect("released", ANSWER);
    p.expect("acquired", ANSWER);
    assert!(
        releasing.elapsed() < Duration::from_secs(1),
        "acquired {:?} after the hold was told to end",
        releasing.elapsed()
    );
    assert_eq!(p.expect("published", ANSWER), "2");
    c.send("take");
    assert_eq!(c.expect("took", ANSWER), "2");
    let f = here.recv_timeout(ANSWER).unwrap();
    assert_eq!(f.seq(), 2);
    check_frame(&f);
    drop(f);
    let snap = inspect::inspect(&channel).unwrap();
    assert_eq!(snap.buffers[0].state, BufferState::Frame(2));
    assert_eq!(snap.buffers[0].hold_mask, 0);
    assert_eq!(snap.forced_releases, 0);
    drop(here);
    c.send("quit");
    c.finish(ANSWER);
    p.send("quit");
    p.finish(ANSWER);
}

#[test]
fn a_holder_killed_in_another_pid_namespace_during_a_reservation_is_released_within_a_second() {
    if let Some(r) = role() {
        return run_role(&r);
    }
    if !namespaces_work() {
        return;
    }
    let test =
        "a_holder_killed_in_another_pid_namespace_during_a_reservation_is_released_within_a_second";
    let channel = channel_name("reserve-kill");
    let (mut p, mut c, here) = reserving_across_namespaces(test, &channel);
    // The holder's namespace killed (its pid 1 and with it everything in it) while the producer
    // waits on its hold.
    let killed = Instant::now();
    kill9(namespace_init(c.child.id()));
    let _ = c.child.wait();
    p.expect("acquired", ANSWER);
    let took = killed.elapsed();
    assert!(
        took < DEAD_PEER,
        "acquired {took:?} after the holder was killed"
    );
    assert_eq!(p.expect("published", ANSWER), "2");
    // The dead consumers' slots were freed and their one hold forced; frame 2 is in the buffer,
    // and reaches the consumer here.
    let snap = inspect::inspect(&channel).unwrap();
    assert_eq!(snap.buffers[0].state, BufferState::Frame(2));
    assert_eq!(snap.buffers[0].hold_mask, 0);
    let left: Vec<_> = snap
        .consumers
        .iter()
        .map(|s| (s.identity.pid, s.liveness))
        .collect();
    assert_eq!(left, vec![(std::process::id(), Liveness::Alive)]);
    assert_eq!(snap.forced_releases, 1);
    assert_eq!(snap.producer_liveness, Liveness::Alive);
    let f = here.recv_timeout(ANSWER).unwrap();
    assert_eq!(f.seq(), 2);
    check_frame(&f);
    drop(f);
    drop(here);
    p.send("quit");
    p.finish(ANSWER);
}
