//! [`RegistryError`]: what the registry reports about its layout, records and participants.
//!
//! What the segment under it reports (missing, taken, of another user, sparse, too small, a
//! seqlock that stays mid-write) is a [`crate::shm::ShmError`], which reaches users as
//! [`crate::Error::Shm`], not wrapped in this type: one pattern per failure, whichever layer
//! opened the segment.

use std::time::Duration;

/// Errors of the registry: its segment's contents (magic, layout version, header, stamp), its
/// records and its participant table.
///
/// Each segment variant names the segment (without the leading `/`) and what was wrong with it;
/// bad bytes from another process always end here (or in [`crate::shm::ShmError`]), never in a
/// panic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// A record name is not acceptable (a segment name is [`crate::shm::ShmError::InvalidName`]).
    #[error("invalid name {name:?}: {reason}")]
    InvalidName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The segment does not start with the registry's magic: something else made it.
    #[error("shared-memory segment /{name} is not a cuda-ipc registry (magic {found:#018x})")]
    ForeignSegment {
        /// The segment name.
        name: String,
        /// The first eight bytes found, as a little-endian number.
        found: u64,
    },
    /// A file under a registry's name without the registry magic, at least 2 s old and not being
    /// sized (empty, sparse, or zero where the magic goes), met by
    /// [`super::Registry::open_or_create`] or by a tool given the name (`cuda-ipc gc NAME`, `ls
    /// NAME`, [`super::remove_abandoned`]): a registry's name is any name, so nothing shows that a
    /// cuda-ipc creation made it rather than another program (a `multiprocessing.shared_memory`
    /// segment is sparse, its first bytes often zero). It is left as it is. A registry creation
    /// killed before its first store looks the same: whoever knows that no program uses the file
    /// removes it (`rm /dev/shm/NAME`).
    #[error(
        "shared-memory segment /{name} is not a cuda-ipc registry: no magic ({what}); left as it is \
         (remove it if no program uses it)"
    )]
    NoMagic {
        /// The segment name.
        name: String,
        /// What stands there instead: `empty`, `sparse`, or `zero where the magic goes`.
        what: &'static str,
    },
    /// The segment's layout version is not the one this build reads.
    #[error(
        "shared-memory segment /{name} has layout version {found}, this build reads version {supported}"
    )]
    VersionMismatch {
        /// The segment name.
        name: String,
        /// The version in the segment.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// A header field disagrees with this build or with the segment's size.
    #[error("shared-memory segment /{name} is corrupt: {what}")]
    Corrupt {
        /// The segment name.
        name: String,
        /// What disagrees, with both values.
        what: String,
    },
    /// The creator has not finished initialising the segment within the wait.
    #[error(
        "shared-memory segment /{name} is not initialised{}: its creator has not finished it, or \
         died while creating it",
        waited_text(.waited)
    )]
    Uninitialised {
        /// The segment name.
        name: String,
        /// How long was waited.
        waited: Duration,
    },
    /// Every slot holds a record; remove one or create the registry with more capacity.
    #[error("registry /{name} is full: all {capacity} slots hold records")]
    Full {
        /// The segment name.
        name: String,
        /// Its number of slots.
        capacity: u32,
    },
    /// Every participant entry is held by a live process.
    #[error(
        "registry /{name} has no free participant entry (all {capacity} are held by live processes)"
    )]
    TooManyParticipants {
        /// The segment name.
        name: String,
        /// Its number of participant entries.
        capacity: u32,
    },
    /// The name now stands for another segment than the one this handle mapped: it was removed
    /// and made again (its creation generation or inode differs). The mapping still works but
    /// nobody else sees it; open the name again.
    #[error(
        "shared-memory segment /{name} was superseded: the name was removed and made again; open it again"
    )]
    Superseded {
        /// The segment name.
        name: String,
    },
    /// A registry segment that was never initialised, whose creator's liveness cannot be told
    /// (e.g. its liveness file belongs to another user): it might still be working, so the segment
    /// is not replaced.
    #[error(
        "shared-memory segment /{name} was never initialised, and whether its creator ({creator}) \
         still runs cannot be told; it is left as it is"
    )]
    CreatorUnknown {
        /// The segment name.
        name: String,
        /// The creator, as recorded in the header.
        creator: String,
    },
    /// A record field is longer than the layout allows.
    #[error("{what} is {len} bytes, more than the {max} bytes a record holds")]
    TooLarge {
        /// Which field (`"record name"`, `"token"`, `"metadata"`).
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The maximum in bytes.
        max: usize,
    },
}

/// `" after waiting 1.0s"`, or nothing when the opener did not wait (an inspection).
fn waited_text(waited: &Duration) -> String {
    if waited.is_zero() {
        String::new()
    } else {
        format!(" after waiting {waited:?}")
    }
}
