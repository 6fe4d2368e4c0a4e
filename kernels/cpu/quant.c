/* Quantized matmul on GGUF blocks: ntx_cpu.h's activation formats, ntx_gemm's walk over tiles,
 * row dequantization. The per-type kernels live in quant_legacy.c (Q4_0 … Q8_0), quant_k.c
 * (Q2_K … Q6_K) and quant_float.c (F32, F16, BF16); quant.h says what each one answers.
 *
 * Errors: a type this file does not know, or an n that is not a whole number of blocks, makes
 * ntx_act_row_bytes return 0 (the caller's check), ntx_gemm write NaN to its outputs and
 * ntx_dequantize_rows write NaN rows, so a wrong call can never pass for a right one.
 */
#include <math.h>

#include "quant.h"

static const ntx_kernel *kernel_for(int wtype) {
    switch (wtype) {
    case NTX_F32: return &ntx_kernel_f32;
    case NTX_F16: return &ntx_kernel_f16;
    case NTX_BF16: return &ntx_kernel_bf16;
    case NTX_Q4_0: return &ntx_kernel_q4_0;
    case NTX_Q4_1: return &ntx_kernel_q4_1;
    case NTX_Q5_0: return &ntx_kernel_q5_0;
    case NTX_Q5_1: return &ntx_kernel_q5_1;
    case NTX_Q8_0: return &ntx_kernel_q8_0;
    case NTX_Q2_K: return &ntx_kernel_q2_k;
    case NTX_Q3_K: return &ntx_kernel_q3_k;
    case NTX_Q4_K: return &ntx_kernel_q4_k;
    case NTX_Q5_K: return &ntx_kernel_q5_k;
    case NTX_Q6_K: return &ntx_kernel_q6_k;
    case NTX_Q4_0 | NTX_ACT16: return &ntx_kernel_q4_0_a16;
    case NTX_Q4_1 | NTX_ACT16: return &ntx_kernel_q4_1_a16;
    case NTX_Q5_0 | NTX_ACT16: return &ntx_kernel_q5_0_a16;
    case NTX_Q5_1 | NTX_ACT16: return &ntx_kernel_q5_1_a16;
    case NTX_Q8_0 | NTX_ACT16: return &ntx_kernel_q8_0_a16;
    default: return NULL;
    }
}

size_t ntx_act_row_bytes(int wtype, int n) {
    const ntx_kernel *k = kernel_for(wtype);
    if (!k || n <= 0 || n % k->block_elems) return 0;
    switch (k->act) {
    case NTX_ACT_Q8_32: return (size_t)(n / 32) * sizeof(ntx_q8_32);
    case NTX_ACT_Q8_256: return (size_t)(n / 256) * sizeof(ntx_q8_256);
    case NTX_ACT_F32: return (size_t)n * sizeof(float);
    case NTX_ACT_Q16_32: return (size_t)(n / 32) * sizeof(ntx_q16_32);
    }
    return 0;
}

const char *ntx_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return "avx2";
#else
    return "generic";
#endif
}

/* ---- activation quantization ------------------------------------------------------------ */

/* q = round-half-even(x * 127 / amax), d = amax / 127: |x - d q| ≤ d/2 up to float rounding
 * of the scale (relative 2^-22 of d). The AVX2 path rounds the same product the same way, so
 * every build quantizes bit-identically. */
static float block_amax(const float *x, int len) {
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < len; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
#else
    float m[8] = {0}; /* eight lanes the compiler can keep in vector registers */
    for (int i = 0; i < len; i += 8)
        for (int k = 0; k < 8; k++) {
            float v = fabsf(x[i + k]);
            m[k] = v > m[k] ? v : m[k];
        }
    float amax = 0.0f;
    for (int k = 0; k < 8; k++) amax = m[k] > amax ? m[k] : amax;
    return amax;
#endif
}

static void quantize_block(const float *x, int len, int8_t *q, float *d_out, int *sum_out) {
    float amax = block_amax(x, len);
    float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
#if defined(__AVX2__)
    const __m256 vid = _mm256_set1_ps(id);
    for (int i = 0; i < len; i += 32) {
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vid));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vid));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vid));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vid));
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        sum += _mm_cvtsi128_si32(s4);
        /* packs interleave 128-bit lanes; the permute puts the 32 bytes back in order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + i), p);
    }
#else
    for (int i = 0; i < len; i++) {
        int v = (int)nearbyintf(x[i] * id);
        q[i] = (int8_t)v;
        sum += v;
    }
#endif
    *d_out = amax / 127.0f;
    if (sum_out) *sum_out = sum;
}

static void quantize_row_q8_32(const float *x, int n, ntx_q8_32 *y) {
    for (int b = 0; b < n / 32; b++, x += 32, y++) {
        int sum;
        quantize_block(x, 32, y->q, &y->d, &sum);
        y->s = y->d * (float)sum;
    }
}

static void quantize_row_q8_256(const float *x, int n, ntx_q8_256 *y) {
    for (int b = 0; b < n / 256; b++, x += 256, y++) {
        quantize_block(x, 256, y->q, &y->d, NULL);
        for (int k = 0; k < 16; k++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += y->q[16 * k + i];
            y->bsums[k] = (int16_t)s;
        }
    }
}

/* The 16-bit blocks: q = round-half-even(x * 32767 / amax), d = amax / 32767, in plain C (one
 * row per output-matrix product: not worth a SIMD path; nearbyintf rounds as cvtps does, so
 * every build gives the same bytes). */
