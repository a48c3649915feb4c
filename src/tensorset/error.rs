//! [`TensorSetError`]: what only the tensor-set layer reports ([`crate::Error::TensorSet`]).

/// What a tensor set's manifest segment (or data segment) was wrong with: each field that a
/// reader range-checks has its own fault, so a hostile or truncated manifest is named, never read
/// out of bounds.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ManifestFault {
    /// The body is shorter than its fixed header, or a table runs past the body's end.
    #[error(
        "{what} at bytes {offset}+{len} runs past the manifest's {}",
        crate::error::bytes(.body)
    )]
    OutOfBounds {
        /// Which part.
        what: &'static str,
        /// Its offset in the body.
        offset: u64,
        /// Its length.
        len: u64,
        /// The body's length.
        body: u64,
    },
    /// The segment is shorter than its header records (its header page and `what` after it): cut
    /// short by `truncate`, or corrupted. Said with the file's real size, never read past it.
    #[error(
        "the segment is {}, cut short of the {} its header records for {what}: truncated or \
         corrupted",
        crate::error::bytes(.len),
        crate::error::bytes(.need)
    )]
    Truncated {
        /// What the header records after its page (`its body`, `its holder slots`).
        what: &'static str,
        /// The file's size in bytes.
        len: u64,
        /// The size its header records, in bytes (the header page and `what`).
        need: u64,
    },
    /// A count or code out of its range.
    #[error("{what} is {found}; {allowed}")]
    Field {
        /// Which field.
        what: &'static str,
        /// What the manifest says.
        found: u64,
        /// What is allowed.
        allowed: &'static str,
    },
    /// A tensor entry that does not hold together (name, shape, range, size).
    #[error("tensor {index}: {why}")]
    Tensor {
        /// The entry's index.
        index: u64,
        /// What is wrong.
        why: String,
    },
    /// An allocation's token in a GPU set's allocation table that does not decode (another
    /// magic, layout version or checksum): the table was overwritten, or the memory kind was (a
    /// host set's table holds no tokens).
    #[error("the allocation table's token of buffer {buffer}, allocation {allocation}: {why}")]
    Token {
        /// The buffer.
        buffer: u64,
        /// The allocation in that buffer.
        allocation: u64,
        /// What the token's decoder said (`invalid token: ...`).
        why: String,
    },
    /// The layout fingerprint stored is not the one its tables give.
    #[error("the stored layout fingerprint does not match the tensor table")]
    Fingerprint,
    /// A segment of the set (the generation channel, the host data) is not the one the manifest
    /// was written with (made again since, or planted).
    #[error("{what} is not the one the manifest names (made again since?)")]
    Mismatch {
        /// Which segment.
        what: &'static str,
    },
}

