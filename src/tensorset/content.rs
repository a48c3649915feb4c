//! Content fingerprints: what a generation's bytes are, computed where the bytes lie (a kernel
//! over device memory, the host twin over host memory), so that a reader refuses a generation
//! whose weights are not the ones its writer published or it expects
//! ([`TensorSetError::ContentMismatch`](crate::tensorset::TensorSetError::ContentMismatch)), and a
//! tensor-set bridge writes only the tensors that changed.
//!
//! A tensor's digest ([`TensorDigest`], 16 bytes): its bytes are read as 16-byte little-endian
//! words `(lo_i, hi_i)` (the last zero-padded); two 64-bit lanes each sum a mix of every word
//! with its index (mod 2^64), and the byte length is mixed into each sum at the end. The sums
//! commute, so the kernel's result does not depend on its grid or on the order of its atomics, and
//! the host twin ([`digest_bytes`]) computes the same 16 bytes. The kernel is
//! `kernels/fingerprint.cu` (`fingerprint_items`), one pass over the bytes at memory bandwidth.
//! A generation's fingerprint ([`set_fingerprint`], 32 bytes): SHA-256 over a tag, the layout
//! fingerprint and every tensor's digest in order.
//!
//! It detects changed, wrong or corrupted content (a different checkpoint, a missed update, a
//! stray write), with a chance of two different contents colliding of about 2^-64 per lane; it is
//! not a cryptographic hash of the bytes: it does not stand against someone who crafts content to
//! collide (the segment's writer, who could publish anything, is trusted anyway).

use crate::driver::{Context, DeviceBuffer, DeviceMemory, Function, LaunchConfig, Module, Stream};
use crate::error::{Error, Result};
use crate::tensorset::manifest::Layout;
use std::ffi::c_void;
use std::sync::Arc;

/// One tensor's content digest (16 bytes; see the module's documentation).
pub type TensorDigest = [u8; 16];

/// The PTX of `kernels/fingerprint.cu` (compute_75, PTX ISA 8.0: any CUDA 12 or newer driver).
pub const PTX: &str = include_str!("../../kernels/fingerprint.ptx");

const M_LO: u64 = 0x9E37_79B9_7F4A_7C15;
const M_HI: u64 = 0xC2B2_AE3D_27D4_EB4F;
const C1: u64 = 0x1656_67B1_9E37_79F9;
/// Bytes per work item of the kernel (a multiple of 16): one block sums one item at a time.
const PIECE: u64 = 1 << 20;
/// Host bytes past which [`digest_bytes`] sums on several threads.
const PARALLEL_BYTES: usize = 64 << 20;
/// The tag [`set_fingerprint`] hashes first (the scheme's version).
const TAG: &[u8] = b"cuda-ipc content fingerprint v1\0";

fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    k ^= k >> 33;
    k = k.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    k ^ (k >> 33)
}

/// Adds word `i` (`lo`, `hi`) to the lanes `s`; `fp_word` in the kernel.
fn word(lo: u64, hi: u64, i: u64, s: &mut [u64; 2]) {
    let a = lo.wrapping_mul(M_LO).wrapping_add(i);
    let b = hi.wrapping_mul(M_HI).wrapping_add(i.rotate_left(32));
    s[0] = s[0].wrapping_add(fmix64(a ^ b.rotate_left(29)));
    s[1] = s[1].wrapping_add(fmix64(b.wrapping_add(a.rotate_left(41)).wrapping_add(C1)));
}

/// The lanes of `bytes`, whose first word has index `first`.
fn sums(bytes: &[u8], first: u64) -> [u64; 2] {
    let mut s = [0u64; 2];
    let mut words = bytes.chunks_exact(16);
    let mut i = first;
    for w in words.by_ref() {
        let (lo, hi) = w.split_at(8);
        let lo = u64::from_le_bytes(lo.try_into().unwrap_or_default());
        let hi = u64::from_le_bytes(hi.try_into().unwrap_or_default());
        word(lo, hi, i, &mut s);
        i += 1;
    }
    let rest = words.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 16];
        w[..rest.len()].copy_from_slice(rest);
        let lo = u64::from_le_bytes(w[..8].try_into().unwrap_or_default());
        let hi = u64::from_le_bytes(w[8..].try_into().unwrap_or_default());
        word(lo, hi, i, &mut s);
    }
    s
}

