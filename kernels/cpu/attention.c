/* Attention over the paged KV cache (attention.h): storing rows, and causal GQA attention that
 * reads the stored rows (F32, F16, Q8_0, Q4_0) through each sequence's block table.
 *
 * The attention of a group of rows (up to NTX_ATTN_ROWS consecutive rows of one sequence, for
 * one KV head: R rows × g query heads = nq query vectors) walks the keys NTX_ATTN_KEYS at a time
 * with an online softmax (running max m, sum l, output accumulator per query vector). Each key
 * and value row is decoded once into a small float tile and used by every query vector of the
 * group, so a prefill chunk reads the cache once per 16 rows, not once per row. The loops run
 * across query vectors (scores) and head_dim (outputs), never reducing inside a vector, and
 * each query vector's arithmetic is the same whatever group it is in: a row's result does not
 * depend on the other rows of its step (a k-token verify step equals k one-token steps).
 */
#include <math.h>
#include <stdlib.h>

#include "attention.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#define KT NTX_ATTN_KEYS

/* ---- rows -------------------------------------------------------------------------------- */

/* As gguf.quants.quantize, bit for bit: d = amax / 127, q = round(x / d) half away from zero. */
static void store_q8_0(const float *x, int hd, uint8_t *row) {
    for (int b = 0; b < hd / NTX_KV_QK; b++, x += NTX_KV_QK, row += NTX_KV_Q8_0_BYTES) {
        float amax = 0.0f;
        for (int i = 0; i < NTX_KV_QK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const _Float16 dh = (_Float16)d;
        memcpy(row, &dh, 2);
        int8_t *q = (int8_t *)(row + 2);
        for (int i = 0; i < NTX_KV_QK; i++) q[i] = (int8_t)roundf(x[i] * id);
    }
}

/* As gguf.quants.quantize: d = (value of largest magnitude) / -8, q = min(15, trunc(x / d + 8.5)).
 * The product is kept apart from the addition (volatile) so no compiler fuses them into an FMA
 * that would round differently. */
static void store_q4_0(const float *x, int hd, uint8_t *row) {
    for (int b = 0; b < hd / NTX_KV_QK; b++, x += NTX_KV_QK, row += NTX_KV_Q4_0_BYTES) {
        float amax = 0.0f, max = 0.0f;
        for (int i = 0; i < NTX_KV_QK; i++)
            if (fabsf(x[i]) > amax) { /* the first of ties, its sign kept */
                amax = fabsf(x[i]);
                max = x[i];
            }
        const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const _Float16 dh = (_Float16)d;
        memcpy(row, &dh, 2);
        uint8_t *q = row + 2;
        for (int i = 0; i < NTX_KV_QK / 2; i++) {
            volatile float a = x[i] * id, c = x[i + NTX_KV_QK / 2] * id;
            int lo = (int)(a + 8.5f), hi = (int)(c + 8.5f);
            lo = lo < 15 ? lo : 15;
            hi = hi < 15 ? hi : 15;
            q[i] = (uint8_t)(lo | hi << 4);
        }
    }
}

void ntx_kv_store(int type, const float *x, int hd, uint8_t *row) {
    switch (type) {
    case NTX_F32: memcpy(row, x, (size_t)hd * sizeof(float)); return;
    case NTX_F16: {
        _Float16 *d = (_Float16 *)row;
        for (int i = 0; i < hd; i++) d[i] = (_Float16)x[i];
        return;
    }
    case NTX_Q8_0: store_q8_0(x, hd, row); return;
    case NTX_Q4_0: store_q4_0(x, hd, row); return;
    default: return;
    }
}

/* Row → float32, as gguf.quants.dequantize: d × q. */
static inline void kv_load(int type, const uint8_t *row, int hd, float *out) {
    switch (type) {
    case NTX_F32: memcpy(out, row, (size_t)hd * sizeof(float)); return;
    case NTX_F16: {
        const _Float16 *s = (const _Float16 *)row;
#pragma omp simd
        for (int i = 0; i < hd; i++) out[i] = (float)s[i];
        return;
    }
    case NTX_Q8_0:
        for (int b = 0; b < hd / NTX_KV_QK; b++, row += NTX_KV_Q8_0_BYTES, out += NTX_KV_QK) {
            _Float16 dh;
            memcpy(&dh, row, 2);
            const float d = (float)dh;
            const int8_t *q = (const int8_t *)(row + 2);
#pragma omp simd
            for (int i = 0; i < NTX_KV_QK; i++) out[i] = (float)q[i] * d;
        }
        return;
    case NTX_Q4_0:
        for (int b = 0; b < hd / NTX_KV_QK; b++, row += NTX_KV_Q4_0_BYTES, out += NTX_KV_QK) {
            _Float16 dh;
            memcpy(&dh, row, 2);
            const float d = (float)dh;
            const uint8_t *q = row + 2;
#pragma omp simd
            for (int i = 0; i < NTX_KV_QK / 2; i++) {
                out[i] = (float)((int)(q[i] & 0x0F) - 8) * d;
                out[i + NTX_KV_QK / 2] = (float)((int)(q[i] >> 4) - 8) * d;
            }
        }
        return;
    default: return;
    }
}

/* n rows of hd values each, stored and loaded as the cache does (tests compare with gguf.quants). */
void ntx_kv_store_rows(int type, const float *x, int64_t n, int hd, uint8_t *rows) {
    int64_t rb = ntx_kv_row_bytes(type, hd);
    for (int64_t r = 0; r < n; r++) ntx_kv_store(type, x + r * hd, hd, rows + r * rb);
}

void ntx_kv_load_rows(int type, const uint8_t *rows, int64_t n, int hd, float *out) {
    int64_t rb = ntx_kv_row_bytes(type, hd);
    for (int64_t r = 0; r < n; r++) kv_load(type, rows + r * rb, hd, out + r * hd);
}

/* ---- attention --------------------------------------------------------------------------- */
/* Two kernels of the same arithmetic. ntx_attn_group_ref (the first one written, kept as the
 * reference the tests and bench/host_attention.py compare with) runs the score loop across
 * query vectors, 16 lanes at a time: a decode step of a GQA model (4 query heads per KV head)
 * leaves 12 of the 16 lanes empty. ntx_attn_group runs it across the tile's 16 keys, with the
 * keys decoded into a transposed tile, so every lane is a real (key, query) pair and each key
 * is decoded once for all the query heads of its group. Each score is still the same chain
 * a = a + k_i q_i over i in order from 0 (contracted the same way by the same compiler flags),
 * each tile of KT keys still updates the running max, sum and output in the same order, so
 * the two kernels' outputs are the same bits. */

/* exp(x) for x ≤ 0 (a score minus its running max), within 2 ulp; exp(0) is exactly 1. Cephes'
 * expf: x = n ln2 + r, |r| ≤ ln2 / 2, a degree-7 polynomial in r, times 2^n. Below -87 (where
 * the weight is already under 2^-125 of the largest) it returns exp(-87). Branch-free, so the
 * loops over query vectors vectorize. */
static inline float exp_le0(float x) {
    x = x > -87.0f ? x : -87.0f;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    const float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return y * scale.f;
}

static inline int64_t up16(int64_t n) { return (n + 15) & ~(int64_t)15; }

int64_t ntx_attn_groups(const ntx_header *h, int64_t *starts) {
    int64_t n = 0, first = 0;
    for (int64_t r = 0; r < h->n_rows; r++) {
        int joins = r > first && r - first < NTX_ATTN_ROWS && h->slots[r] == h->slots[r - 1] &&
                    h->positions[r] == h->positions[r - 1] + 1;
        if (!joins) {
            if (starts) starts[n] = r;
            n++;
            first = r;
        }
    }
    if (starts) starts[n] = h->n_rows;
    return n;
}

int64_t ntx_attn_scratch(const ntx_model *md) {
    int64_t hd = up16(md->head_dim), g = md->n_heads / md->n_kv_heads, nq = up16((int64_t)NTX_ATTN_ROWS * g);
    /* ntx_attn_group's or the reference's, then the running state of serial splits (the last floats) */
    return 2 * hd * nq + KT * nq + 4 * nq + 3 * KT * hd + 16 + (int64_t)NTX_ATTN_ROWS * g * (md->head_dim + 2);
}

void ntx_attn_group_ref(const ntx_model *md, const ntx_header *h, const float *q, float *out, const void *kv_k,
                        const void *kv_v, int64_t r0, int64_t r1, int kh, float *scratch) {
    const int hd = md->head_dim, H = md->n_heads, g = H / md->n_kv_heads, type = md->kv_type;
    const int64_t nq = (r1 - r0) * g, NQ = up16(nq), HD = up16(hd), slot = h->slots[r0];
    const int64_t end = h->positions[r1 - 1] + 1; /* keys [0, end): the last row sees them all */
    const float scale = md->attn_scale;
    /* scratch: q transposed (hd, NQ), scores (KT, NQ), m, l, corr, lim (NQ each), acc (NQ, HD),
     * decoded keys and values (KT, HD) each */
    float *qt = scratch, *s = qt + (int64_t)hd * NQ, *m = s + KT * NQ, *l = m + NQ, *corr = l + NQ,
          *lim = corr + NQ, *acc = lim + NQ, *kt = acc + NQ * HD, *vt = kt + KT * HD;

    for (int64_t v = 0; v < NQ; v++) { /* query vector v: row r0 + v / g, head kh * g + v % g */
        const float *qv = v < nq ? q + (r0 + v / g) * (int64_t)H * hd + (int64_t)(kh * g + v % g) * hd : NULL;
        for (int i = 0; i < hd; i++) qt[(int64_t)i * NQ + v] = qv ? qv[i] : 0.0f;
        m[v] = -INFINITY;
        l[v] = 0.0f;
        lim[v] = v < nq ? (float)h->positions[r0 + v / g] : -1.0f; /* padding sees nothing */
    }
    memset(acc, 0, (size_t)(nq * HD) * sizeof(float));
    if (HD != hd) /* the columns past hd stay zero */
        for (int k = 0; k < 2 * KT; k++) memset(kt + k * HD + hd, 0, (size_t)(HD - hd) * sizeof(float));

    for (int64_t k0 = 0; k0 < end; k0 += KT) {
        const int nk = end - k0 < KT ? (int)(end - k0) : KT;
        for (int k = 0; k < nk; k++) kv_load(type, ntx_kv_row(md, kv_k, slot, k0 + k, kh), hd, kt + k * HD);
        for (int k = 0; k < nk; k++) { /* scores of key k0 + k against every query vector */
            const float *kr = kt + k * HD, key = (float)(k0 + k);
            for (int64_t c = 0; c < NQ; c += 16) {
                float a[16] = {0};
                for (int i = 0; i < hd; i++) {
                    const float *qi = qt + (int64_t)i * NQ + c;
#pragma omp simd
                    for (int t = 0; t < 16; t++) a[t] += kr[i] * qi[t];
                }
                float *sk = s + k * NQ + c;
#pragma omp simd
                for (int t = 0; t < 16; t++) sk[t] = key > lim[c + t] ? -INFINITY : a[t] * scale;
            }
        }
        /* online softmax: corr first holds the new running max, then the old one's correction */
#pragma omp simd
        for (int64_t v = 0; v < NQ; v++) corr[v] = m[v];
        for (int k = 0; k < nk; k++) {
            const float *sk = s + k * NQ;
#pragma omp simd
            for (int64_t v = 0; v < NQ; v++) corr[v] = sk[v] > corr[v] ? sk[v] : corr[v];
        }
        for (int k = 0; k < nk; k++) {
            float *sk = s + k * NQ;
#pragma omp simd
            for (int64_t v = 0; v < NQ; v++) sk[v] = sk[v] == -INFINITY ? 0.0f : exp_le0(sk[v] - corr[v]);
        }
#pragma omp simd
        for (int64_t v = 0; v < NQ; v++) {
            const float mx = corr[v], c = m[v] == -INFINITY ? 0.0f : exp_le0(m[v] - mx);
            m[v] = mx;
            corr[v] = c;
            l[v] *= c;
        }
        for (int k = 0; k < nk; k++) {
            const float *sk = s + k * NQ;
#pragma omp simd
            for (int64_t v = 0; v < NQ; v++) l[v] += sk[v];
        }
        for (int k = 0; k < nk; k++) kv_load(type, ntx_kv_row(md, kv_v, slot, k0 + k, kh), hd, vt + k * HD);
        for (int64_t v = 0; v < nq; v++) { /* acc = acc × corr + Σ_k p_k v_k, 16 values at a time */
            float *av = acc + v * HD;
            for (int i0 = 0; i0 < HD; i0 += 16) {
                float a[16];
#pragma omp simd
                for (int t = 0; t < 16; t++) a[t] = av[i0 + t] * corr[v];
                for (int k = 0; k < nk; k++) {
                    const float p = s[k * NQ + v], *vr = vt + k * HD + i0;
#pragma omp simd
                    for (int t = 0; t < 16; t++) a[t] += p * vr[t];
                }
#pragma omp simd
                for (int t = 0; t < 16; t++) av[i0 + t] = a[t];
            }
        }
    }
    for (int64_t v = 0; v < nq; v++) {
        float *o = out + (r0 + v / g) * (int64_t)H * hd + (int64_t)(kh * g + v % g) * hd;
        for (int i = 0; i < hd; i++) o[i] = acc[v * HD + i] / l[v];
    }
}

#if defined(__AVX2__) && defined(__F16C__)
/* Eight rows of eight floats, transposed in registers. */
static inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
#endif

/* Keys [k0, k0 + nk) of KV head kh decoded into kt (hd, KT): column k holds key k0 + k, the
 * columns past nk zero. row: hd floats of scratch. */
static void load_keys_t(const ntx_model *md, const void *kv_k, int64_t slot, int64_t k0, int nk, int kh, float *kt,
                        float *row) {
    const int hd = md->head_dim, type = md->kv_type;
#if defined(__AVX2__) && defined(__F16C__)
    if (type == NTX_F16 && nk == KT && hd % 8 == 0) { /* F16C: 8 values per conversion, 8×8 in registers */
        const uint8_t *rows[KT];
        for (int k = 0; k < KT; k++) rows[k] = ntx_kv_row(md, kv_k, slot, k0 + k, kh);
        for (int i0 = 0; i0 < hd; i0 += 8)
            for (int kb = 0; kb < KT; kb += 8) {
                __m256 r[8];
                for (int j = 0; j < 8; j++) r[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rows[kb + j] + 2 * i0)));
                transpose8(r);
                for (int j = 0; j < 8; j++) _mm256_storeu_ps(kt + (i0 + j) * KT + kb, r[j]);
            }
        return;
    }
