// Paged attention over block tables, for decode and chunked prefill alike:
// block (kv head g, query token t) attends token t's query heads of group
// g (warp j takes head g * group + j) to positions 0..=qpos[t] of its
// sequence qseq[t], whose KV blocks are tables[qseq[t] * max_blocks + n].
// K/V rows are read once per block into shared memory, 32 positions at a
// time, for all heads of the group (GQA); an online softmax per warp.
// q: token-major, heads * hd floats per token at q_stride; out: heads * hd
// per token. hd <= 128 (4 values per lane), group <= 8.
#define ATT_TILE 32
#define ATT_MAX_HD 128

extern "C" __global__ void paged_attention(const float* q, int q_stride, const u16* kc,
                                           const u16* vc, const int* tables, int max_blocks,
                                           const int* qseq, const int* qpos, float* out,
                                           int heads, int kv_heads, int hd, int block_size,
                                           float scale) {
    __shared__ float ks[ATT_TILE][ATT_MAX_HD + 1];
    __shared__ float vs[ATT_TILE][ATT_MAX_HD];
    int g = blockIdx.x, t = blockIdx.y;
    int group = heads / kv_heads;
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int head = g * group + warp;
    bool active = warp < group;
    int kv_dim = kv_heads * hd;
    const int* table = tables + (size_t)qseq[t] * max_blocks;
    int n = qpos[t] + 1;
    float qv[ATT_MAX_HD / 32], acc[ATT_MAX_HD / 32];
#pragma unroll
    for (int c = 0; c < ATT_MAX_HD / 32; c++) {
        int d = lane + 32 * c;
        qv[c] = (active && d < hd) ? q[(size_t)t * q_stride + head * hd + d] * scale : 0.f;
        acc[c] = 0.f;
    }
    float m = -UF_INF, l = 0.f;
    for (int base = 0; base < n; base += ATT_TILE) {
        __syncthreads();
        for (int k = threadIdx.x; k < ATT_TILE * hd; k += blockDim.x) {
            int p = base + k / hd, d = k % hd;
            float kv = 0.f, vv = 0.f;
            if (p < n) {
                size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
                kv = h2f(kc[slot * kv_dim + g * hd + d]);
                vv = h2f(vc[slot * kv_dim + g * hd + d]);
            }
            ks[k / hd][d] = kv;
            vs[k / hd][d] = vv;
        }
        __syncthreads();
        if (!active) continue;
        // Lane = position within the tile: its score against this head.
        float sc = 0.f;
        for (int c = 0; c < ATT_MAX_HD / 32; c++) {
#pragma unroll 8
            for (int j = 0; j < 32; j++) {
                int d = 32 * c + j;
                if (d < hd) sc += __shfl_sync(0xffffffffu, qv[c], j) * ks[lane][d];
            }
        }
        if (base + lane >= n) sc = -UF_INF;
        float tm = warp_max(sc);
        float nm = fmaxf(m, tm);
        float e = base + lane < n ? __expf(sc - nm) : 0.f;
        float fix = __expf(m - nm);
        l = l * fix + warp_sum(e);
#pragma unroll
        for (int c = 0; c < ATT_MAX_HD / 32; c++) acc[c] *= fix;
        for (int j = 0; j < ATT_TILE; j++) {
            float pj = __shfl_sync(0xffffffffu, e, j);
#pragma unroll
            for (int c = 0; c < ATT_MAX_HD / 32; c++) {
                int d = lane + 32 * c;
                if (d < hd) acc[c] += pj * vs[j][d];
            }
        }
        m = nm;
    }
    if (!active) return;
#pragma unroll
    for (int c = 0; c < ATT_MAX_HD / 32; c++) {
        int d = lane + 32 * c;
        if (d < hd) out[(size_t)t * heads * hd + head * hd + d] = acc[c] / l;
    }
}
