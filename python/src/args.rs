//! The checks of the extension's arguments: each turns what Python passed (a duration, an int, a
//! text, a device, a stream, a memory kind, a wait strategy, a shape, a buffer, a byte range, a
//! fingerprint) into the Rust value it names, or raises `InvalidArgument` saying what is wrong
//! with it (the conversion's `TypeError` where its docs say so). [`memory_name`] spells a memory
//! kind back as [`memory_arg`] reads it.

use crate::errors::{self, bytes};
use cuda_ipc::channel::{MemoryKind, WaitStrategy};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMemoryView, PyString};
use std::time::Duration;

/// The most seconds a duration argument (`timeout`, `spin`) may name: about 31.7 years. Longer
/// is a mistake, or means "forever", which `timeout=None` says; `Instant` arithmetic on such
/// durations would overflow.
pub(crate) const MAX_SECONDS: f64 = 1e9;

/// A duration argument as Python passed it, before [`seconds_arg`] checks its range: a float (or
/// an int that fits one), or an int too large for a float (kept apart so that it is an
/// `InvalidArgument` too, not the `OverflowError` of the conversion).
/// A `bool` (an `int` to Python) is kept apart too: `timeout=True` is a mistake, not 1 s.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Seconds {
    Float(f64),
    HugeInt,
    Bool(bool),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Seconds {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(b) = obj.cast::<pyo3::types::PyBool>() {
            return Ok(Seconds::Bool(b.is_true()));
        }
        match obj.extract::<f64>() {
            Ok(v) => Ok(Seconds::Float(v)),
            Err(_) if obj.is_instance_of::<pyo3::types::PyInt>() => Ok(Seconds::HugeInt),
            // Not a number: the `TypeError` of the conversion.
            Err(e) => Err(e),
        }
    }
}

/// `v` for a message: in exponent form once it is too large for plain digits to read (`-1e300`,
/// not 301 digits).
pub(crate) fn show_f64(v: f64) -> String {
    // Very large and very small magnitudes in exponent form: `-1e-300` is not 300 zeros.
    if v.is_finite() && v != 0.0 && !(1e-6..1e16).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// Duration argument `name` in seconds as a `Duration`: a number from 0 to [`MAX_SECONDS`].
/// Negative, NaN, infinite or larger values raise `InvalidArgument` naming `name` and the range
/// (`Duration::from_secs_f64` would panic on them); `forever` adds that `None` waits forever to
/// the message. The one check of every such argument.
pub(crate) fn seconds_arg(
    py: Python<'_>,
    name: &str,
    value: Seconds,
    forever: bool,
) -> PyResult<Duration> {
    let got = match value {
        // `try_from_secs_f64` refuses negative and non-finite values; `MAX_SECONDS` bounds it.
        Seconds::Float(v) if v <= MAX_SECONDS => match Duration::try_from_secs_f64(v) {
            Ok(d) => return Ok(d),
            Err(_) => show_f64(v),
        },
        Seconds::Float(v) => show_f64(v),
        Seconds::HugeInt => "an int too large for a float".to_string(),
        Seconds::Bool(b) => format!("a bool ({})", if b { "True" } else { "False" }),
    };
    let none = if forever { " (None waits forever)" } else { "" };
    Err(errors::invalid_argument(
        py,
        format!("{name} must be a number of seconds from 0 to {MAX_SECONDS:e}{none}, got {got}"),
    ))
}

/// A text argument (`str`) as Python passed it, before [`Text::get`] checks that it has a UTF-8
/// spelling: a `str` with a lone surrogate (`"a\udcff"`, from `os.fsdecode` of bytes that are no
/// UTF-8) has none, and is kept apart so that it is an `InvalidArgument` naming the argument, not
/// the `UnicodeEncodeError` a plain `&str` or `String` argument raises. Any other type than `str`
/// is the conversion's `TypeError`, as for a plain `String`. The one conversion of every text
/// argument of the extension (names, memory kinds, modes, waits, quota scopes, tensor names).
#[derive(Clone, Debug)]
pub(crate) enum Text {
    Utf8(String),
    /// A `str` with a lone surrogate: its `repr`, for the message.
    Surrogate(String),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Text {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<String>() {
            Ok(s) => Ok(Text::Utf8(s)),
            Err(_) if obj.is_instance_of::<PyString>() => Ok(Text::Surrogate(
                obj.repr()
                    .map_or_else(|_| "?".to_string(), |r| r.to_string()),
            )),
            // Not a `str`: the `TypeError` of the conversion.
            Err(e) => Err(e),
        }
    }
}

impl Text {
    /// A default value of a text argument (`wait="spin_then_block"`).
    pub(crate) fn lit(s: &str) -> Text {
        Text::Utf8(s.to_string())
    }

    /// Argument `name` as UTF-8: `InvalidArgument` naming `name` for a `str` with a lone
    /// surrogate.
    pub(crate) fn get(&self, py: Python<'_>, name: &str) -> PyResult<&str> {
        match self {
            Text::Utf8(s) => Ok(s),
            Text::Surrogate(r) => Err(errors::invalid_argument(
                py,
                format!("{name} {r}: not UTF-8 (a lone surrogate)"),
            )),
        }
    }

    /// [`Text::get`], owned.
    pub(crate) fn into_string(self, py: Python<'_>, name: &str) -> PyResult<String> {
        match self {
            Text::Utf8(s) => Ok(s),
            t => t.get(py, name).map(str::to_string),
        }
    }
}

/// An optional text argument (`None` stays `None`), checked by [`Text::get`].
pub(crate) fn opt_text<'t>(
    py: Python<'_>,
    name: &str,
    v: &'t Option<Text>,
) -> PyResult<Option<&'t str>> {
    v.as_ref().map(|v| v.get(py, name)).transpose()
}

