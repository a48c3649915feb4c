//! The tensor set's own segments: the manifest segment `cuda-ipc.ts.NAME` (a header page, then
//! the manifest body of `manifest.rs`, written once before the stamp) and, for host sets, the data
//! segment `cuda-ipc.td.NAME` (a header page, then the B buffers at a page-aligned stride). Both
//! follow `shm::versioned` (magic, layout version 1, stamp written last, random creation
//! generation) with the writer's identity words; mode 0600.
//!
//! Replacement (creating over a name that is taken) follows the channel's rules: only this user's
//! segments, and of those only a set whose writer is dead or a creation abandoned half-way
//! (empty or sparse for 2 s, or never stamped with its creator dead); a live writer's set is
//! [`TensorSetError::AlreadyExists`], anything else is left alone and named in the error.

use super::error::{ManifestFault, TensorSetError};
use super::manifest::{self, Manifest};
use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
use crate::shm::versioned::{
    self, Blocker, Creator, HeaderError, OpenError, StampWord, VersionedHeader,
};
use crate::shm::{Segment, SegmentOptions, ShmError};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Prefix of a manifest segment's name.
pub const MANIFEST_PREFIX: &str = "cuda-ipc.ts.";
/// Prefix of a set's generation channel (a memoryless channel control segment).
pub const GENERATION_PREFIX: &str = "cuda-ipc.tg.";
/// Prefix of a host set's data segment.
pub const DATA_PREFIX: &str = "cuda-ipc.td.";
/// Prefix of a GPU set's holders segment (who serves the set's file descriptors, `holders.rs`).
pub const HOLDERS_PREFIX: &str = "cuda-ipc.th.";
/// The manifest layout version this build writes and reads.
pub const VERSION: u32 = 1;
/// Bytes of the header page before the body (or the data buffers).
pub const HEADER_PAGE: usize = 4096;
/// The stamp a creator writes last.
const STAMP_READY: u32 = 0x5453_4554;
/// How long an opener waits for the stamp of a segment whose creator may still write it.
pub(crate) const INIT_WAIT: Duration = Duration::from_secs(2);

/// Magic of a manifest segment.
pub const MANIFEST_MAGIC: u64 = u64::from_le_bytes(*b"CIPCTSET");
/// Magic of a host data segment.
pub const DATA_MAGIC: u64 = u64::from_le_bytes(*b"CIPCTSDT");
/// Magic of a holders segment.
pub const HOLDERS_MAGIC: u64 = u64::from_le_bytes(*b"CIPCTSHD");

/// The header page's words (manifest and data segments; `M` is the magic).
#[repr(C)]
pub(crate) struct Header<const M: u64> {
    magic: AtomicU64,
    version: AtomicU32,
    stamp: AtomicU32,
    generation: AtomicU64,
    writer_pid: AtomicU32,
    writer_uid: AtomicU32,
    writer_start_time: AtomicU64,
    writer_boot_id: [AtomicU64; 2],
    writer_pid_ns: AtomicU32,
    _pad0: AtomicU32,
    /// Manifest: the body's length in bytes. Data: the buffers' stride in bytes.
    body_len: AtomicU64,
    /// Data: the number of buffers (manifest: 0).
    buffers: AtomicU32,
    _pad: AtomicU32,
}

#[cfg(not(loom))] // loom atomics have other sizes; the mapped layout is only used without it
const _: () = assert!(std::mem::size_of::<Header<0>>() == 80);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(Header<0>, body_len) == 64);

/// The manifest segment's header.
pub(crate) type ManifestHeader = Header<MANIFEST_MAGIC>;
/// The data segment's header.
pub(crate) type DataHeader = Header<DATA_MAGIC>;
/// The holders segment's header (`body_len`: the slot area's bytes; `buffers`: B).
pub(crate) type HoldersHeader = Header<HOLDERS_MAGIC>;

