//! [`ShmError`]: what named segments and the seqlock report.

/// Errors of the shared-memory layer: a named segment that cannot be made, opened or trusted, and a
/// seqlock read that never found a stable copy.
///
/// Each segment variant names the segment (without the leading `/`). These reach users as
/// [`crate::Error::Shm`], whichever layer opened the segment (a bare [`super::Segment`], a registry
/// or a channel): one pattern per failure, e.g. `Error::Shm(ShmError::NotFound { .. })`. What a
/// segment's *contents* say (magic, layout version, stamps) belongs to the layer that owns the layout
/// ([`crate::registry::RegistryError`], [`crate::channel::ChannelError`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// A segment name is not acceptable (see [`super::validate_name`]).
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
    /// `/dev/shm` has no room for the segment's pages (reserved at creation), or no inode left for
    /// a new segment (tmpfs `nr_inodes`).
    #[error(
        "no space in /dev/shm for segment /{name} of {} (its pages, or at its creation an inode: `df -h /dev/shm`, `df -i /dev/shm`); free some there or enlarge the tmpfs",
        crate::error::bytes(.len)
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
    /// The segment belongs to another user; only segments of our own user (or, by option, of a
    /// shared group) are trusted.
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
    /// The name in `/dev/shm` is not a plain file (a FIFO, a directory, a socket, a device, a
    /// symbolic link, which is never followed): nothing of this crate made it, and it is neither
    /// read nor removed.
    #[error("/dev/shm/{name} is a {kind}, not a shared-memory segment; it is left as it is")]
    NotASegment {
        /// The segment name.
        name: String,
        /// What it is: `"FIFO"`, `"directory"`, `"socket"`, `"symbolic link"`, `"character
        /// device"`, ...
        kind: &'static str,
    },
    /// Pages the segment needs are not backed: the file is sparse (its creator died between
    /// `ftruncate` and `fallocate`, or another program sized it with `truncate`). Touching such a
    /// page in a full `/dev/shm` raises `SIGBUS`, so the segment is not mapped.
    #[error(
        "shared-memory segment /{name} is sparse: memory backs {backed} of its {}; it was not fully created",
        crate::error::bytes(.len)
    )]
    Sparse {
        /// The segment name.
        name: String,
        /// Its size in bytes.
        len: u64,
        /// Bytes backed by pages (`st_blocks` × 512).
        backed: u64,
    },
    /// A mapped segment no longer holds every byte that was mapped, or some of its pages are no
    /// longer backed: another process of its user cut it short (`ftruncate`) after this process
    /// mapped it. Touching a page past the new end raises `SIGBUS`, so the caller leaves it alone.
    #[error(
        "shared-memory segment /{name} was cut to {} ({backed} backed) after this process mapped {mapped}; it is left alone",
        crate::error::bytes(.len)
    )]
    Shrunk {
        /// The segment name.
        name: String,
        /// Its size in bytes now.
        len: u64,
        /// Bytes backed by pages now (`st_blocks` × 512).
        backed: u64,
        /// The bytes this process mapped.
        mapped: u64,
    },
    /// A seqlock stayed odd (a writer inside its critical section) for all the allowed retries.
    #[error("a record stayed mid-write for {retries} read attempts")]
    WriterStalled {
        /// How many read attempts were made.
        retries: u32,
    },
}

/// `"empty (0 bytes): ..."` or `"100 bytes, smaller than the 4096 bytes it needs"`.
fn too_small_text(len: u64, min: u64) -> String {
    if len == 0 {
        "empty (0 bytes): a creator killed before sizing it, or a file of another program".into()
    } else {
        format!(
            "{}, smaller than the {} it needs",
            crate::error::bytes(len),
            crate::error::bytes(min)
        )
    }
}
