// Activation quantization shared by quant.cu, norm.cu and activation.cu (the loader prepends
// this file to each). A warp quantizes one 32-element group, lane i holding element i:
//   x ≈ d * (hi + lo / 254),  d = amax / 127,  |error| ≤ d / 508;  s = the fp32 sum of the group.
// All 32 lanes must be active.

__device__ __forceinline__ void quant32(float v, signed char* hi, signed char* lo, float* dd, float* ss,
                                        long long e, long long g) {
    float a = fabsf(v), s = v;
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
        s += __shfl_xor_sync(0xffffffffu, s, o);
    }
    float id = a > 0.f ? 127.f / a : 0.f;
    float t = v * id;
    float h = fminf(fmaxf(rintf(t), -127.f), 127.f);
    float l = fminf(fmaxf(rintf((t - h) * 254.f), -127.f), 127.f);
    hi[e] = (signed char)(int)h;
    lo[e] = (signed char)(int)l;
    if ((threadIdx.x & 31) == 0) {
        dd[g] = a * (1.f / 127.f);
        ss[g] = s;
    }
}

