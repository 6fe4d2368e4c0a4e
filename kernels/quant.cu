// Quantized weights: dequantization (bit-exact with gguf.quants) and the fused
// dequantize-multiply for decode (y = x @ W.T for a small batch of rows x): matvec_generic for
// every type, and for Q8_0/Q4_K/Q6_K on quantized activations the dp4a kernels mvq_* (1-2 rows)
// and the int8 tensor-core kernels mma_* (4-32 rows), and on f32 activations the f16
// tensor-core kernels mmh_* (4-32 rows of whole 256-blocks; the backend's choice for those;
// mmh_q4_1: rows of any multiple of 32, with settings.f16_legacy).
//
// A weight tensor (N rows of K elements) lives on the device as up to four "planes":
//   Q8_0: p0 = qs (N, K) int8,  p1 = d (N, K/32) f16            (repacked at load: 16-byte loads)
//   Q6_K: p0 = ql (N, K/2), p1 = qh (N, K/4), p2 = scales (N, K/16) int8, p3 = d (N, K/256) f16
//   every other type: p0 = the GGUF blocks as stored, (N, row_bytes)
// Type ids are GGML's: F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q2_K 10, Q3_K 11,
// Q4_K 12, Q5_K 13, Q6_K 14, BF16 30.
//
// Dequantization rounds each product separately (__fmul_rn/__fadd_rn), as numpy does, so the
// result is bit-identical to gguf.quants.dequantize.

// u8/u16/u32, h2f and f2h are in common.cuh (prepended by the loader).
__device__ __forceinline__ float ld_h(const u8* p) { return h2f((u16)(p[0] | (p[1] << 8))); }

struct Planes {
    const u8* p0;
    const u8* p1;
    const u8* p2;
    const u8* p3;
};

// Bytes of one row of the raw GGUF layout for type T and row length K.
template <int T> __device__ __forceinline__ long long row_bytes(int K) {
    switch (T) {
        case 0: return 4LL * K;
        case 1: case 30: return 2LL * K;
        case 2: return K / 32 * 18LL;
        case 3: return K / 32 * 20LL;
        case 6: return K / 32 * 22LL;
        case 7: return K / 32 * 24LL;
        case 10: return K / 256 * 84LL;
        case 11: return K / 256 * 110LL;
        case 12: return K / 256 * 144LL;
        case 13: return K / 256 * 176LL;
        default: return 0;
    }
}

__device__ __forceinline__ void k_scale_min(const u8* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The same from the 12 scale bytes held in three words (no local-memory array).
__device__ __forceinline__ int byte12(u32 a, u32 b, u32 c, int k) {
    u32 w = k < 4 ? a : (k < 8 ? b : c);
    return (w >> (8 * (k & 3))) & 0xFF;
}
__device__ __forceinline__ void k_scale_min_regs(u32 a, u32 b, u32 c, int j, int& sc, int& m) {
    if (j < 4) {
        sc = byte12(a, b, c, j) & 63;
        m = byte12(a, b, c, j + 4) & 63;
    } else {
        sc = (byte12(a, b, c, j + 4) & 0xF) | ((byte12(a, b, c, j - 4) >> 6) << 4);
        m = (byte12(a, b, c, j + 4) >> 4) | ((byte12(a, b, c, j) >> 6) << 4);
    }
}

// 32 bytes from a 16-byte-aligned address in two vector loads; b[i] is byte i.
struct Bytes32 {
    u32 w[8];
    __device__ __forceinline__ int operator[](int i) const { return (w[i >> 2] >> (8 * (i & 3))) & 0xFF; }
};
__device__ __forceinline__ Bytes32 ld_bytes32(const u8* p) {
    const uint4 a = __ldg((const uint4*)p), b = __ldg((const uint4*)(p + 16));
    return {{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}};
}

// All eight from the three words at once, a byte per sub-block: sc[0] = scales 0-3, sc[1] = 4-7.
__device__ __forceinline__ void k_scales_packed(u32 a, u32 b, u32 c, u32 (&sc)[2], u32 (&m)[2]) {
    sc[0] = a & 0x3F3F3F3Fu;
    m[0] = b & 0x3F3F3F3Fu;
    sc[1] = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
    m[1] = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
}

// The 32 elements of sub-block `sub` (elements 32*sub .. 32*sub+31) of row `row`.
template <int T> __device__ void deq32(const Planes& P, long long row, int K, int sub, float* out) {
    if (T == 8) {  // Q8_0, planes
        const Bytes32 q = ld_bytes32(P.p0 + row * K + sub * 32);
        float d = h2f(((const u16*)P.p1)[row * (K / 32) + sub]);
#pragma unroll
        for (int i = 0; i < 32; ++i) out[i] = __fmul_rn((float)(signed char)q[i], d);
        return;
    }
    if (T == 14) {  // Q6_K, planes
        int blk = sub / 8, j = sub % 8, nh = j / 4, jj = j % 4;
        const Bytes32 ql = ld_bytes32(P.p0 + row * (K / 2) + blk * 128 + 64 * nh + 32 * (jj % 2));
        const Bytes32 qh = ld_bytes32(P.p1 + row * (K / 4) + blk * 64 + 32 * nh);
        const signed char* sc = (const signed char*)P.p2 + row * (K / 16) + blk * 16 + 8 * nh + 2 * jj;
        float d = h2f(((const u16*)P.p3)[row * (K / 256) + blk]);
        float d0 = __fmul_rn(d, (float)sc[0]), d1 = __fmul_rn(d, (float)sc[1]);
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            int q = ((ql[i] >> (4 * (jj / 2))) & 0xF) | (((qh[i] >> (2 * jj)) & 3) << 4);
            out[i] = __fmul_rn(i < 16 ? d0 : d1, (float)(q - 32));
        }
        return;
    }
    const u8* r = P.p0 + row * row_bytes<T>(K);
    if (T == 0) {
        for (int i = 0; i < 32; ++i) out[i] = ((const float*)r)[sub * 32 + i];
    } else if (T == 1) {
        for (int i = 0; i < 32; ++i) out[i] = h2f(((const u16*)r)[sub * 32 + i]);
    } else if (T == 30) {
        for (int i = 0; i < 32; ++i) out[i] = __uint_as_float(((u32)((const u16*)r)[sub * 32 + i]) << 16);
    } else if (T == 2 || T == 3 || T == 6 || T == 7) {
        const int bs = T == 2 ? 18 : T == 3 ? 20 : T == 6 ? 22 : 24;
        const u8* b = r + (long long)sub * bs;
        float d = ld_h(b), m = 0.f;
        int o = 2;
        if (T == 3 || T == 7) { m = ld_h(b + 2); o = 4; }
        u32 qh = 0;
        if (T == 6 || T == 7) { qh = b[o] | (b[o + 1] << 8) | (b[o + 2] << 16) | ((u32)b[o + 3] << 24); o += 4; }
        const u8* qs = b + o;
        for (int i = 0; i < 32; ++i) {
            int q = (qs[i % 16] >> (4 * (i / 16))) & 0xF;
            if (T == 6 || T == 7) q |= ((qh >> i) & 1) << 4;
            if (T == 2) out[i] = __fmul_rn(d, (float)(q - 8));
            else if (T == 6) out[i] = __fmul_rn(d, (float)(q - 16));
            else out[i] = __fadd_rn(__fmul_rn(d, (float)q), m);
        }
    } else {  // K-quants on raw blocks
        int blk = sub / 8, j = sub % 8;
        if (T == 10) {  // Q2_K: scales[16] qs[64] d dmin
            const u8* b = r + blk * 84LL;
            float d = ld_h(b + 80), dmin = ld_h(b + 82);
            int h = j / 4, s = j % 4;
            for (int i = 0; i < 32; ++i) {
                int sc = b[2 * j + i / 16];
                float dl = __fmul_rn(d, (float)(sc & 0xF)), ml = __fmul_rn(dmin, (float)(sc >> 4));
                int q = (b[16 + 32 * h + i] >> (2 * s)) & 3;
                out[i] = __fsub_rn(__fmul_rn(dl, (float)q), ml);
            }
        } else if (T == 11) {  // Q3_K: hmask[32] qs[64] scales[12] d
            const u8* b = r + blk * 110LL;
            float d = ld_h(b + 108);
            const u8* sc12 = b + 96;
            int h = j / 4, s = j % 4;
            for (int i = 0; i < 32; ++i) {
                int k = 2 * j + i / 16;
                int ls = (sc12[k % 8] >> (4 * (k / 8))) & 0xF;
                int hs = (sc12[8 + k % 4] >> (2 * (k / 4))) & 3;
                float dl = __fmul_rn(d, (float)((ls | (hs << 4)) - 32));
                int ql = (b[32 + 32 * h + i] >> (2 * s)) & 3;
                int hb = (b[i] >> j) & 1;
                out[i] = __fmul_rn(dl, (float)(ql - ((hb ^ 1) << 2)));
            }
        } else if (T == 12 || T == 13) {  // Q4_K: d dmin scales[12] qs[128]; Q5_K adds qh[32] before qs
            const u8* b = r + blk * (T == 12 ? 144LL : 176LL);
            float d = ld_h(b), dmin = ld_h(b + 2);
            int sc, m;
            k_scale_min(b + 4, j, sc, m);
            float dl = __fmul_rn(d, (float)sc), dm = __fmul_rn(dmin, (float)m);
            const Bytes32 qs = ld_bytes32(b + (T == 12 ? 16 : 48) + 32 * (j / 2));  // 16-aligned: blocks of 144, 176 B
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                int q = (qs[i] >> (4 * (j % 2))) & 0xF;
                if (T == 13) q |= ((b[16 + i] >> j) & 1) << 4;
                out[i] = __fsub_rn(__fmul_rn(dl, (float)q), dm);
            }
        }
    }
}

