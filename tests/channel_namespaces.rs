//! The channel's control protocol between processes in different pid namespaces that share
//! /dev/shm (containers of one pod): nobody is taken for dead while alive, a killed producer is
//! noticed within 1 s, a killed consumer's holds are reclaimed, and the gc functions from either
//! side remove only what a killed process left. Runs without a GPU; needs root for `unshare --pid`
//! (CI runs as root); where the kernel refuses new namespaces the tests say so and skip.

mod common;

use common::{Peer, parent_lines, role, tell};
use cuda_ipc::Error;
use cuda_ipc::channel::Delivery;
use cuda_ipc::channel::{inspect, reclaim};
use cuda_ipc::identity::{Liveness, ProcessIdentity};
use cuda_ipc::raw::channel::testing::{ControlConsumer, ControlProducer};
use cuda_ipc::token::TOKEN_LEN;
use std::process::Command;
use std::time::{Duration, Instant};

const ANSWER: Duration = Duration::from_secs(20);
const CHANNEL: &str = "CUDA_IPC_TEST_CHANNEL";

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
        _ => panic!("unknown role {role}"),
    }
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
