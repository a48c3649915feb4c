//! What several fuzz targets share: planting a segment of given bytes under a name.

use cuda_ipc::raw::shm::{Segment, SegmentOptions};

/// Replaces segment `name` by one holding `img` (mode 0660 with `group`, else 0600); `false` when
/// it cannot be made.
pub fn plant(name: &str, img: &[u8], group: bool) -> bool {
    let _ = Segment::unlink(name);
    let opts = SegmentOptions::new().group_access(group);
    let Ok(seg) = Segment::create(name, img.len().max(1), &opts) else {
        return false;
    };
    // SAFETY: the mapping is at least `img.len()` bytes; this process made the segment, and
    // nothing else writes it; `img` is this process's memory, apart from the mapping.
    unsafe { std::ptr::copy_nonoverlapping(img.as_ptr(), seg.as_ptr(), img.len()) };
    true
}
