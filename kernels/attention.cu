// Attention over the F16 KV cache (slots, max_ctx, n_kv, head_dim) of one layer.
//
// kv_append: row r's k and v (f32, row strides ldk, ldv) go to the cache at [slot[r], pos[r]].
// rope_kv (the decode step's): RoPE of q and k in place, and k, v appended to the cache, in one launch.
// attn_partial<ND>: one warp per (row, head, split). Row r's positions 0..pos[r] are cut into
//   n_splits splits of ceil((pos[r] + 1) / n_splits) positions, so a short context spreads over
//   many warps as well as a long one; each warp runs an online softmax over its split, 8 positions
//   per step, and writes the split's max m, sum l and unnormalised output o. Empty splits write
//   m = -inf. Lane l holds dims l*ND .. l*ND+ND-1 (ND = head_dim / 32), loaded as one vector.
// attn_combine: one warp per (row, head) merges the non-empty splits into out (N, n_heads * head_dim)
//   and, with has_q, writes out quantized for the int8 matvecs (quant_act.cuh, prepended).
// head_dim is a multiple of 32, at most 256.


__global__ void kv_append(const float* __restrict__ k, int ldk, const float* __restrict__ v, int ldv,
                          u16* kc, u16* vc, const int* __restrict__ slot, const int* __restrict__ pos,
                          int N, int kv_dim, int max_ctx) {
    PDL_ENTRY
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)N * kv_dim) return;
    int r = (int)(t / kv_dim), c = (int)(t % kv_dim);
    long long dst = ((long long)slot[r] * max_ctx + pos[r]) * kv_dim + c;
    kc[dst] = f2h(k[(long long)r * ldk + c]);
    vc[dst] = f2h(v[(long long)r * ldv + c]);
}

#define MAXD 8

// Positions per split for a row of len positions: an even share of n_splits, and at least 8
// when there are many (row, head) pairs. Measured on the 8B decode step (H200, 2026-11-29): for
// 1 row, a floor of 8 made attention slower (fewer warps, each with more dependent work); for
// 16 rows, no floor made it slower (many warps for one position each).
__device__ __forceinline__ int split_len(int len, int n_splits, int pairs) {
    return max(pairs >= 256 ? 8 : 1, (len + n_splits - 1) / n_splits);
}

// RoPE of one row's n_heads q heads and n_kv k heads (k right after q, row stride ld), then k
// and v to the cache at [slot[r], pos[r]]. Threads: rows × (q pairs + k pairs + v pairs).
// Angles as in rope.cu (double, like the CPU reference).
__global__ void rope_kv(float* q, int ld, const float* __restrict__ v, int ldv, u16* kc, u16* vc,
                        const int* __restrict__ slot, const int* __restrict__ pos, const double* __restrict__ freqs,
                        int N, int n_heads, int n_kv, int head_dim, int rope_dim, int neox, int max_ctx) {
    PDL_ENTRY
    const int half = rope_dim / 2, hp = head_dim / 2;
    const int qk_pairs = (n_heads + n_kv) * hp, per_row = qk_pairs + n_kv * hp;
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)N * per_row) return;
    const int r = (int)(t / per_row), j = (int)(t % per_row);
    const int kv_dim = n_kv * head_dim;
    u16* kcr = kc + ((long long)slot[r] * max_ctx + pos[r]) * kv_dim;
    if (j >= qk_pairs) {  // v: two elements
        int e = 2 * (j - qk_pairs);
        const float* vr = v + (long long)r * ldv;
        u16* vcr = vc + ((long long)slot[r] * max_ctx + pos[r]) * kv_dim;
        vcr[e] = f2h(vr[e]);
        vcr[e + 1] = f2h(vr[e + 1]);
        return;
    }
    const int h = j / hp, p = j % hp;  // head (q heads, then k heads), pair within the head
    float* x = q + (long long)r * ld + (long long)h * head_dim;
    int ia, ib;
    float a, b;
    if (p < half) {  // a rotated pair
        ia = neox ? p : 2 * p;
        ib = neox ? p + half : 2 * p + 1;
        double s, c;
        sincos((double)pos[r] * freqs[p], &s, &c);
        const float cf = (float)c, sf = (float)s;
        const float x0 = x[ia], x1 = x[ib];
        a = x0 * cf - x1 * sf;
        b = x0 * sf + x1 * cf;
        x[ia] = a;
        x[ib] = b;
    } else {  // the unrotated tail (rope_dim < head_dim)
        ia = 2 * p;
        ib = 2 * p + 1;
        a = x[ia];
        b = x[ib];
    }
    if (h >= n_heads) {
        u16* kh = kcr + (h - n_heads) * head_dim;
        kh[ia] = f2h(a);
        kh[ib] = f2h(b);
    }
}

