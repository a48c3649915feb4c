//! The channel's counters: what a consumer's slot and the header count (frames received and
//! dropped, forced releases, the hand-off latency histogram), and the copies of them that
//! `Control::stats` and inspection hand out. Never calls CUDA.

use super::control::Control;
use super::layout::{ACTIVE, LATENCY_BUCKETS, latency_bucket};
use crate::sync::Ordering;

/// Counters of one consumer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Consumer slot index.
    pub index: usize,
    /// Its process.
    pub pid: u32,
    /// Frames received.
    pub received: u64,
    /// Frames skipped (latest-only delivery, or published before it could take them).
    pub dropped: u64,
    /// Frames it holds now.
    pub in_flight: u32,
    /// Frames published that it has not received or skipped: `head - cursor`.
    pub lag: u64,
    /// Its hand-offs by latency, publish to take.
    pub latency: LatencyHistogram,
}

/// Hand-offs by latency, from the producer's publish to the consumer's take (both
/// `CLOCK_MONOTONIC`, so the same clock for every process of one host), as kept in the consumer's
/// slot: `buckets[0]` counts those under 1 µs, `buckets[k]` (1..=30) those of [2^(k-1), 2^k) µs,
/// `buckets[31]` those of 2^30 µs or more.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct LatencyHistogram {
    /// Hand-offs per bucket.
    pub buckets: [u64; LATENCY_BUCKETS],
    /// Sum of the latencies counted, µs (each rounded down to a whole µs).
    pub sum_us: u64,
}

impl LatencyHistogram {
    /// Hand-offs counted.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// The upper bound of bucket `k` in µs (exclusive): 1 for bucket 0, 2^k for the others,
    /// `u64::MAX` for the last.
    pub fn upper_bound_us(k: usize) -> u64 {
        if k + 1 >= LATENCY_BUCKETS {
            u64::MAX
        } else {
            1u64 << k
        }
    }

    /// The upper bound (µs) of the bucket holding quantile `q` (0.0 to 1.0) of the hand-offs;
    /// `None` when none was counted.
    pub fn quantile_upper_us(&self, q: f64) -> Option<u64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let want = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (k, c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Some(Self::upper_bound_us(k));
            }
        }
        Some(u64::MAX)
    }
}

/// `CLOCK_MONOTONIC` now, µs, low 32 bits (the vDSO: no syscall).
#[inline]
pub(crate) fn monotonic_us32() -> u32 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64 * 1_000_000 + t.tv_nsec as u64 / 1000) as u32
}

/// Counters of a channel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChannelStats {
    /// Frames published.
    pub published: u64,
    /// Sequence number of the latest frame.
    pub head: u64,
    /// Holds released by the producer on behalf of dead consumers or at shutdown.
    pub forced_releases: u64,
    /// One entry per attached consumer.
    pub consumers: Vec<ConsumerStats>,
}

impl Control {
    /// Counts one hand-off of a frame published at `publish_us` (`CLOCK_MONOTONIC` µs, low 32
    /// bits) in consumer `c`'s latency histogram: a clock read, the bucket, two stores. Only the
    /// consumer of slot `c` calls it (the words have one writer: load and store, no RMW).
    #[inline]
    pub(crate) fn record_latency(&self, c: usize, publish_us: u32) {
        let s = self.consumer(c);
        // A wrapping difference of two 32-bit µs clocks: right for latencies under 71 minutes.
        let us = u64::from(monotonic_us32().wrapping_sub(publish_us));
        let k = latency_bucket(us);
        // Relaxed: counters, read by inspection only.
        s.latency[k].store(s.latency[k].load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        s.latency_sum_us.store(
            s.latency_sum_us.load(Ordering::Relaxed).wrapping_add(us),
            Ordering::Relaxed,
        );
    }

    /// Consumer slot `c`'s latency histogram.
    pub(crate) fn latency(&self, c: usize) -> LatencyHistogram {
        let s = self.consumer(c);
        let mut h = LatencyHistogram::default();
        for (d, b) in h.buckets.iter_mut().zip(&s.latency) {
            *d = b.load(Ordering::Relaxed);
        }
        h.sum_us = s.latency_sum_us.load(Ordering::Relaxed);
        h
    }

    /// Counters of the channel.
    pub(crate) fn stats(&self) -> ChannelStats {
        let h = self.header();
        let head = self.head();
        let mut consumers = Vec::new();
        for c in 0..self.consumers {
            let s = self.consumer(c);
            // SYNC POINT: attach. Acquire: pairs with the Release store of ACTIVE in `attach`.
            if s.state.load(Ordering::Acquire) != ACTIVE {
                continue;
            }
            let bit = 1u64 << c;
            consumers.push(ConsumerStats {
                index: c,
                pid: s.pid.load(Ordering::Relaxed),
                received: s.received.load(Ordering::Relaxed),
                dropped: s.dropped.load(Ordering::Relaxed),
                in_flight: (0..self.buffers)
                    .filter(|&i| self.buffer(i).hold_mask.load(Ordering::Relaxed) & bit != 0)
                    .count() as u32,
                lag: head.saturating_sub(s.cursor.load(Ordering::Relaxed)),
                latency: self.latency(c),
            });
        }
        ChannelStats {
            // Every publish adds one to head.
            published: head,
            head,
            forced_releases: h.forced_releases.load(Ordering::Relaxed),
            consumers,
        }
    }
}
