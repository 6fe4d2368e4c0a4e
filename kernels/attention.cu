// Attention over one layer's paged KV cache (engine/kv_cache.py's layout): k and v each
// (n_blocks, n_kv, KV_BLOCK, row), a row one position of one head: head_dim f16 values, or (Q8)
// head_dim / 32 GGUF Q8_0 blocks of 34 bytes (an f16 scale d, 32 int8 quants; value = q * d).
// A sequence slot's blocks are its row of the block table (tables, n_slots × max_blocks int32):
// position p of slot s, head h is row [tables[s * max_blocks + p / KV_BLOCK], h, p % KV_BLOCK].
// Every kernel here takes the table and the storage type (template Q8), and reads rows through
// it; q8 rows are read as they are stored (q * d per value), never copied out dequantized.
// Writes round as the host cache does: f16 round-to-nearest, Q8_0 as gguf.quants.quantize.
//
// kv_append<Q8>: row r's k and v (f32, row strides ldk, ldv) go to the cache at (slot[r], pos[r]).
// attn_decode<ND, Q8> (the captured decode step's): RoPE, cache append, attn_partial and attn_combine
//   in one launch (below). The separate kernels serve eager steps and NTX_ATTN_ONE_LAUNCH=0:
// rope_kv: RoPE of q and k in place, and (f16 caches) k, v appended to the cache, in one launch.
// attn_partial<ND, Q8>: one warp per (row, head, split). Row r's positions 0..pos[r] are cut into
//   n_splits splits of ceil((pos[r] + 1) / n_splits) positions, so a short context spreads over
//   many warps as well as a long one; each warp runs an online softmax over its split, 8 positions
//   per step, and writes the split's max m, sum l and unnormalised output o. Empty splits write
//   m = -inf. Lane l holds dims l*ND .. l*ND+ND-1 (ND = head_dim / 32), loaded as one vector.
// attn_combine: one warp per (row, head) merges the non-empty splits into out (N, n_heads * head_dim)
//   and, with has_q, writes out quantized for the int8 matvecs (quant_act.cuh, prepended).
// head_dim is a multiple of 32, at most 256.

#define KV_BLOCK 16  // positions per block (kv_cache.BLOCK_SIZE)
#define Q8_BYTES 34  // one Q8_0 block: f16 scale, 32 int8

// Bytes of one (position, head) row.
template <int Q8> __device__ __forceinline__ int kv_row_bytes(int head_dim) {
    return Q8 ? head_dim / 32 * Q8_BYTES : head_dim * 2;
}

// Byte offset of position p, kv head kvh of the slot whose table row is tab.
__device__ __forceinline__ long long kv_row(const int* __restrict__ tab, int p, int n_kv, int kvh, int row_bytes) {
    const long long b = tab[p / KV_BLOCK];
    return ((b * n_kv + kvh) * KV_BLOCK + p % KV_BLOCK) * row_bytes;
}

// GGUF Q8_0's arithmetic (gguf.quants, ggml's reference), bit for bit: d = amax / 127 in f32,
// stored as f16; each quant is round-half-away-from-zero of x * (1 / d) (0 where d is 0).
__device__ __forceinline__ float q8_inv(float amax, u16& dh) {
    const float d = amax / 127.f;
    dh = f2h(d);
    return d == 0.f ? 0.f : 1.f / d;
}

__device__ __forceinline__ signed char q8_round(float x) {
    const float a = fabsf(x), f = floorf(a);
    const float b = f + floorf(2.f * (a - f));
    return (signed char)(int)(x < 0.f ? -b : b);
}

// One Q8_0 block of the 32 values at x, written at blk (thread-wise).
__device__ __forceinline__ void q8_store_group(const float* __restrict__ x, u8* blk) {
    float amax = 0.f;
#pragma unroll 8
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
    u16 dh;
    const float id = q8_inv(amax, dh);
    *(u16*)blk = dh;
    signed char* qs = (signed char*)(blk + 2);
#pragma unroll 8
    for (int i = 0; i < 32; ++i) qs[i] = q8_round(x[i] * id);
}

