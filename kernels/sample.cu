// Greedy sampling on the device: out[r] = argmax(logits[r]), lowest index on ties (np.argmax).


__global__ void __launch_bounds__(1024) argmax_rows(const float* __restrict__ logits, int* __restrict__ out, int V) {
    PDL_ENTRY
    const float* l = logits + (long long)blockIdx.x * V;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += 1024) {
        float v = l[i];
        if (v > best || (v == best && i < bi) || (v != v && best == best)) { best = v; bi = i; }
    }
    __shared__ float sv[32];
    __shared__ int si[32];
    for (int o = 16; o; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = best; si[threadIdx.x >> 5] = bi; }
    __syncthreads();
    if (threadIdx.x < 32) {
        best = sv[threadIdx.x]; bi = si[threadIdx.x];
        for (int o = 16; o; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (threadIdx.x == 0) out[blockIdx.x] = bi;
    }
}

// ---- the n most likely ids of each row, for sampling on the host from n values instead of V ----
// top_rows: one 1024-thread block per row writes the n largest logits and their ids, in no
// particular order (the host sorts n values), ties at the n-th value resolved to the lowest ids
// (as sampler.candidates), and the row's NaN count (NaNs are never chosen). Radix select on
// order-preserving keys (larger float -> larger unsigned key): four passes of 8 bits narrow down
// the n-th largest key T from shared-memory histograms; a last pass writes every key > T and
// `need` keys == T. When every key == T is wanted (no tie straddles the n-th, the usual case)
// that pass takes them in any order; otherwise it walks the row in id order to take the lowest
// ids. Each pass loads TOP_ILP elements per thread before using them (the row is L2-resident:
// latency, not bandwidth). Results go to one int32 buffer per row: n ids, n logits (as bits), the
// NaN count, so the host copies them at once.

#define TOP_ILP 8

__device__ __forceinline__ u32 order_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Elements base + 1024 j (j < TOP_ILP) of the row: the thread's batch, past V flagged invalid.
__device__ __forceinline__ void top_batch(const float* l, int V, int base, float (&f)[TOP_ILP], bool (&ok)[TOP_ILP]) {
#pragma unroll
    for (int j = 0; j < TOP_ILP; ++j) {
        const int i = base + 1024 * j;
        f[j] = i < V ? l[i] : 0.f;
        ok[j] = i < V;
    }
}

__global__ void __launch_bounds__(1024) top_rows(const float* __restrict__ logits, int V, int n, int* __restrict__ res) {
    int* ids = res + (long long)blockIdx.x * (2 * n + 1);  // this row's n ids, n logits, NaN count
    float* vals = (float*)ids + n;
    PDL_ENTRY
    const float* l = logits + (long long)blockIdx.x * V;
    __shared__ u32 hist[256];
    __shared__ u32 s_prefix, s_need, s_eq;
    __shared__ int s_warp[32], s_pos, s_nan;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    u32 prefix = 0, mask = 0, need = (u32)n;  // need: how many keys matching prefix are still wanted
    int nans = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (threadIdx.x < 256) hist[threadIdx.x] = 0;
        if (threadIdx.x == 0) { s_prefix = prefix; s_need = need; s_eq = 0; s_pos = 0; s_nan = 0; }
        __syncthreads();
        for (int base = threadIdx.x; base < V; base += 1024 * TOP_ILP) {
            float f[TOP_ILP];
            bool ok[TOP_ILP];
            top_batch(l, V, base, f, ok);
#pragma unroll
            for (int j = 0; j < TOP_ILP; ++j) {
                if (!ok[j]) continue;
                if (f[j] != f[j]) {
                    nans += shift == 24;
                    continue;
                }
                const u32 k = order_key(f[j]);  // (lanes sharing a bin adding once, __match_any_sync: slower)
                if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255], 1u);
            }
        }
        __syncthreads();
        if (w == 0) {  // the digit where the count from the top reaches need; lane l has bins 8l..8l+7
            u32 c[8], own = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) { c[j] = hist[8 * lane + j]; own += c[j]; }
            u32 ge = own;  // keys in the bins of lanes >= lane
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 t = __shfl_down_sync(0xffffffffu, ge, o);
                if (lane + o < 32) ge += t;
            }
            u32 acc = ge - own;  // keys in higher lanes' bins
            if (acc < need && ge >= need) {
                for (int j = 7; j >= 0; --j) {
                    if (acc + c[j] >= need) {
                        s_prefix = prefix | ((u32)(8 * lane + j) << shift);
                        s_need = need - acc;
                        s_eq = c[j];  // at shift 0: how many keys == T
                        break;
                    }
                    acc += c[j];
                }
            }
        }
        __syncthreads();
        prefix = s_prefix;
        need = s_need;
        mask |= 255u << shift;
    }
    // prefix = T, the n-th largest key; need = how many keys == T to take
    if (s_eq == need) {  // every key == T: any order
        for (int base = threadIdx.x; base < V; base += 1024 * TOP_ILP) {
            float f[TOP_ILP];
            bool ok[TOP_ILP];
            top_batch(l, V, base, f, ok);
#pragma unroll
            for (int j = 0; j < TOP_ILP; ++j) {
                if (ok[j] && f[j] == f[j] && order_key(f[j]) >= prefix) {
                    const int p = atomicAdd(&s_pos, 1);
                    ids[p] = base + 1024 * j;
                    vals[p] = f[j];
                }
            }
        }
    } else {  // ties straddle the n-th: the lowest ids of them, in id order, tile by tile
        int taken_eq = 0;  // keys == T in the tiles before this one (the same in every thread)
        for (int base = 0; base < V; base += 1024) {
            const int i = base + threadIdx.x;
            const float f = i < V ? l[i] : 0.f;
            const bool ok = i < V && f == f;
            const u32 k = ok ? order_key(f) : 0u;
            const bool gt = ok && k > prefix, eq = ok && k == prefix;
            const u32 eqm = __ballot_sync(0xffffffffu, eq);
            if (lane == 0) s_warp[w] = __popc(eqm);
            __syncthreads();
            int before = taken_eq + __popc(eqm & ((1u << lane) - 1u)), total = 0;
            for (int j = 0; j < 32; ++j) {
                before += j < w ? s_warp[j] : 0;
                total += s_warp[j];
            }
            if (gt || (eq && (u32)before < need)) {
                const int p = atomicAdd(&s_pos, 1);
                ids[p] = i;
                vals[p] = f;
            }
            taken_eq += total;
            __syncthreads();  // s_warp is rewritten by the next tile
        }
    }
    if (nans) atomicAdd(&s_nan, nans);
    __syncthreads();
    if (threadIdx.x == 0) ids[2 * n] = s_nan;
}
