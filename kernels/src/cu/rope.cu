// Rotary position embedding in place over `heads` heads of `hd` values
// for token blockIdx.x at position pos[blockIdx.x]. Pair i (< hd / 2)
// turns by pos / theta^(2i / hd): llama's interleaved pairs (2i, 2i + 1)
// or NEOX's halves (i, i + hd / 2). `stride` is the floats per token and
// the heads start `off` floats into each token's row.
extern "C" __global__ void rope(float* x, const int* pos, int heads, int hd, int stride,
                                int off, float theta, int neox) {
    int t = blockIdx.x;
    float p = (float)pos[t];
    int half = hd / 2;
    for (int k = threadIdx.x; k < heads * half; k += blockDim.x) {
        int h = k / half, i = k % half;
        // In double: the kernels are compiled with fast math, whose
        // single-precision pow and sincos lose 1e-3 rad at long positions
        // (the angle itself is f32, as the reference's).
        float freq = (float)(1.0 / pow((double)theta, 2.0 * i / hd));
        double sd, cd;
        sincos((double)(p * freq), &sd, &cd);
        float s = (float)sd, c = (float)cd;
        float* v = x + (size_t)t * stride + off + h * hd;
        int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        float x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
    }
}
