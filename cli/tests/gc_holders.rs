//! `gc` and a tensor set's holders segment: the slots that killed holders left in a live set's
//! holders segment are listed by `gc --dry-run` (which changes nothing) and freed by `gc`, which
//! says how many in a line of its own; a live holder's slot stays, and so does the set. No GPU:
//! the set's holders segment and manifest are made from the CPU
//! (`cuda_ipc::raw::tensorset::testing`), its holders are `sleep` processes killed here.

mod common;
use common::cuda_ipc;
use cuda_ipc::identity::{Liveness, ProcessIdentity};
use cuda_ipc::raw::tensorset::testing::HeldSetFixture;
use cuda_ipc::tensorset::HolderRole;
use std::os::unix::fs::MetadataExt;
use std::process::{Child, Command, Output};

fn out(o: &Output) -> String {
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A running child (`sleep`) and its identity (start time from `/proc/PID/stat`, field 22).
fn live_process() -> (Child, ProcessIdentity) {
    let c = Command::new("sleep").arg("60").spawn().unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", c.id())).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let start_time = after.split(' ').nth(19).unwrap().parse().unwrap();
    let id = ProcessIdentity {
        pid: c.id(),
        start_time,
        ..ProcessIdentity::current().unwrap()
    };
    (c, id)
}

/// Unlinks the fixture's segments at the end, whatever the test did.
struct Unlink(HeldSetFixture);
impl Drop for Unlink {
    fn drop(&mut self) {
        self.0.unlink();
    }
}

#[test]
fn gc_frees_killed_holders_slots_and_says_how_many_keeping_a_live_holders() {
    let set = format!("gc-holders-{}", std::process::id());
    let f = Unlink(HeldSetFixture::create(&set, 2).unwrap());
    let uid = std::fs::metadata("/proc/self").unwrap().uid();
    let live = f.0.claim(HolderRole::Holder).unwrap();
    // Both claim while they run (a claim takes a dead server's slot), then both are killed.
    let mut killed = Vec::new();
    let mut children = Vec::new();
    for role in [HolderRole::Holder, HolderRole::Reader] {
        let (c, id) = live_process();
        killed.push((f.0.claim_for(role, id, uid).unwrap(), role, id));
        children.push(c);
    }
    for mut c in children {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    assert!(
        killed
            .iter()
            .all(|k| k.2.liveness_as(uid) == Liveness::Dead)
    );
    let dead_line = |(slot, role, id): &(usize, HolderRole, ProcessIdentity)| {
        format!(
            "tensorset {set}: holder slot {slot} ({}) of dead {id}",
            role.word()
        )
    };

    let dry = out(&cuda_ipc(&["gc", "--dry-run", &set]));
    for k in &killed {
        assert!(
            dry.contains(&format!("would remove {}", dead_line(k))),
            "{dry}"
        );
    }
    assert!(dry.contains("would free 2 dead holder slots"), "{dry}");
    assert_eq!(f.0.holders().len(), 3, "the dry run changed nothing");

    let run = out(&cuda_ipc(&["gc", &set]));
    for k in &killed {
        assert!(run.contains(&format!("removed {}", dead_line(k))), "{run}");
    }
    assert!(run.contains("freed 2 dead holder slots"), "{run}");
    assert!(
        !run.contains("manifest"),
        "the live set's parts stay: {run}"
    );
    let left = f.0.holders();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(
        (left[0].slot, left[0].liveness),
        (live, Liveness::Alive),
        "the live holder's slot"
    );

    let again = out(&cuda_ipc(&["gc", &set]));
    assert!(!again.contains("freed"), "{again}");
    assert!(again.contains("nothing to remove"), "{again}");
}
