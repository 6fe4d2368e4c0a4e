/* The block-32 types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 against ntx_q8_32 activations (and, as
 * type | NTX_ACT16, against ntx_q16_32: the same sums with int16 activations).
 *
 * Every one is an unsigned-8 × signed-8 dot per block plus a correction by the activation sum:
 *   Q4_0: w = d (q - 8)    →  d d_a Σ q a  - 8 d d_a Σ a        (q in 0..15)
 *   Q5_0: w = d (q - 16)   →  d d_a Σ q a  - 16 d d_a Σ a       (q in 0..31)
 *   Q4_1, Q5_1: w = d q + m →  d d_a Σ q a  + m s_a              (s_a = d_a Σ a)
 *   Q8_0: w = d q          →  VNNI: q + 128 unsigned, minus 128 Σ a; AVX2: |q| × sign(a, q)
 * The integer corrections are made in the int32 lanes before the block is scaled, so a block's
 * sum is exact until the one float multiply by d d_a.
 */
#include "quant.h"

/* ---- block layouts (ggml-common.h) -------------------------------------------------------- */

#define Q4_0_BYTES 18 /* d, qs[16] */
#define Q4_1_BYTES 20 /* d, m, qs[16] */
#define Q5_0_BYTES 22 /* d, qh[4], qs[16] */
#define Q5_1_BYTES 24 /* d, m, qh[4], qs[16] */
#define Q8_0_BYTES 34 /* d, qs[32] (int8) */

/* Element i of a nibble block: low nibble of qs[i] for i < 16, high nibble of qs[i - 16]. */
NTX_INLINE int nib(const uint8_t *qs, int i) { return i < 16 ? qs[i] & 15 : qs[i - 16] >> 4; }

/* Five-bit element: the nibble and bit i of qh. */
NTX_INLINE int q5(const uint8_t *qh, const uint8_t *qs, int i) {
    return nib(qs, i) | (int)((ntx_u32(qh) >> i) & 1) << 4;
}

/* ---- dequantization: gguf.quants' float32 operations in its order ---------------------- */

static void deq_q4_0(const uint8_t *w, int nb, float *y) {
    for (int b = 0; b < nb; b++, w += Q4_0_BYTES, y += 32) {
        float d = ntx_f16(w);
        for (int i = 0; i < 32; i++) y[i] = d * (float)(nib(w + 2, i) - 8);
    }
}

static void deq_q4_1(const uint8_t *w, int nb, float *y) {
    for (int b = 0; b < nb; b++, w += Q4_1_BYTES, y += 32) {
        float d = ntx_f16(w), m = ntx_f16(w + 2);
        for (int i = 0; i < 32; i++) y[i] = ntx_rounded(d * (float)nib(w + 4, i)) + m;
    }
}

static void deq_q5_0(const uint8_t *w, int nb, float *y) {
    for (int b = 0; b < nb; b++, w += Q5_0_BYTES, y += 32) {
        float d = ntx_f16(w);
        for (int i = 0; i < 32; i++) y[i] = d * (float)(q5(w + 2, w + 6, i) - 16);
    }
}

static void deq_q5_1(const uint8_t *w, int nb, float *y) {
    for (int b = 0; b < nb; b++, w += Q5_1_BYTES, y += 32) {
        float d = ntx_f16(w), m = ntx_f16(w + 2);
        for (int i = 0; i < 32; i++) y[i] = ntx_rounded(d * (float)q5(w + 4, w + 8, i)) + m;
    }
}

static void deq_q8_0(const uint8_t *w, int nb, float *y) {
    for (int b = 0; b < nb; b++, w += Q8_0_BYTES, y += 32) {
        float d = ntx_f16(w);
        for (int i = 0; i < 32; i++) y[i] = (float)(int8_t)w[2 + i] * d;
    }
}

enum legacy { L_Q4_0, L_Q4_1, L_Q5_0, L_Q5_1, L_Q8_0 };

