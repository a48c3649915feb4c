//! The control messages of a tensor-set bridge ([`SetMsg`], carried as [`Msg::Set`]): the near
//! set's layout, the far set's registered memory and NIXL metadata, a generation's start (which
//! tensors will be written), the far buffer it goes to, its completion and its publication.
//!
//! Encoded as every message of the lane (little-endian integers, strings and byte strings with a
//! `u32` length), behind the session's MAC; a body that does not parse, or whose counts exceed
//! what its bytes can hold, is [`RemoteError::Protocol`](super::RemoteError::Protocol), never a
//! panic or a large allocation.

use super::{Cursor, Msg, protocol, put_bytes};
use crate::error::Result;
use crate::tensorset::{DType, Layout, TensorSpec};

/// The most tensors a layout message may name (each takes more than 40 bytes of the message, so
/// [`super::MAX_MESSAGE`] bounds it first for long names).
pub const MAX_WIRE_TENSORS: usize = 1 << 20;

/// A set's layout on the wire: every tensor's name, dtype, shape, strides (elements), allocation
/// and byte offset, the bytes of each allocation of one buffer, and the layout fingerprint the
/// far side recomputes ([`WireLayout::to_layout`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireLayout {
    /// (spec, allocation, offset) per tensor, in the set's order.
    pub tensors: Vec<(TensorSpec, u32, u64)>,
    /// Bytes of each allocation of one buffer.
    pub allocations: Vec<u64>,
    /// [`Layout::fingerprint`] of the near set.
    pub fingerprint: [u8; 32],
}

impl WireLayout {
    /// The wire form of `layout`.
    pub fn of(layout: &Layout) -> WireLayout {
        WireLayout {
            tensors: layout
                .tensors()
                .iter()
                .map(|t| {
                    (
                        TensorSpec::strided(t.name.clone(), t.dtype, &t.shape, &t.strides),
                        t.allocation,
                        t.offset,
                    )
                })
                .collect(),
            allocations: layout.allocations().to_vec(),
            fingerprint: layout.fingerprint(),
        }
    }

    /// The layout these fields describe, every field checked by [`Layout::with_locations`] (names,
    /// dtypes, sizes, tensors inside their allocations).
    ///
    /// # Errors
    /// [`RemoteError::Protocol`](super::RemoteError::Protocol) when the layout is refused or its
    /// fingerprint is not the one announced.
    pub fn to_layout(&self) -> Result<Layout> {
        let l = Layout::with_locations(&self.tensors, self.allocations.clone())
            .map_err(|e| protocol(&format!("the near set's layout: {e}")))?;
        if l.fingerprint() != self.fingerprint {
            return Err(protocol(
                "the near set's layout does not match its announced fingerprint",
            ));
        }
        Ok(l)
    }

    fn encode(&self, b: &mut Vec<u8>) {
        b.extend_from_slice(&(self.tensors.len() as u32).to_le_bytes());
        for (s, a, o) in &self.tensors {
            put_bytes(b, s.name.as_bytes());
            b.push(s.dtype.code);
            b.push(s.dtype.bits);
            b.extend_from_slice(&s.dtype.lanes.to_le_bytes());
            let strides = s.strides.clone().unwrap_or_default();
            b.push(s.shape.len() as u8);
            for d in s.shape.iter().chain(&strides) {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&a.to_le_bytes());
            b.extend_from_slice(&o.to_le_bytes());
        }
        b.extend_from_slice(&(self.allocations.len() as u32).to_le_bytes());
        for a in &self.allocations {
            b.extend_from_slice(&a.to_le_bytes());
        }
        b.extend_from_slice(&self.fingerprint);
    }