static void quantize_row_q16_32(const float *x, int n, ntx_q16_32 *y) {
    for (int b = 0; b < n / 32; b++, x += 32, y++) {
        float amax = block_amax(x, 32);
        float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int v = (int)nearbyintf(x[i] * id);
            v = v > 32767 ? 32767 : v < -32767 ? -32767 : v; /* x * id may round a hair past amax */
            y->q[i] = (int16_t)v;
            sum += v;
        }
        y->d = amax / 32767.0f;
        y->s = y->d * (float)sum;
    }
}

void ntx_quantize_act(int wtype, const float *x, int nr, int n, int ldx, void *act) {
    const ntx_kernel *k = kernel_for(wtype);
    size_t arb = ntx_act_row_bytes(wtype, n);
    if (!arb) return;
    for (int r = 0; r < nr; r++) {
        const float *xr = x + (size_t)r * ldx;
        uint8_t *ar = (uint8_t *)act + (size_t)r * arb;
        switch (k->act) {
        case NTX_ACT_Q8_32: quantize_row_q8_32(xr, n, (ntx_q8_32 *)ar); break;
        case NTX_ACT_Q8_256: quantize_row_q8_256(xr, n, (ntx_q8_256 *)ar); break;
        case NTX_ACT_F32: memcpy(ar, xr, arb); break;
        case NTX_ACT_Q16_32: quantize_row_q16_32(xr, n, (ntx_q16_32 *)ar); break;
        }
    }
}

/* ---- matmul ------------------------------------------------------------------------------ */

/* Activation rows are taken in groups that fit in L2 beside the weight rows, so a weight row is
 * read from memory once per group (by the group's first tile, which prefetches the next rows)
 * and reused from L1 by every other tile of the group. */
#define NTX_ACT_GROUP_BYTES (192 * 1024)

void ntx_gemm(int wtype, const void *W, size_t w_row_bytes, int n, int j0, int j1,
              const void *act, int nr, float *out, int ldo, const float *res) {
    const ntx_kernel *k = kernel_for(wtype);
    size_t arb = ntx_act_row_bytes(wtype, n);
    if (!arb) {
        for (int r = 0; r < nr; r++)
            for (int j = j0; j < j1; j++) out[(size_t)r * ldo + j] = NAN;
        return;
    }
    const uint8_t *w = (const uint8_t *)W, *a = (const uint8_t *)act;
    int nb = n / k->block_elems;
    int tw = nr == 1 ? 2 : k->prefill_w, ta = nr == 1 ? 1 : k->prefill_a;
    int group = (int)(NTX_ACT_GROUP_BYTES / arb) / ta * ta;
    if (group < ta) group = ta;
    for (int r0 = 0; r0 < nr; r0 += group) {
        int r1 = r0 + group < nr ? r0 + group : nr;
        for (int j = j0; j < j1; j += tw) {
            int nw = j1 - j < tw ? j1 - j : tw;
            for (int r = r0; r < r1; r += ta) {
                int na = r1 - r < ta ? r1 - r : ta;
                float t[NTX_TW * NTX_TA];
                k->tile(w + (size_t)j * w_row_bytes, w_row_bytes, nw, a + (size_t)r * arb, arb, na, nb,
                        r == r0, t);
                for (int ia = 0; ia < na; ia++) {
                    size_t o = (size_t)(r + ia) * ldo + j;
                    for (int iw = 0; iw < nw; iw++)
                        out[o + iw] = res ? t[iw * NTX_TA + ia] + res[o + iw] : t[iw * NTX_TA + ia];
                }
            }
        }
    }
}

void ntx_dequantize_rows(int wtype, const void *W, size_t w_row_bytes, int n,
                         const int64_t *ids, int nr, float *out) {
    const ntx_kernel *k = kernel_for(wtype);
    if (!ntx_act_row_bytes(wtype, n)) {
        for (size_t i = 0; i < (size_t)nr * (n > 0 ? n : 0); i++) out[i] = NAN;
        return;
    }
    for (int r = 0; r < nr; r++)
        k->deq((const uint8_t *)W + (size_t)ids[r] * w_row_bytes, n / k->block_elems, out + (size_t)r * n);
}