NTX_INLINE int block_bytes(const int t) {
    return t == L_Q4_0 ? Q4_0_BYTES : t == L_Q4_1 ? Q4_1_BYTES : t == L_Q5_0 ? Q5_0_BYTES
         : t == L_Q5_1 ? Q5_1_BYTES : Q8_0_BYTES;
}

/* ---- portable dots ------------------------------------------------------------------------
 * Written as fixed-length loops over bytes so the compiler vectorizes them for any target. */

/* The 32 nibble codes of a block as bytes, in element order. */
NTX_INLINE void codes4(const uint8_t *qs, uint8_t u[32]) {
    for (int i = 0; i < 16; i++) u[i] = qs[i] & 15, u[i + 16] = qs[i] >> 4;
}

/* Five-bit codes: each bit of qh spread to 0x10 in its byte (a multiply copies the byte into
 * every lane, a mask keeps lane l's bit l, an add carries it to bit 7). */
NTX_INLINE void codes5(const uint8_t *qh, const uint8_t *qs, uint8_t u[32]) {
    uint8_t h[32];
    for (int k = 0; k < 4; k++) {
        uint64_t x = (qh[k] * 0x0101010101010101ull) & 0x8040201008040201ull;
        x = ((x + 0x7f7f7f7f7f7f7f7full) >> 3) & 0x1010101010101010ull;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        memcpy(h + 8 * k, &x, 8);
#else
        for (int l = 0; l < 8; l++) h[8 * k + l] = (uint8_t)(x >> (8 * l));
#endif
    }
    for (int i = 0; i < 16; i++) u[i] = (qs[i] & 15) | h[i], u[i + 16] = (qs[i] >> 4) | h[i + 16];
}

NTX_INLINE int dot32(const uint8_t u[32], int off, const int8_t *a) {
    int s = 0;
    for (int i = 0; i < 32; i++) s += (u[i] - off) * a[i];
    return s;
}

NTX_PORTABLE float dot_q4_0(const uint8_t *w, const ntx_q8_32 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q4_0_BYTES, a++) {
        uint8_t u[32];
        codes4(w + 2, u);
        acc += ntx_f16(w) * a->d * (float)dot32(u, 8, a->q);
    }
    return acc;
}

NTX_PORTABLE float dot_q4_1(const uint8_t *w, const ntx_q8_32 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q4_1_BYTES, a++) {
        uint8_t u[32];
        codes4(w + 4, u);
        acc += ntx_f16(w) * a->d * (float)dot32(u, 0, a->q) + ntx_f16(w + 2) * a->s;
    }
    return acc;
}

NTX_PORTABLE float dot_q5_0(const uint8_t *w, const ntx_q8_32 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q5_0_BYTES, a++) {
        uint8_t u[32];
        codes5(w + 2, w + 6, u);
        acc += ntx_f16(w) * a->d * (float)dot32(u, 16, a->q);
    }
    return acc;
}

NTX_PORTABLE float dot_q5_1(const uint8_t *w, const ntx_q8_32 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q5_1_BYTES, a++) {
        uint8_t u[32];
        codes5(w + 4, w + 8, u);
        acc += ntx_f16(w) * a->d * (float)dot32(u, 0, a->q) + ntx_f16(w + 2) * a->s;
    }
    return acc;
}

NTX_PORTABLE float dot_q8_0(const uint8_t *w, const ntx_q8_32 *a, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += Q8_0_BYTES, a++) {
        int s = 0;
        for (int i = 0; i < 32; i++) s += (int8_t)w[2 + i] * a->q[i];
        acc += ntx_f16(w) * a->d * (float)s;
    }
    return acc;
}

#define PORTABLE_TILE(name, dot)                                                                   \
    static void name(const uint8_t *w, size_t wrb, int nw, const uint8_t *a, size_t arb, int na,  \
                     int nb, int pf, float *out) {                                                 \
        (void)pf;                                                                                  \
        for (int iw = 0; iw < nw; iw++)                                                            \
            for (int ia = 0; ia < na; ia++)                                                        \
                out[iw * NTX_TA + ia] = dot(w + iw * wrb, (const ntx_q8_32 *)(a + ia * arb), nb);   \
    }

