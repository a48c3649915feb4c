//! [`Segment`]: one named POSIX shared-memory object, sized, its pages reserved, mapped with
//! [`memmap2::MmapRaw`].

use super::ShmError;
use crate::error::{OsError, Result};
use memmap2::{MmapOptions, MmapRaw};
use rustix::fd::OwnedFd;
use rustix::fs::{FallocateFlags, Mode};
use rustix::io::Errno;
use rustix::shm::OFlags;

/// Where replacers lock a segment they are about to unlink ([`Segment::unlink_if_same`]): a
/// byte far past any segment's data (a lock range needs no data behind it).
const REPLACE_LOCK_OFFSET: i64 = 1 << 62;

/// Where a creator locks its new segment while it sizes it: an open-file-description write lock on
/// this byte (far past any data, beside the replacers' lock on byte 2^62), taken by
/// [`Segment::create`] right after `shm_open` and given back once every page is reserved. A segment found empty or sparse
/// with this byte locked is a creation in progress, however long its `fallocate` takes (tens of GB
/// take seconds); with it free, its creator is gone (the kernel drops the lock with the last
/// descriptor) or it is not ours ([`SegmentInfo::sizing`]). Part of the `/dev/shm` protocol: a
/// creator in another language takes the same lock.
pub const SIZING_LOCK_OFFSET: i64 = (1 << 62) + 1;

