//! Opens a quota ledger segment (`cuda-ipc.quota.…`) holding arbitrary bytes, as a producer and
//! the tools do: [`QuotaLedger::open_named`], [`QuotaLedger::snapshot`], a reservation taken and
//! released, [`QuotaLedger::dead_holders`] (the dry run, then the reclaim), `gc`'s look at it
//! ([`cleanup::scan`], [`quota::abandoned`]): every outcome must be a value or an error, never a
//! panic, a fault or a hang, and a reservation a ledger grants leaves the bytes it counts within
//! its budget. A ledger without its init stamp is only judged (`gc`'s look), not opened: every
//! opener awaits its stamp for 1 s by design (a wait, not a hang, that would only slow the run).
//!
//! The first input byte picks the mode: bit 0: raw bytes as the whole segment, or a valid ledger
//! (made by `set_budget` for host memory, one entry held by this process, one by a process that
//! does not run) with the input's (offset high, offset low, value) triples written over it; bit
//! 1: this user's ledger (mode 0600) or the ledger of this process's group (mode 0660); bit 2:
//! the segment is cut short (`ftruncate`) right after the open, to (the mode byte's bits 3-7)
//! KiB, as another member of a group ledger's group may cut it under the mapping.
//!
//! `cargo +nightly fuzz run open_ledger -- -max_len=24576 -max_total_time=60`
#![no_main]

use cuda_ipc::cleanup::{self, Scope};
use cuda_ipc::driver::Uuid;
use cuda_ipc::quota::{self, QuotaLedger, QuotaScope};
use cuda_ipc::raw::shm::Segment;
use libfuzzer_sys::fuzz_target;

mod common;
use common::plant;
use std::os::unix::fs::MetadataExt;
use std::sync::OnceLock;

/// Host memory's device.
const HOST: Uuid = Uuid([0; 16]);
/// Bytes of an entry (layout version 2).
const ENTRY_LEN: usize = 128;
/// Bytes of a ledger: its header page and 256 entries.
const LEDGER_LEN: usize = 4096 + 256 * ENTRY_LEN;
/// Offset of the init stamp, and the stamp.
const STAMP_AT: usize = 12;
const STAMP: u32 = 0x5155_4f54;
/// The first entry.
const ENTRIES_AT: usize = 4096;

fn scope(group: bool) -> QuotaScope {
    if group {
        // `/proc/self` belongs to this process's effective uid and gid.
        let gid = std::fs::metadata("/proc/self").expect("/proc/self").gid();
        QuotaScope::Group(gid)
    } else {
        QuotaScope::user()
    }
}

/// The valid ledger of `group`'s scope: a budget of 1 MiB, entry 0 held by this process (600
/// bytes), entry 1 a copy of it whose holder's pid is one that runs nothing.
fn valid_image(group: bool) -> &'static [u8] {
    static IMG: [OnceLock<Vec<u8>>; 2] = [OnceLock::new(), OnceLock::new()];
    IMG[usize::from(group)].get_or_init(|| {
        let l = QuotaLedger::set_budget(scope(group), HOST, 1 << 20).expect("set_budget");
        let r = l.reserve(600).expect("reserve");
        let mut img = std::fs::read(format!("/dev/shm/{}", l.name())).expect("read ledger");
        drop(r);
        l.remove().expect("remove");
        assert_eq!(img.len(), LEDGER_LEN);
        img.copy_within(ENTRIES_AT..ENTRIES_AT + ENTRY_LEN, ENTRIES_AT + ENTRY_LEN);
        let copy = &mut img[ENTRIES_AT + ENTRY_LEN..ENTRIES_AT + 2 * ENTRY_LEN];
        // The pid word (state is the entry's first 8 bytes, the identity follows): a pid no
        // process has (above the kernel's `pid_max` limit of 2^22).
        copy[8..12].copy_from_slice(&((1u32 << 22) + 7).to_le_bytes());
        img
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let group = mode & 2 != 0;
    let img = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        let mut img = valid_image(group).to_vec();
        for e in rest.chunks_exact(3) {
            let at = (usize::from(e[0]) << 8 | usize::from(e[1])) % img.len();
            img[at] = e[2];
        }
        img
    };
    let name = scope(group).segment_name(HOST);
    if !plant(&name, &img, group) {
        return;
    }
    // A ledger without its init stamp (any other word there) is awaited 1 s by every opener (a
    // creator may still be writing it): a wait by design, not a hang. Only the judges that do
    // not wait look at it.
    let unstamped = img.get(STAMP_AT..STAMP_AT + 4) != Some(&STAMP.to_le_bytes());
    if !unstamped && let Ok(l) = QuotaLedger::open_named(&name) {
        assert_eq!(l.name(), name);
        let _ = QuotaLedger::open(scope(group), HOST);
        if mode & 4 != 0 {
            // Cut short under the mapping, as another member of a group ledger's group may.
            let cut = u64::from(mode >> 3) * 1024;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(format!("/dev/shm/{name}"));
            if let Ok(f) = f {
                let _ = f.set_len(cut);
            }
        }
        let _ = l.dead_holders(false);
        if let Ok(s) = l.snapshot() {
            assert!(s.used >= s.holders.iter().map(|h| h.bytes).max().unwrap_or(0));
        }
        for bytes in [1, 4096, 1 << 20, u64::MAX] {
            if let Ok(r) = l.reserve(bytes) {
                assert_eq!(r.bytes(), bytes);
                if let Ok(s) = l.snapshot() {
                    // What this process holds is counted, within the budget it was judged by.
                    assert!(s.used >= bytes, "{s:?}");
                    assert!(s.budget.is_none_or(|b| s.used <= b), "{s:?}");
                }
                let _ = r.release();
            }
        }
        let _ = l.dead_holders(false);
        let _ = l.dead_holders(true);
    }
    let _ = quota::abandoned(&name);
    let _ =
        cleanup::scan(&Scope::only(Vec::new(), Vec::new()).with_quota_ledgers(vec![name.clone()]));
    let _ = Segment::unlink(&name);
});
