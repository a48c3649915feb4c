//! Restart without reload: [`TensorSetWriter::create`] under the name of a dead writer's held VMM
//! set of the same layout re-attaches to that memory (`holders/mod.rs`, "Restart without
//! reload"), and [`OldReaders`], what a resumed writer keeps of the old incarnation's readers.

use super::{Allocation, Memory, State, TensorSetWriter, generation_channel};
use crate::channel::Control;
use crate::channel::MemoryKind;
use crate::channel::inspect::{self, BufferState};
use crate::driver::Context;
use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
use crate::ipc::ImportedBuffer;
use crate::ipc::fdpass::FdExport;
use crate::tensorset::TensorSetOptions;
use crate::tensorset::encode_meta;
use crate::tensorset::holders::resume::{Decision, Found, MemoryFacts, decide};
use crate::tensorset::holders::{self, HoldersSegment, Whole};
use crate::tensorset::manifest::{FLAG_BUFFERED, KIND_VMM, Layout, Manifest};
use crate::tensorset::segment::{self, GENERATION_PREFIX, INIT_WAIT};
use crate::token::Token;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The dead writer's generation channel, kept open by the writer that resumed its set: readers
/// that joined it before the death still hold generations through it (its hold bits), and their
/// streams may still read a buffer they let go of (its release words).
pub(crate) struct OldReaders {
    control: Option<Control>,
}

impl OldReaders {
    /// Whether a live reader of the old channel holds buffer `i`.
    fn held(&self, i: usize) -> bool {
        let Some(c) = &self.control else {
            return false;
        };
        inspect::snapshot("", c)
            .consumers
            .iter()
            .any(|s| s.attached && s.liveness != Liveness::Dead && s.holds.contains(&i))
    }

    /// Whether a live reader of the old channel that read buffer `i` (its bit in the buffer's
    /// used mask) has not yet had its release word for `i` reach the sequence number of the
    /// frame there: it dropped its guard, but the kernels it ran over the buffer on its stream
    /// may still read it (the stream writes the word after them, `cuStreamWriteValue32`). A dead
    /// reader's work no longer runs; a detached one's words were raised when it left.
    fn gpu_reading(&self, i: usize) -> bool {
        let Some(c) = &self.control else {
            return false;
        };
        let snap = inspect::snapshot("", c);
        let Some(b) = snap.buffers.get(i) else {
            return false;
        };
        let BufferState::Frame(seq) = b.state else {
            return false;
        };
        let mut bits = b.used_mask;
        while bits != 0 {
            let k = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if k >= c.consumer_capacity() || c.released(k, i, seq) {
                continue;
            }
            let live = snap
                .consumers
                .iter()
                .any(|s| s.index == k && s.attached && s.liveness != Liveness::Dead);
            if live {
                return true;
            }
        }
        false
    }

