//! A control connection after its handshake: a reader thread checking each sealed message
//! ([`wire::Opener`]) and turning it into a queue (and silence over [`LaneOptions::link_timeout`],
//! a closed connection or a message that fails its authentication into an error), a heartbeat
//! thread, and sends, sealed ([`wire::Sealer`]), from the bridge's thread.

use super::wire::{self, Msg, Sealer, Session};
use super::{LaneOptions, RemoteError};
use crate::error::{Error, Result};
use crate::identity::ForkEpoch;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// A live control connection.
pub(super) struct Link {
    /// The connection's writing end and this direction's sealer: one lock, so sequence numbers
    /// go out in the order they were given.
    writer: Arc<Mutex<(TcpStream, Sealer)>>,
    rx: mpsc::Receiver<std::result::Result<Msg, String>>,
    done: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    stream: TcpStream,
    lost: Option<String>,
    /// The process (by fork) that started the threads: a forked child has none to join, and its
    /// copy of the connection is the parent's (`identity::fork`).
    fork: ForkEpoch,
}

fn lost(reason: String) -> Error {
    RemoteError::Link(reason).into()
}

impl Link {
    /// Starts the reader and heartbeat threads on `stream`, whose handshake made `session`.
    pub(super) fn start(stream: TcpStream, session: Session, opts: &LaneOptions) -> Result<Link> {
        let io = |e: std::io::Error| lost(format!("cloning the connection: {e}"));
        let mut reader = stream.try_clone().map_err(io)?;
        let Session { sealer, mut opener } = session;
        let writer = Arc::new(Mutex::new((stream.try_clone().map_err(io)?, sealer)));
        let done = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let silence = opts.link_timeout;
        let d = done.clone();
        let r = std::thread::Builder::new()
            .name("lane-reader".into())
            .spawn(move || {
                loop {
                    match wire::recv_sealed(
                        &mut opener,
                        &mut reader,
                        silence,
                        "a message from the lane's peer",
                    ) {
                        Ok(Msg::Ping) => {}
                        Ok(m) => {
                            if tx.send(Ok(m)).is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            if !d.load(Ordering::Relaxed) {
                                let why = match e {
                                    Error::Timeout { after, .. } => {
                                        format!("the peer was silent for {after:?}")
                                    }
                                    // Said once: `lost` names the control connection again.
                                    Error::Remote(RemoteError::Link(why)) => why,
                                    e => e.to_string(),
                                };
                                let _ = tx.send(Err(why));
                            }
                            return;
                        }
                    }
                }
            })
            .map_err(|e| lost(format!("starting the reader thread: {e}")))?;
        let w = writer.clone();
        let d = done.clone();
        let period = opts.heartbeat;
        let h = std::thread::Builder::new()
            .name("lane-heartbeat".into())
            .spawn(move || {
                while !d.load(Ordering::Relaxed) {
                    let Ok(mut g) = w.lock() else { return };
                    let (s, sealer) = &mut *g;
                    if wire::send_sealed(sealer, s, &Msg::Ping).is_err() {
                        return;
                    }
                    drop(g);
                    std::thread::sleep(period);
                }
            })
            .map_err(|e| lost(format!("starting the heartbeat thread: {e}")))?;
        Ok(Link {
            writer,
            rx,
            done,
            threads: vec![r, h],
            stream,
            lost: None,
            fork: ForkEpoch::now(),
        })
    }

    /// Sends `m`, sealed.
    ///
    /// # Errors
    /// [`RemoteError::Link`] when the connection failed; [`Error::ForkedChild`] in a process
    /// forked from the one that made the link (the connection is the parent's).
    pub(super) fn send(&self, m: &Msg) -> Result<()> {
        self.fork.check("remote lane")?;
        let mut g = self
            .writer
            .lock()
            .map_err(|_| lost("a writer thread panicked".into()))?;
        let (s, sealer) = &mut *g;
        wire::send_sealed(sealer, s, m)
    }

    /// The next message, waiting up to `timeout` (`Duration::ZERO`: only what has arrived);
    /// `Ok(None)` when none came.
    ///
    /// # Errors
    /// [`RemoteError::Link`] once the link was lost (closed, failed, or silent too long).
    pub(super) fn next(&mut self, timeout: Duration) -> Result<Option<Msg>> {
        if let Some(why) = &self.lost {
            return Err(lost(why.clone()));
        }
        let r = if timeout.is_zero() {
            match self.rx.try_recv() {
                Ok(r) => r,
                Err(mpsc::TryRecvError::Empty) => return Ok(None),
                Err(mpsc::TryRecvError::Disconnected) => Err("the reader stopped".into()),
            }
        } else {
            match self.rx.recv_timeout(timeout) {
                Ok(r) => r,
                Err(mpsc::RecvTimeoutError::Timeout) => return Ok(None),
                Err(mpsc::RecvTimeoutError::Disconnected) => Err("the reader stopped".into()),
            }
        };
        match r {
            Ok(m) => Ok(Some(m)),
            Err(why) => {
                self.lost = Some(why.clone());
                Err(lost(why))
            }
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if self.fork.inherited() {
            // Shutting the socket down would end the parent's connection; joining would wait for
            // threads that do not run here.
            std::mem::forget(std::mem::take(&mut self.threads));
            return;
        }
        self.done.store(true, Ordering::Relaxed);
        // Wakes the reader (its read fails) and makes the heartbeat's next write fail.
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
