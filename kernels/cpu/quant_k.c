/* The K types Q2_K … Q6_K (super-blocks of 256) against ntx_q8_256 activations.
 *
 * Within a super-block every sub-block scale is a small integer, so the whole super-block's dot
 * is one exact int32 sum Σ_k sc_k Σ q a; the float scales d and dmin multiply it once. The
 * offsets (Q3_K's -4, Q6_K's -32) and the mins (Q2_K, Q4_K, Q5_K) come from the activation's
 * sums of 16 (bsums):  Σ (q - o) a = Σ q a - o Σ a.
 */
#include "quant.h"

#define Q2_K_BYTES 84  /* scales[16] (4-bit scale | 4-bit min), qs[64], d, dmin */
#define Q3_K_BYTES 110 /* hmask[32], qs[64], scales[12] (16 × 6-bit), d */
#define Q4_K_BYTES 144 /* d, dmin, scales[12] (8 × 6-bit scale, 8 × 6-bit min), qs[128] */
#define Q5_K_BYTES 176 /* d, dmin, scales[12], qh[32], qs[128] */
#define Q6_K_BYTES 210 /* ql[128], qh[64], scales[16] (int8), d */

/* ---- element and scale layouts ---------------------------------------------------------- */

/* Two-bit field of element e (Q2_K, Q3_K): 32-byte chunks of 128 elements, four shifts. */
NTX_INLINE int q2_bits(const uint8_t *qs, int e) {
    return (qs[32 * (e >> 7) + (e & 31)] >> (2 * ((e >> 5) & 3))) & 3;
}

/* Bit e / 32 of byte e % 32 (Q3_K's hmask, Q5_K's qh). */
NTX_INLINE int hbit(const uint8_t *h, int e) { return (h[e & 31] >> (e >> 5)) & 1; }

/* Q3_K: signed q in -4..3 (the offset is 0 where the mask bit is set). */
NTX_INLINE int q3(const uint8_t *b, int e) { return q2_bits(b + 32, e) - (hbit(b, e) ? 0 : 4); }

NTX_INLINE void q3_scales(const uint8_t *s, int sc[16]) {
    for (int k = 0; k < 16; k++) {
        int lo = (s[k & 7] >> (4 * (k >> 3))) & 15, hi = (s[8 + (k & 3)] >> (2 * (k >> 2))) & 3;
        sc[k] = (lo | hi << 4) - 32;
    }
}

/* Q4_K / Q5_K: the 8 six-bit scales and mins of the 12 scale bytes. */
NTX_INLINE void k_scale_min(const uint8_t *s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | (s[j] >> 6) << 4;
        mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
    }
}

/* Four-bit field of element e (Q4_K, Q5_K): sub-block j = e / 32 is the low (even j) or high
 * (odd j) nibble of the 32-byte chunk j / 2. */
NTX_INLINE int q4k_bits(const uint8_t *qs, int e) {
    int j = e >> 5;
    return (qs[32 * (j >> 1) + (e & 31)] >> (4 * (j & 1))) & 15;
}

/* Q6_K: unsigned q in 0..63 (the weight is q - 32). */
NTX_INLINE int q6(const uint8_t *b, int e) {
    int c = e >> 7, r = e & 127;
    int lo = (b[64 * c + (r & 63)] >> (4 * (r >> 6))) & 15;
    int hi = (b[128 + 32 * c + (r & 31)] >> (2 * (r >> 5))) & 3;
    return lo | hi << 4;
}

/* ---- dequantization: gguf.quants' float32 operations in its order ---------------------- */

static void deq_q2_k(const uint8_t *w, int nb, float *y) {
    for (int b = 0; b < nb; b++, w += Q2_K_BYTES, y += 256) {
        float d = ntx_f16(w + 80), dmin = ntx_f16(w + 82);
        for (int e = 0; e < 256; e++) {
            uint8_t s = w[e >> 4];
            float dl = d * (float)(s & 15), ml = dmin * (float)(s >> 4);
            y[e] = ntx_rounded(dl * (float)q2_bits(w + 16, e)) - ml;
        }
    }
}

static void deq_q3_k(const uint8_t *w, int nb, float *y) {
    for (int b = 0; b < nb; b++, w += Q3_K_BYTES, y += 256) {
        int sc[16];
        q3_scales(w + 96, sc);
        float d = ntx_f16(w + 108);
        for (int e = 0; e < 256; e++) y[e] = (d * (float)sc[e >> 4]) * (float)q3(w, e);
    }
}

static void deq_q4_k(const uint8_t *w, int nb, float *y) {
    for (int b = 0; b < nb; b++, w += Q4_K_BYTES, y += 256) {
        int sc[8], mn[8];
        k_scale_min(w + 4, sc, mn);
        float d = ntx_f16(w), dmin = ntx_f16(w + 2);
        for (int e = 0; e < 256; e++) {
            float dk = d * (float)sc[e >> 5], mk = dmin * (float)mn[e >> 5];
            y[e] = ntx_rounded(dk * (float)q4k_bits(w + 16, e)) - mk;
        }
    }
}

static void deq_q5_k(const uint8_t *w, int nb, float *y) {
    for (int b = 0; b < nb; b++, w += Q5_K_BYTES, y += 256) {
        int sc[8], mn[8];
        k_scale_min(w + 4, sc, mn);
        float d = ntx_f16(w), dmin = ntx_f16(w + 2);
        for (int e = 0; e < 256; e++) {
            float dk = d * (float)sc[e >> 5], mk = dmin * (float)mn[e >> 5];
            int q = q4k_bits(w + 48, e) | hbit(w + 16, e) << 4;
            y[e] = ntx_rounded(dk * (float)q) - mk;
        }
    }
}