    fn decode(c: &mut Cursor<'_>) -> Result<WireLayout> {
        let n = c.u32()? as usize;
        if n > MAX_WIRE_TENSORS {
            return Err(protocol(&format!(
                "a layout of {n} tensors (at most {MAX_WIRE_TENSORS})"
            )));
        }
        // Each tensor takes at least 25 bytes: never reserve more than the body can hold.
        let mut tensors = Vec::with_capacity(n.min(c.0.len() / 25));
        for _ in 0..n {
            let name = c.string()?;
            let dtype = DType {
                code: c.u8()?,
                bits: c.u8()?,
                lanes: u16::from_le_bytes(c.array()?),
            };
            let ndim = usize::from(c.u8()?);
            let mut dims = Vec::with_capacity(2 * ndim);
            for _ in 0..2 * ndim {
                dims.push(c.u64()? as i64);
            }
            let (shape, strides) = dims.split_at(ndim);
            let a = c.u32()?;
            let o = c.u64()?;
            tensors.push((TensorSpec::strided(name, dtype, shape, strides), a, o));
        }
        let na = c.u32()? as usize;
        let mut allocations = Vec::with_capacity(na.min(c.0.len() / 8));
        for _ in 0..na {
            allocations.push(c.u64()?);
        }
        Ok(WireLayout {
            tensors,
            allocations,
            fingerprint: c.array()?,
        })
    }
}

/// One registered far allocation: its address in the receiving process and its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FarRegion {
    /// Address (host virtual address or `CUdeviceptr`) in the receiving bridge.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A control message of a tensor-set bridge.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SetMsg {
    /// Sender → receiver, first after the handshake: the near set's layout and memory, the
    /// sender's NIXL agent.
    Hello {
        /// The near set's name (for logs; the far set's name is the receiver's).
        set: String,
        /// The near set's memory: 0 host, 1 device.
        kind: u8,
        /// The sender's NIXL agent name.
        agent: String,
        /// The layout.
        layout: WireLayout,
    },
    /// Receiver → sender: the far set exists with this layout; its buffers' registered
    /// allocations (`buffers` × allocations, buffer-major), its agent's metadata, and the near
    /// generation its newest far generation mirrors (0: none known, e.g. a new far set).
    Ready {
        /// The receiver's NIXL agent name.
        agent: String,
        /// The far memory: 0 host, 1 device (with `device`, its ordinal there).
        kind: u8,
        /// Device ordinal in the receiver (0 for host memory).
        device: u32,
        /// Buffers of the far set.
        buffers: u32,
        /// Its registered allocations, buffer-major.
        regions: Vec<FarRegion>,
        /// Near generation mirrored by the far set's newest generation (0: none).
        mirrored: u64,
        /// The receiver's NIXL metadata (`getLocalMD`), its registrations included.
        md: Vec<u8>,
    },
    /// Sender → receiver: near generation `near` (content fingerprint `content`) begins; the
    /// tensors listed will be written (all when `all`); the others are the same as in the
    /// generation the far set mirrors now (near generation `base`), and the receiver fills them
    /// from there.
    Begin {
        /// The near generation.
        near: u64,
        /// Its content fingerprint (all zeros: none).
        content: [u8; 32],
        /// The near generation the unwritten tensors are taken from (0 with `all`).
        base: u64,
        /// Every tensor is written.
        all: bool,
        /// The tensors written, by index, when not `all`.
        tensors: Vec<u32>,
    },
    /// Receiver → sender: far buffer `buffer` takes near generation `near` (no reader holds it,
    /// and on a GPU its last readers' work is done).
    Buffer {
        /// The near generation.
        near: u64,
        /// The far buffer.
        buffer: u32,
    },
    /// Sender → receiver: every WRITE of near generation `near` completed (`writes` of them,
    /// `bytes` in all): publish it once their notifications are in.
    Done {
        /// The near generation.
        near: u64,
        /// WRITEs posted for it.
        writes: u32,
        /// Bytes written.
        bytes: u64,
    },
    /// Receiver → sender: near generation `near` is published as far generation `far`.
    Published {
        /// The near generation.
        near: u64,
        /// Its far generation.
        far: u64,
    },
}