/// Sets (`F_WRLCK`) or clears (`F_UNLCK`) an open-file-description lock on the byte at `at` of
/// `fd`, without waiting (`F_OFD_SETLK`).
pub(super) fn ofd_lock(fd: &OwnedFd, kind: libc::c_int, at: i64) -> std::io::Result<()> {
    use rustix::fd::AsRawFd;
    // SAFETY: `flock` is a plain C struct of integers; all-zero is a valid value.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = at;
    l.l_len = 1;
    // SAFETY: `fd` is an open descriptor; `l` is a valid flock that outlives the call.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &l) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Whether another open file description holds a write lock on the byte at `at` of `fd`
/// (`F_OFD_GETLK`; a read lock, which anyone who can read the file may take, does not count);
/// `false` when the query fails.
pub(super) fn ofd_write_locked(fd: &OwnedFd, at: i64) -> bool {
    use rustix::fd::AsRawFd;
    // SAFETY: as in `ofd_lock`.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_WRLCK as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = at;
    l.l_len = 1;
    // SAFETY: `fd` is an open descriptor; `l` is a valid flock the kernel fills in.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_GETLK, &mut l) };
    r == 0 && l.l_type == libc::F_WRLCK as libc::c_short
}

/// How long a segment with its sizing lock held still counts as being sized
/// ([`SegmentInfo::sizing`]): far longer than `fallocate` of the largest segment takes, but a bound
/// where a creator's child forked without `exec` kept the lock after the creator died.
pub(crate) const SIZING_LIMIT_SECS: u64 = 60;

/// The longest segment name accepted, in bytes, without the leading `/` (Linux allows 255 for a file
/// name in `/dev/shm`; we keep room for suffixes).
pub const MAX_SEGMENT_NAME: usize = 200;

/// How a [`Segment`] is created.
///
/// The default is mode `0600`: only the creating user can open it.
///
/// # Examples
/// ```
/// use cuda_ipc::raw::shm::SegmentOptions;
/// let opts = SegmentOptions::new().group_access(true);
/// assert_eq!(opts.mode(), 0o660);
/// ```
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct SegmentOptions {
    group_access: bool,
}

impl SegmentOptions {
    /// Mode `0600`, no group access.
    pub fn new() -> Self {
        Self::default()
    }

    /// `true`: mode `0660`, so members of the creator's group may open the segment too.
    pub fn group_access(mut self, on: bool) -> Self {
        self.group_access = on;
        self
    }

    /// The file mode the segment is created with (`0600` or `0660`), set exactly, whatever the umask.
    pub fn mode(&self) -> u32 {
        if self.group_access { 0o660 } else { 0o600 }
    }
}

/// A named POSIX shared-memory object (`shm_open`), mapped read-write and shared.
///
/// The mapping is a [`MmapRaw`]: this type hands out a raw pointer and never a Rust reference to the
/// bytes, because other processes write them at any time. Callers access the bytes through atomics
/// (see [`crate::raw::shm::seqlock`]) or raw-pointer reads of bytes they know nobody writes.
///
/// Dropping a `Segment` unmaps it and closes its descriptor; it does not unlink the name (see
/// [`Segment::unlink`]).
///
/// A process with write access to the object can shrink it with `ftruncate` while others have it
/// mapped; accesses beyond the new end then raise `SIGBUS`. The segment is therefore only shared
/// between processes of one user (or one group, by option) that run this crate.
#[derive(Debug)]
pub struct Segment {
    // Drop order: the mapping first, then the descriptor it was made from.
    map: MmapRaw,
    fd: OwnedFd,
    name: String,
}

impl Segment {
    /// Creates the segment `name` (`shm_open` with `O_CREAT | O_EXCL`), sizes it to `len` bytes
    /// (`ftruncate`), reserves its pages (`fallocate`) and maps it. From `shm_open` until the
    /// pages are reserved it holds the sizing lock ([`SIZING_LOCK_OFFSET`]), so that openers wait
    /// for it and replacers leave it.
    ///
    /// `name` is given without the leading `/`; see [`validate_name`] for what is accepted. The
    /// bytes start zeroed. The mode is exactly [`SegmentOptions::mode`] (set with `fchmod`, so the
    /// umask does not change it).
    ///
    /// # Errors
    /// - [`ShmError::InvalidName`] for a bad name, [`crate::Error::InvalidArgument`] for `len == 0`;
    /// - [`ShmError::AlreadyExists`] when the name is taken;
    /// - [`ShmError::NoSpace`] when `/dev/shm` cannot hold `len` bytes;
    /// - [`crate::Error::Os`] for any other failed call.
    ///
    /// On any error after the object was made, the name is unlinked again.
    ///
    /// # Examples
    /// ```
    /// use cuda_ipc::raw::shm::{Segment, SegmentOptions};
    /// let name = format!("cuda-ipc-doc-create-{}", std::process::id());
    /// let seg = Segment::create(&name, 4096, &SegmentOptions::new())?;
    /// assert_eq!(seg.len(), 4096);
    /// Segment::unlink(&name)?;
    /// # Ok::<(), cuda_ipc::Error>(())
    /// ```
    #[doc(alias = "shm_open")]
    pub fn create(name: &str, len: usize, opts: &SegmentOptions) -> Result<Segment> {
        validate_name(name)?;
        if len == 0 {
            return Err(crate::Error::InvalidArgument(format!(
                "segment /{name}: a length of 0 bytes"
            )));
        }
        let path = format!("/{name}");
        let mode = Mode::from_raw_mode(opts.mode());
        let fd = match rustix::shm::open(
            path.as_str(),
            OFlags::CREATE | OFlags::EXCL | OFlags::RDWR,
            mode,
        ) {
            Ok(fd) => fd,
            Err(Errno::EXIST) => {
                return Err(ShmError::AlreadyExists {
                    name: name.to_string(),
                }
                .into());
            }
            // Out of inodes (tmpfs `nr_inodes`): as full as out of pages, for the user.
            Err(Errno::NOSPC) => {
                return Err(ShmError::NoSpace {
                    name: name.to_string(),
                    len: len as u64,
                }
                .into());
            }
            Err(e) => return Err(OsError::new("shm_open", path, e).into()),
        };
        // Until its pages are reserved, the new object is marked as a creation in progress
        // (`SIZING_LOCK_OFFSET`). Another process that opened it first could hold the byte; a
        // failure here only costs openers and replacers the age rule: logged, not fatal.
        if let Err(e) = ofd_lock(&fd, libc::F_WRLCK, SIZING_LOCK_OFFSET) {
            tracing::debug!(segment = %path, error = %e, "no sizing lock on a new segment");
        }
        match Self::size_and_map(fd, name, len, mode) {
            Ok(seg) => Ok(seg),
            Err(e) => {
                // We made the object: take the name away again so a retry is not blocked.
                if let Err(u) = rustix::shm::unlink(path.as_str()) {
                    tracing::warn!(segment = %path, error = %u, "could not unlink a half-made segment");
                }
                Err(e)
            }
        }
    }

    fn size_and_map(fd: OwnedFd, name: &str, len: usize, mode: Mode) -> Result<Segment> {
        let path = format!("/{name}");
        rustix::fs::fchmod(&fd, mode).map_err(|e| OsError::new("fchmod", path.as_str(), e))?;
        let len64 = len as u64;
        rustix::fs::ftruncate(&fd, len64).map_err(|e| match e {
            Errno::NOSPC | Errno::FBIG => ShmError::NoSpace {
                name: name.to_string(),
                len: len64,
            }
            .into(),
            e => crate::Error::from(OsError::new("ftruncate", path.as_str(), e)),
        })?;
        // Reserve the pages now, so a full /dev/shm is an error here and not a SIGBUS at first touch.
        match rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len64) {
            Ok(()) => {}
            Err(Errno::NOSPC) => {
                return Err(ShmError::NoSpace {
                    name: name.to_string(),
                    len: len64,
                }
                .into());
            }
            Err(Errno::OPNOTSUPP | Errno::NOSYS) => {
                // No fallocate here: write the zeros, so every page is backed all the same (an
                // opener refuses a sparse segment) and a full /dev/shm is an error now.
                let zeros = vec![0u8; 1 << 16];
                let mut at = 0u64;
                while at < len64 {
                    let n = (len64 - at).min(zeros.len() as u64) as usize;
                    match rustix::io::pwrite(&fd, &zeros[..n], at) {
                        Ok(w) => at += w as u64,
                        Err(Errno::INTR) => {}
                        Err(Errno::NOSPC) => {
                            return Err(ShmError::NoSpace {
                                name: name.to_string(),
                                len: len64,
                            }
                            .into());
                        }
                        Err(e) => return Err(OsError::new("pwrite", path.as_str(), e).into()),
                    }
                }
            }
            Err(e) => return Err(OsError::new("fallocate", path.as_str(), e).into()),
        }
        // Sized: no longer a creation in progress for openers and replacers (the lock belongs to
        // this open file description, which the segment keeps: it is given back here, not at close).
        let _ = ofd_lock(&fd, libc::F_UNLCK, SIZING_LOCK_OFFSET);
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&fd)
            .map_err(|e| OsError::io("mmap", path.as_str(), e))?;
        Ok(Segment {
            map,
            fd,
            name: name.to_string(),
        })
    }

    /// Opens the existing segment `name` and maps all of it; its size comes from `fstat`.
    ///
    /// Same as [`Segment::open_with_min_len`] with a minimum of one byte.
    ///
    /// # Errors
    /// As [`Segment::open_with_min_len`].
    #[doc(alias = "shm_open")]
    pub fn open(name: &str) -> Result<Segment> {
        Self::open_with_min_len(name, 1)
    }

    /// Opens the existing segment `name`, checks it holds at least `min_len` bytes, and maps all of it.
    ///
    /// Before anything is mapped or read, the descriptor is checked (`fstat`): it must be a regular
    /// file (a FIFO, directory, socket or device planted under the name is refused, and opening
    /// never blocks: `O_NONBLOCK`), at least `min_len` bytes long, and fully backed by memory
    /// (`st_blocks` covers every page), so that touching its pages can never raise `SIGBUS` in a full
    /// `/dev/shm`.
    ///
    /// # Errors
    /// - [`ShmError::InvalidName`] for a bad name;
    /// - [`ShmError::NotFound`] when there is no such segment;
    /// - [`ShmError::NotASegment`] when the name is a FIFO, directory, socket, device or symbolic
    ///   link (never followed);
    /// - [`ShmError::WrongOwner`] when another user's segment may not be opened by us
    ///   (`EACCES`), naming both uids;
    /// - [`ShmError::TooSmall`] when its size is 0 or below `min_len` (checked before mapping,
    ///   so a short segment is an error and not a fault);
    /// - [`ShmError::Sparse`] when some of its pages are not backed (a creator that died
    ///   between `ftruncate` and `fallocate`, or a file sized with `truncate`);
    /// - [`crate::Error::Os`] for a failed call (`EACCES` when the mode forbids us).
    pub fn open_with_min_len(name: &str, min_len: usize) -> Result<Segment> {
        validate_name(name)?;
        let path = format!("/{name}");
        let fd = open_checked(name, true)?;
        let info = SegmentInfo::of(name, &fd)?;
        let size = info.len;
        let min = min_len.max(1) as u64;
        if size < min || usize::try_from(size).is_err() {
            return Err(ShmError::TooSmall {
                name: name.to_string(),
                len: size,
                min,
            }
            .into());
        }
        if info.sparse {
            return Err(ShmError::Sparse {
                name: name.to_string(),
                len: size,
                backed: info.backed,
            }
            .into());
        }
        let map = MmapOptions::new()
            .len(size as usize)
            .map_raw(&fd)
            .map_err(|e| OsError::io("mmap", path.as_str(), e))?;
        Ok(Segment {
            map,
            fd,
            name: name.to_string(),
        })
    }

    /// What is behind the name `name`, without mapping or reading it: opened read-only with
    /// `O_NOFOLLOW | O_NONBLOCK`, then `fstat`. For tools and for creators that
    /// find a name taken and must decide whether the old segment is theirs to replace.
    ///
    /// # Errors
    /// [`ShmError::InvalidName`], [`ShmError::NotFound`],
    /// [`ShmError::NotASegment`] (a FIFO, directory, socket, device or symbolic link),
    /// [`crate::Error::Os`] otherwise.
    pub fn stat(name: &str) -> Result<SegmentInfo> {
        validate_name(name)?;
        let fd = open_checked(name, false)?;
        SegmentInfo::of(name, &fd)
    }

    /// Whether the name `name` still stands for this mapping's object: `false` when it was removed
    /// and made again (another inode behind the name) — the mapping is then superseded. `true` also
    /// when the name is gone (nothing replaced it) or cannot be looked at.
    ///
    /// One `stat` call: for slow paths (a wait that timed out), never per operation.
    pub fn name_is_still_this(&self) -> bool {
        let Ok(mine) = rustix::fs::fstat(&self.fd) else {
            return true;
        };
        match rustix::fs::lstat(format!("{SHM_DIR}/{}", self.name).as_str()) {
            Ok(now) => now.st_ino == mine.st_ino && now.st_dev == mine.st_dev,
            Err(_) => true,
        }
    }

    /// Removes the name `name` only while it still stands for the object with inode `inode` (one a
    /// caller judged, e.g. a dead producer's segment), and returns whether it did.
    ///
    /// Judging a segment and removing its name are two steps; two processes replacing the same
    /// stale segment at once could otherwise remove the one the faster of them just made. Every
    /// replacer therefore holds an open-file-description write lock on the judged object itself (a
    /// byte range far past its data) while it checks the name once more and unlinks: a second
    /// replacer waits for the first (at most 2 s), then finds another inode (or none) behind the
    /// name and removes nothing. A fresh `create` cannot slip in while the judged object still has
    /// the name (`O_EXCL`).
    ///
    /// `Ok(false)`: the name is gone or stands for another object now, or another replacer held
    /// the object for more than 2 s.
    ///
    /// # Errors
    /// As [`Segment::open`] for the open (`NotASegment`, `WrongOwner`, ...), and
    /// [`crate::Error::Os`] when a lock or unlink fails otherwise.
    pub fn unlink_if_same(name: &str, inode: u64) -> Result<bool> {
        validate_name(name)?;
        let fd = match open_checked(name, true) {
            Ok(fd) => fd,
            Err(crate::Error::Shm(ShmError::NotFound { .. })) => return Ok(false),
            Err(e) => return Err(e),
        };
        let path = format!("{SHM_DIR}/{name}");
        let st = rustix::fs::fstat(&fd).map_err(|e| OsError::new("fstat", path.as_str(), e))?;
        if st.st_ino != inode {
            return Ok(false);
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while let Err(e) = ofd_lock(&fd, libc::F_WRLCK, REPLACE_LOCK_OFFSET) {
            if !matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) {
                return Err(OsError::io("fcntl(F_OFD_SETLK)", path, e).into());
            }
            if std::time::Instant::now() >= deadline {
                return Ok(false); // another replacer is at work on it: leave it to them
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // With the lock held, nobody else of this crate removes or replaces the name.
        match rustix::fs::lstat(path.as_str()) {
            Ok(now) if now.st_ino == inode && now.st_dev == st.st_dev => {}
            _ => return Ok(false),
        }
        match Self::unlink(name) {
            Ok(()) => Ok(true),
            Err(crate::Error::Shm(ShmError::NotFound { .. })) => Ok(false),
            Err(e) => Err(e),
        }
        // `fd` closes here, releasing the lock for the next replacer, who finds the name changed.
    }

    /// Removes the name `name` (`shm_unlink`). Mappings that exist stay valid until unmapped.
    ///
    /// # Errors
    /// [`ShmError::InvalidName`], [`ShmError::NotFound`] when no such name exists, and
    /// [`crate::Error::Os`] for other failures.
    #[doc(alias = "shm_unlink")]
    pub fn unlink(name: &str) -> Result<()> {
        validate_name(name)?;
        let path = format!("/{name}");
        match rustix::shm::unlink(path.as_str()) {
            Ok(()) => Ok(()),
            Err(Errno::NOENT) => Err(ShmError::NotFound {
                name: name.to_string(),
            }
            .into()),
            Err(e) => Err(OsError::new("shm_unlink", path, e).into()),
        }
    }

    /// The first byte of the mapping. Valid for [`Segment::len`] bytes while `self` lives.
    ///
    /// Other processes may write any of these bytes at any time: read and write them only through
    /// atomics or raw-pointer accesses, never through a `&[u8]` or `&mut [u8]`.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// The mapped length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Always `false`: a segment is at least one byte.
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// The name, without the leading `/`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The segment's current size according to `fstat`, in bytes (another process may have changed
    /// it since mapping).
    ///
    /// # Errors
    /// [`crate::Error::Os`] when `fstat` fails.
    pub fn current_size(&self) -> Result<u64> {
        let st = rustix::fs::fstat(&self.fd)
            .map_err(|e| OsError::new("fstat", format!("/{}", self.name), e))?;
        Ok(u64::try_from(st.st_size).unwrap_or(0))
    }

    /// Checks that the object still holds every byte this process mapped, each page backed
    /// (`fstat`: `st_size` and `st_blocks`): a guard before touching a segment that another process
    /// of this user could have cut short (`ftruncate`) since it was mapped, where a touch past the
    /// new end would raise `SIGBUS`. One `fstat` call; a cut that lands between this check and the
    /// access still faults (only the segment's own user can make it: mode `0600`/`0660`).
    ///
    /// # Errors
    /// [`ShmError::Shrunk`] naming the size and backed bytes now and the bytes mapped;
    /// [`crate::Error::Os`] when `fstat` fails.
    pub fn check_intact(&self) -> Result<()> {
        let info = SegmentInfo::of(&self.name, &self.fd)?;
        let mapped = self.map.len() as u64;
        if info.len < mapped || info.backed < mapped.div_ceil(4096) * 4096 {
            return Err(ShmError::Shrunk {
                name: self.name.clone(),
                len: info.len,
                backed: info.backed,
                mapped,
            }
            .into());
        }
        Ok(())
    }

    /// The uid that owns the segment (`fstat`'s `st_uid`).
    ///
    /// # Errors
    /// [`crate::Error::Os`] when `fstat` fails.
    pub fn owner_uid(&self) -> Result<u32> {
        let st = rustix::fs::fstat(&self.fd)
            .map_err(|e| OsError::new("fstat", format!("/{}", self.name), e))?;
        Ok(st.st_uid)
    }

    /// The inode number (`fstat`'s `st_ino`), to tell two objects that had the same name apart.
    ///
    /// # Errors
    /// [`crate::Error::Os`] when `fstat` fails.
    pub fn inode(&self) -> Result<u64> {
        let st = rustix::fs::fstat(&self.fd)
            .map_err(|e| OsError::new("fstat", format!("/{}", self.name), e))?;
        Ok(st.st_ino)
    }

    /// The owner's uid and gid and the permission bits (`st_mode & 0o7777`), from `fstat`.
    ///
    /// # Errors
    /// [`crate::Error::Os`] when `fstat` fails.
    pub fn owner(&self) -> Result<(u32, u32, u32)> {
        let st = rustix::fs::fstat(&self.fd)
            .map_err(|e| OsError::new("fstat", format!("/{}", self.name), e))?;
        Ok((st.st_uid, st.st_gid, st.st_mode & 0o7777))
    }

    /// Checks who may have written the segment: it must belong to this process's effective uid, or,
    /// with `allow_group`, give its group access (mode `0660`, `0640`, ...), have no bits for
    /// others, and belong to one of this process's groups.
    /// A segment that others (not owner, not group) may access is refused either way.
    ///
    /// # Errors
    /// [`ShmError::InsecureMode`] for a segment with any of the mode bits `0o007`;
    /// [`ShmError::WrongOwner`] naming both uids; [`crate::Error::Os`] when a call fails.
    pub fn check_access(&self, allow_group: bool) -> Result<()> {
        let (uid, gid, mode) = self.owner()?;
        access_rule(&self.name, uid, gid, mode, allow_group)
    }

    /// Checks that the segment belongs to this process's effective uid and gives other users (not
    /// owner, not group) no access: [`Segment::check_access`] without group access. The library
    /// makes its segments with mode `0600` (`0660` shared with a group); one open to others may
    /// have been written by anyone, and is not trusted.
    ///
    /// # Errors
    /// [`ShmError::InsecureMode`] for a segment with any of the mode bits `0o007`;
    /// [`ShmError::WrongOwner`] naming both uids; [`crate::Error::Os`] when `fstat` fails.
    pub fn check_owner(&self) -> Result<()> {
        let (owner, _, mode) = self.owner()?;
        if mode & 0o007 != 0 {
            return Err(ShmError::InsecureMode {
                name: self.name.clone(),
                mode,
            }
            .into());
        }
        let ours = rustix::process::geteuid().as_raw();
        if owner != ours {
            return Err(ShmError::WrongOwner {
                name: self.name.clone(),
                owner,
                ours,
            }
            .into());
        }
        Ok(())
    }

    /// The descriptor of the shared-memory object (for `fchown`, `flock`, passing it on, ...).
    pub fn fd(&self) -> rustix::fd::BorrowedFd<'_> {
        use rustix::fd::AsFd;
        self.fd.as_fd()
    }
}