/// An integer argument as Python passed it, before [`Int::get`] or [`Int::within`] checks it
/// against the range of what it becomes: kept apart from the conversion so that a negative or
/// too large value (`buffers=-1`, `offset=2**64`) is an `InvalidArgument` naming the argument and
/// its range, not the `OverflowError` a plain `usize` argument raises. A `bool` is refused
/// (`buffers=True` is a mistake); any other type than `int` is the conversion's `TypeError`. The
/// one check of every integer argument of the extension.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Int {
    Small(i128),
    /// An int outside `i128`; `true` when negative.
    Huge(bool),
    Bool(bool),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(b) = obj.cast::<pyo3::types::PyBool>() {
            return Ok(Int::Bool(b.is_true()));
        }
        match obj.extract::<i128>() {
            Ok(v) => Ok(Int::Small(v)),
            Err(_) if obj.is_instance_of::<pyo3::types::PyInt>() => Ok(Int::Huge(obj.lt(0)?)),
            // Not an int: the `TypeError` of the conversion.
            Err(e) => Err(e),
        }
    }
}

/// An integer type an [`Int`] converts to, with its range.
pub(crate) trait IntArg: Copy + std::fmt::Display + TryFrom<i128> {
    const LO: Self;
    const HI: Self;
    /// The value as an `i128` (which holds every value of these types).
    fn wide(self) -> i128;
}

macro_rules! int_arg {
    ($($t:ty),*) => {$(
        impl IntArg for $t {
            const LO: $t = <$t>::MIN;
            const HI: $t = <$t>::MAX;
            fn wide(self) -> i128 {
                self as i128
            }
        }
    )*};
}
int_arg!(u32, u64, usize, i32, i64);

impl Int {
    /// Argument `name` as a `T`: `InvalidArgument` naming `name` and `T`'s range outside it.
    pub(crate) fn get<T: IntArg>(self, py: Python<'_>, name: &str) -> PyResult<T> {
        self.within(py, name, T::LO, T::HI)
    }

    /// Argument `name` as a `T` from `lo` to `hi`: `InvalidArgument` naming `name` and the
    /// range outside it.
    pub(crate) fn within<T: IntArg>(self, py: Python<'_>, name: &str, lo: T, hi: T) -> PyResult<T> {
        let got = match self {
            Int::Small(v) if (lo.wide()..=hi.wide()).contains(&v) => {
                if let Ok(t) = T::try_from(v) {
                    return Ok(t);
                }
                v.to_string()
            }
            Int::Small(v) => v.to_string(),
            Int::Huge(true) => "a negative int beyond 128 bits".to_string(),
            Int::Huge(false) => "an int beyond 128 bits".to_string(),
            Int::Bool(b) => format!("a bool ({})", if b { "True" } else { "False" }),
        };
        Err(errors::invalid_argument(
            py,
            format!("{name} must be an int from {lo} to {hi}, got {got}"),
        ))
    }
}

/// An optional integer argument (`None` stays `None`), checked by [`Int::get`].
pub(crate) fn opt_int<T: IntArg>(
    py: Python<'_>,
    name: &str,
    v: Option<Int>,
) -> PyResult<Option<T>> {
    v.map(|v| v.get(py, name)).transpose()
}

/// A CUDA device ordinal argument (`device`): 0 to `i32::MAX`, the driver's range.
pub(crate) fn device_arg(py: Python<'_>, device: Int) -> PyResult<usize> {
    device.within(py, "device", 0, i32::MAX as usize)
}

/// A `timeout` argument: `None` (forever) stays `None`, a number is checked by [`seconds_arg`].
pub(crate) fn timeout_arg(py: Python<'_>, timeout: Option<Seconds>) -> PyResult<Option<Duration>> {
    timeout
        .map(|t| seconds_arg(py, "timeout", t, true))
        .transpose()
}