// A warp's head row held ND values per lane (lane l: dims l*ND ..): each 32 / ND lanes make one
// Q8_0 block. x becomes the values as the cache holds them (q * d); with write, the row goes to
// row (its byte address). Every lane of the warp calls it.
template <int ND> __device__ __forceinline__ void q8_store_warp(float (&x)[ND], int lane, u8* row, bool write) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < ND; ++i) amax = fmaxf(amax, fabsf(x[i]));
#pragma unroll
    for (int off = 16 / ND; off; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    u16 dh;
    const float id = q8_inv(amax, dh), d = h2f(dh);
    const int e0 = lane * ND;
    u8* blk = row + (e0 >> 5) * Q8_BYTES;
#pragma unroll
    for (int i = 0; i < ND; ++i) {
        const signed char q = q8_round(x[i] * id);
        if (write) ((signed char*)blk)[2 + (e0 & 31) + i] = q;
        x[i] = (float)q * d;
    }
    if (write && (e0 & 31) == 0) *(u16*)blk = dh;
}

// Threads: one per value (f16) or per 32-value block (Q8) of each row's n_kv heads.
template <int Q8>
__global__ void kv_append(const float* __restrict__ k, int ldk, const float* __restrict__ v, int ldv,
                          u8* kc, u8* vc, const int* __restrict__ tables, int max_blocks,
                          const int* __restrict__ slot, const int* __restrict__ pos, int N, int n_kv, int head_dim) {
    PDL_ENTRY
    const int per = Q8 ? head_dim / 32 : head_dim, per_row = n_kv * per;
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)N * per_row) return;
    const int r = (int)(t / per_row), j = (int)(t % per_row), h = j / per, c = j % per;
    const long long off = kv_row(tables + (long long)slot[r] * max_blocks, pos[r], n_kv, h,
                                 kv_row_bytes<Q8>(head_dim));
    const long long col = (long long)h * head_dim + (Q8 ? 32 * c : c);
    if constexpr (Q8) {
        q8_store_group(k + (long long)r * ldk + col, kc + off + (long long)c * Q8_BYTES);
        q8_store_group(v + (long long)r * ldv + col, vc + off + (long long)c * Q8_BYTES);
    } else {
        ((u16*)(kc + off))[c] = f2h(k[(long long)r * ldk + col]);
        ((u16*)(vc + off))[c] = f2h(v[(long long)r * ldv + col]);
    }
}

#define MAXD 8

// Positions per split for a row of len positions: an even share of n_splits, and at least 8
// when there are many (row, head) pairs: for one row a floor of 8 leaves fewer warps, each with
// more dependent work; for many rows no floor gives many warps with one position each.
__device__ __forceinline__ int split_len(int len, int n_splits, int pairs) {
    return max(pairs >= 256 ? 8 : 1, (len + n_splits - 1) / n_splits);
}

// RoPE of one row's n_heads q heads and n_kv k heads (k right after q, row stride ld), then
// (with write: f16 caches; a Q8 cache takes kv_append<1> after it) k and v to the cache at
// (slot[r], pos[r]). Threads: rows × (q pairs + k pairs + v pairs). Angles as in rope.cu
// (double, like the CPU reference).
__global__ void rope_kv(float* q, int ld, const float* __restrict__ v, int ldv, u8* kc, u8* vc,
                        const int* __restrict__ tables, int max_blocks, const int* __restrict__ slot,
                        const int* __restrict__ pos, const double* __restrict__ freqs,
                        int N, int n_heads, int n_kv, int head_dim, int rope_dim, int neox, int write) {
    PDL_ENTRY
    const int half = rope_dim / 2, hp = head_dim / 2;
    const int qk_pairs = (n_heads + n_kv) * hp, per_row = qk_pairs + n_kv * hp;
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)N * per_row) return;
    const int r = (int)(t / per_row), j = (int)(t % per_row);
    const int* tab = tables + (long long)slot[r] * max_blocks;
    if (j >= qk_pairs) {  // v: two elements
        if (!write) return;
        const int e = 2 * (j - qk_pairs), vh = e / head_dim, c = e % head_dim;
        const float* vr = v + (long long)r * ldv;
        u16* vcr = (u16*)(vc + kv_row(tab, pos[r], n_kv, vh, 2 * head_dim));
        vcr[c] = f2h(vr[e]);
        vcr[c + 1] = f2h(vr[e + 1]);
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
    if (write && h >= n_heads) {
        u16* kh = (u16*)(kc + kv_row(tab, pos[r], n_kv, h - n_heads, 2 * head_dim));
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
    } else if constexpr (ND != 8) {  // head_dim 96, 160, ...: no vector load fits
#pragma unroll
        for (int i = 0; i < ND; ++i) out[i] = h2f(p[i]);
    } else {
        uint4 w = *(const uint4*)p;
        const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) { out[2 * i] = h2f((u16)(ws[i] & 0xFFFF)); out[2 * i + 1] = h2f((u16)(ws[i] >> 16)); }
    }
}

