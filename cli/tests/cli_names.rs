//! What a NAME names, for every command that takes one (`ls`, `watch`, `metrics`, `gc`, `hold`):
//! an object's own name as given, never read for a prefix, and a file in /dev/shm given as its path
//! (`/dev/shm/FILE`: the one object it belongs to). `ls cuda-ipc.ch.foo` showed channel `foo`
//! where a channel was named `cuda-ipc.ch.foo`: here a channel, a tensor set and a registry bear
//! names that start with the prefixes, the channel and the set beside one named as the rest, and
//! each command is asked for each by both forms.

mod cli_support;
mod common;

use cli_support::*;
use common::{bin, write_segment};
use cuda_ipc::channel::{ChannelOptions, Producer};
use cuda_ipc::registry::{Registry, RegistryOptions};
use cuda_ipc::tensorset::{DType, TensorSetOptions, TensorSetWriter, TensorSpec};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The kind words `ls` starts an object's line with, and the key of its list in `ls --json`.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Channel,
    Set,
    Registry,
}

impl Kind {
    fn word(self) -> &'static str {
        match self {
            Kind::Channel => "channel",
            Kind::Set => "tensorset",
            Kind::Registry => "registry",
        }
    }

    fn json_key(self) -> &'static str {
        match self {
            Kind::Channel => "channels",
            Kind::Set => "tensor_sets",
            Kind::Registry => "registries",
        }
    }
}

/// The object names `ls` lists in text `t`, each with its kind's word.
fn shown(t: &str) -> Vec<String> {
    t.lines()
        .filter(|l| {
            ["channel ", "tensorset ", "registry "]
                .iter()
                .any(|w| l.starts_with(w))
        })
        .filter_map(|l| l.split_once(": ").map(|(head, _)| head.to_string()))
        .collect()
}

/// The object names in a JSON document of `ls --json` (or a line of `watch --json`).
fn shown_json(v: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    for k in [Kind::Channel, Kind::Set, Kind::Registry] {
        for o in v[k.json_key()].as_array().into_iter().flatten() {
            out.push(format!("{} {}", k.word(), o["name"].as_str().unwrap()));
        }
    }
    out
}

/// One scrape of `cuda-ipc metrics --listen 127.0.0.1:0 NAME`: the OpenMetrics body.
fn scrape(name: &str) -> String {
    serve(name, 1).0.remove(0)
}