#endif
    for (int k = 0; k < KT; k++) {
        if (k < nk)
            kv_load(type, ntx_kv_row(md, kv_k, slot, k0 + k, kh), hd, row);
        else
            memset(row, 0, (size_t)hd * sizeof(float));
        for (int i = 0; i < hd; i++) kt[i * KT + k] = row[i];
    }
}

#define QB 4 /* query vectors whose scores are summed together: 2 × QB independent chains of 8 lanes */

/* ntx_attn_group's scratch for nq query vectors: q (NQ, hd), scores (NQ, KT), m, l, corr, lim
 * (NQ each), acc (NQ, HD), the keys transposed (hd, KT), the values (KT, HD), a decoded row (HD). */
typedef struct {
    float *qs, *s, *m, *l, *corr, *lim, *acc, *kt, *vt, *row;
    int64_t NQ, HD;
} keys_work;

static inline keys_work keys_work_of(const ntx_model *md, int64_t nq, float *scratch) {
    const int hd = md->head_dim;
    keys_work w;
    w.NQ = (nq + QB - 1) / QB * QB;
    w.HD = up16(hd);
    w.qs = scratch;
    w.s = w.qs + w.NQ * hd;
    w.m = w.s + w.NQ * KT;
    w.l = w.m + w.NQ;
    w.corr = w.l + w.NQ;
    w.lim = w.corr + w.NQ;
    w.acc = w.lim + w.NQ;
    w.kt = w.acc + w.NQ * w.HD;
    w.vt = w.kt + (int64_t)hd * KT;
    w.row = w.vt + KT * w.HD;
    return w;
}

