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

/* Q3_K's 16 six-bit scales (4 low bits in bytes 0..7, 2 high bits in bytes 8..11) as 16 bytes
 * in four words, offset by 32: the weight scale is sc - 32. */
NTX_INLINE void q3_scale_words(const uint8_t *s, uint32_t v[4]) {
    const uint32_t m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    uint32_t a0 = ntx_u32(s), a1 = ntx_u32(s + 4), hi = ntx_u32(s + 8);
    v[0] = (a0 & m4) | ((hi >> 0) & m2) << 4;
    v[1] = (a1 & m4) | ((hi >> 2) & m2) << 4;
    v[2] = ((a0 >> 4) & m4) | ((hi >> 4) & m2) << 4;
    v[3] = ((a1 >> 4) & m4) | ((hi >> 6) & m2) << 4;
}

NTX_INLINE void q3_scales(const uint8_t *s, int sc[16]) {
    uint32_t v[4];
    uint8_t b[16];
    q3_scale_words(s, v);
    memcpy(b, v, 16);
    for (int k = 0; k < 16; k++) sc[k] = b[k] - 32;
}

/* Q4_K / Q5_K: the 8 six-bit scales and 8 six-bit mins of the 12 scale bytes, as 16 bytes in
 * four words (scales in bytes 0..7, mins in 8..15). */
NTX_INLINE void k_scale_min_words(const uint8_t *s, uint32_t v[4]) {
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    uint32_t a0 = ntx_u32(s), a1 = ntx_u32(s + 4), a2 = ntx_u32(s + 8);
    v[0] = a0 & m6;
    v[1] = (a2 & m4) | ((a0 >> 6) & m2) << 4;
    v[2] = a1 & m6;
    v[3] = ((a2 >> 4) & m4) | ((a1 >> 6) & m2) << 4;
}

NTX_INLINE void k_scale_min(const uint8_t *s, int sc[8], int mn[8]) {
    uint32_t v[4];
    uint8_t b[16];
    k_scale_min_words(s, v);
    memcpy(b, v, 16);
    for (int j = 0; j < 8; j++) sc[j] = b[j], mn[j] = b[8 + j];
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

/* ---- portable dots ------------------------------------------------------------------------
 * Loops over the bytes in storage order with loop-invariant shifts, so the compiler vectorizes
 * them for any target. */

/* Σ over two 16-element sub-blocks of one 32-byte group: s[0], s[1]. */
NTX_INLINE void group_sums(const uint8_t q[32], const int8_t *a, int s[2]) {
    for (int h = 0; h < 2; h++) {
        int t = 0;
#pragma GCC unroll 1 /* a loop the vectorizer sees, not 16 unrolled statements */
        for (int l = 0; l < 16; l++) t += q[16 * h + l] * a[16 * h + l];
        s[h] = t;
    }
}

NTX_PORTABLE float dot_q2_k(const uint8_t *w, const ntx_q8_256 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q2_K_BYTES, a++) {
        int isum = 0, msum = 0;
        for (int g = 0; g < 8; g++) {
            uint8_t q[32];
            const uint8_t *qs = w + 16 + 32 * (g >> 2);
            for (int l = 0; l < 32; l++) q[l] = (qs[l] >> (2 * (g & 3))) & 3;
            int s[2];
            group_sums(q, a->q + 32 * g, s);
            isum += (w[2 * g] & 15) * s[0] + (w[2 * g + 1] & 15) * s[1];
        }
        for (int k = 0; k < 16; k++) msum += (w[k] >> 4) * a->bsums[k];
        acc += ntx_f16(w + 80) * a->d * (float)isum - ntx_f16(w + 82) * a->d * (float)msum;
    }
    return acc;
}

