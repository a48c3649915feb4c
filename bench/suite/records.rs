//! Measurement records (one number each, with its unit), distributions, and the CSV form.
//!
//! A record: `id` = `bench.impl.scenario.metric.stat` (stable, for the report's look-ups), the same
//! parts as fields, `value`, `unit`, `n` (samples behind it) and `params` (how it was run). The
//! Python baselines write records of the same shape.

use serde_json::{Value, json};

/// Names a group of records: which benchmark, which implementation, which scenario.
#[derive(Clone, Debug)]
pub struct Key {
    /// `handoff`, `throughput`, `zerocopy`, `import`, `registry` or `limits`.
    pub bench: String,
    /// `channel`, `floor`, `cuda_ipc`, `futex_pingpong`, ...
    pub imp: String,
    /// e.g. `spin.idle`, `c4.spin-then-block`, `4K`.
    pub scenario: String,
    /// How it was run, e.g. `frames=3000 gap_us=1000`.
    pub params: String,
}

impl Key {
    /// A key from its parts.
    pub fn new(bench: &str, imp: &str, scenario: &str, params: impl Into<String>) -> Key {
        Key {
            bench: bench.into(),
            imp: imp.into(),
            scenario: scenario.into(),
            params: params.into(),
        }
    }

    /// One record.
    pub fn rec(&self, metric: &str, stat: &str, value: f64, unit: &str, n: usize) -> Value {
        json!({
            "id": format!("{}.{}.{}.{}.{}", self.bench, self.imp, self.scenario, metric, stat),
            "bench": self.bench,
            "impl": self.imp,
            "scenario": self.scenario,
            "metric": metric,
            "stat": stat,
            "value": if value.is_finite() { json!(round(value)) } else { Value::Null },
            "unit": unit,
            "n": n,
            "params": self.params,
        })
    }

    /// The distribution of `samples_ns` (ns) as records in µs: min, p10, p25, p50, p75, p90, p99,
    /// p99.9, max, mean. Nothing when there are no samples.
    pub fn dist_us(&self, metric: &str, samples_ns: &[f64]) -> Vec<Value> {
        self.dist(metric, samples_ns, 1e-3, "us")
    }

    /// As [`Key::dist_us`] with any scale and unit.
    pub fn dist(&self, metric: &str, samples: &[f64], scale: f64, unit: &str) -> Vec<Value> {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Vec::new();
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let mean = v.iter().sum::<f64>() / n as f64;
        let mut out = Vec::new();
        for (stat, x) in [
            ("min", v[0]),
            ("p10", percentile(&v, 0.10)),
            ("p25", percentile(&v, 0.25)),
            ("p50", percentile(&v, 0.50)),
            ("p75", percentile(&v, 0.75)),
            ("p90", percentile(&v, 0.90)),
            ("p99", percentile(&v, 0.99)),
            ("p99.9", percentile(&v, 0.999)),
            ("max", v[n - 1]),
            ("mean", mean),
        ] {
            out.push(self.rec(metric, stat, x * scale, unit, n));
        }
        out
    }
}

/// Nearest-rank percentile of sorted `v` (`p` in 0..=1).
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = (p * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// The median of unsorted samples.
pub fn median(samples: &[f64]) -> f64 {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

fn round(x: f64) -> f64 {
    if x.abs() >= 1000.0 {
        (x * 10.0).round() / 10.0
    } else {
        (x * 1000.0).round() / 1000.0
    }
}

/// The records as CSV: `id,bench,impl,scenario,metric,stat,value,unit,n,params`.
pub fn to_csv(records: &[Value]) -> String {
    const COLS: [&str; 10] = [
        "id", "bench", "impl", "scenario", "metric", "stat", "value", "unit", "n", "params",
    ];
    let mut s = COLS.join(",");
    s.push('\n');
    for r in records {
        let cells: Vec<String> = COLS
            .iter()
            .map(|c| match r.get(*c) {
                Some(Value::String(t)) => csv_cell(t),
                Some(Value::Null) | None => String::new(),
                Some(v) => v.to_string(),
            })
            .collect();
        s.push_str(&cells.join(","));
        s.push('\n');
    }
    s
}

fn csv_cell(t: &str) -> String {
    if t.contains([',', '"', '\n']) {
        format!("\"{}\"", t.replace('"', "\"\""))
    } else {
        t.to_string()
    }
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Days since 1970-01-01 to a civil date (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
    }

    #[test]
    fn csv_quotes_cells_that_need_it() {
        let k = Key::new("b", "i", "s", "a=1, b=\"2\"");
        let csv = to_csv(&[k.rec("m", "p50", 1.5, "us", 3)]);
        let line = csv.lines().nth(1).unwrap();
        assert_eq!(
            line,
            "b.i.s.m.p50,b,i,s,m,p50,1.5,us,3,\"a=1, b=\"\"2\"\"\""
        );
    }

    #[test]
    fn dates_are_iso_utc() {
        let d = utc_now();
        assert_eq!(d.len(), 20, "{d}");
        assert!(
            d.starts_with("20") && d.ends_with('Z') && &d[10..11] == "T",
            "{d}"
        );
    }
}
