// The library's content fingerprint of tensors (src/tensorset/content.rs loads it; it has the host
// twin, which must agree bit for bit). Compiled to PTX by scripts/build-ptx.sh (NVRTC of CUDA
// 12.0, no toolkit needed); kept apart from kernels.cu so that a process that
// fingerprints JIT-compiles this kernel alone.
//
// A tensor of `bytes` bytes is read as 16-byte words w_i = (lo_i, hi_i) (little
// endian; the last word zero-padded); its fingerprint is the pair of sums mod 2^64
//   (sum_i lane0(lo_i, hi_i, i), sum_i lane1(lo_i, hi_i, i))
// which the host finishes with the byte length. Sums commute, so neither the grid's size nor the
// order of the atomics changes the result. Blocks are one-dimensional and a multiple of 32 threads
// (the warp reduction takes every lane; the library launches 256). It detects changed or wrong
// content, not a forgery.
__device__ __forceinline__ unsigned long long fp_fmix64(unsigned long long k) {
    k ^= k >> 33;
    k *= 0xFF51AFD7ED558CCDull;
    k ^= k >> 33;
    k *= 0xC4CEB9FE1A85EC53ull;
    k ^= k >> 33;
    return k;
}

__device__ __forceinline__ unsigned long long fp_rotl(unsigned long long x, int r) {
    return (x << r) | (x >> (64 - r));
}

__device__ __forceinline__ void fp_word(unsigned long long lo, unsigned long long hi, unsigned long long i,
                                        unsigned long long* s0, unsigned long long* s1) {
    unsigned long long a = lo * 0x9E3779B97F4A7C15ull + i;
    unsigned long long b = hi * 0xC2B2AE3D27D4EB4Full + fp_rotl(i, 32);
    *s0 += fp_fmix64(a ^ fp_rotl(b, 29));
    *s1 += fp_fmix64(b + fp_rotl(a, 41) + 0x165667B19E3779F9ull);
}

// items: n_items records of four u64 (address of the item's first byte, index of its first word
// in its tensor, its byte count, its tensor's index); an item starts at a word boundary of its
// tensor and only a tensor's last item may end inside a word. out: two u64 per tensor, zeroed
// before the launch; each block adds its items' sums there.
extern "C" __global__ void fingerprint_items(const unsigned long long* items, unsigned long long n_items,
                                             unsigned long long* out) {
    for (unsigned long long it = blockIdx.x; it < n_items; it += gridDim.x) {
        const unsigned char* p = (const unsigned char*)items[4 * it];
        unsigned long long first = items[4 * it + 1];
        unsigned long long bytes = items[4 * it + 2];
        unsigned long long t = items[4 * it + 3];
        unsigned long long full = bytes / 16;
        unsigned long long s0 = 0, s1 = 0;
        if (((unsigned long long)p & 15) == 0) {
            const ulonglong2* q = (const ulonglong2*)p;
            for (unsigned long long w = threadIdx.x; w < full; w += blockDim.x) {
                ulonglong2 v = q[w];
                fp_word(v.x, v.y, first + w, &s0, &s1);
            }
        } else {
            for (unsigned long long w = threadIdx.x; w < full; w += blockDim.x) {
                unsigned long long lo = 0, hi = 0;
                for (int k = 0; k < 8; k++) {
                    lo |= (unsigned long long)p[16 * w + k] << (8 * k);
                    hi |= (unsigned long long)p[16 * w + 8 + k] << (8 * k);
                }
                fp_word(lo, hi, first + w, &s0, &s1);
            }
        }
        unsigned long long rem = bytes - 16 * full;
        if (rem != 0 && threadIdx.x == 0) {
            unsigned long long lo = 0, hi = 0;
            for (unsigned long long k = 0; k < rem; k++) {
                unsigned long long b = p[16 * full + k];
                if (k < 8) {
                    lo |= b << (8 * k);
                } else {
                    hi |= b << (8 * (k - 8));
                }
            }
            fp_word(lo, hi, first + full, &s0, &s1);
        }
        for (int o = 16; o > 0; o >>= 1) {
            s0 += __shfl_down_sync(0xFFFFFFFFu, s0, o);
            s1 += __shfl_down_sync(0xFFFFFFFFu, s1, o);
        }
        if ((threadIdx.x & 31) == 0) {
            atomicAdd(&out[2 * t], s0);
            atomicAdd(&out[2 * t + 1], s1);
        }
    }
}
