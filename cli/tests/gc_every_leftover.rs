//! `gc --dry-run` lists exactly what `gc` then removes: one rule set (`cuda_ipc::cleanup`). A child
//! process plants a leftover of each kind it can on a machine without a GPU, and is killed with
//! SIGKILL: a registry record and participant entry, a host channel with its pool, a quota
//! reservation, its liveness file; beside it an fd server socket and a bridge status file named
//! for it, a channel creation abandoned half-way and a quota ledger creation it left unstamped.
//! Both runs' lines about these are compared as
//! sets, and a live producer's channel is in neither. A test binary of its own: `gc` without a
//! NAME looks at everything, so no other test of this crate may plant or clean meanwhile.

mod common;
use common::cuda_ipc;
use cuda_ipc::channel::{ChannelOptions, Producer};
use cuda_ipc::driver::Uuid;
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::quota::{QuotaLedger, QuotaScope};
use cuda_ipc::registry::{Registry, RegistryOptions};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ROLE: &str = "CUDA_IPC_GC_EVERY_LEFTOVER_CHILD";
const TEST: &str = "gc_dry_run_lists_exactly_what_gc_removes_of_every_kind_of_leftover";

/// Removes a name in /dev/shm when dropped (whatever the test left).
struct Gone(String);
impl Drop for Gone {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.0));
    }
}

