//! Producer/consumer GPU pipelines: a [`Producer`] hands frames from a pool of exportable device
//! buffers to one or more [`Consumer`] processes with zero copies, each in its own CUDA context.
//!
//! Owns: the pool, the hand-off protocol (control segment, holds, releases, delivery policies,
//! dead-peer recovery) and its GPU side: stream-ordered both ways through words in the control
//! segment that the streams write and wait on (stream memory operations), with no IPC events.
//! Built on [`crate::ipc`], [`crate::driver`] and [`crate::raw::shm`]; it never changes those layers.
//!
//! One hand-off:
//! 1. the producer [`acquires`](Producer::acquire) a free buffer (no consumer holds it, every
//!    every-frame consumer received its frame); if the consumers that last read it may still be
//!    reading it on their GPUs, the producer's stream waits for their release words
//!    (`cuStreamWaitValue32`): its host never blocks on their work;
//! 2. it enqueues its GPU work on [`Producer::stream`] and [`publishes`](WriteFrame::publish) with up
//!    to [`META_BYTES`] of metadata: the sequence number is bumped and the producer's stream then
//!    writes the buffer's ready word (`cuStreamWriteValue32`);
//! 3. a consumer's [`recv`](Consumer::recv) returns a [`Frame`] whose ready word its stream already
//!    waits for (no host synchronisation); it enqueues its own kernels on [`Consumer::stream`];
//! 4. dropping the frame enqueues the write of its release word on the consumer's stream and ends
//!    its hold.
//!
//! In ring order ([`ChannelOptions::ring`]) frame `s` always lands in buffer `(s - 1) % B`, so an
//! every-frame consumer can [`post`](Consumer::post) its receives ahead: its stream waits on the
//! GPU for frames not yet published, and their kernels start as the producer's write ends.
//!
//! Dead peers: the driver never completes the work of a process that died, so a stream waiting for
//! a dead peer's word would wait for good. Each end's watchdog thread writes a dead peer's words
//! within about 20 ms (a consumer closes a dead producer's gate, raising every ready word; a
//! producer frees a dead consumer's slot, raising its release words), and consumers of a producer
//! that dies get [`ChannelError::ProducerGone`]; [`Producer::close`] waits (bounded) for
//! outstanding
//! holds and reports the ones it forced.

mod closing;
mod consumer;
mod control;
mod error;
mod handoff;
mod hold;
mod host;
pub mod inspect;
pub(crate) mod layout;
mod options;
pub mod owned;
mod pool;
mod producer;
pub mod reclaim;
mod reserve;
mod stats;
pub(crate) mod testing;
mod view;
mod wait;
mod watchdog;

pub(crate) use consumer::FrameHold;
pub use consumer::{Consumer, Frame, MAX_POSTED_AHEAD, Posted, PostedFrame};
pub(crate) use control::Control;
pub use control::MAX_CHANNEL_NAME;
pub(crate) use control::validate_name_as;
pub(crate) use error::is_not_found;
pub use error::{ChannelError, SegmentFault};
pub use layout::{Delivery, LATENCY_BUCKETS, MAX_BUFFERS, MAX_CONSUMERS, META_BYTES};
pub use options::{ChannelOptions, ConsumerOptions, MemoryKind};
pub use pool::ChannelBuffer;
pub(crate) use pool::{allocate_pool, auto_kind};
#[cfg(feature = "remote")]
pub(crate) use producer::LentFrame;
pub use producer::{Producer, ShutdownReport, WriteFrame};
pub use stats::{ChannelStats, ConsumerStats, LatencyHistogram};
pub use view::FrameBuffer;
pub use wait::WaitStrategy;