static void deq_q6_k(const uint8_t *w, int nb, float *y) {
    for (int b = 0; b < nb; b++, w += Q6_K_BYTES, y += 256) {
        float d = ntx_f16(w + 208);
        for (int e = 0; e < 256; e++) y[e] = (d * (float)(int8_t)w[192 + (e >> 4)]) * (float)(q6(w, e) - 32);
    }
}

/* ---- portable dots ------------------------------------------------------------------------ */

NTX_PORTABLE float dot_q2_k(const uint8_t *w, const ntx_q8_256 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q2_K_BYTES, a++) {
        int isum = 0, msum = 0;
        for (int k = 0; k < 16; k++) {
            int s = 0;
            for (int e = 16 * k; e < 16 * k + 16; e++) s += q2_bits(w + 16, e) * a->q[e];
            isum += (w[k] & 15) * s;
            msum += (w[k] >> 4) * a->bsums[k];
        }
        acc += ntx_f16(w + 80) * a->d * (float)isum - ntx_f16(w + 82) * a->d * (float)msum;
    }
    return acc;
}

NTX_PORTABLE float dot_q3_k(const uint8_t *w, const ntx_q8_256 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q3_K_BYTES, a++) {
        int sc[16], isum = 0;
        q3_scales(w + 96, sc);
        for (int k = 0; k < 16; k++) {
            int s = 0;
            for (int e = 16 * k; e < 16 * k + 16; e++) s += q3(w, e) * a->q[e];
            isum += sc[k] * s;
        }
        acc += ntx_f16(w + 108) * a->d * (float)isum;
    }
    return acc;
}

NTX_PORTABLE float dot_q4_k(const uint8_t *w, const ntx_q8_256 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q4_K_BYTES, a++) {
        int sc[8], mn[8], isum = 0, msum = 0;
        k_scale_min(w + 4, sc, mn);
        for (int j = 0; j < 8; j++) {
            int s = 0;
            for (int e = 32 * j; e < 32 * j + 32; e++) s += q4k_bits(w + 16, e) * a->q[e];
            isum += sc[j] * s;
            msum += mn[j] * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
        }
        acc += ntx_f16(w) * a->d * (float)isum - ntx_f16(w + 2) * a->d * (float)msum;
    }
    return acc;
}

NTX_PORTABLE float dot_q5_k(const uint8_t *w, const ntx_q8_256 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q5_K_BYTES, a++) {
        int sc[8], mn[8], isum = 0, msum = 0;
        k_scale_min(w + 4, sc, mn);
        for (int j = 0; j < 8; j++) {
            int s = 0;
            for (int e = 32 * j; e < 32 * j + 32; e++)
                s += (q4k_bits(w + 48, e) | hbit(w + 16, e) << 4) * a->q[e];
            isum += sc[j] * s;
            msum += mn[j] * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
        }
        acc += ntx_f16(w) * a->d * (float)isum - ntx_f16(w + 2) * a->d * (float)msum;
    }
    return acc;
}

NTX_PORTABLE float dot_q6_k(const uint8_t *w, const ntx_q8_256 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q6_K_BYTES, a++) {
        int isum = 0;
        for (int k = 0; k < 16; k++) {
            int s = 0;
            for (int e = 16 * k; e < 16 * k + 16; e++) s += (q6(w, e) - 32) * a->q[e];
            isum += (int8_t)w[192 + k] * s;
        }
        acc += ntx_f16(w + 208) * a->d * (float)isum;
    }
    return acc;
}

#define PORTABLE_TILE(name, dot)                                                                   \
    static void name(const uint8_t *w, size_t wrb, int nw, const uint8_t *a, size_t arb, int na,  \
                     int nb, float *out) {                                                         \
        for (int iw = 0; iw < nw; iw++)                                                            \
            for (int ia = 0; ia < na; ia++)                                                        \
                out[iw * NTX_TA + ia] = dot(w + iw * wrb, (const ntx_q8_256 *)(a + ia * arb), nb);  \
    }

PORTABLE_TILE(tile_q2_k, dot_q2_k)
PORTABLE_TILE(tile_q3_k, dot_q3_k)
PORTABLE_TILE(tile_q4_k, dot_q4_k)
PORTABLE_TILE(tile_q5_k, dot_q5_k)
PORTABLE_TILE(tile_q6_k, dot_q6_k)

const ntx_kernel ntx_kernel_q2_k = {256, Q2_K_BYTES, NTX_ACT_Q8_256, tile_q2_k, deq_q2_k};
const ntx_kernel ntx_kernel_q3_k = {256, Q3_K_BYTES, NTX_ACT_Q8_256, tile_q3_k, deq_q3_k};
const ntx_kernel ntx_kernel_q4_k = {256, Q4_K_BYTES, NTX_ACT_Q8_256, tile_q4_k, deq_q4_k};
const ntx_kernel ntx_kernel_q5_k = {256, Q5_K_BYTES, NTX_ACT_Q8_256, tile_q5_k, deq_q5_k};
const ntx_kernel ntx_kernel_q6_k = {256, Q6_K_BYTES, NTX_ACT_Q8_256, tile_q6_k, deq_q6_k};