fn lines(args: &[&str], strip: &str, mine: &dyn Fn(&str) -> bool) -> BTreeSet<String> {
    let o = cuda_ipc(args);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{args:?}: {out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out.lines()
        .filter_map(|l| l.strip_prefix(strip))
        .filter(|l| mine(l))
        .map(str::to_string)
        .collect()
}

#[test]
fn gc_dry_run_lists_exactly_what_gc_removes_of_every_kind_of_leftover() {
    let tag = format!("gc-every-{}", std::process::id());
    let dev = {
        let mut d = [0u8; 16];
        d[0] = 0xfe;
        d[1] = 0x77;
        d[12..].copy_from_slice(&std::process::id().to_le_bytes());
        Uuid(d)
    };
    if let Ok(role) = std::env::var(ROLE) {
        let (t, d) = role.split_once('|').unwrap();
        let dev: Uuid = d.parse().unwrap();
        let reg = Registry::create(t, &RegistryOptions::new().capacity(4)).unwrap();
        reg.publish("orphan", 1, b"token", b"").unwrap();
        let _tx = Producer::create_host(&format!("{t}-ch"), &ChannelOptions::new(4096).buffers(2))
            .unwrap();
        let l = QuotaLedger::open(QuotaScope::user(), dev).unwrap();
        let _r = l.reserve(700).unwrap();
        let me = ProcessIdentity::current().unwrap();
        let mut o = std::io::stdout().lock();
        writeln!(o, "\nplanted {} {}", me.start_time, me.pid_ns).unwrap();
        o.flush().unwrap();
        drop(o);
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
    let started = Instant::now();
    let dead_ch = format!("{tag}-ch");
    let live_ch = format!("{tag}-live");
    let half = format!("{tag}-half");
    let _names = [
        Gone(tag.clone()),
        Gone(format!("cuda-ipc.ch.{dead_ch}")),
        Gone(format!("cuda-ipc.hp.{dead_ch}")),
        Gone(format!("cuda-ipc.ch.{live_ch}")),
        Gone(format!("cuda-ipc.hp.{live_ch}")),
        Gone(format!("cuda-ipc.ch.{half}")),
        Gone(format!("cuda-ipc.br.{tag}")),
    ];
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), dev, 1 << 20).unwrap();
    let _ledger = Gone(ledger.name().to_string());
    let _live = Producer::create_host(&live_ch, &ChannelOptions::new(4096).buffers(2)).unwrap();

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, format!("{tag}|{dev}"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let planted = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("planted ").map(str::to_string))
        .expect("the child did not plant");
    let pid = child.id();
    child.kill().unwrap();
    child.wait().unwrap();
    let (start, ns) = planted.split_once(' ').unwrap();
    let dead = ProcessIdentity {
        pid,
        start_time: start.parse().unwrap(),
        boot_id: ProcessIdentity::current().unwrap().boot_id,
        pid_ns: ns.parse().unwrap(),
    };
    // An fd server socket and a lane bridge's status file of the killed process.
    let socket = cuda_ipc::ipc::fdpass::socket_path(&dead);
    let _socket = Gone(socket.trim_start_matches("/dev/shm/").to_string());
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    std::fs::write(
        format!("/dev/shm/cuda-ipc.br.{tag}"),
        format!("role=send\npid={pid}\nstart_time={start}\npeer=10.0.0.1:1\nmemory=host\n"),
    )
    .unwrap();
    // A channel creation abandoned half-way: sized, no page backed, 2 s old below.
    common::write_segment(&format!("cuda-ipc.ch.{half}"), b"")
        .set_len(1 << 20)
        .unwrap();
    // A quota ledger the killed process began and never stamped: every page written, the magic,
    // layout version 1 and its identity words, 2 s old below.
    let half_ledger = QuotaScope::user().segment_name(Uuid({
        let mut d = dev.0;
        d[1] = 0x78;
        d
    }));
    let _half_ledger = Gone(half_ledger.clone());
    let mut header = b"CIPCQUOT".to_vec();
    header.extend_from_slice(&1u32.to_le_bytes());
    header.extend_from_slice(&[0; 12]); // no init stamp; generation 0
    for w in dead.to_words() {
        header.extend_from_slice(&w.to_le_bytes());
    }
    header.resize(4096 + 256 * 64, 0);
    common::write_segment(&half_ledger, &header);
    // Liveness files younger than 5 s and half-made creations younger than 2 s are never stale.
    if let Some(rest) = Duration::from_millis(5300).checked_sub(started.elapsed()) {
        std::thread::sleep(rest);
    }

    let mine = |l: &str| {
        l.contains(&tag)
            || l.contains(&format!("pid {pid} "))
            || l.contains(&format!(".{pid}."))
            || l.contains(ledger.name())
            || l.contains(&half_ledger)
    };
    let would = lines(&["gc", "--dry-run"], "would remove ", &mine);
    let removed = lines(&["gc"], "removed ", &mine);
    let kinds = [
        format!("registry {tag}: record \"orphan\""),
        format!("registry {tag}: participant entry"),
        format!("channel {dead_ch}: segment"),
        format!("host pool /dev/shm/cuda-ipc.hp.{dead_ch} of channel {dead_ch}"),
        format!("channel {half}: segment /dev/shm/cuda-ipc.ch.{half}: a creation abandoned"),
        "the reservation of 700 bytes of dead pid ".to_string(),
        format!(
            "quota ledger {half_ledger}: segment /dev/shm/{half_ledger}: a creation abandoned by \
             its dead creator"
        ),
        "liveness file /dev/shm/cuda-ipc.live.".to_string(),
        format!("fd server socket {socket}"),
        format!("bridge status /dev/shm/cuda-ipc.br.{tag}"),
    ];
    for k in &kinds {
        assert!(
            would.iter().any(|l| l.starts_with(k.as_str())),
            "the dry run does not list {k}:\n{would:#?}"
        );
    }
    assert_eq!(would, removed, "gc removed other than its dry run listed");
    assert!(
        !would.iter().any(|l| l.contains(&live_ch)),
        "a live producer's channel was listed: {would:#?}"
    );
    assert!(
        cuda_ipc::channel::inspect::inspect(&live_ch).is_ok(),
        "kept"
    );
    assert!(std::fs::symlink_metadata(&socket).is_err(), "removed");
    assert!(
        lines(&["gc", "--dry-run"], "would remove ", &mine).is_empty(),
        "nothing of it is left"
    );
}
