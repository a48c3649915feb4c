//! A memoryless channel's consumer (a tensor set's generation channel): joined in two steps
//! ([`Joined`]: the slot, then the consumer), and its GPU objects made at first need.
//!
//! The rule for a memoryless GPU consumer: its stream (with the watchdog that drains it), the
//! registration of the channel's GPU words and the join event are made by the first call that
//! needs them, which returns their error. A take whose buffer's ready word already shows the frame
//! (Acquire, wrapping ≥ its sequence number) while the gate is open was written by the producer's
//! stream after its work: the generation is complete in device memory and nothing is enqueued
//! (the frame is *host-ready*). Otherwise the stream waits on the word as on every GPU channel.
//! A frame's release goes on the stream when the stream exists (someone made it: `stream()`, an
//! ordering call, a stream-ordered take), after the work there; when it was never made, no GPU
//! work of this consumer can read or wait for the frame, and the release word is written from
//! the host.

use super::{Consumer, GpuImports, Side};
use crate::channel::control::Control;
use crate::channel::layout::GateState;
use crate::channel::watchdog::Watchdog;
use crate::channel::{ChannelError, ConsumerOptions, SegmentFault, WaitStrategy};
use crate::driver::{Context, Event, HostRegistration, Stream};
use crate::error::Result;
use std::sync::{Arc, Mutex, OnceLock};

/// A memoryless channel joined: its control segment open and checked, the producer alive at the
/// check, a consumer slot claimed. Dropping it leaves the slot; [`Joined::into_consumer`] makes
/// the consumer that keeps it.
pub(crate) struct Joined {
    /// `None` once taken by [`Joined::into_consumer`].
    control: Option<Control>,
    slot: usize,
    wait: WaitStrategy,
}

impl std::fmt::Debug for Joined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Joined")
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

impl Joined {
    /// The control segment's creation generation and its buffer count (a tensor set's reader
    /// checks them against the manifest before it keeps the slot).
    pub(crate) fn generation(&self) -> (u64, usize) {
        match &self.control {
            Some(c) => (c.generation(), c.buffers()),
            None => (0, 0),
        }
    }

    /// The consumer that keeps this slot: in `ctx` (its GPU objects made at first need, see the
    /// module docs), or on the host with `None`. Makes no driver call and cannot fail.
    pub(crate) fn into_consumer(mut self, ctx: Option<&Arc<Context>>) -> Consumer {
        let control = self
            .control
            .take()
            .expect("a Joined is consumed once, by value");
        let side = match ctx {
            None => Side::Host(None),
            Some(ctx) => Side::Gpu {
                watchdog: OnceLock::new(),
                imports: Arc::new(GpuImports {
                    join: OnceLock::new(),
                    buffers: Vec::new(),
                    stream: OnceLock::new(),
                    ready: OnceLock::new(),
                    making: Mutex::new(()),
                    lazy: true,
                    ctx: ctx.clone(),
                }),
            },
        };
        Consumer {
            side,
            control: Arc::new(control),
            slot: self.slot,
            wait: self.wait,
            posted: Mutex::new(0),
        }
    }
}

impl Drop for Joined {
    fn drop(&mut self) {
        // Never a consumer: nothing was received, nothing enqueued.
        if let Some(c) = &self.control {
            c.detach(self.slot);
        }
    }
}

impl Consumer {
    /// Joins the memoryless channel `name` under `prefix` (crate-private: a tensor set's
    /// generation channel, see `Producer::create_memoryless`): opens its control segment, checks
    /// it has no buffer memory and its producer lives, claims a slot. Needs no context: the
    /// consumer is made from it by [`Joined::into_consumer`].
    ///
    /// # Errors
    /// As [`Consumer::attach`]; [`ChannelError::BadSegment`] when the channel has buffer memory.
    pub(crate) fn join_memoryless(
        prefix: &str,
        name: &str,
        opts: &ConsumerOptions,
    ) -> Result<Joined> {
        let control = Control::open_in(
            prefix,
            name,
            opts.group_access,
            crate::channel::control::INIT_WAIT,
        )?;
        if control.buffer_bytes() != 0 {
            return Err(ChannelError::BadSegment(SegmentFault::BufferLen {
                index: 0,
                len: control.buffer_bytes() as usize,
                expected: 0,
            })
            .into());
        }
        control.producer_gone()?;
        let slot = control.attach(opts.delivery)?;
        Ok(Joined {
            control: Some(control),
            slot,
            wait: opts.wait,
        })
    }