// Lane `lane`'s ND values (dims lane*ND ..) of the row at `row` (its byte address) as float:
// one vector load of f16, or (Q8) the quants times their block's scale, as gguf dequantizes.
template <int ND, int Q8> __device__ __forceinline__ void load_row(const u8* row, int lane, float* out) {
    if constexpr (Q8) {
        const int e0 = lane * ND;
        const u8* blk = row + (e0 >> 5) * Q8_BYTES;
        const float d = h2f(*(const u16*)blk);
        const signed char* qs = (const signed char*)(blk + 2 + (e0 & 31));
#pragma unroll
        for (int i = 0; i < ND; ++i) out[i] = (float)qs[i] * d;
    } else {
        load_h<ND>((const u16*)row + lane * ND, out);
    }
}

// One step of the online softmax over positions t .. t+CH-1, those before t_end real: the lanes' partial scores
// summed across the warp (every lane gets them), then l and o rescaled from the running max m
// to the new one, which is returned (m itself is left for the caller to update).
template <int CH, int ND>
__device__ __forceinline__ float online_rescale(float (&s)[CH], int t, int t_end, float m, float& l, float (&o)[ND]) {
#pragma unroll
    for (int off = 16; off; off >>= 1)
#pragma unroll
        for (int j = 0; j < CH; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], off);
    float mn = m;
#pragma unroll
    for (int j = 0; j < CH; ++j) if (t + j < t_end) mn = fmaxf(mn, s[j]);
    const float corr = __expf(m - mn);
    l *= corr;
#pragma unroll
    for (int i = 0; i < ND; ++i) o[i] *= corr;
    return mn;
}

