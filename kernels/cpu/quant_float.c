/* The float weight types F32, F16, BF16 against float32 activation rows (no quantization). */
#include "quant.h"

static void deq_f32(const uint8_t *w, int n, float *y) { memcpy(y, w, (size_t)n * 4); }

static void deq_f16(const uint8_t *w, int n, float *y) {
    for (int i = 0; i < n; i++) y[i] = ntx_half_bits_to_f32(ntx_u16(w + 2 * i));
}

static void deq_bf16(const uint8_t *w, int n, float *y) {
    for (int i = 0; i < n; i++) y[i] = ntx_bf16(w + 2 * i);
}

enum flt { F_F32, F_F16, F_BF16 };

/* Branch-free half → float, so loops over it vectorize: the 15 magnitude bits placed under a
 * float exponent and scaled by 2^112 give every finite half exactly (subnormals included, in the
 * default floating-point environment); an all-ones exponent becomes inf/NaN with its payload. */
NTX_INLINE float half_to_f32_branchless(uint16_t h) {
    uint32_t mag = (uint32_t)(h & 0x7fffu) << 13, bits;
    float f;
    memcpy(&f, &mag, 4);
    f *= 0x1p112f;
    memcpy(&bits, &f, 4);
    bits = (h & 0x7c00u) == 0x7c00u ? mag | 0x7f800000u : bits;
    bits |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &bits, 4);
    return f;
}

NTX_INLINE float scalar_w(const int t, const uint8_t *w, int i) {
    float v;
    if (t == F_F32) memcpy(&v, w + 4 * i, 4);
#if defined(__F16C__)
    return t == F_F32 ? v : t == F_F16 ? ntx_f16(w + 2 * i) : ntx_bf16(w + 2 * i);
#else
    return t == F_F32 ? v : t == F_F16 ? half_to_f32_branchless(ntx_u16(w + 2 * i)) : ntx_bf16(w + 2 * i);
#endif
}

/* An explicit fma where the hardware has one: every tile shape then rounds alike. */
#if defined(__FMA__)
#define FMA(a, b, c) __builtin_fmaf(a, b, c)
#else
#define FMA(a, b, c) ((a) * (b) + (c))
#endif

#if defined(__AVX2__)
/* Eight weights from element i on, as float32. */
NTX_INLINE __m256 vec_w(const int t, const uint8_t *w, int i) {
    if (t == F_F32) return _mm256_loadu_ps((const float *)(const void *)(w + 4 * i));
    __m128i h = _mm_loadu_si128((const __m128i *)(w + 2 * i));
    if (t == F_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

NTX_INLINE void float_tile(const int t, const int NW, const int NA, const uint8_t *w, size_t wrb,
                           const uint8_t *a, size_t arb, int n, int pf, float *out) {
    const float *x[NTX_TA];
    NTX_UNROLL
    for (int ia = 0; ia < NA; ia++) x[ia] = (const float *)(const void *)(a + ia * arb);
    float s[NTX_TW][NTX_TA];
    NTX_UNROLL
    for (int iw = 0; iw < NW; iw++)
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) s[iw][ia] = 0.0f;
    int i = 0;
    (void)pf;
#if defined(__AVX2__)
    __m256 acc[NTX_TW][NTX_TA];
    NTX_UNROLL
    for (int iw = 0; iw < NW; iw++)
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) acc[iw][ia] = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        if (pf) ntx_prefetch_next_tile(w, wrb, NW, (size_t)i / 8, t == F_F32 ? 32 : 16);
        __m256 xv[NTX_TA];
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) xv[ia] = _mm256_loadu_ps(x[ia] + i);
        NTX_UNROLL
        for (int iw = 0; iw < NW; iw++) {
            __m256 wv = vec_w(t, w + iw * wrb, i);
            NTX_UNROLL
            for (int ia = 0; ia < NA; ia++) acc[iw][ia] = _mm256_fmadd_ps(wv, xv[ia], acc[iw][ia]);
        }
    }
    NTX_UNROLL
    for (int iw = 0; iw < NW; iw++)
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) s[iw][ia] = ntx_hsum(acc[iw][ia]);
#endif
    for (; i < n; i++)
        NTX_UNROLL
        for (int iw = 0; iw < NW; iw++) {
            float wv = scalar_w(t, w + iw * wrb, i);
            NTX_UNROLL
            for (int ia = 0; ia < NA; ia++) s[iw][ia] = FMA(wv, x[ia][i], s[iw][ia]);
        }
    NTX_UNROLL
    for (int iw = 0; iw < NW; iw++)
        NTX_UNROLL
        for (int ia = 0; ia < NA; ia++) out[iw * NTX_TA + ia] = s[iw][ia];
}

#define F_TILE(name, T)                                                                            \
    static void name(const uint8_t *w, size_t wrb, int nw, const uint8_t *a, size_t arb, int na,  \
                     int n, int pf, float *out) {                                                  \
        NTX_TILE_SWITCH(T##_SHAPE, nw, na)                                                         \
    }
#define F_F32_SHAPE(NW, NA) float_tile(F_F32, NW, NA, w, wrb, a, arb, n, pf, out)
#define F_F16_SHAPE(NW, NA) float_tile(F_F16, NW, NA, w, wrb, a, arb, n, pf, out)
#define F_BF16_SHAPE(NW, NA) float_tile(F_BF16, NW, NA, w, wrb, a, arb, n, pf, out)
F_TILE(tile_f32, F_F32)
F_TILE(tile_f16, F_F16)
F_TILE(tile_bf16, F_BF16)

const ntx_kernel ntx_kernel_f32 = {1, 4, NTX_ACT_F32, tile_f32, deq_f32, 2, 4};
const ntx_kernel ntx_kernel_f16 = {1, 2, NTX_ACT_F32, tile_f16, deq_f16, 2, 4};
const ntx_kernel ntx_kernel_bf16 = {1, 2, NTX_ACT_F32, tile_bf16, deq_bf16, 2, 4};
