// RMSNorm: y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w. Grid (ceil(D / 1024), rows) of 1024-thread
// blocks: every block of a row sums the whole row's squares (the row is a few KB, in L2) in the
// same order, so all agree on the scale, then writes its own 1024 elements. Many blocks per row
// instead of one keeps a decode step's norm at a couple of memory latencies.
// has_q: y is also quantized for the int8 matvecs (quant_act.cuh; D must be a multiple of 32).

__global__ void __launch_bounds__(1024) rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                                 float* __restrict__ y, int D, float eps, signed char* qh,
                                                 signed char* ql, float* qd, float* qs, int has_q) {
    PDL_ENTRY
    const float* xr = x + (long long)blockIdx.y * D;
    float s = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < D; i += 1024) s = fmaf(xr[i], xr[i], s);
    __shared__ float part[32];
#pragma unroll
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < 32; ++i) t += part[i];
    const float inv = 1.0f / sqrtf(t / D + eps);
    const int e = blockIdx.x * 1024 + threadIdx.x;
    if (e >= D) return;  // warp-uniform when D % 32 == 0 (has_q)
    const float v = (xr[e] * inv) * w[e];
    const long long o = (long long)blockIdx.y * D + e;
    y[o] = v;
    if (has_q) quant32(v, qh, ql, qd, qs, o, o >> 5);
}
