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

// ---- a step's draws on the device (backends/cuda/sampling.py; sampler.sample_rows is the reference) ----
// Each row of a step's logits (B, V) draws one id: greedy (the largest logit, lowest id on ties) or
// filtered (top-k, top-p, min-p, temperature, then the running-sum search with the row's uniform,
// drawn on the host from the request's generator). The host copies back 2 int32 a row: the id and
// the fault code (sampler.FAULT_*; FAULT_REDO: the host draws this row from its logits itself).
//
// penalize_rows: on a copy of the rows, per row, the ignore_eos bans (-inf) and then the penalties
// over the (id, count) pairs of its history window, in float32 as sampler.penalise does (each
// product rounded on its own: no fused multiply-add). A row whose penalties or bans touch a
// non-finite value, or turn a finite one non-finite, is flagged (the host redoes it: the rare
// rows where the reference reduces the row to its unpenalised argmax, or whose ban hid a NaN).
// draw_rows: each row's top-n from top_rows (n ids, n logits, the NaN count), sorted (logit
// descending, id ascending), then the chain as sampler.draw_filtered in float64: numpy's sums
// are pairwise (pairwise_sum below, its order), running sums sequential.

#define FAULT_NAN 1
#define FAULT_INF 2
#define FAULT_NO_FINITE 3
#define FAULT_REDO 9

// ipack: offsets of the bans (B + 1) then of the penalties (B + 1), then the banned ids, then the
// penalty ids, then their counts. fpack: (B, 3) repetition, frequency, presence (float32).
__global__ void __launch_bounds__(256) penalize_rows(float* __restrict__ x, int V, int B,
                                                     const int* __restrict__ ipack, const float* __restrict__ fpack,
                                                     int* __restrict__ odd) {
    PDL_ENTRY
    const int r = blockIdx.x;
    const int* boff = ipack;
    const int* poff = ipack + B + 1;
    const int nb = boff[B], np_ = poff[B];
    const int* bids = ipack + 2 * (B + 1);
    const int* pids = bids + nb;
    const int* pcnt = pids + np_;
    float* row = x + (long long)r * V;
    int flag = 0;
    for (int j = boff[r] + threadIdx.x; j < boff[r + 1]; j += blockDim.x) {
        const float v = row[bids[j]];
        if (!(v < INFINITY)) flag = 1;  // NaN or +inf behind a ban
        row[bids[j]] = -INFINITY;
    }
    __syncthreads();  // the penalties read the banned row
    const float rep = fpack[3 * r], freq = fpack[3 * r + 1], pres = fpack[3 * r + 2];
    for (int j = poff[r] + threadIdx.x; j < poff[r + 1]; j += blockDim.x) {
        const int id = pids[j];
        const float v = row[id];
        float y = v <= 0.f ? __fmul_rn(v, rep) : __fdiv_rn(v, rep);
        y = __fsub_rn(y, __fadd_rn(__fmul_rn((float)pcnt[j], freq), pres));
        if (v != v || v == INFINITY || (isfinite(v) && !isfinite(y))) flag = 1;
        row[id] = y;
    }
    flag = __syncthreads_or(flag);
    if (threadIdx.x == 0) odd[r] = flag;
}

// numpy's pairwise summation of a[0..n) (its pairwise_sum for doubles, blocks of 8 unrolled).
__device__ double pairwise_sum(const double* a, int n) {
    if (n < 8) {
        double s = 0.;  // numpy starts from -0. only to keep a sign; sums of positive terms agree
        for (int i = 0; i < n; ++i) s = __dadd_rn(s, a[i]);
        return s;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; ++j) r[j] = a[j];
        int i = 8;
        for (; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; ++j) r[j] = __dadd_rn(r[j], a[i + j]);
        double s = __dadd_rn(__dadd_rn(__dadd_rn(r[0], r[1]), __dadd_rn(r[2], r[3])),
                             __dadd_rn(__dadd_rn(r[4], r[5]), __dadd_rn(r[6], r[7])));
        for (; i < n; ++i) s = __dadd_rn(s, a[i]);
        return s;
    }
    int n2 = n / 2;
    n2 -= n2 % 8;
    return __dadd_rn(pairwise_sum(a, n2), pairwise_sum(a + n2, n - n2));
}

#define DRAW_MAX 256

// res: top_rows' (B, 2n + 1). prm: (B, 6) float64 per row: kind (0 none, 1 greedy, 2 filtered),
// top_k, top_p, log(min_p) as float32 (NaN: off), temperature, uniform. odd: penalize_rows' flags
// (nullptr: none). out: (2, B) int32: ids, then faults.
__global__ void __launch_bounds__(DRAW_MAX) draw_rows(const int* __restrict__ res, int n, int B,
                                                      const double* __restrict__ prm, const int* __restrict__ odd,
                                                      int* __restrict__ out) {
    PDL_ENTRY
    const int r = blockIdx.x;
    const int* ids = res + (long long)r * (2 * n + 1);
    const float* vals = (const float*)(ids + n);
    const double* p = prm + 6 * r;
    const int kind = (int)p[0];
    __shared__ int s_id[DRAW_MAX];
    __shared__ float s_v[DRAW_MAX];
    __shared__ double s_w[DRAW_MAX];
    if (threadIdx.x < n) {  // rank by (logit descending, id ascending): the sorted position
        const float v = vals[threadIdx.x];
        const int id = ids[threadIdx.x];
        int rank = 0;
        for (int j = 0; j < n; ++j) {
            const float w = vals[j];
            rank += w > v || (w == v && ids[j] < id);
        }
        s_id[rank] = id;
        s_v[rank] = v;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    int id = -1, fault = 0;
    if (kind == 0) {
    } else if (ids[2 * n] > 0) {
        fault = FAULT_NAN;
    } else if (odd != nullptr && odd[r]) {
        fault = FAULT_REDO;
    } else if (s_v[0] == INFINITY) {
        fault = FAULT_INF;
    } else if (s_v[0] == -INFINITY) {
        fault = FAULT_NO_FINITE;
    } else if (kind == 1) {
        id = s_id[0];
    } else {
        int L = min((int)p[1], n);
        int f = 1;  // -inf leaves (never the first): the finite ones are a prefix
        while (f < L && s_v[f] > -INFINITY) ++f;
        L = f;
        const double top_p = p[2];
        if (top_p < 1.0 && L > 1) {
            const double z0 = (double)s_v[0];
            for (int j = 0; j < L; ++j) s_w[j] = exp((double)s_v[j] - z0);
            const double sum = pairwise_sum(s_w, L);
            double cum = 0.;
            int last = L - 1;
            for (int j = 0; j < L; ++j) {
                cum = __dadd_rn(cum, s_w[j] / sum);
                if (cum >= top_p) { last = j; break; }  // the first index where the sum reaches p
            }
            L = min(last, L - 1) + 1;
        }
        const double lmp = p[3];
        if (lmp == lmp && L > 1) {
            const float bound = __fadd_rn(s_v[0], (float)lmp);
            int m = 0;
            while (m < L && s_v[m] >= bound) ++m;
            L = m;
        }
        const double t = p[4], u = p[5];
        const double z0 = (double)s_v[0] / t;
        double c = 0.;
        for (int j = 0; j < L; ++j) {
            c = __dadd_rn(c, exp((double)s_v[j] / t - z0));
            s_w[j] = c;
        }
        const double target = __dmul_rn(u, c);
        int k = 0;
        while (k < L && s_w[k] <= target) ++k;  // searchsorted side="right"
        id = s_id[min(k, L - 1)];
    }
    out[r] = id;
    out[B + r] = fault;
}
