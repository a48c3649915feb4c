//! Which cases run, with how many frames, in which order, and each one's deadline.

use crate::FRAME_BYTES;
use crate::kv::WAITS;

/// The groups `--only` accepts.
pub const GROUPS: [&str; 8] = [
    "env",
    "registry",
    "limits",
    "handoff",
    "posted",
    "zerocopy",
    "throughput",
    "import",
];

/// The hand-off implementations, each run with every wait strategy and the same pacing.
pub const HANDOFF_IMPLS: [&str; 4] = ["floor", "bare_floor", "bare_hold", "channel"];

/// Receives posted ahead: the channel and its raw floor.
pub const POSTED_IMPLS: [&str; 2] = ["bare_posted", "posted"];

/// The frame sizes of the zero-copy case and of the device-to-device copies: label and bytes.
pub const SIZES: [(&str, usize); 3] = [
    ("1MiB", 1 << 20),
    ("33MB", FRAME_BYTES),
    ("256MiB", 256 << 20),
];

/// How a case runs.
pub enum Kind {
    /// In a child process: `--role ROLE key=value...`.
    Child {
        role: String,
        args: Vec<(String, String)>,
    },
    /// The registry's publish/get, in the orchestrating process (no GPU).
    Registry { iters: usize },
    /// A cross-process ping-pong driven from the orchestrating process (no GPU).
    PingPong { mode: String, iters: usize },
}

/// One case.
pub struct Case {
    /// Stable name, e.g. `handoff/channel/spin/idle`.
    pub id: String,
    /// Its group (for `--only`).
    pub group: &'static str,
    pub kind: Kind,
    /// Deadline of the whole case in seconds, past which its process is killed.
    pub timeout_s: u64,
}

struct Scale {
    handoff_frames: u64,
    handoff_warmup: u64,
    idle_gap_us: u64,
    spinning_gap_us: u64,
    tput_frames: u64,
    tput_warmup: u64,
    tput_all_waits: bool,
    zc_frames: u64,
    zc_gap_us: u64,
    import_handles: usize,
    cached_iters: usize,
    registry_iters: usize,
    futex_iters: usize,
    spin_iters: usize,
    d2d_iters: usize,
}

const FULL: Scale = Scale {
    handoff_frames: 5000,
    handoff_warmup: 100,
    idle_gap_us: 1000,
    spinning_gap_us: 10,
    tput_frames: 8000,
    tput_warmup: 200,
    tput_all_waits: true,
    zc_frames: 1000,
    zc_gap_us: 300,
    import_handles: 64,
    cached_iters: 100_000,
    registry_iters: 200_000,
    futex_iters: 20_000,
    spin_iters: 200_000,
    d2d_iters: 50,
};

const QUICK: Scale = Scale {
    handoff_frames: 300,
    handoff_warmup: 20,
    idle_gap_us: 500,
    spinning_gap_us: 10,
    tput_frames: 600,
    tput_warmup: 50,
    tput_all_waits: false,
    zc_frames: 200,
    zc_gap_us: 300,
    import_handles: 8,
    cached_iters: 10_000,
    registry_iters: 20_000,
    futex_iters: 2_000,
    spin_iters: 20_000,
    d2d_iters: 10,
};