// SAFETY: (1) `Header` is `#[repr(C)]` and made of atomics only; (2) its alignment is 8, which
// divides 4096; (3) it is 80 bytes, less than `HEADER_LEN` (asserted above).
unsafe impl<const M: u64> VersionedHeader for Header<M> {
    const MAGIC: u64 = M;
    const VERSION: u32 = VERSION;
    const HEADER_LEN: usize = HEADER_PAGE;
    /// The stamp word is only ever 0 (a file being made) or the stamp (`write_versioned` stores
    /// it once): any other value is a damaged header, refused at once instead of awaited.
    const STRICT_STAMP: bool = true;
    fn magic(&self) -> &AtomicU64 {
        &self.magic
    }
    fn version(&self) -> &AtomicU32 {
        &self.version
    }
    fn stamp(&self) -> StampWord<'_> {
        StampWord::U32(&self.stamp, STAMP_READY)
    }
    fn generation(&self) -> &AtomicU64 {
        &self.generation
    }
}

impl<const M: u64> Header<M> {
    /// The body's length (manifest), the buffers' stride (data) or the slot area's length
    /// (holders), as recorded.
    pub(crate) fn body_len(&self) -> u64 {
        // Relaxed: written before the stamp, which openers Acquire-loaded.
        self.body_len.load(Ordering::Relaxed)
    }

    /// The buffer count recorded (data and holders segments).
    pub(crate) fn buffers(&self) -> u32 {
        // Relaxed: as `body_len`.
        self.buffers.load(Ordering::Relaxed)
    }

    /// Records the body length and buffer count (creators, before the stamp).
    pub(crate) fn set_body(&self, body_len: u64, buffers: u32) {
        // Relaxed: published by the stamp's Release store (`write_versioned`).
        self.body_len.store(body_len, Ordering::Relaxed);
        self.buffers.store(buffers, Ordering::Relaxed);
    }

    fn write_owner(&self, me: &ProcessIdentity) {
        // Relaxed: published by the magic's and the stamp's Release stores (`write_versioned`),
        // and, for a judge of the unstamped segment, by the pid's Release store below.
        self.writer_uid
            .store(rustix::process::geteuid().as_raw(), Ordering::Relaxed);
        self.writer_start_time
            .store(me.start_time, Ordering::Relaxed);
        self.writer_boot_id[0].store(
            u64::from_le_bytes(me.boot_id[..8].try_into().unwrap_or_default()),
            Ordering::Relaxed,
        );
        self.writer_boot_id[1].store(
            u64::from_le_bytes(me.boot_id[8..].try_into().unwrap_or_default()),
            Ordering::Relaxed,
        );
        self.writer_pid_ns.store(me.pid_ns, Ordering::Relaxed);
        // SYNC POINT: writer recorded. Release, stored last: pairs with the Acquire load of
        // `writer_pid` in `writer`; a judge of a segment not stamped yet that sees the pid sees
        // the whole identity (never a torn one, which would read as a dead writer's).
        self.writer_pid.store(me.pid, Ordering::Release);
    }

    /// The writer's identity and uid as recorded.
    pub(crate) fn writer(&self) -> (ProcessIdentity, u32) {
        // SYNC POINT: writer recorded. Acquire, loaded first: pairs with the Release store of
        // `writer_pid` in `write_owner` (the identity is whole once the pid is seen).
        let pid = self.writer_pid.load(Ordering::Acquire);
        // Relaxed: written before the pid and the stamp, which openers Acquire-loaded (or a
        // diagnosis of an unstamped segment).
        let mut boot_id = [0u8; 16];
        boot_id[..8].copy_from_slice(&self.writer_boot_id[0].load(Ordering::Relaxed).to_le_bytes());
        boot_id[8..].copy_from_slice(&self.writer_boot_id[1].load(Ordering::Relaxed).to_le_bytes());
        (
            ProcessIdentity {
                pid,
                start_time: self.writer_start_time.load(Ordering::Relaxed),
                boot_id,
                pid_ns: self.writer_pid_ns.load(Ordering::Relaxed),
            },
            self.writer_uid.load(Ordering::Relaxed),
        )
    }