    /// Waits (up to `timeout`; `None`: no bound), looking every 200 µs to 2 ms, until neither a
    /// live reader of the old channel nor a live writerless reader (`holders`' reading words)
    /// holds buffer `i`, and every live reader of the old channel that read it has its release
    /// word for it at the frame it read ([`OldReaders::gpu_reading`]: its kernels are done).
    ///
    /// # Errors
    /// [`Error::Timeout`] when one still holds it.
    pub(crate) fn wait_free(
        &self,
        holders: &HoldersSegment,
        i: usize,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut nap = Duration::from_micros(200);
        while self.held(i) || holders.reading_held(i) || self.gpu_reading(i) {
            if timeout.is_some_and(|t| start.elapsed() >= t) {
                return Err(Error::Timeout {
                    what: "the old incarnation's readers to let go of the buffer",
                    after: start.elapsed(),
                });
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
        }
        Ok(())
    }
}

impl TensorSetWriter {
    /// The resume of set `name` when [`decide`] says so (`Ok(None)`: replace as a new set).
    /// Fetches every fd from a live holder, imports each read-write in `ctx` and serves it from
    /// this process, makes the generation channel and the manifest (replacing the dead writer's),
    /// claims the writer's slot in the same holders segment and publishes the last whole
    /// generation again (its number and content fingerprint; 0 bytes copied).
    pub(super) fn try_resume(
        ctx: &Arc<Context>,
        name: &str,
        layout: &Layout,
        opts: &TensorSetOptions,
        b: usize,
    ) -> Result<Option<TensorSetWriter>> {
        let Ok(opened) = segment::open_manifest(name, INIT_WAIT) else {
            return Ok(None);
        };
        let old = opened.manifest;
        if old.kind != KIND_VMM || old.holders_generation == 0 {
            return Ok(None);
        }
        let Ok(control) = Control::open_in(GENERATION_PREFIX, name, false, INIT_WAIT) else {
            return Ok(None);
        };
        let allocs = old.layout.allocations().len();
        let Ok(holders) =
            HoldersSegment::open(name, Some((old.holders_generation, old.buffers, allocs)))
        else {
            return Ok(None);
        };
        let Ok(facts) = holders.memory_facts() else {
            return Ok(None);
        };
        let whole = holders.last_whole();
        let found = Found {
            facts,
            writer_dead: control.producer_liveness() == Liveness::Dead,
            live_holders: holders.live_holders(),
            whole: matches!(whole, Whole::Generation { .. }),
        };
        let asked = MemoryFacts {
            fingerprint: layout.fingerprint(),
            bytes_per_buffer: layout.bytes_per_buffer(),
            buffers: b,
            allocations: layout.allocations().len(),
        };
        if let Decision::Replace(why) = decide(&asked, opts.resume, &found) {
            tracing::info!("tensor set {name}: a new set replaces the old one ({why})");
            return Ok(None);
        }
        let Whole::Generation {
            generation,
            buffer,
            content,
        } = whole
        else {
            return Ok(None);
        };
        let (fds, _) = holders::fetch_all(name, &old, &holders)?;
        let me = ProcessIdentity::current()?;
        let mut rows = Vec::with_capacity(b);
        let mut tokens = Vec::with_capacity(b);
        let mut fds = fds.into_iter();
        for row in &old.tokens {
            let (mut allocs_row, mut toks_row) = (Vec::new(), Vec::new());
            for t in row {
                let mut tok = Token::from_bytes(t)?;
                let fd = fds.next().ok_or_else(|| {
                    Error::InvalidArgument("fewer fds than allocations from the holder".into())
                })?;
                let size = u64::from_le_bytes(tok.handle[8..16].try_into().unwrap_or_default());
                let size = usize::try_from(size)
                    .map_err(|_| Error::InvalidArgument(format!("allocation of {size} bytes")))?;
                let buf = ImportedBuffer::from_vmm_fd(ctx, fd.as_fd(), size)?;
                let export = FdExport::new(fd)?;
                tok.exporter = me;
                tok.export_id = export.id();
                tok.handle[..4].copy_from_slice(&export.raw_fd().to_le_bytes());
                toks_row.push(tok.to_bytes());
                allocs_row.push(Allocation::Resumed {
                    buf,
                    _export: export,
                });
            }
            rows.push(allocs_row);
            tokens.push(toks_row);
        }
        // The new channel replaces the dead writer's name; `control` keeps the old one mapped.
        let mut producer = generation_channel(Some(ctx), name, opts, b)?;
        let base = generation.saturating_sub(1);
        let m = Manifest {
            kind: KIND_VMM,
            flags: if b > 1 { FLAG_BUFFERED } else { 0 },
            buffers: b,
            layout: layout.clone(),
            tokens,
            channel_generation: producer.control_generation(),
            data_generation: 0,
            max_readers: opts.max_readers as u32,
            holders_generation: holders.generation(),
            generation_base: base,
        };
        let manifest = segment::create_manifest(name, &m)?;
        let recorder = match Self::start_recorder(&producer, &m, holders) {
            Ok(r) => r,
            Err(e) => {
                segment::unlink_own(&manifest);
                return Err(e);
            }
        };
        // The first generation: the last whole one, in its own buffer (a fresh channel lends
        // buffers 0, 1, ... in turn; those before it go back unpublished).
        let mut skipped = Vec::new();
        let lent = loop {
            match producer.lend(Some(Duration::ZERO))? {
                Some(l) if l.index() == buffer => break l,
                Some(l) => skipped.push(l),
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "buffer {buffer} of a fresh generation channel of {b} was not free"
                    )));
                }
            }
        };
        drop(skipped);
        let seq = producer
            .resume(lent)?
            .publish(&encode_meta(generation, &content, 0))?;
        tracing::info!("tensor set {name}: resumed at generation {generation} (0 bytes copied)");
        Ok(Some(TensorSetWriter {
            producer: Some(producer),
            recorder: Some(recorder),
            memory: Memory::Gpu(rows),
            manifest,
            layout: Arc::new(m.layout),
            name: name.to_string(),
            state: State {
                generation: base + seq,
                head: Some(buffer),
                base,
            },
            kind: MemoryKind::Vmm,
            mode: opts.mode,
            allocated: 0,
            old: Some(OldReaders {
                control: Some(control),
            }),
            _quota: None,
            fingerprinter: std::sync::OnceLock::new(),
            copier: std::sync::OnceLock::new(),
            closing: false,
            fork: crate::identity::ForkEpoch::now(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::Delivery;
    use crate::channel::testing::{ControlConsumer, ControlProducer, token};

    #[test]
    fn an_old_reader_that_let_go_on_the_host_is_waited_for_until_its_release_word_comes() {
        let name = format!("resume-old-{}", std::process::id());
        let p = ControlProducer::create(&name, 4096, 4, &[token(0).unwrap(), token(1).unwrap()])
            .unwrap();
        let rx = ControlConsumer::attach(&name, Delivery::LatestOnly).unwrap();
        let (i, _) = p.try_acquire().unwrap();
        let seq = p.publish(i, b"g1").unwrap();
        let (got, s, _) = rx.take(Some(Duration::from_secs(1))).unwrap().unwrap();
        assert_eq!((got, s), (i, seq));
        let old = OldReaders {
            control: Some(Control::open(&name).unwrap()),
        };
        assert!(old.held(i), "held on the host");
        rx.release(i);
        assert!(!old.held(i), "the host hold is gone");
        assert!(
            old.gpu_reading(i),
            "its stream has not written the release word yet"
        );
        assert!(!old.gpu_reading(1 - i), "the other buffer was never read");
        rx.set_released(i, seq);
        assert!(
            !old.gpu_reading(i),
            "the release word reached the frame it read"
        );
        drop(rx);
        p.unlink();
    }
}