/* Against 16-bit activations: each block's weights as signed integers with the type's integer
 * offset taken out (Q4_1 and Q5_1 keep theirs, m, apart: it multiplies s). */
NTX_INLINE void codes16(const int t, const uint8_t *wb, int v[32]) {
    uint8_t u[32];
    switch (t) {
    case L_Q4_0: codes4(wb + 2, u); for (int i = 0; i < 32; i++) v[i] = u[i] - 8; break;
    case L_Q4_1: codes4(wb + 4, u); for (int i = 0; i < 32; i++) v[i] = u[i]; break;
    case L_Q5_0: codes5(wb + 2, wb + 6, u); for (int i = 0; i < 32; i++) v[i] = u[i] - 16; break;
    case L_Q5_1: codes5(wb + 4, wb + 8, u); for (int i = 0; i < 32; i++) v[i] = u[i]; break;
    default: for (int i = 0; i < 32; i++) v[i] = (int8_t)wb[2 + i];
    }
}

NTX_PORTABLE float dot16(const int t, const uint8_t *w, const ntx_q16_32 *a, int nb) {
    const int BB = block_bytes(t), HAS_M = t == L_Q4_1 || t == L_Q5_1;
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += BB, a++) {
        int v[32], s = 0;
        codes16(t, w, v);
        for (int i = 0; i < 32; i++) s += v[i] * a->q[i];
        acc += ntx_f16(w) * a->d * (float)s + (HAS_M ? ntx_f16(w + 2) * a->s : 0.0f);
    }
    return acc;
}

#define PORTABLE_TILE16(name, T)                                                                   \
    static void name(const uint8_t *w, size_t wrb, int nw, const uint8_t *a, size_t arb, int na,  \
                     int nb, int pf, float *out) {                                                 \
        (void)pf;                                                                                  \
        for (int iw = 0; iw < nw; iw++)                                                            \
            for (int ia = 0; ia < na; ia++)                                                        \
                out[iw * NTX_TA + ia] = dot16(T, w + iw * wrb, (const ntx_q16_32 *)(a + ia * arb), nb); \
    }

#if !defined(__AVX2__)
PORTABLE_TILE16(tile16_q4_0, L_Q4_0)
PORTABLE_TILE16(tile16_q4_1, L_Q4_1)
PORTABLE_TILE16(tile16_q5_0, L_Q5_0)
PORTABLE_TILE16(tile16_q5_1, L_Q5_1)
PORTABLE_TILE16(tile16_q8_0, L_Q8_0)
PORTABLE_TILE(tile_q4_0, dot_q4_0)
PORTABLE_TILE(tile_q4_1, dot_q4_1)
PORTABLE_TILE(tile_q5_0, dot_q5_0)
PORTABLE_TILE(tile_q5_1, dot_q5_1)
PORTABLE_TILE(tile_q8_0, dot_q8_0)
#else

/* ---- AVX2 / AVX-512 VNNI ------------------------------------------------------------------ */

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_0_OFFSET 1 /* q + 128 as unsigned, minus 128 Σ a */
#else
#define Q8_0_OFFSET 0 /* |q| × sign(a, q): vpmaddubsw's pair sums stay below 2^15 */
#endif

/* The integer offset subtracted from the unsigned weights (0: none, or a float m term). */
NTX_INLINE int offset(const int t) {
    return t == L_Q4_0 ? 8 : t == L_Q5_0 ? 16 : t == L_Q8_0 && Q8_0_OFFSET ? 128 : 0;
}

/* The 16 bytes in both lanes, the high lane shifted down a nibble: two ALU operations. */
NTX_INLINE __m256i nibbles(const uint8_t *qs) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    v = _mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0));
    return _mm256_and_si256(v, _mm256_set1_epi8(15));
}

