/* The recorded step's data: instructions, the per-step header, the model's constants.
 * Mirrored field by field by ctypes structures in backends/host/native.py. */
#ifndef NTX_STEP_H
#define NTX_STEP_H

#include <stdint.h>

enum ntx_op {
    NTX_OP_EMBED = 1,      /* out (rows, n) = dequantized rows `tokens` of w */
    NTX_OP_RMS_NORM = 2,   /* out = x / rms(x) * w, per row of n; y: also quantized for wtype */
    NTX_OP_QUANT = 3,      /* out (bytes) = x's rows as activations for weight type wtype */
    NTX_OP_MATMUL = 4,     /* out (rows, m) = act x · w rows (+ res) */
    NTX_OP_SWIGLU = 5,     /* out = silu(x) * y, rows × n; res: also quantized for wtype */
    NTX_OP_ROWS = 6,       /* out (n_out, n) = x rows out_rows */
    NTX_OP_ATTN_WRITE = 7, /* RoPE on q (x, in place) and k (y); k, v (res) into the cache */
    NTX_OP_ATTN = 8,       /* out = causal GQA attention of q (x) over the cache */
};

enum { NTX_ROWS_ALL = 0, NTX_ROWS_OUT = 1 }; /* which row count an instruction runs over */
enum { NTX_SAME_PHASE = 1 };                /* no barrier after: the next reads nothing this writes */

typedef struct {
    int32_t op, flags, rows, wtype;
    int32_t n, m;          /* input and output widths */
    int64_t x, y, res, out; /* arena byte offsets, -1 for none */
    const void *w;         /* GGUF weight bytes or a float32 norm vector */
    int64_t w_row_bytes;
    void *kv_k, *kv_v;     /* this layer's KV cache (attention) */
    float eps;
    int32_t pad;
} ntx_instr;

typedef struct {
    int64_t n_rows, n_out;  /* rows of the step; rows the head runs over */
    const int64_t *tokens, *positions, *slots, *out_rows; /* (n_rows,) ×3, (n_out,) */
} ntx_header;

/* The KV cache (kernels/cpu/kv.h, engine/kv_cache.py): each layer's k and v are blocks of
 * kv_block positions, (n_blocks, n_kv_heads, kv_block, row) with rows of kv_row_bytes holding
 * head_dim values of GGML type kv_type (F32, F16, Q8_0, Q4_0); kv_tables (slots, kv_max_blocks)
 * gives each slot's block ids in position order. The caller reserves a step's blocks before it. */
typedef struct {
    int32_t n_heads, n_kv_heads, head_dim, rope_dim;
    int32_t rope_neox, kv_type;
    int64_t max_ctx;        /* positions per sequence (the rope table, the split partials' room) */
    float attn_scale;
    int32_t kv_block;
    const float *rope_cos, *rope_sin; /* (max_ctx, rope_dim/2) */
    const int32_t *kv_tables;
    int64_t kv_max_blocks, kv_row_bytes;
} ntx_model;

/* Run prog over the step h. scratch: n_threads × scratch_per_thread floats (at least
 * ntx_attn_scratch(md) each); parts: n_parts floats the threads share for attention's split
 * partials (ntx_attn_parts(md); fewer, or NULL, runs more splits in turn: the same bits). 0, or
 * -1 (a model shape the kernels do not take), -2 (no memory), -3 (the cache's layout), -4 (scratch). */
int ntx_step(const ntx_instr *prog, int n_instr, const ntx_header *h, char *arena,
             const ntx_model *md, float *scratch, int64_t scratch_per_thread, int n_threads,
             float *parts, int64_t n_parts);
void ntx_struct_sizes(int64_t *out);
double ntx_read_probe(const void *buf, int64_t bytes, int rounds, int n_threads);
void ntx_topk(const float *x, int64_t rows, int64_t V, int k, int64_t *ids, float *vals,
              int64_t *nan_count, int n_threads);

#endif
