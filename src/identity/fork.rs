//! Objects a forked child inherits: which process (by `fork`) made each one.
//!
//! `fork()` copies every object of the parent into the child: a producer, a consumer, a tensor
//! set's writer or reader, their holds and frames, registries, quota reservations, fd servers,
//! driver objects. Each stands for something the *parent* holds in shared memory (a consumer slot,
//! a hold bit, a segment's name, reserved bytes) or in its CUDA context, which the child does not
//! have (CUDA does not survive `fork`). A child that used them, or dropped them (at its normal
//! exit, or when Python collects them), would act for its parent: detach the parent's consumer,
//! release its holds, unlink its live channel or set, give back its reservation.
//!
//! So every such object records its [`ForkEpoch`] when it is made, and:
//! - its `Drop` does nothing shared in a forked child ([`ForkEpoch::inherited`]): the child's copy
//!   is forgotten, the parent's object goes on as before (its memory mappings and file
//!   descriptors end with the child, which touches nothing of the parent's);
//! - its operations refuse in a forked child with [`crate::Error::ForkedChild`]
//!   ([`ForkEpoch::check`]): the child makes its own objects (open the channel or set again).
//!
//! A process counts the forks that made it in [`FORKS`], incremented by a `pthread_atfork`
//! child handler: an object made in this process holds the count it was made at, so one made
//! in the parent (an older count) is told from one the child made itself. The check is one
//! relaxed atomic load, no system call.

use std::sync::atomic::{AtomicU64, Ordering};

/// How many `fork()`s lie between the first process that used this crate and this one (0 in it).
/// Incremented only by [`count_fork`] in a child, which runs before any other code of the child;
/// read with `Relaxed`: the value is this process's own, written before any thread of it exists.
static FORKS: AtomicU64 = AtomicU64::new(0);

/// In a child made by `fork()`: one more fork (one atomic add, async-signal-safe).
extern "C" fn count_fork() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Registers [`count_fork`] once per process, before the first [`ForkEpoch`] is taken (so every
/// object is made after it and any later fork counts).
fn count_forks() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        // SAFETY: `count_fork` is an `extern "C"` function without arguments that only adds to
        // an atomic (async-signal-safe); registering it has no other precondition.
        unsafe { libc::pthread_atfork(None, None, Some(count_fork)) };
    });
}

/// The process (by `fork`) that made an object: taken when the object is made
/// ([`ForkEpoch::now`]), it tells a forked child's copy ([`ForkEpoch::inherited`]) from an object
/// the child made itself. The crate's own objects keep one each; bindings keep one beside their
/// locks, to refuse a forked child's call before taking a lock a thread of the parent may have
/// held at the fork (that thread does not run in the child).
///
/// ```
/// use cuda_ipc::identity::ForkEpoch;
/// let made = ForkEpoch::now();
/// assert!(!made.inherited()); // this process made it
/// assert!(made.check("thing").is_ok());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForkEpoch(u64);

impl ForkEpoch {
    /// This process, for an object made now (one relaxed atomic load; the first call registers
    /// the `pthread_atfork` handler that counts forks).
    pub fn now() -> ForkEpoch {
        count_forks();
        ForkEpoch(FORKS.load(Ordering::Relaxed))
    }

    /// Whether the object was made by a process this one was forked from: then its `Drop` must
    /// do nothing shared (no detach, release, unlink, join of a thread the child does not have,
    /// nor any CUDA call) and its operations refuse ([`ForkEpoch::check`]).
    pub fn inherited(self) -> bool {
        FORKS.load(Ordering::Relaxed) != self.0
    }

    /// `Ok` in the process that made the object.
    ///
    /// # Errors
    /// [`crate::Error::ForkedChild`] naming `what` (`"channel consumer"`) in a process forked
    /// from the one that made it.
    pub fn check(self, what: &'static str) -> crate::Result<()> {
        if self.inherited() {
            return Err(crate::Error::ForkedChild { what });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An origin taken before a fork is inherited in the child and not in the parent; one taken
    /// in the child is the child's own.
    #[test]
    fn a_forked_child_tells_its_parents_objects_from_its_own() {
        let parent = ForkEpoch::now();
        assert!(!parent.inherited());
        assert!(parent.check("thing").is_ok());
        // SAFETY: the child calls only async-signal-safe code (atomics, `_exit`) before it ends.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let own = ForkEpoch::now();
            let code = if parent.inherited()
                && !own.inherited()
                && matches!(
                    parent.check("thing"),
                    Err(crate::Error::ForkedChild { what: "thing" })
                ) {
                0
            } else {
                1
            };
            // SAFETY: ends the forked child at once, running no destructors or handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child made above; `status` is a valid out pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(r, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert!(!parent.inherited(), "the parent's count is its own");
    }
}