/* The online softmax of rows [r0, r1)'s query vectors for KV head kh over keys [k_lo, k_hi),
 * from a fresh state: leaves each vector's running max m, sum l and unnormalised output acc in w. */
static void attn_keys(const ntx_model *md, const ntx_header *h, const float *q, const void *kv_k, const void *kv_v,
                      int64_t r0, int64_t r1, int kh, int64_t k_lo, int64_t k_hi, const keys_work *w) {
    const int hd = md->head_dim, H = md->n_heads, g = H / md->n_kv_heads, type = md->kv_type;
    const int64_t nq = (r1 - r0) * g, NQ = w->NQ, HD = w->HD, slot = h->slots[r0];
    const float scale = md->attn_scale;
    float *qs = w->qs, *s = w->s, *m = w->m, *l = w->l, *corr = w->corr, *lim = w->lim, *acc = w->acc, *kt = w->kt,
          *vt = w->vt, *row = w->row;

    for (int64_t v = 0; v < NQ; v++) { /* query vector v: row r0 + v / g, head kh * g + v % g */
        if (v < nq)
            memcpy(qs + v * hd, q + (r0 + v / g) * (int64_t)H * hd + (int64_t)(kh * g + v % g) * hd,
                   (size_t)hd * sizeof(float));
        else
            memset(qs + v * hd, 0, (size_t)hd * sizeof(float));
        m[v] = -INFINITY;
        l[v] = 0.0f;
        lim[v] = v < nq ? (float)h->positions[r0 + v / g] : -1.0f; /* padding sees nothing */
    }
    memset(acc, 0, (size_t)(NQ * HD) * sizeof(float));
    if (HD != hd) /* the columns past hd stay zero */
        for (int k = 0; k < KT; k++) memset(vt + k * HD + hd, 0, (size_t)(HD - hd) * sizeof(float));

    for (int64_t k0 = k_lo; k0 < k_hi; k0 += KT) {
        const int nk = k_hi - k0 < KT ? (int)(k_hi - k0) : KT;
        load_keys_t(md, kv_k, slot, k0, nk, kh, kt, row);
        for (int64_t v0 = 0; v0 < NQ; v0 += QB) { /* scores of QB query vectors against the tile's keys */
            float a[QB][KT] = {{0}};
            const float *qv = qs + v0 * hd;
            for (int i = 0; i < hd; i++) {
                const float *ki = kt + i * KT;
                for (int u = 0; u < QB; u++) {
                    const float qi = qv[u * hd + i];
#pragma omp simd
                    for (int t = 0; t < KT; t++) a[u][t] += ki[t] * qi;
                }
            }
            for (int u = 0; u < QB; u++) {
                float *sv = s + (v0 + u) * KT;
                const float lv = lim[v0 + u];
#pragma omp simd
                for (int t = 0; t < KT; t++) sv[t] = (float)(k0 + t) > lv ? -INFINITY : a[u][t] * scale;
            }
        }
        /* online softmax, per query vector as the reference runs it across them */
        for (int64_t v = 0; v < NQ; v++) {
            float *sv = s + v * KT, mx = m[v];
            for (int k = 0; k < nk; k++) mx = sv[k] > mx ? sv[k] : mx;
#pragma omp simd
            for (int k = 0; k < nk; k++) sv[k] = sv[k] == -INFINITY ? 0.0f : exp_le0(sv[k] - mx);
            const float c = m[v] == -INFINITY ? 0.0f : exp_le0(m[v] - mx);
            m[v] = mx;
            corr[v] = c;
            float lv = l[v] * c;
            for (int k = 0; k < nk; k++) lv += sv[k];
            l[v] = lv;
        }
        for (int k = 0; k < nk; k++) kv_load(type, ntx_kv_row(md, kv_v, slot, k0 + k, kh), hd, vt + k * HD);
        for (int i0 = 0; i0 < HD; i0 += 16) /* acc = acc × corr + Σ_k p_k v_k, QB vectors × 16 values at a time */
            for (int64_t v0 = 0; v0 < nq; v0 += QB) {
                float a[QB][16];
                for (int u = 0; u < QB; u++)
#pragma omp simd
                    for (int t = 0; t < 16; t++) a[u][t] = acc[(v0 + u) * HD + i0 + t] * corr[v0 + u];
                for (int k = 0; k < nk; k++) {
                    const float *vr = vt + k * HD + i0;
                    for (int u = 0; u < QB; u++) {
                        const float p = s[(v0 + u) * KT + k];
#pragma omp simd
                        for (int t = 0; t < 16; t++) a[u][t] += p * vr[t];
                    }
                }
                for (int u = 0; u < QB; u++)
#pragma omp simd
                    for (int t = 0; t < 16; t++) acc[(v0 + u) * HD + i0 + t] = a[u][t];
            }
    }
}

