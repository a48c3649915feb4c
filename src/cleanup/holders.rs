//! The slots that dead servers left in a tensor set's holders segment (a holder, a serving or
//! writerless reader, a writer), on a set that stays: listed by [`scan`], freed by [`free`]
//! through [`tensorset::reclaim::release_dead_holders`] (each slot only while it is still the dead
//! server's; a live server's slot, or one whose liveness cannot be told, is never touched).

use super::{Leftover, LeftoverKind, Removal, Scan, Target, leftover};
use crate::tensorset::{self, HolderSnapshot};

/// The leftover of a dead server's slot in set `t`.
fn slot_leftover(t: &str, h: &HolderSnapshot) -> Leftover {
    leftover(
        LeftoverKind::TensorSetHolder,
        t,
        Some(h.identity),
        Some(h.uid),
        format!(
            "tensorset {t}: holder slot {} ({}) of dead {}",
            h.slot,
            h.role.word(),
            h.identity
        ),
        Target::TensorSetHolder { slot: h.slot },
    )
}

/// Lists the dead servers' slots of set `t` (a holders segment that cannot be read is a problem).
pub(super) fn scan(t: &str, s: &mut Scan) {
    match tensorset::reclaim::dead_holders(t) {
        Ok(dead) => s.leftovers.extend(dead.iter().map(|h| slot_leftover(t, h))),
        Err(e) => s.unread(format!("tensorset {t}"), e),
    }
}

/// Frees the dead servers' slots of set `t` and reports each (those freed beside the ones
/// `listed`, dead since the scan, too); a listed slot not freed is kept.
pub(super) fn free(t: &str, listed: &[Leftover], out: &mut Removal) {
    match tensorset::reclaim::release_dead_holders(t) {
        Ok(freed) => {
            let freed: Vec<Leftover> = freed.iter().map(|h| slot_leftover(t, h)).collect();
            for l in listed.iter().filter(|l| l.object == t) {
                if matches!(l.target, Target::TensorSetHolder { .. }) && !freed.contains(l) {
                    out.kept.push((l.clone(), "gone or no longer dead"));
                }
            }
            out.removed.extend(freed);
        }
        Err(e) => out.failed(
            format!("tensorset {t}"),
            e,
            listed
                .iter()
                .filter(|l| l.object == t && matches!(l.target, Target::TensorSetHolder { .. })),
        ),
    }
}