// Rows of a weight tensor as float32 or f16: out[r] = W[rows[r]] (rows == nullptr: all rows).
// One thread per 32-element sub-block.
template <int T, bool HALF>
__global__ void dequant_rows(const u8* p0, const u8* p1, const u8* p2, const u8* p3, const int* __restrict__ rows,
                             int has_rows, int n_rows, int K, void* out) {
    PDL_ENTRY
    Planes P{p0, p1, p2, p3};
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int subs = K / 32;
    if (t >= (long long)n_rows * subs) return;
    int r = (int)(t / subs), sub = (int)(t % subs);
    long long src = has_rows ? rows[r] : r;
    float v[32];
    deq32<T>(P, src, K, sub, v);
    if (HALF) {  // 16-byte stores: a warp's 32 threads write 2 KB in 128 stores, not 1024
        uint4* o = (uint4*)((u16*)out + (long long)r * K + sub * 32);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) w[j] = f2h(v[8 * i + 2 * j]) | ((u32)f2h(v[8 * i + 2 * j + 1]) << 16);
            o[i] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    } else {
        float4* o = (float4*)((float*)out + (long long)r * K + sub * 32);
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    }
}

// ---- fused dequantize-multiply: y[b, n] = sum_k W[n, k] x[b, k] (+ res[b, n]) -------------
// matvec_generic (every type but Q8_0, Q4_K, Q6_K, which use the int8 mvq_* below): one warp
// per output row, 4 rows per 128-thread block; NB is the most batch rows one launch
// carries (accumulators in registers), nb ≤ NB the rows it has.

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int NB>
__device__ __forceinline__ void mv_store(float (&acc)[NB], const float* res, float* y, int N, int row, int nb) {
    for (int b = 0; b < NB; ++b) {
        if (b >= nb) break;
        float s = warp_sum(acc[b]);
        if ((threadIdx.x & 31) == 0) y[(long long)b * N + row] = s + (res ? res[(long long)b * N + row] : 0.f);
    }
}

// Dot of 16 weights (w[]) with x[b, k0 .. k0+16).
__device__ __forceinline__ float dot16(const float* w, const float* x) {
    const float4* x4 = (const float4*)x;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float4 v = __ldg(x4 + i);
        s = fmaf(w[4 * i], v.x, s);
        s = fmaf(w[4 * i + 1], v.y, s);
        s = fmaf(w[4 * i + 2], v.z, s);
        s = fmaf(w[4 * i + 3], v.w, s);
    }
    return s;
}

template <int T, int NB>
__global__ void __launch_bounds__(128) matvec_generic(const u8* p0, const u8* p1, const u8* p2, const u8* p3, const float* __restrict__ x, const float* res, int has_res,
                                                      float* y, int N, int K, int nb) {
    PDL_ENTRY
    Planes P{p0, p1, p2, p3};
    int row = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    float acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = 0.f;
    for (int sub = lane; sub < K / 32; sub += 32) {
        float w[32];
        deq32<T>(P, row, K, sub, w);
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (b < nb) {
                const float* xb = x + (long long)b * K + sub * 32;
                acc[b] += dot16(w, xb) + dot16(w + 16, xb + 16);
            }
        }
    }
    mv_store<NB>(acc, has_res ? res : nullptr, y, N, row, nb);
}

// ---- int8 dot-product matvec on quantized activations ---------------------------------------
// The activation rows x (B, K) are quantized per 32-element group g to two int8 levels,
//   x ≈ d[g] * (hi + lo / 254),   d = amax / 127,  |error| ≤ d / 508  (about 2^-15 of amax),
// plus s[g] = the fp32 sum of the group (for the K-quant minimums). Each weight word then costs
// two dp4a (hi and lo) instead of four fp32 FMAs and conversions, and x is read as 2 bytes per
// element instead of 4. Each warp takes R rows so every x load serves R rows.

// quant32 (the per-group quantizer) is in quant_act.cuh, prepended by the loader.

// x (N rows, K of them used, row stride ld) → hi, lo (N, K) int8; d, s (N, K/32). One warp per group.
__global__ void quantize_rows(const float* __restrict__ x, int ld, int N, int K, signed char* hi, signed char* lo,
                              float* d, float* s) {
    PDL_ENTRY
    long long g = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31, gpr = K / 32;
    if (g >= (long long)N * gpr) return;
    long long r = g / gpr, k = (g % gpr) * 32 + lane;
    quant32(x[r * ld + k], hi, lo, d, s, r * K + k, g);
}

__device__ __forceinline__ float mix(int ih, int il) { return fmaf((float)il, 1.f / 254.f, (float)ih); }

// The sum of the 16 int8 products of a 16-byte weight vector and 16 activation bytes.
__device__ __forceinline__ int dot16(uint4 v, uint4 x) {
    int s = __dp4a((int)v.x, (int)x.x, 0);
    s = __dp4a((int)v.y, (int)x.y, s);
    s = __dp4a((int)v.z, (int)x.z, s);
    return __dp4a((int)v.w, (int)x.w, s);
}

// Q4_K, lane (g, h) of a block's 8: the scales of its sub-blocks 2g and 2g + 1 from the block's
// first 16 bytes (d, dmin, 12 scale bytes), dl = d * scale and dm = dmin * min, the minimums
// zeroed by mf = 0 (the h = 1 lane: the pair adds them once).
__device__ __forceinline__ void q4k_lane_scales(uint4 hd, int g, float mf, float& dl0, float& dm0, float& dl1,
                                                float& dm1) {
    const float d = h2f((u16)(hd.x & 0xFFFF)), dmin = h2f((u16)(hd.x >> 16));
    u32 scp[2], mp[2];  // sub-blocks 2g, 2g + 1: bytes 2(g & 1), + 1 of word g >> 1
    k_scales_packed(hd.y, hd.z, hd.w, scp, mp);
    const u32 sw = g < 2 ? scp[0] : scp[1], mw = g < 2 ? mp[0] : mp[1];
    const int sh = 16 * (g & 1);
    const int sc0 = (sw >> sh) & 0xFF, sc1 = (sw >> (sh + 8)) & 0xFF;
    const int m0 = (mw >> sh) & 0xFF, m1 = (mw >> (sh + 8)) & 0xFF;
    dl0 = d * sc0; dm0 = dmin * m0 * mf; dl1 = d * sc1; dm1 = dmin * m1 * mf;
}