/// What only tensor sets report. Wrapped in [`crate::Error::TensorSet`]; a segment's own faults
/// (missing, another user's, not a file, sparse) stay [`crate::Error::Shm`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorSetError {
    /// No tensor set of this name.
    #[error("no tensor set named {0:?}")]
    NotFound(String),
    /// A live writer publishes this name already.
    #[error("tensor set {name:?} is already published by pid {pid}")]
    AlreadyExists {
        /// The set.
        name: String,
        /// The live writer's pid.
        pid: u32,
    },
    /// A creation under this name is in progress (or was abandoned less than 2 s ago).
    #[error("tensor set {0:?} is being created by another process; try again")]
    CreationInProgress(String),
    /// The layout fingerprint is not the one expected (another checkpoint or model shape).
    #[error(
        "layout fingerprint mismatch: expected {}, found {}",
        hex(expected),
        hex(found)
    )]
    LayoutMismatch {
        /// What the reader expected.
        expected: [u8; 32],
        /// What the set has.
        found: [u8; 32],
    },
    /// A generation's committed content fingerprint is not the one the reader demands
    /// ([`crate::tensorset::ReaderOptions::expect_content`]). It compares the writer's label, not
    /// the bytes: [`TensorSetError::ContentUnverified`] is about the bytes.
    #[error(
        "content fingerprint mismatch in generation {generation}: expected {}, the writer committed {}",
        hex(expected),
        hex(found)
    )]
    ContentMismatch {
        /// The generation.
        generation: u64,
        /// What the reader expected.
        expected: [u8; 32],
        /// What the writer committed (all zeros: none).
        found: [u8; 32],
    },
    /// A generation's bytes do not have the content fingerprint its writer committed, or the
    /// writer committed none ([`crate::tensorset::Held::verify_content`]).
    #[error("{}", unverified(*generation, committed, computed))]
    ContentUnverified {
        /// The generation.
        generation: u64,
        /// What the writer committed (all zeros: none).
        committed: [u8; 32],
        /// The fingerprint of the bytes, computed by the reader.
        computed: [u8; 32],
    },
    /// The segment `segment` of a tensor set (its manifest, or its data, holders or generation
    /// segment, which the manifest names) is not valid, or not the one the manifest names.
    #[error("bad tensor-set segment {segment}: {fault}")]
    BadManifest {
        /// The segment's name.
        segment: String,
        /// What is wrong.
        fault: ManifestFault,
    },
    /// The manifest was written by another layout version.
    #[error("tensor set {name:?} has layout version {found}; this build reads {supported}")]
    VersionMismatch {
        /// The set.
        name: String,
        /// Version found.
        found: u32,
        /// Version this build reads.
        supported: u32,
    },
    /// The writer died (or its generation channel is gone): the generation held stays readable,
    /// no newer one will come. A reader opened after the writer's death reads the last whole
    /// generation its holders keep; `why` says why there is none (empty otherwise).
    #[error("the writer of tensor set {name:?} (pid {pid}) is gone{}", suffix(why))]
    WriterGone {
        /// The set.
        name: String,
        /// The writer's pid.
        pid: u32,
        /// Why nothing can be read ("" when it is only the writer's death).
        why: String,
    },
    /// The set cannot be held by forwarding its file descriptors (a host, pool or legacy set, one
    /// without a holders segment, or more allocations than
    /// [`super::holders::MAX_HOLDER_ENTRIES`]).
    #[error("tensor set {name:?} cannot be held: {why}")]
    NotHoldable {
        /// The set.
        name: String,
        /// Why.
        why: String,
    },
    /// Every slot of the set's holders segment serves a live process.
    #[error("all {slots} holder slots of tensor set {name:?} serve live processes")]
    NoHolderSlot {
        /// The set.
        name: String,
        /// The slots.
        slots: usize,
    },
    /// No process could hand over the set's file descriptors: its writer is dead and no live
    /// holder answered. `tried` names each server tried and what it said.
    #[error("no process serves the file descriptors of tensor set {name:?}: {tried}")]
    NoServer {
        /// The set.
        name: String,
        /// What was tried.
        tried: String,
    },
    /// The writer closed the set.
    #[error("tensor set {0:?} was closed by its writer")]
    Closed(String),
    /// No generation was published yet (or the one there is being rewritten in place).
    #[error("tensor set {0:?} has no generation to read now")]
    NoGeneration(String),
    /// More tensors, dimensions or name bytes than a manifest holds.
    #[error("{what}: {found}; at most {max}")]
    TooManyTensors {
        /// What overflowed.
        what: &'static str,
        /// How many were given.
        found: u64,
        /// The limit.
        max: u64,
    },
    /// A tensor specification that cannot be laid out.
    #[error("tensor {name:?}: {why}")]
    BadTensor {
        /// The tensor's name.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// Every reader slot of the set is taken ([`super::TensorSetOptions::max_readers`]).
    #[error("all {max} reader slots of tensor set {name:?} are taken (the writer's max_readers)")]
    TooManyReaders {
        /// The set.
        name: String,
        /// Its reader limit.
        max: usize,
    },
    /// No tensor of this name or index.
    #[error("no tensor {0} in the set")]
    NoSuchTensor(String),
    /// The set's memory kind does not offer what was asked (a host accessor on a GPU set, ...).
    #[error("{0}")]
    WrongKind(&'static str),
}

fn suffix(why: &str) -> String {
    if why.is_empty() {
        String::new()
    } else {
        format!(": {why}")
    }
}

fn unverified(generation: u64, committed: &[u8; 32], computed: &[u8; 32]) -> String {
    if committed == &[0; 32] {
        format!(
            "generation {generation} was committed without a content fingerprint, so its bytes \
             cannot be verified (the writer commits with commit_fingerprinted); its bytes have {}",
            hex(computed)
        )
    } else {
        format!(
            "generation {generation}'s bytes are not the ones its writer fingerprinted: the \
             writer committed {}, the bytes have {}",
            hex(committed),
            hex(computed)
        )
    }
}

fn hex(b: &[u8; 32]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Whether `e` says that nothing stands under the name: a missing segment, a channel of no such
/// name ([`crate::channel::is_not_found`]: a set's generation channel), or no tensor set of that
/// name ([`TensorSetError::NotFound`]).
pub(crate) fn is_not_found(e: &crate::Error) -> bool {
    crate::channel::is_not_found(e)
        || matches!(e, crate::Error::TensorSet(TensorSetError::NotFound(_)))
}