// ND consecutive f16 (one vector load) as float.
template <int ND> __device__ __forceinline__ void load_h(const u16* p, float* out) {
    if constexpr (ND == 1) {
        out[0] = h2f(*p);
    } else if constexpr (ND == 2) {
        u32 w = *(const u32*)p;
        out[0] = h2f((u16)(w & 0xFFFF)); out[1] = h2f((u16)(w >> 16));
    } else if constexpr (ND == 4) {
        uint2 w = *(const uint2*)p;
        out[0] = h2f((u16)(w.x & 0xFFFF)); out[1] = h2f((u16)(w.x >> 16));
        out[2] = h2f((u16)(w.y & 0xFFFF)); out[3] = h2f((u16)(w.y >> 16));
    } else {
        uint4 w = *(const uint4*)p;
        const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) { out[2 * i] = h2f((u16)(ws[i] & 0xFFFF)); out[2 * i + 1] = h2f((u16)(ws[i] >> 16)); }
    }
}

template <int ND>
__global__ void __launch_bounds__(128) attn_partial(
        const float* __restrict__ q, int ldq, const u16* __restrict__ kc, const u16* __restrict__ vc,
        const int* __restrict__ slot, const int* __restrict__ pos, float* __restrict__ pm,
        float* __restrict__ pl, float* __restrict__ po, int N, int n_heads, int n_kv, int max_ctx,
        int n_splits, float scale) {
    PDL_ENTRY
    constexpr int HD = 32 * ND;
    const int warp = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const int split = blockIdx.y;
    if (warp >= N * n_heads) return;
    const int r = warp / n_heads, h = warp % n_heads;
    const int kvh = h / (n_heads / n_kv);
    const long long pidx = ((long long)r * n_heads + h) * n_splits + split;
    const int len = pos[r] + 1, sl = split_len(len, n_splits, N * n_heads);
    const int t0 = split * sl, t1 = min(len, t0 + sl);
    if (t0 >= t1) {
        if (lane == 0) { pm[pidx] = -INFINITY; pl[pidx] = 0.f; }
        return;
    }
    float qv[ND], o[ND];
    const float* qr = q + (long long)r * ldq + (long long)h * HD + lane * ND;
#pragma unroll
    for (int i = 0; i < ND; ++i) { qv[i] = qr[i] * scale; o[i] = 0.f; }
    float m = -INFINITY, l = 0.f;
    const long long kv_dim = (long long)n_kv * HD;
    const long long base = (long long)slot[r] * max_ctx * kv_dim + kvh * HD + lane * ND;
    const u16* kb = kc + base;
    const u16* vb = vc + base;
    // CH positions per step: their K loads (then V loads) are independent and issued together.
    constexpr int CH = 8;
    for (int t = t0; t < t1; t += CH) {
        float s[CH];
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            s[j] = 0.f;
            if (t + j < t1) {
                float kv[ND];
                load_h<ND>(kb + (long long)(t + j) * kv_dim, kv);
#pragma unroll
                for (int i = 0; i < ND; ++i) s[j] = fmaf(qv[i], kv[i], s[j]);
            }
        }
#pragma unroll
        for (int off = 16; off; off >>= 1)
#pragma unroll
            for (int j = 0; j < CH; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], off);
        float mn = m;