// A Q4_K lane's activations: hi/lo bytes of elements k0.. (sub-block 2g) and k0 + 32.. (2g + 1),
// their groups' scales and sums.
struct XQ4 {
    uint4 h0, h1, l0, l1;
    float2 d, s;
};
__device__ __forceinline__ XQ4 ld_xq4(const signed char* xh, const signed char* xl, const float* xd, const float* xs,
                                      long long k0, long long s0) {
    return {__ldg((const uint4*)(xh + k0)), __ldg((const uint4*)(xh + k0 + 32)), __ldg((const uint4*)(xl + k0)),
            __ldg((const uint4*)(xl + k0 + 32)), __ldg((const float2*)(xd + s0)), __ldg((const float2*)(xs + s0))};
}

// The lane's 32 products: the 16 low nibbles of v (sub-block 2g) and the 16 high ones (2g + 1).
__device__ __forceinline__ float q4k_lane_dot(uint4 v, float dl0, float dm0, float dl1, float dm1, const XQ4& x) {
    const uint4 a = {v.x & 0x0F0F0F0Fu, v.y & 0x0F0F0F0Fu, v.z & 0x0F0F0F0Fu, v.w & 0x0F0F0F0Fu};
    const uint4 e = {(v.x >> 4) & 0x0F0F0F0Fu, (v.y >> 4) & 0x0F0F0F0Fu, (v.z >> 4) & 0x0F0F0F0Fu,
                     (v.w >> 4) & 0x0F0F0F0Fu};
    float t = fmaf(dl0 * x.d.x, mix(dot16(a, x.h0), dot16(a, x.l0)), -dm0 * x.s.x);
    t = fmaf(dl1 * x.d.y, mix(dot16(e, x.h1), dot16(e, x.l1)), t);
    return fmaf(-dm1, x.s.y, t);
}

// Q6_K, lane (half nh, a) of a block's 8: its 32 weights minus 32 as signed bytes, w[quarter][word],
// from ql bytes l and l + 32 (l0, l1) and qh byte l (hh), l = 8a .. 8a + 7 of the half.
__device__ __forceinline__ void q6k_lane_weights(uint2 l0, uint2 l1, uint2 hh, int (&w)[4][2]) {
    const u32 L0[2] = {l0.x, l0.y}, L1[2] = {l1.x, l1.y}, H[2] = {hh.x, hh.y};
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        w[0][p] = (int)__vsub4((L0[p] & 0x0F0F0F0Fu) | ((H[p] << 4) & 0x30303030u), 0x20202020u);
        w[1][p] = (int)__vsub4((L1[p] & 0x0F0F0F0Fu) | ((H[p] << 2) & 0x30303030u), 0x20202020u);
        w[2][p] = (int)__vsub4(((L0[p] >> 4) & 0x0F0F0F0Fu) | (H[p] & 0x30303030u), 0x20202020u);
        w[3][p] = (int)__vsub4(((L1[p] >> 4) & 0x0F0F0F0Fu) | ((H[p] >> 2) & 0x30303030u), 0x20202020u);
    }
}
// Its four quarter scales (8nh + (a >> 1) + 0, 2, 4, 6) as bytes of a word, from the 8 scale
// bytes of its half (bytes 0 and 2 of each word).
__device__ __forceinline__ u32 q6k_lane_scales(uint2 sv, int a) {
    const int sh = 8 * (a >> 1);
    return __byte_perm(sv.x >> sh, sv.y >> sh, 0x6420);
}

template <int R, int NB>
__device__ __forceinline__ void mvq_store(float (&acc)[R][NB], const float* res, float* y, int N, int row0, int nb) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (b >= nb) break;
            float s = warp_sum(acc[r][b]);
            if ((threadIdx.x & 31) == 0 && row0 + r < N)
                y[(long long)b * N + row0 + r] = s + (res ? res[(long long)b * N + row0 + r] : 0.f);
        }
}

// MB: the blocks per SM the registers must allow (launch bounds): more resident warps keep more
// loads in flight, at the price of registers (no spills for the instances the backend uses).
// KS > 1 (few rows, so few warps): the block's four warps share R rows and each takes a quarter
// of K (whole 32-chunk or 256-block steps); their sums meet in shared memory.
template <int R, int NB, int KS>
__device__ __forceinline__ void mvq_finish(float (&acc)[R][NB], const float* res, float* y, int N, int row0, int nb) {
    if constexpr (KS == 1) {
        mvq_store<R, NB>(acc, res, y, N, row0, nb);
    } else {
        __shared__ float part[KS][R][NB];
        const int w = threadIdx.x >> 5;
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const float v = warp_sum(acc[r][b]);
                if ((threadIdx.x & 31) == 0) part[w][r][b] = v;
            }
        __syncthreads();
        const int r = threadIdx.x / NB, b = threadIdx.x % NB;
        if (threadIdx.x < R * NB && b < nb && row0 + r < N) {
            float v = 0.f;
#pragma unroll
            for (int k = 0; k < KS; ++k) v += part[k][r][b];
            y[(long long)b * N + row0 + r] = v + (res ? res[(long long)b * N + row0 + r] : 0.f);
        }
        __syncthreads();  // part is reused by the block's next row group
    }
}

// The warp's first row and its share [*beg, *end) of `units` K steps of `step` (KS = 1: all).
template <int R, int KS>
__device__ __forceinline__ int mvq_rows(int units, int step, int& beg, int& end) {
    if constexpr (KS == 1) {
        beg = 0;
        end = units;
        return (blockIdx.x * 4 + (threadIdx.x >> 5)) * R;
    } else {
        const int per = (units + KS * step - 1) / (KS * step) * step;
        beg = min(units, (int)(threadIdx.x >> 5) * per);
        end = min(units, beg + per);
        return blockIdx.x * R;
    }
}

// mvq_q8_0 hands row groups out grid-stride: the launcher sizes its grid to what the SMs hold at
// once (a persistent grid: no tail wave, no block start per group), which made the Q8_0 decode
// step faster; the same loop made the K-quant kernels slower, so they keep a block per group
// (bench/RESULTS.md, "tried and rejected").
template <int R, int KS> __device__ __forceinline__ int mvq_stride() { return gridDim.x * (KS == 1 ? 4 : 1) * R; }

#define MVQ_ARGS const u8 *p0, const u8 *p1, const u8 *p2, const u8 *p3, const signed char *__restrict__ xh, \
                 const signed char *__restrict__ xl, const float *__restrict__ xd, const float *__restrict__ xs, \
                 const float *res, int has_res, float *y, int N, int K, int nb

// Q8_0 on planes: lane takes 16 int8 (one 16-byte load) per row per step. Software-pipelined:
// the next U steps' weights are in flight while this U's are multiplied, and the first U are
// loaded before pdl_wait (weights are never written), so they arrive during the previous kernel.
template <int R, int NB, int KS, int MB>
__global__ void __launch_bounds__(128, MB) mvq_q8_0(MVQ_ARGS) {
    const int lane = threadIdx.x & 31, nc = K / 16;
    int cb, ce;
    const int row_first = mvq_rows<R, KS>(nc, 32, cb, ce);
    if (row_first >= N) return;
    const int stride = mvq_stride<R, KS>();
    pdl_launch_next();
    for (int row0 = row_first; row0 < N; row0 += stride) {
        const uint4* q[R];
        const u16* dd[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            long long row = min(row0 + r, N - 1);
            q[r] = (const uint4*)(p0 + row * K);
            dd[r] = (const u16*)p1 + row * (K / 32);
        }
        constexpr int U = R >= 4 ? 1 : 4 / R;
        uint4 wA[U][R], wB[U][R];
        float dA[U][R], dB[U][R];
        auto load = [&](uint4 (&w)[U][R], float (&wd)[U][R], int c0) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + 32 * u;
                if (c < ce)
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        w[u][r] = __ldg(q[r] + c);
                        wd[u][r] = h2f(__ldg(dd[r] + (c >> 1)));
                    }
            }
        };
        float acc[R][NB];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b) acc[r][b] = 0.f;
        auto mul = [&](const uint4 (&w)[U][R], const float (&wd)[U][R], int c0) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + 32 * u;
                if (c >= ce) break;
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    if (b >= nb) break;
                    const uint4 h = __ldg((const uint4*)(xh + (long long)b * K) + c);
                    const uint4 l = __ldg((const uint4*)(xl + (long long)b * K) + c);
                    const float d = __ldg(xd + (long long)b * (K / 32) + (c >> 1));
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const int ih = dot16(w[u][r], h), il = dot16(w[u][r], l);
                        acc[r][b] = fmaf(wd[u][r] * d, mix(ih, il), acc[r][b]);
                    }
                }
            }
        };
        load(wA, dA, cb + lane);
        pdl_wait();
        for (int c0 = cb + lane; c0 < ce; c0 += 64 * U) {
            load(wB, dB, c0 + 32 * U);
            mul(wA, dA, c0);
            if (c0 + 32 * U >= ce) break;
            load(wA, dA, c0 + 64 * U);
            mul(wB, dB, c0 + 32 * U);
        }
        mvq_finish<R, NB, KS>(acc, has_res ? res : nullptr, y, N, row0, nb);
    }
}

