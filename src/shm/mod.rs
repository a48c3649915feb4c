//! Named POSIX shared-memory segments, shared futex words. Never calls CUDA.
