//! `gc` and the quota ledgers: a killed holder's reservation is listed by `gc --dry-run` (which
//! changes nothing) and freed by `gc`; the ledger and the live reservations stay. A test binary of
//! its own: every `ls`, `watch` and `metrics` also frees dead holders, so no other test may look at
//! the ledgers meanwhile.

mod common;
use common::cuda_ipc;
use cuda_ipc::driver::Uuid;
use cuda_ipc::quota::{QuotaLedger, QuotaScope};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn fake_device(tag: u8) -> Uuid {
    let mut d = [0u8; 16];
    d[0] = 0xfe;
    d[1] = tag;
    d[12..].copy_from_slice(&std::process::id().to_le_bytes());
    Uuid(d)
}

/// Removes a ledger's name when dropped.
struct Gone(String);
impl Drop for Gone {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.0));
    }
}

const HOLDER_ROLE: &str = "CUDA_IPC_MON_TEST_HOLDER";

#[test]
fn gc_frees_a_killed_holders_reservation_and_keeps_the_ledger_and_the_live_ones() {
    const TEST: &str =
        "gc_frees_a_killed_holders_reservation_and_keeps_the_ledger_and_the_live_ones";
    let dev = fake_device(4);
    if let Ok(d) = std::env::var(HOLDER_ROLE) {
        let l = QuotaLedger::open(QuotaScope::user(), d.parse().unwrap()).unwrap();
        let _r = l.reserve(700).unwrap();
        // Straight to stdout (the test harness captures `println!`), on a line of its own (the
        // harness may have written `test NAME ... ` before it).
        let mut o = std::io::stdout().lock();
        writeln!(o, "\nheld").unwrap();
        o.flush().unwrap();
        drop(o);
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
    let ledger = QuotaLedger::set_budget(QuotaScope::user(), dev, 1000).unwrap();
    let _g = Gone(ledger.name().to_string());
    let mine = ledger.reserve(100).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(HOLDER_ROLE, dev.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let held = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .any(|l| l == "held");
    assert!(held, "the holder did not reserve");
    let pid = child.id();
    child.kill().unwrap();
    child.wait().unwrap();
    let o = cuda_ipc(&["gc", "--dry-run"]);
    let t = text(&o);
    let line = format!(
        "would remove quota ledger {}: reservation of 700 bytes of dead pid {pid}",
        ledger.name()
    );
    assert!(t.contains(&line), "{t}");
    // The dry run changed nothing (read without reclaiming).
    assert_eq!(ledger.dead_holders(false).unwrap().len(), 1);
    let o = cuda_ipc(&["gc"]);
    let t = text(&o);
    assert!(
        t.contains(&format!(
            "removed quota ledger {}: reservation of 700 bytes of dead pid {pid}",
            ledger.name()
        )),
        "{t}"
    );
    let s = ledger.snapshot().unwrap();
    assert_eq!((s.used, s.holders.len(), s.reclaimed), (100, 1, 0));
    assert!(std::fs::metadata(format!("/dev/shm/{}", ledger.name())).is_ok());
    drop(mine);
}
