//! `metrics --listen ADDR`: the channels' counters, latency histograms, GPU state and quota
//! budgets in the OpenMetrics text format (`prometheus-client`), served on `GET /metrics` by
//! hyper on a tokio runtime of one thread ([`server`]: bounded connections, read and write
//! deadlines, one request per connection) bound to the address the user names (loopback by
//! default).
//! Every scrape takes a fresh [`Sample`]: nothing is kept between scrapes, so the counters are
//! the segments' own.

pub mod server;

use crate::Outcome;
use crate::latency::{BUCKETS, LatencyBuckets};
use crate::quota::device_name;
use crate::state::{self, Sample};
use cuda_ipc::identity::Liveness;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use server::Limits;
use std::error::Error;

/// The default address: loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9464";

/// The content type of the OpenMetrics text format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;

fn labels(pairs: &[(&str, String)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// Latency histograms with their label sets, encoded from their buckets (the channel keeps the
/// counts; nothing is observed here).
#[derive(Debug, Default)]
struct Histograms(Vec<(Labels, LatencyBuckets)>);

impl EncodeMetric for Histograms {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (l, h) in &self.0 {
            let buckets: Vec<(f64, u64)> = (0..BUCKETS)
                .map(|i| (LatencyBuckets::upper_us(i) / 1e6, h.counts[i]))
                .collect();
            encoder.encode_family(l)?.encode_histogram::<NoLabelSet>(
                h.sum_us as f64 / 1e6,
                h.count(),
                &buckets,
                None,
            )?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

fn gauge_family() -> Family<Labels, Gauge> {
    Family::default()
}

fn counter_family() -> Family<Labels, Counter> {
    Family::default()
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The OpenMetrics text of one sample (ends with `# EOF`).
pub fn encode(s: &Sample) -> Result<String, std::fmt::Error> {
    let mut reg = Registry::with_prefix("cuda_ipc");

    let published = counter_family();
    let forced = counter_family();
    let head = gauge_family();
    let producer_alive = gauge_family();
    let consumers = gauge_family();
    let received = counter_family();
    let dropped = counter_family();
    let lag = gauge_family();
    let in_flight = gauge_family();
    let mut hist = Histograms::default();
    for c in &s.listing.channels {
        let c = &c.snapshot;
        let ch = labels(&[("channel", c.name.clone())]);
        published.get_or_create(&ch).inc_by(c.published);
        forced.get_or_create(&ch).inc_by(c.forced_releases);
        head.get_or_create(&ch).set(clamp(c.head));
        producer_alive
            .get_or_create(&ch)
            .set(i64::from(c.producer_liveness != Liveness::Dead));
        consumers.get_or_create(&ch).set(c.consumers.len() as i64);
        for x in &c.consumers {
            let l = labels(&[
                ("channel", c.name.clone()),
                ("consumer", x.index.to_string()),
                ("pid", x.identity.pid.to_string()),
            ]);
            received.get_or_create(&l).inc_by(x.received);
            dropped.get_or_create(&l).inc_by(x.dropped);
            lag.get_or_create(&l).set(clamp(x.lag));
            in_flight.get_or_create(&l).set(x.holds.len() as i64);
            let h = s
                .latency
                .get(&(c.name.clone(), x.index))
                .copied()
                .unwrap_or_default();
            hist.0.push((l, h));
        }
    }
    reg.register(
        "channel_published",
        "Frames the channel's producer published",
        published,
    );
    reg.register(
        "channel_forced_releases",
        "Holds the producer forced free (dead or stalled consumers)",
        forced,
    );
    reg.register("channel_head", "The latest sequence number published", head);
    reg.register(
        "channel_producer_alive",
        "1 while the producer runs (alive or unknown), 0 when it is dead",
        producer_alive,
    );
    reg.register(
        "channel_consumers",
        "Consumers attached to the channel",
        consumers,
    );
    reg.register(
        "consumer_received",
        "Frames the consumer received",
        received,
    );
    reg.register(
        "consumer_dropped",
        "Frames a latest-only consumer skipped",
        dropped,
    );
    reg.register(
        "consumer_lag",
        "Frames published that the consumer has not reached (head - cursor)",
        lag,
    );
    reg.register(
        "consumer_in_flight",
        "Frames the consumer holds now (received, not yet released)",
        in_flight,
    );
    reg.register_with_unit(
        "consumer_handoff_latency",
        "Publish to take, per consumer (log2 buckets of microseconds)",
        Unit::Seconds,
        hist,
    );

    let ts_generation = gauge_family();
    let ts_writer_alive = gauge_family();
    let ts_readers = gauge_family();
    let ts_holds = gauge_family();
    let ts_bytes = gauge_family();
    let ts_holders = gauge_family();
    let ts_bridge = gauge_family();
    let ts_bridge_generations = gauge_family();
    for v in &s.listing.tensor_sets {
        let t = &v.snapshot;
        let l = labels(&[("tensorset", t.name.clone())]);
        ts_generation.get_or_create(&l).set(clamp(t.generation));
        ts_writer_alive
            .get_or_create(&l)
            .set(i64::from(t.writer_liveness != Liveness::Dead));
        ts_readers.get_or_create(&l).set(t.readers.len() as i64);
        ts_holds.get_or_create(&l).set(i64::from(t.holds));
        ts_bytes.get_or_create(&l).set(clamp(t.bytes));
        ts_holders.get_or_create(&l).set(t.live_holders() as i64);
        if let Some(b) = &v.bridge {
            let bl = labels(&[
                ("tensorset", t.name.clone()),
                ("role", b.role.clone()),
                ("transport", b.transport.clone()),
                ("path", b.path.clone()),
            ]);
            ts_bridge.get_or_create(&bl).set(i64::from(b.alive));
            ts_bridge_generations.get_or_create(&l).set(clamp(b.frames));
        }
    }
    reg.register(
        "tensorset_generation",
        "The newest generation the tensor set's writer published",
        ts_generation,
    );
    reg.register(
        "tensorset_writer_alive",
        "1 while the writer runs (alive or unknown), 0 when it is dead",
        ts_writer_alive,
    );
    reg.register(
        "tensorset_readers",
        "Readers attached to the tensor set",
        ts_readers,
    );
    reg.register(
        "tensorset_holds",
        "Generations held by readers now (one per reader and buffer)",
        ts_holds,
    );
    reg.register(
        "tensorset_holders",
        "Live processes besides the writer that serve the tensor set's fds (holders, serving readers); each pins its device memory",
        ts_holders,
    );
    reg.register(
        "tensorset_bridge",
        "1 while a tensor-set bridge of the set runs (0: its status file outlived it); its role, \
         UCX transport and path (gpu-direct, host-staged, host) as labels",
        ts_bridge,
    );
    reg.register(
        "tensorset_bridge_generations",
        "Generations the set's tensor-set bridge has mirrored since it started",
        ts_bridge_generations,
    );
    reg.register_with_unit(
        "tensorset_memory",
        "Bytes of the tensor set's buffers (buffers x bytes per buffer)",
        Unit::Bytes,
        ts_bytes,
    );

    let nvml = gauge_family();
    nvml.get_or_create(&Vec::new())
        .set(i64::from(s.gpu.missing().is_none()));
    reg.register(
        "nvml_available",
        "1 when NVML answered, 0 when it is missing (GPU metrics absent)",
        nvml,
    );
    let util = gauge_family();
    let used = gauge_family();
    let total = gauge_family();
    for g in s.gpu.gpus() {
        let l = labels(&[("gpu", g.index.to_string()), ("uuid", g.uuid.clone())]);
        if let Some(u) = g.utilization_percent {
            util.get_or_create(&l).set(i64::from(u));
        }
        used.get_or_create(&l).set(clamp(g.memory_used));
        total.get_or_create(&l).set(clamp(g.memory_total));
    }
    reg.register(
        "gpu_utilization_percent",
        "Percent of the last sample period in which a kernel ran (NVML)",
        util,
    );
    reg.register_with_unit(
        "gpu_memory_used",
        "Device memory in use (NVML)",
        Unit::Bytes,
        used,
    );
    reg.register_with_unit(
        "gpu_memory_total",
        "Device memory in all (NVML)",
        Unit::Bytes,
        total,
    );
    let proc_mem = gauge_family();
    for p in &s.matching.processes {
        let roles: Vec<&str> = p.participants.iter().map(|x| x.role.as_str()).collect();
        let l = labels(&[
            ("gpu", p.gpu.to_string()),
            ("pid", p.process.pid.to_string()),
            ("participant", roles.join("; ")),
        ]);
        proc_mem
            .get_or_create(&l)
            .set(clamp(p.process.used_bytes.unwrap_or(0)));
    }
    reg.register_with_unit(
        "gpu_process_memory",
        "Device memory each process holds (NVML; root pid namespace pids), with the participants it is",
        Unit::Bytes,
        proc_mem,
    );

    let matched = gauge_family();
    if s.gpu.missing().is_none() {
        let mut seen = std::collections::BTreeSet::new();
        for p in &s.matching.processes {
            for x in &p.participants {
                if seen.insert((x.role.clone(), x.pid)) {
                    let l = labels(&[("role", x.role.clone()), ("pid", x.pid.to_string())]);
                    matched.get_or_create(&l).set(1);
                }
            }
        }
        for (x, _) in &s.matching.unmatched {
            let l = labels(&[("role", x.role.clone()), ("pid", x.pid.to_string())]);
            matched.get_or_create(&l).set(0);
        }
    }
    reg.register(
        "participant_gpu_matched",
        "1 when a channel or registry participant was matched to an NVML process, 0 when not (no device memory, or its pid not visible here); absent without NVML",
        matched,
    );

    let budget = gauge_family();
    let q_used = gauge_family();
    let holders = gauge_family();
    for q in &s.quotas {
        let l = labels(&[
            ("device", device_name(&q.device)),
            ("scope", q.scope.to_string()),
        ]);
        if let Some(b) = q.budget {
            budget.get_or_create(&l).set(clamp(b));
        }
        q_used.get_or_create(&l).set(clamp(q.used));
        holders.get_or_create(&l).set(q.holders.len() as i64);
    }
    reg.register_with_unit(
        "quota_budget",
        "The device's budget across processes (absent: unlimited)",
        Unit::Bytes,
        budget,
    );
    reg.register_with_unit(
        "quota_used",
        "Bytes reserved from the budget by live producers (and by dead ones whose host memory is still in /dev/shm)",
        Unit::Bytes,
        q_used,
    );
    reg.register(
        "quota_holders",
        "Reservations in the ledger: live holders, and dead ones whose host memory is still in /dev/shm",
        holders,
    );

    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &reg)?;
    Ok(out)
}

/// `cuda-ipc metrics [--listen ADDR] [NAME]`: serves until killed, within `limits` (connections
/// at once, read and write deadlines: see [`server`]). A NAME that `ls` refuses (a process's own
/// file) is refused (exit status 1) before anything listens; one that names nothing now is said
/// once on stderr at the start, and served on ([`names_nothing`]).
pub fn run(listen: &str, name: Option<&str>, limits: Limits) -> Result<Outcome, Box<dyn Error>> {
    // What `ls NAME` refuses is refused here too, before anything listens; a NAME that names
    // nothing now is said once, and served on (it may appear later).
    let nothing = match name {
        Some(n) => names_nothing(n)?,
        None => None,
    };
    let listener = std::net::TcpListener::bind(listen)
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let addr = listener
        .local_addr()
        .map_or_else(|_| listen.to_string(), |a| a.to_string());
    out!("serving OpenMetrics on http://{addr}/metrics");
    // A log line, not stdout: scripts read the address from the first line and may close the
    // pipe after it.
    tracing::info!(
        "at most {} connections at once (more are answered 503), {} ms to send a request, {} ms to take a response",
        limits.max_connections,
        limits.read_timeout.as_millis(),
        limits.write_timeout.as_millis()
    );
    if let Some(why) = nothing {
        eprintln!("cuda-ipc: warning: {why}; serving anyway: its metrics appear once it does");
    }
    if let Some(why) = state::sample(name, true).gpu.missing() {
        eprintln!("cuda-ipc: {why}");
    }
    let name = name.map(str::to_string);
    server::serve(
        listener,
        limits,
        move |req| respond(req, name.as_deref()),
        std::future::pending(),
    )
    .map_err(|e| format!("metrics endpoint on {addr} stopped: {e}"))?;
    Ok(Outcome::Ok)
}

/// What `metrics NAME` says of `name` at its start, by `ls NAME`'s rule (`crate::listing::targets`
/// and its reading): an error for what `ls` refuses (a process's own file, `NoTarget::Refused`);
/// `Some(why)` when it names nothing now, neither an object (`no registry, channel or tensor set
/// named …`, `nothing stands at …`) nor anything that can be read (a FIFO, a file that is no
/// registry: what `ls` says of it); `None` when it names something.
fn names_nothing(name: &str) -> Result<Option<String>, Box<dyn Error>> {
    use crate::listing::NoTarget;
    let t = match crate::listing::targets(Some(name)) {
        Ok(t) => t,
        Err(e) => {
            return match e.downcast_ref::<NoTarget>() {
                Some(NoTarget::Refused(_)) => Err(e),
                _ => Ok(Some(e.to_string())),
            };
        }
    };
    if t.ledger.is_some() {
        return Ok(None);
    }
    let l = crate::listing::collect(&t);
    if !(l.registries.is_empty()
        && l.channels.is_empty()
        && l.tensor_sets.is_empty()
        && l.sets_without_manifest.is_empty()
        && l.host_pools.is_empty())
    {
        return Ok(None);
    }
    let mut why: Vec<String> = l
        .errors
        .iter()
        .map(|e| format!("{} {}: cannot read: {}", e.kind, e.name, e.error))
        .collect();
    why.extend(
        l.closed_meanwhile
            .iter()
            .map(|c| format!("{} {}: closed meanwhile", c.kind, c.name)),
    );
    Ok(Some(format!(
        "{name} names nothing that can be read now: {}",
        why.join("; ")
    )))
}

/// The answer to one request: `GET /metrics` a fresh sample, `/` a line saying where they are.
fn respond(req: &server::Request, name: Option<&str>) -> server::Response {
    let get = matches!(req.method, "GET" | "HEAD");
    match (get, req.path) {
        (true, "/metrics") => match encode(&state::sample(name, true)) {
            Ok(text) => server::Response {
                status: 200,
                content_type: CONTENT_TYPE,
                body: text.into_bytes(),
            },
            Err(e) => server::Response::text(500, format!("encoding failed: {e}\n")),
        },
        (true, "/") => {
            server::Response::text(200, "cuda-ipc metrics: GET /metrics (OpenMetrics text)\n")
        }
        (true, _) => server::Response::text(404, "not found; try /metrics\n"),
        (false, _) => server::Response::text(405, "only GET\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{Gpu, GpuProcess, GpuState, Participant, match_processes};

    #[test]
    fn gpu_state_and_participants_are_exported_as_nvml_gave_them() {
        let gpus = vec![Gpu {
            index: 0,
            uuid: "GPU-11111111-2222-3333-4444-555555555555".into(),
            name: "Test".into(),
            utilization_percent: Some(37),
            memory_used: 3 << 30,
            memory_total: 8 << 30,
            processes: vec![GpuProcess {
                pid: 9001,
                used_bytes: Some(512 << 20),
            }],
        }];
        let parts = [
            Participant {
                pid: 7,
                pid_ns: 11,
                role: "producer of frames".into(),
            },
            Participant {
                pid: 8,
                pid_ns: 11,
                role: "consumer 0 of frames".into(),
            },
        ];
        let matching = match_processes(&gpus, &parts, crate::gpu::ROOT_PID_NS, |_| {
            Some(("NSpid:\t9001\t7\n".into(), "pid:[11]".into()))
        });
        let s = Sample {
            listing: Default::default(),
            quotas: vec![],
            quota_errors: vec![],
            gpu: GpuState::Found { gpus },
            matching,
            latency: Default::default(),
        };
        let t = encode(&s).unwrap();
        for want in [
            "cuda_ipc_nvml_available 1\n",
            "cuda_ipc_gpu_utilization_percent{gpu=\"0\",uuid=\"GPU-11111111-2222-3333-4444-555555555555\"} 37\n",
            "cuda_ipc_gpu_memory_used_bytes{gpu=\"0\",uuid=\"GPU-11111111-2222-3333-4444-555555555555\"} 3221225472\n",
            "cuda_ipc_gpu_memory_total_bytes{gpu=\"0\",uuid=\"GPU-11111111-2222-3333-4444-555555555555\"} 8589934592\n",
            "cuda_ipc_gpu_process_memory_bytes{gpu=\"0\",pid=\"9001\",participant=\"producer of frames\"} 536870912\n",
            "cuda_ipc_participant_gpu_matched{role=\"producer of frames\",pid=\"7\"} 1\n",
            "cuda_ipc_participant_gpu_matched{role=\"consumer 0 of frames\",pid=\"8\"} 0\n",
            "# TYPE cuda_ipc_gpu_memory_used_bytes gauge\n",
            "# UNIT cuda_ipc_gpu_memory_used_bytes bytes\n",
        ] {
            assert!(t.contains(want), "missing {want:?} in\n{t}");
        }
        assert!(t.ends_with("# EOF\n"), "{t}");
    }
}
