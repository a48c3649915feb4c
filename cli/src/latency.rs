//! The hand-off latency histogram of a consumer (publish → take), as this tool shows and exports
//! it: 32 log2 buckets of microseconds and their sum.
//!
//! Bucket `i` counts hand-offs that took less than 2^i µs (and at least 2^(i-1) µs, for `i > 0`);
//! the last bucket also counts everything slower: the channel's own buckets
//! (`cuda_ipc::channel::LatencyHistogram`, recorded in its shared memory per consumer slot since
//! layout version 5). [`of_consumer`] is the one place that reads them.

#[cfg(test)]
use cuda_ipc::channel::LatencyHistogram;
use cuda_ipc::channel::inspect::ConsumerSnapshot;

/// Number of buckets.
pub const BUCKETS: usize = cuda_ipc::channel::LATENCY_BUCKETS;

/// A latency histogram: counts per log2-µs bucket, and the sum of every latency counted, in µs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LatencyBuckets {
    /// Hand-offs per bucket (bucket `i`: under 2^i µs).
    pub counts: [u64; BUCKETS],
    /// Sum of the latencies counted, µs.
    pub sum_us: u64,
}

impl LatencyBuckets {
    /// The upper bound of bucket `i` in µs (`f64::INFINITY` for the last).
    pub fn upper_us(i: usize) -> f64 {
        if i + 1 >= BUCKETS {
            f64::INFINITY
        } else {
            (1u64 << i) as f64
        }
    }

    /// Hand-offs counted.
    pub fn count(&self) -> u64 {
        self.counts.iter().fold(0u64, |a, c| a.saturating_add(*c))
    }

    /// The bound (µs) under which a fraction `q` (0 to 1) of the hand-offs fell: the upper bound of
    /// the bucket where the running count reaches `q` of the total; `None` when nothing was counted.
    pub fn quantile_upper_us(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let want = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut run = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            run = run.saturating_add(*c);
            if run >= want {
                return Some(Self::upper_us(i));
            }
        }
        Some(f64::INFINITY)
    }

    /// Adds `other` into this one (the channel's histogram from its consumers').
    pub fn merge(&mut self, other: &LatencyBuckets) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a = a.saturating_add(*b);
        }
        self.sum_us = self.sum_us.saturating_add(other.sum_us);
    }
}

/// LATENCY SOURCE: the histogram of consumer `c`, from its snapshot (the channel layout's
/// per-consumer histogram, recorded by the consumer at each take; the same buckets as here).
pub fn of_consumer(c: &ConsumerSnapshot) -> LatencyBuckets {
    LatencyBuckets {
        counts: c.latency.buckets,
        sum_us: c.latency.sum_us,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_bounds_quantiles_and_merging() {
        assert_eq!(LatencyBuckets::upper_us(0), 1.0);
        assert_eq!(LatencyBuckets::upper_us(4), 16.0);
        assert_eq!(LatencyBuckets::upper_us(31), f64::INFINITY);
        let mut a = LatencyBuckets::default();
        assert_eq!(a.quantile_upper_us(0.5), None);
        a.counts[4] = 90; // 8..16 µs
        a.counts[8] = 10; // 128..256 µs
        a.sum_us = 90 * 12 + 10 * 200;
        assert_eq!(a.count(), 100);
        assert_eq!(a.quantile_upper_us(0.5), Some(16.0));
        assert_eq!(a.quantile_upper_us(0.99), Some(256.0));
        let mut b = a;
        b.merge(&a);
        assert_eq!((b.count(), b.sum_us), (200, 2 * a.sum_us));
    }

    #[test]
    fn the_buckets_are_the_channels_own() {
        for k in 0..BUCKETS - 1 {
            assert_eq!(
                LatencyBuckets::upper_us(k),
                LatencyHistogram::upper_bound_us(k) as f64,
                "bucket {k}"
            );
        }
        assert!(LatencyBuckets::upper_us(BUCKETS - 1).is_infinite());
        assert_eq!(LatencyHistogram::upper_bound_us(BUCKETS - 1), u64::MAX);
    }
}
