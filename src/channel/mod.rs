//! Producer/consumer GPU pipelines: a [`Producer`] hands frames from a pool of exportable device
//! buffers to one or more [`Consumer`] processes with zero copies, each in its own CUDA context.
//!
//! Owns: the pool, the hand-off protocol (control segment, holds, releases, delivery policies,
//! dead-peer recovery) and its GPU side (stream-ordered hand-off through ready words, release through IPC events).
//! Built on [`crate::ipc`], [`crate::driver`] and [`crate::raw::shm`]; it never changes those layers.
//!
//! One hand-off:
//! 1. the producer [`acquires`](Producer::acquire) a free buffer once the release events of the
//!    consumers that last read it completed, so the write cannot overtake their kernels (checked on
//!    the host: a stream wait on another process's event would block for good if that process died);
//! 2. it enqueues its GPU work on [`Producer::stream`] and [`publishes`](WriteFrame::publish) with up
//!    to [`META_BYTES`] of metadata: the sequence number is bumped and the producer's stream then
//!    writes the buffer's ready word, a `u32` in the control segment's page registered with the
//!    driver;
//! 3. a consumer's [`recv`](Consumer::recv) returns a [`Frame`] whose ready word its stream already
//!    waits for (`cuStreamWaitValue32`, no host synchronisation); it enqueues its own kernels on
//!    [`Consumer::stream`]. If the producer dies before its write finished, the consumer marks the
//!    word ready itself so its stream drains (a wait on a dead process's IPC event never ends);
//! 4. dropping the frame records the consumer's release event and ends its hold.
//!
//! A consumer that dies has its holds released by the producer within about 20 ms of the producer
//! needing the buffer; consumers of a producer that dies get [`Error::ProducerGone`] within about
//! 20 ms; [`Producer::close`] waits (bounded) for outstanding holds and reports the ones it forced.
//!
//! [`Error::ProducerGone`]: crate::Error::ProducerGone

mod consumer;
mod control;
mod error;
mod handoff;
mod hold;
mod host;
pub mod inspect;
#[doc(hidden)]
pub mod layout;
mod options;
pub mod owned;
mod producer;
#[doc(hidden)]
pub mod testing;
mod wait;

pub use consumer::{Consumer, Frame};
pub use control::MAX_CHANNEL_NAME;
pub use error::ChannelError;
pub use handoff::{ChannelStats, ConsumerStats};
pub use layout::{
    ConsumerState, Delivery, MAX_BUFFERS, MAX_CONSUMERS, META_BYTES, ProducerState, UnknownCode,
};
pub use options::{ChannelOptions, ConsumerOptions, MemoryKind};
pub use producer::{ChannelBuffer, Producer, ShutdownReport, WriteFrame};
pub use wait::WaitStrategy;
