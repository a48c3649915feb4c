//! [`RegistryError`]: what the registry and the shared-memory segments under it report.

use std::time::Duration;

/// Errors of the registry and of the shared-memory segments under it.
///
/// Each variant names the segment (without the leading `/`) and what was wrong with it; bad bytes
/// from another process always end here, never in a panic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// A segment or record name is not acceptable.
    #[error("invalid name {name:?}: {reason}")]
    InvalidName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// `create` found a segment of that name already there (`shm_open` returned `EEXIST`).
    #[error("shared-memory segment /{name} already exists")]
    AlreadyExists {
        /// The segment name.
        name: String,
    },
    /// `open` found no segment of that name (`shm_open` returned `ENOENT`).
    #[error("shared-memory segment /{name} does not exist")]
    NotFound {
        /// The segment name.
        name: String,
    },
    /// `/dev/shm` has no room for the segment's pages (reserved at creation).
    #[error(
        "no space in /dev/shm for segment /{name} of {len} bytes; free space there or enlarge the tmpfs"
    )]
    NoSpace {
        /// The segment name.
        name: String,
        /// The size asked for, in bytes.
        len: u64,
    },
    /// The segment is smaller than its layout needs (zero-size, truncated, or still being created).
    #[error("shared-memory segment /{name} is {}", too_small_text(*.len, *.min))]
    TooSmall {
        /// The segment name.
        name: String,
        /// Its size in bytes.
        len: u64,
        /// The size needed, in bytes.
        min: u64,
    },
    /// The segment belongs to another user; the registry only trusts segments of its own user.
    #[error(
        "shared-memory segment /{name} is owned by uid {owner}, not by this process's uid {ours}"
    )]
    WrongOwner {
        /// The segment name.
        name: String,
        /// The owner's uid.
        owner: u32,
        /// This process's effective uid.
        ours: u32,
    },
    /// The segment can be opened by users other than its owner and group (mode bits `0o007`).
    #[error(
        "shared-memory segment /{name} has mode {mode:#o}, open to other users; refusing to trust it"
    )]
    InsecureMode {
        /// The segment name.
        name: String,
        /// Its permission bits.
        mode: u32,
    },
    /// The segment does not start with the registry's magic: something else made it.
    #[error("shared-memory segment /{name} is not a cuda-ipc registry (magic {found:#018x})")]
    ForeignSegment {
        /// The segment name.
        name: String,
        /// The first eight bytes found, as a little-endian number.
        found: u64,
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
    /// A seqlock stayed odd (a writer inside its critical section) for all the allowed retries.
    #[error("a record stayed mid-write for {retries} read attempts")]
    WriterStalled {
        /// How many read attempts were made.
        retries: u32,
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
    /// The name in `/dev/shm` is not a plain file (a FIFO, a directory, a socket, a device): nothing
    /// of this crate made it, and it is neither read nor removed.
    #[error("/dev/shm/{name} is a {kind}, not a shared-memory segment; it is left as it is")]
    NotASegment {
        /// The segment name.
        name: String,
        /// What it is: `"FIFO"`, `"directory"`, `"socket"`, `"character device"`, ...
        kind: &'static str,
    },
    /// Pages the segment needs are not backed: the file is sparse (its creator died between
    /// `ftruncate` and `fallocate`, or another program sized it with `truncate`). Touching such a
    /// page in a full `/dev/shm` raises `SIGBUS`, so the segment is not mapped.
    #[error(
        "shared-memory segment /{name} is sparse: {backed} of its {len} bytes are backed by memory; it was not fully created"
    )]
    Sparse {
        /// The segment name.
        name: String,
        /// Its size in bytes.
        len: u64,
        /// Bytes backed by pages (`st_blocks` × 512).
        backed: u64,
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

/// `"empty (0 bytes): ..."` or `"100 bytes, smaller than the 4096 bytes it needs"`.
fn too_small_text(len: u64, min: u64) -> String {
    if len == 0 {
        "empty (0 bytes): a creator killed before sizing it, or a file of another program".into()
    } else {
        format!("{len} bytes, smaller than the {min} bytes it needs")
    }
}

/// `" after waiting 1.0s"`, or nothing when the opener did not wait (an inspection).
fn waited_text(waited: &Duration) -> String {
    if waited.is_zero() {
        String::new()
    } else {
        format!(" after waiting {waited:?}")
    }
}