// Q4_K on raw 144-byte blocks: 8 lanes per block; lane (g, h) takes the 16-byte slice h of qs
// pair g = 16 low nibbles (sub-block 2g, elements 16h..) and 16 high nibbles (sub-block 2g+1).
// The minimum term uses the group sums s and is added by the h = 0 lane only.
template <int R, int NB, int KS, int MB>
__global__ void __launch_bounds__(128, MB) mvq_q4_k(MVQ_ARGS) {
    const int lane = threadIdx.x & 31, nblk = K / 256;
    int bb, be;
    const int row0 = mvq_rows<R, KS>(nblk, 1, bb, be);
    if (row0 >= N) return;
    const uint4* rb[R];
#pragma unroll
    for (int r = 0; r < R; ++r) rb[r] = (const uint4*)(p0 + (long long)min(row0 + r, N - 1) * nblk * 144);
    pdl_launch_next();
#pragma unroll
    for (int r = 0; r < R; ++r) prefetch_l2(rb[r] + bb * 9, min((be - bb) * 144, 2048));  // the first weights: before the wait
    pdl_wait();
    float acc[R][NB];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < NB; ++b) acc[r][b] = 0.f;
    const int c = lane & 7, g = c >> 1, h = c & 1;
    const float mf = h ? 0.f : 1.f;
    constexpr int U = R >= 4 ? 1 : 4 / R;
    for (int b0 = bb + (lane >> 3); b0 < be; b0 += 4 * U) {
        uint4 hd[U][R], qv[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int blk = b0 + 4 * u;
            if (blk < be)
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    hd[u][r] = __ldg(rb[r] + blk * 9);
                    qv[u][r] = __ldg(rb[r] + blk * 9 + 1 + c);
                }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int blk = b0 + 4 * u;
            if (blk >= be) break;
            float dl0[R], dm0[R], dl1[R], dm1[R];
#pragma unroll
            for (int r = 0; r < R; ++r) q4k_lane_scales(hd[u][r], g, mf, dl0[r], dm0[r], dl1[r], dm1[r]);
            const long long k0 = (long long)blk * 256 + 64 * g + 16 * h;
            const long long s0 = (long long)blk * 8 + 2 * g;
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                if (b >= nb) break;
                const XQ4 x = ld_xq4(xh + (long long)b * K, xl + (long long)b * K, xd + (long long)b * (K / 32),
                                     xs + (long long)b * (K / 32), k0, s0);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r][b] += q4k_lane_dot(qv[u][r], dl0[r], dm0[r], dl1[r], dm1[r], x);
            }
        }
    }
    mvq_finish<R, NB, KS>(acc, has_res ? res : nullptr, y, N, row0, nb);
}

// Q6_K on planes: 8 lanes per 256-block; lane (half nh, a) takes elements 8a..8a+7 of each of the
// four 32-element quarters of its half (ql bytes l and l+32, qh byte l, l = 8a..8a+7).
template <int R, int NB, int KS, int MB>
__global__ void __launch_bounds__(128, MB) mvq_q6_k(MVQ_ARGS) {
    const int lane = threadIdx.x & 31, nblk = K / 256;
    int bb, be;
    const int row0 = mvq_rows<R, KS>(nblk, 1, bb, be);
    if (row0 >= N) return;
    const u8 *ql[R], *qh[R];
    const signed char* scs[R];
    const u16* dd[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        long long row = min(row0 + r, N - 1);
        ql[r] = p0 + row * (K / 2);
        qh[r] = p1 + row * (K / 4);
        scs[r] = (const signed char*)p2 + row * (K / 16);
        dd[r] = (const u16*)p3 + row * nblk;
    }
    pdl_launch_next();
#pragma unroll
    for (int r = 0; r < R; ++r) {  // weights: before the wait
        prefetch_l2(ql[r] + bb * 128, min((be - bb) * 128, 1024));
        prefetch_l2(qh[r] + bb * 64, min((be - bb) * 64, 512));
    }
    pdl_wait();
    float acc[R][NB];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < NB; ++b) acc[r][b] = 0.f;
    const int c = lane & 7, nh = c >> 2, a = c & 3;
    constexpr int U = R >= 4 ? 1 : 4 / R;
    for (int b0 = bb + (lane >> 3); b0 < be; b0 += 4 * U) {
        uint2 l0[U][R], l1[U][R], hh[U][R];
        u32 sc4[U][R];
        float d[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int blk = b0 + 4 * u;
            if (blk < be)
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    l0[u][r] = __ldg((const uint2*)(ql[r] + blk * 128 + 64 * nh + 8 * a));
                    l1[u][r] = __ldg((const uint2*)(ql[r] + blk * 128 + 64 * nh + 32 + 8 * a));
                    hh[u][r] = __ldg((const uint2*)(qh[r] + blk * 64 + 32 * nh + 8 * a));
                    sc4[u][r] = q6k_lane_scales(__ldg((const uint2*)(scs[r] + blk * 16 + 8 * nh)), a);
                    d[u][r] = h2f(__ldg(dd[r] + blk));
                }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int blk = b0 + 4 * u;
            if (blk >= be) break;
            int w[R][4][2];  // w[r][quarter][word]: q - 32 as signed bytes
            float ds[R][4];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                q6k_lane_weights(l0[u][r], l1[u][r], hh[u][r], w[r]);
#pragma unroll
                for (int qq = 0; qq < 4; ++qq) ds[r][qq] = d[u][r] * (float)(signed char)((sc4[u][r] >> (8 * qq)) & 0xFF);
            }
            const long long k0 = (long long)blk * 256 + 128 * nh + 8 * a;
            const long long g0 = (long long)blk * 8 + 4 * nh;
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                if (b >= nb) break;
                const signed char* xhb = xh + (long long)b * K + k0;
                const signed char* xlb = xl + (long long)b * K + k0;
                const float4 xd4 = __ldg((const float4*)(xd + (long long)b * (K / 32) + g0));
                const float xdq[4] = {xd4.x, xd4.y, xd4.z, xd4.w};
#pragma unroll
                for (int qq = 0; qq < 4; ++qq) {
                    const uint2 hv = __ldg((const uint2*)(xhb + 32 * qq)), lv = __ldg((const uint2*)(xlb + 32 * qq));
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        int ih = __dp4a(w[r][qq][0], (int)hv.x, 0);
                        ih = __dp4a(w[r][qq][1], (int)hv.y, ih);
                        int il = __dp4a(w[r][qq][0], (int)lv.x, 0);
                        il = __dp4a(w[r][qq][1], (int)lv.y, il);
                        acc[r][b] = fmaf(ds[r][qq] * xdq[qq], mix(ih, il), acc[r][b]);
                    }
                }
            }
        }
    }
    mvq_finish<R, NB, KS>(acc, has_res ? res : nullptr, y, N, row0, nb);
}

