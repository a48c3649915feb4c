//! What a holders segment's slot says of its server: its role ([`HolderRole`], stored as a code
//! in the slot's role word) and the snapshot tools read ([`HolderSnapshot`]).

use crate::identity::{Liveness, ProcessIdentity};

/// What a slot's server is to the set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(rename_all = "lowercase")
)]
#[non_exhaustive]
pub enum HolderRole {
    /// The set's writer (its own exports).
    Writer,
    /// A reader that opened with [`crate::tensorset::ReaderOptions::serve`].
    Reader,
    /// A [`Holder`](crate::tensorset::Holder) (e.g. `cuda-ipc hold`).
    Holder,
    /// A reader opened after the writer's death: serves nothing, records the buffer its guards
    /// hold (a resumed writer does not write it meanwhile).
    WriterlessReader,
}

impl HolderRole {
    pub(super) fn code(self) -> u32 {
        match self {
            HolderRole::Writer => 1,
            HolderRole::Reader => 2,
            HolderRole::Holder => 3,
            HolderRole::WriterlessReader => 4,
        }
    }
    pub(super) fn from_code(c: u32) -> Option<HolderRole> {
        match c {
            1 => Some(HolderRole::Writer),
            2 => Some(HolderRole::Reader),
            3 => Some(HolderRole::Holder),
            4 => Some(HolderRole::WriterlessReader),
            _ => None,
        }
    }
    /// In words: `writer`, `reader`, `holder`, `writerless-reader`.
    pub fn word(self) -> &'static str {
        match self {
            HolderRole::Writer => "writer",
            HolderRole::Reader => "reader",
            HolderRole::Holder => "holder",
            HolderRole::WriterlessReader => "writerless-reader",
        }
    }

    /// Whether a process in this role serves the set's fds (all but a writerless reader).
    pub fn serves(self) -> bool {
        self != HolderRole::WriterlessReader
    }
}

/// One serving slot of a set's holders segment, as read.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct HolderSnapshot {
    /// Its slot.
    pub slot: usize,
    /// What it is to the set.
    pub role: HolderRole,
    /// Its process.
    #[cfg_attr(
        feature = "serde",
        serde(serialize_with = "crate::identity::snapshot_json::identity")
    )]
    pub identity: ProcessIdentity,
    /// Its effective uid.
    pub uid: u32,
    /// Whether it runs.
    pub liveness: Liveness,
    /// Unix milliseconds since it serves.
    pub since_ms: u64,
}