impl SetMsg {
    pub(super) fn encode(&self, b: &mut Vec<u8>) {
        match self {
            SetMsg::Hello {
                set,
                kind,
                agent,
                layout,
            } => {
                b.push(1);
                put_bytes(b, set.as_bytes());
                b.push(*kind);
                put_bytes(b, agent.as_bytes());
                layout.encode(b);
            }
            SetMsg::Ready {
                agent,
                kind,
                device,
                buffers,
                regions,
                mirrored,
                md,
            } => {
                b.push(2);
                put_bytes(b, agent.as_bytes());
                b.push(*kind);
                b.extend_from_slice(&device.to_le_bytes());
                b.extend_from_slice(&buffers.to_le_bytes());
                b.extend_from_slice(&(regions.len() as u32).to_le_bytes());
                for r in regions {
                    b.extend_from_slice(&r.addr.to_le_bytes());
                    b.extend_from_slice(&r.len.to_le_bytes());
                }
                b.extend_from_slice(&mirrored.to_le_bytes());
                put_bytes(b, md);
            }
            SetMsg::Begin {
                near,
                content,
                base,
                all,
                tensors,
            } => {
                b.push(3);
                b.extend_from_slice(&near.to_le_bytes());
                b.extend_from_slice(content);
                b.extend_from_slice(&base.to_le_bytes());
                b.push(u8::from(*all));
                b.extend_from_slice(&(tensors.len() as u32).to_le_bytes());
                for t in tensors {
                    b.extend_from_slice(&t.to_le_bytes());
                }
            }
            SetMsg::Buffer { near, buffer } => {
                b.push(4);
                b.extend_from_slice(&near.to_le_bytes());
                b.extend_from_slice(&buffer.to_le_bytes());
            }
            SetMsg::Done {
                near,
                writes,
                bytes,
            } => {
                b.push(5);
                b.extend_from_slice(&near.to_le_bytes());
                b.extend_from_slice(&writes.to_le_bytes());
                b.extend_from_slice(&bytes.to_le_bytes());
            }
            SetMsg::Published { near, far } => {
                b.push(6);
                b.extend_from_slice(&near.to_le_bytes());
                b.extend_from_slice(&far.to_le_bytes());
            }
        }
    }

    pub(super) fn decode(c: &mut Cursor<'_>) -> Result<SetMsg> {
        Ok(match c.u8()? {
            1 => SetMsg::Hello {
                set: c.string()?,
                kind: c.u8()?,
                agent: c.string()?,
                layout: WireLayout::decode(c)?,
            },
            2 => {
                let agent = c.string()?;
                let kind = c.u8()?;
                let device = c.u32()?;
                let buffers = c.u32()?;
                let n = c.u32()? as usize;
                let mut regions = Vec::with_capacity(n.min(c.0.len() / 16));
                for _ in 0..n {
                    regions.push(FarRegion {
                        addr: c.u64()?,
                        len: c.u64()?,
                    });
                }
                SetMsg::Ready {
                    agent,
                    kind,
                    device,
                    buffers,
                    regions,
                    mirrored: c.u64()?,
                    md: c.bytes()?,
                }
            }
            3 => {
                let near = c.u64()?;
                let content = c.array()?;
                let base = c.u64()?;
                let all = c.u8()? != 0;
                let n = c.u32()? as usize;
                let mut tensors = Vec::with_capacity(n.min(c.0.len() / 4));
                for _ in 0..n {
                    tensors.push(c.u32()?);
                }
                SetMsg::Begin {
                    near,
                    content,
                    base,
                    all,
                    tensors,
                }
            }
            4 => SetMsg::Buffer {
                near: c.u64()?,
                buffer: c.u32()?,
            },
            5 => SetMsg::Done {
                near: c.u64()?,
                writes: c.u32()?,
                bytes: c.u64()?,
            },
            6 => SetMsg::Published {
                near: c.u64()?,
                far: c.u64()?,
            },
            t => return Err(protocol(&format!("unknown tensor-set message tag {t}"))),
        })
    }
}

impl From<SetMsg> for Msg {
    fn from(m: SetMsg) -> Msg {
        Msg::Set(m)
    }
}

/// What a tensor-set WRITE's NIXL notification says: ASCII text `cipc-ts 1 SESSION NEAR INDEX`
/// (the sending bridge's session tag, the near generation, the WRITE's index within it), so a
/// notification of another session or generation is never counted for this one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SetNote {
    /// A random tag of the sending bridge's session.
    pub session: u64,
    /// The near generation.
    pub near: u64,
    /// The WRITE's index within the generation (0 ..).
    pub index: u32,
}

