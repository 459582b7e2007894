// SiLU-and-multiply over the fused gate|up output: for token t,
// out[t][i] = silu(gu[t][i]) * gu[t][ff + i], silu(g) = g / (1 + e^-g).
extern "C" __global__ void silu_mul(const float* gu, float* out, int ff, int tokens) {
    size_t n = (size_t)ff * tokens;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < n;
         k += (size_t)gridDim.x * blockDim.x) {
        size_t t = k / ff, i = k % ff;
        float g = gu[t * 2 * ff + i], u = gu[t * 2 * ff + ff + i];
        out[k] = g / (1.f + __expf(-g)) * u;
    }
}
