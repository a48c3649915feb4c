// Many byte ranges copied by one launch: a tensor set's update from many separate source tensors
// (src/tensorset/writer/copies.rs loads it), where one cuMemcpyDtoDAsync per small range costs
// more in per-copy overhead than the bytes take to move. Compiled to PTX by scripts/build-ptx.sh
// (NVRTC of CUDA 12.0, no toolkit needed); kept apart from kernels.cu so that a process that
// copies JIT-compiles this kernel alone.
//
// The ranges travel in the kernel's parameters (no table in device memory, nothing to keep alive
// after the launch): COPY_RANGES of them at most, under the 4 KiB parameter limit of every driver.
// `__grid_constant__` reads them where they lie instead of a copy per thread.

#define COPY_RANGES 160

struct CopyRanges {
    unsigned long long dst[COPY_RANGES];
    unsigned long long src[COPY_RANGES];
    unsigned long long len[COPY_RANGES];
    unsigned int count;
};

// Range `d`..`d + len` := `s`..`s + len` by the blocks of one grid row, in words of W bytes (both
// addresses are W-aligned), the bytes past the last whole word by the row's first block. The
// library gives a row a block per 4 KiB (one 16-byte word a thread): for ranges of about 1 MiB
// that copies at 0.88 of one cudaMemcpyAsync of the same bytes on an H200, where loading four or
// eight words a thread before storing them did worse (0.82, 0.74); a single large range copies at
// 0.92 either way.
template <typename W>
__device__ __forceinline__ void copy_words(unsigned char* __restrict__ d,
                                           const unsigned char* __restrict__ s,
                                           unsigned long long len) {
    const unsigned long long n = len / sizeof(W);
    W* __restrict__ dw = reinterpret_cast<W*>(d);
    const W* __restrict__ sw = reinterpret_cast<const W*>(s);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += stride) {
        dw[i] = sw[i];
    }
    if (blockIdx.x == 0) {
        for (unsigned long long i = n * sizeof(W) + threadIdx.x; i < len; i += blockDim.x) {
            d[i] = s[i];
        }
    }
}

// Grid row y copies range y (y < count); its blocks stride over the range in the widest words
// (16, 8, 4, 2 or 1 bytes) both its addresses are aligned to. Ranges must not overlap one another's
// destinations, nor a destination its source other than exactly (a copy onto itself).
extern "C" __global__ void copy_ranges(const __grid_constant__ CopyRanges r) {
    unsigned int k = blockIdx.y;
    if (k >= r.count) return;
    unsigned long long dst = r.dst[k], src = r.src[k], len = r.len[k];
    unsigned char* d = reinterpret_cast<unsigned char*>(dst);
    const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
    unsigned long long a = dst | src;
    if ((a & 15) == 0) {
        copy_words<uint4>(d, s, len);
    } else if ((a & 7) == 0) {
        copy_words<unsigned long long>(d, s, len);
    } else if ((a & 3) == 0) {
        copy_words<unsigned int>(d, s, len);
    } else if ((a & 1) == 0) {
        copy_words<unsigned short>(d, s, len);
    } else {
        copy_words<unsigned char>(d, s, len);
    }
}