    /// Whether the recorded writer runs.
    pub(crate) fn writer_liveness(&self) -> Liveness {
        let (id, uid) = self.writer();
        id.liveness_as(uid)
    }
}

/// Checks a tensor set's name (without [`MANIFEST_PREFIX`]) by the rule every writer, reader and
/// holder applies: as a channel name, 1 to [`crate::channel::MAX_CHANNEL_NAME`] bytes of
/// `[A-Za-z0-9._-]`, not `.` or `..` (the set's generation channel bears its name).
///
/// # Errors
/// [`crate::Error::InvalidArgument`] for a name too long, [`crate::shm::ShmError::InvalidName`]
/// saying what else is wrong.
///
/// # Examples
/// ```
/// use cuda_ipc::tensorset::validate_set_name;
/// assert!(validate_set_name("weights.v2").is_ok());
/// assert!(validate_set_name("").is_err() && validate_set_name("a/b").is_err());
/// ```
pub fn validate_set_name(name: &str) -> Result<()> {
    // The set's generation channel bears its name: the channel's limits are the set's.
    crate::channel::validate_name_as(name, "tensor-set name")
}

pub(crate) fn bad(segment: &str, fault: ManifestFault) -> Error {
    TensorSetError::BadManifest {
        segment: segment.to_string(),
        fault,
    }
    .into()
}

/// The error an opener of `seg_name` (of set `set`) reports for `e`.
pub(crate) fn open_error(set: &str, seg_name: &str, e: OpenError) -> Error {
    match e {
        OpenError::Segment(Error::Shm(ShmError::NotFound { .. }))
            if seg_name.starts_with(MANIFEST_PREFIX) =>
        {
            TensorSetError::NotFound(set.to_string()).into()
        }
        OpenError::Segment(e) => e,
        OpenError::Header(HeaderError::Foreign { magic }) => bad(
            seg_name,
            ManifestFault::Field {
                what: "the magic",
                found: magic,
                allowed: "not this kind of tensor-set segment's (a file of another program, or another kind of segment under this name)",
            },
        ),
        OpenError::Header(HeaderError::BadStamp { found }) => bad(
            seg_name,
            ManifestFault::Field {
                what: "the header's init stamp",
                found,
                allowed: "neither 0 (being made) nor the stamp: the header was overwritten",
            },
        ),
        // No creation at all: a segment in use whose header was overwritten. Left as it is.
        OpenError::Header(HeaderError::InUse) => bad(
            seg_name,
            ManifestFault::Field {
                what: "the header's init stamp",
                found: 0,
                allowed: "the stamp, in a segment in use (a holder's slot claimed, a generation \
                          recorded or begun, which only follow the stamp): the header was \
                          overwritten; left as it is",
            },
        ),
        // Not waited for: its writer died (or never recorded itself) before stamping it.
        OpenError::Header(HeaderError::Abandoned) => bad(
            seg_name,
            ManifestFault::Field {
                what: "the header's init stamp",
                found: 0,
                allowed: "never written: a creation abandoned half-way (its writer died, or \
                          never recorded itself, before finishing it), which `cuda-ipc gc` \
                          removes",
            },
        ),
        OpenError::Header(HeaderError::OtherVersion { found }) => TensorSetError::VersionMismatch {
            name: set.to_string(),
            found,
            supported: VERSION,
        }
        .into(),
        // Waited for in vain while the writer it records ran: a creation writes its header
        // within milliseconds of recording its writer, so a stamp still 0 after the wait is a
        // header overwritten since (its stamp zeroed), not a creation in progress (the one rule
        // of `versioned::StampWait`).
        OpenError::Header(HeaderError::Overwritten { .. }) => bad(
            seg_name,
            ManifestFault::Field {
                what: "the header's init stamp",
                found: 0,
                allowed: "not written within the opener's wait though the writer the \
                              header records runs (a creation writes it within milliseconds): \
                              the header was overwritten, or its writer is stopped",
            },
        ),
        // A look that did not wait, no writer recorded yet, or one recorded too late in the
        // wait to tell: a creation may be under way.
        OpenError::Header(_) => TensorSetError::CreationInProgress(set.to_string()).into(),
    }
}

