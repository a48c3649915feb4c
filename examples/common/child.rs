//! Child processes: this binary re-executed in another role (CUDA does not survive `fork()`), its
//! stdout read line by line on a thread, every wait on it bounded.

use super::Res;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// A child this process started. Dropping it kills the child if it still runs, so an early error
/// of the parent leaves no child behind.
pub struct Child {
    /// Its short name: the prefix of the line [`Child::finish`] adds when it had to kill it.
    name: String,
    /// How error messages call it.
    called: String,
    child: std::process::Child,
    lines: Receiver<String>,
}

impl Child {
    /// Starts this binary (`std::env::current_exe`) with `args`, stdout piped to a reader thread.
    /// Errors when the executable cannot be found or started.
    pub fn spawn(name: &str, args: &[&str]) -> Res<Child> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(args)
            .env(super::CHILD_ENV, "1")
            .stdout(Stdio::piped())
            .spawn()?;
        let out = child.stdout.take().ok_or("no stdout")?;
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(Child {
            name: name.to_string(),
            called: name.to_string(),
            child,
            lines,
        })
    }

    /// Names the child `called` in the errors of [`Child::line`] (its name by default).
    pub fn called(mut self, called: &str) -> Child {
        self.called = called.to_string();
        self
    }

    /// Its short name, as given to [`Child::spawn`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The next line the child prints, waiting at most `timeout`; the channel's own error when
    /// none came in time or the child's stdout closed.
    pub fn recv(&self, timeout: Duration) -> Result<String, RecvTimeoutError> {
        self.lines.recv_timeout(timeout)
    }

    /// The next line the child prints, waiting at most `timeout`. Errors, naming the child, when
    /// none came in time or it exited first.
    pub fn line(&self, timeout: Duration) -> Res<String> {
        self.recv(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => {
                format!("{} printed nothing within {timeout:?}", self.called).into()
            }
            RecvTimeoutError::Disconnected => {
                format!("{} exited early (its error is above)", self.called).into()
            }
        })
    }

    /// Whether the child has already exited (or cannot be asked).
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)) | Err(_))
    }

    /// Waits up to `timeout` for the child to exit (then kills it); returns whether it exited
    /// successfully and the lines it printed since the last [`Child::line`]. Errors when it cannot
    /// be waited for or killed.
    pub fn finish(&mut self, timeout: Duration) -> Res<(bool, Vec<String>)> {
        self.finish_by(Instant::now() + timeout, timeout)
    }

    /// [`Child::finish`] until `deadline`, the end of a `limit` that several children share (named
    /// in the line added when the child is killed, `"{name}: FAIL did not exit within {limit:?};
    /// killed"`).
    pub fn finish_by(&mut self, deadline: Instant, limit: Duration) -> Res<(bool, Vec<String>)> {
        let mut rest = Vec::new();
        let ok = loop {
            if let Some(st) = self.child.try_wait()? {
                break st.success();
            }
            if Instant::now() >= deadline {
                self.child.kill()?;
                self.child.wait()?;
                rest.push(format!(
                    "{}: FAIL did not exit within {limit:?}; killed",
                    self.name
                ));
                break false;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        rest.extend(self.rest());
        Ok((ok, rest))
    }

    /// Waits, with no bound, for the child to exit; returns whether it exited successfully and the
    /// lines it printed since the last [`Child::line`]. Errors when it cannot be waited for.
    pub fn wait(&mut self) -> Res<(bool, Vec<String>)> {
        let ok = self.child.wait()?.success();
        Ok((ok, self.rest()))
    }

    /// The lines left once the child exited: its stdout reaches end of file, so the reader ends.
    fn rest(&self) -> Vec<String> {
        let mut rest = Vec::new();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(5)) {
            rest.push(l);
        }
        rest
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
