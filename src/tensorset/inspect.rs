//! Read-only snapshots of tensor sets, for tools.
