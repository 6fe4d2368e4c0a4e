// Attention over the F16 KV cache (slots, max_ctx, n_kv, head_dim) of one layer.
//
// kv_append: row r's k and v (f32, row strides ldk, ldv) go to the cache at [slot[r], pos[r]].
// attn_partial: one warp per (row, head, split); row r attends causally to positions
//   split*split_len .. min(pos[r], split end) of its slot, online softmax; writes the split's
//   max m, sum l and unnormalised output o, 8 positions per step. Splits beyond pos[r] write m = -inf.
// attn_combine: one warp per (row, head) merges its splits into out (N, n_heads * head_dim).
// head_dim is a multiple of 32, at most 256: each lane holds head_dim / 32 dims (lane + 32 i).

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned short u16;

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__global__ void kv_append(const float* __restrict__ k, int ldk, const float* __restrict__ v, int ldv,
                          u16* kc, u16* vc, const int* __restrict__ slot, const int* __restrict__ pos,
                          int N, int kv_dim, int max_ctx) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)N * kv_dim) return;
    int r = (int)(t / kv_dim), c = (int)(t % kv_dim);
    long long dst = ((long long)slot[r] * max_ctx + pos[r]) * kv_dim + c;
    kc[dst] = f2h(k[(long long)r * ldk + c]);
    vc[dst] = f2h(v[(long long)r * ldv + c]);
}

#define MAXD 8

__global__ void __launch_bounds__(128) attn_partial(
        const float* __restrict__ q, int ldq, const u16* __restrict__ kc, const u16* __restrict__ vc,
        const int* __restrict__ slot, const int* __restrict__ pos, float* __restrict__ pm,
        float* __restrict__ pl, float* __restrict__ po, int N, int n_heads, int n_kv, int head_dim,
        int max_ctx, int split_len, int n_splits, float scale) {
    int warp = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int split = blockIdx.y;
    if (warp >= N * n_heads) return;
    int r = warp / n_heads, h = warp % n_heads;
    int kvh = h / (n_heads / n_kv);
    int nd = head_dim >> 5;
    long long pidx = ((long long)r * n_heads + h) * n_splits + split;
    int t0 = split * split_len, t1 = min(pos[r] + 1, t0 + split_len);
    if (t0 >= t1) {
        if (lane == 0) { pm[pidx] = -INFINITY; pl[pidx] = 0.f; }
        return;
    }
    float qv[MAXD], o[MAXD];
    const float* qr = q + (long long)r * ldq + (long long)h * head_dim;
#pragma unroll
    for (int i = 0; i < MAXD; ++i) { qv[i] = i < nd ? qr[lane + 32 * i] * scale : 0.f; o[i] = 0.f; }
    float m = -INFINITY, l = 0.f;
    long long kv_dim = (long long)n_kv * head_dim;
    const u16* kb = kc + (long long)slot[r] * max_ctx * kv_dim + kvh * head_dim + lane;
    const u16* vb = vc + (long long)slot[r] * max_ctx * kv_dim + kvh * head_dim + lane;
    // CH positions per step: their K and V loads are independent and issued together, so a
    // split costs a few memory latencies instead of one per position.
    constexpr int CH = 8;
    for (int t = t0; t < t1; t += CH) {
        float s[CH];
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            s[j] = 0.f;
            if (t + j < t1) {
                const u16* kt = kb + (long long)(t + j) * kv_dim;
#pragma unroll
                for (int i = 0; i < MAXD; ++i) if (i < nd) s[j] = fmaf(qv[i], h2f(kt[32 * i]), s[j]);
            }
        }
#pragma unroll
        for (int off = 16; off; off >>= 1)
#pragma unroll
            for (int j = 0; j < CH; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], off);
        float mn = m;
#pragma unroll
        for (int j = 0; j < CH; ++j) if (t + j < t1) mn = fmaxf(mn, s[j]);
        float corr = __expf(m - mn);
        l *= corr;
#pragma unroll
        for (int i = 0; i < MAXD; ++i) o[i] *= corr;
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            if (t + j < t1) {
                float p = __expf(s[j] - mn);
                l += p;
                const u16* vt = vb + (long long)(t + j) * kv_dim;
#pragma unroll
                for (int i = 0; i < MAXD; ++i) if (i < nd) o[i] = fmaf(p, h2f(vt[32 * i]), o[i]);
            }
        }
        m = mn;
    }
    if (lane == 0) { pm[pidx] = m; pl[pidx] = l; }
    float* orow = po + pidx * head_dim;
#pragma unroll
    for (int i = 0; i < MAXD; ++i) if (i < nd) orow[lane + 32 * i] = o[i];
}

__global__ void __launch_bounds__(128) attn_combine(
        const float* __restrict__ pm, const float* __restrict__ pl, const float* __restrict__ po,
        float* __restrict__ out, int N, int n_heads, int head_dim, int n_splits) {
    int warp = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (warp >= N * n_heads) return;
    long long base = (long long)warp * n_splits;
    float M = -INFINITY;
    for (int s = 0; s < n_splits; ++s) M = fmaxf(M, pm[base + s]);
    int nd = head_dim >> 5;
    float acc[MAXD], L = 0.f;
#pragma unroll
    for (int i = 0; i < MAXD; ++i) acc[i] = 0.f;
    for (int s = 0; s < n_splits; ++s) {
        float ms = pm[base + s];
        if (ms == -INFINITY) continue;
        float w = __expf(ms - M);
        L = fmaf(w, pl[base + s], L);
        const float* os = po + (base + s) * head_dim;
#pragma unroll
        for (int i = 0; i < MAXD; ++i) if (i < nd) acc[i] = fmaf(w, os[lane + 32 * i], acc[i]);
    }
    float inv = 1.0f / L;
    float* orow = out + (long long)warp * head_dim;  // (r, h) → r * n_heads * hd + h * hd
#pragma unroll
    for (int i = 0; i < MAXD; ++i) if (i < nd) orow[lane + 32 * i] = acc[i] * inv;
}