/* Byte i = 0x10 where bit i of the 32-bit word is set. */
NTX_INLINE __m256i high_bits(uint32_t x) {
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x),
                                    _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                      0x0101010101010101, 0));
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    v = _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* The block's 32 weights as unsigned bytes, in element order. */
NTX_INLINE __m256i unpack(const int t, const uint8_t *wb) {
    switch (t) {
    case L_Q4_0: return nibbles(wb + 2);
    case L_Q4_1: return nibbles(wb + 4);
    case L_Q5_0: return _mm256_or_si256(nibbles(wb + 6), high_bits(ntx_u32(wb + 2)));
    case L_Q5_1: return _mm256_or_si256(nibbles(wb + 8), high_bits(ntx_u32(wb + 4)));
    default:
        return Q8_0_OFFSET ? _mm256_xor_si256(ntx_load256(wb + 2), _mm256_set1_epi8((char)0x80))
                           : _mm256_abs_epi8(ntx_load256(wb + 2));
    }
}

NTX_INLINE void legacy_tile(const int t, const int NW, const int NA, const uint8_t *w, size_t wrb,
                            const uint8_t *a, size_t arb, int nb, int pf, float *out) {
    const int BB = block_bytes(t), OFF = offset(t), HAS_M = t == L_Q4_1 || t == L_Q5_1;
    __m256 acc[NTX_TW][NTX_TA];
    float macc[NTX_TW][NTX_TA];
    NTX_UNROLL
    for (int iw = 0; iw < NW; iw++)
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) acc[iw][ia] = _mm256_setzero_ps(), macc[iw][ia] = 0.0f;
    for (int b = 0; b < nb; b++) {
        if (pf) ntx_prefetch_next_tile(w, wrb, NW, b, BB);
        const ntx_q8_32 *ab[NTX_TA];
        __m256i q[NTX_TA], base[NTX_TA];
        __m256 da[NTX_TA];
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) {
            ab[ia] = (const ntx_q8_32 *)(a + ia * arb) + b;
            q[ia] = ntx_load256(ab[ia]->q);
            da[ia] = _mm256_broadcast_ss(&ab[ia]->d);
            /* lanes start at -OFF × (their 4 activations), so the dot lands on Σ (q - OFF) a */
            base[ia] = OFF ? _mm256_sub_epi32(_mm256_setzero_si256(),
                                              ntx_dpbusd(_mm256_setzero_si256(),
                                                         _mm256_set1_epi8((char)OFF), q[ia]))
                           : _mm256_setzero_si256();
        }
        NTX_UNROLL
        for (int iw = 0; iw < NW; iw++) {
            const uint8_t *wb = w + iw * wrb + (size_t)b * BB;
            __m256i u = unpack(t, wb);
            __m256 dw;
            float m = 0.0f;
            if (HAS_M) { /* d and m are adjacent halves: one conversion */
                __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)ntx_u32(wb)));
                dw = _mm256_broadcastss_ps(dm);
                m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
            } else {
                dw = _mm256_set1_ps(ntx_f16(wb));
            }
            NTX_UNROLL
            for (int ia = 0; ia < NA; ia++) {
                __m256i s8 = t == L_Q8_0 && !Q8_0_OFFSET ? _mm256_sign_epi8(q[ia], ntx_load256(wb + 2)) : q[ia];
                __m256i sum = ntx_dpbusd(base[ia], u, s8);
                acc[iw][ia] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, da[ia]), acc[iw][ia]);
                /* an explicit fma: every tile shape rounds the same way, so an output's bits do
                 * not depend on how the caller splits rows among threads */
                if (HAS_M) macc[iw][ia] = __builtin_fmaf(m, ab[ia]->s, macc[iw][ia]);
            }
        }
    }
    NTX_UNROLL
    for (int iw = 0; iw < NW; iw++)
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) out[iw * NTX_TA + ia] = ntx_hsum(acc[iw][ia]) + macc[iw][ia];
}

