//! Removing a registry creation abandoned half-way, for `gc` ([`crate::cleanup`]): the one
//! mutation of a registry segment that is not the registry's own recovery
//! ([`super::Registry::reclaim_dead`]). It judges again, by the rule of
//! [`super::inspect::abandoned`] (the registry magic, never stamped, its recorded creator dead;
//! never a file without the magic, which [`super::Registry::open_or_create`], claiming the name,
//! may replace), right before it unlinks, and only while the name still stands for the file
//! judged.

use super::inspect::judged;
use crate::error::Result;

/// Removes the segment `name` when it is a registry creation abandoned half-way
/// ([`super::inspect::abandoned`]: the registry magic, never stamped, its recorded creator dead),
/// only while the name still stands for the file judged. Returns why it was removed, `Ok(None)`
/// when nothing was touched. A file without the magic is never removed
/// ([`super::RegistryError::NoMagic`] once it is 2 s old).
///
/// # Errors
/// As [`super::inspect::abandoned`]; [`crate::Error::Os`] when the unlink fails.
pub fn remove_abandoned(name: &str) -> Result<Option<&'static str>> {
    let Some((why, inode)) = judged(name)? else {
        return Ok(None);
    };
    Ok(crate::shm::Segment::unlink_if_same(name, inode)?.then_some(why))
}
