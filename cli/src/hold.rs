//! `hold`: keep a VMM tensor set attachable after its writer dies, with no other work (a sidecar
//! container, a systemd unit): a [`Holder`] serves the set's file descriptors until SIGINT or
//! SIGTERM, or until the set is closed by its writer or replaced.
//!
//! SIGINT and SIGTERM set flags (`signal_hook::flag`) that the loop reads every 100 ms between
//! looks at the set; the holder then drops (its slot freed, its fds closed) and `hold` exits 0.

use crate::Outcome;
use cuda_ipc::tensorset::{Holder, HolderStatus};
use signal_hook::consts::{SIGINT, SIGTERM};
use std::error::Error;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// `cuda-ipc hold NAME`.
pub fn run(name: &str) -> Result<Outcome, Box<dyn Error>> {
    let stops = [(SIGINT, "SIGINT"), (SIGTERM, "SIGTERM")].map(|(sig, word)| {
        let flag = Arc::new(AtomicBool::new(false));
        (
            signal_hook::flag::register(sig, flag.clone()).map(|_| flag),
            word,
        )
    });
    let mut flags = Vec::new();
    for (f, word) in stops {
        flags.push((f?, word));
    }
    let h = Holder::open(name)?;
    out!(
        "holding tensorset {name}: {} allocations, {} pinned, served by pid {} (fetched from pid {})",
        h.allocations(),
        crate::text::bytes(h.bytes()),
        std::process::id(),
        h.source().pid,
    );
    loop {
        // Relaxed: a flag alone, no data published with it.
        if let Some((_, sig)) = flags.iter().find(|(f, _)| f.load(Ordering::Relaxed)) {
            drop(h);
            out!("stopped by {sig}: tensorset {name} is no longer held here");
            return Ok(Outcome::Ok);
        }
        let s = h.status();
        if s != HolderStatus::Serving {
            drop(h);
            out!("tensorset {name} was {}: let go", s.word());
            return Ok(Outcome::Ok);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