NTX_PORTABLE float dot_q3_k(const uint8_t *w, const ntx_q8_256 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q3_K_BYTES, a++) {
        int sc[16], isum = 0;
        q3_scales(w + 96, sc);
        for (int g = 0; g < 8; g++) {
            uint8_t q[32]; /* q + 4: the low bits and the mask bit as bit 2 */
            const uint8_t *qs = w + 32 + 32 * (g >> 2);
            for (int l = 0; l < 32; l++) q[l] = ((qs[l] >> (2 * (g & 3))) & 3) | ((w[l] >> g) & 1) << 2;
            int s[2];
            group_sums(q, a->q + 32 * g, s);
            isum += sc[2 * g] * s[0] + sc[2 * g + 1] * s[1];
        }
        for (int k = 0; k < 16; k++) isum -= 4 * sc[k] * a->bsums[k];
        acc += ntx_f16(w + 108) * a->d * (float)isum;
    }
    return acc;
}

/* Q4_K and Q5_K (qh not NULL): sub-block j is the low (even j) or high (odd j) nibble of
 * 32-byte chunk j / 2, with bit j of qh as bit 4. */
NTX_INLINE float dot_k45(const uint8_t *w, const uint8_t *qh, const uint8_t *qs, const ntx_q8_256 *a) {
    int sc[8], mn[8], isum = 0, msum = 0;
    k_scale_min(w + 4, sc, mn);
    for (int j = 0; j < 8; j++) {
        const uint8_t *c = qs + 32 * (j >> 1);
        int s = 0;
        for (int l = 0; l < 32; l++) {
            int q = (c[l] >> (4 * (j & 1))) & 15;
            if (qh) q |= ((qh[l] >> j) & 1) << 4;
            s += q * a->q[32 * j + l];
        }
        isum += sc[j] * s;
        msum += mn[j] * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
    }
    return ntx_f16(w) * a->d * (float)isum - ntx_f16(w + 2) * a->d * (float)msum;
}

NTX_PORTABLE float dot_q4_k(const uint8_t *w, const ntx_q8_256 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q4_K_BYTES, a++) acc += dot_k45(w, NULL, w + 16, a);
    return acc;
}

NTX_PORTABLE float dot_q5_k(const uint8_t *w, const ntx_q8_256 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q5_K_BYTES, a++) acc += dot_k45(w, w + 16, w + 48, a);
    return acc;
}

NTX_PORTABLE float dot_q6_k(const uint8_t *w, const ntx_q8_256 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q6_K_BYTES, a++) {
        const int8_t *sc = (const int8_t *)(w + 192);
        int isum = 0;
        for (int g = 0; g < 8; g++) { /* group g: 32 elements from 128 (g / 4) + 32 (g % 4) */
            const int c = g >> 2, k = g & 3;
            const uint8_t *ql = w + 64 * c + 32 * (k & 1), *qh = w + 128 + 32 * c;
            uint8_t q[32];
            for (int l = 0; l < 32; l++) q[l] = ((ql[l] >> (4 * (k >> 1))) & 15) | ((qh[l] >> (2 * k)) & 3) << 4;
            int s[2];
            group_sums(q, a->q + 32 * g, s);
            isum += sc[2 * g] * s[0] + sc[2 * g + 1] * s[1];
        }
        for (int k = 0; k < 16; k++) isum -= 32 * sc[k] * a->bsums[k];
        acc += ntx_f16(w + 208) * a->d * (float)isum;
    }
    return acc;
}

#define PORTABLE_TILE(name, dot)                                                                   \
    static void name(const uint8_t *w, size_t wrb, int nw, const uint8_t *a, size_t arb, int na,  \
                     int nb, int pf, float *out) {                                                 \
        (void)pf;                                                                                  \
        for (int iw = 0; iw < nw; iw++)                                                            \
            for (int ia = 0; ia < na; ia++)                                                        \
                out[iw * NTX_TA + ia] = dot(w + iw * wrb, (const ntx_q8_256 *)(a + ia * arb), nb);  \
    }

