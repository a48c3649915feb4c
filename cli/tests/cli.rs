//! The `cuda-ipc` binary against real registries and channels made here: `ls` output and exit
//! codes, `gc` removing what a dead child left but never what a live process holds, `watch` rates,
//! and `doctor`'s report (without a driver: a plain message and exit status 1).
//!
//! Child processes are this test binary re-executed with [`ROLE`] set (running [`child`] only);
//! every segment name is unique to the test and the process, and removed at the end.

mod common;
use common::{bin, cuda_ipc};
use cuda_ipc::channel::Delivery;
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::raw::channel::testing::{ControlConsumer, ControlProducer};
use cuda_ipc::raw::shm::{Segment, SegmentOptions};
use cuda_ipc::registry::inspect as registry_inspect;
use cuda_ipc::registry::{Registry, RegistryOptions};
use cuda_ipc::token::{TOKEN_LEN, Token, TokenKind};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Environment variable naming a child's role (`registry-orphan`, `registry-live`,
/// `channel-orphan`, `channel-consumer-orphan`) and the segment it works on (`CUDA_IPC_CLI_TEST_NAME`).
const ROLE: &str = "CUDA_IPC_CLI_TEST_ROLE";
const NAME: &str = "CUDA_IPC_CLI_TEST_NAME";

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exited, not killed")
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(o)))
}

/// A name unique to this test and process.
fn unique(tag: &str) -> String {
    format!("cuda-ipc-cli-test-{tag}-{}", std::process::id())
}

/// Removes a segment when dropped, so a failing test leaves nothing behind.
struct Unlink(String);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = Segment::unlink(&self.0);
    }
}

fn token(i: u8) -> [u8; TOKEN_LEN] {
    Token {
        kind: TokenKind::LegacyMemory,
        handle: [i; 64],
        offset: 0,
        len: 1 << 20,
        device: cuda_ipc::driver::Uuid([0xab; 16]),
        export_id: 0,
        exporter: ProcessIdentity::current().unwrap(),
    }
    .to_bytes()
}

/// A child running one role; waits for its `ready` line.
struct ChildRole(Child);

impl ChildRole {
    fn start(role: &str, name: &str) -> ChildRole {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["child", "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env(NAME, name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child");
        let out = child.stdout.take().unwrap();
        let mut lines = BufReader::new(out).lines();
        loop {
            match lines.next() {
                Some(Ok(l)) if l.ends_with("@@ ready") => break,
                Some(Ok(_)) => continue,
                _ => panic!("child {role} ended before it was ready"),
            }
        }
        ChildRole(child)
    }

    /// Waits for a child that exits by itself.
    fn wait(mut self) {
        let st = self.0.wait().unwrap();
        assert!(st.success(), "child failed: {st}");
    }

