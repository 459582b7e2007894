// Paged attention over block tables, for decode and chunked prefill alike:
// block (kv head g, query token t, part z) attends token t's query heads of
// group g (warp j takes head g * group + j) to positions
// [z * chunk, min((z + 1) * chunk, qpos[t] + 1)) of its sequence qseq[t],
// whose KV blocks are tables[qseq[t] * max_blocks + n]. K/V rows are read
// once per block into shared memory, 32 positions at a time, for all heads
// of the group (GQA); an online softmax per warp.
// One part (gridDim.z == 1): the output, normalized. Several (split
// context, flash-decoding: a decode step has a few query rows, so one
// block per KV head and row would leave most of a GPU idle while each
// walked its whole context): each part writes its unnormalized sums, its
// running max and its sum of exponentials to `part` (hd + 2 floats per
// head, part-major within the token), and `attention_merge` combines them.
// q: token-major, heads * hd floats per token at q_stride; out: heads * hd
// per token. hd <= 128 (4 values per lane), group <= 8.
#define ATT_TILE 32
#define ATT_MAX_HD 128

extern "C" __global__ void paged_attention(const float* q, int q_stride, const u16* kc,
                                           const u16* vc, const int* tables, int max_blocks,
                                           const int* qseq, const int* qpos, float* out,
                                           int heads, int kv_heads, int hd, int block_size,
                                           float scale, int chunk, float* part) {
    __shared__ float ks[ATT_TILE][ATT_MAX_HD + 1];
    __shared__ float vs[ATT_TILE][ATT_MAX_HD];
    int g = blockIdx.x, t = blockIdx.y, z = blockIdx.z, parts = gridDim.z;
    int group = heads / kv_heads;
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int head = g * group + warp;
    bool active = warp < group;
    int kv_dim = kv_heads * hd;
    const int* table = tables + (size_t)qseq[t] * max_blocks;
    // This part's positions: [lo, n).
    int lo = z * chunk;
    int n = min(qpos[t] + 1, lo + chunk);
    float qv[ATT_MAX_HD / 32], acc[ATT_MAX_HD / 32];
#pragma unroll
    for (int c = 0; c < ATT_MAX_HD / 32; c++) {
        int d = lane + 32 * c;
        qv[c] = (active && d < hd) ? q[(size_t)t * q_stride + head * hd + d] * scale : 0.f;
        acc[c] = 0.f;
    }
    float m = -UF_INF, l = 0.f;
    for (int base = lo; base < n; base += ATT_TILE) {
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
    if (parts == 1) {
#pragma unroll
        for (int c = 0; c < ATT_MAX_HD / 32; c++) {
            int d = lane + 32 * c;
            if (d < hd) out[(size_t)t * heads * hd + head * hd + d] = acc[c] / l;
        }
        return;
    }
    // A part past the row's last position has m = -inf and l = 0.
    float* pp = part + (((size_t)t * parts + z) * heads + head) * (hd + 2);
#pragma unroll
    for (int c = 0; c < ATT_MAX_HD / 32; c++) {
        int d = lane + 32 * c;
        if (d < hd) pp[d] = acc[c];
    }
    if (lane == 0) {
        pp[hd] = m;
        pp[hd + 1] = l;
    }
}

// The parts of a split attention combined: block (head, token), thread d
// for value d. Each part's sums are rescaled from its own max to the
// overall one; parts that saw no position weigh nothing.
extern "C" __global__ void attention_merge(const float* part, float* out, int parts, int heads,
                                           int hd) {
    int head = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    if (d >= hd) return;
    size_t stride = (size_t)heads * (hd + 2);
    const float* p0 = part + ((size_t)t * parts * heads + head) * (hd + 2);
    float m = -UF_INF;
    for (int z = 0; z < parts; z++) m = fmaxf(m, p0[z * stride + hd]);
    float l = 0.f, a = 0.f;
    for (int z = 0; z < parts; z++) {
        const float* p = p0 + z * stride;
        float w = p[hd + 1] > 0.f ? __expf(p[hd] - m) : 0.f;
        l += w * p[hd + 1];
        a += w * p[d];
    }
    out[(size_t)t * heads * hd + head * hd + d] = a / l;
}
