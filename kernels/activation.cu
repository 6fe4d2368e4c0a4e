// SwiGLU: out = silu(g) * u, for N rows of F (g and u with row stride ld; out dense (N, F)).

__global__ void swiglu(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ out,
                       int N, int F, int ld) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)N * F) return;
    long long r = t / F, c = t % F;
    float a = g[r * ld + c];
    out[t] = a / (1.0f + expf(-a)) * u[r * ld + c];
}
