//! The module's quota functions (`set_quota`, `remove_quota`).

use crate::args::{Int, Text, device_arg};
use crate::util::err;
use cuda_ipc::driver::Device;
use cuda_ipc::quota::{QuotaLedger, QuotaScope};
use pyo3::prelude::*;

/// The quota scope a `quota=` or `scope=` string names: `"user"` (this process's effective uid)
/// or `"group:NAME"` (a group name or numeric gid this process belongs to).
pub(crate) fn quota_scope(s: &str) -> cuda_ipc::Result<QuotaScope> {
    match s.split_once(':') {
        None if s == "user" => Ok(QuotaScope::user()),
        Some(("group", g)) if !g.is_empty() => QuotaScope::group(g),
        _ => Err(cuda_ipc::Error::InvalidArgument(format!(
            "quota scope {s:?}: \"user\" or \"group:NAME\""
        ))),
    }
}

/// The device UUID of a budget: host memory (`device=None`, the all-zero UUID) or CUDA device
/// `device`'s.
pub(crate) fn quota_device(device: Option<usize>) -> cuda_ipc::Result<cuda_ipc::driver::Uuid> {
    match device {
        None => Ok(cuda_ipc::driver::Uuid([0; 16])),
        Some(d) => Ok(Device::get(d)?.uuid()),
    }
}

/// Sets the shared budget, in bytes, that producers created with `quota=scope` reserve their pools
/// from: for host memory (`device=None`, the default: the budget of `memory="host"` producers
/// and writers, not GPU 0's) or for CUDA device `device`. Creates the ledger
/// (mode 0600 for `"user"`, 0660 for `"group:NAME"`) or changes its budget; reservations already
/// made stay. The same as `cuda-ipc quota set`.
///
/// Raises `QuotaError` when the ledger is another user's, `InvalidArgument` for a bad scope or a
/// group this process is not in, `BadSegment` for something else under the ledger's name.
#[pyfunction]
#[pyo3(signature = (budget_bytes, *, scope=Text::lit("user"), device=None))]
#[pyo3(text_signature = "(budget_bytes, *, scope=\"user\", device=None)")]
pub(crate) fn set_quota(
    py: Python<'_>,
    budget_bytes: Int,
    scope: Text,
    device: Option<Int>,
) -> PyResult<()> {
    let budget_bytes: u64 = budget_bytes.get(py, "budget_bytes")?;
    let scope = scope.get(py, "scope")?;
    let device = device.map(|d| device_arg(py, d)).transpose()?;
    let scope = quota_scope(scope).map_err(|e| err(py, e))?;
    py.detach(|| QuotaLedger::set_budget(scope, quota_device(device)?, budget_bytes).map(|_| ()))
        .map_err(|e| err(py, e))
}

/// Removes the budget of `scope` for host memory (`device=None`) or CUDA device `device`; returns
/// whether there was one. Producers holding reservations keep them. The same as `cuda-ipc quota
/// remove`.
///
/// Raises `QuotaError` when the ledger is another user's.
#[pyfunction]
#[pyo3(signature = (*, scope=Text::lit("user"), device=None))]
#[pyo3(text_signature = "(*, scope=\"user\", device=None)")]
pub(crate) fn remove_quota(py: Python<'_>, scope: Text, device: Option<Int>) -> PyResult<bool> {
    let scope = scope.get(py, "scope")?;
    let device = device.map(|d| device_arg(py, d)).transpose()?;
    let scope = quota_scope(scope).map_err(|e| err(py, e))?;
    // Also a ledger of another layout version (an older build's), which no open reads.
    py.detach(|| QuotaLedger::remove_of(scope, quota_device(device)?))
        .map_err(|e| err(py, e))
}
