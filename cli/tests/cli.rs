//! The `cuda-ipc` binary against real registries and channels made here: `ls` output and exit
//! codes, `gc` removing what a dead child left but never what a live process holds, `watch` rates,
//! and `doctor`'s report (without a driver: a plain message and exit status 1).
//!
//! Child processes are this test binary re-executed with `ROLE` set (running [`child`] only:
//! `cli_support`); every segment name is unique to the test and the process, and removed at the
//! end. `gc` over real segments: `cli_gc`.

mod cli_support;
mod common;

use cli_support::*;
use common::{bin, cuda_ipc};
use cuda_ipc::channel::Delivery;
use cuda_ipc::raw::channel::testing::{ControlConsumer, ControlProducer};
use cuda_ipc::registry::inspect as registry_inspect;
use cuda_ipc::registry::{Registry, RegistryOptions};
use serde_json::Value;
use std::time::{Duration, Instant};

/// The child side of the two-process tests ([`cli_support::child_role`]).
#[test]
fn child() {
    cli_support::child_role();
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

    // The path of the channel's segment works too (`cli_names`); the table shows the same.
    let o = cuda_ipc(&["ls", &format!("/dev/shm/cuda-ipc.ch.{name}")]);
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
            &format!("#{held}")
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

/// The tables' hold columns are lists of indices, and read as such: consumer slot 0 holding
/// buffer 0 shows `#0` under `HELD BY CONSUMERS` and `HOLDS BUFFERS` (not a bare `0`, which reads
/// as a count of none), and a buffer nobody holds shows `-`. `--json` keeps its fields: a buffer's
/// `holders` (consumer slot indices) and a consumer's `holds` (buffer indices).
#[test]
fn ls_shows_holds_as_lists_of_indices_not_counts() {
    let name = unique("ls-holds");
    let _u = Unlink(format!("cuda-ipc.ch.{name}"));
    let tx = ControlProducer::create(&name, 4096, 4, &[token(1), token(2)]).unwrap();
    let rx = ControlConsumer::attach(&name, Delivery::EveryFrame).unwrap();
    let (i, _) = tx.try_acquire().unwrap();
    tx.publish(i, b"m").unwrap();
    let (held, _, _) = rx.take(Some(Duration::from_secs(1))).unwrap().unwrap();
    assert_eq!((rx.slot(), held), (0, 0));

    let o = cuda_ipc(&["ls", &name]);
    let t = text(&o);
    assert_eq!(code(&o), 0, "{t}");
    let lines: Vec<&str> = t.lines().collect();
    let head = |h: &str| lines.iter().position(|l| l.contains(h)).expect(&t);
    let b = head("HELD BY CONSUMERS");
    let cols = |l: &str| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();
    // BUFFER STATE SEQ HELD-BY ...: buffer 0 held by consumer slot 0, buffer 1 by nobody.
    assert_eq!(cols(lines[b + 1])[..4], ["0", "frame", "1", "#0"], "{t}");
    assert_eq!(cols(lines[b + 2])[..4], ["1", "empty", "-", "-"], "{t}");
    let c = head("HOLDS BUFFERS");
    assert_eq!(cols(lines[c + 1]).last().unwrap(), "#0", "{t}");

    let v = json(&cuda_ipc(&["ls", &name, "--json"]));
    let ch = &v["channels"][0];
    assert_eq!(ch["buffers"][0]["holders"], serde_json::json!([0]), "{v}");
    assert_eq!(ch["buffers"][1]["holders"], serde_json::json!([]), "{v}");
    assert_eq!(ch["consumers"][0]["holds"], serde_json::json!([0]), "{v}");
    rx.release(held);
    drop(rx);
    tx.unlink();
}

/// A pool of one buffer that its producer waits for while a consumer holds the frame is reserved
/// (docs/channel-layout.md): `ls` says `reserved`, held by that consumer, not `writing`; once the
/// hold ends the producer has it, and it is a frame again after the publish.
#[test]
fn ls_shows_a_one_buffer_pool_reserved_while_its_producer_waits_for_a_hold() {
    let name = unique("ls-reserved");
    let _u = Unlink(format!("cuda-ipc.ch.{name}"));
    let tx = ControlProducer::create(&name, 4096, 4, &[token(1)]).unwrap();
    let rx = ControlConsumer::attach(&name, Delivery::LatestOnly).unwrap();
    let (i, _) = tx.try_acquire().unwrap();
    tx.publish(i, b"m").unwrap();
    let (held, _, _) = rx.take(Some(Duration::from_secs(1))).unwrap().unwrap();
    std::thread::scope(|s| {
        let waiting = s.spawn(|| tx.acquire(Some(Duration::from_secs(20))));
        let deadline = Instant::now() + Duration::from_secs(10);
        let row = loop {
            let o = cuda_ipc(&["ls", &name]);
            let t = text(&o);
            let row = t
                .lines()
                .skip_while(|l| !l.contains("HELD BY CONSUMERS"))
                .nth(1)
                .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
                .unwrap_or_default();
            if row.get(1).map(String::as_str) == Some("reserved") || Instant::now() > deadline {
                break row;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(row[..4], ["0", "reserved", "-", "#0"], "{row:?}");
        rx.release(held);
        let (j, _) = waiting
            .join()
            .unwrap()
            .unwrap()
            .expect("the buffer once the hold ended");
        tx.publish(j, b"n").unwrap();
    });
    let t = text(&cuda_ipc(&["ls", &name]));
    assert!(
        t.lines()
            .any(|l| l.split_whitespace().take(4).eq(["0", "frame", "2", "-"])),
        "{t}"
    );
    drop(rx);
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

/// A NAME that no segment can bear (the library's rule for segment names, of an own name or of
/// FILE in `/dev/shm/FILE`, and for `hold` its rule for set names and its sets' files) is a usage
/// error for every subcommand that takes one: exit status 2 and what is wrong with it (`invalid
/// name`, its length, or for `hold` a path of no set's file), never a `cannot read` or `not found`
/// of a registry by that name.
#[test]
fn every_subcommand_that_takes_a_name_calls_an_invalid_one_a_usage_error_and_exits_2() {
    let long = "x".repeat(201);
    let long_set = "x".repeat(cuda_ipc::channel::MAX_CHANNEL_NAME + 1);
    let bad = [
        "",
        ".",
        "..",
        "a/b",
        "/x",
        "x y",
        long.as_str(),
        "/dev/shm/",
        "/dev/shm/a/b",
        "/dev/shm/..",
    ];
    let forms: [&[&str]; 8] = [
        &["ls"],
        &["ls", "--json"],
        &["watch", "--count", "1"],
        &["watch", "--json", "--count", "1"],
        &["metrics", "--listen", "127.0.0.1:0"],
        &["gc"],
        &["gc", "--dry-run", "--json"],
        &["hold"],
    ];
    for form in forms {
        let mut names = bad.to_vec();
        if form == ["hold"] {
            names.extend([
                long_set.as_str(),
                "/dev/shm/cuda-ipc.ts.",
                "/dev/shm/cuda-ipc.ch.x",
            ]);
        }
        for name in names {
            let args: Vec<&str> = form.iter().copied().chain([name]).collect();
            let o = cuda_ipc_bounded(&args, false);
            let t = text(&o);
            assert_eq!(code(&o), 2, "{args:?}: {t}");
            assert!(
                t.contains("invalid name")
                    || t.contains("at most")
                    || t.contains("is no file of a tensor set"),
                "{args:?}: {t}"
            );
            assert!(
                !t.contains("cannot read") && !t.contains("no registry"),
                "{args:?}: {t}"
            );
        }
    }
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

#[test]
fn doctor_fails_a_dev_shm_where_nothing_can_be_created_however_much_room_it_has() {
    // A read-only tmpfs on /dev/shm (in a mount namespace of its own): free space says nothing
    // of it, and every channel, set or ledger creation there fails with EROFS.
    let script = format!(
        "mount -t tmpfs -o ro,mode=1777 tmpfs /dev/shm && exec {} doctor",
        bin().display()
    );
    let o = std::process::Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &script])
        .output()
        .unwrap();
    let t = text(&o);
    if t.contains("unshare failed") || t.contains("mount: ") {
        println!("skipped: a mount namespace with its own /dev/shm needs root: {t}");
        return;
    }
    let line = t
        .lines()
        .find(|l| l.contains("/dev/shm"))
        .unwrap_or_else(|| panic!("no /dev/shm line: {t}"));
    assert!(
        line.starts_with("FAIL") && line.contains("nothing can be created there"),
        "{t}"
    );
    assert!(line.contains("Read-only file system"), "{t}");
    assert_eq!(code(&o), 1, "{t}");
}