// ---- tensor-core matvec for batches (B = 4..32 rows): int8 mma.sync on the QAct levels -----
// The dp4a kernels above cost two dp4a per weight word per batch row, so at B = 16 they are
// bound by instruction issue, not bandwidth. Here each group of 32 (Q6_K: 16) weights of 16 rows
// meets 8 batch rows in one mma.sync (m16n8k32 / m16n8k16, s8 × s8 → s32), once for the hi and
// once for the lo activation level; the per-group scales are applied to the int32 results.
// K order inside an mma is free as long as A and B agree: thread t of a quad takes the 8
// consecutive elements 8t..8t+7 of a group (one 8-byte load for weights and for x), its first
// register holding 8t..8t+3 and its second 8t+4..8t+7, for A and B alike.
// Block: MW = 8 warps over the same 16 MT rows (MT 16-row tiles: 2, or 1 for matrices of few
// rows, so that they still spread over every SM); warp w takes K units w, w + 8, ...; the
// partial sums meet in shared memory. NT = ceil(B / 8) tiles of 8 batch rows.

#define MW 8

__device__ __forceinline__ void mma_k32(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    c[0] = c[1] = c[2] = c[3] = 0;
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_k16(int (&c)[4], u32 a0, u32 a1, u32 b0) {
    c[0] = c[1] = c[2] = c[3] = 0;
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

// The activation fragments of NT batch tiles at element k: W bytes (8 or 4) of hi and lo of
// batch row nt*8 + g (zeros past nb), and the scale d (and sum s) of that element's group for
// the two batch rows this thread's results belong to (nt*8 + 2t, + 1).
template <int NT> struct XFrag {
    uint2 h[NT], l[NT];
    float d[NT][2], s[NT][2];
};

template <int NT, bool SUMS>
__device__ __forceinline__ void load_x(XFrag<NT>& x, const signed char* __restrict__ xh, const signed char* __restrict__ xl,
                                       const float* __restrict__ xd, const float* __restrict__ xs, int K, int nb,
                                       long long k, int bytes) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const long long grp = k >> 5;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int b = nt * 8 + g;
        if (b < nb) {
            if (bytes == 8) {
                x.h[nt] = *(const uint2*)(xh + (long long)b * K + k);
                x.l[nt] = *(const uint2*)(xl + (long long)b * K + k);
            } else {
                x.h[nt].x = *(const u32*)(xh + (long long)b * K + k);
                x.l[nt].x = *(const u32*)(xl + (long long)b * K + k);
                x.h[nt].y = x.l[nt].y = 0;
            }
        } else {
            x.h[nt] = x.l[nt] = make_uint2(0, 0);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int bc = nt * 8 + 2 * t + j;
            x.d[nt][j] = bc < nb ? xd[(long long)bc * (K / 32) + grp] : 0.f;
            x.s[nt][j] = SUMS && bc < nb ? xs[(long long)bc * (K / 32) + grp] : 0.f;
        }
    }
}

// acc[mt][nt][i] += dw[mt][i / 2] * xd * (hi + lo / 254) - mw[mt][i / 2] * xs for one group.
template <int NT, int MT, bool MIN>
__device__ __forceinline__ void mma_epilogue(float (&acc)[MT][NT][4], const int (&ch)[4], const int (&cl)[4], int mt,
                                             int nt, const float (&dw)[2], const float (&mw)[2], const XFrag<NT>& x) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float v = fmaf(dw[i >> 1] * x.d[nt][i & 1], mix(ch[i], cl[i]), acc[mt][nt][i]);
        acc[mt][nt][i] = MIN ? fmaf(-mw[i >> 1], x.s[nt][i & 1], v) : v;
    }
}

// The warps' partial sums → y (+ res). Every thread of the block must call it.
template <int NT, int MT>
__device__ __forceinline__ void mma_store(float (&acc)[MT][NT][4], const float* res, float* y, int N, int row0, int nb) {
    __shared__ float red[MW][16 * MT][NT * 8];
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[warp][mt * 16 + g + 8 * (i >> 1)][nt * 8 + 2 * t + (i & 1)] = acc[mt][nt][i];
    __syncthreads();
    for (int o = threadIdx.x; o < 16 * MT * NT * 8; o += MW * 32) {
        const int r = o / (NT * 8), b = o % (NT * 8);
        if (row0 + r >= N || b >= nb) continue;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < MW; ++w) s += red[w][r][b];
        const long long yi = (long long)b * N + row0 + r;
        y[yi] = s + (res ? res[yi] : 0.f);
    }
}

#define MMA_PROLOGUE                                                                      \
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3; \
    const int row0 = blockIdx.x * 16 * MT;                                                \
    long long rows[MT][2];                                                                \
    for (int mt = 0; mt < MT; ++mt)                                                       \
        for (int hh = 0; hh < 2; ++hh) rows[mt][hh] = min(row0 + mt * 16 + g + 8 * hh, N - 1); \
    float acc[MT][NT][4];                                                                 \
    for (int mt = 0; mt < MT; ++mt)                                                       \
        for (int nt = 0; nt < NT; ++nt)                                                   \
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

// Q8_0 on planes: a K unit is one 32-group; U units' weights are loaded before any is used.
template <int NT, int MT>
__global__ void __launch_bounds__(MW * 32, NT >= 4 ? 1 : MT == 1 ? 3 : 2) mma_q8_0(MVQ_ARGS) {
    PDL_ENTRY
    MMA_PROLOGUE
    constexpr int U = 4;
    const float nomin[2] = {0.f, 0.f};
    const int groups = K / 32;
    for (int grp0 = warp; grp0 < groups; grp0 += MW * U) {
        uint2 w[U][MT][2];
        float dw[U][MT][2];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int grp = min(grp0 + MW * u, groups - 1);  // past the end: reloads the last (not used)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    w[u][mt][hh] = __ldg((const uint2*)(p0 + rows[mt][hh] * K + (long long)grp * 32 + 8 * t));
                    dw[u][mt][hh] = h2f(__ldg((const u16*)p1 + rows[mt][hh] * (K / 32) + grp));
                }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int grp = grp0 + MW * u;
            if (grp >= groups) break;
            XFrag<NT> x;
            load_x<NT, false>(x, xh, xl, xd, xs, K, nb, (long long)grp * 32 + 8 * t, 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    int ch[4], cl[4];
                    mma_k32(ch, w[u][mt][0].x, w[u][mt][1].x, w[u][mt][0].y, w[u][mt][1].y, x.h[nt].x, x.h[nt].y);
                    mma_k32(cl, w[u][mt][0].x, w[u][mt][1].x, w[u][mt][0].y, w[u][mt][1].y, x.l[nt].x, x.l[nt].y);
                    mma_epilogue<NT, MT, false>(acc, ch, cl, mt, nt, dw[u][mt], nomin, x);
                }
        }
    }
    mma_store<NT, MT>(acc, has_res ? res : nullptr, y, N, row0, nb);
}

// Q4_K on raw 144-byte blocks: a K unit is one 256-block; its qs pair p (32 bytes) holds
// sub-block 2p in the low nibbles and 2p + 1 in the high ones, element i at byte i.
template <int NT, int MT>
__global__ void __launch_bounds__(MW * 32, NT >= 4 ? 1 : MT == 1 ? 3 : 2) mma_q4_k(MVQ_ARGS) {
    PDL_ENTRY
    MMA_PROLOGUE
    const int nblk = K / 256;
    for (int blk = warp; blk < nblk; blk += MW) {
        uint4 hd[MT][2];
        uint2 qv[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const u8* b = p0 + (rows[mt][hh] * nblk + blk) * 144;
                hd[mt][hh] = __ldg((const uint4*)b);
#pragma unroll
                for (int p = 0; p < 4; ++p) qv[mt][hh][p] = __ldg((const uint2*)(b + 16 + 32 * p + 8 * t));
            }
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // sub-block
            const int p = j >> 1, sh = 4 * (j & 1);
            XFrag<NT> x;
            load_x<NT, true>(x, xh, xl, xd, xs, K, nb, (long long)blk * 256 + 32 * j + 8 * t, 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float dw[2], mw[2];
                u32 a[2][2];
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    int sc, m;
                    k_scale_min_regs(hd[mt][hh].y, hd[mt][hh].z, hd[mt][hh].w, j, sc, m);
                    dw[hh] = h2f((u16)(hd[mt][hh].x & 0xFFFF)) * sc;
                    mw[hh] = h2f((u16)(hd[mt][hh].x >> 16)) * m;
                    a[hh][0] = (qv[mt][hh][p].x >> sh) & 0x0F0F0F0Fu;
                    a[hh][1] = (qv[mt][hh][p].y >> sh) & 0x0F0F0F0Fu;
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    int ch[4], cl[4];
                    mma_k32(ch, a[0][0], a[1][0], a[0][1], a[1][1], x.h[nt].x, x.h[nt].y);
                    mma_k32(cl, a[0][0], a[1][0], a[0][1], a[1][1], x.l[nt].x, x.l[nt].y);
                    mma_epilogue<NT, MT, true>(acc, ch, cl, mt, nt, dw, mw, x);
                }
            }
        }
    }
    mma_store<NT, MT>(acc, has_res ? res : nullptr, y, N, row0, nb);
}

