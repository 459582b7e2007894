// Shared by every kernel source. Header-free: NVRTC from the PyPI wheel has
// no CUDA headers, so half and bfloat16 go through PTX conversions and bit
// operations, and the few types are spelled out.
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// f32 to bfloat16, round to nearest even (PTX for sm_80 and later).
__device__ __forceinline__ u16 f2bf(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// A little-endian u16 at any even offset (GGUF blocks of 34 and 210
// bytes leave their halves only 2-byte aligned).
__device__ __forceinline__ u16 ld16(const u8* p) {
    return *(const u16*)p;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Tokens per GEMV launch: each lane keeps one accumulator per token.
#define GEMV_TOKENS 8

// +infinity without <math.h>.
#define UF_INF __int_as_float(0x7f800000)
