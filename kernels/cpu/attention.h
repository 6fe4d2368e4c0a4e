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
/* Positions per split: a sequence's keys are cut at multiples of this from position 0, so a
 * row's splits follow from its own position alone (not the thread count, the other rows of the
 * step or the configured context). A group whose keys fit in one split runs whole, as before
 * splits existed: the same bits. 1024 keeps every context up to 1024 on that path (the decode
 * goldens, the bit-exact kernel tests) and makes each split item long (1024 keys × a group's
 * query vectors) against what a split adds (its partial written and folded: nq × head_dim
 * floats), and against a step's claiming of work. A multiple of NTX_ATTN_KEYS, so
 * a split's tiles are the whole group's tiles, and of any power-of-two kv_block up to it. */
#define NTX_ATTN_SPLIT 1024

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

/* Floats of scratch one thread's attention needs (ntx_attn_item, ntx_attn_group, the reference). */
int64_t ntx_attn_scratch(const ntx_model *md);

/* Floats of a step's shared buffer for split partials: room for the splits of NTX_ATTN_ROWS
 * query rows at max_ctx (16 decode rows at the full context, or one group of a prefill chunk).
 * A step whose split groups need more runs the rest each in one item (the same bits); it then
 * has at least 16 × n_kv_heads (group, head) items of its own to share out. */
int64_t ntx_attn_parts(const ntx_model *md);

/* Causal GQA attention of rows [r0, r1) (one group) for KV head kh: q (rows, H * hd) already
 * rotated, the cache holding every position they see; out (rows, H * hd). */
void ntx_attn_group(const ntx_model *md, const ntx_header *h, const float *q, float *out, const void *kv_k,
                    const void *kv_v, int64_t r0, int64_t r1, int kh, float *scratch);

/* The same, bit for bit, by the first kernel's loop order (attention.c): the reference the new
 * one is tested and timed against. */
void ntx_attn_group_ref(const ntx_model *md, const ntx_header *h, const float *q, float *out, const void *kv_k,
                        const void *kv_v, int64_t r0, int64_t r1, int kh, float *scratch);

/* A step's attention as work items, the same whoever runs them. A group of rows whose keys
 * [0, end) span one split is n_kv_heads items, each ntx_attn_group. A group of several splits
 * computes each split apart (from a fresh running max, sum and output: its partial) and folds
 * the partials in split order (ntx_attn_item): with room in parts, that is one item per
 * (head, split), the last of a head's items to finish doing the fold; without, one item per
 * head that runs its splits in turn. Both fold the same partials in the same order, so a row's
 * bits depend on its own position and data alone. Made once per step, read by every layer. */
enum { NTX_ATTN_STEP = 0, NTX_ATTN_REF = 1, NTX_ATTN_WHOLE = 2, NTX_ATTN_SERIAL = 3 };
typedef struct {
    int kernel;       /* NTX_ATTN_*: STEP as steps run it; REF, WHOLE: every group whole (ntx_attn_group_ref,
                         ntx_attn_group: the kernels before splits); SERIAL: STEP without parts */
    int64_t n_groups, n_items;
    int64_t *groups;  /* (n_groups + 1) each group's first row; last: n_rows */
    int64_t *first;   /* (n_groups + 1) each group's first item; last: n_items */
    int64_t *part;    /* (n_groups) offset in parts of the group's partials; -1: none (whole, or serial) */
    int32_t *pending; /* (n_groups × n_kv_heads) split items of a (group, head) done in this layer */
    float *parts;
} ntx_attn_plan;

/* The plan of h's rows with n_parts floats of parts; 0, or -2 where its arrays could not be
 * allocated. ntx_attn_plan_free releases them. */
int ntx_attn_plan_init(ntx_attn_plan *p, const ntx_model *md, const ntx_header *h, int kernel, float *parts,
                       int64_t n_parts);
void ntx_attn_plan_free(ntx_attn_plan *p);

/* Item `it` of the plan, for one layer: q (rows, H * hd) rotated, out (rows, H * hd). Items run
 * in any order on any threads; a layer's items must all be done before the next layer's start
 * (the fold's counters are reset by the item that folds). */
void ntx_attn_item(const ntx_attn_plan *p, const ntx_model *md, const ntx_header *h, const float *q, float *out,
                   const void *kv_k, const void *kv_v, int64_t it, float *scratch);

/* Attention of every row of h over one layer's cache on n_threads threads, as a step's
 * NTX_OP_ATTN runs it (kernel NTX_ATTN_STEP, with the parts a step of md has) or by another
 * kernel: what tests, bench/host_attention.py and the figures at load (engine/figures.py) call
 * outside a step. 0, or -2 where the scratch could not be allocated. */
int ntx_attention(const ntx_model *md, const ntx_header *h, const float *q, float *out, const void *kv_k,
                  const void *kv_v, int n_threads, int kernel);

#endif
