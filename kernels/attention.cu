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
// rope_kv: RoPE of q and k in place, and (f16 caches) k, v appended to the cache, in one launch.
// attn_decode<ND, Q8, HB>: attention of rows of one query each (decode tokens, verify rows) over
//   fixed position splits (sl positions, from the configured context alone), merged in split
//   order in the same launch; fused, RoPE and the cache append too (below).
// attn_chunk<HD, Q8>: a prefill chunk's rows on tensor cores (f16 q and P; below).
// ND = head_dim / 32: lane l holds dims l*ND .. l*ND+ND-1 of a head row, loaded as one vector.
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
        const float2 y = rope_rot(x[ia], x[ib], cf, sf);
        a = y.x;
        b = y.y;
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

// ---- decode attention over fixed position splits ------------------------------------------
// attn_decode<ND, Q8, HB>: causal GQA attention of rows that each hold one query (a decode
// token, or one row of a verify step) over positions 0 .. pos[r] of the row's slot.
// Positions are cut into splits of sl positions, sl set by the configured context alone
// (backends/cuda/attention.py split_len), never by the number of rows or the row's position;
// every split's partial, and the merge of the splits in the order 0, 1, 2, ..., are then the
// same arithmetic whatever else the step holds: a row's bits depend on its own data, position
// and sl only.
// Grid: x a column per (row, kv head, HB q heads of its group), y a stride over the splits:
// block y takes splits y, y + gridDim.y, ... (which block computes a split changes no bit of
// it; the launcher sizes gridDim.y from the rows so that the GPU fills). Blocks of a column past
// its last non-empty split leave at once. Warp w of a block takes the w-th of DECODE_WARPS
// equal pieces of the split for all HB heads: each K and V row it loads serves every head, an
// online softmax CH positions per step, lane l holding dims l*ND .. l*ND+ND-1. The pieces merge
// in shared memory in the order 0, 1, ... into each head's split max m, sum l and unnormalised
// output o (pm, pl, po: (row, head, split)). The last block of a column to finish (cnt counts
// them; that block resets it, so graph replays find it zero) merges the splits of its heads
// into out (N, n_heads * head_dim), and with has_q writes out quantized for the int8 matvecs
// (quant_act.cuh).
// fused (the decode step's RoPE + cache append + attention in one launch): rows of qkv (stride
// ld) hold q then k, not rotated; v at row stride ldv. q and the new k are rotated in registers
// (qkv is not written) with the row's angles (in double, as rope.cu), k and v are rounded as
// the cache holds them (f16, or Q8_0 as gguf rounds) and the group's first column writes them
// at (slot, pos); the piece holding pos uses those values where the other mode reads them back
// from the cache, at the same place in its sums, so the two modes give the same bits. Not
// fused: qkv holds q alone (rotated), and the cache holds position pos already (kv_append or
// rope_kv before it); v and freqs are unused.

#define MAX_SPLITS 128  // attention.py MAX_SPLITS: the most splits a row has (the merge's lanes hold 4 each)
#define DECODE_WARPS 8  // warps of an attn_decode block: the pieces of a split

// Element d of the head in s (head_dim floats) after RoPE with the angles cs[p] = (cos, sin) of
// pair p (rope.cu's pairing, common.cuh's rope_rot).
__device__ __forceinline__ float rope_elem(const float* s, const float2* cs, int d, int rope_dim, int neox) {
    if (d >= rope_dim) return s[d];  // the unrotated tail
    const int half = rope_dim / 2;
    const int p = neox ? (d < half ? d : d - half) : d >> 1;
    const int ia = neox ? p : 2 * p, ib = neox ? p + half : 2 * p + 1;
    const float2 r = rope_rot(s[ia], s[ib], cs[p].x, cs[p].y);
    return d == ia ? r.x : r.y;
}