/// The rule of [`Segment::check_access`] for a segment of owner `uid`, group `gid` and permission
/// bits `mode`.
fn access_rule(name: &str, uid: u32, gid: u32, mode: u32, allow_group: bool) -> Result<()> {
    let ours = rustix::process::geteuid().as_raw();
    let wrong = || {
        Err(ShmError::WrongOwner {
            name: name.to_string(),
            owner: uid,
            ours,
        }
        .into())
    };
    if mode & 0o007 != 0 {
        return Err(ShmError::InsecureMode {
            name: name.to_string(),
            mode,
        }
        .into());
    }
    if uid == ours {
        return Ok(());
    }
    if !allow_group {
        return wrong();
    }
    // Shared with the group only when its mode says so (0660): root, who can open anything,
    // must not take a 0600 segment of another user for one shared with root's group.
    let in_group = rustix::process::getegid().as_raw() == gid
        || rustix::process::getgroups()
            .map(|gs| gs.iter().any(|g| g.as_raw() == gid))
            .unwrap_or(false);
    if in_group && mode & 0o060 != 0 {
        Ok(())
    } else {
        wrong()
    }
}

/// What [`Segment::stat`] found behind a name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SegmentInfo {
    /// Size in bytes (`st_size`).
    pub len: u64,
    /// Bytes backed by memory (`st_blocks` × 512).
    pub backed: u64,
    /// Whether fewer bytes are backed than the size needs (rounded up to 4096-byte pages): some
    /// page lies in a hole and would have to be allocated at first touch.
    pub sparse: bool,
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Inode number.
    pub inode: u64,
    /// Seconds since the last status change (`st_ctime`: creation, `ftruncate`, `fchmod`).
    pub age_secs: u64,
    /// Whether a creator is sizing it now: it is empty or sparse, younger than 60 s, and its
    /// [`SIZING_LOCK_OFFSET`] byte is write-locked (`F_OFD_GETLK`). Always `false` for a segment
    /// with every page reserved (not asked). Says nothing of who holds the lock: whoever can open
    /// the file for writing can take it; callers weigh it with [`uid`](Self::uid).
    pub sizing: bool,
}

