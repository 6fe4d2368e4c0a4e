// RMSNorm: y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, one 256-thread block per row.
// has_q: y is also quantized for the int8 matvecs (quant_act.cuh; D must be a multiple of 32).

__global__ void __launch_bounds__(256) rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                                float* __restrict__ y, int D, float eps, signed char* qh,
                                                signed char* ql, float* qd, float* qs, int has_q) {
    const float* xr = x + (long long)blockIdx.x * D;
    float* yr = y + (long long)blockIdx.x * D;
    float s = 0.f;
    for (int i = threadIdx.x; i < D; i += 256) s = fmaf(xr[i], xr[i], s);
    __shared__ float part[8];
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < 8; ++i) t += part[i];
    float inv = 1.0f / sqrtf(t / D + eps);
    for (int i = threadIdx.x; i < D; i += 256) {
        float v = (xr[i] * inv) * w[i];
        yr[i] = v;
        if (has_q) {  // warp-uniform: D % 32 == 0
            long long e = (long long)blockIdx.x * D + i;
            quant32(v, qh, ql, qd, qs, e, e >> 5);
        }
    }
}