// Q6_K on planes: a K unit is one 256-block, in 16-element sub-blocks (one scale each), so
// k16 mmas; thread t takes elements 4t..4t+3 of each. Sub-block s = nh*8 + quarter*2 + lh holds
// l = 16 lh .. 16 lh + 15 of quarter `quarter` of half nh (the layout deq32 decodes).
template <int NT, int MT>
__global__ void __launch_bounds__(MW * 32, NT >= 4 ? 1 : MT == 1 ? 3 : 2) mma_q6_k(MVQ_ARGS) {
    PDL_ENTRY
    MMA_PROLOGUE
    const int nblk = K / 256;
    for (int blk = warp; blk < nblk; blk += MW) {
        float d[MT][2];
        uint4 sc16[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const long long r = rows[mt][hh];
                d[mt][hh] = h2f(__ldg((const u16*)p3 + r * nblk + blk));
                sc16[mt][hh] = __ldg((const uint4*)(p2 + r * (K / 16) + blk * 16));
            }
#pragma unroll 1
        for (int nl = 0; nl < 4; ++nl) {  // (half nh, l-half lh); not unrolled: registers
            const int nh = nl >> 1, lh = nl & 1;
            u32 q[MT][2][4];  // [mt][hh][quarter]: q - 32 as signed bytes
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const long long r = rows[mt][hh];
                    const u8* ql = p0 + r * (K / 2) + blk * 128 + nh * 64 + 16 * lh + 4 * t;
                    const u32 l0 = __ldg((const u32*)ql), l1 = __ldg((const u32*)(ql + 32));
                    const u32 h = __ldg((const u32*)(p1 + r * (K / 4) + blk * 64 + nh * 32 + 16 * lh + 4 * t));
                    q[mt][hh][0] = __vsub4((l0 & 0x0F0F0F0Fu) | ((h << 4) & 0x30303030u), 0x20202020u);
                    q[mt][hh][1] = __vsub4((l1 & 0x0F0F0F0Fu) | ((h << 2) & 0x30303030u), 0x20202020u);
                    q[mt][hh][2] = __vsub4(((l0 >> 4) & 0x0F0F0F0Fu) | (h & 0x30303030u), 0x20202020u);
                    q[mt][hh][3] = __vsub4(((l1 >> 4) & 0x0F0F0F0Fu) | ((h >> 2) & 0x30303030u), 0x20202020u);
                }
#pragma unroll
            for (int qq = 0; qq < 4; ++qq) {
                const int s = nh * 8 + qq * 2 + lh;
                XFrag<NT> x;
                load_x<NT, false>(x, xh, xl, xd, xs, K, nb, (long long)blk * 256 + 16 * s + 4 * t, 4);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    float dw[2];
                    const float nomin[2] = {0.f, 0.f};
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const u32 word = s < 4 ? sc16[mt][hh].x : s < 8 ? sc16[mt][hh].y : s < 12 ? sc16[mt][hh].z : sc16[mt][hh].w;
                        dw[hh] = d[mt][hh] * (float)(signed char)((word >> (8 * (s & 3))) & 0xFF);
                    }
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        int ch[4], cl[4];
                        mma_k16(ch, q[mt][0][qq], q[mt][1][qq], x.h[nt].x);
                        mma_k16(cl, q[mt][0][qq], q[mt][1][qq], x.l[nt].x);
                        mma_epilogue<NT, MT, false>(acc, ch, cl, mt, nt, dw, nomin, x);
                    }
                }
            }
        }
    }
    mma_store<NT, MT>(acc, has_res ? res : nullptr, y, N, row0, nb);
}

// ---- f16 tensor-core matvec for batches of K-quants (B = 4..32 rows): mmh_* ---------------
// The int8 kernels above spend most of their instructions on the per-group epilogue (two
// activation levels, a float scale per 32 or 16 weights). Here the weights are dequantized in
// registers to f16 with their scales applied (exact small integers minus 1024, times the
// scale, one rounding), the activations are staged once per block of 256 K elements in shared
// memory as f16, and m16n8k16 mmas accumulate in f32 with no epilogue. Precision is prefill's
// (f16 weights and activations, f32 sums), not the int8 kernels' (about 2^-15).
// Block: 8 warps, 16 rows each (128 rows); gridDim.y = KS splits the K blocks; gridDim.z chunks
// of 32 batch rows (nb counts them all; chunk z reads x, res and writes y from row 32z, with part
// and the tile counters of its own: the same arithmetic per row as a launch per chunk). With KS > 1 the
// splits write partial sums to part (KS, nb, N) and the last block of a row tile to finish
// (a counter per tile, reset by it) adds them in split order: deterministic.
// Fragments: thread (g, t) holds 4 consecutive elements e0..e3 of each k16 step, as the pairs
// (e0, e2) and (e1, e3) (k order is free inside an mma when A and B agree); the staged
// activations are stored in that order, so one 16-byte read gives a thread two steps of B.
#define MH_ROWS 128
#define MH_XS (256 * 2 + 64)  // bytes per staged batch row (≡ 64 mod 128: conflict-free 16-byte reads)

__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ u32 h2dup(float f) {
    const u32 h = f2h(f);
    return h | (h << 16);
}
// Bytes q0..q3 of v (each < 256) as f16 pairs (1024 + q0, 1024 + q2), (1024 + q1, 1024 + q3).
__device__ __forceinline__ void bytes_h2(u32 v, u32& p02, u32& p13) {
    p02 = (v & 0x00FF00FFu) | 0x64006400u;
    p13 = ((v >> 8) & 0x00FF00FFu) | 0x64006400u;
}

// Row hh (g or g + 8) of a k16 step's A fragment from four biased bytes (1024 + bias + q each, as
// f16): (q) · s, plus o with OFFSET.
template <bool OFFSET>
__device__ __forceinline__ void mh_arow(u32 (&a)[4], int hh, u32 bytes, u32 bias2, u32 s2, u32 o2) {
    u32 p02, p13;
    bytes_h2(bytes, p02, p13);
    a[hh] = OFFSET ? hfma2(hsub2(p02, bias2), s2, o2) : hmul2(hsub2(p02, bias2), s2);
    a[2 + hh] = OFFSET ? hfma2(hsub2(p13, bias2), s2, o2) : hmul2(hsub2(p13, bias2), s2);
}
// The B fragments of every batch tile for elements e .. e + 7 of the staged block (two k16 steps).
template <int NT>
__device__ __forceinline__ void mh_xfrag(uint4 (&xf)[NT], const u8* xb, int e) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xf[nt] = *(const uint4*)(xb + (nt * 8 + g) * MH_XS + e * 2);
}
// One k16 step (st = 0, 1 of the fragments' two) against every batch tile.
template <int NT>
__device__ __forceinline__ void mh_mma(float (&acc)[NT][4], const u32 (&a)[4], const uint4 (&xf)[NT], int st) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma_f16(acc[nt], a, st ? xf[nt].z : xf[nt].x, st ? xf[nt].w : xf[nt].y);
}

