//! Internals for tools, tests and fuzzing: named shared-memory segments, the shared futex and
//! the seqlock (`raw::shm`), the registry's byte layout (`raw::registry_layout`), the test points
//! of the registry and of a quota reservation (`raw::registry_test_hooks`,
//! `raw::quota_test_hooks`), the liveness helpers of tests that kill their own children
//! (`raw::identity`), the GPU kernels the examples and tests check frames with
//! (`raw::kernels`), and the channel's byte layout and its protocol driven without a GPU
//! (`raw::channel::layout`, `raw::channel::testing`), and a tensor set's holders segment made
//! without a GPU (`raw::tensorset::testing`).
//!
//! They are what the crate itself is built on, and they follow the layouts documented in
//! docs/registry-layout.md and docs/channel-layout.md, but they are not part of the API the crate
//! keeps stable: their signatures may change in any release. A program that shares buffers uses
//! [`crate::channel`], [`crate::registry`], [`crate::ipc`] and [`crate::driver`] instead; the
//! errors the primitives report reach users as [`crate::Error::Shm`] ([`crate::ShmError`]).

/// Named POSIX segments, shared futex words and the seqlock (the crate's `shm` layer).
pub mod shm {
    pub use crate::shm::{
        MAX_SEGMENT_NAME, SHM_DIR, SIZING_LOCK_OFFSET, Segment, SegmentInfo, SegmentOptions,
        SeqLock, SeqWriter, ShmError, WaitResult, list_segments, new_generation, validate_name,
    };

    /// Shared `FUTEX_WAIT`/`FUTEX_WAKE` with timeouts.
    pub mod futex {
        pub use crate::shm::futex::*;
    }

    /// A seqlock over atomic payload words.
    pub mod seqlock {
        pub use crate::shm::seqlock::*;
    }
}

/// The registry's byte layout: offsets, sizes and constants (docs/registry-layout.md).
pub mod registry_layout {
    pub use crate::registry::layout::*;
}

/// Points inside the registry's write and repair paths where a test can stop or kill a process.
pub mod registry_test_hooks {
    pub use crate::registry::slot::{TestPoint, set_test_hook};
}

/// Points inside a quota reservation where a test can stop or kill a process.
pub mod quota_test_hooks {
    pub use crate::quota::ledger::{QuotaTestPoint, set_test_hook};
}

/// This process's liveness lock and other processes' liveness files, for tests that kill their own
/// children (docs/ARCHITECTURE.md, "Identity and liveness").
pub mod identity {
    pub use crate::identity::files::remove_liveness_file_if_free;
    pub use crate::identity::lock::liveness_lock_fd;
}

/// PTX kernels (fill, check, spin, time stamps) that the examples, tests and benchmarks use to
/// write and verify frames on the GPU.
pub mod kernels {
    pub use crate::kernels::*;
}

/// The channel's control segment without a GPU: its byte layout (docs/channel-layout.md) and its
/// protocol driven from the control segment alone, for tests of tools and fuzzing.
pub mod channel {
    /// The channel's byte layout: offsets, sizes, codes and constants (docs/channel-layout.md).
    pub mod layout {
        pub use crate::channel::layout::*;
    }

    /// Protocol-only access to a channel's control segment, without a GPU (tokens stored as given
    /// and never opened).
    pub mod testing {
        pub use crate::channel::testing::*;
    }
}

/// A VMM tensor set's holders segment and manifest without a GPU, and slots claimed in it for any
/// process, for tests of tools, of other users' access and of hostile segments.
pub mod tensorset {
    /// The holders segment made and claimed from the CPU alone.
    pub mod testing {
        pub use crate::tensorset::holders::testing::*;
    }
}
