use super::{Context, Stream};
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use std::mem::MaybeUninit;
use std::sync::Arc;

/// A CUDA graph captured from the work enqueued on a [`Stream`] and instantiated once
/// (`cuStreamBeginCapture_v2`, `cuStreamEndCapture`, `cuGraphInstantiateWithFlags`), replayed with
/// [`Graph::launch`]. Every device address the captured work used is frozen in the graph: replays
/// read and write the same addresses (kernel parameters included), which is what a reader's
/// stable addresses ([`crate::tensorset::TensorSetReader::switch_stable`]) keep valid across
/// generations. Drop destroys the executable graph and the graph (`cuGraphExecDestroy`,
/// `cuGraphDestroy`).
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html>.
#[derive(Debug)]
pub struct Graph {
    // Drop order: the executable graph and the graph are destroyed (in Drop) before `ctx` is
    // released.
    exec: sys::CUgraphExec,
    graph: sys::CUgraph,
    ctx: Arc<Context>,
}

// SAFETY: a graph and its executable form are driver handles owned by this value alone; moving
// them to another thread moves that ownership, and every call enters the context first. Not
// `Sync`: the driver does not synchronise concurrent calls on one graph object.
unsafe impl Send for Graph {}

impl Graph {
    /// Captures the work `record` enqueues on `stream` (`cuStreamBeginCapture_v2` in
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`: this thread may make no call that would
    /// synchronise with the capture until it ends; other threads are not restricted), ends the
    /// capture (`cuStreamEndCapture`, also when `record` fails) and instantiates the graph
    /// (`cuGraphInstantiateWithFlags`, no flags). Nothing runs while capturing: the work runs
    /// at each [`Graph::launch`]. `stream` must be a stream of its own (not one another thread
    /// enqueues on meanwhile), and not the legacy default stream.
    ///
    /// # Errors
    /// `record`'s error (the capture is ended and dropped first); [`Error::Cuda`] naming the
    /// call that failed (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` from `cuStreamEndCapture` when
    /// the captured work made a call capture does not allow, `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`
    /// for such a call itself); [`Error::InvalidArgument`] when the capture recorded nothing.
    ///
    /// # Examples
    /// ```no_run
    /// use cuda_ipc::driver::{Context, DeviceBuffer, Graph, Stream};
    /// use cuda_ipc::raw::kernels::Kernels;
    /// let ctx = Context::default_device()?;
    /// let (k, s) = (Kernels::load(&ctx)?, Stream::new(&ctx)?);
    /// let buf = DeviceBuffer::new(&ctx, 1 << 20)?;
    /// let g = Graph::capture(&s, |s| k.fill_pattern(&buf, 7, s))?;
    /// // SAFETY: `buf`, the only memory the graph touches, lives until the stream is drained.
    /// unsafe { g.launch(&s)? };
    /// s.synchronize()?;
    /// # Ok::<(), cuda_ipc::Error>(())
    /// ```
    #[doc(alias = "cuStreamBeginCapture")]
    #[doc(alias = "cuGraphInstantiate")]
    pub fn capture(stream: &Stream, record: impl FnOnce(&Stream) -> Result<()>) -> Result<Graph> {
        let ctx = stream.context().clone();
        {
            let _cur = ctx.enter()?;
            // SAFETY: context current (`_cur`); the stream is live (borrowed) and belongs to it;
            // the mode is a defined capture mode.
            check("cuStreamBeginCapture_v2", unsafe {
                sys::cuStreamBeginCapture_v2(
                    stream.as_raw(),
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
            })?;
        }
        let recorded = record(stream);
        let mut raw = MaybeUninit::<sys::CUgraph>::uninit();
        let ended = {
            let _cur = ctx.enter()?;
            // SAFETY: context current (`_cur`); the stream is capturing (begun above); `raw` a
            // valid out-pointer. Ends the capture whatever `record` did, so the stream is usable
            // again.
            check("cuStreamEndCapture", unsafe {
                sys::cuStreamEndCapture(stream.as_raw(), raw.as_mut_ptr())
            })
        };
        // SAFETY: written on success (possibly null when nothing was captured).
        let graph = ended.map(|()| unsafe { raw.assume_init() });
        let graph = match (recorded, graph) {
            (Ok(()), Ok(g)) if !g.is_null() => g,
            (Ok(()), Ok(_)) => {
                return Err(Error::InvalidArgument(
                    "the captured work enqueued nothing to replay".into(),
                ));
            }
            (Err(e), Ok(g)) => {
                Self::destroy_graph(&ctx, g);
                return Err(e);
            }
            (Err(e), Err(_)) => return Err(e),
            (Ok(()), Err(e)) => return Err(e.into()),
        };
        let mut exec = MaybeUninit::<sys::CUgraphExec>::uninit();
        let made = ctx.enter().and_then(|_cur| {
            // SAFETY: context current (`_cur`); `graph` came from the capture above and is live;
            // `exec` a valid out-pointer; flags 0.
            check("cuGraphInstantiateWithFlags", unsafe {
                sys::cuGraphInstantiateWithFlags(exec.as_mut_ptr(), graph, 0)
            })
            .map_err(Into::into)
        });
        if let Err(e) = made {
            Self::destroy_graph(&ctx, graph);
            return Err(e);
        }
        Ok(Graph {
            // SAFETY: written on success.
            exec: unsafe { exec.assume_init() },
            graph,
            ctx,
        })
    }

    fn destroy_graph(ctx: &Context, graph: sys::CUgraph) {
        if graph.is_null() {
            return;
        }
        let r = ctx.enter().and_then(|_cur| {
            // SAFETY: context current (`_cur`); `graph` is a live graph owned by the caller and
            // destroyed once, here.
            check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph) }).map_err(Into::into)
        });
        if let Err(e) = r {
            tracing::warn!("{e}; the graph leaks until the context is torn down");
        }
    }

    /// Enqueues one replay of the graph on `stream` (`cuGraphLaunch`), after the work enqueued
    /// there so far and after the graph's previous launches.
    ///
    /// # Safety
    /// 1. Every device address the captured work reads or writes is valid (allocated, or mapped
    ///    with the access the work needs) in the graph's context until this replay completes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `stream` belongs to another context; [`Error::Cuda`]
    /// naming `cuGraphLaunch`.
    #[doc(alias = "cuGraphLaunch")]
    pub unsafe fn launch(&self, stream: &Stream) -> Result<()> {
        self.ctx.same_as(stream.context())?;
        let _cur = self.ctx.enter()?;
        // SAFETY: context current (`_cur`); the executable graph is live until drop; the stream
        // is live (borrowed) and of this context (checked above); the caller guarantees the
        // addresses the work uses (obligation 1).
        check("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(self.exec, stream.as_raw())
        })?;
        Ok(())
    }

    /// The context the graph belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let r = self.ctx.enter().and_then(|_cur| {
            // SAFETY: context current (`_cur`); the executable graph was instantiated by this
            // value and is destroyed once; the driver lets launched replays finish first.
            check("cuGraphExecDestroy", unsafe {
                sys::cuGraphExecDestroy(self.exec)
            })
            .map_err(Into::into)
        });
        if let Err(e) = r {
            tracing::warn!("{e}; the executable graph leaks until the context is torn down");
        }
        Self::destroy_graph(&self.ctx, self.graph);
    }
}
