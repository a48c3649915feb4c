//! The `Producer` class.

use crate::args::{
    Int, Seconds, Text, close_timeout_arg, device_arg, memory_arg, memory_name, opt_int, opt_text,
    stream_arg, timeout_arg, wait_arg,
};
use crate::lending::Lender;
use crate::quota::quota_scope;
use crate::util::{CLOSE_WAITS_FOR_ACQUIRE, Stop, err, lock, sliced, stats_dict, timeout_error};
use crate::write_frame::WriteFrame;
use crate::{aio, errors};
use cuda_ipc::channel::owned::OwnedWriteFrame;
use cuda_ipc::channel::{ChannelOptions, MemoryKind};
use cuda_ipc::driver::Device;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

/// The producing end of a channel (`cuda_ipc::channel::Producer`).
///
/// The Rust producer is lent, by value, to a blocking `acquire` and then to the `WriteFrame` it
/// returns, and comes back when they end (`crate::lending`).
///
/// In a child made by `fork()` after the parent created it, the channel is the parent's:
/// `acquire`, `try_acquire` and `stats` raise `NotSupported` (an awaited `acquire_async` too),
/// taking no lock; `close()`, the end of a `with` block, the exit and its collection close
/// nothing; `name` and `memory` describe the copy.
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct Producer {
    lender: Arc<Lender>,
    memory: MemoryKind,
}

impl Producer {
    /// `acquire`, stopping (`ChannelClosed`) also once `cancelled` is raised (an awaitable's
    /// wait).
    fn acquire_until(
        slf: &Bound<'_, Self>,
        timeout: Option<Duration>,
        cancelled: Option<&AtomicBool>,
    ) -> PyResult<WriteFrame> {
        let py = slf.py();
        let this = &slf.get().lender;
        // Before the wait for a cancelled `acquire_async`, which locks the state.
        this.check_fork()?;
        if cancelled.is_some() {
            this.await_cancelled_acquire(py);
        }
        let mut producer = Some(this.take(py, true)?);
        let got = sliced(
            py,
            timeout,
            || this.is_closed() || cancelled.is_some_and(aio::is_cancelled),
            |_| this.closed_error(),
            |slice| {
                let Some(p) = producer.take() else {
                    // Never: the producer is put back after every slice that does not end the
                    // wait. Stopping is the safe answer should that change.
                    return Err(Stop::Closed);
                };
                // A slice that times out leaves a pool of one buffer reserved for the next
                // (consumers whose holds outlast a slice cannot take its frame between them).
                match OwnedWriteFrame::acquire_slice(p, Some(slice)) {
                    Ok(f) => Ok(Some(f)),
                    Err((p, cuda_ipc::Error::Timeout { .. })) => {
                        producer = Some(p);
                        Ok(None)
                    }
                    Err((p, e)) => {
                        producer = Some(p);
                        Err(e.into())
                    }
                }
            },
        );
        if let Some(mut p) = producer.take() {
            // The wait ended without a buffer (timed out, closed, a signal): the frame is
            // takeable again.
            p.give_back_reservation();
            this.give_back(py, p, true);
        }
        match got? {
            Some(f) if cancelled.is_some_and(aio::is_cancelled) => {
                // The awaiting task was cancelled while this slice took the buffer: nobody will
                // publish it, so it goes back now, not when the discarded frame is collected
                // (an `acquire` awaited right after would find the producer in use).
                // The error is never seen: the awaiting side gave up (as a wait stopped by the
                // cancellation between slices, which says the same).
                this.give_back(py, f.into_producer(), true);
                Err(this.closed_error())
            }
            Some(f) => slf.get().hand_out(py, f),
            None => Err(timeout_error(py, "a free buffer", timeout)),
        }
    }

    /// The write frame an `acquire` got, unless `close()` came meanwhile: then it goes back
    /// unpublished (the producer closed) and `ChannelClosed` is raised. Decided under the lock,
    /// so a `close()` either came first (and is seen here) or sees the loan to the `WriteFrame`
    /// (and leaves the closing to its publish or abandon).
    fn hand_out(&self, py: Python<'_>, f: OwnedWriteFrame) -> PyResult<WriteFrame> {
        let l = &self.lender;
        let mut s = lock(&l.state);
        if s.closed {
            drop(s);
            l.give_back(py, f.into_producer(), true);
            return Err(l.closed_error());
        }
        s.acquiring = None;
        drop(s);
        WriteFrame::new(py, l.clone(), f)
    }
}

