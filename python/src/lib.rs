//! `cuda_ipc`, the Python extension: [`Producer`], [`Consumer`] and their frames over the Rust
//! channel (`cuda_ipc::channel`), frames exported as DLPack capsules and through
//! `__cuda_array_interface__`, errors as the hierarchy of [`errors`].
//!
//! Ownership: a Python `Frame` holds an `Arc` of a
//! [`OwnedFrame`](cuda_ipc::channel::owned::OwnedFrame), which keeps the Rust consumer alive;
//! every DLPack capsule made from it holds another `Arc`, so the hold ends when the frame is
//! released (or collected) *and* every tensor made from it is freed. A `WriteFrame` owns the Rust
//! producer while it is written ([`OwnedWriteFrame`](cuda_ipc::channel::owned::OwnedWriteFrame))
//! and gives it back to its `Producer` on `publish`, `abandon` or collection.
//!
//! Host channels (`memory="host"`, `cuda_ipc::channel::MemoryKind::Host`) never load the CUDA
//! driver. Their frames have no device pointer, stream or tensor export: every such accessor raises
//! `NotSupported`, checked once in [`view::Buffer`], which both frame classes hold (made from the
//! library's one view of a frame, `cuda_ipc::channel::FrameBuffer`). Their bytes are copied in
//! and out (`WriteFrame.write`, `Frame.bytes`, `Frame.read`), never lent as a buffer: another
//! process writes that memory once the frame is released, and a Python buffer (a `memoryview`, a
//! NumPy array) could outlive the hold with nothing to stop it; the abi3 wheel (limited API of
//! CPython 3.9) cannot export the buffer protocol either.
//!
//! Blocking calls release the GIL and wait in slices of at most [`util::SLICE`], checking for
//! signals and for `close()` between slices, so Ctrl-C raises `KeyboardInterrupt` promptly with
//! nothing held, and `close()` from another thread wakes them within a slice ([`util::sliced`]).
//! Every duration argument goes through [`args::seconds_arg`] (0 to [`args::MAX_SECONDS`], else
//! `InvalidArgument`), every integer argument through [`args::Int`] (the range of what it
//! becomes, else `InvalidArgument` naming it, never `OverflowError`), every text argument through
//! [`args::Text`] (a lone surrogate is `InvalidArgument` naming it, never `UnicodeEncodeError`);
//! all are checked before a
//! call consumes anything (a refused `publish` leaves its frame open). `close(timeout)` waits in
//! the same slices (`Producer::wait_closing`). Their `*_async` forms (`Consumer.recv_async`, `Producer.acquire_async`,
//! `Posted.wait_async`, `TensorSetReader.wait_newer_async`) are coroutines that run the same
//! sliced wait on a thread of the extension's own executor (not the loop's default one, whose
//! few threads as many pending waits would use up) and stop it within a slice when the awaiting
//! task is cancelled ([`aio`]).
//!
//! One class a file: `producer.rs`, `write_frame.rs`, `consumer.rs`, `frame.rs`, `posted.rs` (a
//! receive posted ahead, `Posted`, and its `PostedFrame`), `holder.rs` (a tensor set's
//! `TensorSetHolder`), `tensor_set_writer.rs`, `tensor_update.rs` (its `TensorUpdate`),
//! `copy_plan.rs` (`CopyPlan`), `tensor_set_reader.rs` (`TensorSetReader`, `TensorHold`; its
//! folder the parking of released holds); `lending.rs` the Rust producer a `Producer` lends its
//! `WriteFrame`s, `writer_core.rs` what a tensor-set writer shares with its update, `sources.rs`
//! an update's source tensors, `tensors.rs` tensor sets as PyTorch tensors, `aio.rs` the
//! awaitable waits, `view.rs` the frames' buffer, `args.rs` the checks of every argument
//! (durations, ints, texts, devices, streams, memory kinds, waits, shapes, buffers, ranges,
//! fingerprints), `util.rs` what the classes share besides (locks, the sliced wait, the closes at
//! exit, tensor shaping), `quota.rs` the quota functions, `cleanup.rs` `cleanup`, `errors.rs` the
//! exception classes and the spelling of counts in messages, `dlpack.rs` the tensor exports,
//! `warm.rs` the warm-up at import (`warm_up`), `torch_alloc.rs` PyTorch's pluggable allocator
//! (the exported C functions `cuda_ipc_torch_malloc`/`cuda_ipc_torch_free` over a VMM arena) and
//! `torch_mem_pool`.

mod aio;
mod args;
mod cleanup;
mod consumer;
mod copy_plan;
mod dlpack;
mod errors;
mod frame;
mod holder;
mod lending;
mod posted;
mod producer;
mod quota;
mod sources;
mod tensor_set_reader;
mod tensor_set_writer;
mod tensor_update;
mod tensors;
mod torch_alloc;
mod util;
mod view;
mod warm;
mod write_frame;
mod writer_core;

use consumer::Consumer;
use frame::Frame;
use producer::Producer;
use pyo3::prelude::*;
use quota::{remove_quota, set_quota};
use write_frame::WriteFrame;

/// Zero-copy GPU frames between processes: the cuda-ipc channel.
#[pymodule]
#[pyo3(name = "cuda_ipc")]
fn cuda_ipc_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    // Not attributes of the module: registered with `atexit`, and kept for `multiprocessing`'s
    // finalizers (`util::close_at_exit_later`), alone.
    let hook = wrap_pyfunction!(util::mark_exiting, m)?;
    m.py().import("atexit")?.call_method1("register", (hook,))?;
    let mp_hook = wrap_pyfunction!(util::mp_exiting, m)?;
    let _ = util::HOOK.set(m.py(), mp_hook.into_any().unbind());
    m.add_class::<Producer>()?;
    m.add_class::<WriteFrame>()?;
    m.add_class::<Consumer>()?;
    m.add_class::<Frame>()?;
    m.add_class::<posted::Posted>()?;
    m.add_class::<posted::PostedFrame>()?;
    m.add_class::<tensor_set_writer::TensorSetWriter>()?;
    m.add_class::<tensor_update::TensorUpdate>()?;
    m.add_class::<copy_plan::CopyPlan>()?;
    m.add_class::<tensor_set_reader::TensorSetReader>()?;
    m.add_class::<tensor_set_reader::TensorHold>()?;
    m.add_class::<holder::TensorSetHolder>()?;
    m.add_function(wrap_pyfunction!(set_quota, m)?)?;
    m.add_function(wrap_pyfunction!(remove_quota, m)?)?;
    m.add_function(wrap_pyfunction!(cleanup::cleanup, m)?)?;
    m.add("CleanupResult", cleanup::result_type(m.py())?)?;
    m.add_function(wrap_pyfunction!(torch_alloc::torch_mem_pool, m)?)?;
    m.add_function(wrap_pyfunction!(torch_alloc::arena_locate, m)?)?;
    m.add_function(wrap_pyfunction!(torch_alloc::arena_stats, m)?)?;
    m.add("META_BYTES", cuda_ipc::channel::META_BYTES)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(warm::warm_up, m)?)?;
    // Last: the module is whole if PyTorch's calls below import anything that looks at it.
    warm::at_import(m.py())?;
    Ok(())
}