/// Judges what blocks creating `seg_name` of set `set` (the channel's rules, see the module
/// docs): `Ok(why)` when it may be replaced, else the error naming it (a segment without its
/// stamp that shows use, which only follows the stamp, is [`TensorSetError::BadManifest`]: a
/// header overwritten, never replaced).
pub(crate) fn replaceable<const M: u64>(
    set: &str,
    seg_name: &str,
    used: ShowsUse,
) -> Result<&'static str> {
    match versioned::stat_blocker(seg_name, HEADER_PAGE)? {
        Blocker::Abandoned => return Ok(versioned::ABANDONED_UNSIZED),
        Blocker::Young => return Err(TensorSetError::CreationInProgress(set.to_string()).into()),
        Blocker::Sized(_) => {}
    }
    match open_segment::<M>(seg_name, INIT_WAIT, used) {
        Ok(seg) => {
            let h = versioned::header::<Header<M>>(&seg);
            if h.writer_liveness() == Liveness::Dead {
                Ok("its writer is dead")
            } else {
                Err(TensorSetError::AlreadyExists {
                    name: set.to_string(),
                    pid: h.writer().0.pid,
                }
                .into())
            }
        }
        // Never stamped, or its stamp damaged: judged by its writer's liveness.
        Err(OpenError::Header(
            HeaderError::Unstamped { .. } | HeaderError::BadStamp { .. } | HeaderError::Abandoned,
        )) => {
            let seg = Segment::open_with_min_len(seg_name, HEADER_PAGE)?;
            match creator_of::<M>(&seg, used) {
                Creator::Running => Err(TensorSetError::CreationInProgress(set.to_string()).into()),
                // Shows use that only follows the stamp: never a creation; kept.
                Creator::InUse => Err(open_error(
                    set,
                    seg_name,
                    OpenError::Header(HeaderError::InUse),
                )),
                Creator::Dead | Creator::Unrecorded => {
                    Ok("a creation abandoned before it was finished")
                }
            }
        }
        Err(e) => Err(open_error(set, seg_name, e)),
    }
}

/// Opens the tensor-set segment `seg_name` of magic `M` ([`versioned::open_versioned`], this
/// user's only), waiting up to `wait` for its stamp only while a writer may still write it: one
/// it records that runs (or whose liveness cannot be told), or none recorded yet in a segment
/// younger than 2 s ([`versioned::open_versioned_unless_abandoned`]), judged again while it waits.
///
/// # Errors
/// As [`versioned::open_versioned`]; `HeaderError::Abandoned`, at once, for a creation abandoned
/// half-way ([`open_error`] names it).
pub(crate) fn open_segment<const M: u64>(
    seg_name: &str,
    wait: Duration,
    used: ShowsUse,
) -> std::result::Result<Segment, OpenError> {
    versioned::open_versioned_unless_abandoned::<Header<M>>(seg_name, false, wait, |seg| {
        creator_of::<M>(seg, used)
    })
}

/// A layout's sign of use that only follows the stamp, asked of a segment found without its stamp
/// (at least a header page long): words its creator leaves zero and only processes of the stamped
/// segment write. The holders segment's is `holders::used_since_stamped`; the manifest's body and
/// the data segment's header are written once, before the stamp, and the data buffers' bytes may
/// be zero, so those two show none ([`shows_no_use`]).
pub(crate) type ShowsUse = fn(&Segment) -> bool;

/// The [`ShowsUse`] of the manifest and data segments: none.
pub(crate) fn shows_no_use(_: &Segment) -> bool {
    false
}

/// The writer that the tensor-set segment `seg` of magic `M` records, judged by the one rule of
/// [`Creator::judged`]: in use (`used`, its header overwritten), none recorded yet (pid 0), dead,
/// or running (or whose liveness cannot be told).
fn creator_of<const M: u64>(seg: &Segment, used: ShowsUse) -> Creator {
    let h = versioned::header::<Header<M>>(seg);
    Creator::judged(
        h.writer().0.pid != 0,
        || h.writer_liveness() == Liveness::Dead,
        || used(seg),
    )
}

