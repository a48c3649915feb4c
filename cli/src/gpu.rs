//! GPU state through NVML (`nvml-wrapper`, `libnvidia-ml.so.1` loaded at run time): per GPU
//! utilization and memory, per process the memory it holds, and which of those processes are
//! channel or registry participants.
//!
//! NVML reports pids of the root (host's) pid namespace; participants record their pid in their
//! own namespace with that namespace's inode. [`match_processes`] maps one to the other through
//! `NSpid` in `/proc/PID/status` (the pid in each namespace, outermost first) and
//! `/proc/PID/ns/pid`, a pure function of that text so it is tested without a GPU or containers.
//! That works only where this command runs in the root pid namespace (its `/proc` then counts
//! NVML's pids): elsewhere (a container, `unshare --pid`) NVML's pids are not looked up at all
//! (the same number may be another process here), and a participant's device memory is said to
//! be unknown, with why ([`unmatched_reason`]), never that it holds none.

use std::collections::BTreeMap;

/// One process on a GPU as NVML reports it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GpuProcess {
    /// Its pid in the root pid namespace (what NVML reports).
    pub pid: u32,
    /// Device memory it holds, in bytes; `None` when NVML cannot tell.
    pub used_bytes: Option<u64>,
}

/// One GPU.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Gpu {
    /// NVML's index.
    pub index: u32,
    /// `GPU-xxxxxxxx-...`, as NVML and `nvidia-smi` print it.
    pub uuid: String,
    /// The product name.
    pub name: String,
    /// Percent of the last sample period in which a kernel ran (0 to 100); `None` when NVML
    /// cannot tell.
    pub utilization_percent: Option<u32>,
    /// Device memory in use, bytes.
    pub memory_used: u64,
    /// Device memory in all, bytes.
    pub memory_total: u64,
    /// Compute processes on it.
    pub processes: Vec<GpuProcess>,
}

/// What NVML gave, or why not.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(tag = "nvml", rename_all = "lowercase")]
pub enum GpuState {
    /// NVML answered.
    Found {
        /// Every GPU NVML sees.
        gpus: Vec<Gpu>,
    },
    /// NVML could not be loaded or initialised; `reason` says why, in words.
    Missing {
        /// Why, for people (starts with "NVML not found" when the library is missing).
        reason: String,
    },
}

impl GpuState {
    /// The GPUs, none when NVML is missing.
    pub fn gpus(&self) -> &[Gpu] {
        match self {
            GpuState::Found { gpus } => gpus,
            GpuState::Missing { .. } => &[],
        }
    }

    /// The line shown where NVML is missing.
    pub fn missing(&self) -> Option<&str> {
        match self {
            GpuState::Found { .. } => None,
            GpuState::Missing { reason } => Some(reason),
        }
    }
}

/// Why NVML is missing, in words.
fn why(e: nvml_wrapper::error::NvmlError) -> String {
    use nvml_wrapper::error::NvmlError as E;
    match e {
        E::LibloadingError(e) => format!(
            "NVML not found: libnvidia-ml.so could not be loaded ({e}); GPU utilization and memory are not shown (install the NVIDIA driver, or add its folder to LD_LIBRARY_PATH)"
        ),
        E::LibraryNotFound | E::FailedToLoadSymbol(_) => format!(
            "NVML not found: {e}; GPU utilization and memory are not shown"
        ),
        E::DriverNotLoaded => {
            "NVML not usable: the NVIDIA driver is not loaded; GPU utilization and memory are not shown".to_string()
        }
        e => format!("NVML not usable: {e}; GPU utilization and memory are not shown"),
    }
}