// x[b, k0 .. k0 + 256) for the block's batch rows (zeros past nb, and past K where the last
// block is partial: rows of 32-element blocks, mmh_q4_1): loaded into registers (this
// thread's NT * 2 float4s), later stored to shared memory as f16, each 4 elements as (0, 2, 1, 3).
template <int NT> struct XRegs {
    float4 v[NT * 2];
};
template <int NT>
__device__ __forceinline__ void mh_load_x(XRegs<NT>& r, const float* __restrict__ x, int K, int nb, int k0) {
#pragma unroll
    for (int i = 0; i < NT * 2; ++i) {
        const int idx = threadIdx.x + 256 * i, b = idx >> 6, c = (idx & 63) * 4;
        r.v[i] = b < nb && k0 + c < K ? __ldg((const float4*)(x + (long long)b * K + k0 + c))
                                      : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}
template <int NT>
__device__ __forceinline__ void mh_store_x(const XRegs<NT>& r, u8* xs) {
#pragma unroll
    for (int i = 0; i < NT * 2; ++i) {
        const int idx = threadIdx.x + 256 * i, b = idx >> 6, c = (idx & 63) * 4;
        const float4 v = r.v[i];
        *(uint2*)(xs + b * MH_XS + c * 2) = make_uint2(pack_h2(v.x, v.z), pack_h2(v.y, v.w));
    }
}

// The K loop of an mmh block, software-pipelined: while block blk multiplies (its weights in
// registers, its activations in one of two shared buffers), block blk + 1's weights and
// activations are in flight. load(W&, blk) issues a block's weight loads; mul(const W&, xs, blk)
// multiplies it.
template <int NT, class W, class Load, class Mul>
__device__ __forceinline__ void mh_loop(const float* __restrict__ x, int K, int nb, int blk0, int blk1,
                                        u8 (&xs)[2][NT * 8 * MH_XS], Load load, Mul mul) {
    W wa, wb;
    XRegs<NT> xr;
    if (blk0 < blk1) {
        load(wa, blk0);
        mh_load_x<NT>(xr, x, K, nb, blk0 * 256);
        mh_store_x<NT>(xr, xs[0]);
    }
    __syncthreads();
    for (int blk = blk0; blk < blk1; blk += 2) {
        const bool b1 = blk + 1 < blk1, b2 = blk + 2 < blk1;
        if (b1) {
            load(wb, blk + 1);
            mh_load_x<NT>(xr, x, K, nb, (blk + 1) * 256);
        }
        mul(wa, xs[0], blk);
        if (b1) mh_store_x<NT>(xr, xs[1]);
        __syncthreads();
        if (!b1) break;
        if (b2) {
            load(wa, blk + 2);
            mh_load_x<NT>(xr, x, K, nb, (blk + 2) * 256);
        }
        mul(wb, xs[1], blk + 1);
        if (b2) mh_store_x<NT>(xr, xs[0]);
        __syncthreads();
    }
}

// The block's results: straight to y (one split), else through part and the tile's counter.
template <int NT>
__device__ __forceinline__ void mh_finish(float (&acc)[NT][4], const float* res, float* y, int N, int nb, float* part,
                                          int* cnt) {
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const int row0 = blockIdx.x * MH_ROWS, ksn = gridDim.y;
    float* dst = ksn == 1 ? y : part + (long long)blockIdx.y * nb * N;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = row0 + 16 * warp + g + 8 * (i >> 1), b = nt * 8 + 2 * t + (i & 1);
            if (r < N && b < nb) {
                const long long o = (long long)b * N + r;
                dst[o] = acc[nt][i] + (ksn == 1 && res ? res[o] : 0.f);
            }
        }
    if (ksn == 1) return;
    __shared__ int last;
    __threadfence();  // this block's partials visible before its ticket
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(cnt + blockIdx.x, 1) == ksn - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < MH_ROWS * nb; i += blockDim.x) {
        const int r = row0 + i % MH_ROWS, b = i / MH_ROWS;
        if (r >= N) continue;
        const long long o = (long long)b * N + r;
        float s = 0.f;
        for (int k = 0; k < ksn; ++k) s += __ldcg(part + (long long)k * nb * N + o);
        y[o] = s + (res ? res[o] : 0.f);
    }
    if (threadIdx.x == 0) cnt[blockIdx.x] = 0;  // ready for the next launch (graph replays)
}

#define MH_ARGS const u8 *p0, const u8 *p1, const u8 *p2, const u8 *p3, const float *__restrict__ x, \
                const float *res, int has_res, float *y, int N, int K, int nb, float *part, int *cnt
#define MH_PROLOGUE                                                                            \
    if (blockIdx.z) { /* chunk z of 32 batch rows: one launch for a step of up to 128 rows */    \
        const long long zr = 32LL * blockIdx.z;                                                \
        x += zr * K; res += zr * N; y += zr * N; nb -= (int)zr;                                \
        part += zr * gridDim.y * N; cnt += blockIdx.z * gridDim.x;                             \
    }                                                                                          \
    nb = min(nb, 32);                                                                          \
    __shared__ __align__(16) u8 xs[2][NT * 8 * MH_XS];                                         \
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;      \
    const int nblk = K / 256, kblk = (K + 255) / 256, per = (kblk + gridDim.y - 1) / gridDim.y; \
    const int blk0 = blockIdx.y * per, blk1 = min(kblk, blk0 + per);                           \
    long long rows[2];                                                                         \
    for (int hh = 0; hh < 2; ++hh) rows[hh] = min(blockIdx.x * MH_ROWS + 16 * warp + g + 8 * hh, N - 1); \
    float acc[NT][4];                                                                          \
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

// Q4_K on raw 144-byte blocks: thread t takes bytes 8t..8t+7 of each 32-byte qs pair p, i.e.
// elements 8t.. of sub-block 2p (low nibbles) and of 2p + 1 (high nibbles); w = q·(d·sc) − dmin·m.
struct MhQ4K {
    uint4 hd[2];
    uint2 qv[2][4];
};

template <int NT>
__global__ void __launch_bounds__(256, NT >= 4 ? 1 : 2) mmh_q4_k(MH_ARGS) {
    PDL_ENTRY
    MH_PROLOGUE
    auto load = [&](MhQ4K& w, int blk) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const u8* b = p0 + (rows[hh] * nblk + blk) * 144;
            w.hd[hh] = __ldg((const uint4*)b);
#pragma unroll
            for (int p = 0; p < 4; ++p) w.qv[hh][p] = __ldg((const uint2*)(b + 16 + 32 * p + 8 * t));
        }
    };
    auto mul = [&](const MhQ4K& w, const u8* xb, int) {
        u32 sc[2][2], mn[2][2];  // [hh][j < 4 ? 0 : 1]: the 6-bit scales and minimums, a byte each
        float d[2], dm[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            k_scales_packed(w.hd[hh].y, w.hd[hh].z, w.hd[hh].w, sc[hh], mn[hh]);
            d[hh] = h2f((u16)(w.hd[hh].x & 0xFFFF));
            dm[hh] = h2f((u16)(w.hd[hh].x >> 16));
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // sub-block
            const int p = j >> 1, sh = 4 * (j & 1);
            u32 s2[2], o2[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int sj = (sc[hh][j >> 2] >> (8 * (j & 3))) & 0xFF, mj = (mn[hh][j >> 2] >> (8 * (j & 3))) & 0xFF;
                s2[hh] = h2dup(d[hh] * (float)sj);
                o2[hh] = h2dup(-dm[hh] * (float)mj);
            }
            uint4 xf[NT];
            mh_xfrag<NT>(xf, xb, 32 * j + 8 * t);
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                u32 a[4];
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
                    mh_arow<true>(a, hh, ((st ? w.qv[hh][p].y : w.qv[hh][p].x) >> sh) & 0x0F0F0F0Fu, 0x64006400u, s2[hh],
                                  o2[hh]);
                mh_mma<NT>(acc, a, xf, st);
            }
        }
    };
    mh_loop<NT, MhQ4K>(x, K, nb, blk0, blk1, xs, load, mul);
    mh_finish<NT>(acc, has_res ? res : nullptr, y, N, nb, part, cnt);
}