#if !defined(__AVX2__)
PORTABLE_TILE(tile_q2_k, dot_q2_k)
PORTABLE_TILE(tile_q3_k, dot_q3_k)
PORTABLE_TILE(tile_q4_k, dot_q4_k)
PORTABLE_TILE(tile_q5_k, dot_q5_k)
PORTABLE_TILE(tile_q6_k, dot_q6_k)
#else

/* ---- AVX2 / AVX-512 VNNI ------------------------------------------------------------------
 * Each 32-element group of weights is unpacked once to unsigned bytes and, per activation row,
 * multiplied into int16 pair sums (vpmaddubsw: q ≤ 63, so no saturation) that the group's
 * scales weight into the super-block's int32 lanes (vpdpwssd, or vpmaddwd + add on AVX2). */

enum kq { K_Q2, K_Q3, K_Q4, K_Q5, K_Q6 };

NTX_INLINE int k_bytes(const int t) {
    return t == K_Q2 ? Q2_K_BYTES : t == K_Q3 ? Q3_K_BYTES : t == K_Q4 ? Q4_K_BYTES
         : t == K_Q5 ? Q5_K_BYTES : Q6_K_BYTES;
}

/* Per byte: the `width`-bit field at bit `from` moved to bit `to`, other bits zero. The 16-bit
 * shift spills bits between the two bytes of a lane only below (left shift) or above (right
 * shift) the field's new place, where the mask drops them. */
NTX_INLINE __m256i field(__m256i v, const int from, const int width, const int to) {
    __m256i s = from > to ? _mm256_srli_epi16(v, from - to) : from < to ? _mm256_slli_epi16(v, to - from) : v;
    return _mm256_and_si256(s, _mm256_set1_epi8((char)(((1 << width) - 1) << to)));
}

/* int16 k of each 128-bit lane of v, broadcast over that lane. */
NTX_INLINE __m256i lane_bcast16(__m256i v, const int k0, const int k1) {
    return _mm256_shuffle_epi8(v, _mm256_set_m128i(_mm_set1_epi16((short)((2 * k1 + 1) << 8 | 2 * k1)),
                                                   _mm_set1_epi16((short)((2 * k0 + 1) << 8 | 2 * k0))));
}

/* Scales of 16-element sub-blocks 2g (low lane) and 2g + 1 (high lane) of group g; half[0]
 * holds scales 0..7 in both lanes, half[1] scales 8..15. */
NTX_INLINE __m256i pair_scales(const __m256i half[2], const int g) {
    return lane_bcast16(half[g >> 2], 2 * (g & 3), 2 * (g & 3) + 1);
}