#[pymethods]
impl Producer {
    /// Creates channel `name` with a pool of `buffers` buffers of `buffer_bytes` bytes on CUDA
    /// device `device` (its primary context); with `memory="host"`, of shared host memory
    /// (`Producer::create_host`: no CUDA driver needed, `device` unused). `ring=True` hands
    /// buffers out in ring order (frame `s` in buffer `(s - 1) % buffers`), which consumers'
    /// `post` (receives posted ahead) needs (`ChannelOptions::ring`).
    #[new]
    #[pyo3(signature = (name, buffer_bytes, *, buffers=Int::Small(4), max_consumers=Int::Small(8),
        quota_bytes=None, quota=None, wait=Text::lit("spin_then_block"),
        spin=Seconds::Float(50e-6), memory=Text::lit("auto"), group_access=false, device=Int::Small(0), stream=None, ring=false))]
    #[pyo3(
        text_signature = "(name, buffer_bytes, *, buffers=4, max_consumers=8, \
        quota_bytes=None, quota=None, wait=\"spin_then_block\", spin=5e-05, memory=\"auto\", \
        group_access=False, device=0, stream=None, ring=False)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: Text,
        buffer_bytes: Int,
        buffers: Int,
        max_consumers: Int,
        quota_bytes: Option<Int>,
        quota: Option<Text>,
        wait: Text,
        spin: Seconds,
        memory: Text,
        group_access: bool,
        device: Int,
        stream: Option<&Bound<'_, PyAny>>,
        ring: bool,
    ) -> PyResult<Self> {
        let name = name.into_string(py, "name")?;
        let quota = opt_text(py, "quota", &quota)?;
        let wait = wait.get(py, "wait")?;
        let memory = memory.get(py, "memory")?;
        let buffer_bytes: usize = buffer_bytes.get(py, "buffer_bytes")?;
        let buffers: usize = buffers.within(py, "buffers", 1, cuda_ipc::channel::MAX_BUFFERS)?;
        let max_consumers: usize =
            max_consumers.within(py, "max_consumers", 1, cuda_ipc::channel::MAX_CONSUMERS)?;
        let quota_bytes: Option<u64> = opt_int(py, "quota_bytes", quota_bytes)?;
        let device = device_arg(py, device)?;
        let stream = stream_arg(py, stream)?;
        if stream.is_some() && memory == "host" {
            return Err(errors::invalid_argument(
                py,
                "a host-memory channel has no streams to order: leave stream=None".to_string(),
            ));
        }
        let mut opts = ChannelOptions::new(buffer_bytes)
            .buffers(buffers)
            .max_consumers(max_consumers)
            .wait(wait_arg(py, wait, spin)?)
            .memory(memory_arg(py, memory)?)
            .group_access(group_access)
            .ring(ring);
        if let Some(q) = quota_bytes {
            opts = opts.quota_bytes(q);
        }
        if let Some(q) = quota {
            opts = opts.quota(quota_scope(q).map_err(|e| err(py, e))?);
        }
        let host = memory == "host";
        let p = py
            .detach(|| {
                if host {
                    return cuda_ipc::channel::Producer::create_host(&name, &opts);
                }
                let ctx = Device::get(device)?.primary_context()?;
                cuda_ipc::channel::Producer::create(&ctx, &name, &opts)
            })
            .map_err(|e| err(py, e))?;
        let memory = p.memory_kind();
        let lender = Arc::new(Lender::new(p, name, stream));
        crate::util::close_at_exit_later(
            py,
            &(lender.clone() as Arc<dyn crate::util::CloseAtExit>),
        );
        Ok(Producer { memory, lender })
    }

    /// The channel name.
    #[getter]
    fn name(&self) -> &str {
        &self.lender.name
    }

    /// The kind of memory of the pool: "legacy", "vmm", "pool" or "host".
    #[getter]
    fn memory(&self) -> &'static str {
        memory_name(self.memory)
    }

    /// Takes a free buffer to write, waiting up to `timeout` seconds (`None`: forever).
    /// `ChannelClosed` once `close()` was called, also from another thread while this waits (it
    /// wakes within 50 ms); `Timeout`; `InvalidArgument` while a `WriteFrame` is outstanding. On
    /// a pool of one buffer that consumers hold, its frame stays reserved across the 50 ms slices
    /// (`Producer::acquire_slice`) and is given back when the wait ends without a buffer.
    /// `NotSupported` in a forked child.
    #[pyo3(signature = (timeout=None))]
    fn acquire(slf: &Bound<'_, Self>, timeout: Option<Seconds>) -> PyResult<WriteFrame> {
        let timeout = timeout_arg(slf.py(), timeout)?;
        Self::acquire_until(slf, timeout, None)
    }

    /// `acquire` as an awaitable (`await producer.acquire_async(timeout=1.0)`): it waits on a thread
    /// of the extension's own executor (without the GIL; a thread for every wait pending), so the
    /// loop runs other tasks meanwhile. Cancelling the awaiting task stops that thread within
    /// 50 ms; a buffer taken in that instant is given back unpublished at once, so an
    /// `acquire_async` awaited right after finds the producer free. Raises as `acquire`. Awaited outside a running event loop
    /// it raises `RuntimeError`.
    #[pyo3(signature = (timeout=None))]
    fn acquire_async<'py>(
        slf: Bound<'py, Self>,
        timeout: Option<Seconds>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let timeout = timeout_arg(py, timeout)?;
        let this = slf.unbind();
        // A frame the wait returned to a task cancelled before it resumed goes back unpublished.
        let undo = py.get_type::<WriteFrame>().getattr("abandon")?.unbind();
        aio::awaitable_undoing(
            py,
            move |py, cancelled| {
                let f = Self::acquire_until(this.bind(py), timeout, Some(cancelled))?;
                Ok(Py::new(py, f)?.into_any())
            },
            undo,
        )
    }

    /// A free buffer if one is free now, else `None`. `ChannelClosed` once closed;
    /// `NotSupported` in a forked child.
    fn try_acquire(slf: &Bound<'_, Self>) -> PyResult<Option<WriteFrame>> {
        let py = slf.py();
        let this = slf.get();
        let l = &this.lender;
        let p = l.take(py, true)?;
        match OwnedWriteFrame::acquire(p, Some(Duration::ZERO)) {
            Ok(f) => this.hand_out(py, f).map(Some),
            Err((p, cuda_ipc::Error::Timeout { .. })) => {
                l.give_back(py, p, true);
                Ok(None)
            }
            Err((p, e)) => {
                l.give_back(py, p, true);
                Err(err(py, e))
            }
        }
    }

    /// The channel's counters as a dict. `ChannelClosed` once closed; `InvalidArgument` while a
    /// `WriteFrame` is outstanding; `NotSupported` in a forked child.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // Its state may be a parent's thread's, which does not run here (an `acquire`).
        self.lender.check_fork()?;
        let s = {
            let st = lock(&self.lender.state);
            match &st.producer {
                Some(p) => p.stats(),
                None if st.closed => return Err(self.lender.closed_error()),
                None => {
                    return Err(errors::invalid_argument(
                        py,
                        "a WriteFrame of this producer is outstanding: publish or abandon it first"
                            .to_string(),
                    ));
                }
            }
        };
        stats_dict(py, &s)
    }

    /// Closes the channel: no frame can be published after it, and consumers get
    /// `ChannelClosed` once they received what was published. Waits up to `timeout` seconds (0
    /// to 1e9; `None`: without bound, as every `timeout=None`) until every every-frame consumer
    /// (`delivery="every"`) has *received* every published frame (taken it with `recv`, not only
    /// been able to) and no consumer holds a frame; then forces the holds left and frees the
    /// pool. A latest-only consumer is waited for only while it holds a frame. Returns `{"forced_holds": n, "consumers_behind": m}`:
    /// `n` holds still outstanding at the deadline, released by force (a consumer still reading
    /// one reads undefined data), and `m` every-frame consumers that had not received every
    /// frame by then (the frames they missed are gone); either nonzero means the whole timeout
    /// was waited. Closing again does nothing (`{"forced_holds": 0, "consumers_behind": 0}`),
    /// but a second `close()` while another thread's close frees the channel returns once that
    /// one has (within its own `timeout`), so the name can be created again after it.
    ///
    /// The wait runs without the GIL in 50 ms slices, checking for signals between them: Ctrl-C
    /// raises `KeyboardInterrupt` within a slice. The channel is then closed to new frames
    /// (`acquire` raises `ChannelClosed`; consumers get `ChannelClosed` once they received what
    /// was published) but its pool is not freed yet: call `close()` again to finish (it waits
    /// anew, up to its own `timeout`), or let the producer be collected (which closes it waiting
    /// up to 5 s).
    ///
    /// A thread blocked in `acquire()` raises `ChannelClosed` within 50 ms, and this waits for it
    /// to give the producer back (a close from within that `acquire`, by a signal handler, does
    /// not wait: that `acquire` closes the channel as it ends). While a `WriteFrame` is
    /// outstanding, the channel is closed when it is published (which then raises
    /// `ChannelClosed`) or abandoned, and this returns `{"forced_holds": 0,
    /// "consumers_behind": 0}` at once. So it does in a forked child, whose copy closes nothing:
    /// the channel is the parent's.
    #[pyo3(signature = (timeout=Some(Seconds::Float(5.0))))]
    #[pyo3(text_signature = "($self, timeout=5.0)")]
    fn close<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<Seconds>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let t = close_timeout_arg(py, timeout)?;
        let (forced, behind) = self.close_for(py, t)?;
        let d = PyDict::new(py);
        d.set_item("forced_holds", forced)?;
        d.set_item("consumers_behind", behind)?;
        Ok(d)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.close(py, Some(Seconds::Float(5.0))).map(|_| ())
    }

    fn __repr__(&self) -> String {
        format!(
            "Producer({:?}, memory={:?})",
            self.lender.name,
            memory_name(self.memory)
        )
    }
}