/// The digest of lanes `s` over `len` bytes.
fn finish(s: [u64; 2], len: u64) -> TensorDigest {
    let a = fmix64(s[0] ^ len.wrapping_mul(M_LO));
    let b = fmix64(s[1] ^ len.wrapping_mul(M_HI) ^ C1);
    let mut d = [0u8; 16];
    d[..8].copy_from_slice(&a.to_le_bytes());
    d[8..].copy_from_slice(&b.to_le_bytes());
    d
}

/// The digest of `bytes` computed on the host: the same 16 bytes the kernel computes over the
/// same bytes in device memory. Past 64 MiB the words are summed on up to
/// `std::thread::available_parallelism` threads.
pub fn digest_bytes(bytes: &[u8]) -> TensorDigest {
    let threads = if bytes.len() < PARALLEL_BYTES {
        1
    } else {
        threads()
    };
    let s = if threads < 2 {
        sums(bytes, 0)
    } else {
        // Parts of whole words; the lanes add up whatever the split.
        let part = bytes.len().div_ceil(threads).next_multiple_of(16);
        std::thread::scope(|sc| {
            let parts: Vec<_> = bytes
                .chunks(part)
                .enumerate()
                .map(|(k, c)| sc.spawn(move || sums(c, (k * part / 16) as u64)))
                .collect();
            parts.into_iter().fold([0u64; 2], |acc, p| {
                // A part's thread cannot panic (no indexing, no allocation past its slice); a
                // join error is therefore unreachable, and summing zero for it is never used.
                let s = p.join().unwrap_or([0; 2]);
                [acc[0].wrapping_add(s[0]), acc[1].wrapping_add(s[1])]
            })
        })
    };
    finish(s, bytes.len() as u64)
}

/// Threads for a large host digest (`std::thread::available_parallelism`, read once).
fn threads() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Bytes a host digest of shared memory copies at a time.
const STAGE: usize = 4 << 20;

/// The lanes of the `len` bytes at `ptr`, whose first word has index `first`, copied out
/// [`STAGE`] bytes at a time (`len` a multiple of 16 except for a tensor's last part).
///
/// # Safety
/// As [`digest_shared`].
unsafe fn sums_shared(ptr: *const u8, len: usize, first: u64) -> [u64; 2] {
    let mut buf = vec![0u8; STAGE.min(len)];
    let mut s = [0u64; 2];
    let mut at = 0;
    while at < len {
        let n = STAGE.min(len - at);
        // SAFETY: `at + n <= len`: inside the range the caller vouches for; `buf` is this
        // function's and holds at least `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(ptr.add(at), buf.as_mut_ptr(), n) };
        let p = sums(&buf[..n], first + (at / 16) as u64);
        s = [s[0].wrapping_add(p[0]), s[1].wrapping_add(p[1])];
        at += n;
    }
    s
}

/// [`digest_bytes`] of the `len` bytes at `ptr` in memory other processes map (a host tensor
/// set's buffer): copied out a few MiB at a time (never a reference into shared memory, never a
/// copy of the whole tensor), on several threads past 64 MiB.
///
/// # Safety
/// `ptr..ptr + len` is readable for the call (a mapping that outlives it); bytes another process
/// writes meanwhile give a digest of some mix of old and new bytes, never undefined behaviour
/// (they are only copied, byte for byte).
pub(crate) unsafe fn digest_shared(ptr: *const u8, len: usize) -> TensorDigest {
    let threads = if len < PARALLEL_BYTES { 1 } else { threads() };
    let s = if threads < 2 {
        // SAFETY: forwarded from this function's contract.
        unsafe { sums_shared(ptr, len, 0) }
    } else {
        let part = len.div_ceil(threads).next_multiple_of(16);
        // Addresses cross threads as integers: each part is a distinct range of the caller's.
        let base = ptr as usize;
        std::thread::scope(|sc| {
            let parts: Vec<_> = (0..len)
                .step_by(part)
                .map(|at| {
                    let n = part.min(len - at);
                    // SAFETY: `at + n <= len`, inside the caller's range, alive for the scope.
                    sc.spawn(move || unsafe {
                        sums_shared((base + at) as *const u8, n, (at / 16) as u64)
                    })
                })
                .collect();
            parts.into_iter().fold([0u64; 2], |acc, p| {
                // A part's thread cannot panic but by allocation failure, which aborts.
                let s = p.join().unwrap_or([0; 2]);
                [acc[0].wrapping_add(s[0]), acc[1].wrapping_add(s[1])]
            })
        })
    };
    finish(s, len as u64)
}