NTX_INLINE void k_tile(const int t, const int NW, const int NA, const uint8_t *w, size_t wrb,
                       const uint8_t *a, size_t arb, int nb, int pf, float *out) {
    const int BB = k_bytes(t), MINS = t == K_Q2 || t == K_Q4 || t == K_Q5;
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc[NTX_TW][NTX_TA];
    NTX_UNROLL
    for (int iw = 0; iw < NW; iw++)
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) acc[iw][ia] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (pf) ntx_prefetch_next_tile(w, wrb, NW, b, BB);
        const ntx_q8_256 *ab[NTX_TA];
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) ab[ia] = (const ntx_q8_256 *)(a + ia * arb) + b;
        NTX_UNROLL
        for (int iw = 0; iw < NW; iw++) {
            const uint8_t *wb = w + iw * wrb + (size_t)b * BB;
            __m256i isum[NTX_TA], msum[NTX_TA];
            float d, dmin = 0.0f;
            if (t == K_Q4 || t == K_Q5) {
                uint32_t sm[4];
                k_scale_min_words(wb + 4, sm);
                __m128i v = _mm_setr_epi32((int)sm[0], (int)sm[1], (int)sm[2], (int)sm[3]);
                __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(v)); /* 8 scales, both lanes */
                __m256i mn = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v));      /* mn0 mn0 mn1 mn1 … */
                d = ntx_f16(wb), dmin = ntx_f16(wb + 2);
                NTX_UNROLL
                for (int ia = 0; ia < NA; ia++) {
                    isum[ia] = _mm256_setzero_si256();
                    msum[ia] = _mm256_madd_epi16(ntx_load256(ab[ia]->bsums), mn);
                }
                __m256i hb = t == K_Q5 ? ntx_load256(wb + 16) : _mm256_setzero_si256();
                const uint8_t *qs = wb + (t == K_Q5 ? 48 : 16);
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    __m256i raw = ntx_load256(qs + 32 * c);
                    __m256i lo = _mm256_and_si256(raw, m4), hi = field(raw, 4, 4, 0);
                    if (t == K_Q5) {
                        lo = _mm256_or_si256(lo, field(hb, 2 * c, 1, 4));
                        hi = _mm256_or_si256(hi, field(hb, 2 * c + 1, 1, 4));
                    }
                    __m256i s_lo = lane_bcast16(sc, 2 * c, 2 * c), s_hi = lane_bcast16(sc, 2 * c + 1, 2 * c + 1);
                    NTX_UNROLL
                    for (int ia = 0; ia < NA; ia++) {
                        __m256i p_lo = _mm256_maddubs_epi16(lo, ntx_load256(ab[ia]->q + 64 * c));
                        __m256i p_hi = _mm256_maddubs_epi16(hi, ntx_load256(ab[ia]->q + 64 * c + 32));
                        isum[ia] = ntx_dpwssd(ntx_dpwssd(isum[ia], p_lo, s_lo), p_hi, s_hi);
                    }
                }
            } else {
                /* Q2_K, Q3_K, Q6_K: eight groups of 32, each two sub-blocks of 16 */
                __m256i sc16, qsrc[2], hsrc = _mm256_setzero_si256();
                int off = 0;
                if (t == K_Q2) {
                    __m128i v = _mm_loadu_si128((const __m128i *)wb);
                    sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(v, _mm_set1_epi8(15)));
                    __m256i mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15)));
                    NTX_UNROLL
                    for (int ia = 0; ia < NA; ia++) msum[ia] = _mm256_madd_epi16(ntx_load256(ab[ia]->bsums), mn);
                    qsrc[0] = ntx_load256(wb + 16), qsrc[1] = ntx_load256(wb + 48);
                    d = ntx_f16(wb + 80), dmin = ntx_f16(wb + 82);
                } else if (t == K_Q3) {
                    uint32_t sb[4];
                    q3_scale_words(wb + 96, sb);
                    sc16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_setr_epi32((int)sb[0], (int)sb[1], (int)sb[2], (int)sb[3])),
                                            _mm256_set1_epi16(32));
                    hsrc = ntx_load256(wb);
                    qsrc[0] = ntx_load256(wb + 32), qsrc[1] = ntx_load256(wb + 64);
                    d = ntx_f16(wb + 108);
                    off = 4; /* q + 4 = low bits | mask bit << 2; off is 4 or 32, a shift */
                } else {
                    sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 192)));
                    d = ntx_f16(wb + 208);
                    off = 32;
                }
                NTX_UNROLL
                for (int ia = 0; ia < NA; ia++) {
                    /* lanes start at -off Σ_k sc_k bsum_k: the dot of the unsigned codes lands on Σ sc (q - off) a */
                    __m256i c = _mm256_madd_epi16(ntx_load256(ab[ia]->bsums), sc16);
                    isum[ia] = off ? _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(c, off == 4 ? 2 : 5))
                                   : _mm256_setzero_si256();
                }
                const __m256i half[2] = {_mm256_permute4x64_epi64(sc16, 0x44), _mm256_permute4x64_epi64(sc16, 0xee)};