/// Creates `seg_name` of `len` bytes (replacing only what [`replaceable`] lets go) and writes its
/// header with `fields` (everything past the header's words) before the stamp. Returns the
/// segment and its creation generation.
pub(crate) fn create<const M: u64>(
    set: &str,
    seg_name: &str,
    len: usize,
    used: ShowsUse,
    fields: impl FnOnce(&Segment, &Header<M>),
) -> Result<(Segment, u64)> {
    let opts = SegmentOptions::new();
    // Before the segment is made: the first call of a process creates its liveness file, whose
    // failure (a full /dev/shm) must not leave the new segment behind.
    let me = ProcessIdentity::current()?;
    let seg =
        versioned::create_replacing(
            seg_name,
            len,
            &opts,
            "tensor-set segment",
            || match replaceable::<M>(set, seg_name, used) {
                Ok(why) => Ok(Some(why)),
                Err(Error::Shm(ShmError::NotFound { .. })) => Ok(None),
                Err(Error::TensorSet(TensorSetError::NotFound(_))) => Ok(None),
                Err(e) => Err(e),
            },
        )?;
    // SYNC POINT: stamp. Release, stored last by `write_versioned`: pairs with the Acquire load in
    // `open_versioned`; the body written in `fields` is visible to an opener that sees it.
    let generation =
        versioned::write_versioned::<Header<M>>(&seg, |h| h.write_owner(&me), |h| fields(&seg, h));
    Ok((seg, generation))
}

/// Creates the manifest segment of `set` holding `m`'s body.
pub(crate) fn create_manifest(set: &str, m: &Manifest) -> Result<Segment> {
    let body = manifest::encode(m);
    let len = HEADER_PAGE
        .checked_add(body.len())
        .and_then(|l| l.checked_next_multiple_of(HEADER_PAGE))
        .ok_or_else(|| Error::InvalidArgument("the manifest's size overflows".into()))?;
    let name = format!("{MANIFEST_PREFIX}{set}");
    let (seg, _) = create::<MANIFEST_MAGIC>(set, &name, len, shows_no_use, |seg, h| {
        h.body_len.store(body.len() as u64, Ordering::Relaxed);
        // SAFETY: the mapping is `len >= HEADER_PAGE + body.len()` bytes; the body area is
        // written only here, by the creator, before the stamp; `body` is this process's memory.
        unsafe {
            std::ptr::copy_nonoverlapping(body.as_ptr(), seg.as_ptr().add(HEADER_PAGE), body.len())
        };
    })?;
    Ok(seg)
}

/// An opened manifest: the segment (kept mapped: its inode tells a replaced set) and the body.
/// From [`open_manifest_unverified`], its layout fingerprint is still to be checked
/// ([`Manifest::verify_fingerprint`]).
pub(crate) struct OpenedManifest {
    /// Shared with a [`ManifestBody`] still to be copied out ([`open_manifest_head`]).
    pub(crate) seg: Arc<Segment>,
    pub(crate) manifest: Manifest,
    /// How long the open, the copy and the decode took (without a later fingerprint check).
    pub(crate) took: Duration,
    /// Of `took`: the tensor tables' decode (zero while they are not decoded).
    pub(crate) tables_took: Duration,
}

impl OpenedManifest {
    /// The header's words.
    pub(crate) fn header(&self) -> &ManifestHeader {
        versioned::header::<ManifestHeader>(&self.seg)
    }
}

