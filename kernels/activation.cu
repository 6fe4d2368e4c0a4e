// SwiGLU: out = silu(g) * u, for N rows of F (g and u with row stride ld; out dense (N, F)).
// has_q: out is also quantized for the int8 matvecs (quant_act.cuh; F must be a multiple of 32).

__global__ void swiglu(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ out,
                       int N, int F, int ld, signed char* qh, signed char* ql, float* qd, float* qs, int has_q) {
    PDL_ENTRY
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)N * F) return;  // warp-uniform when has_q
    long long r = t / F, c = t % F;
    float a = g[r * ld + c];
    float v = a / (1.0f + expf(-a)) * u[r * ld + c];
    out[t] = v;
    if (has_q) quant32(v, qh, ql, qd, qs, t, t >> 5);
}
