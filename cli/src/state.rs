//! One look at everything the monitoring views show (`watch`'s live view, `metrics`): the
//! channels and registries (`ls`'s listing), the quota ledgers, the GPUs through NVML and which
//! participants their processes are, and each consumer's latency histogram.

use crate::gpu::{self, GpuState, Matching, Participant};
use crate::latency::{self, LatencyBuckets};
use crate::listing::{self, Listing};
use cuda_ipc::quota::LedgerSnapshot;
use std::collections::BTreeMap;

/// Everything seen at one moment.
pub struct Sample {
    /// Registries and channels.
    pub listing: Listing,
    /// Quota ledgers (dead holders reclaimed as they were read).
    pub quotas: Vec<LedgerSnapshot>,
    /// Ledgers that could not be read, with why.
    pub quota_errors: Vec<(String, String)>,
    /// GPUs, or why NVML is missing.
    pub gpu: GpuState,
    /// NVML's processes matched to participants.
    pub matching: Matching,
    /// (channel, consumer slot) → its latency histogram.
    pub latency: BTreeMap<(String, usize), LatencyBuckets>,
}

/// The participants of a listing: each channel's producer and consumers, each registry's
/// participants.
pub fn participants(l: &Listing) -> Vec<Participant> {
    let mut v = Vec::new();
    for c in &l.channels {
        let s = &c.snapshot;
        v.push(Participant {
            pid: s.producer.pid,
            pid_ns: s.producer.pid_ns,
            role: format!("producer of {}", s.name),
        });
        for x in &s.consumers {
            v.push(Participant {
                pid: x.identity.pid,
                pid_ns: x.identity.pid_ns,
                role: format!("consumer {} of {}", x.index, s.name),
            });
        }
    }
    for r in &l.registries {
        for p in &r.snapshot.participants {
            v.push(Participant {
                pid: p.identity.pid,
                pid_ns: p.identity.pid_ns,
                role: format!("participant of registry {}", r.snapshot.name),
            });
        }
    }
    v
}

/// Looks at everything once; `name` narrows the channels and registries as for `ls`. NVML is
/// asked only when `with_gpu`.
pub fn sample(name: Option<&str>, with_gpu: bool) -> Sample {
    let listing = match listing::targets(name) {
        Ok(t) => listing::collect(&t),
        Err(e) => Listing {
            errors: vec![listing::SegmentError {
                kind: "segment",
                name: name.unwrap_or_default().to_string(),
                error: e.to_string(),
            }],
            ..Default::default()
        },
    };
    let (quotas, quota_errors) = crate::quota::collect();
    let gpu = if with_gpu {
        gpu::query()
    } else {
        GpuState::Missing {
            reason: "NVML not asked".into(),
        }
    };
    let matching = gpu::match_processes(
        gpu.gpus(),
        &participants(&listing),
        gpu::own_pid_ns(),
        gpu::proc_facts,
    );
    let mut latency = BTreeMap::new();
    for c in &listing.channels {
        for x in &c.snapshot.consumers {
            latency.insert((c.snapshot.name.clone(), x.index), latency::of_consumer(x));
        }
    }
    Sample {
        listing,
        quotas,
        quota_errors,
        gpu,
        matching,
        latency,
    }
}