/// Opens and decodes the manifest of `set` (waiting up to `init_wait` for a creator's stamp).
///
/// # Errors
/// [`TensorSetError::NotFound`]; the segment's own errors ([`crate::Error::Shm`]: another
/// user's, a FIFO, sparse, too small); [`TensorSetError::BadManifest`] for a foreign magic, a
/// body that does not decode, or a creation abandoned half-way (no stamp, and its writer dead or
/// never recorded in a segment older than 2 s: told at once, never waited for), and for a stamp
/// still 0 after `init_wait` in a header whose recorded writer runs and had recorded itself at
/// least 500 ms before the wait ended (overwritten: `versioned::StampWait`);
/// [`TensorSetError::VersionMismatch`]; [`TensorSetError::CreationInProgress`] when no writer is
/// recorded yet (or was recorded too late in the wait to tell) and the stamp did not come within
/// `init_wait`, or at a look that did not wait (`init_wait` zero).
pub(crate) fn open_manifest(set: &str, init_wait: Duration) -> Result<OpenedManifest> {
    let opened = open_manifest_unverified(set, init_wait)?;
    opened
        .manifest
        .verify_fingerprint()
        .map_err(|f| bad(opened.seg.name(), f))?;
    Ok(opened)
}

/// [`open_manifest`] without the layout fingerprint's recomputation (the caller does it before
/// relying on the manifest: [`Manifest::verify_fingerprint`]).
///
/// # Errors
/// As [`open_manifest`], less the fingerprint's fault.
pub(crate) fn open_manifest_unverified(set: &str, init_wait: Duration) -> Result<OpenedManifest> {
    open_manifest_head(set, init_wait)?.decoded()
}

/// A manifest opened by [`open_manifest_head`]: its layout is provisional (allocations and the
/// stored fingerprint) until `tables` are decoded from `body`.
pub(crate) struct OpenedHead {
    pub(crate) opened: OpenedManifest,
    /// The whole body, still in the segment: copied out by whichever thread decodes the tables.
    pub(crate) body: ManifestBody,
    pub(crate) tables: manifest::TensorTables,
}

/// A manifest's body, for the decode of its tensor tables: in its segment (kept mapped by the
/// `Arc`). [`ManifestBody::copied`] copies it out byte-wise: the bytes are
/// never referenced in place, so a writer that broke the protocol and changed them changes the
/// copy's bytes, which the layout fingerprint check then refuses, never this process's memory
/// safety.
pub(crate) enum ManifestBody {
    /// `len` bytes after the header page of `seg`, every page backed (checked at open) and
    /// immutable after the stamp, which the open Acquire-loaded.
    InSegment { seg: Arc<Segment>, len: usize },
    /// Bytes made by a test.
    #[cfg(test)]
    Copied(Vec<u8>),
}

impl ManifestBody {
    /// The body's bytes, copied out of the segment now (a manifest of the Llama shape: about
    /// 40 KB, whose fresh pages a first copy faults in).
    pub(crate) fn copied(self) -> Vec<u8> {
        match self {
            #[cfg(test)]
            ManifestBody::Copied(v) => v,
            ManifestBody::InSegment { seg, len } => copy_body(&seg, 0, len),
        }
    }
}

/// `len` bytes of the body of manifest segment `seg` from body offset `from`: the caller checked
/// `HEADER_PAGE + from + len <= seg.len()`.
fn copy_body(seg: &Segment, from: usize, len: usize) -> Vec<u8> {
    debug_assert!(HEADER_PAGE + from + len <= seg.len());
    let mut out = vec![0u8; len];
    // SAFETY: `HEADER_PAGE + from + len <= seg.len()` (the caller's check), every page backed
    // (checked at open); the body is immutable after the stamp, which `open_versioned`
    // Acquire-loaded; copied out byte-wise, never referenced.
    unsafe {
        std::ptr::copy_nonoverlapping(
            seg.as_ptr().add(HEADER_PAGE + from),
            out.as_mut_ptr(),
            out.len(),
        )
    };
    out
}

