//! A GPU channel's pool: [`ChannelBuffer`] (legacy, VMM or memory-pool memory, exported), how a
//! producer allocates its buffers (`allocate_pool`) and which kind [`MemoryKind::Auto`] picks
//! (`auto_kind`).
//!
//! [`MemoryKind::Auto`]: super::MemoryKind::Auto

use super::{ChannelOptions, MemoryKind};
use crate::driver::{Context, DeviceBuffer, DeviceMemory, Stream};
use crate::error::Result;
use crate::ipc::{MemPool, PoolBuffer, VmmBuffer};
use crate::token::{TOKEN_LEN, Token};
use std::sync::Arc;

/// One buffer of a producer's pool: legacy, VMM or memory-pool memory. Use it through
/// [`DeviceMemory`].
#[derive(Debug)]
#[non_exhaustive]
pub enum ChannelBuffer {
    /// A `cuMemAlloc` buffer.
    Legacy(DeviceBuffer),
    /// A `cuMemCreate` buffer.
    Vmm(VmmBuffer),
    /// An allocation from the producer's exportable [`MemPool`].
    Pool(PoolBuffer),
}

impl ChannelBuffer {
    fn new(
        ctx: &Arc<Context>,
        kind: MemoryKind,
        len: usize,
        pool: Option<&(MemPool, Stream)>,
    ) -> Result<ChannelBuffer> {
        Ok(match (kind, pool) {
            (MemoryKind::Vmm, _) => ChannelBuffer::Vmm(VmmBuffer::new(ctx, len)?),
            (MemoryKind::Pool, Some((p, s))) => ChannelBuffer::Pool(p.alloc(len, s)?),
            _ => ChannelBuffer::Legacy(DeviceBuffer::new(ctx, len)?),
        })
    }
    fn export(&self) -> Result<Token> {
        match self {
            ChannelBuffer::Legacy(b) => b.export(),
            ChannelBuffer::Vmm(b) => b.export(),
            ChannelBuffer::Pool(b) => b.export(),
        }
    }
    /// The kind of memory.
    pub fn kind(&self) -> MemoryKind {
        match self {
            ChannelBuffer::Legacy(_) => MemoryKind::Legacy,
            ChannelBuffer::Vmm(_) => MemoryKind::Vmm,
            ChannelBuffer::Pool(_) => MemoryKind::Pool,
        }
    }
}

impl DeviceMemory for ChannelBuffer {
    fn device_ptr(&self) -> u64 {
        match self {
            ChannelBuffer::Legacy(b) => b.device_ptr(),
            ChannelBuffer::Vmm(b) => b.device_ptr(),
            ChannelBuffer::Pool(b) => b.device_ptr(),
        }
    }
    fn len(&self) -> usize {
        match self {
            ChannelBuffer::Legacy(b) => b.len(),
            ChannelBuffer::Vmm(b) => b.len(),
            ChannelBuffer::Pool(b) => b.len(),
        }
    }
    fn context(&self) -> &Arc<Context> {
        match self {
            ChannelBuffer::Legacy(b) => b.context(),
            ChannelBuffer::Vmm(b) => b.context(),
            ChannelBuffer::Pool(b) => b.context(),
        }
    }
}

/// The buffers and their exported tokens of a GPU pool of `kind`, each buffer its own allocation
/// (a legacy handle exposes the whole allocation it names). Whatever was made is freed again on
/// failure.
pub(crate) fn allocate_pool(
    ctx: &Arc<Context>,
    kind: MemoryKind,
    opts: &ChannelOptions,
) -> Result<(MemoryKind, Vec<ChannelBuffer>, Vec<[u8; TOKEN_LEN]>)> {
    let pool = match kind {
        MemoryKind::Pool => Some((MemPool::exportable(ctx)?, Stream::new(ctx)?)),
        _ => None,
    };
    let mut buffers = Vec::with_capacity(opts.buffers);
    let mut tokens = Vec::with_capacity(opts.buffers);
    for _ in 0..opts.buffers {
        let b = ChannelBuffer::new(ctx, kind, opts.buffer_bytes, pool.as_ref())?;
        tokens.push(b.export()?.to_bytes());
        buffers.push(b);
    }
    Ok((kind, buffers, tokens))
}

/// What [`MemoryKind::Auto`] tries first for a GPU pool.
///
/// VMM memory wherever the device can export it as a file descriptor and the consumers are of
/// the producer's own user: its imports work between any two processes of the user, whatever
/// their pid namespaces. Legacy IPC handles cannot be opened by a process whose pid equals the
/// exporter's (the driver takes it for the exporter itself and answers
/// `CUDA_ERROR_INVALID_CONTEXT`; measured on an H200, docs/gpu-verification.md), which is what two
/// containers whose main processes are both pid 1 are. Legacy memory where consumers of other
/// users must attach ([`ChannelOptions::group_access`]: VMM descriptors are served to the same
/// user alone) or the device has no fd-exportable VMM.
pub(crate) fn auto_kind(ctx: &Arc<Context>, opts: &ChannelOptions) -> MemoryKind {
    if opts.group_access {
        return MemoryKind::Legacy;
    }
    match ctx.device().capabilities() {
        Ok(c) if c.vmm && c.posix_fd_handles => MemoryKind::Vmm,
        _ => MemoryKind::Legacy,
    }
}