    /// [`Consumer::join_memoryless`] then [`Joined::into_consumer`]. The frames of such a
    /// consumer have no buffer: only their sequence number, index and metadata mean anything.
    ///
    /// # Errors
    /// As [`Consumer::join_memoryless`].
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn attach_memoryless(
        ctx: Option<&Arc<Context>>,
        prefix: &str,
        name: &str,
        opts: &ConsumerOptions,
    ) -> Result<Consumer> {
        Ok(Self::join_memoryless(prefix, name, opts)?.into_consumer(ctx))
    }

    /// The watchdog of a GPU consumer: closes a dead producer's gate, so its stream drains.
    pub(super) fn watchdog(control: &Arc<Control>) -> Watchdog {
        let watched = control.clone();
        Watchdog::start(
            "cuda-ipc-watchdog",
            "a dead producer is noticed at recv",
            move || {
                if watched.producer_gone().is_err() {
                    watched.force_ready();
                    return false;
                }
                true
            },
        )
    }

    /// The consumer's stream (`cuStreamCreate` at the first call on a memoryless channel, with
    /// the watchdog that drains it when the producer dies).
    pub(super) fn made_stream<'a>(&'a self, gpu: &'a GpuImports) -> Result<&'a Stream> {
        made(&gpu.stream, &gpu.making, || {
            let stream = Stream::new(&gpu.ctx)?;
            if let Side::Gpu { watchdog, .. } = &self.side {
                watchdog.get_or_init(|| Self::watchdog(&self.control));
            }
            Ok(stream)
        })
    }

    /// The registration of the channel's GPU words (`cuMemHostRegister` at the first call on a
    /// memoryless channel).
    pub(super) fn made_ready<'a>(&'a self, gpu: &'a GpuImports) -> Result<&'a HostRegistration> {
        made(&gpu.ready, &gpu.making, || {
            let (page, len) = self.control.gpu_words();
            // SAFETY: the GPU words lie in the control segment's mapping, which `self.control`
            // keeps until the registration drops (Consumer's fields: the side, holding the
            // registration, drops before the control; the thread that waits for posted receives
            // drops its imports before its control).
            unsafe { HostRegistration::new(&gpu.ctx, page, len) }
        })
    }

    /// The join event (`cuEventCreate` at the first call on a memoryless channel).
    pub(super) fn made_join<'a>(&'a self, gpu: &'a GpuImports) -> Result<&'a Mutex<Event>> {
        made(&gpu.join, &gpu.making, || {
            Ok(Mutex::new(Event::new(&gpu.ctx)?))
        })
    }

    /// Whether buffer `i`'s ready word shows frame `seq` written by the producer's stream: the
    /// word is at or past `seq` and the gate is still open (a gate closed for a dead producer
    /// raises the words without the frame's bytes).
    pub(super) fn host_ready(&self, i: usize, seq: u64) -> bool {
        // The word first: `ready_value`'s Acquire pairs with the producer stream's write (after
        // its work on the buffer) and with `close_gate`'s raise, which stores the gate's state
        // before it raises the words, so a raised word seen here makes the closed state visible
        // to the `gate` load below.
        let word = self.control.ready_value(i);
        (word.wrapping_sub(seq as u32) as i32) >= 0
            && self.control.gate().0 == GateState::Open.to_wire()
    }
}

/// `cell`'s object, made by `make` (under `lock`, once) when there is none yet.
fn made<'a, T>(
    cell: &'a OnceLock<T>,
    lock: &Mutex<()>,
    make: impl FnOnce() -> Result<T>,
) -> Result<&'a T> {
    if let Some(v) = cell.get() {
        return Ok(v);
    }
    let _making = lock.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(v) = cell.get() {
        return Ok(v);
    }
    let v = make()?;
    Ok(cell.get_or_init(|| v))
}