/// [`digest_shared`] of every tensor of `layout` in the host buffer at `base`.
///
/// # Safety
/// `base` is the first byte of a buffer of `layout` (`bytes_per_buffer` bytes, the layout checked
/// at decode) in a mapping that outlives the call, as [`digest_shared`] asks of each tensor.
pub(crate) unsafe fn host_digests(base: *const u8, layout: &Layout) -> Vec<TensorDigest> {
    layout
        .tensors()
        .iter()
        // SAFETY: `offset + bytes <= bytes_per_buffer`, so each tensor lies in the buffer.
        .map(|t| unsafe { digest_shared(base.add(t.offset as usize), t.bytes as usize) })
        .collect()
}

/// A generation's content fingerprint: SHA-256 over a tag, `layout`'s fingerprint, the number of
/// tensors and `digests` (one per tensor of `layout`, in order).
///
/// # Errors
/// [`Error::InvalidArgument`] when `digests` does not hold one digest per tensor.
pub fn set_fingerprint(layout: &Layout, digests: &[TensorDigest]) -> Result<[u8; 32]> {
    use sha2::Digest as _;
    if digests.len() != layout.len() {
        return Err(Error::InvalidArgument(format!(
            "{} digests for {} tensors",
            digests.len(),
            layout.len()
        )));
    }
    let mut h = sha2::Sha256::new();
    h.update(TAG);
    h.update(layout.fingerprint());
    h.update((digests.len() as u64).to_le_bytes());
    for d in digests {
        h.update(d);
    }
    Ok(h.finalize().into())
}

/// The fingerprinter in `cell`, loaded into `ctx` at the first call.
pub(crate) fn cached<'c>(
    cell: &'c std::sync::OnceLock<Fingerprinter>,
    ctx: &Arc<Context>,
) -> Result<&'c Fingerprinter> {
    if let Some(f) = cell.get() {
        return Ok(f);
    }
    let f = Fingerprinter::new(ctx)?;
    Ok(cell.get_or_init(|| f))
}

/// The fingerprint kernel loaded in one context (`cuModuleLoadData` of [`PTX`]: the driver
/// JIT-compiles it once per process and caches the result on disk), with its item table and
/// result buffers, kept between calls and grown when a call needs more (a `cuMemFree`, which
/// waits for the device, only then). Calls from several threads take turns.
#[derive(Debug)]
pub struct Fingerprinter {
    func: Function,
    ctx: Arc<Context>,
    /// (item table, results), each allocated at the first call and grown as needed.
    buffers: std::sync::Mutex<(Option<DeviceBuffer>, Option<DeviceBuffer>)>,
}

/// `slot`, holding at least `len` bytes: the one there, or a new one (the old one freed).
fn at_least<'b>(
    slot: &'b mut Option<DeviceBuffer>,
    ctx: &Arc<Context>,
    len: usize,
) -> Result<&'b DeviceBuffer> {
    if slot.as_ref().is_none_or(|b| b.len() < len) {
        *slot = None;
        *slot = Some(DeviceBuffer::new(ctx, len.next_power_of_two().max(4096))?);
    }
    slot.as_ref()
        .ok_or_else(|| Error::InvalidArgument("no fingerprint buffer".into()))
}

