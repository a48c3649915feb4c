//! Freeing what dead processes left in channels, for `gc` ([`crate::cleanup`]): the control
//! segment of a channel whose producer died ([`remove_stale`], [`remove_stale_control`]), a
//! creation abandoned half-way ([`remove_abandoned`]), the slots of dead consumers
//! ([`release_dead_consumers`]) and host pools left without a live producer
//! ([`remove_stale_host_pool`]).
//!
//! Each judges again, right before it changes anything, by the rule [`super::inspect`] reads
//! with, and returns what it freed; nothing of a live process or of another user is touched.
//! Never calls CUDA.

use super::control::Control;
use super::inspect::{
    ChannelSnapshot, ConsumerSnapshot, abandoned, pool_segment_name, segment_name, snapshot,
};
use crate::error::{Error, Result};
use crate::identity::Liveness;
use crate::shm::{Segment, ShmError};

/// Removes the control segment of `channel` when its producer process is dead, and returns what it
/// held; `Ok(None)` (nothing touched) when the producer runs or its liveness cannot be told. A host
/// channel's pool segment goes with it when its own header names a dead producer too.
///
/// Consumers that still have the segment mapped keep their mapping (they get
/// [`ChannelError::ProducerGone`](super::ChannelError::ProducerGone) as before); only the name
/// goes, and only while it still stands for the segment judged ([`Segment::unlink_if_same`]): a
/// new producer that replaced it meanwhile keeps its own.
///
/// # Errors
/// As [`inspect`](super::inspect::inspect); [`Error::Os`] when the unlink fails.
pub fn remove_stale(channel: &str) -> Result<Option<ChannelSnapshot>> {
    let removed = remove_stale_control(channel)?;
    if removed.is_some()
        && let Err(e) = remove_stale_host_pool(channel)
    {
        tracing::warn!("channel {channel}: its host pool stays: {e}");
    }
    Ok(removed)
}

/// [`remove_stale`] without the host pool: removes only the control segment of `channel` when its
/// producer process is dead, and returns what it held; `Ok(None)` (nothing touched) when the
/// producer runs or its liveness cannot be told. For callers that judge and report the pool on
/// its own ([`remove_stale_host_pool`]), as [`crate::cleanup`] does.
///
/// # Errors
/// As [`inspect`](super::inspect::inspect); [`Error::Os`] when the unlink fails.
pub fn remove_stale_control(channel: &str) -> Result<Option<ChannelSnapshot>> {
    remove_stale_control_in(super::layout::SEGMENT_PREFIX, channel)
}

/// [`remove_stale_control`] of the control segment under `prefix` (crate-private: a tensor set's
/// generation channel).
pub(crate) fn remove_stale_control_in(
    prefix: &str,
    channel: &str,
) -> Result<Option<ChannelSnapshot>> {
    let c = Control::open_unless_abandoned_in(prefix, channel)?;
    let snap = snapshot(channel, &c);
    if snap.producer_liveness != Liveness::Dead {
        return Ok(None);
    }
    let ino = c.segment().inode()?;
    drop(c);
    // Only the segment judged, under the replacers' lock: a new producer's segment made meanwhile
    // keeps its name.
    let name = super::control::segment_name_in(prefix, channel);
    Ok(Segment::unlink_if_same(&name, ino)?.then_some(snap))
}

/// Removes the control segment `channel` under `prefix` when it is a creation abandoned half-way
/// (the rule a new producer replaces it by), checking just before that the name still stands for
/// the file judged (crate-private: a tensor set's generation channel). Returns why it was
/// removed; `Ok(None)` when nothing was touched.
///
/// # Errors
/// The typed errors that say what else is under the name.
pub(crate) fn remove_abandoned_in(prefix: &str, channel: &str) -> Result<Option<&'static str>> {
    let Some((why, inode)) = abandoned_in(prefix, channel)? else {
        return Ok(None);
    };
    let name = super::control::segment_name_in(prefix, channel);
    Ok(Segment::unlink_if_same(&name, inode)?.then_some(why))
}