#pragma unroll
        for (int j = 0; j < CH; ++j) if (t + j < t1) mn = fmaxf(mn, s[j]);
        const float corr = __expf(m - mn);
        l *= corr;
#pragma unroll
        for (int i = 0; i < ND; ++i) o[i] *= corr;
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            if (t + j < t1) {
                const float p = __expf(s[j] - mn);
                l += p;
                float vv[ND];
                load_h<ND>(vb + (long long)(t + j) * kv_dim, vv);
#pragma unroll
                for (int i = 0; i < ND; ++i) o[i] = fmaf(p, vv[i], o[i]);
            }
        }
        m = mn;
    }
    if (lane == 0) { pm[pidx] = m; pl[pidx] = l; }
    float* orow = po + pidx * HD + lane * ND;
#pragma unroll
    for (int i = 0; i < ND; ++i) orow[i] = o[i];
}

// One 128-thread block per (row, head): the four warps take splits w, w + 4, ... (each lane its
// dims lane + 32 i), the split weights exp(m_s - M) computed once per split by the lanes, and the
// warps' sums meet in shared memory.
__global__ void __launch_bounds__(128) attn_combine(
        const float* __restrict__ pm, const float* __restrict__ pl, const float* __restrict__ po,
        float* __restrict__ out, const int* __restrict__ pos, int N, int n_heads, int head_dim, int n_splits,
        signed char* qh, signed char* ql, float* qd, float* qs, int has_q) {
    PDL_ENTRY
    const int rh = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = rh / n_heads;
    const int len = pos[r] + 1, sl = split_len(len, n_splits, N * n_heads);
    const int active = (len + sl - 1) / sl;  // the non-empty splits (≤ n_splits ≤ 64)
    const long long base = (long long)rh * n_splits;
    const float m0 = lane < active ? pm[base + lane] : -INFINITY;
    const float m1 = lane + 32 < active ? pm[base + lane + 32] : -INFINITY;
    float M = fmaxf(m0, m1);
#pragma unroll
    for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    const float w0 = lane < active ? __expf(m0 - M) : 0.f, w1 = lane + 32 < active ? __expf(m1 - M) : 0.f;
    float L = (lane < active ? w0 * pl[base + lane] : 0.f) + (lane + 32 < active ? w1 * pl[base + lane + 32] : 0.f);
#pragma unroll
    for (int o = 16; o; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    const int nd = head_dim >> 5;
    float acc[MAXD];
#pragma unroll
    for (int i = 0; i < MAXD; ++i) acc[i] = 0.f;
#pragma unroll 4
    for (int s = warp; s < active; s += 4) {
        const float w = __shfl_sync(0xffffffffu, s < 32 ? w0 : w1, s & 31);
        const float* os = po + (base + s) * head_dim;
#pragma unroll
        for (int i = 0; i < MAXD; ++i) if (i < nd) acc[i] = fmaf(w, os[lane + 32 * i], acc[i]);
    }
    __shared__ float part[4][256];
#pragma unroll
    for (int i = 0; i < MAXD; ++i) if (i < nd) part[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    if (warp) return;
    const float inv = 1.0f / L;
    const long long row0 = (long long)rh * head_dim;  // (r, h) → r * n_heads * hd + h * hd
#pragma unroll
    for (int i = 0; i < MAXD; ++i) {
        if (i < nd) {
            const int d = lane + 32 * i;
            const float v = (part[0][d] + part[1][d] + part[2][d] + part[3][d]) * inv;
            out[row0 + d] = v;
            if (has_q) quant32(v, qh, ql, qd, qs, row0 + d, (row0 >> 5) + i);  // one 32-group per i
        }
    }
}