impl SegmentInfo {
    /// Whether a segment of this owner, group and mode may be opened as
    /// [`Segment::check_access`] (`allow_group`) or [`Segment::check_owner`] (without it) would
    /// let it: judged before it is mapped, so that another user's file, or one open to others, is
    /// refused by whose it is, not waited for.
    ///
    /// # Errors
    /// [`ShmError::InsecureMode`] (any of the mode bits `0o007`), [`ShmError::WrongOwner`] for
    /// `name`.
    pub(crate) fn may_open(&self, name: &str, allow_group: bool) -> Result<()> {
        access_rule(name, self.uid, self.gid, self.mode, allow_group)
    }

    fn of(name: &str, fd: &OwnedFd) -> Result<SegmentInfo> {
        let path = format!("{SHM_DIR}/{name}");
        let st = rustix::fs::fstat(fd).map_err(|e| OsError::new("fstat", path.as_str(), e))?;
        let ft = rustix::fs::FileType::from_raw_mode(st.st_mode);
        if ft != rustix::fs::FileType::RegularFile {
            return Err(ShmError::NotASegment {
                name: name.to_string(),
                kind: file_kind(ft),
            }
            .into());
        }
        let len = u64::try_from(st.st_size).unwrap_or(0);
        let backed = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
        // Counted in pages actually allocated (`st_blocks`), not with `SEEK_HOLE`: tmpfs reports
        // pages reserved by `fallocate` but never written as holes, though they are backed.
        let sparse = backed < len.div_ceil(4096) * 4096;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let age_secs = now.saturating_sub(u64::try_from(st.st_ctime).unwrap_or(0));
        Ok(SegmentInfo {
            len,
            backed,
            sparse,
            uid: st.st_uid,
            gid: st.st_gid,
            mode: st.st_mode & 0o7777,
            inode: st.st_ino,
            age_secs,
            sizing: (len == 0 || sparse)
                && age_secs < SIZING_LIMIT_SECS
                && ofd_write_locked(fd, SIZING_LOCK_OFFSET),
        })
    }
}

