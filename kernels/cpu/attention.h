/* Attention over the paged KV cache (engine/kv_cache.py's layout), internal to the kernels.
 *
 * A row of the cache is one position of one KV head: head_dim values stored as F32, F16, or
 * GGUF's Q8_0 / Q4_0 blocks of 32 values (a float16 scale d, then int8 quants, or 4-bit quants
 * packed low nibbles first). Rows are stored as the step writes the cache (quantization
 * bit-exact with gguf.quants.quantize) and each is decoded into the kernel's registers as it is
 * read (bit-exact with gguf.quants.dequantize): there is no dequantized copy of the cache.
 *
 * Rows lie in blocks of kv_block positions: layer array (n_blocks, n_kv_heads, kv_block, row);
 * slot s's block table is kv_tables[s * kv_max_blocks …], its block ids in position order.
 */
#ifndef NTX_ATTENTION_H
#define NTX_ATTENTION_H

#include <stdint.h>
#include <string.h>

#include "ntx_cpu.h"
#include "ntx_step.h"

#define NTX_KV_QK 32 /* values per Q8_0 / Q4_0 block */
#define NTX_KV_Q8_0_BYTES 34
#define NTX_KV_Q4_0_BYTES 18
#define NTX_ATTN_ROWS 16 /* query rows of one sequence that share each key and value read */
#define NTX_ATTN_KEYS 16 /* keys per step of the online softmax */

static inline int64_t ntx_kv_row_bytes(int type, int hd) {
    switch (type) {
    case NTX_F32: return (int64_t)hd * 4;
    case NTX_F16: return (int64_t)hd * 2;
    case NTX_Q8_0: return hd % NTX_KV_QK ? -1 : (int64_t)hd / NTX_KV_QK * NTX_KV_Q8_0_BYTES;
    case NTX_Q4_0: return hd % NTX_KV_QK ? -1 : (int64_t)hd / NTX_KV_QK * NTX_KV_Q4_0_BYTES;
    default: return -1;
    }
}

/* The row of position pos of `slot`, KV head kh, in a layer's k or v. */
static inline uint8_t *ntx_kv_row(const ntx_model *md, const void *base, int64_t slot, int64_t pos, int kh) {
    int64_t blk = md->kv_tables[slot * md->kv_max_blocks + pos / md->kv_block];
    return (uint8_t *)base + ((blk * md->n_kv_heads + kh) * md->kv_block + pos % md->kv_block) * md->kv_row_bytes;
}

/* float32 → row, as gguf.quants.quantize rounds. */
void ntx_kv_store(int type, const float *x, int hd, uint8_t *row);

/* Rows of one step that attend together: consecutive rows of one sequence (one slot, consecutive
 * positions), at most NTX_ATTN_ROWS. starts (n_rows + 1 entries, may be NULL) receives each
 * group's first row and, last, n_rows; returns the number of groups. A row's result does not
 * depend on the group it is in. */
int64_t ntx_attn_groups(const ntx_header *h, int64_t *starts);

/* Floats of scratch one thread's ntx_attn_group needs. */
int64_t ntx_attn_scratch(const ntx_model *md);

/* Causal GQA attention of rows [r0, r1) (one group) for KV head kh: q (rows, H * hd) already
 * rotated, the cache holding every position they see; out (rows, H * hd). */
void ntx_attn_group(const ntx_model *md, const ntx_header *h, const float *q, float *out, const void *kv_k,
                    const void *kv_v, int64_t r0, int64_t r1, int kh, float *scratch);

/* The same, bit for bit, by the first kernel's loop order (attention.c): the reference the new
 * one is tested and timed against. */
void ntx_attn_group_ref(const ntx_model *md, const ntx_header *h, const float *q, float *out, const void *kv_k,
                        const void *kv_v, int64_t r0, int64_t r1, int kh, float *scratch);

/* Attention of every row of h over one layer's cache on n_threads threads, as a step's
 * NTX_OP_ATTN runs it (ref: by ntx_attn_group_ref): what tests, bench/host_attention.py and
 * the figures at load (engine/figures.py) call outside a step. 0, or -2 where the scratch
 * could not be allocated. */
int ntx_attention(const ntx_model *md, const ntx_header *h, const float *q, float *out, const void *kv_k,
                  const void *kv_v, int n_threads, int ref);

#endif