fn kv(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// The cases of a run, in order, restricted to the groups in `only` (all when empty).
pub fn plan(quick: bool, only: &[String]) -> Vec<Case> {
    let s = if quick { &QUICK } else { &FULL };
    let mut cases = Vec::new();
    let mut push = |id: String, group: &'static str, kind: Kind, timeout_s: u64| {
        cases.push(Case {
            id,
            group,
            kind,
            timeout_s,
        })
    };
    push(
        "env".into(),
        "env",
        Kind::Child {
            role: "env".into(),
            args: Vec::new(),
        },
        60,
    );
    push(
        "registry".into(),
        "registry",
        Kind::Registry {
            iters: s.registry_iters,
        },
        60,
    );
    for (mode, iters) in [("futex", s.futex_iters), ("spin", s.spin_iters)] {
        push(
            format!("limits/{mode}_pingpong"),
            "limits",
            Kind::PingPong {
                mode: mode.into(),
                iters,
            },
            60,
        );
    }
    let sizes: Vec<String> = SIZES.iter().map(|(l, b)| format!("{l}:{b}")).collect();
    push(
        "limits/d2d_copy".into(),
        "limits",
        Kind::Child {
            role: "d2d".into(),
            args: kv(&[
                ("iters", s.d2d_iters.to_string()),
                ("sizes", sizes.join(",")),
            ]),
        },
        120,
    );
    // Hand-off with an idle consumer: the floor, the bare floor and the channel side by side for
    // each wait strategy, with the same frames, warm-up, gap and fill; then the default strategy
    // with a gap short enough that the consumer is still spinning.
    let handoff =
        |imp: &str, wait: &str, scenario: &str, gap_us: u64, fill: bool| -> (String, Kind, u64) {
            let frames = s.handoff_frames;
            let est_s = (frames + s.handoff_warmup) * (gap_us + 2000) / 1_000_000;
            (
                format!("handoff/{imp}/{wait}/{scenario}"),
                Kind::Child {
                    role: "handoff".into(),
                    args: kv(&[
                        ("bench", "handoff".into()),
                        ("impl", imp.into()),
                        ("wait", wait.into()),
                        ("scenario", format!("{wait}.{scenario}")),
                        ("frames", frames.to_string()),
                        ("warmup", s.handoff_warmup.to_string()),
                        ("gap_us", gap_us.to_string()),
                        ("bytes", FRAME_BYTES.to_string()),
                        ("fill", fill.to_string()),
                    ]),
                },
                90 + 2 * est_s,
            )
        };
    for wait in WAITS {
        for imp in HANDOFF_IMPLS {
            let (id, kind, t) = handoff(imp, wait, "idle", s.idle_gap_us, true);
            push(id, "handoff", kind, t);
        }
    }
    for imp in HANDOFF_IMPLS {
        let (id, kind, t) = handoff(imp, WAITS[0], "spinning", s.spinning_gap_us, false);
        push(id, "handoff", kind, t);
    }
    // Receives posted ahead, the consumer's host asleep: the channel beside its raw floor, same
    // frames, warm-up, gap and frame size.
    for imp in POSTED_IMPLS {
        let frames = s.handoff_frames;
        let est_s = (frames + s.handoff_warmup) * (s.idle_gap_us + 2000) / 1_000_000;
        push(
            format!("posted/{imp}/idle"),
            "posted",
            Kind::Child {
                role: "posted".into(),
                args: kv(&[
                    ("impl", imp.into()),
                    ("wait", WAITS[0].into()),
                    ("scenario", "idle".into()),
                    ("frames", frames.to_string()),
                    ("warmup", s.handoff_warmup.to_string()),
                    ("gap_us", s.idle_gap_us.to_string()),
                    ("bytes", FRAME_BYTES.to_string()),
                ]),
            },
            90 + 2 * est_s,
        );
    }
    // Zero copy: the consumer's per-frame cost and hand-off latency across frame sizes.
    for (label, bytes) in SIZES {
        push(
            format!("zerocopy/{label}"),
            "zerocopy",
            Kind::Child {
                role: "handoff".into(),
                args: kv(&[
                    ("bench", "zerocopy".into()),
                    ("impl", "channel".into()),
                    ("wait", "spin".into()),
                    ("scenario", label.into()),
                    ("frames", s.zc_frames.to_string()),
                    ("warmup", s.handoff_warmup.to_string()),
                    ("gap_us", s.zc_gap_us.to_string()),
                    ("bytes", bytes.to_string()),
                    ("cost", "true".into()),
                ]),
            },
            120,
        );
    }
    // Saturated throughput (and the saturated hand-off latency): 1 consumer per wait strategy,
    // then 4 consumers with the default.
    let mut tput = vec![(1usize, WAITS[0])];
    if s.tput_all_waits {
        tput.extend([(1, WAITS[1]), (1, WAITS[2])]);
    }
    tput.push((4, WAITS[0]));
    let mut tput: Vec<(usize, &str, bool)> = tput.into_iter().map(|(c, w)| (c, w, false)).collect();
    // Receives posted ahead through a ring: the producer runs ahead, fewer context switches.
    tput.push((1, WAITS[0], true));
    for (consumers, wait, posted) in tput {
        let tag = if posted { "-posted" } else { "" };
        push(
            format!("throughput/c{consumers}{tag}/{wait}"),
            "throughput",
            Kind::Child {
                role: "throughput".into(),
                args: kv(&[
                    ("consumers", consumers.to_string()),
                    ("wait", wait.into()),
                    ("frames", s.tput_frames.to_string()),
                    ("warmup", s.tput_warmup.to_string()),
                    ("bytes", FRAME_BYTES.to_string()),
                    ("posted", posted.to_string()),
                ]),
            },
            120,
        );
    }
    push(
        "import".into(),
        "import",
        Kind::Child {
            role: "import".into(),
            args: kv(&[
                ("handles", s.import_handles.to_string()),
                ("bytes", (2usize << 20).to_string()),
                ("cached_iters", s.cached_iters.to_string()),
            ]),
        },
        120,
    );
    cases.retain(|c| only.is_empty() || only.iter().any(|g| selects(g, c)));
    cases
}

