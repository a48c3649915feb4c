//! The monitoring and quota commands against real host-memory channels and quota ledgers made
//! here: `metrics` scraped over loopback and parsed strictly as OpenMetrics text, `quota set /
//! show / remove` and the budget in `ls`, `watch --plain` (and a non-terminal stdout) giving the
//! line output, hostile ledgers reported, and what is said without NVML.

mod common;
use common::{bin, cuda_ipc};
use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer};
use cuda_ipc::driver::Uuid;
use cuda_ipc::quota::{QuotaLedger, QuotaScope};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "cli-mon-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A device UUID of this test process (never a real GPU's: starts with `fe`).
fn fake_device(tag: u8) -> Uuid {
    let mut d = [0u8; 16];
    d[0] = 0xfe;
    d[1] = tag;
    d[12..].copy_from_slice(&std::process::id().to_le_bytes());
    Uuid(d)
}

/// Removes a ledger's or planted file's name when dropped.
struct Gone(String);
impl Drop for Gone {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.0));
    }
}

/// Kills the child when dropped.
struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTP/1.1 GET over loopback: (status code, headers, body).
fn get(addr: &str, path: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics server");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut all = String::new();
    s.read_to_string(&mut all).unwrap();
    let (head, body) = all.split_once("\r\n\r\n").expect("a header and a body");
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status line");
    (code, head.to_string(), body.to_string())
}

/// A strict reading of the OpenMetrics text format: `# TYPE`, `# HELP`, `# UNIT` lines, sample
/// lines of declared families (`name{labels} value`), and `# EOF` as the last line, once.
/// Returns each sample's value by `name{labels}`, and each family's type.
fn parse_openmetrics(text: &str) -> (BTreeMap<String, f64>, BTreeMap<String, String>) {
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.last(), Some(&"# EOF"), "ends with # EOF:\n{text}");
    assert_eq!(lines.iter().filter(|l| **l == "# EOF").count(), 1);
    let mut types = BTreeMap::new();
    let mut samples = BTreeMap::new();
    for l in &lines[..lines.len() - 1] {
        if let Some(rest) = l.strip_prefix("# ") {
            let mut w = rest.splitn(3, ' ');
            let (kind, name, val) = (w.next().unwrap(), w.next().unwrap(), w.next());
            match kind {
                "TYPE" => {
                    let t = val.unwrap().to_string();
                    assert!(
                        [
                            "counter",
                            "gauge",
                            "histogram",
                            "info",
                            "unknown",
                            "stateset",
                            "summary",
                            "gaugehistogram"
                        ]
                        .contains(&t.as_str()),
                        "type {t}"
                    );
                    assert!(
                        types.insert(name.to_string(), t).is_none(),
                        "one TYPE per family: {name}"
                    );
                }
                "HELP" | "UNIT" => assert!(val.is_some(), "{l}"),
                other => panic!("unknown descriptor {other}: {l}"),
            }
            continue;
        }
        let (series, value) = l
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("a sample: {l}"));
        let v: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("a number: {l}")),
        };
        let name = series.split('{').next().unwrap();
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "a metric name: {name}"
        );
        let labels = &series[name.len()..];
        assert!(
            labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')),
            "labels: {l}"
        );
        let family = ["_total", "_bucket", "_sum", "_count", "_created"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| types.contains_key(*f)))
            .unwrap_or(name);
        assert!(
            types.contains_key(family),
            "sample of an undeclared family: {l}"
        );
        samples.insert(series.to_string(), v);
    }
    (samples, types)
}