template <int ND, int Q8>
__global__ void __launch_bounds__(128) attn_partial(
        const float* __restrict__ q, int ldq, const u8* __restrict__ kc, const u8* __restrict__ vc,
        const int* __restrict__ tables, int max_blocks, const int* __restrict__ slot, const int* __restrict__ pos,
        float* __restrict__ pm, float* __restrict__ pl, float* __restrict__ po, int N, int n_heads, int n_kv,
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
    const int* tab = tables + (long long)slot[r] * max_blocks;
    const int rb = kv_row_bytes<Q8>(HD);
    // CH positions per step: their K loads (then V loads) are independent and issued together.
    constexpr int CH = 8;
    for (int t = t0; t < t1; t += CH) {
        float s[CH];
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            s[j] = 0.f;
            if (t + j < t1) {
                float kv[ND];
                load_row<ND, Q8>(kc + kv_row(tab, t + j, n_kv, kvh, rb), lane, kv);
#pragma unroll
                for (int i = 0; i < ND; ++i) s[j] = fmaf(qv[i], kv[i], s[j]);
            }
        }
        const float mn = online_rescale<CH, ND>(s, t, t1, m, l, o);
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            if (t + j < t1) {
                const float p = __expf(s[j] - mn);
                l += p;
                float vv[ND];
                load_row<ND, Q8>(vc + kv_row(tab, t + j, n_kv, kvh, rb), lane, vv);
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

// The merge weights of `active` (≤ 64) splits of one (row, head) whose partials start at base:
// lane i's splits i and i + 32 get w0, w1 = exp(m - M) (M the largest m), and every lane gets
// L = the sum of w * l. CG: read through L2 only (partials written earlier by this same grid).
template <bool CG>
__device__ __forceinline__ void split_weights(const float* pm, const float* pl, long long base, int active, int lane,
                                              float& w0, float& w1, float& L) {
    auto ld = [](const float* p) { return CG ? __ldcg(p) : *p; };
    const float m0 = lane < active ? ld(pm + base + lane) : -INFINITY;
    const float m1 = lane + 32 < active ? ld(pm + base + lane + 32) : -INFINITY;
    float M = fmaxf(m0, m1);
#pragma unroll
    for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    w0 = lane < active ? __expf(m0 - M) : 0.f;
    w1 = lane + 32 < active ? __expf(m1 - M) : 0.f;
    L = (lane < active ? w0 * ld(pl + base + lane) : 0.f) + (lane + 32 < active ? w1 * ld(pl + base + lane + 32) : 0.f);
#pragma unroll
    for (int o = 16; o; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
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
    float w0, w1, L;
    split_weights<false>(pm, pl, base, active, lane, w0, w1, L);
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

// ---- the decode step's attention in one launch --------------------------------------------
// attn_decode<ND> = rope_kv + attn_partial + attn_combine: grid and warps as attn_partial (a warp
// per (row, head, split)), rows of qkv holding q then k (row stride ld), v at row stride ldv.
// A warp rotates its q head in registers (the angles of its row in a per-warp table; q is not
// written back). The warps whose split holds the new position (pos[r]) rotate its k head too and
// take k and v from registers, rounded through f16 as the cache holds them; the first q head of
// each kv group also writes them to the cache. Every other position comes from the cache
// (written by earlier steps, never by this launch). Partials go to the scratch as attn_partial's;
// the last block of each grid column to finish (cnt[blockIdx.x] counts them; that block resets
// it, so graph replays find it zero) merges every split of its four heads as attn_combine does.
// Blocks past the last non-empty split of their rows return at once (a grid sized for the
// longest context is mostly such blocks while contexts are short).

// attn_decode's positions per split: at least 8 (a warp loads 8 positions at once, so up to 8
// cost about what one does, and the merge, in one block, reads fewer splits).
__device__ __forceinline__ int decode_split_len(int len, int n_splits) {
    return max(8, (len + n_splits - 1) / n_splits);
}

// Element d of the head in s (head_dim floats) after RoPE with the angles cs[p] = (cos, sin) of
// pair p (rope.cu's pairing and arithmetic).
__device__ __forceinline__ float rope_elem(const float* s, const float2* cs, int d, int rope_dim, int neox) {
    if (d >= rope_dim) return s[d];  // the unrotated tail
    const int half = rope_dim / 2;
    const int p = neox ? (d < half ? d : d - half) : d >> 1;
    const int ia = neox ? p : 2 * p, ib = neox ? p + half : 2 * p + 1;
    const float x0 = s[ia], x1 = s[ib], cf = cs[p].x, sf = cs[p].y;
    return d == ia ? x0 * cf - x1 * sf : x0 * sf + x1 * cf;
}

template <int ND, int Q8>
__global__ void __launch_bounds__(128) attn_decode(
        const float* __restrict__ qkv, int ld, const float* __restrict__ v, int ldv, u8* kc, u8* vc,
        const int* __restrict__ tables, int max_blocks, const int* __restrict__ slot, const int* __restrict__ pos,
        const double* __restrict__ freqs, float* pm, float* pl, float* po, int* cnt, float* __restrict__ out,
        int N, int n_heads, int n_kv, int n_splits, float scale, int rope_dim, int neox,
        signed char* qh, signed char* ql, float* qd, float* qs, int has_q) {
    // Before pdl_wait, only what no kernel of this step writes: slot and pos (set before the
    // step), the angles, and the cached positions (earlier steps); q, k, v, the scratch and the
    // counters come after it. At short contexts the whole split is loaded during the matvec.
    pdl_launch_next();
    constexpr int HD = 32 * ND;
    constexpr int CH = ND >= 8 ? 4 : 8;  // positions per step, their K and V loads issued together
    __shared__ float sq[4][HD], sk[4][HD];
    __shared__ float2 scs[4][HD / 2];
    __shared__ int last;
    const int wib = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warp = blockIdx.x * 4 + wib, split = blockIdx.y;
    // The grid has n_splits splits for the longest context; a block past the last non-empty split
    // of all its rows (its four warps may be different rows) has nothing to do and leaves at
    // once, and the merge waits for the `need` blocks before it only.
    int need = 0;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const int wg = blockIdx.x * 4 + w;
        if (wg < N * n_heads) {
            const int ln = pos[wg / n_heads] + 1, sw = decode_split_len(ln, n_splits);
            need = max(need, (ln + sw - 1) / sw);
        }
    }
    if (split >= need) return;
    const bool live = warp < N * n_heads;
    const int r = live ? warp / n_heads : 0, h = warp % n_heads, group = n_heads / n_kv, kvh = h / group;
    const int p_now = pos[r], len = p_now + 1, sl = decode_split_len(len, n_splits);
    const int t0 = split * sl, t1 = min(len, t0 + sl);
    const bool has_new = t1 == len;  // this split ends at the new position
    const int tc = has_new ? t1 - 1 : t1;  // cached positions [t0, tc)
    const int* tab = tables + (long long)slot[r] * max_blocks;
    const int rb = kv_row_bytes<Q8>(HD);
    float kv[CH][ND], vv[CH][ND];
    auto load_chunk = [&](int t) {
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            const long long o_ = kv_row(tab, min(t + j, tc - 1), n_kv, kvh, rb);  // past tc: a valid row, never used
            load_row<ND, Q8>(kc + o_, lane, kv[j]);
            load_row<ND, Q8>(vc + o_, lane, vv[j]);
        }
    };
    float2* cs = scs[wib];
    if (live && t0 < t1) {
        if (t0 < tc) load_chunk(t0);
        for (int p = lane; p < rope_dim / 2; p += 32) {
            double sn, c;
            sincos((double)p_now * freqs[p], &sn, &c);
            cs[p] = make_float2((float)c, (float)sn);
        }
    }
    pdl_wait();
    if (live) {
        const long long pidx = ((long long)r * n_heads + h) * n_splits + split;
        if (t0 >= t1) {
            if (lane == 0) { pm[pidx] = -INFINITY; pl[pidx] = 0.f; }
        } else {
            const float* qr = qkv + (long long)r * ld + (long long)h * HD + lane * ND;
            const float* kr = qkv + (long long)r * ld + (long long)(n_heads + kvh) * HD + lane * ND;
            const float* vr = v + (long long)r * ldv + (long long)kvh * HD + lane * ND;
            float qx[ND], kx[ND], vn[ND];
#pragma unroll
            for (int i = 0; i < ND; ++i) {
                qx[i] = qr[i];
                kx[i] = has_new ? kr[i] : 0.f;
                vn[i] = has_new ? vr[i] : 0.f;
            }
#pragma unroll
            for (int i = 0; i < ND; ++i) { sq[wib][lane * ND + i] = qx[i]; sk[wib][lane * ND + i] = kx[i]; }
            __syncwarp();
            float qv[ND], o[ND], kn[ND];
#pragma unroll
            for (int i = 0; i < ND; ++i) { qv[i] = rope_elem(sq[wib], cs, lane * ND + i, rope_dim, neox) * scale; o[i] = 0.f; }
            if (has_new) {  // the new k, v as the cache holds them; the group's first head writes them
                const long long dst = kv_row(tab, p_now, n_kv, kvh, rb);
                const bool write = h % group == 0;
#pragma unroll
                for (int i = 0; i < ND; ++i) kn[i] = rope_elem(sk[wib], cs, lane * ND + i, rope_dim, neox);
                if constexpr (Q8) {
                    q8_store_warp<ND>(kn, lane, kc + dst, write);
                    q8_store_warp<ND>(vn, lane, vc + dst, write);
                } else {
                    u16* kd = (u16*)(kc + dst) + lane * ND;
                    u16* vd = (u16*)(vc + dst) + lane * ND;
#pragma unroll
                    for (int i = 0; i < ND; ++i) {
                        const u16 kh = f2h(kn[i]), vh = f2h(vn[i]);
                        kn[i] = h2f(kh);
                        vn[i] = h2f(vh);
                        if (write) { kd[i] = kh; vd[i] = vh; }
                    }
                }
            }
            float m = -INFINITY, l = 0.f;
            for (int t = t0; t < tc; t += CH) {  // chunk t is loaded (the first before the wait)
                float sc[CH];
#pragma unroll
                for (int j = 0; j < CH; ++j) {
                    sc[j] = 0.f;
                    if (t + j < tc)
#pragma unroll
                        for (int i = 0; i < ND; ++i) sc[j] = fmaf(qv[i], kv[j][i], sc[j]);
                }
                const float mn = online_rescale<CH, ND>(sc, t, tc, m, l, o);
#pragma unroll
                for (int j = 0; j < CH; ++j) {
                    if (t + j < tc) {
                        const float p = __expf(sc[j] - mn);
                        l += p;
#pragma unroll
                        for (int i = 0; i < ND; ++i) o[i] = fmaf(p, vv[j][i], o[i]);
                    }
                }
                m = mn;
                if (t + CH < tc) load_chunk(t + CH);
            }
            if (has_new) {
                float sn = 0.f;
#pragma unroll
                for (int i = 0; i < ND; ++i) sn = fmaf(qv[i], kn[i], sn);
#pragma unroll
                for (int off = 16; off; off >>= 1) sn += __shfl_xor_sync(0xffffffffu, sn, off);
                const float mn = fmaxf(m, sn), corr = __expf(m - mn), p = __expf(sn - mn);
                l = l * corr + p;
#pragma unroll
                for (int i = 0; i < ND; ++i) o[i] = fmaf(p, vn[i], o[i] * corr);
                m = mn;
            }
            if (lane == 0) { pm[pidx] = m; pl[pidx] = l; }
            float* orow = po + pidx * HD + lane * ND;
#pragma unroll
            for (int i = 0; i < ND; ++i) orow[i] = o[i];
        }
    }
    // The last block of this column merges the splits of its heads. The barrier orders the
    // block's writes before thread 0's fence (cumulative), which orders them before its count.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(cnt + blockIdx.x, 1) == need - 1;
        if (last) {
            __threadfence();
            cnt[blockIdx.x] = 0;
        }
    }
    __syncthreads();
    if (!last || !live) return;
    const int active = (len + sl - 1) / sl;
    const long long pbase = (long long)warp * n_splits;
    float w0, w1, L;
    split_weights<true>(pm, pl, pbase, active, lane, w0, w1, L);
    float acc[ND];
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[i] = 0.f;
#pragma unroll 4
    for (int sp = 0; sp < active; ++sp) {
        const float w = __shfl_sync(0xffffffffu, sp < 32 ? w0 : w1, sp & 31);
        const float* os = po + (pbase + sp) * HD;
#pragma unroll
        for (int i = 0; i < ND; ++i) acc[i] = fmaf(w, __ldcg(os + lane + 32 * i), acc[i]);
    }
    const float inv = 1.0f / L;
    const long long row0 = (long long)warp * HD;  // (r, h) → r * n_heads * hd + h * hd
#pragma unroll
    for (int i = 0; i < ND; ++i) {
        const float val = acc[i] * inv;
        out[row0 + lane + 32 * i] = val;
        if (has_q) quant32(val, qh, ql, qd, qs, row0 + lane + 32 * i, (row0 >> 5) + i);  // one 32-group per i
    }
}

// ---- prefill: causal attention for chunks of rows on tensor cores ---------------------------
// attn_chunk<HD>: a block per (tile of ≤ 16 rows of one sequence, HB q heads sharing one kv head);
// warp w takes q head blockIdx.y * HB + w over the tile's rows, so the K and V tiles that the
// block stages in shared memory serve 16 × HB query rows. Tiles come from the host (tile_row0,
// tile_n): their rows share a slot; each row is masked at its own position, the block walks
// positions 0 .. the tile's largest. Scores and P·V are mma.sync m16n8k16 (f16 × f16 → f32):
// q (scaled by scale · log2 e) and P are rounded to f16, as the prefill matmuls round x, and the
// online softmax runs in base 2 in f32. Fragment layouts (PTX ISA, m16n8k16 .f16): lane = 4 g + t;
// A regs {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}; B regs {(k 2t..2t+1, n g),
// (k 2t+8.., n g)}; C {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}. An S tile's C registers are
// P's A registers for the next multiply, so P never leaves the registers.
// pack_h2 and mma_f16 are in common.cuh.

// Values c .. c+7 (c a multiple of 8) of a Q8_0 row as 8 f16 (q * d rounded to f16, as the
// prefill multiplies round): the staging of a tile, in shared memory only.
__device__ __forceinline__ uint4 q8_tile8(const u8* row, int c) {
    const u8* blk = row + (c >> 5) * Q8_BYTES;
    const float d = h2f(*(const u16*)blk);
    const u16* qs = (const u16*)(blk + 2 + (c & 31));  // 2-byte aligned: 34 b + 2 + 8 i
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u16 pair = qs[i];
        w[i] = pack_h2((float)(signed char)(pair & 0xFF) * d, (float)(signed char)(pair >> 8) * d);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

template <int HD, int Q8>
__global__ void __launch_bounds__(256) attn_chunk(
        const float* __restrict__ q, int ldq, const u8* __restrict__ kc, const u8* __restrict__ vc,
        const int* __restrict__ tables, int max_blocks, const int* __restrict__ slot, const int* __restrict__ pos,
        const int* __restrict__ tile_row0, const int* __restrict__ tile_n, float* __restrict__ out, int ldo,
        int n_heads, int n_kv, float scale_log2) {
    PDL_ENTRY
    constexpr int KT = 64;          // positions per staged tile
    constexpr int KS = HD + 8;      // Ks row stride (halves): rows 4 banks apart, conflict-free fragment reads
    constexpr int VS = KT + 8;      // Vt row stride (halves)
    __shared__ __align__(16) u16 Ks[KT * KS];  // K tile, (position, dim)
    __shared__ __align__(16) u16 Vt[HD * VS];  // V tile transposed, (dim, position)
    const int HB = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = tile_row0[blockIdx.x], nr = tile_n[blockIdx.x];
    const int h = blockIdx.y * HB + warp, kvh = h / (n_heads / n_kv);
    const int* tab = tables + (long long)slot[r0] * max_blocks;
    const int row_bytes = kv_row_bytes<Q8>(HD);
    const int ra = r0 + min(g, nr - 1), rb = r0 + min(g + 8, nr - 1);  // rows past nr repeat the last, unwritten
    const int pa = pos[ra], pb = pos[rb];
    int pmax = 0;
    for (int i = 0; i < nr; ++i) pmax = max(pmax, pos[r0 + i]);

    u32 qa[HD / 16][4];
    {
        const float* qA = q + (long long)ra * ldq + (long long)h * HD + 2 * t;
        const float* qB = q + (long long)rb * ldq + (long long)h * HD + 2 * t;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const float2 a0 = *(const float2*)(qA + 16 * kk), a1 = *(const float2*)(qB + 16 * kk);
            const float2 a2 = *(const float2*)(qA + 16 * kk + 8), a3 = *(const float2*)(qB + 16 * kk + 8);
            qa[kk][0] = pack_h2(a0.x * scale_log2, a0.y * scale_log2);
            qa[kk][1] = pack_h2(a1.x * scale_log2, a1.y * scale_log2);
            qa[kk][2] = pack_h2(a2.x * scale_log2, a2.y * scale_log2);
            qa[kk][3] = pack_h2(a3.x * scale_log2, a3.y * scale_log2);
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float ma = -INFINITY, mb = -INFINITY, la = 0.f, lb = 0.f;

    for (int kt0 = 0; kt0 <= pmax; kt0 += KT) {
        __syncthreads();  // the previous tile is no longer read
        // Stage: lane-consecutive positions, so the transposed V stores hit consecutive halves.
        for (int idx = threadIdx.x; idx < KT * (HD / 8); idx += blockDim.x) {
            const int p = idx % KT, c = (idx / KT) * 8, pp = kt0 + p;
            uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
            if (pp <= pmax) {  // past the tile's last position: zeros, never the cache's stale (maybe NaN) halves
                const long long o_ = kv_row(tab, pp, n_kv, kvh, row_bytes);
                if constexpr (Q8) {
                    kv4 = q8_tile8(kc + o_, c);
                    vv4 = q8_tile8(vc + o_, c);
                } else {
                    kv4 = *(const uint4*)(kc + o_ + 2 * c);
                    vv4 = *(const uint4*)(vc + o_ + 2 * c);
                }
            }
            *(uint4*)&Ks[p * KS + c] = kv4;
            const u32 vw[4] = {vv4.x, vv4.y, vv4.z, vv4.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                Vt[(c + 2 * i) * VS + p] = (u16)(vw[i] & 0xFFFF);
                Vt[(c + 2 * i + 1) * VS + p] = (u16)(vw[i] >> 16);
            }
        }
        __syncthreads();
        float s[KT / 8][4];
#pragma unroll
        for (int j = 0; j < KT / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
            const u16* kr = Ks + (8 * j + g) * KS + 2 * t;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk)
                mma_f16(s[j], qa[kk], *(const u32*)(kr + 16 * kk), *(const u32*)(kr + 16 * kk + 8));
        }
        float xa = -INFINITY, xb = -INFINITY;
#pragma unroll
        for (int j = 0; j < KT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int p = kt0 + 8 * j + 2 * t + e;
                if (p > pa) s[j][e] = -INFINITY;
                if (p > pb) s[j][2 + e] = -INFINITY;
                xa = fmaxf(xa, s[j][e]);
                xb = fmaxf(xb, s[j][2 + e]);
            }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, off));
            xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, off));
        }
        const float na = fmaxf(ma, xa), nb = fmaxf(mb, xb);  // finite: position 0 is in every row's first tile
        const float ca = exp2f(ma - na), cb = exp2f(mb - nb);
        ma = na;
        mb = nb;
        float sa = 0.f, sb = 0.f;
