//! Removing a registry creation abandoned half-way, for `gc` ([`crate::cleanup`]): the one
//! mutation of a registry segment that is not the registry's own recovery
//! ([`super::Registry::reclaim_dead`]). It judges again, by the rule of
//! [`super::inspect::abandoned`] (the one [`super::Registry::open_or_create`] replaces one by),
//! right before it unlinks, and only while the name still stands for the file judged.

use super::inspect::judged;
use crate::error::Result;

/// Removes the segment `name` when it is a registry creation abandoned half-way ([`super::inspect::abandoned`]),
/// only while the name still stands for the file judged. Returns why it was removed, `Ok(None)`
/// when nothing was touched.
///
/// # Errors
/// As [`super::inspect::abandoned`]; [`crate::Error::Os`] when the unlink fails.
pub fn remove_abandoned(name: &str) -> Result<Option<&'static str>> {
    let Some((why, inode)) = judged(name)? else {
        return Ok(None);
    };
    Ok(crate::shm::Segment::unlink_if_same(name, inode)?.then_some(why))
}