impl Producer {
    /// `close(timeout)`, `t` checked: the holds forced and the consumers behind.
    fn close_for(&self, py: Python<'_>, t: Duration) -> PyResult<(u64, u64)> {
        let me = std::thread::current().id();
        let l = &self.lender;
        if l.is_forked_copy() {
            // A forked child's copy (a `with` block left by the child's exit): the channel is the
            // parent's, and stays open; nothing was waited for.
            return Ok((0, 0));
        }
        let p = py.detach(|| {
            let mut s = lock(&l.state);
            if !s.closed {
                s.closed = true;
                s.close_timeout = t;
            }
            if s.producer.is_none() && s.acquiring.is_some_and(|a| a != me) {
                // The blocked `acquire` sees `closed` before its next slice and gives the
                // producer back (`give_back`, which sees `close_waits` and leaves it here). It
                // needs neither this lock (released while waiting) nor the GIL (released above).
                // Bounded all the same (`CLOSE_WAITS_FOR_ACQUIRE`): should that `acquire` not come
                // back (a bug), this returns and whoever gives the producer back closes it.
                s.close_waits = true;
                s = l
                    .back
                    .wait_timeout_while(s, CLOSE_WAITS_FOR_ACQUIRE, |s| {
                        s.producer.is_none() && s.acquiring.is_some()
                    })
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                s.close_waits = false;
            }
            // Marked as finishing under the state's lock (`Finish`): a second `close()` that
            // finds the producer gone waits for this one.
            s.producer.take().map(|p| (p, l.finish.start()))
        });
        let (forced, behind) = match p {
            Some((mut p, _finishing)) => {
                let start = Instant::now();
                // What `close` waits for, in slices, so that Ctrl-C is seen (`sliced`).
                let waited = sliced(
                    py,
                    Some(t),
                    || false,
                    |_| l.closed_error(),
                    |slice| Ok(p.wait_closing(slice).then_some(())),
                );
                if let Err(e) = waited {
                    // A signal handler raised: the producer stays here, closed to consumers but
                    // not freed; a later `close()` finishes (or its `Drop`, when collected).
                    lock(&l.state).producer = Some(p);
                    return Err(e);
                }
                // Done waiting, or the deadline passed: `close` checks once more with the time
                // left (on a GPU channel also for the consumers' last kernels), then frees.
                let left = t.saturating_sub(start.elapsed());
                let r = py.detach(|| p.close(left)).map_err(|e| err(py, e))?;
                (r.forced_holds, r.consumers_behind)
            }
            None => {
                // Closed already, or being closed by another `close()` (or by the `acquire` or
                // `WriteFrame` that has the producer as it ends): returns once that close has
                // finished, within `timeout`.
                // A close interrupted (Ctrl-C) hands the producer back, closed but not freed:
                // then this one finishes it.
                let back = || lock(&l.state).producer.is_some();
                if l.finish.wait_or_take_over(py, t, back)? {
                    return self.close_for(py, t);
                }
                (0, 0)
            }
        };
        Ok((forced, behind))
    }
}
