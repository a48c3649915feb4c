//! Removal of what dead writers left.
