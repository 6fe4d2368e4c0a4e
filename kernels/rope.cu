// RoPE in place on x (N rows of n_heads * head_dim, row stride ld floats), angle
// pos[r] * freqs[i] computed in double as the CPU reference does. One thread per rotated pair.
// neox = 0: pairs (2i, 2i+1) (Llama's GGUF order); neox = 1: pairs (i, i + rope_dim/2).

__global__ void rope(float* x, const int* __restrict__ pos, const double* __restrict__ freqs, int N,
                     int n_heads, int head_dim, int rope_dim, int ld, int neox) {
    PDL_ENTRY
    int half = rope_dim / 2;
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)N * n_heads * half) return;
    int i = (int)(t % half);
    long long rh = t / half;
    int h = (int)(rh % n_heads), r = (int)(rh / n_heads);
    double s, c;
    sincos((double)pos[r] * freqs[i], &s, &c);
    float cf = (float)c, sf = (float)s;
    float* p = x + (long long)r * ld + (long long)h * head_dim;
    int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    const float2 y = rope_rot(p[ia], p[ib], cf, sf);
    p[ia] = y.x;
    p[ib] = y.y;
}
