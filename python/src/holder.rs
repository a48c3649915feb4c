//! The `TensorSetHolder` class (`cuda_ipc::tensorset::Holder`): keeps a VMM tensor set
//! attachable after its writer dies, by holding and serving the file descriptors of its memory.
//! Needs no CUDA context and maps nothing.

use crate::args::{Seconds, Text, timeout_arg};
use crate::errors;
use crate::util::{SLICE, err, lock};
use cuda_ipc::identity::ForkEpoch;
use cuda_ipc::tensorset::{Holder, HolderStatus};
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often `wait` looks at the status (and for signals): the slice every blocking call
/// waits in, so Ctrl-C is seen within it here too.
const POLL: Duration = SLICE;

/// What `status` says once this holder's own `close()` let go of the set: not `"closed"`, which
/// says the writer closed it.
const RELEASED: &str = "released";

/// `status` of a holder still open, in one word: `"serving"`, `"closed"` (by its writer),
/// `"damaged"` (its holders segment was cut short) or `"replaced"`.
fn status_word(s: HolderStatus) -> &'static str {
    match s {
        HolderStatus::Serving => "serving",
        HolderStatus::Closed => "closed",
        HolderStatus::Damaged => "damaged",
        _ => "replaced",
    }
}

/// Keeps tensor set `name` attachable after its writer dies (`cuda_ipc::tensorset::Holder`).
///
/// Once `close()` was called, `allocations`, `bytes` and `source_pid` raise `TensorSetClosed`
/// (the class a writer's close raises, its message naming this holder); `status` and `wait` say
/// `"released"` (not `"closed"`, which says the writer closed the set).
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct TensorSetHolder {
    inner: Mutex<Option<Arc<Holder>>>,
    name: String,
    /// The process (by fork) that made it: a forked child's calls raise `NotSupported`.
    fork: ForkEpoch,
}

impl TensorSetHolder {
    /// The holder, or `TensorSetClosed` once `close()` was called.
    fn get(&self) -> PyResult<Arc<Holder>> {
        if self.fork.inherited() {
            return Err(errors::forked("tensor set holder"));
        }
        lock(&self.inner)
            .clone()
            .ok_or_else(|| errors::closed_here("holder", &self.name))
    }
}

#[pymethods]
impl TensorSetHolder {
    /// Holds VMM tensor set `name`: fetches a file descriptor of every allocation of every
    /// buffer (from the writer while it runs, else from a live holder), serves them from this
    /// process (the writer's peer checks: this user or root) and records itself in the set's
    /// holders segment, where readers opened after the writer's death find it. No CUDA context
    /// is made; each fd pins the set's device memory (`bytes`) until `close()`.
    ///
    /// Raises `TensorSetNotFound`; `NotHoldable` for a host, pool or legacy set (or one whose
    /// writer made no holders segment); `NoServer` when neither the writer nor a holder hands the
    /// fds over; `NoHolderSlot` when every slot serves a live process; `BadSegment`; `OsError`.
    #[new]
    fn new(py: Python<'_>, name: Text) -> PyResult<Self> {
        let name = name.into_string(py, "name")?;
        let h = py.detach(|| Holder::open(&name)).map_err(|e| err(py, e))?;
        Ok(TensorSetHolder {
            inner: Mutex::new(Some(Arc::new(h))),
            name,
            fork: ForkEpoch::now(),
        })
    }

    /// The set's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// File descriptors held: buffers × allocations per buffer.
    #[getter]
    fn allocations(&self) -> PyResult<usize> {
        Ok(self.get()?.allocations())
    }

    /// Device bytes this holder pins: buffers × bytes per buffer (as the manifest records them;
    /// the driver rounds each allocation up to its granularity).
    #[getter]
    fn bytes(&self) -> PyResult<u64> {
        Ok(self.get()?.bytes())
    }

    /// The pid of the process the fds were fetched from (the writer, or another holder).
    #[getter]
    fn source_pid(&self) -> PyResult<u32> {
        Ok(self.get()?.source().pid)
    }

