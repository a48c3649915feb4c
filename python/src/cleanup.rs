//! `cuda_ipc.cleanup`: what dead processes left, found and removed by the library's one rule set
//! (`cuda_ipc::cleanup`, the same as `cuda-ipc gc`).

use crate::errors;
use cuda_ipc::cleanup::{self as lib, Leftover, Scope};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

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

/// Finds what dead processes left in `/dev/shm` (registries' and channels' leftovers, host pools,
/// quota reservations and abandoned ledger creations, liveness files, fd server sockets, bridge
/// status files) and, unless `dry_run`, removes them, each checked again right before it goes.
/// Returns the leftovers found (`dry_run`) or removed, each a dict (`kind`, `object`, `pid`,
/// `uid`, `what`). The same as `cuda-ipc gc [--dry-run]`; nothing of a live process or of another
/// user is touched.
///
/// Raises `OSError` when `/dev/shm` cannot be listed. What cannot be read or removed (another
/// user's quota ledger, a foreign file under our names) is skipped and kept; `cuda-ipc gc`
/// names each.
#[pyfunction]
#[pyo3(signature = (*, dry_run=false))]
pub(crate) fn cleanup(py: Python<'_>, dry_run: bool) -> PyResult<Bound<'_, PyList>> {
    let found = py
        .detach(|| -> cuda_ipc::Result<Vec<Leftover>> {
            // What cannot be read or removed stays, and is skipped here (another user's quota
            // ledger is one): `cuda-ipc gc` names each.
            let scan = lib::scan(&Scope::everything())?;
            if dry_run {
                return Ok(scan.leftovers);
            }
            Ok(lib::remove(&scan.leftovers).removed)
        })
        .map_err(|e| errors::to_py(py, &e))?;
    let out = PyList::empty(py);
    for l in &found {
        out.append(to_dict(py, l)?)?;
    }
    Ok(out)
}
