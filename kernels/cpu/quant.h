/* Internal to the quant*.c kernels: one table entry per weight type, the fp16 helpers, the
 * SIMD helpers every family shares. Nothing here is exported from the shared library.
 *
 * A weight type answers two calls:
 *   tile(w, wrb, nw, a, arb, na, nb, pf, out): out[iw * NTX_TA + ia] = dot(weight row iw, act
 *       row ia) for iw < nw, ia < na (nw ≤ 2 with na ≤ 4, or nw = 1 with na ≤ 8); w: nw rows of
 *       wrb bytes, a: na rows of arb bytes, nb blocks per row; pf: the caller reads the nw rows
 *       after these next, from memory, so prefetch them. A tile unpacks each weight block once
 *       and uses it against every activation row of the tile (prefill is compute-bound; decode,
 *       na = 1, reads each weight byte once).
 *   deq(w, nb, out): one row of nb blocks → float32, bit-exact with gguf.quants.
 */
#ifndef NTX_QUANT_H
#define NTX_QUANT_H

#include <stdint.h>
#include <string.h>

#include "ntx_cpu.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define NTX_HIDDEN __attribute__((visibility("hidden")))
#define NTX_INLINE static inline __attribute__((always_inline))
#define NTX_UNROLL _Pragma("GCC unroll 8") /* tile loops: accumulators must stay in registers */
#define NTX_PORTABLE static __attribute__((unused)) /* the dots a SIMD build may not call */

/* Tile shapes: decode (one activation row) runs 2 weight rows × 1; prefill runs the kernel's
 * prefill shape, 2 × 4 or 1 × 8 (whichever measured faster for the family and instruction set:
 * 1 × 8 unpacks each weight block once for 8 rows but needs registers only AVX-512 has). */
#define NTX_TW 2
#define NTX_TA 8

enum ntx_act_kind { NTX_ACT_Q8_32, NTX_ACT_Q8_256, NTX_ACT_F32, NTX_ACT_Q16_32 };

typedef void (*ntx_tile_fn)(const uint8_t *w, size_t wrb, int nw, const uint8_t *a, size_t arb,
                            int na, int nb, int pf, float *out);
typedef void (*ntx_deq_fn)(const uint8_t *w, int nb, float *out);

typedef struct {
    int block_elems, block_bytes;
    enum ntx_act_kind act;
    ntx_tile_fn tile;
    ntx_deq_fn deq;
    int prefill_w, prefill_a; /* tile shape for more than one activation row */
} ntx_kernel;

NTX_HIDDEN extern const ntx_kernel ntx_kernel_f32, ntx_kernel_f16, ntx_kernel_bf16;
NTX_HIDDEN extern const ntx_kernel ntx_kernel_q4_0, ntx_kernel_q4_1, ntx_kernel_q5_0,
    ntx_kernel_q5_1, ntx_kernel_q8_0;
NTX_HIDDEN extern const ntx_kernel ntx_kernel_q4_0_a16, ntx_kernel_q4_1_a16, ntx_kernel_q5_0_a16,
    ntx_kernel_q5_1_a16, ntx_kernel_q8_0_a16; /* the same weights against ntx_q16_32 */
NTX_HIDDEN extern const ntx_kernel ntx_kernel_q2_k, ntx_kernel_q3_k, ntx_kernel_q4_k,
    ntx_kernel_q5_k, ntx_kernel_q6_k;

/* Expands F(NW, NA) for the (nw, na) the caller asked for, so each tile shape is its own
 * fully unrolled instance with its accumulators in registers. ntx_gemm asks for no other. */
#define NTX_TILE_SWITCH(F, nw, na)                                                                 \
    switch ((nw) * 16 + (na)) {                                                                    \
    case 16 + 1: F(1, 1); break;                                                                   \
    case 16 + 2: F(1, 2); break;                                                                   \
    case 16 + 3: F(1, 3); break;                                                                   \
    case 16 + 4: F(1, 4); break;                                                                   \
    case 16 + 5: F(1, 5); break;                                                                   \
    case 16 + 6: F(1, 6); break;                                                                   \
    case 16 + 7: F(1, 7); break;                                                                   \
    case 16 + 8: F(1, 8); break;                                                                   \
    case 32 + 1: F(2, 1); break;                                                                   \
    case 32 + 2: F(2, 2); break;                                                                   \
    case 32 + 3: F(2, 3); break;                                                                   \
    case 32 + 4: F(2, 4); break;                                                                   \
    default: break;                                                                                \
    }

NTX_INLINE uint16_t ntx_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

NTX_INLINE uint32_t ntx_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* IEEE half → float, exact for every value (subnormals, inf, NaN payloads kept). */
NTX_INLINE float ntx_half_bits_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        float v = (float)man * 0x1p-24f; /* zero or subnormal: exact in float */
        memcpy(&bits, &v, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

NTX_INLINE float ntx_f16(const uint8_t *p) {
#if defined(__F16C__)
    return _cvtsh_ss(ntx_u16(p));
#else
    return ntx_half_bits_to_f32(ntx_u16(p));
#endif
}

NTX_INLINE float ntx_bf16(const uint8_t *p) {
    uint32_t bits = (uint32_t)ntx_u16(p) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A product rounded to float before it is added: gguf.quants computes d * q + m in two numpy
 * steps, so dequantization must not let the compiler fuse them into one FMA. */
NTX_INLINE float ntx_rounded(float x) {
#if defined(__x86_64__)
    __asm__("" : "+x"(x));
    return x;
#else
    volatile float v = x;
    return v;
#endif
}

#if defined(__AVX2__)
/* u8 × s8 dot, 4 products summed into each int32 lane. The AVX2 form goes through int16 pair
 * sums (vpmaddubsw), exact only while |u0*s0 + u1*s1| ≤ 32767: every caller keeps u ≤ 128. */
NTX_INLINE __m256i ntx_dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* int16 × int16 pair sums added to int32 lanes. */
NTX_INLINE __m256i ntx_dpwssd(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

NTX_INLINE float ntx_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

NTX_INLINE __m256i ntx_load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* A tile that is the first to read its weight rows streams them from memory, NW interleaved
 * rows at a time, a pattern the hardware prefetchers follow poorly. While it works on its
 * block b, it fetches the matching share of the next tile's rows (contiguous after its own), so
 * the next tile finds its bytes in cache. */
NTX_INLINE void ntx_prefetch_next_tile(const uint8_t *w, size_t wrb, const int NW, size_t b, const int BB) {
    const uint8_t *p = w + NW * wrb + b * NW * BB;
    for (int o = 0; o < NW * BB; o += 64) _mm_prefetch((const char *)(p + o), _MM_HINT_T0);
}
#endif

#endif