impl OpenedHead {
    /// The tensor tables decoded on this thread into the manifest's layout (their time added to
    /// `took`): what [`open_manifest_unverified`] returns.
    ///
    /// # Errors
    /// [`TensorSetError::BadManifest`] for tables that do not decode.
    pub(crate) fn decoded(self) -> Result<OpenedManifest> {
        let t = std::time::Instant::now();
        let body = self.body.copied();
        let layout = self
            .tables
            .decode(&body)
            .map_err(|f| bad(self.opened.seg.name(), f))?;
        let mut opened = self.opened;
        opened.manifest.layout = layout;
        opened.tables_took = t.elapsed();
        opened.took += opened.tables_took;
        Ok(opened)
    }
}

/// [`open_manifest_unverified`] up to the tensor tables: the header and allocation table decoded,
/// the tables located in the body (`took`: this much). For a reader that maps the memory while
/// another thread decodes the tables.
///
/// # Errors
/// As [`open_manifest_unverified`], less the tensor tables' faults.
pub(crate) fn open_manifest_head(set: &str, init_wait: Duration) -> Result<OpenedHead> {
    validate_set_name(set)?;
    let started = std::time::Instant::now();
    let name = format!("{MANIFEST_PREFIX}{set}");
    let seg = open_segment::<MANIFEST_MAGIC>(&name, init_wait, shows_no_use)
        .map_err(|e| open_error(set, &name, e))?;
    let h = versioned::header::<ManifestHeader>(&seg);
    let body_len = h.body_len.load(Ordering::Relaxed);
    let room = (seg.len() - HEADER_PAGE) as u64;
    if body_len > room {
        return Err(bad(
            &name,
            ManifestFault::Truncated {
                what: "its body",
                len: seg.len() as u64,
                need: body_len.saturating_add(HEADER_PAGE as u64),
            },
        ));
    }
    let body_len = body_len as usize; // at most the segment's length, a `usize`
    // Only the head is copied here: the body header and the allocation table, which the opening
    // thread decodes. The tensor tables (most of the body) are copied by the thread that decodes
    // them (`ManifestBody`).
    let mut head = copy_body(&seg, 0, body_len.min(manifest::BODY_HEADER));
    let head_len = manifest::head_len(&head, body_len);
    if head_len > head.len() {
        let more = copy_body(&seg, head.len(), head_len - head.len());
        head.extend_from_slice(&more);
    }
    let (manifest, tables) =
        manifest::decode_head_within(&head, body_len as u64).map_err(|f| bad(&name, f))?;
    let seg = Arc::new(seg);
    Ok(OpenedHead {
        opened: OpenedManifest {
            seg: seg.clone(),
            manifest,
            took: started.elapsed(),
            tables_took: Duration::ZERO,
        },
        body: ManifestBody::InSegment { seg, len: body_len },
        tables,
    })
}

/// A host set's data segment: B buffers of `stride` bytes after the header page.
pub(crate) struct DataSegment {
    pub(crate) seg: Segment,
    pub(crate) generation: u64,
    pub(crate) stride: usize,
    pub(crate) buffers: usize,
}

/// The data segment name of host set `set`: `cuda-ipc.td.SET`.
pub(crate) fn data_name(set: &str) -> String {
    format!("{DATA_PREFIX}{set}")
}

/// The page-aligned stride of a host buffer of `bytes` bytes.
pub(crate) fn data_stride(bytes: u64) -> Result<usize> {
    usize::try_from(bytes)
        .ok()
        .and_then(|b| b.max(1).checked_next_multiple_of(HEADER_PAGE))
        .ok_or_else(|| Error::InvalidArgument(format!("{bytes} bytes per buffer overflow")))
}

/// The stride (`data_stride`) and the whole length in bytes of a host set's data segment of
/// `buffers` buffers of `bytes` bytes (the header page, then the buffers).
///
/// # Errors
/// [`Error::InvalidArgument`] naming the buffers, the bytes and the limit when the segment would
/// pass `isize::MAX` bytes (what a file size, `off_t`, and a mapping hold).
pub(crate) fn data_len(buffers: usize, bytes: u64) -> Result<(usize, usize)> {
    let len = data_stride(bytes).ok().and_then(|stride| {
        stride
            .checked_mul(buffers)
            .and_then(|l| l.checked_add(HEADER_PAGE))
            .filter(|&l| l <= isize::MAX as usize)
            .map(|l| (stride, l))
    });
    len.ok_or_else(|| {
        Error::InvalidArgument(format!(
            "the data segment of {buffers} buffers of {bytes} bytes passes the most a segment \
             can hold ({} bytes)",
            isize::MAX
        ))
    })
}

