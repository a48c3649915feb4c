//! The command line's JSON forms (docs/cli.md): `doctor --json` and `gc --json` print one
//! parseable document with the exit status of their text form; `watch --json` prints, one per
//! line, the same document `ls --json` prints (the same keys, at the top and in each channel).
//!
//! The dead producer of the `gc` test is this test binary re-executed with [`ROLE`] set.

mod common;
use common::cuda_ipc;
use cuda_ipc::raw::channel::testing::ControlProducer;
use cuda_ipc::raw::shm::Segment;
use cuda_ipc::token::{TOKEN_LEN, Token, TokenKind};
use serde_json::Value;
use std::collections::BTreeSet;
use std::process::{Command, Output, Stdio};

const ROLE: &str = "CUDA_IPC_JSON_TEST_ROLE";

fn unique(tag: &str) -> String {
    format!("cuda-ipc-json-test-{tag}-{}", std::process::id())
}

/// Removes a segment when dropped, so a failing test leaves nothing behind.
struct Unlink(String);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = Segment::unlink(&self.0);
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(o)))
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .keys()
        .cloned()
        .collect()
}

fn token(i: u8) -> [u8; TOKEN_LEN] {
    Token {
        kind: TokenKind::LegacyMemory,
        handle: [i; 64],
        offset: 0,
        len: 4096,
        device: cuda_ipc::driver::Uuid([0xab; 16]),
        export_id: 0,
        exporter: cuda_ipc::identity::ProcessIdentity::current().unwrap(),
    }
    .to_bytes()
}

/// The child side: a host-memory channel whose producer exits without closing it.
#[test]
fn child() {
    let Ok(name) = std::env::var(ROLE) else {
        return;
    };
    let opts = cuda_ipc::channel::ChannelOptions::new(4096).buffers(2);
    let mut tx = cuda_ipc::channel::Producer::create_host(&name, &opts).unwrap();
    tx.acquire(None).unwrap().publish(b"last words").unwrap();
    std::process::exit(0);
}

#[test]
fn doctor_json_is_one_document_with_a_status_per_check_and_the_text_forms_exit_status() {
    let o = cuda_ipc(&["doctor", "--json"]);
    let v = json(&o);
    assert_eq!(keys(&v), ["checks", "ok"].map(String::from).into(), "{v}");
    let checks = v["checks"].as_array().unwrap();
    assert!(!checks.is_empty());
    for c in checks {
        assert_eq!(
            keys(c),
            ["check", "detail", "status"].map(String::from).into()
        );
        let s = c["status"].as_str().unwrap();
        assert!(["ok", "warn", "info", "fail"].contains(&s), "{c}");
    }
    let failed = checks.iter().any(|c| c["status"] == "fail");
    assert_eq!(v["ok"], !failed);
    assert_eq!(code(&o), if failed { 1 } else { 0 }, "{}", text(&o));
    // The same checks as the text form, which exits the same way.
    let t = cuda_ipc(&["doctor"]);
    assert_eq!(code(&t), code(&o));
    for c in checks {
        assert!(
            text(&t).contains(c["check"].as_str().unwrap()),
            "{c} missing from the text form"
        );
    }
}

#[test]
fn watch_json_lines_are_the_document_ls_json_prints() {
    let name = unique("same-shape");
    let _u = Unlink(format!("cuda-ipc.ch.{name}"));
    let tx = ControlProducer::create(&name, 4096, 2, &[token(1), token(2)]).unwrap();
    let (i, _) = tx.try_acquire().unwrap();
    tx.publish(i, b"m").unwrap();
    for args in [vec![name.as_str()], vec![]] {
        let mut ls_args = vec!["ls", "--json"];
        ls_args.extend(&args);
        let ls = cuda_ipc(&ls_args);
        let doc = json(&ls);
        let mut w_args = vec!["watch", "--json", "--interval", "20", "--count", "2"];
        w_args.extend(&args);
        let w = cuda_ipc(&w_args);
        assert_eq!(code(&w), code(&ls), "{}", text(&w));
        let lines: Vec<Value> = String::from_utf8_lossy(&w.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("line not JSON ({e}): {l}")))
            .collect();
        assert_eq!(lines.len(), 2, "{}", text(&w));
        for line in &lines {
            assert_eq!(keys(line), keys(&doc), "{args:?}");
            let find = |d: &Value| {
                d["channels"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|c| c["name"] == name.as_str())
                    .cloned()
                    .unwrap_or_else(|| panic!("channel {name} missing: {d}"))
            };
            assert_eq!(keys(&find(line)), keys(&find(&doc)));
            assert_eq!(find(line)["head"], 1);
        }
        // Rates: none in `ls`, nor on the first refresh; measured from the second.
        let ch = |d: &Value| {
            d["channels"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["name"] == name.as_str())
                .unwrap()["frames_per_s"]
                .clone()
        };
        assert!(ch(&doc).is_null() && ch(&lines[0]).is_null());
        assert!(ch(&lines[1]).is_number(), "{}", lines[1]);
        if args.is_empty() {
            assert!(doc.get("gpu").is_some_and(|g| !g.is_null()), "{doc}");
        } else {
            assert!(doc["gpu"].is_null() && doc["quotas"] == serde_json::json!([]));
        }
    }
    tx.unlink();
}

