// RMSNorm with the residual add fused: for token t (one block each),
// x += add (when add is not null; x is the residual stream, updated in
// place), then out = x * w / sqrt(mean(x^2) + eps).
extern "C" __global__ void rmsnorm_residual(float* x, const float* add, const float* w,
                                            float* out, int dim, float eps) {
    __shared__ float part[32];
    float* xt = x + (size_t)blockIdx.x * dim;
    const float* at = add ? add + (size_t)blockIdx.x * dim : 0;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xt[i];
        if (at) {
            v += at[i];
            xt[i] = v;
        }
        ss += v * v;
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.f;
        v = warp_sum(v);
        if (threadIdx.x == 0) part[0] = v;
    }
    __syncthreads();
    float inv = rsqrtf(part[0] / (float)dim + eps);
    float* ot = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ot[i] = xt[i] * inv * w[i];
}
