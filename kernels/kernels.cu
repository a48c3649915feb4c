// Kernels used by cuda-ipc's tests, examples and benchmarks. Compiled to PTX (compute_75, PTX ISA
// 8.0, which any CUDA 12 or newer driver loads) by scripts/build-ptx.sh with NVRTC of CUDA 12.0
// from NVIDIA's wheel (no toolkit needed; .ci/run checks the PTX against this file that way); the
// PTX is checked in and loaded with cuModuleLoadData, so the driver JIT-compiles it for whatever
// GPU it runs on.
//
// The pattern: element i of a buffer tagged `seed` holds pattern(seed, i). Producers fill, consumers
// check, and any element that does not match is counted, so a read that raced a write shows up.

__device__ __forceinline__ unsigned int pattern(unsigned int seed, unsigned long long i) {
    unsigned int x = seed * 2654435761u ^ (unsigned int)i ^ (unsigned int)(i >> 32) * 0x9E3779B9u;
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    return x + (unsigned int)i;
}

// p[i] = pattern(seed, i) for i < n (n in 32-bit words).
extern "C" __global__ void fill_pattern(unsigned int* p, unsigned long long n, unsigned int seed) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        p[i] = pattern(seed, i);
    }
}

// Adds to *mismatches the number of i < n with p[i] != pattern(seed, i).
extern "C" __global__ void check_pattern(const unsigned int* p, unsigned long long n, unsigned int seed,
                                         unsigned long long* mismatches) {
    unsigned long long bad = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        bad += (p[i] != pattern(seed, i));
    }
    if (bad) atomicAdd(mismatches, bad);
}

// dst[i] = src[i] ^ key: a transform stage (in place when dst == src).
extern "C" __global__ void xor_u32(const unsigned int* src, unsigned int* dst, unsigned long long n,
                                   unsigned int key) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] = src[i] ^ key;
    }
}

// Adds to *mismatches the number of i < n with p[i] != (pattern(seed, i) ^ key).
extern "C" __global__ void check_pattern_xor(const unsigned int* p, unsigned long long n, unsigned int seed,
                                             unsigned int key, unsigned long long* mismatches) {
    unsigned long long bad = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        bad += (p[i] != (pattern(seed, i) ^ key));
    }
    if (bad) atomicAdd(mismatches, bad);
}

// Busy-waits for `ns` nanoseconds of GPU time (one thread), to keep a stream busy so that work
// queued after it is still in flight when another process looks.
extern "C" __global__ void spin_ns(unsigned long long ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

// Writes the GPU's %globaltimer (ns) to *out: marks when a kernel started, for latency measurements.
extern "C" __global__ void stamp_globaltimer(unsigned long long* out) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *out = now;
}

// Sums p[0..n) as 64-bit into *sum (for the dataset example: each simulation reads the whole set).
extern "C" __global__ void sum_u32(const unsigned int* p, unsigned long long n, unsigned long long* sum) {
    unsigned long long s = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        s += p[i];
    }
    atomicAdd(sum, s);
}

// Normalises u8 RGBA pixels into f32 planes: out[c * npix + i] = in[4 * i + c] / 255 (c < 3), the
// preprocessing stage of the preprocessing -> inference example.
extern "C" __global__ void rgba_to_planar_f32(const unsigned char* in, float* out, unsigned long long npix) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < npix;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = in[4 * i] * (1.0f / 255.0f);
        out[npix + i] = in[4 * i + 1] * (1.0f / 255.0f);
        out[2 * npix + i] = in[4 * i + 2] * (1.0f / 255.0f);
    }
}