/// Whether an `--only` item selects `case`: its group (`handoff`), or its id or a `/`-separated
/// prefix of it (`handoff/bare_floor`, `handoff/bare_floor/spin`).
pub fn selects(item: &str, case: &Case) -> bool {
    item == case.group
        || case
            .id
            .strip_prefix(item)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(c: &Case) -> Vec<(String, String)> {
        match &c.kind {
            Kind::Child { args, .. } => args.clone(),
            _ => panic!("{} is not a child case", c.id),
        }
    }

    #[test]
    fn the_bare_floor_runs_beside_the_floor_with_the_same_pacing() {
        for quick in [false, true] {
            let cases = plan(quick, &[]);
            let ids: Vec<&str> = cases.iter().map(|c| c.id.as_str()).collect();
            let scenarios: Vec<(&str, &str)> = WAITS
                .iter()
                .map(|w| (*w, "idle"))
                .chain([(WAITS[0], "spinning")])
                .collect();
            for (wait, scenario) in scenarios {
                let find = |imp: &str| {
                    let id = format!("handoff/{imp}/{wait}/{scenario}");
                    cases
                        .iter()
                        .find(|c| c.id == id)
                        .unwrap_or_else(|| panic!("no case {id} in {ids:?}"))
                };
                let (floor, bare, channel) = (find("floor"), find("bare_floor"), find("channel"));
                let without_impl = |c: &Case| -> Vec<(String, String)> {
                    args(c).into_iter().filter(|(k, _)| k != "impl").collect()
                };
                // Same frames, warm-up, gap, fill, bytes and scenario name (the record keys).
                assert_eq!(without_impl(bare), without_impl(floor), "{wait}/{scenario}");
                assert_eq!(
                    without_impl(bare),
                    without_impl(channel),
                    "{wait}/{scenario}"
                );
                assert_eq!(bare.timeout_s, floor.timeout_s);
                assert!(args(bare).contains(&("impl".into(), "bare_floor".into())));
                // The bare floor with the hold protocol: the same case but for the impl.
                assert_eq!(without_impl(find("bare_hold")), without_impl(bare));
            }
        }
    }

    #[test]
    fn only_selects_groups_and_case_prefixes() {
        let only = |items: &[&str]| -> Vec<String> {
            let items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
            plan(true, &items).into_iter().map(|c| c.id).collect()
        };
        let bare = only(&["handoff/bare_floor"]);
        assert_eq!(bare.len(), WAITS.len() + 1, "{bare:?}");
        assert!(bare.iter().all(|id| id.starts_with("handoff/bare_floor/")));
        assert_eq!(
            only(&["handoff/bare_floor/spin/idle"]),
            ["handoff/bare_floor/spin/idle"]
        );
        // Whole segments only: `handoff/f` is no prefix of `handoff/floor/...`.
        assert!(only(&["handoff/f"]).is_empty());
        assert_eq!(
            only(&["handoff"]).len(),
            (WAITS.len() + 1) * HANDOFF_IMPLS.len()
        );
        assert_eq!(only(&["env", "handoff/floor"]).len(), 1 + WAITS.len() + 1);
    }
}