impl DataSegment {
    /// Creates the data segment of `set` with `buffers` buffers of `bytes` bytes.
    pub(crate) fn create(set: &str, buffers: usize, bytes: u64) -> Result<DataSegment> {
        let (stride, len) = data_len(buffers, bytes)?;
        let name = data_name(set);
        let (seg, generation) = create::<DATA_MAGIC>(set, &name, len, shows_no_use, |_, h| {
            h.body_len.store(stride as u64, Ordering::Relaxed);
            h.buffers.store(buffers as u32, Ordering::Relaxed);
        })?;
        Ok(DataSegment {
            seg,
            generation,
            stride,
            buffers,
        })
    }

    /// Opens the data segment of `set` that `m` names (its generation, buffers and size).
    ///
    /// # Errors
    /// As [`open_manifest`] for the segment and its header; [`TensorSetError::BadManifest`]
    /// ([`ManifestFault::Mismatch`]) for a header of another creation, stride or buffer count
    /// than `m` names; [`ShmError::TooSmall`] for the segment `m` names cut short of its buffers;
    /// [`TensorSetError::NotFound`] when it is gone (its writer closed the set, or a new writer
    /// replaced it, since the manifest was read), as for the manifest.
    pub(crate) fn open(set: &str, m: &Manifest) -> Result<DataSegment> {
        let name = data_name(set);
        let seg =
            open_segment::<DATA_MAGIC>(&name, INIT_WAIT, shows_no_use).map_err(|e| match e {
                OpenError::Segment(Error::Shm(ShmError::NotFound { .. })) => {
                    TensorSetError::NotFound(set.to_string()).into()
                }
                e => open_error(set, &name, e),
            })?;
        let h = versioned::header::<DataHeader>(&seg);
        let stride = data_stride(m.layout.bytes_per_buffer())?;
        let mismatch = || {
            bad(
                &name,
                ManifestFault::Mismatch {
                    what: "the host data segment",
                },
            )
        };
        if h.generation.load(Ordering::Relaxed) != m.data_generation
            || h.body_len.load(Ordering::Relaxed) != stride as u64
            || h.buffers.load(Ordering::Relaxed) as usize != m.buffers
        {
            return Err(mismatch());
        }
        let Some(need) = stride
            .checked_mul(m.buffers)
            .and_then(|l| l.checked_add(HEADER_PAGE))
        else {
            return Err(mismatch());
        };
        // Its own creation, cut short (`truncate`): too small, not another creation.
        if seg.len() < need {
            return Err(ShmError::TooSmall {
                name,
                len: seg.len() as u64,
                min: need as u64,
            }
            .into());
        }
        Ok(DataSegment {
            seg,
            generation: m.data_generation,
            stride,
            buffers: m.buffers,
        })
    }

    /// The first byte of buffer `i` (`i < buffers`).
    pub(crate) fn ptr(&self, i: usize) -> *mut u8 {
        assert!(i < self.buffers);
        // SAFETY: `HEADER_PAGE + (i + 1) × stride <= len` (checked at create/open), so the
        // address lies in the mapping.
        unsafe { self.seg.as_ptr().add(HEADER_PAGE + i * self.stride) }
    }

    /// Unlinks the name while it still stands for this segment.
    pub(crate) fn unlink(&self) {
        unlink_own(&self.seg);
    }
}

/// Unlinks `seg`'s name while it still stands for `seg` (never one that replaced it).
pub(crate) fn unlink_own(seg: &Segment) {
    let r = seg
        .inode()
        .and_then(|ino| Segment::unlink_if_same(seg.name(), ino));
    if let Err(e) = r {
        tracing::warn!("unlinking {}: {e}", seg.name());
    }
}
