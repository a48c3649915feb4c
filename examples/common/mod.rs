//! Helpers shared by the examples (`mod common;`): the clock every process of a machine agrees on,
//! and the frame metadata the producers publish.

// Each example uses a subset of these.
#![allow(dead_code)]

/// CLOCK_MONOTONIC in ns: the same clock in every process of the machine, so a time taken in one
/// process can be compared with one taken in another.
pub fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// The metadata the examples publish with a frame: four little-endian u64 words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameMeta {
    /// Frame index (0, 1, ...); also the seed of the frame's fill pattern.
    pub index: u64,
    /// Width in pixels.
    pub width: u64,
    /// Height in pixels.
    pub height: u64,
    /// When the producer called `publish`, in ns of CLOCK_MONOTONIC ([`now_ns`]).
    pub stamp_ns: u64,
}

impl FrameMeta {
    /// Bytes of the encoded form.
    pub const LEN: usize = 32;

    /// The 32-byte encoding.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut m = [0u8; Self::LEN];
        for (k, w) in [self.index, self.width, self.height, self.stamp_ns]
            .iter()
            .enumerate()
        {
            m[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        m
    }

    /// Decodes metadata written by [`FrameMeta::encode`]; `None` when it is shorter than 32 bytes.
    pub fn decode(m: &[u8]) -> Option<FrameMeta> {
        let word = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(
                m.get(i * 8..i * 8 + 8)?.try_into().ok()?,
            ))
        };
        Some(FrameMeta {
            index: word(0)?,
            width: word(1)?,
            height: word(2)?,
            stamp_ns: word(3)?,
        })
    }
}