#pragma unroll
        for (int j = 0; j < KT / 8; ++j) {
            s[j][0] = exp2f(s[j][0] - na); s[j][1] = exp2f(s[j][1] - na);
            s[j][2] = exp2f(s[j][2] - nb); s[j][3] = exp2f(s[j][3] - nb);
            sa += s[j][0] + s[j][1];
            sb += s[j][2] + s[j][3];
        }
        la = la * ca + sa;
        lb = lb * cb + sb;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) { o[n][0] *= ca; o[n][1] *= ca; o[n][2] *= cb; o[n][3] *= cb; }
#pragma unroll
        for (int c16 = 0; c16 < KT / 16; ++c16) {
            const u32 pa4[4] = {pack_h2(s[2 * c16][0], s[2 * c16][1]), pack_h2(s[2 * c16][2], s[2 * c16][3]),
                                pack_h2(s[2 * c16 + 1][0], s[2 * c16 + 1][1]), pack_h2(s[2 * c16 + 1][2], s[2 * c16 + 1][3])};
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                const u16* vr = Vt + (8 * n + g) * VS + 16 * c16 + 2 * t;
                mma_f16(o[n], pa4, *(const u32*)vr, *(const u32*)(vr + 8));
            }
        }
    }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        la += __shfl_xor_sync(0xffffffffu, la, off);
        lb += __shfl_xor_sync(0xffffffffu, lb, off);
    }
    const float ia = 1.f / la, ib = 1.f / lb;
    float* oa = out + (long long)(r0 + g) * ldo + (long long)h * HD + 2 * t;
    float* ob = out + (long long)(r0 + g + 8) * ldo + (long long)h * HD + 2 * t;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
        if (g < nr) *(float2*)(oa + 8 * n) = make_float2(o[n][0] * ia, o[n][1] * ia);
        if (g + 8 < nr) *(float2*)(ob + 8 * n) = make_float2(o[n][2] * ib, o[n][3] * ib);
    }
}