/* out's rows [r0, r1), heads of kh: each vector's acc (row stride lda) / l. */
static void attn_out(const ntx_model *md, int64_t r0, int kh, int64_t nq, const float *acc, int64_t lda,
                     const float *l, float *out) {
    const int hd = md->head_dim, H = md->n_heads, g = H / md->n_kv_heads;
    for (int64_t v = 0; v < nq; v++) {
        float *o = out + (r0 + v / g) * (int64_t)H * hd + (int64_t)(kh * g + v % g) * hd;
        for (int i = 0; i < hd; i++) o[i] = acc[v * lda + i] / l[v];
    }
}

void ntx_attn_group(const ntx_model *md, const ntx_header *h, const float *q, float *out, const void *kv_k,
                    const void *kv_v, int64_t r0, int64_t r1, int kh, float *scratch) {
    const int64_t nq = (r1 - r0) * (md->n_heads / md->n_kv_heads);
    const keys_work w = keys_work_of(md, nq, scratch);
    attn_keys(md, h, q, kv_k, kv_v, r0, r1, kh, 0, h->positions[r1 - 1] + 1, &w); /* the last row sees them all */
    attn_out(md, r0, kh, nq, w.acc, w.HD, w.l, out);
}

/* ---- splits ------------------------------------------------------------------------------ */
/* A partial is one split's state for the nq query vectors of a (group, KV head): m (nq), l (nq),
 * acc (nq, hd), as attn_keys leaves them. The fold takes the state to be split 0's partial and
 * folds splits 1, 2, … into it in order: M' = max(M, m), L' = L e^(M − M') + l e^(m − M'), the
 * same for the output. A split that holds none of a row's keys (the rows of a prefill chunk
 * before it) leaves that row's state as it was: its m is −inf, its l and acc 0, and
 * e^(M − M') = exp_le0(0) = 1 exactly. So a row below NTX_ATTN_SPLIT keeps the whole kernel's
 * bits in a group that reaches past it, and a row's bits never depend on its group. */