#pragma GCC unroll 8
                for (int g = 0; g < 8; g++) {
                    __m256i q;
                    if (t == K_Q6) {
                        const int c = g >> 2, s = g & 3;
                        __m256i l = ntx_load256(wb + 64 * c + 32 * (s & 1)), h = ntx_load256(wb + 128 + 32 * c);
                        q = _mm256_or_si256(s < 2 ? _mm256_and_si256(l, m4) : field(l, 4, 4, 0), field(h, 2 * s, 2, 4));
                    } else {
                        q = field(qsrc[g >> 2], 2 * (g & 3), 2, 0);
                        if (t == K_Q3) q = _mm256_or_si256(q, field(hsrc, g, 1, 2));
                    }
                    __m256i scg = pair_scales(half, g);
                    NTX_UNROLL
                    for (int ia = 0; ia < NA; ia++)
                        isum[ia] = ntx_dpwssd(isum[ia], _mm256_maddubs_epi16(q, ntx_load256(ab[ia]->q + 32 * g)), scg);
                }
            }
            NTX_UNROLL
            for (int ia = 0; ia < NA; ia++) {
                acc[iw][ia] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[ia]), _mm256_set1_ps(d * ab[ia]->d), acc[iw][ia]);
                if (MINS)
                    acc[iw][ia] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[ia]), _mm256_set1_ps(dmin * ab[ia]->d), acc[iw][ia]);
            }
        }
    }
    NTX_UNROLL
    for (int iw = 0; iw < NW; iw++)
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) out[iw * NTX_TA + ia] = ntx_hsum(acc[iw][ia]);
}

#define SIMD_TILE(name, T)                                                                         \
    static void name(const uint8_t *w, size_t wrb, int nw, const uint8_t *a, size_t arb, int na,  \
                     int nb, int pf, float *out) {                                                 \
        _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
        NTX_TILE_SWITCH(T##_SHAPE, nw, na)                                                         \
        _Pragma("GCC diagnostic pop")                                                              \
    }
#define K_Q2_SHAPE(NW, NA) k_tile(K_Q2, NW, NA, w, wrb, a, arb, nb, pf, out)
#define K_Q3_SHAPE(NW, NA) k_tile(K_Q3, NW, NA, w, wrb, a, arb, nb, pf, out)
#define K_Q4_SHAPE(NW, NA) k_tile(K_Q4, NW, NA, w, wrb, a, arb, nb, pf, out)
#define K_Q5_SHAPE(NW, NA) k_tile(K_Q5, NW, NA, w, wrb, a, arb, nb, pf, out)
#define K_Q6_SHAPE(NW, NA) k_tile(K_Q6, NW, NA, w, wrb, a, arb, nb, pf, out)
SIMD_TILE(tile_q2_k, K_Q2)
SIMD_TILE(tile_q3_k, K_Q3)
SIMD_TILE(tile_q4_k, K_Q4)
SIMD_TILE(tile_q5_k, K_Q5)
SIMD_TILE(tile_q6_k, K_Q6)
#endif

const ntx_kernel ntx_kernel_q2_k = {256, Q2_K_BYTES, NTX_ACT_Q8_256, tile_q2_k, deq_q2_k, 1, 8};
const ntx_kernel ntx_kernel_q3_k = {256, Q3_K_BYTES, NTX_ACT_Q8_256, tile_q3_k, deq_q3_k, 1, 8};
const ntx_kernel ntx_kernel_q4_k = {256, Q4_K_BYTES, NTX_ACT_Q8_256, tile_q4_k, deq_q4_k, 1, 8};
const ntx_kernel ntx_kernel_q5_k = {256, Q5_K_BYTES, NTX_ACT_Q8_256, tile_q5_k, deq_q5_k, 1, 8};
const ntx_kernel ntx_kernel_q6_k = {256, Q6_K_BYTES, NTX_ACT_Q8_256, tile_q6_k, deq_q6_k, 1, 8};
