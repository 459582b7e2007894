// On-device candidates for sampling: the host keeps the seeded generator,
// so only these leave the GPU. One block per row of `vocab` logits.

// Block-wide (value, index) maximum; ties go to the smaller index.
__device__ __forceinline__ void better(float* v, int* i, float ov, int oi) {
    if (ov > *v || (ov == *v && oi < *i)) {
        *v = ov;
        *i = oi;
    }
}

__device__ void block_best(float* v, int* i) {
    __shared__ float sv[32];
    __shared__ int si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, *v, o);
        int oi = __shfl_xor_sync(0xffffffffu, *i, o);
        better(v, i, ov, oi);
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) {
        sv[warp] = *v;
        si[warp] = *i;
    }
    __syncthreads();
    if (warp == 0) {
        *v = lane < blockDim.x / 32 ? sv[lane] : -UF_INF;
        *i = lane < blockDim.x / 32 ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, *v, o);
            int oi = __shfl_xor_sync(0xffffffffu, *i, o);
            better(v, i, ov, oi);
        }
        if (lane == 0) {
            sv[0] = *v;
            si[0] = *i;
        }
    }
    __syncthreads();
    *v = sv[0];
    *i = si[0];
}

// The k largest logits of each row, largest first (ties: smaller index
// first), k passes each taking the best below the previous one in that
// order. k = 1 is argmax. NaN never wins; slots past the row's last
// non-NaN logit get index -1. Indices and values go to one buffer, so
// that one copy brings them back: out[row * k + r] is an index and
// out[rows * k + row * k + r] the bits of its value (rows = gridDim.x).
extern "C" __global__ void top_k(const float* logits, int vocab, int k, int* out) {
    int* idx = out;
    int* val = out + (size_t)gridDim.x * k;
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float pv = UF_INF;
    int pi = -1;
    for (int r = 0; r < k; r++) {
        float v = -UF_INF;
        int i = 0x7fffffff;
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            float x = row[j];
            bool below = x < pv || (x == pv && j > pi);
            if (below) better(&v, &i, x, j);
        }
        block_best(&v, &i);
        if (threadIdx.x == 0) {
            // -1: nothing left (the row had fewer than k non-NaN logits).
            idx[blockIdx.x * k + r] = i == 0x7fffffff ? -1 : i;
            val[blockIdx.x * k + r] = __float_as_int(v);
        }
        pv = v;
        pi = i;
    }
}

// Block-wide sum.
__device__ float block_sum(float s) {
    __shared__ float ss[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) ss[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < blockDim.x / 32 ? ss[lane] : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) ss[0] = s;
    }
    __syncthreads();
    return ss[0];
}

// ln sum(e^x) of each row (the softmax's log-normaliser: a logit minus it
// is its token's log-probability), for the rows whose log-probabilities
// are reported; NaN counts nothing, a row with nothing finite gives -inf.
// One block per row: its maximum (block_best), then the sum of e^(x - max)
// with each thread's terms added in order.
extern "C" __global__ void log_norm(const float* logits, int vocab, float* out) {
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float v = -UF_INF;
    int i = 0x7fffffff;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float x = row[j];
        if (x == x) better(&v, &i, x, j);
    }
    block_best(&v, &i);
    float m = v;
    float s = 0.0f;
    if (m > -UF_INF && m < UF_INF) {
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            float x = row[j];
            if (x == x) s += __expf(x - m);
        }
    }
    s = block_sum(s);
    if (threadIdx.x == 0) out[blockIdx.x] = (m > -UF_INF && m < UF_INF) ? m + __logf(s) : m;
}