/// The wait of a `close(timeout=None)`: no bound. Every wait a close makes takes it as none, in
/// the extension ([`util::sliced`](crate::util::sliced),
/// [`util::Finish::wait`](crate::util::Finish::wait)) and in the library (`Producer::close`,
/// `TensorSetWriter::close`): a deadline `Instant::now() + NO_BOUND` overflows, which they read
/// as no deadline, and an elapsed time never reaches it.
pub(crate) const NO_BOUND: Duration = Duration::MAX;

/// The `timeout` of a `close()`, which hands it to the library's close as a `Duration`: a number
/// checked by [`seconds_arg`], or [`NO_BOUND`] for `None`, as every other `timeout=None`.
pub(crate) fn close_timeout_arg(py: Python<'_>, timeout: Option<Seconds>) -> PyResult<Duration> {
    Ok(timeout_arg(py, timeout)?.unwrap_or(NO_BOUND))
}

pub(crate) fn wait_arg(py: Python<'_>, wait: &str, spin: Seconds) -> PyResult<WaitStrategy> {
    // Checked whatever `wait` is: a bad value is a mistake even where it is not used.
    let spin = seconds_arg(py, "spin", spin, false)?;
    match wait {
        "block" => Ok(WaitStrategy::Block),
        "spin" => Ok(WaitStrategy::Spin),
        "spin_then_block" => Ok(WaitStrategy::SpinThenBlock(spin)),
        w => Err(errors::invalid_argument(
            py,
            format!("wait must be \"block\", \"spin\" or \"spin_then_block\", got {w:?}"),
        )),
    }
}

pub(crate) fn memory_name(k: MemoryKind) -> &'static str {
    match k {
        MemoryKind::Legacy => "legacy",
        MemoryKind::Vmm => "vmm",
        MemoryKind::Pool => "pool",
        MemoryKind::Host => "host",
        _ => "auto",
    }
}

pub(crate) fn memory_arg(py: Python<'_>, memory: &str) -> PyResult<MemoryKind> {
    match memory {
        "auto" => Ok(MemoryKind::Auto),
        "legacy" => Ok(MemoryKind::Legacy),
        "vmm" => Ok(MemoryKind::Vmm),
        "pool" => Ok(MemoryKind::Pool),
        "host" => Ok(MemoryKind::Host),
        m => Err(errors::invalid_argument(
            py,
            format!(
                "memory must be \"auto\", \"legacy\", \"vmm\", \"pool\" or \"host\", got {m:?}"
            ),
        )),
    }
}

/// A stream argument as a raw `CUstream`: `None`; an `int`; an object with `cuda_stream`
/// (`torch.cuda.Stream`) or `ptr` (`cupy.cuda.Stream`), or with `__cuda_stream__` (the CUDA
/// stream protocol: a `(version, handle)` pair).
pub(crate) fn stream_arg(
    py: Python<'_>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<usize>> {
    let Some(s) = stream else {
        return Ok(None);
    };
    if s.is_none() {
        return Ok(None);
    }
    let raw = if let Ok(v) = s.extract::<usize>() {
        v
    } else if s.is_instance_of::<pyo3::types::PyInt>() {
        return Err(errors::invalid_argument(
            py,
            format!(
                "stream {} is not a CUstream (an int from 0 to {})",
                s.repr()?,
                usize::MAX
            ),
        ));
    } else if let Ok(p) = s.call_method0("__cuda_stream__") {
        p.extract::<(i64, usize)>()?.1
    } else if let Ok(v) = s.getattr("cuda_stream") {
        v.extract::<usize>()?
    } else if let Ok(v) = s.getattr("ptr") {
        v.extract::<usize>()?
    } else {
        return Err(errors::invalid_argument(
            py,
            format!(
                "stream must be None, an int (a CUstream), a torch.cuda.Stream or a \
                 cupy.cuda.Stream, got {}",
                s.get_type().name()?
            ),
        ));
    };
    Ok(Some(raw))
}

/// `InvalidArgument` when a host tensor set's call was given a `stream`: its memory is host
/// memory, with no stream to order (as a host channel refuses one).
pub(crate) fn host_stream_refused(
    py: Python<'_>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    match stream {
        Some(s) if !s.is_none() => Err(errors::invalid_argument(
            py,
            "a host tensor set has no streams to order: leave stream=None".to_string(),
        )),
        _ => Ok(()),
    }
}

