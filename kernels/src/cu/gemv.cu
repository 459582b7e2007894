// Decode GEMV straight from GGUF blocks, dequantized in registers:
// y[t * rows + r] (+)= sum_k W[r][k] * x[t * cols + k] for t < tokens
// (at most GEMV_TOKENS per launch). One warp per row; lane j takes weight
// j of every 32-weight piece of the row, so that a warp reads a piece's
// quantized bytes together and 32 consecutive x values (128 bytes) per
// token: every load is coalesced. (Lanes over whole blocks read x 128
// bytes apart, one transaction per lane.) Each weight is dequantized once
// for all the launch's tokens. A warp sum at the end; `acc` != 0 adds to y
// (the residual add fused into the epilogue).

// Q4_1: 20 bytes per 32 weights: half d, half m, 16 bytes of nibbles
// (low nibbles are weights 0..15, high nibbles 16..31); w = d * q + m.
__device__ __forceinline__ void q4_1_block(const u8* b, float* w) {
    float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[4 + j];
        w[j] = d * (float)(q & 15) + m;
        w[j + 16] = d * (float)(q >> 4) + m;
    }
}

// Q8_0: 34 bytes per 32 weights: half d, 32 signed bytes; w = d * q.
__device__ __forceinline__ void q8_0_block(const u8* b, float* w) {
    float d = h2f(ld16(b));
#pragma unroll
    for (int j = 0; j < 32; j++) w[j] = d * (float)(i8)b[2 + j];
}

#define DEQ_Q4_1(b, piece, v) q4_1_block(b, v)
#define DEQ_Q8_0(b, piece, v) q8_0_block(b, v)

// Q4_K: 144 bytes per 256 weights: half d, half dmin, 12 bytes of 6-bit
// scales and mins for 8 sub-blocks of 32, 128 bytes of nibbles (64 weights
// per 32 bytes: low nibbles first, then high).
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, float* sc, float* mn) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *mn = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4));
        *mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

__device__ __forceinline__ void q4_k_piece(const u8* b, int piece, float* w) {
    float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
    float sc, mn;
    scale_min_k4(piece, b + 4, &sc, &mn);
    const u8* q = b + 16 + (piece / 2) * 32;
    int hi = piece & 1;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        int n = hi ? (q[j] >> 4) : (q[j] & 15);
        w[j] = d * sc * (float)n - dmin * mn;
    }
}

// Q6_K: 210 bytes per 256 weights: 128 bytes of low nibbles, 64 bytes of
// high 2-bit pairs, 16 signed 8-bit scales (one per 16 weights), half d.
__device__ __forceinline__ void q6_k_piece(const u8* b, int piece, float* w) {
    const u8* ql = b + (piece / 4) * 64;
    const u8* qh = b + 128 + (piece / 4) * 32;
    const i8* sc = (const i8*)(b + 192) + (piece / 4) * 8;
    float d = h2f(ld16(b + 208));
    int quarter = piece & 3;
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int low = (quarter & 1) ? ql[l + 32] : ql[l];
        low = (quarter & 2) ? (low >> 4) : (low & 15);
        int high = (qh[l] >> (2 * quarter)) & 3;
        int q = (low | (high << 4)) - 32;
        w[l] = d * (float)sc[l / 16 + 2 * quarter] * (float)q;
    }
}

// Weight `j` (a lane) of 32-weight piece `piece` of a block, per format.
__device__ __forceinline__ float q4_1_at(const u8* b, int piece, int j) {
    u8 q = b[4 + (j & 15)];
    return h2f(ld16(b)) * (float)(j < 16 ? q & 15 : q >> 4) + h2f(ld16(b + 2));
}

__device__ __forceinline__ float q8_0_at(const u8* b, int piece, int j) {
    return h2f(ld16(b)) * (float)(i8)b[2 + j];
}

__device__ __forceinline__ float q4_k_at(const u8* b, int piece, int j) {
    float sc, mn;
    scale_min_k4(piece, b + 4, &sc, &mn);
    u8 q = b[16 + (piece / 2) * 32 + j];
    int n = (piece & 1) ? (q >> 4) : (q & 15);
    return h2f(ld16(b)) * sc * (float)n - h2f(ld16(b + 2)) * mn;
}