/// Asks NVML for every GPU's state. Never fails: a missing or failing NVML is
/// [`GpuState::Missing`] with the reason; a GPU whose queries fail is skipped with a warning.
pub fn query() -> GpuState {
    let nvml = match nvml_wrapper::Nvml::init() {
        Ok(n) => n,
        Err(e) => return GpuState::Missing { reason: why(e) },
    };
    let n = match nvml.device_count() {
        Ok(n) => n,
        Err(e) => return GpuState::Missing { reason: why(e) },
    };
    let mut gpus = Vec::new();
    for index in 0..n {
        let d = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("NVML device {index}: {e}");
                continue;
            }
        };
        let mem = d.memory_info().ok();
        let processes = d
            .running_compute_processes()
            .unwrap_or_default()
            .into_iter()
            .map(|p| GpuProcess {
                pid: p.pid,
                used_bytes: match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
                    _ => None,
                },
            })
            .collect();
        gpus.push(Gpu {
            index,
            uuid: d.uuid().unwrap_or_default(),
            name: d.name().unwrap_or_default(),
            utilization_percent: d.utilization_rates().ok().map(|u| u.gpu),
            memory_used: mem.as_ref().map_or(0, |m| m.used),
            memory_total: mem.as_ref().map_or(0, |m| m.total),
            processes,
        });
    }
    GpuState::Found { gpus }
}

/// A channel or registry participant, as its segment records it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Participant {
    /// Its pid in its own pid namespace.
    pub pid: u32,
    /// Its pid namespace inode (0: unknown).
    pub pid_ns: u32,
    /// What it is, for people: `producer of frames`, `consumer 2 of frames`, `registry r`.
    pub role: String,
}