/// The element count of `shape` (an int or a sequence of ints), or `InvalidArgument`.
pub(crate) fn elements(py: Python<'_>, shape: &Bound<'_, PyAny>) -> PyResult<usize> {
    let dims: Vec<usize> = match shape.extract::<usize>() {
        Ok(n) => vec![n],
        Err(_) => shape.extract().map_err(|_| {
            errors::invalid_argument(
                py,
                "shape must be an int or a sequence of non-negative ints".to_string(),
            )
        })?,
    };
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| {
            errors::invalid_argument(
                py,
                format!(
                    "shape {dims:?} has more than {} elements (usize::MAX)",
                    usize::MAX
                ),
            )
        })
}

/// `bytes` as is; anything else that exports a buffer (`bytearray`, `memoryview`, `array`, NumPy)
/// copied into `bytes` once. Raises `TypeError` for anything else (`str`, `int`),
/// `InvalidArgument` for a buffer of Python objects ([`raw_bytes`]).
pub(crate) fn bytes_of<'py>(data: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    Ok(raw_bytes(data)?.bytes)
}

/// The bytes of a buffer ([`raw_bytes`]) and what its items are.
pub(crate) struct RawBytes<'py> {
    /// A copy of its bytes.
    pub bytes: Bound<'py, PyBytes>,
    /// Its items' format, as `memoryview.format` says it (`"B"` for `bytes`).
    pub format: String,
    /// Bytes of one item (1 for `bytes`).
    pub itemsize: usize,
}

impl RawBytes<'_> {
    /// Whether its items are plain bytes (`bytes`, `bytearray`, a `"B"` or `"c"` memoryview such
    /// as `memoryview(a).cast("B")`): copied as they are into anything.
    pub(crate) fn plain(&self) -> bool {
        self.itemsize == 1
            && matches!(
                self.format.trim_start_matches(['@', '=', '<', '>', '!']),
                "B" | "c"
            )
    }
}

/// Whether a buffer format (PEP 3118, `memoryview.format`) has an item that is a Python object
/// (`O`): its bytes are pointers into this process, meaningless anywhere else. Field names
/// (`:name:`) are skipped.
fn holds_objects(format: &str) -> bool {
    let mut in_name = false;
    format.chars().any(|c| {
        if c == ':' {
            in_name = !in_name;
            return false;
        }
        !in_name && c == 'O'
    })
}

/// [`bytes_of`] with the buffer's format and item size. `bytes` as is; anything else that
/// exports a buffer copied once.
///
/// # Errors
/// `TypeError` for what exports no buffer; `InvalidArgument` for a buffer of Python objects
/// (format `O`, a NumPy array of `dtype=object`): its bytes are object pointers, which would be
/// copied as they are into memory other processes read.
pub(crate) fn raw_bytes<'py>(data: &Bound<'py, PyAny>) -> PyResult<RawBytes<'py>> {
    if let Ok(b) = data.cast::<PyBytes>() {
        return Ok(RawBytes {
            bytes: b.clone(),
            format: "B".to_string(),
            itemsize: 1,
        });
    }
    let view = PyMemoryView::from(data)?;
    let format: String = view.getattr("format")?.extract()?;
    let itemsize: usize = view.getattr("itemsize")?.extract()?;
    if holds_objects(&format) {
        return Err(errors::invalid_argument(
            data.py(),
            format!(
                "a buffer of Python objects (format {format:?}, e.g. a NumPy array of \
                 dtype=object) holds pointers into this process, not values: give bytes or an \
                 array of numbers"
            ),
        ));
    }
    Ok(RawBytes {
        bytes: view.call_method0("tobytes")?.cast_into::<PyBytes>()?,
        format,
        itemsize,
    })
}

/// `n` bytes from `offset` of a `len`-byte buffer (`n`: `None` for the rest), or `InvalidArgument`.
pub(crate) fn range_arg(
    py: Python<'_>,
    offset: usize,
    n: Option<usize>,
    len: usize,
) -> PyResult<usize> {
    let n = n.unwrap_or_else(|| len.saturating_sub(offset));
    if offset.checked_add(n).is_none_or(|end| end > len) {
        return Err(errors::invalid_argument(
            py,
            format!(
                "{} at offset {offset} would pass the end of a {len}-byte buffer",
                bytes(n)
            ),
        ));
    }
    Ok(n)
}

/// A 32-byte fingerprint argument named `what` from any bytes-like object (`None`: none);
/// `InvalidArgument` for another length, `TypeError` for an object that is not bytes-like.
pub(crate) fn fingerprint_arg(
    py: Python<'_>,
    what: &str,
    v: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<[u8; 32]>> {
    let Some(v) = v else { return Ok(None) };
    let b = bytes_of(v)?;
    let b = b.as_bytes();
    <[u8; 32]>::try_from(b).map(Some).map_err(|_| {
        crate::errors::invalid_argument(
            py,
            format!("{what} is {}; a fingerprint has 32", bytes(b.len())),
        )
    })
}