/// Whether the control segment `channel` under `prefix` is a creation abandoned half-way: why,
/// and the inode judged; `Ok(None)` when there is none or it is not abandoned (crate-private).
///
/// # Errors
/// As [`remove_abandoned_in`].
pub(crate) fn abandoned_in(prefix: &str, channel: &str) -> Result<Option<(&'static str, u64)>> {
    let name = super::control::segment_name_in(prefix, channel);
    let before = match Segment::stat(&name) {
        Ok(i) => i,
        Err(Error::Shm(ShmError::NotFound { .. })) => return Ok(None),
        Err(e) => return Err(e),
    };
    match Control::replaceable(channel, &name) {
        Ok("its producer is dead") => Ok(None),
        Ok(why) => Ok(Some((why, before.inode))),
        // Gone since the stat (the opener tells it as `ChannelError::NotFound`).
        Err(e) if super::is_not_found(&e) => Ok(None),
        Err(Error::Channel(
            super::ChannelError::AlreadyExists { .. } | super::ChannelError::CreationInProgress(_),
        )) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Frees the slots (and holds) of dead consumers of the control segment `channel` under `prefix`
/// (crate-private: a tensor set's dead readers); returns how many holds were forced.
///
/// # Errors
/// As [`inspect`](super::inspect::inspect).
pub(crate) fn release_dead_consumers_in(prefix: &str, channel: &str) -> Result<u64> {
    let c = Control::open_unless_abandoned_in(prefix, channel)?;
    Ok(c.reclaim_dead_consumers())
}

/// Removes the segment of `channel` when it is a creation abandoned half-way ([`abandoned`]),
/// checking just before that the name still stands for the file judged. Returns why it was
/// removed, `Ok(None)` when nothing was touched.
///
/// # Errors
/// As [`abandoned`]; [`Error::Os`] when the unlink fails.
pub fn remove_abandoned(channel: &str) -> Result<Option<&'static str>> {
    let name = segment_name(channel);
    let before = match Segment::stat(&name) {
        Ok(i) => i,
        Err(Error::Shm(ShmError::NotFound { .. })) => return Ok(None),
        Err(e) => return Err(e),
    };
    let Some(why) = abandoned(channel)? else {
        return Ok(None);
    };
    Ok(Segment::unlink_if_same(&name, before.inode)?.then_some(why))
}

/// Releases the holds and frees the slots of consumers of `channel` whose process is dead, as the
/// producer does when it next needs a buffer (and as a consumer does when it attaches), and returns
/// the slots freed, as they were. Live consumers and the producer are not touched.
///
/// Useful when a producer is idle (it reclaims only while waiting for a buffer): a dead consumer's
/// slot would otherwise stay taken. The producer is woken so it sees the freed buffers.
///
/// # Errors
/// As [`inspect`](super::inspect::inspect).
pub fn release_dead_consumers(channel: &str) -> Result<Vec<ConsumerSnapshot>> {
    let c = Control::open_unless_abandoned_in(super::layout::SEGMENT_PREFIX, channel)?;
    let before = snapshot(channel, &c);
    if before
        .consumers
        .iter()
        .all(|x| x.liveness != Liveness::Dead)
    {
        return Ok(Vec::new());
    }
    c.reclaim_dead_consumers();
    let after = snapshot(channel, &c);
    Ok(before
        .consumers
        .into_iter()
        .filter(|x| {
            x.liveness == Liveness::Dead
                && !after
                    .consumers
                    .iter()
                    .any(|y| y.index == x.index && y.generation == x.generation)
        })
        .collect())
}

/// Removes the host pool segment of `channel` when a dead producer or an abandoned creation left
/// it (see [`super::inspect::stale_host_pools`]); `Ok(None)` when there is none or it is not stale. Only the pool
/// judged is removed ([`Segment::unlink_if_same`]).
///
/// # Errors
/// The typed error naming what is under the name when it is not a stale pool of ours (a live
/// producer's pool is `Ok(None)`); [`super::ChannelError::VersionMismatch`] when the channel's
/// control segment has another layout version (the pool is kept with it); [`Error::Os`] when the
/// unlink fails.
pub fn remove_stale_host_pool(channel: &str) -> Result<Option<&'static str>> {
    let name = pool_segment_name(channel);
    let before = match Segment::stat(&name) {
        Ok(i) => i,
        Err(Error::Shm(ShmError::NotFound { .. })) => return Ok(None),
        Err(e) => return Err(e),
    };
    let why = match super::host::HostPool::replaceable(channel) {
        Ok(why) => why,
        Err(Error::Shm(ShmError::NotFound { .. })) => return Ok(None),
        Err(Error::Channel(
            super::ChannelError::AlreadyExists { .. } | super::ChannelError::CreationInProgress(_),
        )) => return Ok(None),
        Err(e) => return Err(e),
    };
    Ok(Segment::unlink_if_same(&name, before.inode)?.then_some(why))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::channel::Delivery;
    use crate::channel::inspect::inspect;
    use crate::channel::testing::{ControlConsumer, ControlProducer, token};

    fn name(tag: &str) -> String {
        format!("reclaim-{tag}-{}", std::process::id())
    }

    #[test]
    fn a_live_producers_channel_and_its_live_consumers_are_never_removed_or_released() {
        let n = name("live");
        let tx = ControlProducer::create(&n, 4096, 1, &[token(1).unwrap()]).unwrap();
        let rx = ControlConsumer::attach(&n, Delivery::LatestOnly).unwrap();
        let (i, _) = tx.try_acquire().unwrap();
        tx.publish(i, b"").unwrap();
        let (held, _, _) = rx.take(None).unwrap().unwrap();
        // The consumer is alive: nothing to release, its hold stays.
        assert!(release_dead_consumers(&n).unwrap().is_empty());
        let s = inspect(&n).unwrap();
        assert_eq!(s.consumers[0].holds, [held]);
        assert_eq!(s.consumers[0].liveness, Liveness::Alive);
        // The producer is alive: its segment stays, with or without its pool.
        assert_eq!(remove_stale(&n).unwrap(), None);
        assert_eq!(remove_stale_control(&n).unwrap(), None);
        assert_eq!(remove_abandoned(&n).unwrap(), None);
        assert!(inspect(&n).is_ok());
        rx.release(held);
        drop(rx);
        tx.unlink();
    }

    #[test]
    fn a_foreign_segment_under_a_channels_name_is_never_removed() {
        let n = name("foreign");
        let seg_name = segment_name(&n);
        let seg = Segment::create(&seg_name, 4096, &crate::shm::SegmentOptions::new()).unwrap();
        // SAFETY: the mapping is 4096 bytes, so its first 8 (page-aligned) are in bounds; nobody
        // else knows this segment.
        unsafe { (seg.as_ptr() as *mut u64).write_volatile(u64::from_le_bytes(*b"NOTCHANL")) };
        assert!(remove_stale(&n).is_err(), "a foreign segment is refused");
        assert!(remove_stale_control(&n).is_err());
        assert!(Segment::stat(&seg_name).is_ok(), "and kept");
        Segment::unlink(&seg_name).unwrap();
        drop(seg);
    }
}