    /// Whether the set's names still stand for what this holder serves: `"serving"` (its writer
    /// may be dead: the holder keeps it attachable), `"closed"` (its writer closed it),
    /// `"replaced"` (another set was made under its name) or `"damaged"` (its holders segment was
    /// cut short under it). Two `stat` calls and an `fstat`; `"released"` after this holder's own
    /// `close()` (nothing is looked at then).
    #[getter]
    fn status(&self) -> &'static str {
        match lock(&self.inner).clone() {
            Some(h) => status_word(h.status()),
            None => RELEASED,
        }
    }

    /// Waits (GIL released, looking every 100 ms, Ctrl-C honoured within as long) until `status`
    /// is no longer `"serving"`, at most `timeout` seconds (`None`: no bound), and returns the
    /// status last seen (`"serving"` when the timeout ran out; `"released"` at once after
    /// `close()`, also when it was called from another thread meanwhile). Raises
    /// `InvalidArgument` for a bad `timeout`.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<Seconds>) -> PyResult<&'static str> {
        let timeout = timeout_arg(py, timeout)?;
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            let Some(h) = lock(&self.inner).clone() else {
                return Ok(RELEASED);
            };
            let s = py.detach(|| h.status());
            if s != HolderStatus::Serving || deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(status_word(s));
            }
            let pause = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()).min(POLL),
                None => POLL,
            };
            drop(h);
            py.detach(|| std::thread::sleep(pause));
            py.check_signals()?;
        }
    }

    /// Lets go of the holder slot and closes the fds; the memory goes back to the device once no
    /// process maps it or holds an fd of it. Afterwards `allocations`, `bytes` and `source_pid`
    /// raise `TensorSetClosed`, `status` and `wait` say `"released"`. Closing twice does nothing.
    fn close(&self) {
        if self.fork.inherited() {
            return; // a forked child's copy: the parent's holder stays
        }
        lock(&self.inner).take();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close();
    }

    fn __repr__(&self) -> String {
        match lock(&self.inner).as_ref() {
            Some(h) => format!(
                "TensorSetHolder({:?}, {} allocations, {} bytes)",
                self.name,
                h.allocations(),
                h.bytes()
            ),
            None => format!("TensorSetHolder({:?}, closed)", self.name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::errors::TensorSetClosed;

    /// A closed holder made here (a holder is opened only on a VMM set, which needs a GPU): every
    /// attribute Python sees, asked through the interpreter as a Python caller would. Its
    /// `status` and `wait` say `"released"`, never `"closed"`, the word of a writer's close (a
    /// holder's own close and its writer's were both `"closed"`).
    #[test]
    fn every_call_of_a_closed_holder_raises_tensor_set_closed_naming_the_holder() {
        assert_eq!(status_word(HolderStatus::Closed), "closed");
        for s in [
            HolderStatus::Serving,
            HolderStatus::Closed,
            HolderStatus::Damaged,
            HolderStatus::Replaced,
        ] {
            assert_ne!(status_word(s), RELEASED, "{s:?}");
        }
        Python::initialize();
        Python::attach(|py| {
            let h = Bound::new(
                py,
                TensorSetHolder {
                    inner: Mutex::new(None),
                    name: "weights".to_string(),
                    fork: ForkEpoch::now(),
                },
            )
            .unwrap();
            let closed = ["allocations", "bytes", "source_pid"];
            let answering = ["name", "status", "wait", "close"];
            let mut public: Vec<String> = h
                .get_type()
                .dir()
                .unwrap()
                .iter()
                .map(|a| a.extract::<String>().unwrap())
                .filter(|a| !a.starts_with('_'))
                .collect();
            public.sort();
            let mut known: Vec<&str> = closed.iter().chain(&answering).copied().collect();
            known.sort();
            assert_eq!(public, known, "a call this test does not know");
            for a in closed {
                let e = h.getattr(a).unwrap_err();
                assert!(e.is_instance_of::<TensorSetClosed>(py), "{a}: {e}");
                assert_eq!(
                    e.value(py).to_string(),
                    "this holder of tensor set \"weights\" is closed \
                     (by its own close(), not by the writer)",
                    "{a}"
                );
            }
            assert_eq!(h.getattr("name").unwrap().to_string(), "weights");
            // Its own close, told apart from its writer's ("closed").
            assert_eq!(h.getattr("status").unwrap().to_string(), "released");
            assert_eq!(h.call_method0("wait").unwrap().to_string(), "released");
            assert_eq!(
                h.call_method1("wait", (0.0,)).unwrap().to_string(),
                "released"
            );
            assert!(h.call_method0("close").unwrap().is_none());
            assert!(h.call_method0("close").unwrap().is_none());
            assert_eq!(
                h.repr().unwrap().to_string(),
                "TensorSetHolder(\"weights\", closed)"
            );
        });
    }
}