#[test]
fn metrics_serves_openmetrics_with_the_channels_counters_and_the_quota_over_loopback() {
    let name = unique("metrics");
    let mut tx = Producer::create_host(&name, &ChannelOptions::new(64).buffers(8)).unwrap();
    let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
    for _ in 0..5 {
        tx.acquire(None).unwrap().publish(b"").unwrap();
    }
    drop(rx.recv().unwrap());
    drop(rx.recv().unwrap());
    let held = rx.recv().unwrap(); // in flight while scraped
    let dev = fake_device(1);
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), dev, 1000).unwrap();
    let _g = Gone(ledger.name().to_string());
    let r = ledger.reserve(300).unwrap();

    let mut child = Command::new(bin())
        .args(["metrics", "--listen", "127.0.0.1:0", &name])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let server = Server(child);
    let addr = first
        .trim()
        .strip_prefix("serving OpenMetrics on http://")
        .and_then(|a| a.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("first line: {first:?}"))
        .to_string();
    assert!(addr.starts_with("127.0.0.1:"), "bound where asked: {addr}");

    let (code, head, body) = get(&addr, "/metrics");
    assert_eq!(code, 200, "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0"),
        "{head}"
    );
    let (m, types) = parse_openmetrics(&body);
    let pid = std::process::id();
    let ch = format!("channel=\"{name}\"");
    let cons = format!("{{channel=\"{name}\",consumer=\"0\",pid=\"{pid}\"}}");
    let at = |k: &str| -> f64 { *m.get(k).unwrap_or_else(|| panic!("no {k} in\n{body}")) };
    assert_eq!(types["cuda_ipc_channel_published"], "counter");
    assert_eq!(
        at(&format!("cuda_ipc_channel_published_total{{{ch}}}")),
        5.0
    );
    assert_eq!(at(&format!("cuda_ipc_channel_head{{{ch}}}")), 5.0);
    assert_eq!(at(&format!("cuda_ipc_channel_consumers{{{ch}}}")), 1.0);
    assert_eq!(at(&format!("cuda_ipc_channel_producer_alive{{{ch}}}")), 1.0);
    assert_eq!(at(&format!("cuda_ipc_consumer_received_total{cons}")), 3.0);
    assert_eq!(at(&format!("cuda_ipc_consumer_dropped_total{cons}")), 0.0);
    assert_eq!(at(&format!("cuda_ipc_consumer_lag{cons}")), 2.0);
    assert_eq!(at(&format!("cuda_ipc_consumer_in_flight{cons}")), 1.0);
    // The histogram: 32 buckets (the last +Inf), a sum and a count per consumer.
    assert_eq!(
        types["cuda_ipc_consumer_handoff_latency_seconds"],
        "histogram"
    );
    let buckets = m
        .keys()
        .filter(|k| {
            k.starts_with("cuda_ipc_consumer_handoff_latency_seconds_bucket{") && k.contains(&name)
        })
        .count();
    assert_eq!(buckets, 32, "{body}");
    let inf = format!(
        "cuda_ipc_consumer_handoff_latency_seconds_bucket{{le=\"+Inf\",channel=\"{name}\",consumer=\"0\",pid=\"{pid}\"}}"
    );
    assert_eq!(
        at(&inf),
        at(&format!(
            "cuda_ipc_consumer_handoff_latency_seconds_count{cons}"
        ))
    );
    // The consumer recorded one hand-off per frame it took.
    assert_eq!(at(&inf), 3.0, "{body}");
    // Quota: the budget and what this process holds.
    let q = format!(
        "{{device=\"{dev}\",scope=\"uid {}\"}}",
        rustix::process::geteuid().as_raw()
    );
    assert_eq!(at(&format!("cuda_ipc_quota_budget_bytes{q}")), 1000.0);
    assert_eq!(at(&format!("cuda_ipc_quota_used_bytes{q}")), 300.0);
    assert_eq!(at(&format!("cuda_ipc_quota_holders{q}")), 1.0);
    // NVML: present or plainly absent.
    let nvml = at("cuda_ipc_nvml_available");
    if nvml == 0.0 {
        assert!(
            !m.keys()
                .any(|k| k.starts_with("cuda_ipc_gpu_memory_used_bytes"))
        );
    }

    // Counters follow the channel between scrapes.
    drop(held);
    tx.acquire(None).unwrap().publish(b"").unwrap();
    drop(r);
    let (_, _, body) = get(&addr, "/metrics");
    let (m, _) = parse_openmetrics(&body);
    assert_eq!(m[&format!("cuda_ipc_channel_published_total{{{ch}}}")], 6.0);
    assert_eq!(m[&format!("cuda_ipc_consumer_in_flight{cons}")], 0.0);
    assert_eq!(m[&format!("cuda_ipc_quota_used_bytes{q}")], 0.0);

    assert_eq!(get(&addr, "/nothing").0, 404);
    drop(server);
    drop(rx);
    tx.close(Duration::from_secs(1)).unwrap();
}