// The merge weights of `active` (≤ MAX_SPLITS) splits of one (row, head) whose partials start
// at base: lane i's splits i + 32 k get w[k] = exp(m - M) (M the largest m), and every lane
// gets L = the sum of w * l (each lane its own splits in order, then a fixed butterfly: the
// same order for the same `active`). Read through L2 (written by other blocks of this grid).
__device__ __forceinline__ void split_weights(const float* pm, const float* pl, long long base, int active, int lane,
                                              float (&w)[MAX_SPLITS / 32], float& L) {
    float mk[MAX_SPLITS / 32], M = -INFINITY;
#pragma unroll
    for (int k = 0; k < MAX_SPLITS / 32; ++k) {
        const int s = lane + 32 * k;
        mk[k] = s < active ? __ldcg(pm + base + s) : -INFINITY;
        M = fmaxf(M, mk[k]);
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    L = 0.f;
#pragma unroll
    for (int k = 0; k < MAX_SPLITS / 32; ++k) {
        const int s = lane + 32 * k;
        w[k] = s < active ? __expf(mk[k] - M) : 0.f;
        if (s < active) L = fmaf(w[k], __ldcg(pl + base + s), L);
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
}

// Two blocks per SM where that fits without (more than a few bytes of) spills, the 8B's shape
// among them: 16 warps keep the memory busy; the larger shapes take the registers they need.
template <int ND, int Q8, int HB>
__global__ void __launch_bounds__(32 * DECODE_WARPS, (HB * ND == 16 || HB * ND <= 4) && ND <= 4 ? 2 : 1) attn_decode(
        const float* __restrict__ qkv, int ld, const float* __restrict__ v, int ldv, u8* kc, u8* vc,
        const int* __restrict__ tables, int max_blocks, const int* __restrict__ slot, const int* __restrict__ pos,
        const double* __restrict__ freqs, float* pm, float* pl, float* po, int* cnt, float* __restrict__ out,
        int N, int n_heads, int n_kv, int sl, int max_splits, float scale, int rope_dim, int neox, int fused,
        signed char* qh, signed char* ql, float* qd, float* qs, int has_q) {
    // fused: before pdl_wait only what no kernel of this step writes: slot and pos (set before
    // the step), the angles, and the cached positions (earlier steps); q, k, v, the scratch and
    // the counters come after it. Not fused: the cache row at pos comes from the kernel before.
    pdl_launch_next();
    if (!fused) pdl_wait();
    constexpr int HD = 32 * ND, W = DECODE_WARPS;
    // positions per step, their K and V loads issued together (fewer where the heads' registers are many)
    constexpr int CH = HB * ND >= 64 ? 2 : HB * ND >= 16 || ND >= 4 ? 4 : 8;
    __shared__ float sx[HB + 1][HD];   // fused: the column's q heads and the new k head, before RoPE
    __shared__ float so[W][HD];        // the pieces' o of one head, for the merge
    __shared__ float sml[W][HB][2];    // the pieces' m and l
    __shared__ float2 scs[HD / 2];     // fused: the row's angles
    __shared__ int last;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = n_heads / n_kv, hgroups = group / HB;
    const int col = blockIdx.x, r = col / (n_kv * hgroups), kvh = (col / hgroups) % n_kv;
    const int h0 = kvh * group + (col % hgroups) * HB;  // the column's first q head
    const int p_now = pos[r], len = p_now + 1, active = (len + sl - 1) / sl;
    if ((int)blockIdx.y >= active) return;
    const int need = min((int)gridDim.y, active);  // the column's blocks with work
    const int piece = sl / W;
    const int* tab = tables + (long long)slot[r] * max_blocks;
    const int rb = kv_row_bytes<Q8>(HD);
    float kv[CH][ND], vv[CH][ND];
    auto load_chunk = [&](int t, int t_end) {
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            const long long o_ = kv_row(tab, min(t + j, t_end - 1), n_kv, kvh, rb);  // past t_end: a valid row, never used
            load_row<ND, Q8>(kc + o_, lane, kv[j]);
            load_row<ND, Q8>(vc + o_, lane, vv[j]);
        }
    };
    // The first split's first chunk (fused: during the previous kernel; the row at pos, not yet
    // written, is replaced below).
    int a = blockIdx.y * sl + w * piece, b = min(len, a + piece);
    if (a < b) load_chunk(a, b);
    float qv[HB][ND];
    if (fused) {
        for (int p = threadIdx.x; p < rope_dim / 2; p += blockDim.x) {
            double sn, c;
            sincos((double)p_now * freqs[p], &sn, &c);
            scs[p] = make_float2((float)c, (float)sn);
        }
        pdl_wait();
        const float* row = qkv + (long long)r * ld;
        for (int e = threadIdx.x; e < (HB + 1) * HD; e += blockDim.x)  // q heads h0 .., then k head kvh
            sx[e / HD][e % HD] = row[(e < HB * HD ? (long long)h0 * HD : (long long)(n_heads + kvh) * HD - HB * HD) + e];
        __syncthreads();
#pragma unroll
        for (int hh = 0; hh < HB; ++hh)
#pragma unroll
            for (int i = 0; i < ND; ++i) qv[hh][i] = rope_elem(sx[hh], scs, lane * ND + i, rope_dim, neox) * scale;
    } else {
#pragma unroll
        for (int hh = 0; hh < HB; ++hh) {
            const float* qr = qkv + (long long)r * ld + (long long)(h0 + hh) * HD + lane * ND;
#pragma unroll
            for (int i = 0; i < ND; ++i) qv[hh][i] = qr[i] * scale;
        }
    }
    for (int s = blockIdx.y; s < active; s += gridDim.y) {
        if (s != (int)blockIdx.y) {
            a = s * sl + w * piece;
            b = min(len, a + piece);
            if (a < b) load_chunk(a, b);
        }
        // fused: the new k and v as the cache holds them, in the piece that holds pos; the
        // group's first column writes them to the cache.
        float kn[ND], vn[ND];
        const bool has_new = fused && a <= p_now && p_now < b;
        if (has_new) {
            const float* vr = v + (long long)r * ldv + (long long)kvh * HD + lane * ND;
#pragma unroll
            for (int i = 0; i < ND; ++i) {
                kn[i] = rope_elem(sx[HB], scs, lane * ND + i, rope_dim, neox);
                vn[i] = vr[i];
            }
            const long long dst = kv_row(tab, p_now, n_kv, kvh, rb);
            const bool write = h0 % group == 0;
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
        float m[HB], l[HB], o[HB][ND];
#pragma unroll
        for (int hh = 0; hh < HB; ++hh) {
            m[hh] = -INFINITY;
            l[hh] = 0.f;
#pragma unroll
            for (int i = 0; i < ND; ++i) o[hh][i] = 0.f;
        }
        for (int t = a; t < b; t += CH) {  // chunk t is loaded
            if (has_new && p_now - t < CH) {
#pragma unroll
                for (int j = 0; j < CH; ++j)
                    if (t + j == p_now)
#pragma unroll
                        for (int i = 0; i < ND; ++i) { kv[j][i] = kn[i]; vv[j][i] = vn[i]; }
            }
            float sc[HB][CH];
#pragma unroll
            for (int hh = 0; hh < HB; ++hh)
#pragma unroll
                for (int j = 0; j < CH; ++j) {
                    sc[hh][j] = 0.f;
#pragma unroll
                    for (int i = 0; i < ND; ++i) sc[hh][j] = fmaf(qv[hh][i], kv[j][i], sc[hh][j]);
                }
#pragma unroll
            for (int off = 16; off; off >>= 1)
#pragma unroll
                for (int hh = 0; hh < HB; ++hh)
#pragma unroll
                    for (int j = 0; j < CH; ++j) sc[hh][j] += __shfl_xor_sync(0xffffffffu, sc[hh][j], off);
#pragma unroll
            for (int hh = 0; hh < HB; ++hh) {
                float mn = m[hh];
#pragma unroll
                for (int j = 0; j < CH; ++j) if (t + j < b) mn = fmaxf(mn, sc[hh][j]);
                const float corr = __expf(m[hh] - mn);
                l[hh] *= corr;
#pragma unroll
                for (int i = 0; i < ND; ++i) o[hh][i] *= corr;
#pragma unroll
                for (int j = 0; j < CH; ++j) {
                    if (t + j < b) {
                        const float p = __expf(sc[hh][j] - mn);
                        l[hh] += p;
#pragma unroll
                        for (int i = 0; i < ND; ++i) o[hh][i] = fmaf(p, vv[j][i], o[hh][i]);
                    }
                }
                m[hh] = mn;
            }
            if (t + CH < b) load_chunk(t + CH, b);
        }
        // The split's pieces merge in order, head by head (piece 0 is never empty: the split
        // holds a position; an empty one has m = -inf, so weight 0, and l, o zero).
        if (lane == 0)
#pragma unroll
            for (int hh = 0; hh < HB; ++hh) { sml[w][hh][0] = m[hh]; sml[w][hh][1] = l[hh]; }
#pragma unroll
        for (int hh = 0; hh < HB; ++hh) {
#pragma unroll
            for (int i = 0; i < ND; ++i) so[w][lane * ND + i] = o[hh][i];
            __syncthreads();
            if (w == hh % W) {
                float M = -INFINITY;
                for (int p = 0; p < W; ++p) M = fmaxf(M, sml[p][hh][0]);
                float L = 0.f, acc[ND];
#pragma unroll
                for (int i = 0; i < ND; ++i) acc[i] = 0.f;
                for (int p = 0; p < W; ++p) {
                    const float wt = __expf(sml[p][hh][0] - M);
                    L = fmaf(wt, sml[p][hh][1], L);
#pragma unroll
                    for (int i = 0; i < ND; ++i) acc[i] = fmaf(wt, so[p][lane * ND + i], acc[i]);
                }
                const long long pidx = ((long long)r * n_heads + h0 + hh) * max_splits + s;
                if (lane == 0) { pm[pidx] = M; pl[pidx] = L; }
                float* orow = po + pidx * HD + lane * ND;
#pragma unroll
                for (int i = 0; i < ND; ++i) orow[i] = acc[i];
            }
            __syncthreads();  // so (and, after the last head, sml) serve again
        }
    }
    // The last block of this column merges the splits of its heads. The barrier orders the
    // block's writes before thread 0's fence (cumulative), which orders them before its count.
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(cnt + col, 1) == need - 1;
        if (last) {
            __threadfence();
            cnt[col] = 0;
        }
    }
    __syncthreads();
    if (!last) return;
    // Warp w merges head w % HB's dim groups i = w / HB + k * WS (lane + 32 i: one 32-group of
    // the quantized output each), all its groups' loads of a split issued together; each dim's
    // sum runs over the splits in order.
    constexpr int WS = W / HB, NI = (ND + WS - 1) / WS;  // warps per head, dim groups per warp
    const int hh = w % HB, h = h0 + hh, i0 = w / HB;
    const long long pbase = ((long long)r * n_heads + h) * max_splits;
    float wts[MAX_SPLITS / 32], L;
    split_weights(pm, pl, pbase, active, lane, wts, L);
    float acc[NI];
#pragma unroll
    for (int k = 0; k < NI; ++k) acc[k] = 0.f;
#pragma unroll 4
    for (int sp = 0; sp < active; ++sp) {
        float wk = 0.f;  // wts[sp / 32], kept in registers
#pragma unroll
        for (int k = 0; k < MAX_SPLITS / 32; ++k) wk = k == sp >> 5 ? wts[k] : wk;
        const float wt = __shfl_sync(0xffffffffu, wk, sp & 31);
        const float* os = po + (pbase + sp) * HD + lane;
#pragma unroll
        for (int k = 0; k < NI; ++k)
            if (i0 + k * WS < ND) acc[k] = fmaf(wt, __ldcg(os + 32 * (i0 + k * WS)), acc[k]);
    }
    const float inv = 1.0f / L;
    const long long row0 = ((long long)r * n_heads + h) * HD;  // (r, h) → r * n_heads * hd + h * hd
#pragma unroll
    for (int k = 0; k < NI; ++k) {
        const int i = i0 + k * WS;
        if (i < ND) {  // warp-uniform: quant32 takes the whole warp
            const float val = acc[k] * inv;
            out[row0 + lane + 32 * i] = val;
            if (has_q) quant32(val, qh, ql, qd, qs, row0 + lane + 32 * i, (row0 >> 5) + i);
        }
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