/* The block's 32 weights as int16 (two registers of 16, in element order), the type's integer
 * offset taken out as in codes16. */
NTX_INLINE void unpack16(const int t, const uint8_t *wb, __m256i *lo, __m256i *hi) {
    if (t == L_Q8_0) {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 2)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 18)));
        return;
    }
    __m256i u = unpack(t, wb);
    *lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
    *hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1));
    const int off = t == L_Q4_0 ? 8 : t == L_Q5_0 ? 16 : 0;
    if (off) {
        *lo = _mm256_sub_epi16(*lo, _mm256_set1_epi16((short)off));
        *hi = _mm256_sub_epi16(*hi, _mm256_set1_epi16((short)off));
    }
}

/* legacy_tile against ntx_q16_32: int16 pair products summed exactly in int32 lanes
 * (|w| ≤ 128, |q| ≤ 32767: a block's sum stays below 2^28). */
NTX_INLINE void legacy_tile16(const int t, const int NW, const int NA, const uint8_t *w, size_t wrb,
                              const uint8_t *a, size_t arb, int nb, int pf, float *out) {
    const int BB = block_bytes(t), HAS_M = t == L_Q4_1 || t == L_Q5_1;
    __m256 acc[NTX_TW][NTX_TA];
    float macc[NTX_TW][NTX_TA];
    NTX_UNROLL
    for (int iw = 0; iw < NW; iw++)
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) acc[iw][ia] = _mm256_setzero_ps(), macc[iw][ia] = 0.0f;
    for (int b = 0; b < nb; b++) {
        if (pf) ntx_prefetch_next_tile(w, wrb, NW, b, BB);
        const ntx_q16_32 *ab[NTX_TA];
        __m256i qlo[NTX_TA], qhi[NTX_TA];
        __m256 da[NTX_TA];
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) {
            ab[ia] = (const ntx_q16_32 *)(a + ia * arb) + b;
            qlo[ia] = ntx_load256(ab[ia]->q);
            qhi[ia] = ntx_load256(ab[ia]->q + 16);
            da[ia] = _mm256_broadcast_ss(&ab[ia]->d);
        }
        NTX_UNROLL
        for (int iw = 0; iw < NW; iw++) {
            const uint8_t *wb = w + iw * wrb + (size_t)b * BB;
            __m256i lo, hi;
            unpack16(t, wb, &lo, &hi);
            __m256 dw = _mm256_set1_ps(ntx_f16(wb));
            float m = HAS_M ? ntx_f16(wb + 2) : 0.0f;
            NTX_UNROLL
            for (int ia = 0; ia < NA; ia++) {
                __m256i sum = ntx_dpwssd(ntx_dpwssd(_mm256_setzero_si256(), lo, qlo[ia]), hi, qhi[ia]);
                acc[iw][ia] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, da[ia]), acc[iw][ia]);
                if (HAS_M) macc[iw][ia] = __builtin_fmaf(m, ab[ia]->s, macc[iw][ia]);
            }
        }
    }
    NTX_UNROLL
    for (int iw = 0; iw < NW; iw++)
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) out[iw * NTX_TA + ia] = ntx_hsum(acc[iw][ia]) + macc[iw][ia];
}