// Q6_K on planes: thread t takes bytes 8t..8t+7 of each half's ql (both 32-byte runs) and qh,
// i.e. elements 8t.. of its four quarters; w = (q − 32)·(d·sc), sc that of the element's
// 16-element sub-block (t < 2: the first of the quarter's two).
struct MhQ6K {
    uint2 l0[2][2], l1[2][2], qh[2][2];  // [hh][half]
    uint4 sc[2];
    u16 d[2];
};

template <int NT>
__global__ void __launch_bounds__(256, NT >= 4 ? 1 : 2) mmh_q6_k(MH_ARGS) {
    PDL_ENTRY
    MH_PROLOGUE
    auto load = [&](MhQ6K& w, int blk) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const long long r = rows[hh];
#pragma unroll
            for (int nh = 0; nh < 2; ++nh) {
                const u8* ql = p0 + r * (K / 2) + blk * 128 + 64 * nh + 8 * t;
                w.l0[hh][nh] = __ldg((const uint2*)ql);
                w.l1[hh][nh] = __ldg((const uint2*)(ql + 32));
                w.qh[hh][nh] = __ldg((const uint2*)(p1 + r * (K / 4) + blk * 64 + 32 * nh + 8 * t));
            }
            w.sc[hh] = __ldg((const uint4*)(p2 + r * (K / 16) + blk * 16));
            w.d[hh] = __ldg((const u16*)p3 + r * nblk + blk);
        }
    };
    auto mul = [&](const MhQ6K& w, const u8* xb, int) {
#pragma unroll
        for (int nh = 0; nh < 2; ++nh)
#pragma unroll
            for (int qq = 0; qq < 4; ++qq) {  // quarter: elements 128 nh + 32 qq + 8t ..
                u32 s2[2];
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const uint4 v = w.sc[hh];
                    const u32 sw = nh ? (qq < 2 ? v.z : v.w) : (qq < 2 ? v.x : v.y);  // scales 8nh + 2qq, + 1
                    const int sc = (signed char)((sw >> (8 * (2 * (qq & 1) + (t >> 1)))) & 0xFF);
                    s2[hh] = h2dup(h2f(w.d[hh]) * (float)sc);
                }
                uint4 xf[NT];
                mh_xfrag<NT>(xf, xb, 128 * nh + 32 * qq + 8 * t);
#pragma unroll
                for (int st = 0; st < 2; ++st) {
                    u32 a[4];
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const u32 L = st ? (qq & 1 ? w.l1[hh][nh].y : w.l0[hh][nh].y) : (qq & 1 ? w.l1[hh][nh].x : w.l0[hh][nh].x);
                        const u32 H = st ? w.qh[hh][nh].y : w.qh[hh][nh].x;
                        const u32 q = ((L >> (4 * (qq >> 1))) & 0x0F0F0F0Fu) | (((H >> (2 * qq)) << 4) & 0x30303030u);
                        mh_arow<false>(a, hh, q, 0x64206420u, s2[hh], 0);  // 1056 = 1024 + 32
                    }
                    mh_mma<NT>(acc, a, xf, st);
                }
            }
    };
    mh_loop<NT, MhQ6K>(x, K, nb, blk0, blk1, xs, load, mul);
    mh_finish<NT>(acc, has_res ? res : nullptr, y, N, nb, part, cnt);
}

// Q8_0 on planes: thread t takes bytes 8t..8t+7 of each 32-group (one 8-byte load), the
// block's 8 scales one 16-byte load; w = q·d (q + 128 as an unsigned byte: 1024 + 128 + q).
struct MhQ8 {
    uint2 q[2][8];  // [hh][group]
    uint4 d[2];     // 8 f16 scales
};

template <int NT>
__global__ void __launch_bounds__(256, NT >= 4 ? 1 : 2) mmh_q8_0(MH_ARGS) {
    PDL_ENTRY
    MH_PROLOGUE
    auto load = [&](MhQ8& w, int blk) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
            for (int gi = 0; gi < 8; ++gi) w.q[hh][gi] = __ldg((const uint2*)(p0 + rows[hh] * K + blk * 256 + 32 * gi + 8 * t));
            w.d[hh] = __ldg((const uint4*)((const u16*)p1 + rows[hh] * (K / 32) + blk * 8));
        }
    };
    auto mul = [&](const MhQ8& w, const u8* xb, int) {
#pragma unroll
        for (int gi = 0; gi < 8; ++gi) {
            u32 d2[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const uint4 v = w.d[hh];
                const u32 dw = (gi >> 1) == 0 ? v.x : (gi >> 1) == 1 ? v.y : (gi >> 1) == 2 ? v.z : v.w;
                const u32 h = (gi & 1) ? dw >> 16 : dw & 0xFFFF;
                d2[hh] = h | (h << 16);
            }
            uint4 xf[NT];
            mh_xfrag<NT>(xf, xb, 32 * gi + 8 * t);
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                u32 a[4];
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)  // 1152 = 1024 + 128
                    mh_arow<false>(a, hh, (st ? w.q[hh][gi].y : w.q[hh][gi].x) ^ 0x80808080u, 0x64806480u, d2[hh], 0);
                mh_mma<NT>(acc, a, xf, st);
            }
        }
    };
    mh_loop<NT, MhQ8>(x, K, nb, blk0, blk1, xs, load, mul);
    mh_finish<NT>(acc, has_res ? res : nullptr, y, N, nb, part, cnt);
}

// Q4_1 on raw 20-byte blocks (d, m as f16, then 16 bytes of nibbles: element i < 16 the low
// nibble of byte i, i >= 16 the high nibble of byte i - 16). K is any multiple of 32: the last
// 256-block may be partial, its missing groups zero weights against zero activations
// (mh_load_x). Thread t takes elements 8t..8t+7 of each group: bytes 8(t & 1).. of its nibbles,
// shifted by 4(t >> 1); w = q·d + m in one f16 rounding (d and m are f16 already). The nibbles
// are loaded a block ahead (mh_loop); d and m when multiplying, from the lines those loads
// brought into L1 (prefetched too, they spill at 2 batch tiles).
struct MhQ41 {
    uint2 q[2][8];  // [hh][group]
};

template <int NT>
__global__ void __launch_bounds__(256, NT >= 4 ? 1 : 2) mmh_q4_1(MH_ARGS) {
    PDL_ENTRY
    MH_PROLOGUE
    const int groups = K / 32;
    const long long rb = (long long)groups * 20;  // bytes of a row: 4-aligned, as every block's fields
    const u8* rp[2] = {p0 + rows[0] * rb, p0 + rows[1] * rb};
    auto load = [&](MhQ41& w, int blk) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int gi = 0; gi < 8; ++gi) {
                const int gr = blk * 8 + gi;
                const u8* b = rp[hh] + gr * 20LL + 4 + 8 * (t & 1);
                w.q[hh][gi] = gr < groups ? make_uint2(__ldg((const u32*)b), __ldg((const u32*)(b + 4))) : make_uint2(0u, 0u);
            }
    };
    auto mul = [&](const MhQ41& w, const u8* xb, int blk) {
        const int sh = 4 * (t >> 1);
#pragma unroll
        for (int gi = 0; gi < 8; ++gi) {
            const int gr = blk * 8 + gi;
            u32 d2[2], m2[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const u32 v = gr < groups ? __ldg((const u32*)(rp[hh] + gr * 20LL)) : 0u;  // zero weights past K
                d2[hh] = (v & 0xFFFFu) | (v << 16);
                m2[hh] = (v >> 16) | (v & 0xFFFF0000u);
            }
            uint4 xf[NT];
            mh_xfrag<NT>(xf, xb, 32 * gi + 8 * t);
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                u32 a[4];
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)  // 1024 + q, q = 0..15
                    mh_arow<true>(a, hh, ((st ? w.q[hh][gi].y : w.q[hh][gi].x) >> sh) & 0x0F0F0F0Fu, 0x64006400u, d2[hh],
                                  m2[hh]);
                mh_mma<NT>(acc, a, xf, st);
            }
        }
    };
    mh_loop<NT, MhQ41>(x, K, nb, blk0, blk1, xs, load, mul);
    mh_finish<NT>(acc, has_res ? res : nullptr, y, N, nb, part, cnt);
}