#[test]
fn metrics_says_why_it_cannot_listen() {
    let o = cuda_ipc(&["metrics", "--listen", "not-an-address"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("cannot listen on not-an-address"),
        "{}",
        text(&o)
    );
}

#[test]
fn quota_set_show_and_remove_and_ls_shows_the_budget_with_its_holders() {
    let dev = fake_device(2);
    let scope = QuotaScope::user();
    let _g = Gone(scope.segment_name(dev));
    let uid = rustix::process::geteuid().as_raw();
    let d = dev.to_string();
    let o = cuda_ipc(&["quota", "set", "--device", &d, "--bytes", "1KiB"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains(&format!(
            "set budget for uid {uid} on {d}: 1024 bytes, 1.0 KiB"
        )),
        "{}",
        text(&o)
    );
    let ledger = QuotaLedger::open(scope, dev).unwrap();
    let r = ledger.reserve(300).unwrap();
    let o = cuda_ipc(&["ls"]);
    let t = text(&o);
    assert!(
        t.contains(&format!(
            "quota uid {uid} on {d}: 300 B of 1.0 KiB used (29%), 1 holders"
        )),
        "{t}"
    );
    assert!(
        t.contains(&format!("pid {} (uid {uid}", std::process::id()))
            && t.contains("holds 300 B, alive"),
        "{t}"
    );
    let o = cuda_ipc(&["quota", "show", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mine = v["ledgers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["device"] == d.as_str())
        .expect("our ledger");
    assert_eq!(mine["budget"], 1024);
    assert_eq!(mine["used"], 300);
    assert_eq!(mine["holders"][0]["bytes"], 300);
    let o = cuda_ipc(&["ls", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["quotas"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["device"] == d.as_str())
    );
    // `watch --plain` shows the budget's line as `ls` does.
    let o = cuda_ipc(&["watch", "--plain", "--count", "1"]);
    assert!(
        text(&o).contains(&format!(
            "quota uid {uid} on {d}: 300 B of 1.0 KiB used (29%), 1 holders"
        )),
        "{}",
        text(&o)
    );
    // Over the budget from the command line's point of view: the library refuses, naming us.
    let e = ledger.reserve(800).unwrap_err().to_string();
    assert!(
        e.contains("over quota") && e.contains("holds 300 bytes"),
        "{e}"
    );
    drop(r);
    // A size that is no size is a usage error.
    let o = cuda_ipc(&["quota", "set", "--device", &d, "--bytes", "8 parsecs"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let o = cuda_ipc(&["quota", "set", "--device", "gpu0", "--bytes", "1G"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("`host`, or `all`"), "{}", text(&o));
    // Removed while a reservation is held: said, with what it means.
    let held = ledger.reserve(200).unwrap();
    let o = cuda_ipc(&["quota", "remove", "--device", &d]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains("note: 1 reservations (200 B) are forgotten with the ledger"),
        "{}",
        text(&o)
    );
    assert!(std::fs::metadata(format!("/dev/shm/{}", scope.segment_name(dev))).is_err());
    drop(held);

    // A garbage file under a ledger's name: reported by ls and quota show (exit 1), kept.
    let bad = scope.segment_name(fake_device(3));
    let _b = Gone(bad.clone());
    common::write_segment(&bad, &[0x5a; 4096 + 256 * 64]);
    for args in [&["ls"][..], &["quota", "show"]] {
        let o = cuda_ipc(args);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {t}");
        assert!(
            t.contains(&format!(
                "quota ledger {bad}: cannot read: {bad} is not a usable quota ledger"
            )),
            "{args:?}: {t}"
        );
    }
    assert!(std::fs::metadata(format!("/dev/shm/{bad}")).is_ok(), "kept");
}

#[test]
fn watch_plain_and_a_non_terminal_stdout_give_the_same_lines() {
    let name = unique("plain");
    let tx = Producer::create_host(&name, &ChannelOptions::new(64).buffers(2)).unwrap();
    let a = cuda_ipc(&["watch", &name, "--interval", "20", "--count", "2"]);
    let b = cuda_ipc(&[
        "watch",
        &name,
        "--interval",
        "20",
        "--count",
        "2",
        "--plain",
    ]);
    assert_eq!(a.status.code(), Some(0), "{}", text(&a));
    assert_eq!(text(&a), text(&b));
    let t = text(&b);
    assert!(t.starts_with("every 20 ms, refresh 1\nchannel "), "{t}");
    assert!(t.contains("\nevery 20 ms, refresh 2\n"), "{t}");
    assert!(t.contains(", 0.0 frames/s"), "{t}");
    let o = cuda_ipc(&["watch", "--plain", "--json", "--count", "1"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    tx.close(Duration::from_secs(1)).unwrap();
}

#[test]
fn doctor_reports_nvml_quota_and_mps_plainly() {
    let o = cuda_ipc(&["doctor"]);
    let t = text(&o);
    assert!(t.contains("NVML"), "{t}");
    if !std::path::Path::new("/proc/driver/nvidia/version").exists() {
        assert!(
            t.contains("warn  NVML                 NVML not found:"),
            "{t}"
        );
    }
    assert!(t.contains("info  MPS"), "{t}");
    // `ls` says the same of NVML, in words and in its JSON.
    let l = cuda_ipc(&["ls"]);
    let lt = text(&l);
    let lj: serde_json::Value =
        serde_json::from_slice(&cuda_ipc(&["ls", "--json"]).stdout).unwrap();
    if !std::path::Path::new("/proc/driver/nvidia/version").exists() {
        assert!(
            lt.contains("\ngpu: NVML not found:") || lt.starts_with("gpu: NVML not found:"),
            "{lt}"
        );
        assert_eq!(lj["gpu"]["nvml"], "missing", "{lj}");
        assert!(
            lj["gpu"]["reason"]
                .as_str()
                .unwrap()
                .starts_with("NVML not found")
        );
    } else {
        assert!(lt.contains("gpu 0 GPU-"), "{lt}");
        assert_eq!(lj["gpu"]["nvml"], "found", "{lj}");
    }
    assert!(t.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), "{t}");
    assert!(t.contains("quota"), "{t}");
    assert!(!t.contains("panicked"), "{t}");
}

/// `text` without ANSI escape sequences and without whitespace (a terminal program moves the
/// cursor over blank cells instead of writing spaces).
fn screen_words(raw: &[u8]) -> String {
    let s = String::from_utf8_lossy(raw);
    let mut out = String::new();
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == '\x1b' {
            // CSI: ESC [ params final-byte; other escapes: ESC and one more character.
            if it.peek() == Some(&'[') {
                it.next();
                for d in it.by_ref() {
                    if ('@'..='~').contains(&d) {
                        break;
                    }
                }
            } else {
                it.next();
            }
        } else if !c.is_whitespace() {
            out.push(c);
        }
    }
    out
}

#[test]
fn watch_on_a_pseudo_terminal_draws_the_live_view_and_gives_the_terminal_back() {
    if Command::new("script").arg("--version").output().is_err() {
        println!("skipped: `script` (util-linux) is not installed to make a pseudo-terminal");
        return;
    }
    let name = unique("pty");
    let mut tx = Producer::create_host(&name, &ChannelOptions::new(64).buffers(2)).unwrap();
    let rx = Consumer::attach(&name, &ConsumerOptions::new()).unwrap();
    tx.acquire(None).unwrap().publish(b"").unwrap();
    let cmd = format!(
        "stty cols 150 rows 45; {} watch {name} --interval 100 --count 3",
        bin().display()
    );
    let o = Command::new("script")
        .args(["-qfec", &cmd, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let w = screen_words(&o.stdout);
    for want in [
        // The first frame in full; later ones only write the cells that changed.
        "cuda-ipcwatch:every100ms,refresh1",
        "Channels:frames/sandlagperconsumer",
        &format!("{name}:"),
        "consumer0(pid",
        "lag1frames",
        "GPUs(NVML)",
        "Quotabudgets",
        "Hand-offlatency",
    ] {
        assert!(w.contains(want), "missing {want:?} in {w}");
    }
    // The alternate screen is left again (crossterm's LeaveAlternateScreen).
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("\x1b[?1049l"),
        "the terminal was not given back"
    );
    drop(rx);
    tx.close(Duration::from_secs(1)).unwrap();
}