#define SIMD_TILE(name, T)                                                                         \
    static void name(const uint8_t *w, size_t wrb, int nw, const uint8_t *a, size_t arb, int na,  \
                     int nb, int pf, float *out) {                                                 \
        _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
        NTX_TILE_SWITCH(T##_SHAPE, nw, na)                                                         \
        _Pragma("GCC diagnostic pop")                                                              \
    }
#define L_Q4_0_SHAPE(NW, NA) legacy_tile(L_Q4_0, NW, NA, w, wrb, a, arb, nb, pf, out)
#define L_Q4_1_SHAPE(NW, NA) legacy_tile(L_Q4_1, NW, NA, w, wrb, a, arb, nb, pf, out)
#define L_Q5_0_SHAPE(NW, NA) legacy_tile(L_Q5_0, NW, NA, w, wrb, a, arb, nb, pf, out)
#define L_Q5_1_SHAPE(NW, NA) legacy_tile(L_Q5_1, NW, NA, w, wrb, a, arb, nb, pf, out)
#define L_Q8_0_SHAPE(NW, NA) legacy_tile(L_Q8_0, NW, NA, w, wrb, a, arb, nb, pf, out)
SIMD_TILE(tile_q4_0, L_Q4_0)
SIMD_TILE(tile_q4_1, L_Q4_1)
SIMD_TILE(tile_q5_0, L_Q5_0)
SIMD_TILE(tile_q5_1, L_Q5_1)
SIMD_TILE(tile_q8_0, L_Q8_0)
#define L16_Q4_0_SHAPE(NW, NA) legacy_tile16(L_Q4_0, NW, NA, w, wrb, a, arb, nb, pf, out)
#define L16_Q4_1_SHAPE(NW, NA) legacy_tile16(L_Q4_1, NW, NA, w, wrb, a, arb, nb, pf, out)
#define L16_Q5_0_SHAPE(NW, NA) legacy_tile16(L_Q5_0, NW, NA, w, wrb, a, arb, nb, pf, out)
#define L16_Q5_1_SHAPE(NW, NA) legacy_tile16(L_Q5_1, NW, NA, w, wrb, a, arb, nb, pf, out)
#define L16_Q8_0_SHAPE(NW, NA) legacy_tile16(L_Q8_0, NW, NA, w, wrb, a, arb, nb, pf, out)
SIMD_TILE(tile16_q4_0, L16_Q4_0)
SIMD_TILE(tile16_q4_1, L16_Q4_1)
SIMD_TILE(tile16_q5_0, L16_Q5_0)
SIMD_TILE(tile16_q5_1, L16_Q5_1)
SIMD_TILE(tile16_q8_0, L16_Q8_0)
#endif

#if defined(__AVX512F__)
#define PREFILL 1, 8
#else
#define PREFILL 2, 4
#endif
const ntx_kernel ntx_kernel_q4_0 = {32, Q4_0_BYTES, NTX_ACT_Q8_32, tile_q4_0, deq_q4_0, PREFILL};
const ntx_kernel ntx_kernel_q4_1 = {32, Q4_1_BYTES, NTX_ACT_Q8_32, tile_q4_1, deq_q4_1, PREFILL};
const ntx_kernel ntx_kernel_q5_0 = {32, Q5_0_BYTES, NTX_ACT_Q8_32, tile_q5_0, deq_q5_0, PREFILL};
const ntx_kernel ntx_kernel_q5_1 = {32, Q5_1_BYTES, NTX_ACT_Q8_32, tile_q5_1, deq_q5_1, PREFILL};
const ntx_kernel ntx_kernel_q8_0 = {32, Q8_0_BYTES, NTX_ACT_Q8_32, tile_q8_0, deq_q8_0, PREFILL};
const ntx_kernel ntx_kernel_q4_0_a16 = {32, Q4_0_BYTES, NTX_ACT_Q16_32, tile16_q4_0, deq_q4_0, PREFILL};
const ntx_kernel ntx_kernel_q4_1_a16 = {32, Q4_1_BYTES, NTX_ACT_Q16_32, tile16_q4_1, deq_q4_1, PREFILL};
const ntx_kernel ntx_kernel_q5_0_a16 = {32, Q5_0_BYTES, NTX_ACT_Q16_32, tile16_q5_0, deq_q5_0, PREFILL};
const ntx_kernel ntx_kernel_q5_1_a16 = {32, Q5_1_BYTES, NTX_ACT_Q16_32, tile16_q5_1, deq_q5_1, PREFILL};
const ntx_kernel ntx_kernel_q8_0_a16 = {32, Q8_0_BYTES, NTX_ACT_Q16_32, tile16_q8_0, deq_q8_0, PREFILL};