#[test]
fn gc_json_lists_the_leftovers_of_a_dry_run_then_what_it_removed() {
    let dead = unique("gc-dead");
    let _u1 = Unlink(format!("cuda-ipc.ch.{dead}"));
    let _u2 = Unlink(format!("cuda-ipc.hp.{dead}"));
    let st = Command::new(std::env::current_exe().unwrap())
        .args(["child", "--exact", "--test-threads=1"])
        .env(ROLE, &dead)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());

    let o = cuda_ipc(&["gc", &dead, "--dry-run", "--json"]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let v = json(&o);
    let all = [
        "dry_run",
        "kept",
        "leftovers",
        "problems",
        "quota_skipped",
        "removed",
        "skipped",
    ];
    assert_eq!(keys(&v), all.map(String::from).into(), "{v}");
    assert_eq!(v["dry_run"], true);
    // With a NAME of this user's, nothing of other users': only the object named is looked at.
    assert_eq!(v["skipped"], serde_json::json!([]));
    assert_eq!(v["removed"], serde_json::json!([]));
    let left = v["leftovers"].as_array().unwrap();
    let kinds: BTreeSet<&str> = left.iter().map(|l| l["kind"].as_str().unwrap()).collect();
    assert!(
        kinds.contains("channel") && kinds.contains("host_pool"),
        "{v}"
    );
    for l in left {
        assert_eq!(
            keys(l),
            ["kind", "object", "pid", "uid", "what"]
                .map(String::from)
                .into()
        );
    }
    assert!(
        cuda_ipc::channel::inspect::inspect(&dead).is_ok(),
        "dry run removed it"
    );

    let o = cuda_ipc(&["gc", &dead, "--json"]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let v = json(&o);
    assert_eq!(v["dry_run"], false);
    let removed = v["removed"].as_array().unwrap();
    assert!(
        removed
            .iter()
            .any(|l| l["kind"] == "channel" && l["object"] == dead.as_str()),
        "{v}"
    );
    assert_eq!(v["problems"], serde_json::json!([]));
    assert!(cuda_ipc::channel::inspect::inspect(&dead).is_err());

    // Nothing left: empty lists, exit status 0, and still one document.
    let o = cuda_ipc(&["gc", &dead, "--json"]);
    // The name is gone: `gc NAME` fails as `ls NAME` does (exit status 1, on stderr).
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(o.stdout.is_empty(), "{}", text(&o));
}

/// A live writer's set whose generation channel was replaced by a FIFO: `ls` says its
/// generation is not known and why (`gen ?` and a problem line naming the FIFO), and `ls --json`
/// gives the same reason as `channel_problem` (null for a set whose channel reads).
#[test]
fn ls_says_why_a_sets_generation_channel_cannot_be_read() {
    use cuda_ipc::tensorset::{DType, TensorSetOptions, TensorSetWriter, TensorSpec};
    let name = unique("tg-fifo");
    let w = TensorSetWriter::create_host(
        &name,
        &[TensorSpec::new("w", DType::F32, &[4])],
        &TensorSetOptions::new(),
    )
    .unwrap();
    let ok = json(&cuda_ipc(&["ls", "--json", &name]));
    let set = &ok["tensor_sets"][0];
    assert_eq!(set["name"], name.as_str(), "{ok}");
    assert!(set["channel_problem"].is_null(), "{ok}");
    let tg = format!("/dev/shm/cuda-ipc.tg.{name}");
    let away = format!("{tg}.away");
    std::fs::rename(&tg, &away).unwrap();
    let st = Command::new("mkfifo").arg(&tg).status().unwrap();
    assert!(st.success());
    let o = cuda_ipc(&["ls", &name]);
    let t = text(&o);
    let j = json(&cuda_ipc(&["ls", "--json", &name]));
    std::fs::remove_file(&tg).unwrap();
    std::fs::rename(&away, &tg).unwrap();
    assert!(t.contains("gen ?"), "{t}");
    assert!(
        t.contains("generation channel cannot be read") && t.contains("FIFO"),
        "{t}"
    );
    let problem = j["tensor_sets"][0]["channel_problem"]
        .as_str()
        .unwrap_or("");
    assert!(problem.contains("FIFO"), "{j}");
    assert!(j["tensor_sets"][0]["generation"].is_null(), "{j}");
    // A problem: exit status 1, as for a segment that cannot be read.
    assert_eq!(code(&o), 1, "{t}");
    drop(w);
}

/// A live host producer's pool and a live host writer's data segment cut short of their buffers
/// (`truncate`): `ls` says each cannot be used, as a consumer's attach and a reader's open find
/// it (a problem line, `pool_problem` / `data_problem` in `--json`, exit status 1), without
/// reading past the file's end. Before, `ls` showed both as fine (exit status 0) while the attach
/// and the open failed.
#[test]
fn ls_says_a_live_host_channels_pool_or_host_sets_data_cut_short_cannot_be_used() {
    use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
    use cuda_ipc::tensorset::{
        DType, ReaderOptions, TensorSetOptions, TensorSetReader, TensorSetWriter, TensorSpec,
    };
    let ch = unique("hp-short");
    let ts = unique("td-short");
    let tx = Producer::create_host(&ch, &ChannelOptions::new(4096).buffers(2)).unwrap();
    let w = TensorSetWriter::create_host(
        &ts,
        &[TensorSpec::new("w", DType::F32, &[4])],
        &TensorSetOptions::new(),
    )
    .unwrap();
    let before = [
        json(&cuda_ipc(&["ls", "--json", &ch])),
        json(&cuda_ipc(&["ls", "--json", &ts])),
    ];
    assert!(
        before[0]["channels"][0]["pool_problem"].is_null(),
        "{}",
        before[0]
    );
    assert!(
        before[1]["tensor_sets"][0]["data_problem"].is_null(),
        "{}",
        before[1]
    );
    assert_eq!(code(&cuda_ipc(&["ls", &ch])), 0);
    assert_eq!(code(&cuda_ipc(&["ls", &ts])), 0);
    // Cut short by hand (`truncate -s 4096`), then given its length back before the writer and
    // producer go (they map the whole of it).
    let files = [
        format!("/dev/shm/cuda-ipc.hp.{ch}"),
        format!("/dev/shm/cuda-ipc.td.{ts}"),
    ];
    let lens: Vec<u64> = files
        .iter()
        .map(|f| std::fs::metadata(f).unwrap().len())
        .collect();
    let set_len = |f: &str, n: u64| {
        std::fs::OpenOptions::new()
            .write(true)
            .open(f)
            .unwrap()
            .set_len(n)
            .unwrap()
    };
    for f in &files {
        set_len(f, 4096);
    }
    let attach = Consumer::attach(&ch, &ConsumerOptions::default())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    let open = TensorSetReader::open_host(&ts, &ReaderOptions::default())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    let (ls_ch, ls_ts) = (cuda_ipc(&["ls", &ch]), cuda_ipc(&["ls", &ts]));
    let (j_ch, j_ts) = (
        json(&cuda_ipc(&["ls", "--json", &ch])),
        json(&cuda_ipc(&["ls", "--json", &ts])),
    );
    for (f, n) in files.iter().zip(&lens) {
        set_len(f, *n);
    }
    let (t_ch, t_ts) = (text(&ls_ch), text(&ls_ts));
    assert_eq!(code(&ls_ch), 1, "{t_ch}");
    assert_eq!(code(&ls_ts), 1, "{t_ts}");
    assert!(
        t_ch.contains(&format!("problem: its host pool cannot be used ({attach})")),
        "attach: {attach}\n{t_ch}"
    );
    assert!(attach.contains("truncated"), "{attach}");
    assert!(
        t_ts.contains(&format!(
            "problem: its host data segment cannot be used ({open})"
        )),
        "open: {open}\n{t_ts}"
    );
    assert_eq!(
        j_ch["channels"][0]["pool_problem"],
        attach.as_str(),
        "{j_ch}"
    );
    assert_eq!(
        j_ts["tensor_sets"][0]["data_problem"],
        open.as_str(),
        "{j_ts}"
    );
    drop(w);
    drop(tx);
}
