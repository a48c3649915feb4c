//! `cuda_ipc.cleanup`: what dead processes left, found and removed by the library's one rule set
//! (`cuda_ipc::cleanup`, the same as `cuda-ipc gc`), returned as a `CleanupResult`: a `list` of
//! the leftovers, as before, with what of other users the scan passed over in its `skipped`.

use crate::errors;
use cuda_ipc::cleanup::{self as lib, Leftover, Scope, Skipped};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple, PyType};

/// One leftover as a dict: `kind` (e.g. `"channel"`, `"channel_consumer"`, `"host_pool"`,
/// `"registry_record"`, `"quota_creation"`, `"liveness_file"`), `object` (the registry, channel, ledger or file name),
/// `pid` (the dead process's, or `None`), `uid` (or `None`) and `what` (the line `cuda-ipc gc`
/// prints after `would remove` / `removed`).
fn to_dict<'py>(py: Python<'py>, l: &Leftover) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", kind_name(l.kind))?;
    d.set_item("object", &l.object)?;
    d.set_item("pid", l.owner.map(|o| o.pid))?;
    d.set_item("uid", l.uid)?;
    d.set_item("what", l.to_string())?;
    Ok(d)
}

/// One object of another user passed over as a dict, with the keys of an entry of `cuda-ipc gc
/// --json`'s `skipped`: `name` (in `/dev/shm`), `owner` (its uid), `what` (`"registry"`,
/// `"channel segment"`, `"host pool"`, `"tensor set part"`, `"quota ledger"`, `"liveness
/// file"`, `"fd server socket"`, `"bridge status file"`; or what stands under such a name when
/// it is no segment: `"FIFO"`, `"directory"`, `"symbolic link"`, ...), `dead` (whether its listing found it
/// a dead process's leftover; `False` for a segment, which is not judged) and `pid` (the dead
/// process a liveness file or fd server socket names, or `None`).
fn skipped_dict<'py>(py: Python<'py>, s: &Skipped) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", &s.name)?;
    d.set_item("owner", s.uid)?;
    d.set_item("what", s.what)?;
    d.set_item("dead", s.dead)?;
    d.set_item("pid", s.owner.map(|o| o.pid))?;
    Ok(d)
}

/// The snake-case name of a leftover kind (its Rust variant name, `RegistryRecord` →
/// `registry_record`).
fn kind_name(k: lib::LeftoverKind) -> String {
    let mut out = String::new();
    for (i, c) in format!("{k:?}").chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

const RESULT_DOC: &str = "What ``cleanup()`` returns: a ``list`` of the leftovers found \
(``dry_run``) or removed, each a dict (``kind``, ``object``, ``pid``, ``uid``, ``what``), and in \
``skipped`` a list of the objects of other users it passed over, each a dict (``name``, \
``owner``, ``what``, ``dead``, ``pid``), as ``cuda-ipc gc --json``'s ``skipped`` and \
``quota_skipped`` together: never judged nor removed, theirs to clean.";

static RESULT: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `CleanupResult`, a subclass of `list` made once (the abi3 wheel cannot subclass `list` from a
/// `#[pyclass]` before Python 3.12): whatever iterated, indexed, counted or compared the plain
/// list `cleanup()` returned before does the same, and `skipped` is one attribute more.
pub(crate) fn result_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    RESULT
        .get_or_try_init(py, || {
            let dict = PyDict::new(py);
            dict.set_item("__doc__", RESULT_DOC)?;
            dict.set_item("__module__", "cuda_ipc")?;
            let bases = PyTuple::new(py, [py.get_type::<PyList>()])?;
            Ok(py
                .get_type::<PyType>()
                .call1(("CleanupResult", bases, dict))?
                .cast_into::<PyType>()?
                .unbind())
        })
        .map(|t| t.bind(py))
}

/// Finds what dead processes left in `/dev/shm` (registries' and channels' leftovers, host pools,
/// quota reservations and abandoned ledger creations, liveness files, fd server sockets, bridge
/// status files) and, unless `dry_run`, removes them, each checked again right before it goes.
/// Returns a `CleanupResult`: a list of the leftovers found (`dry_run`) or removed, each a dict
/// (`kind`, `object`, `pid`, `uid`, `what`), with `skipped`, the objects of other users passed
/// over (each `name`, `owner`, `what`, `dead`, `pid`). The same as `cuda-ipc gc [--dry-run]`;
/// nothing of a live process or of another user is touched.
///
/// Raises `OSError` when `/dev/shm` cannot be listed. What cannot be read or removed (a foreign
/// file under our names, one open to other users) is left as it is, in neither list;
/// `cuda-ipc gc` names each as a problem.
#[pyfunction]
#[pyo3(signature = (*, dry_run=false))]
pub(crate) fn cleanup(py: Python<'_>, dry_run: bool) -> PyResult<Bound<'_, PyAny>> {
    let (found, skipped) = py
        .detach(|| -> cuda_ipc::Result<(Vec<Leftover>, Vec<Skipped>)> {
            // What cannot be read or removed stays, and is left out here: `cuda-ipc gc` names
            // each.
            let scan = lib::scan(&Scope::everything())?;
            if dry_run {
                return Ok((scan.leftovers, scan.skipped));
            }
            Ok((lib::remove(&scan.leftovers).removed, scan.skipped))
        })
        .map_err(|e| errors::to_py(py, &e))?;
    let items = PyList::empty(py);
    for l in &found {
        items.append(to_dict(py, l)?)?;
    }
    let passed = PyList::empty(py);
    for s in &skipped {
        passed.append(skipped_dict(py, s)?)?;
    }
    let out = result_type(py)?.call1((items,))?;
    out.setattr("skipped", passed)?;
    Ok(out)
}