impl SetNote {
    /// The notification text.
    pub fn encode(&self) -> String {
        format!("cipc-ts 1 {} {} {}", self.session, self.near, self.index)
    }

    /// Parses a notification.
    ///
    /// # Errors
    /// [`RemoteError::Protocol`](super::RemoteError::Protocol) when `s` is not one.
    pub fn decode(s: &str) -> Result<SetNote> {
        let bad = || protocol("a NIXL notification that is not a tensor-set WRITE's");
        let mut it = s.split(' ');
        if it.next() != Some("cipc-ts") || it.next() != Some("1") {
            return Err(bad());
        }
        let mut num = || -> Result<u64> { it.next().and_then(|x| x.parse().ok()).ok_or_else(bad) };
        let session = num()?;
        let near = num()?;
        let index = u32::try_from(num()?).map_err(|_| bad())?;
        if it.next().is_some() {
            return Err(bad());
        }
        Ok(SetNote {
            session,
            near,
            index,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout::new(&[
            TensorSpec::new("a", DType::F32, &[4, 3]),
            TensorSpec::strided("b", DType::BF16, &[2, 2], &[1, 2]),
            TensorSpec::new("c", DType::I8, &[]),
        ])
        .unwrap()
    }

    #[test]
    fn set_messages_round_trip_and_truncations_are_errors() {
        let l = layout();
        let w = WireLayout::of(&l);
        assert_eq!(w.to_layout().unwrap().fingerprint(), l.fingerprint());
        let all = [
            SetMsg::Hello {
                set: "near".into(),
                kind: 1,
                agent: "a".into(),
                layout: w.clone(),
            },
            SetMsg::Ready {
                agent: "b".into(),
                kind: 0,
                device: 0,
                buffers: 2,
                regions: vec![FarRegion { addr: 1, len: 2 }, FarRegion { addr: 3, len: 4 }],
                mirrored: 7,
                md: vec![9; 5],
            },
            SetMsg::Begin {
                near: 3,
                content: [4; 32],
                base: 2,
                all: false,
                tensors: vec![0, 2],
            },
            SetMsg::Buffer { near: 3, buffer: 1 },
            SetMsg::Done {
                near: 3,
                writes: 4,
                bytes: 99,
            },
            SetMsg::Published { near: 3, far: 5 },
        ];
        for m in all {
            let m = Msg::from(m);
            let b = m.encode();
            assert_eq!(Msg::decode(&b[4..]).unwrap(), m);
            for n in 0..b.len() - 4 {
                assert!(Msg::decode(&b[4..4 + n]).is_err(), "{m:?} cut at {n}");
            }
        }
    }

    #[test]
    fn a_layout_whose_fingerprint_differs_is_refused() {
        let mut w = WireLayout::of(&layout());
        w.fingerprint[0] ^= 1;
        assert!(w.to_layout().is_err());
        let mut w = WireLayout::of(&layout());
        w.tensors[0].2 = 1 << 40; // outside its allocation
        assert!(w.to_layout().is_err());
    }

    #[test]
    fn huge_counts_in_a_short_body_are_errors_not_allocations() {
        let mut b = vec![12u8, 3];
        b.extend_from_slice(&5u64.to_le_bytes());
        b.extend_from_slice(&[0; 32]);
        b.extend_from_slice(&0u64.to_le_bytes());
        b.push(0);
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Msg::decode(&b).is_err());
    }

    #[test]
    fn set_notes_round_trip_and_others_are_refused() {
        let n = SetNote {
            session: 77,
            near: 5,
            index: 3,
        };
        assert_eq!(SetNote::decode(&n.encode()).unwrap(), n);
        for bad in [
            "",
            "cipc-lane 1 1 1 1 ",
            "cipc-ts 2 1 1 1",
            "cipc-ts 1 1 1",
            "cipc-ts 1 1 1 1 x",
        ] {
            assert!(SetNote::decode(bad).is_err(), "{bad:?}");
        }
    }
}