impl Fingerprinter {
    /// Loads the kernel into `ctx`.
    ///
    /// # Errors
    /// As [`Module::from_ptx`] (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION` on drivers older than CUDA
    /// 13.0); [`Error::Cuda`] naming `cuModuleGetFunction`.
    pub fn new(ctx: &Arc<Context>) -> Result<Fingerprinter> {
        let m = Module::from_ptx(ctx, PTX)?;
        Ok(Fingerprinter {
            func: m.function("fingerprint_items")?,
            ctx: ctx.clone(),
            buffers: std::sync::Mutex::new((None, None)),
        })
    }

    /// The digest of each of `tensors` (device memory of this context, readable), computed on
    /// `stream` after the work enqueued there before (the fingerprint of what that work leaves);
    /// returns once it is done (a wait for `stream`). One launch for all of them: items of at
    /// most 1 MiB, about one pass over the bytes at the device's memory bandwidth, plus a small
    /// upload of the item table (32 bytes per MiB and per tensor) and a download of 16 bytes per
    /// tensor.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `stream` or a tensor belongs to another context;
    /// [`Error::Cuda`] from the allocation of the table or the results (`cuMemAlloc_v2`, at the
    /// first call and when a call needs more than the last), the copies, the launch
    /// (`cuLaunchKernel`), or the wait, where a fault of the kernel shows (the context is then
    /// unusable, as after any kernel fault).
    pub fn digests<M: DeviceMemory>(
        &self,
        tensors: &[M],
        stream: &Stream,
    ) -> Result<Vec<TensorDigest>> {
        self.ctx.same_as(stream.context())?;
        for t in tensors {
            self.ctx.same_as(t.context())?;
        }
        if tensors.is_empty() {
            return Ok(Vec::new());
        }
        // The item table: (address, first word, bytes, tensor) per item.
        let mut items: Vec<u64> = Vec::new();
        for (k, t) in tensors.iter().enumerate() {
            let len = t.len() as u64;
            let mut at = 0;
            while at < len {
                let n = PIECE.min(len - at);
                items.extend([t.device_ptr() + at, at / 16, n, k as u64]);
                at += n;
            }
        }
        let n_items = (items.len() / 4) as u64;
        let mut out = vec![0u8; tensors.len() * 16];
        let table: Vec<u8> = items.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut bufs = self.buffers.lock().unwrap_or_else(|p| p.into_inner());
        let (table_slot, out_slot) = &mut *bufs;
        let table_dev = at_least(table_slot, &self.ctx, table.len())?;
        let out_dev = at_least(out_slot, &self.ctx, out.len())?;
        let mut run = || -> Result<()> {
            // The results zeroed (a power of two of at least 4 KiB: whole 32-bit words).
            out_dev.memset_u32_async(0, stream)?;
            if n_items > 0 {
                // SAFETY: `table` (pageable, this function's) lives until the wait at the end of
                // `run` (`copy_to_host_on`) or, on an error, the wait below.
                unsafe { table_dev.copy_from_host_on(0, &table, stream)? };
                let (t, o) = (table_dev.device_ptr(), out_dev.device_ptr());
                let cfg = LaunchConfig {
                    grid: (n_items.clamp(1, 4096) as u32, 1, 1),
                    block: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut params = [
                    (&t as *const u64).cast_mut().cast::<c_void>(),
                    (&n_items as *const u64).cast_mut().cast::<c_void>(),
                    (&o as *const u64).cast_mut().cast::<c_void>(),
                ];
                // The table's `n_items` records lie inside `tensors` (built above from their
                // lengths): device memory of this context the caller keeps alive and readable
                // for the call, which waits for the kernel below.
                // SAFETY: the parameters match `fingerprint_items(const ull*, ull, ull*)`, each
                // a live `u64`; the ranges are valid as above; `out_dev` holds two u64 per
                // tensor index in the table.
                unsafe { self.func.launch(cfg, stream, &mut params)? };
            }
            out_dev.copy_to_host_on(0, &mut out, stream)
        };
        if let Err(e) = run() {
            // The table's host bytes are dropped below, and the buffers are used by the next
            // call: nothing enqueued may still use them.
            let _ = stream.synchronize();
            return Err(e);
        }
        Ok(tensors
            .iter()
            .enumerate()
            .map(|(k, t)| {
                let lane = |j: usize| {
                    let b = &out[16 * k + 8 * j..16 * k + 8 * j + 8];
                    u64::from_le_bytes(b.try_into().unwrap_or_default())
                };
                finish([lane(0), lane(1)], t.len() as u64)
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensorset::{DType, TensorSpec};

    #[test]
    fn a_digest_depends_on_every_byte_its_place_and_the_length() {
        let base: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let d = digest_bytes(&base);
        for at in [0, 1, 15, 16, 500, 999] {
            let mut v = base.clone();
            v[at] ^= 1;
            assert_ne!(digest_bytes(&v), d, "byte {at}");
        }
        // Two words swapped: the index is in each word's mix.
        let mut v = base.clone();
        let (a, b) = v.split_at_mut(16);
        a.swap_with_slice(&mut b[..16]);
        assert_ne!(digest_bytes(&v), d);
        // A zero byte more: the padded word is the same, the length is not.
        let mut z = vec![0u8; 15];
        let d15 = digest_bytes(&z);
        z.push(0);
        assert_ne!(digest_bytes(&z), d15);
        assert_eq!(digest_bytes(&base), d);
        assert_ne!(digest_bytes(&[]), digest_bytes(&[0]));
    }

    #[test]
    fn the_threaded_sum_is_the_one_thread_sum() {
        let n = PARALLEL_BYTES + 12_345;
        let v: Vec<u8> = (0..n)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8)
            .collect();
        let one = finish(sums(&v, 0), n as u64);
        assert_eq!(digest_bytes(&v), one);
        // SAFETY: `v` is readable for the calls.
        assert_eq!(unsafe { digest_shared(v.as_ptr(), n) }, one);
        for len in [0, 1, 17, STAGE - 1, STAGE + 33] {
            // SAFETY: as above.
            let d = unsafe { digest_shared(v.as_ptr(), len) };
            assert_eq!(d, digest_bytes(&v[..len]), "{len}");
        }
    }

    #[test]
    fn the_lanes_add_up_over_any_split_at_a_word_boundary() {
        let v: Vec<u8> = (0..4099u32).map(|i| (i ^ (i >> 3)) as u8).collect();
        let whole = sums(&v, 0);
        for cut in [16, 1024, 4096] {
            let a = sums(&v[..cut], 0);
            let b = sums(&v[cut..], (cut / 16) as u64);
            assert_eq!([a[0].wrapping_add(b[0]), a[1].wrapping_add(b[1])], whole);
        }
    }

    #[test]
    fn known_digests_pin_the_scheme_the_kernel_shares() {
        // The kernel's results on the GPU are checked against `digest_bytes`
        // (tests/tensorset_content_gpu.rs); these pin the host twin itself, so a change to the
        // scheme is a change of this test and of the kernel together.
        let hex = |d: TensorDigest| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let ramp: Vec<u8> = (0..=255).collect();
        assert_eq!(hex(digest_bytes(&[])), hex(finish([0, 0], 0)));
        assert_eq!(hex(digest_bytes(&ramp)), KNOWN_RAMP);
    }

    /// The digest of bytes 0, 1, ..., 255, as an independent reading of the scheme (in Python)
    /// computed it.
    const KNOWN_RAMP: &str = "bf70d04c6b025bc1da21ffbcb8ecfdfd";

    #[test]
    fn a_set_fingerprint_covers_layout_and_every_digest() {
        let l = Layout::new(&[
            TensorSpec::new("a", DType::U8, &[3]),
            TensorSpec::new("b", DType::U8, &[2]),
        ])
        .unwrap();
        let d = [digest_bytes(b"abc"), digest_bytes(b"de")];
        let f = set_fingerprint(&l, &d).unwrap();
        assert_ne!(f, set_fingerprint(&l, &[d[1], d[0]]).unwrap());
        let l2 = Layout::new(&[
            TensorSpec::new("a", DType::U8, &[3]),
            TensorSpec::new("c", DType::U8, &[2]),
        ])
        .unwrap();
        assert_ne!(f, set_fingerprint(&l2, &d).unwrap());
        assert!(set_fingerprint(&l, &d[..1]).is_err());
    }
}