static inline int64_t splits_of(int64_t end) { return (end + NTX_ATTN_SPLIT - 1) / NTX_ATTN_SPLIT; }

static inline int64_t part_floats(const ntx_model *md, int64_t nq) { return nq * (md->head_dim + 2); }

/* w's state (acc of row stride w->HD) into a partial. */
static void keep(const ntx_model *md, int64_t nq, const keys_work *w, float *part) {
    const int hd = md->head_dim;
    memcpy(part, w->m, (size_t)nq * sizeof(float));
    memcpy(part + nq, w->l, (size_t)nq * sizeof(float));
    for (int64_t v = 0; v < nq; v++) memcpy(part + 2 * nq + v * hd, w->acc + v * w->HD, (size_t)hd * sizeof(float));
}

/* The running state st (a partial) ← st folded with the next split's m, l, acc (row stride lda).
 * st's max is finite: every row sees key 0, in split 0. */
static void fold(const ntx_model *md, int64_t nq, float *st, const float *m, const float *l, const float *acc,
                 int64_t lda) {
    const int hd = md->head_dim;
    float *M = st, *L = st + nq, *A = st + 2 * nq;
    for (int64_t v = 0; v < nq; v++) {
        const float mx = m[v] > M[v] ? m[v] : M[v];
        const float a = exp_le0(M[v] - mx), b = m[v] == -INFINITY ? 0.0f : exp_le0(m[v] - mx);
        M[v] = mx;
        L[v] = L[v] * a + l[v] * b;
        float *Av = A + v * hd;
        const float *av = acc + v * lda;
#pragma omp simd
        for (int i = 0; i < hd; i++) Av[i] = Av[i] * a + av[i] * b;
    }
}

