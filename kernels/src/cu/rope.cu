// Rotary position embedding in place over `heads` heads of `hd` values
// for token blockIdx.x at position pos[blockIdx.x]. Pair i (< hd / 2)
// turns by the angle whose cosine and sine are table[(pos * hd / 2 + i) * 2
// + {0, 1}] (`reference::rope_table`, made once at load in double: no
// pow or sincos per step, and fast math's single-precision ones lose 1e-3
// rad at long positions): llama's interleaved pairs (2i, 2i + 1) or NEOX's
// halves (i, i + hd / 2). `stride` is the floats per token and the heads
// start `off` floats into each token's row. A position past the table's
// `npos` rows gives NaN, which every check sees, rather than a read past
// the table.
extern "C" __global__ void rope(float* x, const int* pos, int heads, int hd, int stride,
                                int off, const float* table, int npos, int neox) {
    int t = blockIdx.x;
    int p = pos[t];
    int half = hd / 2;
    bool inside = p >= 0 && p < npos;
    const float* row = table + (size_t)(inside ? p : 0) * half * 2;
    for (int k = threadIdx.x; k < heads * half; k += blockDim.x) {
        int h = k / half, i = k % half;
        float c = inside ? row[2 * i] : __int_as_float(0x7fc00000);
        float s = inside ? row[2 * i + 1] : c;
        float* v = x + (size_t)t * stride + off + h * hd;
        int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        float x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
    }
}
