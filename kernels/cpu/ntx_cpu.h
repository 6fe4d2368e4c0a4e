/* The CPU backend's C interface: quantized matmul on GGUF blocks, the other ops of a step,
 * and the recorded-step interpreter that runs model.forward's op list in one call.
 *
 * One source tree, compiled once per instruction set (generic, x86-64-v3 = AVX2/FMA/F16C,
 * x86-64-v4 + VNNI): the loader picks the variant the CPU supports at run time. Every function
 * here is reentrant; the ones that take a [j0, j1) range are called by several threads at once
 * on disjoint ranges and write only their own outputs.
 */
#ifndef NTX_CPU_H
#define NTX_CPU_H

#include <stddef.h>
#include <stdint.h>

/* GGML type ids (gguf.GGMLQuantizationType). */
enum ntx_type {
    NTX_F32 = 0, NTX_F16 = 1, NTX_Q4_0 = 2, NTX_Q4_1 = 3, NTX_Q5_0 = 6, NTX_Q5_1 = 7,
    NTX_Q8_0 = 8, NTX_Q2_K = 10, NTX_Q3_K = 11, NTX_Q4_K = 12, NTX_Q5_K = 13, NTX_Q6_K = 14,
    NTX_BF16 = 30,
};

/* Activations are quantized once per op, per row, in the format the weight type's dot wants:
 *   block-32 types (Q4_0 … Q8_0): ntx_q8_32 — int8 q, scale d = amax/127, s = d * sum(q)
 *   K types (Q2_K … Q6_K):        ntx_q8_256 — int8 q, scale d = amax/127, bsums = sums of 16
 *   F32, F16, BF16:               the float32 row itself
 *   a block-32 type | NTX_ACT16:  ntx_q16_32 — int16 q, scale d = amax/32767, s = d * sum(q)
 * NTX_ACT16 names the same weights against 16-bit activation blocks: 258 times finer steps, for
 * the product whose rounding reaches the logits most directly (the output matrix) at about twice
 * the integer work of the 8-bit dot.
 */
#define NTX_ACT16 0x100
typedef struct { float d; float s; int8_t q[32]; } ntx_q8_32;
typedef struct { float d; int16_t bsums[16]; int8_t q[256]; } ntx_q8_256;
typedef struct { float d; float s; int16_t q[32]; } ntx_q16_32;
_Static_assert(sizeof(ntx_q8_32) == 40, "ntx_q8_32 is 40 bytes");
_Static_assert(sizeof(ntx_q8_256) == 292, "ntx_q8_256 is 292 bytes");
_Static_assert(sizeof(ntx_q16_32) == 72, "ntx_q16_32 is 72 bytes");

/* Bytes of one activation row of n elements in the format weight type `wtype` wants (wtype: a
 * GGML type id, or a block-32 type's id | NTX_ACT16 everywhere below). */
size_t ntx_act_row_bytes(int wtype, int n);

/* Quantize float rows x (nr rows of n, row stride ldx floats) into act (nr rows of
 * ntx_act_row_bytes(wtype, n) each); for float weight types copies the rows. */
void ntx_quantize_act(int wtype, const float *x, int nr, int n, int ldx, void *act);

/* out[r * ldo + j] = dot(weight row j, activation row r) (+ res[r * ldo + j] where res is not
 * NULL; res may equal out) for j in [j0, j1), r in [0, nr). W is the GGUF tensor: rows of
 * w_row_bytes; n the row length in elements. */
void ntx_gemm(int wtype, const void *W, size_t w_row_bytes, int n, int j0, int j1,
              const void *act, int nr, float *out, int ldo, const float *res);

/* Dequantize rows ids[0..nr) of W into out (nr × n float32), bit-exact with gguf.quants. */
void ntx_dequantize_rows(int wtype, const void *W, size_t w_row_bytes, int n,
                         const int64_t *ids, int nr, float *out);

/* The instruction set this build was compiled for ("generic", "avx2", "avx512"). */
const char *ntx_isa(void);

#endif
