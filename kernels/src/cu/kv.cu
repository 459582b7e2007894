// The K/V write into the paged cache: token t's kv_dim keys and values go
// to slot slots[t] = block id * block size + offset (the block ids of
// kv::BlockPool), stored as f16: cache[slot * kv_dim + i]. The rows come
// from the fused QKV output: k at k_off and v at v_off floats into each
// token's `stride` floats.
extern "C" __global__ void kv_write(const float* qkv, int stride, int k_off, int v_off,
                                    u16* kc, u16* vc, const int* slots, int kv_dim) {
    int t = blockIdx.x;
    size_t s = (size_t)slots[t];
    const float* row = qkv + (size_t)t * stride;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        kc[s * kv_dim + i] = f2h(row[k_off + i]);
        vc[s * kv_dim + i] = f2h(row[v_off + i]);
    }
}