/// The pids of `NSpid:` in a `/proc/PID/status` text, outermost namespace first (one pid when the
/// process is in the root namespace; none on kernels before 4.1).
pub fn ns_pids(status: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .map(|v| {
            v.split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The inode of a `pid:[4026531836]` link text (`readlink /proc/PID/ns/pid`).
pub fn ns_inode(link: &str) -> Option<u32> {
    link.trim()
        .strip_prefix("pid:[")?
        .strip_suffix(']')?
        .parse::<u64>()
        .ok()
        .map(|i| i as u32)
}

/// What `/proc` says of one root-namespace pid: its `status` text and its `ns/pid` link text;
/// `None` when the pid is not visible here (another pid namespace's `/proc`, `hidepid`, gone).
pub type ProcFacts = Option<(String, String)>;

/// Reads [`ProcFacts`] of `pid` from this machine's `/proc`.
pub fn proc_facts(pid: u32) -> ProcFacts {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let link = std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok()?;
    Some((status, link.to_string_lossy().into_owned()))
}

/// The inode of the root (initial) pid namespace, whose pids NVML reports: the kernel's
/// `PROC_PID_INIT_INO`, the same on every Linux since 3.8.
pub const ROOT_PID_NS: u32 = 0xEFFF_FFFC;

/// One NVML process, and the participants it is.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MatchedProcess {
    /// The GPU's index.
    pub gpu: u32,
    /// NVML's process.
    pub process: GpuProcess,
    /// The participants it is (a process may produce one channel and consume another); empty
    /// when it is none of them.
    pub participants: Vec<Participant>,
}

/// The result of [`match_processes`].
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Matching {
    /// Every NVML process with the participants it is.
    pub processes: Vec<MatchedProcess>,
    /// Participants no NVML process could be matched to, each with why.
    pub unmatched: Vec<(Participant, String)>,
    /// Whether NVML's pids could be looked up here: this command runs in the root pid namespace.
    /// When not, no process has participants and every participant is unmatched, its device
    /// memory not known.
    pub mapped: bool,
}

/// Why no NVML process was matched to `part`, in words (`ls`'s "not matched" lines, JSON's
/// `gpu_processes.unmatched`).
///
/// `own_ns` is this command's pid namespace inode (0: unknown), `invisible` the number of NVML's
/// pids with no `/proc` entry here, `untranslated` the number of NVML's processes in another pid
/// namespace whose `/proc/PID/status` has no `NSpid` chain to map them by (kernels before 4.1).
/// "Holds no device memory" is said only where every NVML pid could be mapped to `part`'s
/// namespace; where the pids are of another namespace than the one NVML reports in and cannot be
/// mapped, its device memory is not known.
pub fn unmatched_reason(
    part: &Participant,
    own_ns: u32,
    invisible: usize,
    untranslated: usize,
) -> String {
    let part_elsewhere = part.pid_ns != 0 && part.pid_ns != ROOT_PID_NS;
    if own_ns == 0 {
        return "device memory not known: this command's pid namespace cannot be read \
                (/proc/self/ns/pid), so NVML's pids (the host's) cannot be mapped to it"
            .to_string();
    }
    if own_ns != ROOT_PID_NS {
        return if part_elsewhere {
            format!(
                "device memory not known: it is in pid namespace {}, another than NVML's pids \
                 (the host's), and this command runs in pid namespace {own_ns}, where the \
                 host's pids cannot be looked up; run it in the host's pid namespace to match",
                part.pid_ns
            )
        } else {
            format!(
                "device memory not known: NVML's pids are the host's, and this command runs in \
                 pid namespace {own_ns}, where the host's pids cannot be looked up; run it in the \
                 host's pid namespace to match"
            )
        };
    }
    if invisible > 0 {
        return format!(
            "no GPU process matched; {invisible} of NVML's pids are not visible in this pid namespace's /proc, so it may be one of them"
        );
    }
    if part_elsewhere && untranslated > 0 {
        return format!(
            "device memory not known: it is in pid namespace {}, another than NVML's pids (the \
             host's), and /proc gives no NSpid for {untranslated} of NVML's processes of other \
             namespaces to map them by",
            part.pid_ns
        );
    }
    "no GPU process matched: it holds no device memory (a host channel, or not using the GPU)"
        .to_string()
}

/// Maps NVML's processes (root-namespace pids, per GPU) to participants (pid in their own
/// namespace, namespace inode): a process matches a participant when its innermost `NSpid`
/// equals the participant's pid and its `ns/pid` inode equals the participant's namespace. A
/// participant without a namespace inode (0) matches its pid as seen from the root namespace.
/// `own_ns` is this command's pid namespace inode ([`own_pid_ns`]); `facts(pid)` answers for
/// each NVML pid ([`proc_facts`] on a real machine), and is asked only where `own_ns` is the root
/// namespace ([`ROOT_PID_NS`]): elsewhere this `/proc` does not count NVML's pids, and every
/// participant is unmatched with its device memory not known.
///
/// A participant is unmatched, with the reason ([`unmatched_reason`]), when no NVML process is it:
/// it holds no device memory (a host channel, or not started), its process is not visible from
/// here, or its device memory is not known (NVML's pids cannot be mapped to its namespace).
pub fn match_processes(
    gpus: &[Gpu],
    participants: &[Participant],
    own_ns: u32,
    facts: impl Fn(u32) -> ProcFacts,
) -> Matching {
    let mut out = Matching {
        mapped: own_ns == ROOT_PID_NS,
        ..Matching::default()
    };
    let mut matched = vec![false; participants.len()];
    let mut invisible = 0usize;
    let mut untranslated = 0usize;
    let mut cache: BTreeMap<u32, ProcFacts> = BTreeMap::new();
    for g in gpus {
        for p in &g.processes {
            let mut mine = Vec::new();
            if out.mapped {
                match cache.entry(p.pid).or_insert_with(|| facts(p.pid)) {
                    Some((status, link)) => {
                        let pids = ns_pids(status);
                        let inner = pids.last().copied().unwrap_or(p.pid);
                        let ns = ns_inode(link);
                        if ns != Some(ROOT_PID_NS) && pids.len() < 2 {
                            untranslated += 1;
                        }
                        for (k, part) in participants.iter().enumerate() {
                            let hit = if part.pid_ns == 0 {
                                part.pid == p.pid
                            } else {
                                ns == Some(part.pid_ns) && inner == part.pid
                            };
                            if hit {
                                matched[k] = true;
                                mine.push(part.clone());
                            }
                        }
                    }
                    None => invisible += 1,
                }
            }
            out.processes.push(MatchedProcess {
                gpu: g.index,
                process: p.clone(),
                participants: mine,
            });
        }
    }
    for (k, part) in participants.iter().enumerate() {
        if !matched[k] {
            let why = unmatched_reason(part, own_ns, invisible, untranslated);
            out.unmatched.push((part.clone(), why));
        }
    }
    out
}

/// This command's pid namespace inode (`/proc/self/ns/pid`), 0 when it cannot be read.
pub fn own_pid_ns() -> u32 {
    cuda_ipc::identity::own_pid_ns()
}

/// The lines of `ls`'s GPU section: each GPU with its utilization and memory, each process on it
/// with the participants it is, and the participants no GPU process was matched to; or the one line
/// saying why NVML is missing.
pub fn render(state: &GpuState, m: &Matching) -> String {
    let bytes = crate::text::bytes;
    if let Some(why) = state.missing() {
        return format!("gpu: {why}\n");
    }
    let mut out = String::new();
    if state.gpus().is_empty() {
        out.push_str("gpu: NVML sees no GPU\n");
    }
    for g in state.gpus() {
        out.push_str(&format!(
            "gpu {} {}: {}, utilization {}, memory {} of {}\n",
            g.index,
            g.uuid,
            g.name,
            g.utilization_percent
                .map_or("unknown".into(), |u| format!("{u}%")),
            bytes(g.memory_used),
            bytes(g.memory_total)
        ));
        for p in m.processes.iter().filter(|p| p.gpu == g.index) {
            let who = if !m.mapped {
                "whether it is a participant is not known (NVML's pids are the host's, and this \
                 command runs in another pid namespace)"
                    .to_string()
            } else if p.participants.is_empty() {
                "no participant of a registry or channel here".to_string()
            } else {
                p.participants
                    .iter()
                    .map(|x| x.role.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            out.push_str(&format!(
                "  pid {} holds {}: {who}\n",
                p.process.pid,
                p.process
                    .used_bytes
                    .map_or("an unknown amount".into(), bytes)
            ));
        }
    }
    for (p, why) in &m.unmatched {
        out.push_str(&format!(
            "  not matched: {} (pid {}, pid ns {}): {why}\n",
            p.role, p.pid, p.pid_ns
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(nspid: &str) -> String {
        format!("Name:\tworker\nState:\tS (sleeping)\nTgid:\t4242\nNSpid:\t{nspid}\nPPid:\t1\n")
    }

    fn gpu(pids: &[u32]) -> Gpu {
        Gpu {
            index: 0,
            uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
            name: "Test".into(),
            utilization_percent: Some(50),
            memory_used: 1 << 30,
            memory_total: 8 << 30,
            processes: pids
                .iter()
                .map(|p| GpuProcess {
                    pid: *p,
                    used_bytes: Some(u64::from(*p) << 20),
                })
                .collect(),
        }
    }

    fn part(pid: u32, pid_ns: u32, role: &str) -> Participant {
        Participant {
            pid,
            pid_ns,
            role: role.into(),
        }
    }

    #[test]
    fn nspid_and_namespace_links_parse_and_garbage_gives_nothing() {
        assert_eq!(ns_pids(&status("4242")), vec![4242]);
        assert_eq!(ns_pids(&status("4242\t17\t3")), vec![4242, 17, 3]);
        assert_eq!(ns_pids("Name:\tx\n"), Vec::<u32>::new());
        assert_eq!(ns_inode("pid:[4026531836]"), Some(4026531836));
        assert_eq!(ns_inode("net:[4026531836]"), None);
        assert_eq!(ns_inode("pid:[x]"), None);
    }

    #[test]
    fn a_container_participant_is_matched_through_its_innermost_nspid_and_namespace() {
        let root_ns = 4026531836u32;
        let box_ns = 4026532999u32;
        let procs = |pid: u32| -> ProcFacts {
            match pid {
                // The host's view of a process that is pid 7 in a container.
                9001 => Some((status("9001\t7"), format!("pid:[{box_ns}]"))),
                // A root-namespace process.
                500 => Some((status("500"), format!("pid:[{root_ns}]"))),
                // Another process that is also pid 7, in another container.
                9002 => Some((status("9002\t7"), "pid:[4026533111]".into())),
                _ => None,
            }
        };
        let parts = [
            part(7, box_ns, "producer of frames"),
            part(500, root_ns, "consumer 0 of frames"),
            part(500, root_ns, "registry r"),
            part(33, box_ns, "consumer 1 of frames"),
        ];
        let m = match_processes(&[gpu(&[9001, 500, 9002])], &parts, ROOT_PID_NS, procs);
        assert_eq!(m.processes.len(), 3);
        assert_eq!(m.processes[0].participants, vec![parts[0].clone()]);
        assert_eq!(
            m.processes[1].participants,
            vec![parts[1].clone(), parts[2].clone()]
        );
        assert!(
            m.processes[2].participants.is_empty(),
            "same inner pid, other namespace"
        );
        assert_eq!(m.unmatched.len(), 1);
        assert_eq!(m.unmatched[0].0, parts[3]);
        assert!(m.unmatched[0].1.contains("holds no device memory"));
    }

    #[test]
    fn pids_invisible_here_are_said_to_be_why_a_participant_is_unmatched() {
        let m = match_processes(
            &[gpu(&[1234])],
            &[part(7, 99, "producer of x")],
            ROOT_PID_NS,
            |_| None,
        );
        assert!(m.processes[0].participants.is_empty());
        assert!(
            m.unmatched[0].1.contains("not visible"),
            "{:?}",
            m.unmatched
        );
        // Without a namespace inode, the root pid itself.
        let m = match_processes(
            &[gpu(&[1234])],
            &[part(1234, 0, "old")],
            ROOT_PID_NS,
            |_| Some((status("1234"), "pid:[1]".into())),
        );
        assert_eq!(m.processes[0].participants.len(), 1);
        assert!(m.unmatched.is_empty());
    }

    #[test]
    fn the_gpu_section_names_processes_participants_and_the_unmatched() {
        let parts = [
            part(7, 11, "producer of frames"),
            part(8, 11, "consumer 0 of frames"),
        ];
        let m = match_processes(&[gpu(&[9001, 500])], &parts, ROOT_PID_NS, |pid| match pid {
            9001 => Some((status("9001\t7"), "pid:[11]".into())),
            _ => Some((status("500"), format!("pid:[{ROOT_PID_NS}]"))),
        });
        let t = render(
            &GpuState::Found {
                gpus: vec![gpu(&[9001, 500])],
            },
            &m,
        );
        assert!(t.starts_with("gpu 0 GPU-00000000-0000-0000-0000-000000000000: Test, utilization 50%, memory 1.0 GiB of 8.0 GiB\n"), "{t}");
        assert!(
            t.contains("  pid 9001 holds 8.8 GiB: producer of frames\n"),
            "{t}"
        );
        assert!(
            t.contains("  pid 500 holds 500.0 MiB: no participant"),
            "{t}"
        );
        assert!(
            t.contains(
                "  not matched: consumer 0 of frames (pid 8, pid ns 11): no GPU process matched"
            ),
            "{t}"
        );
        let t = render(
            &GpuState::Missing {
                reason: "NVML not found: x".into(),
            },
            &Matching::default(),
        );
        assert_eq!(t, "gpu: NVML not found: x\n");
    }

    #[test]
    fn without_nvml_the_state_says_so_plainly() {
        // On this machine (no GPU in CI) NVML is missing; on a GPU machine it is found. Either way
        // the answer is one of the two, never a panic.
        match query() {
            GpuState::Found { gpus } => {
                assert!(gpus.iter().all(|g| g.memory_total >= g.memory_used))
            }
            GpuState::Missing { reason } => assert!(reason.starts_with("NVML not"), "{reason}"),
        }
    }

    #[test]
    fn across_pid_namespaces_device_memory_is_said_unknown_never_none_held() {
        let other = 4026532999u32;
        let me_elsewhere = 4026533111u32;
        let producer = part(7, other, "producer of frames");
        let host = part(500, ROOT_PID_NS, "consumer 0 of frames");
        // This command in another pid namespace than NVML's: unknown, whichever namespace the
        // participant is in.
        for p in [&producer, &host] {
            let why = unmatched_reason(p, me_elsewhere, 0, 0);
            assert!(why.starts_with("device memory not known"), "{why}");
            assert!(
                why.contains(&format!("pid namespace {me_elsewhere}")),
                "{why}"
            );
            assert!(!why.contains("holds no device memory"), "{why}");
        }
        assert!(
            unmatched_reason(&producer, me_elsewhere, 0, 0).contains(&format!(
                "it is in pid namespace {other}, another than NVML's pids"
            ))
        );
        // Our own namespace unreadable: unknown as well.
        assert!(unmatched_reason(&producer, 0, 0, 0).starts_with("device memory not known"));
        // In the root namespace: a container participant whose namespace cannot be mapped (no
        // NSpid) is unknown; once every NVML pid is mapped, it holds none.
        let why = unmatched_reason(&producer, ROOT_PID_NS, 0, 1);
        assert!(why.starts_with("device memory not known"), "{why}");
        assert!(why.contains("no NSpid"), "{why}");
        assert!(unmatched_reason(&producer, ROOT_PID_NS, 0, 0).contains("holds no device memory"));
        assert!(unmatched_reason(&host, ROOT_PID_NS, 0, 3).contains("holds no device memory"));
        assert!(unmatched_reason(&host, ROOT_PID_NS, 2, 0).contains("not visible"));
    }

    #[test]
    fn from_another_pid_namespace_nvml_pids_are_not_looked_up_and_nothing_is_matched() {
        let asked = std::cell::Cell::new(0);
        let parts = [part(7, 4026532999, "producer of frames")];
        // Pid 7 here may be any process: the host's pid 9001 must not be read in this /proc.
        let m = match_processes(&[gpu(&[9001])], &parts, 4026533111, |_| {
            asked.set(asked.get() + 1);
            Some((status("9001\t7"), "pid:[4026532999]".into()))
        });
        assert_eq!(asked.get(), 0);
        assert!(!m.mapped);
        assert!(m.processes[0].participants.is_empty());
        assert!(m.unmatched[0].1.starts_with("device memory not known"));
        let t = render(
            &GpuState::Found {
                gpus: vec![gpu(&[9001])],
            },
            &m,
        );
        assert!(
            t.contains("  pid 9001 holds 8.8 GiB: whether it is a participant is not known"),
            "{t}"
        );
        assert!(
            t.contains("  not matched: producer of frames (pid 7, pid ns 4026532999): device memory not known"),
            "{t}"
        );
        assert!(!t.contains("holds no device memory"), "{t}");
    }

    const UNSHARED_ROLE: &str = "CUDA_IPC_TEST_UNSHARED_HOST_PID";

    #[test]
    fn ls_run_under_unshare_pid_says_device_memory_is_not_known() {
        const TEST: &str = "gpu::tests::ls_run_under_unshare_pid_says_device_memory_is_not_known";
        if let Ok(host_pid) = std::env::var(UNSHARED_ROLE) {
            // In the new pid namespace: NVML (faked) lists the parent by its host pid, and this
            // process is the participant, by its pid here.
            let me = cuda_ipc::identity::ProcessIdentity::current().unwrap();
            let m = match_processes(
                &[gpu(&[host_pid.parse().unwrap()])],
                &[part(me.pid, me.pid_ns, "producer of frames")],
                own_pid_ns(),
                proc_facts,
            );
            println!("\nown {} pid {}", own_pid_ns(), me.pid);
            for (p, why) in &m.unmatched {
                println!("reason {}: {why}", p.role);
            }
            return;
        }
        if !rustix::process::geteuid().is_root() {
            println!("skipped: unshare --pid needs root");
            return;
        }
        let o = std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc"])
            .arg(std::env::current_exe().unwrap())
            .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(UNSHARED_ROLE, std::process::id().to_string())
            .output();
        let o = match o {
            Ok(o) => o,
            Err(e) => {
                println!("skipped: unshare cannot be run: {e}");
                return;
            }
        };
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let own: u32 = out
            .lines()
            .find_map(|l| l.strip_prefix("own "))
            .and_then(|l| l.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{out}"));
        assert_ne!(own, own_pid_ns(), "a pid namespace of its own: {out}");
        assert_ne!(own, ROOT_PID_NS, "{out}");
        let reason = out
            .lines()
            .find_map(|l| l.strip_prefix("reason producer of frames: "))
            .unwrap_or_else(|| panic!("{out}"));
        assert!(reason.starts_with("device memory not known"), "{reason}");
        assert!(!reason.contains("holds no device memory"), "{reason}");
    }
}