int64_t ntx_attn_parts(const ntx_model *md) {
    return NTX_ATTN_ROWS * part_floats(md, md->n_heads) * splits_of(md->max_ctx);
}

int ntx_attn_plan_init(ntx_attn_plan *p, const ntx_model *md, const ntx_header *h, int kernel, float *parts,
                       int64_t n_parts) {
    const int64_t n = h->n_rows, Hk = md->n_kv_heads, g = md->n_heads / md->n_kv_heads;
    memset(p, 0, sizeof(*p));
    p->kernel = kernel;
    p->parts = parts;
    /* groups, first: n + 1 each at most; part: n; pending: n × Hk int32 */
    int64_t *mem = malloc((size_t)(3 * n + 2) * sizeof(int64_t) + (size_t)(n * Hk) * sizeof(int32_t));
    if (!mem) return -2;
    p->groups = mem;
    p->n_groups = ntx_attn_groups(h, p->groups);
    p->first = p->groups + n + 1;
    p->part = p->first + n + 1;
    p->pending = (int32_t *)(p->part + n);
    memset(p->pending, 0, (size_t)(p->n_groups * Hk) * sizeof(int32_t));
    int64_t items = 0, used = 0;
    for (int64_t gi = 0; gi < p->n_groups; gi++) {
        const int64_t r0 = p->groups[gi], r1 = p->groups[gi + 1];
        const int64_t ns = kernel == NTX_ATTN_STEP || kernel == NTX_ATTN_SERIAL ? splits_of(h->positions[r1 - 1] + 1) : 1;
        const int64_t need = Hk * ns * part_floats(md, (r1 - r0) * g);
        p->first[gi] = items;
        p->part[gi] = -1;
        if (ns > 1 && kernel == NTX_ATTN_STEP && used + need <= n_parts) {
            p->part[gi] = used;
            used += need;
            items += Hk * ns;
        } else
            items += Hk;
    }
    p->first[p->n_groups] = p->n_items = items;
    return 0;
}