/// `cuda-ipc metrics --listen 127.0.0.1:0 NAME`, scraped `scrapes` times on new connections,
/// then killed: the responses (status line, headers, body) and everything it wrote on stderr.
fn serve(name: &str, scrapes: usize) -> (Vec<String>, String) {
    let mut child = Command::new(bin())
        .args(["metrics", "--listen", "127.0.0.1:0", name])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let said = std::thread::spawn(move || {
        let mut all = String::new();
        let _ = stderr.read_to_string(&mut all);
        all
    });
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let addr = first
        .trim()
        .strip_prefix("serving OpenMetrics on http://")
        .and_then(|a| a.strip_suffix("/metrics"))
        .map(str::to_string);
    let bodies = addr.map(|addr| {
        (0..scrapes)
            .map(|_| {
                let mut s = TcpStream::connect(&addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                write!(
                    s,
                    "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
                )
                .unwrap();
                let mut all = String::new();
                s.read_to_string(&mut all).unwrap();
                all
            })
            .collect()
    });
    let _ = child.kill();
    let _ = child.wait();
    let said = said.join().unwrap();
    let bodies =
        bodies.unwrap_or_else(|| panic!("metrics {name}: first line {first:?}; stderr: {said}"));
    (bodies, said)
}

#[test]
fn a_name_is_the_objects_own_and_a_path_in_dev_shm_names_the_object_of_that_file() {
    let base = unique("names");
    let (ch, ts, reg) = (
        format!("{base}-ch"),
        format!("{base}-ts"),
        format!("{base}-reg"),
    );
    // A channel and a set named with their own kind's prefix, each beside the one named as the
    // rest; a registry named as another kind's file (channel `{reg}`'s control segment).
    let (pch, pts, preg) = (
        format!("cuda-ipc.ch.{ch}"),
        format!("cuda-ipc.ts.{ts}"),
        format!("cuda-ipc.ch.{reg}"),
    );
    let host = ChannelOptions::new(4096).buffers(2);
    let _c = Producer::create_host(&ch, &host).unwrap();
    let _pc = Producer::create_host(&pch, &host).unwrap();
    let specs = [TensorSpec::new("w", DType::F32, &[4])];
    let _t = TensorSetWriter::create_host(&ts, &specs, &TensorSetOptions::new()).unwrap();
    let _pt = TensorSetWriter::create_host(&pts, &specs, &TensorSetOptions::new()).unwrap();
    let _u = Unlink(preg.clone());
    let _r = Registry::create(&preg, &RegistryOptions::new().capacity(8)).unwrap();

    // (NAME, the one object it names).
    let cases = [
        (pch.clone(), format!("channel {pch}")),
        (ch.clone(), format!("channel {ch}")),
        (
            format!("/dev/shm/cuda-ipc.ch.{ch}"),
            format!("channel {ch}"),
        ),
        (
            format!("/dev/shm/cuda-ipc.hp.{ch}"),
            format!("channel {ch}"),
        ),
        (
            format!("/dev/shm/cuda-ipc.ch.{pch}"),
            format!("channel {pch}"),
        ),
        (pts.clone(), format!("tensorset {pts}")),
        (ts.clone(), format!("tensorset {ts}")),
        (
            format!("/dev/shm/cuda-ipc.ts.{ts}"),
            format!("tensorset {ts}"),
        ),
        (
            format!("/dev/shm/cuda-ipc.td.{ts}"),
            format!("tensorset {ts}"),
        ),
        (
            format!("/dev/shm/cuda-ipc.tg.{pts}"),
            format!("tensorset {pts}"),
        ),
        (preg.clone(), format!("registry {preg}")),
        (format!("/dev/shm/{preg}"), format!("registry {preg}")),
    ];
    for (name, object) in &cases {
        let want = vec![object.clone()];
        let ls = cuda_ipc_bounded(&["ls", name], false);
        assert_eq!(code(&ls), 0, "ls {name}: {}", text(&ls));
        assert_eq!(shown(&text(&ls)), want, "ls {name}: {}", text(&ls));
        let o = cuda_ipc_bounded(&["ls", "--json", name], false);
        assert_eq!(shown_json(&json(&o)), want, "ls --json {name}");
        let o = cuda_ipc_bounded(&["watch", "--plain", "--count", "1", name], false);
        assert_eq!(code(&o), 0, "watch {name}: {}", text(&o));
        assert_eq!(shown(&text(&o)), want, "watch {name}: {}", text(&o));
        let o = cuda_ipc_bounded(&["watch", "--json", "--count", "1", name], false);
        assert_eq!(shown_json(&json(&o)), want, "watch --json {name}");
        // Live objects: nothing to remove, nothing that cannot be read.
        for args in [&["gc", "--dry-run", name][..], &["gc", name]] {
            let o = cuda_ipc_bounded(args, false);
            assert_eq!(code(&o), 0, "{args:?}: {}", text(&o));
            assert_eq!(text(&o).trim(), "nothing to remove", "{args:?}");
        }
    }
    // `metrics` labels the channels and sets it serves with their names.
    for (name, label, not) in [
        (
            &pch,
            format!("channel=\"{pch}\""),
            format!("channel=\"{ch}\""),
        ),
        (
            &format!("/dev/shm/cuda-ipc.ch.{ch}"),
            format!("channel=\"{ch}\""),
            format!("channel=\"{pch}\""),
        ),
        (
            &pts,
            format!("tensorset=\"{pts}\""),
            format!("tensorset=\"{ts}\""),
        ),
        (
            &format!("/dev/shm/cuda-ipc.ts.{ts}"),
            format!("tensorset=\"{ts}\""),
            format!("tensorset=\"{pts}\""),
        ),
    ] {
        let body = scrape(name);
        assert!(
            body.contains(&label) && !body.contains(&not),
            "metrics {name}:\n{body}"
        );
    }
    // `hold` takes a set's own name, or a path of one of its files (a host set cannot be held:
    // the error names the set it tried).
    for (name, set, not) in [
        (pts.clone(), &pts, &ts),
        (format!("/dev/shm/cuda-ipc.ts.{ts}"), &ts, &pts),
    ] {
        let o = cuda_ipc_bounded(&["hold", &name], false);
        let t = text(&o);
        assert_eq!(code(&o), 1, "hold {name}: {t}");
        assert!(
            t.contains(&format!("{set:?}")) && !t.contains(&format!("{not:?}")),
            "hold {name}: {t}"
        );
    }
}

/// `gc` scans what the NAME names: a leftover under channel `X`'s or set `X`'s file is not
/// touched by `gc cuda-ipc.ch.X` (the live channel of that name) and is removed by
/// `gc /dev/shm/cuda-ipc.ch.X`. An abandoned creation (an empty file of this user, older than
/// 2 s) stands for the leftover.
#[test]
fn gc_of_an_own_name_never_takes_the_leftover_of_the_object_its_prefix_would_name() {
    let g = unique("names-gone");
    let (pch, pts) = (format!("cuda-ipc.ch.{g}"), format!("cuda-ipc.ts.{g}"));
    let files = [format!("cuda-ipc.ch.{g}"), format!("cuda-ipc.ts.{g}")];
    let _u = files.clone().map(Unlink);
    for f in &files {
        drop(write_segment(f, b""));
    }
    let _c = Producer::create_host(&pch, &ChannelOptions::new(4096).buffers(2)).unwrap();
    let specs = [TensorSpec::new("w", DType::F32, &[4])];
    let _t = TensorSetWriter::create_host(&pts, &specs, &TensorSetOptions::new()).unwrap();
    // Past any creation's grace (2 s, in whole seconds of `st_ctime`).
    std::thread::sleep(Duration::from_millis(3100));
    for (own, file, kind) in [(&pch, &files[0], "channel"), (&pts, &files[1], "tensorset")] {
        for args in [&["gc", "--dry-run", own][..], &["gc", own]] {
            let o = cuda_ipc_bounded(args, false);
            assert_eq!(code(&o), 0, "{args:?}: {}", text(&o));
            assert_eq!(text(&o).trim(), "nothing to remove", "{args:?}");
        }
        assert!(std::fs::metadata(format!("/dev/shm/{file}")).is_ok());
        let path = format!("/dev/shm/{file}");
        let o = cuda_ipc_bounded(&["gc", "--dry-run", &path], false);
        let want = format!("would remove {kind} {g}");
        assert!(
            text(&o).contains(&want),
            "gc --dry-run {path}: {}",
            text(&o)
        );
        let o = cuda_ipc_bounded(&["gc", &path], false);
        assert_eq!(code(&o), 0, "gc {path}: {}", text(&o));
        assert!(
            text(&o).contains(&format!("removed {kind} {g}")),
            "gc {path}: {}",
            text(&o)
        );
        assert!(std::fs::metadata(&path).is_err(), "{path} removed");
        // The live object of the own name stands.
        let o = cuda_ipc_bounded(&["ls", own], false);
        assert_eq!(code(&o), 0, "ls {own}: {}", text(&o));
        assert_eq!(shown(&text(&o)), [format!("{kind} {own}")]);
    }
}

/// A NAME that is a process's own file, given as its path, is refused saying what it is; given as
/// an own name it is looked for as the objects of that name, and refused the same way when none
/// stands but that file.
#[test]
fn a_process_file_is_refused_by_its_path_and_its_name_names_the_objects_of_that_name() {
    let me = cuda_ipc::identity::ProcessIdentity::current().unwrap();
    let live = me.liveness_name();
    let path = format!("/dev/shm/{live}");
    let said = "is a process's liveness file, not a registry, channel or tensor set";
    let metrics = |n: &str| ["metrics", "--listen", "127.0.0.1:0", n].map(str::to_string);
    for args in [
        ["ls", &path].map(str::to_string).to_vec(),
        ["gc", &path].map(str::to_string).to_vec(),
        ["ls", &live].map(str::to_string).to_vec(),
        ["gc", &live].map(str::to_string).to_vec(),
        // Refused before it listens, as `ls` refuses it.
        metrics(&path).to_vec(),
        metrics(&live).to_vec(),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = cuda_ipc_bounded(&args, false);
        assert_eq!(code(&o), 1, "{args:?}: {}", text(&o));
        assert!(text(&o).contains(said), "{args:?}: {}", text(&o));
        assert!(!text(&o).contains("serving"), "{args:?}: {}", text(&o));
    }
    // A channel may bear that name: then it is that channel.
    let _c = Producer::create_host(&live, &ChannelOptions::new(4096).buffers(2)).unwrap();
    let o = cuda_ipc_bounded(&["ls", &live], false);
    assert_eq!(code(&o), 0, "ls {live}: {}", text(&o));
    assert_eq!(shown(&text(&o)), [format!("channel {live}")]);
    let o = cuda_ipc_bounded(&["ls", &path], false);
    assert!(text(&o).contains(said), "ls {path}: {}", text(&o));
}

/// `metrics NAME` of a NAME that names nothing now (a typo; a FIFO, which no object can be; a
/// file of another program under a registry's name, no registry) says so once on stderr at its
/// start, as `ls NAME` would, and serves on: what the NAME names may be made later. One that names
/// something says nothing of the kind.
#[test]
fn metrics_says_once_at_its_start_that_a_name_names_nothing_now_and_serves_on() {
    let [typo, fifo, foreign, reg] = [
        "no-such-object",
        "metrics-fifo",
        "metrics-foreign",
        "metrics-reg",
    ]
    .map(unique);
    let _p = [&fifo, &foreign].map(|n| Planted(n.clone()));
    let st = Command::new("mkfifo")
        .arg(format!("/dev/shm/{fifo}"))
        .status()
        .unwrap();
    assert!(st.success());
    let mut bytes = vec![0u8; 4096];
    bytes[..8].copy_from_slice(b"PSMDEMO!");
    write_segment(&foreign, &bytes);
    let fifo_path = format!("/dev/shm/{fifo}");
    let cases = [
        (
            typo.as_str(),
            format!("no registry, channel or tensor set named {typo:?} in /dev/shm"),
        ),
        (
            fifo_path.as_str(),
            format!(
                "{fifo_path} names nothing that can be read now: registry {fifo}: cannot read: "
            ),
        ),
        (
            foreign.as_str(),
            format!(
                "{foreign} names nothing that can be read now: registry {foreign}: cannot read: \
                 shared-memory segment /{foreign} is not a cuda-ipc registry"
            ),
        ),
    ];
    for (name, said) in &cases {
        let (bodies, stderr) = serve(name, 2);
        for b in &bodies {
            assert!(b.starts_with("HTTP/1.1 200"), "{name}: {b}");
            assert!(b.ends_with("# EOF\n"), "{name}: {b}");
        }
        assert!(
            stderr.contains(&format!("cuda-ipc: warning: {said}")),
            "{name}: {stderr}"
        );
        assert!(stderr.contains("serving anyway"), "{name}: {stderr}");
        assert_eq!(stderr.matches("warning:").count(), 1, "{name}: {stderr}");
    }
    let _r = Registry::create(&reg, &RegistryOptions::new().capacity(4)).unwrap();
    let (bodies, stderr) = serve(&reg, 1);
    assert!(bodies[0].starts_with("HTTP/1.1 200"), "{}", bodies[0]);
    assert!(!stderr.contains("warning"), "{stderr}");
    Registry::unlink(&reg).unwrap();
}