    /// Kills a child that waits (SIGKILL) and reaps it.
    fn kill(mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for ChildRole {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The child side of the two-process tests. Run without [`ROLE`] (as in every test run) it has
/// nothing to do.
#[test]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let name = std::env::var(NAME).unwrap();
    match role.as_str() {
        // Joins the registry, publishes, and exits without leaving (like a crash).
        "registry-orphan" => {
            let reg = Registry::open(&name, &RegistryOptions::new()).unwrap();
            reg.publish("orphan", 7, b"token of the dead", b"meta")
                .unwrap();
            println!("@@ ready");
            std::mem::forget(reg);
            std::process::exit(0);
        }
        // Joins, publishes, and stays until killed.
        "registry-live" => {
            let reg = Registry::open(&name, &RegistryOptions::new()).unwrap();
            reg.publish("keeper", 8, b"token of the living", b"")
                .unwrap();
            println!("@@ ready");
            std::thread::sleep(Duration::from_secs(120));
            drop(reg);
        }
        // Creates a channel, publishes one frame, and exits without closing it.
        "channel-orphan" => {
            let tx = ControlProducer::create(&name, 1 << 20, 4, &[token(1)]).unwrap();
            let (i, _) = tx.try_acquire().unwrap();
            tx.publish(i, b"last words").unwrap();
            println!("@@ ready");
            std::process::exit(0);
        }
        // Creates a host-memory channel (its pool a segment of its own), publishes one frame,
        // and exits without closing it.
        "host-channel-orphan" => {
            let opts = cuda_ipc::channel::ChannelOptions::new(4096).buffers(2);
            let mut tx = cuda_ipc::channel::Producer::create_host(&name, &opts).unwrap();
            tx.acquire(None).unwrap().publish(b"last words").unwrap();
            println!("@@ ready");
            std::process::exit(0);
        }
        // Attaches to a channel, takes the next frame (holding its buffer), and exits without
        // releasing or detaching.
        "channel-consumer-orphan" => {
            let rx = ControlConsumer::attach(&name, Delivery::EveryFrame).unwrap();
            println!("@@ ready");
            // Nothing more on stdout: the parent stopped reading it.
            rx.take(Some(Duration::from_secs(10))).unwrap().unwrap();
            std::process::exit(0);
        }
        // Creates a channel, publishes one frame, and stays until killed.
        "channel-live" => {
            let tx = ControlProducer::create(&name, 1 << 20, 4, &[token(1)]).unwrap();
            let (i, _) = tx.try_acquire().unwrap();
            tx.publish(i, b"alive").unwrap();
            // And an fd on offer, as a VMM producer has: its server socket is left by a kill.
            let memfd =
                rustix::fs::memfd_create("gc-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
            let export = cuda_ipc::ipc::fdpass::FdExport::new(memfd).unwrap();
            println!("@@ ready");
            std::thread::sleep(Duration::from_secs(120));
            drop((tx, export));
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn help_documents_exit_codes_and_usage_errors_exit_2() {
    let o = cuda_ipc(&["--help"]);
    assert_eq!(code(&o), 0);
    let t = text(&o);
    for want in [
        "doctor",
        "ls",
        "watch",
        "gc",
        "Exit status",
        "0  ok",
        "2  usage error",
    ] {
        assert!(t.contains(want), "{want:?} missing from: {t}");
    }
    assert!(text(&cuda_ipc(&["gc", "--help"])).contains("Exit status"));
    assert_eq!(code(&cuda_ipc(&[])), 2);
    assert_eq!(code(&cuda_ipc(&["frobnicate"])), 2);
    assert_eq!(code(&cuda_ipc(&["watch", "--interval", "soon"])), 2);
    assert_eq!(code(&cuda_ipc(&["ls", "--bogus"])), 2);
}

#[test]
fn ls_shows_a_registry_with_records_sequence_numbers_owners_and_sizes() {
    let name = unique("ls-reg");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &RegistryOptions::new().capacity(8)).unwrap();
    let s1 = reg.publish("camera/0", 3, &[1; 144], b"1920x1080").unwrap();
    let s2 = reg.publish("tensor", 4, &[2; 10], b"").unwrap();
    let me = std::process::id();

    let o = cuda_ipc(&["ls", &name]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(
        t.contains(&format!("registry {name}: 2 of 8 slots used")),
        "{t}"
    );
    let row = t.lines().find(|l| l.contains("camera/0")).expect(&t);
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        cols[..5],
        ["camera/0", "3", &s1.to_string(), &me.to_string(), "alive"],
        "{t}"
    );
    assert!(row.contains("144 B") && row.contains("9 B"), "{row}");
    assert!(t.contains(&format!("participants: {me} alive")), "{t}");

    let v = json(&cuda_ipc(&["ls", &name, "--json"]));
    let r = &v["registries"][0];
    assert_eq!(r["name"], name.as_str());
    assert_eq!(r["capacity"], 8);
    assert_eq!(r["last_seq"], s2);
    assert_eq!(r["leftovers"], false);
    let recs = r["records"].as_array().unwrap();
    let tensor = recs.iter().find(|x| x["name"] == "tensor").unwrap();
    assert_eq!(tensor["seq"], s2);
    assert_eq!(tensor["owner_pid"], me);
    assert_eq!(tensor["owner"], "alive");
    assert_eq!(tensor["token_bytes"], 10);
    assert_eq!(v["channels"].as_array().unwrap().len(), 0);

    // Listing everything includes it; listing joined nothing.
    let all = cuda_ipc(&["ls"]);
    assert!(text(&all).contains(&format!("registry {name}:")));
    assert_eq!(
        registry_inspect::inspect(&name).unwrap().participants.len(),
        1
    );
}

#[test]
fn ls_shows_a_channel_with_buffers_consumers_holds_and_cursors() {
    let name = unique("ls-chan");
    let _u = Unlink(format!("cuda-ipc.ch.{name}"));
    let tx = ControlProducer::create(&name, 1 << 20, 4, &[token(1), token(3), token(5)]).unwrap();
    let rx = ControlConsumer::attach(&name, Delivery::EveryFrame).unwrap();
    for k in 0..2u8 {
        let (i, _) = tx.try_acquire().unwrap();
        tx.publish(i, &[k; 12]).unwrap();
    }
    let (held, seq, _) = rx.take(Some(Duration::from_secs(1))).unwrap().unwrap();
    assert_eq!(seq, 1);

    let v = json(&cuda_ipc(&["ls", &name, "--json"]));
    let c = &v["channels"][0];
    assert_eq!(c["name"], name.as_str());
    assert_eq!(c["segment"], format!("cuda-ipc.ch.{name}"));
    assert_eq!(c["producer_pid"], std::process::id());
    assert_eq!(c["producer"], "alive");
    assert_eq!(c["closed"], false);
    assert_eq!(
        (c["head"].as_u64(), c["published"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(c["buffer_bytes"], 1 << 20);
    let bufs = c["buffers"].as_array().unwrap();
    assert_eq!(bufs.len(), 3);
    assert_eq!(bufs[held]["seq"], 1);
    assert_eq!(bufs[held]["holders"], serde_json::json!([rx.slot()]));
    assert_eq!(bufs[held]["bytes"], 1 << 20);
    assert_eq!(bufs[held]["metadata_bytes"], 12);
    assert_eq!(
        bufs[held]["device"],
        "GPU-abababab-abab-abab-abab-abababababab"
    );
    let cons = c["consumers"].as_array().unwrap();
    assert_eq!(cons.len(), 1);
    assert_eq!(cons[0]["delivery"], "every-frame");
    assert_eq!(cons[0]["process"], "alive");
    assert_eq!(
        (
            cons[0]["cursor"].as_u64(),
            cons[0]["lag"].as_u64(),
            cons[0]["received"].as_u64()
        ),
        (Some(1), Some(1), Some(1))
    );
    assert_eq!(cons[0]["holds"], serde_json::json!([held]));

    // The channel's segment name works too; the table shows the same.
    let o = cuda_ipc(&["ls", &format!("cuda-ipc.ch.{name}")]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(
        t.contains(&format!(
            "channel {name}: producer {} alive, open, head 2",
            std::process::id()
        )),
        "{t}"
    );
    assert!(t.contains("3 × 1.0 MiB buffers, 1 of 4 consumers"), "{t}");
    let row = t.lines().find(|l| l.contains("every-frame")).expect(&t);
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        cols,
        [
            &rx.slot().to_string(),
            &std::process::id().to_string(),
            "alive",
            "every-frame",
            "1",
            "1",
            "1",
            "0",
            &held.to_string()
        ],
        "{t}"
    );
    rx.release(held);
    drop(rx);
    tx.close();
    let v = json(&cuda_ipc(&["ls", &name, "--json"]));
    assert_eq!(v["channels"][0]["closed"], true);
    assert_eq!(v["channels"][0]["consumers"].as_array().unwrap().len(), 0);
    tx.unlink();
}

#[test]
fn ls_of_an_unknown_name_fails_with_exit_1_and_says_why() {
    let o = cuda_ipc(&["ls", &unique("nothing-here")]);
    assert_eq!(code(&o), 1);
    assert!(
        text(&o).contains("no registry, channel or tensor set named"),
        "{}",
        text(&o)
    );
    let o = cuda_ipc(&["gc", &unique("nothing-here")]);
    assert_eq!(code(&o), 1);
}

#[test]
fn ls_of_a_name_that_exists_but_is_no_registry_or_channel_says_what_is_wrong() {
    // A file of another program, named like a registry, then like a channel's segment.
    let name = unique("not-a-registry");
    let _u = Unlink(name.clone());
    let _c = Unlink(format!("cuda-ipc.ch.{name}"));
    for seg in [name.clone(), format!("cuda-ipc.ch.{name}")] {
        let path = format!("/dev/shm/{seg}");
        std::fs::write(&path, b"hello").unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        for args in [&["ls", &name][..], &["gc", &name, "--dry-run"]] {
            let o = cuda_ipc(args);
            let t = text(&o);
            assert_eq!(code(&o), 1, "{args:?}: {t}");
            assert!(
                !t.contains("no registry, channel or tensor set named"),
                "{args:?}: {t}"
            );
            assert!(
                t.contains("cannot read") && t.contains("5 bytes"),
                "{args:?}: {t}"
            );
        }
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn gc_removes_a_dead_childs_registry_entries_but_never_a_live_ones() {
    let name = unique("gc-reg");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &RegistryOptions::new().capacity(8)).unwrap();
    reg.publish("mine", 1, b"", b"").unwrap();
    // The living child joins first: `Registry::open` frees dead participants' entries on the way
    // in, so a child joining after the orphan died would leave gc no entry to remove.
    let live = ChildRole::start("registry-live", &name);
    ChildRole::start("registry-orphan", &name).wait();

    // ls flags the leftovers (exit 1) and names the dead owner.
    let o = cuda_ipc(&["ls", &name]);
    let t = text(&o);
    assert_eq!(code(&o), 1, "{t}");
    let orphan = t.lines().find(|l| l.contains("orphan")).expect(&t);
    assert!(orphan.contains("dead"), "{orphan}");
    assert!(
        t.lines()
            .find(|l| l.contains("keeper"))
            .expect(&t)
            .contains("alive")
    );
    assert!(t.contains("cuda-ipc gc"), "{t}");
    let snap = registry_inspect::inspect(&name).unwrap();
    assert_eq!(snap.records.len(), 3);
    assert_eq!(snap.participants.len(), 3);

    // A dry run says what would go and changes nothing.
    let o = cuda_ipc(&["gc", &name, "--dry-run"]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(
        t.contains(&format!("would remove registry {name}: record \"orphan\"")),
        "{t}"
    );
    assert!(t.contains("participant entry"), "{t}");
    assert!(!t.contains("keeper") && !t.contains("\"mine\""), "{t}");
    assert_eq!(registry_inspect::inspect(&name).unwrap(), snap);

    // gc removes the dead child's record and entry, nothing of the living.
    let o = cuda_ipc(&["gc", &name]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(
        t.contains(&format!("removed registry {name}: record \"orphan\"")),
        "{t}"
    );
    assert!(
        t.contains("removed registry") && t.contains("participant entry"),
        "{t}"
    );
    let after = registry_inspect::inspect(&name).unwrap();
    let mut names: Vec<_> = after
        .records
        .iter()
        .map(|r| r.record.name.clone())
        .collect();
    names.sort();
    assert_eq!(names, ["keeper", "mine"]);
    assert_eq!(after.participants.len(), 2, "{after:?}");
    assert!(after.participants.iter().all(|p| !p.dead));
    assert_eq!(code(&cuda_ipc(&["ls", &name])), 0);
    let o = cuda_ipc(&["gc", &name]);
    assert!(text(&o).contains("nothing to remove"), "{}", text(&o));

    // Once killed, the other child's record goes too; ours stays.
    live.kill();
    let o = cuda_ipc(&["gc", &name]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(t.contains("record \"keeper\""), "{t}");
    let after = registry_inspect::inspect(&name).unwrap();
    assert_eq!(after.records.len(), 1);
    assert_eq!(after.records[0].record.name, "mine");
    assert_eq!(after.participants.len(), 1);
    drop(reg);
}

#[test]
fn gc_says_it_removed_a_dead_host_producers_pool_with_its_channel() {
    let dead = unique("gc-host-dead");
    let _u1 = Unlink(format!("cuda-ipc.ch.{dead}"));
    let _u2 = Unlink(format!("cuda-ipc.hp.{dead}"));
    ChildRole::start("host-channel-orphan", &dead).wait();
    let pool = format!("/dev/shm/cuda-ipc.hp.{dead}");
    assert!(std::path::Path::new(&pool).exists());
    let o = cuda_ipc(&["gc", &dead, "--dry-run"]);
    let t = text(&o);
    assert!(t.contains(&format!("would remove channel {dead}")), "{t}");
    assert!(std::path::Path::new(&pool).exists(), "dry run removed it");
    let o = cuda_ipc(&["gc", &dead]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(t.contains(&format!("removed channel {dead}")), "{t}");
    assert!(
        t.contains(&format!(
            "removed host pool {pool} of channel {dead}: its producer"
        )),
        "{t}"
    );
    assert!(!std::path::Path::new(&pool).exists());
}

#[test]
fn gc_removes_a_dead_producers_channel_but_not_a_live_one() {
    let dead = unique("gc-chan-dead");
    let _u1 = Unlink(format!("cuda-ipc.ch.{dead}"));
    let live = unique("gc-chan-live");
    let _u2 = Unlink(format!("cuda-ipc.ch.{live}"));
    ChildRole::start("channel-orphan", &dead).wait();
    let tx = ControlProducer::create(&live, 4096, 2, &[token(1)]).unwrap();

    let o = cuda_ipc(&["ls", &dead]);
    let t = text(&o);
    assert_eq!(code(&o), 1, "{t}");
    assert!(t.contains("dead, open, head 1"), "{t}");
    assert!(t.contains("the producer is dead"), "{t}");

    let o = cuda_ipc(&["gc", &dead, "--dry-run"]);
    assert_eq!(code(&o), 0);
    assert!(
        text(&o).contains(&format!("would remove channel {dead}")),
        "{}",
        text(&o)
    );
    assert!(
        cuda_ipc::channel::inspect::inspect(&dead).is_ok(),
        "dry run removed it"
    );

    let o = cuda_ipc(&["gc", &dead]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(
        t.contains(&format!(
            "removed channel {dead}: segment /dev/shm/cuda-ipc.ch.{dead}"
        )),
        "{t}"
    );
    assert!(
        !cuda_ipc::channel::inspect::list_channels()
            .unwrap()
            .contains(&dead)
    );
    assert_eq!(code(&cuda_ipc(&["ls", &dead])), 1, "gone: not found");

    let o = cuda_ipc(&["gc", &live]);
    assert_eq!(code(&o), 0);
    assert!(text(&o).contains("nothing to remove"), "{}", text(&o));
    assert!(
        cuda_ipc::channel::inspect::inspect(&live).is_ok(),
        "a live producer's channel was removed"
    );
    tx.unlink();
}

#[test]
fn gc_frees_a_dead_consumers_slot_and_holds_on_a_live_producers_channel() {
    let name = unique("gc-consumer");
    let _u = Unlink(format!("cuda-ipc.ch.{name}"));
    let tx = ControlProducer::create(&name, 4096, 4, &[token(1), token(3)]).unwrap();
    let live = ControlConsumer::attach(&name, Delivery::LatestOnly).unwrap();
    let child = ChildRole::start("channel-consumer-orphan", &name);
    let (i, _) = tx.try_acquire().unwrap();
    tx.publish(i, b"").unwrap();
    child.wait();
    // The dead consumer holds frame 1's buffer.
    let v = json(&cuda_ipc(&["ls", &name, "--json"]));
    let cons = v["channels"][0]["consumers"].as_array().unwrap().clone();
    assert_eq!(cons.len(), 2);
    let dead = cons
        .iter()
        .find(|c| c["process"] == "dead")
        .expect("dead consumer listed");
    assert_eq!(dead["holds"], serde_json::json!([i]));
    assert_eq!(v["channels"][0]["leftovers"], true);
    let o = cuda_ipc(&["ls", &name]);
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(
        text(&o).contains("dead consumers are attached"),
        "{}",
        text(&o)
    );

    let o = cuda_ipc(&["gc", &name, "--dry-run"]);
    let t = text(&o);
    assert!(
        t.contains(&format!("would remove channel {name}: consumer slot")),
        "{t}"
    );
    assert_eq!(inspect_consumers(&name), 2, "dry run changed the channel");

    let o = cuda_ipc(&["gc", &name]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert!(
        t.contains(&format!(
            "removed channel {name}: consumer slot {}",
            dead["index"]
        )),
        "{t}"
    );
    assert!(t.contains(&format!("holds on buffers [{i}]")), "{t}");
    let s = cuda_ipc::channel::inspect::inspect(&name).unwrap();
    assert_eq!(s.consumers.len(), 1, "the live consumer stays");
    assert_eq!(s.consumers[0].index, live.slot());
    assert_eq!(s.forced_releases, 1);
    assert!(s.buffers.iter().all(|b| b.hold_mask == 0));
    assert_eq!(code(&cuda_ipc(&["ls", &name])), 0);
    drop(live);
    tx.unlink();
}

fn inspect_consumers(name: &str) -> usize {
    cuda_ipc::channel::inspect::inspect(name)
        .unwrap()
        .consumers
        .len()
}

#[test]
fn a_corrupt_channel_segment_is_reported_and_never_removed() {
    let name = unique("corrupt");
    let seg_name = format!("cuda-ipc.ch.{name}");
    let _u = Unlink(seg_name.clone());
    drop(Segment::create(&seg_name, 100, &SegmentOptions::new()).unwrap());
    let o = cuda_ipc(&["ls", &name]);
    let t = text(&o);
    assert_eq!(code(&o), 1, "{t}");
    assert!(t.contains(&format!("channel {name}: cannot read")), "{t}");
    let v = json(&cuda_ipc(&["ls", &name, "--json"]));
    assert!(
        v["errors"][0]["error"]
            .as_str()
            .unwrap()
            .contains("smaller than"),
        "{v}"
    );
    let o = cuda_ipc(&["gc", &name]);
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(
        Segment::open(&seg_name).is_ok(),
        "gc removed a segment it could not read"
    );
}

#[test]
fn watch_refreshes_count_times_with_frame_rates() {
    let name = unique("watch");
    let _u = Unlink(format!("cuda-ipc.ch.{name}"));
    let tx = ControlProducer::create(&name, 4096, 2, &[token(1), token(3)]).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let out = std::thread::scope(|s| {
        s.spawn(|| {
            // No consumer: every publish finds a free buffer at once.
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some((i, _)) = tx.try_acquire() {
                    tx.publish(i, b"").unwrap();
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        let t0 = Instant::now();
        let o = cuda_ipc(&[
            "watch",
            &name,
            "--interval",
            "200",
            "--count",
            "3",
            "--json",
        ]);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(
            t0.elapsed() >= Duration::from_millis(400),
            "refreshes were not spaced"
        );
        o
    });
    assert_eq!(code(&out), 0, "{}", text(&out));
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert!(
        lines[0]["channels"][0]["frames_per_s"].is_null(),
        "no rate before a second refresh"
    );
    let heads: Vec<u64> = lines
        .iter()
        .map(|l| l["channels"][0]["head"].as_u64().unwrap())
        .collect();
    assert!(heads[0] < heads[2], "{heads:?}");
    let rate = lines[2]["channels"][0]["frames_per_s"].as_f64().unwrap();
    assert!(
        rate > 10.0,
        "a producer publishing every few ms shows {rate} frames/s"
    );

    // The table form carries the rate too.
    let o = cuda_ipc(&["watch", &name, "--interval", "50", "--count", "2"]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    assert_eq!(t.matches("refresh ").count(), 2, "{t}");
    assert!(t.contains("frames/s"), "{t}");
    tx.unlink();
}

fn driver_present() -> bool {
    ["/proc/driver/nvidia/version"]
        .iter()
        .any(|p| std::path::Path::new(p).exists())
        || std::env::var_os("CUDA_IPC_TEST_ASSUME_DRIVER").is_some()
}

#[test]
fn doctor_without_a_driver_says_so_plainly_and_exits_1() {
    if driver_present() {
        // With a driver the GPU test below applies; here only check that it runs and reports.
        let o = cuda_ipc(&["doctor"]);
        assert!(text(&o).contains("driver"), "{}", text(&o));
        return;
    }
    let o = cuda_ipc(&["doctor"]);
    let t = text(&o);
    assert_eq!(code(&o), 1, "{t}");
    let first = t.lines().next().unwrap();
    assert!(
        first.starts_with("FAIL") && first.contains("CUDA driver not found"),
        "{t}"
    );
    assert!(first.contains("install the NVIDIA driver"), "{t}");
    // The host checks still run.
    for want in ["WSL", "/dev/shm", "ptrace", "kernel", "problems found"] {
        assert!(t.contains(want), "{want:?} missing: {t}");
    }
    assert!(!t.contains("panicked"), "{t}");
}

#[test]
fn a_closed_stdout_ends_the_command_quietly_with_status_141() {
    // `cuda-ipc doctor | head -c0`: the reader is gone before the command writes (closed before
    // the command even starts, so the outcome does not depend on timing). Close-on-exec, so a child
    // that another test spawns meanwhile does not inherit the read end and keep the pipe open.
    for args in [
        &["doctor"][..],
        &["watch", "--interval", "10", "--count", "3"],
        &["watch", "--json", "--interval", "10", "--count", "3"],
    ] {
        let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        drop(r);
        let o = std::process::Command::new(bin())
            .args(args)
            .stdout(std::process::Stdio::from(w))
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(o.status.code(), Some(141), "{args:?}: {err}");
        assert!(!err.contains("Broken pipe"), "{args:?}: {err}");
    }
}

#[test]
fn watch_count_must_be_at_least_one() {
    let o = cuda_ipc(&["watch", "--count", "0"]);
    assert_eq!(code(&o), 2, "{}", text(&o));
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-test.sh)"]
fn doctor_on_a_gpu_machine_lists_every_gpu_with_its_uuid_and_capabilities() {
    let o = cuda_ipc(&["doctor"]);
    let t = text(&o);
    println!("{t}");
    assert_eq!(code(&o), 0, "{t}");
    // Lines are `STATUS LABEL DETAIL` with the label in columns 6 to 26.
    let label = |l: &str| l.get(6..26).unwrap_or("").trim().to_string();
    let first = t.lines().next().unwrap();
    assert!(first.starts_with("ok") && label(first) == "driver", "{t}");
    let gpus: Vec<&str> = t.lines().filter(|l| label(l).starts_with("GPU ")).collect();
    assert!(!gpus.is_empty(), "{t}");
    assert!(
        gpus.iter()
            .all(|l| l.starts_with("ok") && l.contains(", GPU-")),
        "{t}"
    );
    for want in [
        "IPC memory",
        "IPC events",
        "VMM",
        "POSIX-fd handles",
        "fabric handles",
        "memory pools",
        "compute mode",
        "MIG",
    ] {
        let n = t.lines().filter(|l| label(l) == want).count();
        assert_eq!(n, gpus.len(), "{want}: {t}");
    }
}

/// Runs `cuda-ipc args` (optionally under `unshare --pid --fork --mount-proc`), failing the test
/// when it runs longer than 20 s: a hang is a bug.
fn cuda_ipc_bounded(args: &[&str], other_pid_namespace: bool) -> Output {
    let mut cmd = if other_pid_namespace {
        let mut c = Command::new("unshare");
        c.args(["--pid", "--fork", "--mount-proc"]).arg(bin());
        c
    } else {
        Command::new(bin())
    };
    let mut child = cmd
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run cuda-ipc");
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("cuda-ipc {args:?} hung (killed after 20 s)");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

fn unshare_works() -> bool {
    let ok = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        println!("skipped: `unshare --pid --fork --mount-proc` is not allowed here (needs root)");
    }
    ok
}

/// Something that is not a segment, planted under a name in /dev/shm and removed on drop.
struct Planted(String);

impl Drop for Planted {
    fn drop(&mut self) {
        let p = format!("/dev/shm/{}", self.0);
        let _ = std::fs::remove_dir(&p);
        let _ = std::fs::remove_file(&p);
    }
}

#[test]
fn ls_watch_and_gc_never_hang_on_fifos_directories_links_or_sparse_files_and_keep_them() {
    let base = unique("hostile");
    let fifo = format!("cuda-ipc.ch.{base}-fifo");
    let dir = format!("cuda-ipc.ch.{base}-dir");
    let link = format!("cuda-ipc.ch.{base}-link");
    let sparse = format!("cuda-ipc.ch.{base}-sparse");
    let reg_fifo = format!("{base}-registry-fifo");
    let reg_sparse = format!("{base}-registry-sparse");
    let planted: Vec<Planted> = [&fifo, &dir, &link, &sparse, &reg_fifo, &reg_sparse]
        .iter()
        .map(|n| Planted(n.to_string()))
        .collect();
    let path = |n: &str| format!("/dev/shm/{n}");
    for f in [&fifo, &reg_fifo] {
        let st = Command::new("mkfifo").arg(path(f)).status().unwrap();
        assert!(st.success());
    }
    std::fs::create_dir(path(&dir)).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", path(&link)).unwrap();
    for f in [&sparse, &reg_sparse] {
        std::fs::File::create(path(f))
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
    }
    // Every command, over everything and over each name.
    let mut runs: Vec<Vec<String>> = vec![
        vec!["ls".into()],
        vec!["ls".into(), "--json".into()],
        vec!["watch".into(), "--count".into(), "1".into()],
        vec!["gc".into(), "--dry-run".into()],
        vec!["gc".into()],
    ];
    for n in [&fifo, &dir, &link, &sparse, &reg_fifo, &reg_sparse] {
        runs.push(vec!["ls".into(), n.to_string()]);
        runs.push(vec!["gc".into(), n.to_string()]);
    }
    for args in &runs {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = cuda_ipc_bounded(&a, false);
        // Not a crash: an exit status of ours (0, 1), never a signal.
        assert!(
            matches!(o.status.code(), Some(0 | 1)),
            "{a:?}: {:?}\n{}",
            o.status,
            text(&o)
        );
    }
    // Named, each is reported for what it is.
    let o = cuda_ipc_bounded(&["ls", &fifo], false);
    assert!(text(&o).contains("FIFO"), "{}", text(&o));
    let o = cuda_ipc_bounded(&["ls", &dir], false);
    assert!(text(&o).contains("directory"), "{}", text(&o));
    let o = cuda_ipc_bounded(&["ls", &sparse], false);
    assert!(text(&o).contains("sparse"), "{}", text(&o));
    // And all of it is still there.
    for p in &planted {
        assert!(
            std::fs::symlink_metadata(path(&p.0)).is_ok(),
            "{} was removed",
            p.0
        );
    }
}

#[test]
fn gc_in_any_pid_namespace_keeps_a_live_producers_channel_there_and_removes_it_once_killed() {
    if !unshare_works() {
        return;
    }
    let name = unique("gc-ns");
    let _u = Unlink(format!("cuda-ipc.ch.{name}"));
    // The producer runs in a pid namespace of its own (a container of the same pod).
    let mut producer = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--kill-child"])
        .arg(std::env::current_exe().unwrap())
        .args(["child", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, "channel-live")
        .env(NAME, &name)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let out = producer.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.ends_with("@@ ready") => break,
            Some(Ok(_)) => continue,
            _ => panic!("producer ended before it was ready"),
        }
    }
    let snap = cuda_ipc::channel::inspect::inspect(&name).unwrap();
    assert_ne!(snap.producer.pid_ns, cuda_ipc::identity::own_pid_ns());
    // From here, and from a third namespace: alive, nothing removed.
    for other in [false, true] {
        let o = cuda_ipc_bounded(&["ls", &name], other);
        assert!(text(&o).contains("alive"), "{}", text(&o));
        let o = cuda_ipc_bounded(&["gc", &name], other);
        assert_eq!(code(&o), 0, "{}", text(&o));
        assert!(text(&o).contains("nothing to remove"), "{}", text(&o));
        assert!(cuda_ipc::channel::inspect::inspect(&name).is_ok());
    }
    // Killed (the namespace's init, which takes the producer with it): gc from another namespace
    // removes the segment, and a later gc the killed process's liveness file.
    let wrapper = producer.id();
    let init: u32 = std::fs::read_to_string(format!("/proc/{wrapper}/task/{wrapper}/children"))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        Command::new("kill")
            .args(["-9", &init.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let _ = producer.wait();
    let o = cuda_ipc_bounded(&["gc", &name], true);
    assert!(
        text(&o).contains(&format!("removed channel {name}")),
        "{}",
        text(&o)
    );
    let live_file = format!("/dev/shm/{}", snap.producer.liveness_name());
    assert!(
        std::fs::symlink_metadata(&live_file).is_ok(),
        "left by the kill"
    );
    // Liveness files younger than 5 s are never taken for stale.
    if let Some(rest) = Duration::from_millis(5200).checked_sub(started.elapsed()) {
        std::thread::sleep(rest);
    }
    // The fd server socket the kill left (unless a `gc` of a test running beside this one took it
    // already: it has no age guard, its process being known dead).
    let socket = cuda_ipc::ipc::fdpass::socket_path(&snap.producer);
    let socket_left = std::fs::symlink_metadata(&socket).is_ok();
    let o = cuda_ipc_bounded(&["gc"], false);
    assert!(
        text(&o).contains(&format!("removed liveness file {live_file}")),
        "{}",
        text(&o)
    );
    assert!(
        !socket_left || text(&o).contains(&format!("removed fd server socket {socket}")),
        "{}",
        text(&o)
    );
    assert!(std::fs::symlink_metadata(&live_file).is_err(), "removed");
    assert!(std::fs::symlink_metadata(&socket).is_err(), "removed");
}

#[test]
fn gc_removes_a_channel_creation_abandoned_half_way_once_it_is_two_seconds_old() {
    let name = unique("abandoned");
    let seg = format!("cuda-ipc.ch.{name}");
    let _u = Unlink(seg.clone());
    // What a producer killed between `ftruncate` and `fallocate` leaves: sized, no page backed.
    std::fs::File::create(format!("/dev/shm/{seg}"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    // Young: maybe a producer creating it right now. Reported, kept.
    let o = cuda_ipc_bounded(&["gc", &name], false);
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(text(&o).contains("sparse"), "{}", text(&o));
    assert!(std::fs::symlink_metadata(format!("/dev/shm/{seg}")).is_ok());
    std::thread::sleep(Duration::from_millis(2100));
    let o = cuda_ipc_bounded(&["gc", &name, "--dry-run"], false);
    assert!(
        text(&o).contains(&format!(
            "would remove channel {name}: segment /dev/shm/{seg}: a creation abandoned"
        )),
        "{}",
        text(&o)
    );
    assert!(
        std::fs::symlink_metadata(format!("/dev/shm/{seg}")).is_ok(),
        "dry run"
    );
    let o = cuda_ipc_bounded(&["gc", &name], false);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(
        text(&o).contains(&format!("removed channel {name}: segment /dev/shm/{seg}")),
        "{}",
        text(&o)
    );
    assert!(std::fs::symlink_metadata(format!("/dev/shm/{seg}")).is_err());
}

#[test]
fn ls_and_gc_leave_registries_of_other_users_out_instead_of_failing_on_them() {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to give a registry to another uid");
        return;
    }
    let name = unique("theirs");
    let _u = Unlink(name.clone());
    drop(Registry::create(&name, &RegistryOptions::new().capacity(4)).unwrap());
    let path = format!("/dev/shm/{name}");
    let st = Command::new("chown")
        .args(["54321", &path])
        .status()
        .unwrap();
    assert!(st.success());
    assert!(!registry_inspect::list_registries().unwrap().contains(&name));
    for args in [&["ls"][..], &["gc", "--dry-run"][..]] {
        let o = cuda_ipc_bounded(args, false);
        assert!(!text(&o).contains(&name), "{args:?}: {}", text(&o));
    }
    // Named, it says whose it is.
    let o = cuda_ipc_bounded(&["ls", &name], false);
    assert_eq!(code(&o), 1);
    assert!(text(&o).contains("owned by uid 54321"), "{}", text(&o));
}