fn file_kind(ft: rustix::fs::FileType) -> &'static str {
    use rustix::fs::FileType as T;
    match ft {
        T::RegularFile => "regular file",
        T::Directory => "directory",
        T::Symlink => "symbolic link",
        T::Fifo => "FIFO",
        T::Socket => "socket",
        T::CharacterDevice => "character device",
        T::BlockDevice => "block device",
        _ => "special file",
    }
}

/// Opens `/dev/shm/NAME` for a segment: never through a symbolic link (`O_NOFOLLOW`, as glibc's
/// shm_open passes it: /dev/shm is writable by everyone, so a link planted under a segment's name
/// must not make us map, and then write, the file it points to), never blocking on a FIFO
/// (`O_NONBLOCK`), close-on-exec; read-write or read-only.
fn open_checked(name: &str, write: bool) -> Result<OwnedFd> {
    let path = format!("/{name}");
    let extra = OFlags::from_bits_retain(
        (rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::NOCTTY)
            .bits(),
    );
    let access = if write { OFlags::RDWR } else { OFlags::RDONLY };
    match rustix::shm::open(path.as_str(), access | extra, Mode::empty()) {
        Ok(fd) => Ok(fd),
        Err(Errno::NOENT) => Err(ShmError::NotFound {
            name: name.to_string(),
        }
        .into()),
        // Never followed: a link is what stands under the name, not a segment.
        Err(Errno::LOOP) => Err(ShmError::NotASegment {
            name: name.to_string(),
            kind: "symbolic link",
        }
        .into()),
        Err(Errno::ISDIR) => Err(ShmError::NotASegment {
            name: name.to_string(),
            kind: "directory",
        }
        .into()),
        // A socket (or a device without a driver) cannot be opened at all.
        Err(Errno::NXIO) => Err(ShmError::NotASegment {
            name: name.to_string(),
            kind: "socket",
        }
        .into()),
        // Not ours to open: name the owner when the name can be looked at.
        Err(Errno::ACCESS) => match rustix::fs::lstat(format!("{SHM_DIR}/{name}").as_str()) {
            Ok(st) if st.st_uid != rustix::process::geteuid().as_raw() => {
                Err(ShmError::WrongOwner {
                    name: name.to_string(),
                    owner: st.st_uid,
                    ours: rustix::process::geteuid().as_raw(),
                }
                .into())
            }
            _ => Err(OsError::new("shm_open", path, Errno::ACCESS).into()),
        },
        Err(e) => Err(OsError::new("shm_open", path, e).into()),
    }
}

/// Checks a segment name: 1 to [`MAX_SEGMENT_NAME`] bytes of `[A-Za-z0-9._-]`, not `.` or `..`,
/// given without the leading `/` (it is added here).
///
/// # Errors
/// [`ShmError::InvalidName`] saying what is wrong.
pub fn validate_name(name: &str) -> Result<()> {
    let bad = |reason| {
        Err(ShmError::InvalidName {
            name: name.chars().take(MAX_SEGMENT_NAME + 8).collect(),
            reason,
        }
        .into())
    };
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > MAX_SEGMENT_NAME {
        return bad("longer than 200 bytes");
    }
    if name == "." || name == ".." {
        return bad("`.` and `..` are not names");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return bad("only ASCII letters, digits, `.`, `_` and `-` are allowed (no leading `/`)");
    }
    Ok(())
}

/// The folder where Linux (glibc and musl) keeps POSIX shared-memory objects: `shm_open("/NAME")`
/// makes the file `/dev/shm/NAME`.
pub const SHM_DIR: &str = "/dev/shm";