__device__ __forceinline__ float q6_k_at(const u8* b, int piece, int j) {
    int quarter = piece & 3;
    const u8* ql = b + (piece / 4) * 64;
    int low = (quarter & 1) ? ql[j + 32] : ql[j];
    low = (quarter & 2) ? (low >> 4) : (low & 15);
    int high = (b[128 + (piece / 4) * 32 + j] >> (2 * quarter)) & 3;
    int q = (low | (high << 4)) - 32;
    const i8* sc = (const i8*)(b + 192) + (piece / 4) * 8;
    return h2f(ld16(b + 208)) * (float)sc[j / 16 + 2 * quarter] * (float)q;
}

// The loop every format shares: the warp walks the row's blocks, lane j
// taking weight j of each 32-weight piece (`AT` dequantizes it).
#define GEMV_BODY(BYTES, PER, AT)                                                   \
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                   \
    int lane = threadIdx.x & 31;                                                    \
    if (row >= rows) return;                                                        \
    int nb = cols / (PER);                                                          \
    const u8* wr = w + (size_t)row * nb * (BYTES);                                  \
    float s[GEMV_TOKENS];                                                           \
    _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) s[t] = 0.f;             \
    _Pragma("unroll 4") for (int b = 0; b < nb; b++) {                              \
        const u8* blk = wr + (size_t)b * (BYTES);                                   \
        _Pragma("unroll") for (int piece = 0; piece < (PER) / 32; piece++) {        \
            float v = AT(blk, piece, lane);                                         \
            const float* xk = x + (size_t)b * (PER) + piece * 32 + lane;            \
            _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) {               \
                if (t < tokens) s[t] += v * xk[(size_t)t * cols];                   \
            }                                                                       \
        }                                                                           \
    }                                                                               \
    _Pragma("unroll") for (int t = 0; t < GEMV_TOKENS; t++) {                       \
        if (t < tokens) {                                                           \
            float r = warp_sum(s[t]);                                               \
            if (lane == 0) {                                                        \
                float* o = y + (size_t)t * rows + row;                              \
                *o = acc ? *o + r : r;                                              \
            }                                                                       \
        }                                                                           \
    }

extern "C" __global__ void gemv_q4_1(const u8* w, const float* x, float* y, int rows, int cols,
                                     int tokens, int acc) {
    GEMV_BODY(20, 32, q4_1_at)
}

extern "C" __global__ void gemv_q8_0(const u8* w, const float* x, float* y, int rows, int cols,
                                     int tokens, int acc) {
    GEMV_BODY(34, 32, q8_0_at)
}

extern "C" __global__ void gemv_q4_k(const u8* w, const float* x, float* y, int rows, int cols,
                                     int tokens, int acc) {
    GEMV_BODY(144, 256, q4_k_at)
}

extern "C" __global__ void gemv_q6_k(const u8* w, const float* x, float* y, int rows, int cols,
                                     int tokens, int acc) {
    GEMV_BODY(210, 256, q6_k_at)
}

// Prefill weights for cuBLAS: each GGUF block dequantized once, at load,
// into a row-major bfloat16 matrix. One thread per 32 weights.
#define DEQUANT_BODY(BYTES, PER, DEQ)                                               \
    size_t p = (size_t)blockIdx.x * blockDim.x + threadIdx.x;                       \
    int pieces = cols / 32;                                                         \
    if (p >= (size_t)rows * pieces) return;                                         \
    int row = (int)(p / pieces), k0 = (int)(p % pieces) * 32;                       \
    float v[32];                                                                    \
    DEQ(w + ((size_t)row * (cols / (PER)) + k0 / (PER)) * (BYTES), (k0 % (PER)) / 32, v); \
    u16* o = out + (size_t)row * cols + k0;                                         \
    _Pragma("unroll") for (int j = 0; j < 32; j++) o[j] = f2bf(v[j]);

extern "C" __global__ void dequant_q4_1(const u8* w, u16* out, int rows, int cols) {
    DEQUANT_BODY(20, 32, DEQ_Q4_1)
}

extern "C" __global__ void dequant_q8_0(const u8* w, u16* out, int rows, int cols) {
    DEQUANT_BODY(34, 32, DEQ_Q8_0)
}

extern "C" __global__ void dequant_q4_k(const u8* w, u16* out, int rows, int cols) {
    DEQUANT_BODY(144, 256, q4_k_piece)
}

extern "C" __global__ void dequant_q6_k(const u8* w, u16* out, int rows, int cols) {
    DEQUANT_BODY(210, 256, q6_k_piece)
}

// A prompt's activations as bfloat16, for the cuBLAS GEMM.
extern "C" __global__ void to_bf16(const float* x, u16* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2bf(x[i]);
}