void ntx_attn_plan_free(ntx_attn_plan *p) {
    free(p->groups);
    p->groups = NULL;
}

void ntx_attn_item(const ntx_attn_plan *p, const ntx_model *md, const ntx_header *h, const float *q, float *out,
                   const void *kv_k, const void *kv_v, int64_t it, float *scratch) {
    const int Hk = md->n_kv_heads;
    int64_t lo = 0, hi = p->n_groups; /* the group of item it: first[gi] <= it < first[gi + 1] */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (p->first[mid] <= it) lo = mid;
        else hi = mid;
    }
    const int64_t gi = lo, k = it - p->first[gi], r0 = p->groups[gi], r1 = p->groups[gi + 1];
    const int64_t nq = (r1 - r0) * (md->n_heads / Hk), end = h->positions[r1 - 1] + 1;
    if (p->kernel == NTX_ATTN_REF) {
        ntx_attn_group_ref(md, h, q, out, kv_k, kv_v, r0, r1, (int)k, scratch);
        return;
    }
    const int64_t ns = p->kernel == NTX_ATTN_WHOLE ? 1 : splits_of(end);
    if (ns == 1) {
        ntx_attn_group(md, h, q, out, kv_k, kv_v, r0, r1, (int)k, scratch);
        return;
    }
    const keys_work w = keys_work_of(md, nq, scratch);
    const int64_t pf = part_floats(md, nq);
    if (p->part[gi] < 0) { /* the head's splits in turn, folded as they come */
        float *st = scratch + ntx_attn_scratch(md) - part_floats(md, (int64_t)NTX_ATTN_ROWS * (md->n_heads / Hk));
        for (int64_t sp = 0; sp < ns; sp++) {
            const int64_t k_hi = (sp + 1) * NTX_ATTN_SPLIT < end ? (sp + 1) * NTX_ATTN_SPLIT : end;
            attn_keys(md, h, q, kv_k, kv_v, r0, r1, (int)k, sp * NTX_ATTN_SPLIT, k_hi, &w);
            if (sp == 0)
                keep(md, nq, &w, st);
            else
                fold(md, nq, st, w.m, w.l, w.acc, w.HD);
        }
        attn_out(md, r0, (int)k, nq, st + 2 * nq, md->head_dim, st + nq, out);
        return;
    }
    /* one split of one head; the head's last split to finish folds them all */
    const int kh = (int)(k / ns);
    const int64_t sp = k % ns, k_hi = (sp + 1) * NTX_ATTN_SPLIT < end ? (sp + 1) * NTX_ATTN_SPLIT : end;
    float *mine = p->parts + p->part[gi] + kh * ns * pf;
    attn_keys(md, h, q, kv_k, kv_v, r0, r1, kh, sp * NTX_ATTN_SPLIT, k_hi, &w);
    keep(md, nq, &w, mine + sp * pf);
    int32_t *pending = p->pending + gi * Hk + kh;
    if (__atomic_add_fetch(pending, 1, __ATOMIC_ACQ_REL) < ns) return; /* acquire: the others' partials */
    for (int64_t j = 1; j < ns; j++) {
        const float *pj = mine + j * pf;
        fold(md, nq, mine, pj, pj + nq, pj + 2 * nq, md->head_dim);
    }
    attn_out(md, r0, kh, nq, mine + 2 * nq, md->head_dim, mine + nq, out);
    __atomic_store_n(pending, 0, __ATOMIC_RELAXED); /* for the next layer, after the step's barrier */
}
