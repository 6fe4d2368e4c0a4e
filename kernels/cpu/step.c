/* A recorded step: model.forward's op list, run by a team of threads in one call.
 *
 * Python records model.forward once per step shape (backends/host/record.py) into an array
 * of ntx_instr; ntx_step runs it. Row counts, token ids, positions and KV slots are read from
 * the step's header at run time, so one recording serves every batch of its shape. Threads
 * split each instruction's work (rows, columns, or attention's (group, KV head, split) items)
 * and meet at a barrier after it, unless the instruction says the next one reads nothing it
 * writes (the members of a stacked matmul). One team per step: the threads are created once (OpenMP) and spin briefly
 * between steps.
 */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "ntx_cpu.h"
#include "ntx_step.h"
#include "attention.h"

static inline int64_t rows_of(const ntx_header *h, int32_t sel) {
    return sel == NTX_ROWS_OUT ? h->n_out : h->n_rows;
}

/* [lo, hi) of n items for thread t of nt, in chunks of `align` items. */
static inline void share(int64_t n, int64_t align, int t, int nt, int64_t *lo, int64_t *hi) {
    int64_t chunks = (n + align - 1) / align;
    int64_t per = chunks / nt, extra = chunks % nt;
    int64_t c0 = t * per + (t < extra ? t : extra);
    int64_t c1 = c0 + per + (t < extra ? 1 : 0);
    *lo = c0 * align < n ? c0 * align : n;
    *hi = c1 * align < n ? c1 * align : n;
}

static inline float *F(char *arena, int64_t off) { return (float *)(arena + off); }

static void op_embed(const ntx_instr *in, const ntx_header *h, char *arena, int t, int nt) {
    int64_t lo, hi;
    share(h->n_rows, 1, t, nt, &lo, &hi);
    if (hi > lo)
        ntx_dequantize_rows(in->wtype, in->w, (size_t)in->w_row_bytes, in->n, h->tokens + lo,
                            (int)(hi - lo), F(arena, in->out) + lo * in->n);
}

static void op_rms_norm(const ntx_instr *in, const ntx_header *h, char *arena, int t, int nt) {
    int64_t lo, hi, n = in->n;
    share(rows_of(h, in->rows), 1, t, nt, &lo, &hi);
    const float *w = (const float *)in->w;
    for (int64_t r = lo; r < hi; r++) {
        const float *x = F(arena, in->x) + r * n;
        float *y = F(arena, in->out) + r * n;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
        float k = 1.0f / sqrtf(ss / (float)n + in->eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) y[i] = (x[i] * k) * w[i];
        if (in->y >= 0) /* fused: the row quantized for the matmuls that read it */
            ntx_quantize_act(in->wtype, y, 1, (int)n, (int)n,
                             arena + in->y + r * ntx_act_row_bytes(in->wtype, (int)n));
    }
}

static void op_quant(const ntx_instr *in, const ntx_header *h, char *arena, int t, int nt) {
    int64_t lo, hi;
    share(rows_of(h, in->rows), 1, t, nt, &lo, &hi);
    size_t rb = ntx_act_row_bytes(in->wtype, in->n);
    if (hi > lo)
        ntx_quantize_act(in->wtype, F(arena, in->x) + lo * in->n, (int)(hi - lo), in->n, in->n,
                         arena + in->out + lo * rb);
}

static void op_matmul(const ntx_instr *in, const ntx_header *h, char *arena, int t, int nt) {
    int64_t lo, hi;
    share(in->m, 16, t, nt, &lo, &hi);
    if (hi <= lo) return;
    const void *act = in->wtype == NTX_F32 || in->wtype == NTX_F16 || in->wtype == NTX_BF16
                          ? (const void *)F(arena, in->x) : (const void *)(arena + in->x);
    ntx_gemm(in->wtype, in->w, (size_t)in->w_row_bytes, in->n, (int)lo, (int)hi, act,
             (int)rows_of(h, in->rows), F(arena, in->out), in->m,
             in->res >= 0 ? F(arena, in->res) : NULL);
}

static void op_swiglu(const ntx_instr *in, const ntx_header *h, char *arena, int t, int nt) {
    const float *g = F(arena, in->x), *u = F(arena, in->y);
    float *o = F(arena, in->out);
    if (in->res < 0) {
        int64_t lo, hi, n = rows_of(h, in->rows) * in->n;
        share(n, 64, t, nt, &lo, &hi);
        for (int64_t i = lo; i < hi; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        return;
    }
    /* fused with the quantization of its output (act at res): split by (row, chunk of 256
     * elements), whole activation blocks each */
    int64_t n = in->n, chunk = n % 256 == 0 ? 256 : n, per_row = n / chunk, lo, hi;
    size_t rb = ntx_act_row_bytes(in->wtype, (int)n);
    share(rows_of(h, in->rows) * per_row, 1, t, nt, &lo, &hi);
    for (int64_t it = lo; it < hi; it++) {
        int64_t r = it / per_row, e0 = (it % per_row) * chunk;
        const float *gr = g + r * n + e0, *ur = u + r * n + e0;
        float *orow = o + r * n + e0;
        for (int64_t i = 0; i < chunk; i++) orow[i] = gr[i] / (1.0f + expf(-gr[i])) * ur[i];
        ntx_quantize_act(in->wtype, orow, 1, (int)chunk, (int)chunk,
                         arena + in->res + r * rb + ntx_act_row_bytes(in->wtype, (int)e0));
    }
}

static void op_rows(const ntx_instr *in, const ntx_header *h, char *arena, int t, int nt) {
    int64_t lo, hi;
    share(h->n_out, 1, t, nt, &lo, &hi);
    for (int64_t i = lo; i < hi; i++)
        memcpy(F(arena, in->out) + i * in->n, F(arena, in->x) + h->out_rows[i] * in->n,
               (size_t)in->n * sizeof(float));
}

/* Rotate one head's first rope_dim elements by the position's angles (cos, sin: rope_dim/2). */
static inline void rope_head(float *x, const float *cs, const float *sn, int rd, int neox) {
    int half = rd / 2;
    if (neox) {
        for (int i = 0; i < half; i++) {
            float a = x[i], b = x[i + half];
            x[i] = a * cs[i] - b * sn[i];
            x[i + half] = a * sn[i] + b * cs[i];
        }
    } else {
        for (int i = 0; i < half; i++) {
            float a = x[2 * i], b = x[2 * i + 1];
            x[2 * i] = a * cs[i] - b * sn[i];
            x[2 * i + 1] = a * sn[i] + b * cs[i];
        }
    }
}

/* Phase 1 of attention: RoPE on q (in place) and k, then k and v into the cache at each row's
 * slot and position (its block reserved by the caller). Split by rows. */
static void op_attn_write(const ntx_instr *in, const ntx_header *h, char *arena, const ntx_model *md,
                          int t, int nt) {
    int64_t lo, hi;
    share(h->n_rows, 1, t, nt, &lo, &hi);
    int hd = md->head_dim, H = md->n_heads, Hk = md->n_kv_heads, rd = md->rope_dim, half = rd / 2;
    float kbuf[1024];
    for (int64_t r = lo; r < hi; r++) {
        int64_t pos = h->positions[r], slot = h->slots[r];
        const float *cs = md->rope_cos + pos * half, *sn = md->rope_sin + pos * half;
        float *q = F(arena, in->x) + r * (int64_t)H * hd;
        const float *k = F(arena, in->y) + r * (int64_t)Hk * hd;
        const float *v = F(arena, in->res) + r * (int64_t)Hk * hd;
        for (int hh = 0; hh < H; hh++) rope_head(q + hh * hd, cs, sn, rd, md->rope_neox);
        for (int kh = 0; kh < Hk; kh++) {
            memcpy(kbuf, k + kh * hd, (size_t)hd * sizeof(float));
            rope_head(kbuf, cs, sn, rd, md->rope_neox);
            ntx_kv_store(md->kv_type, kbuf, hd, ntx_kv_row(md, in->kv_k, slot, pos, kh));
            ntx_kv_store(md->kv_type, v + kh * hd, hd, ntx_kv_row(md, in->kv_v, slot, pos, kh));
        }
    }
}

/* Phase 2: causal GQA attention through each sequence's block table (attention.c), split by the
 * step's attention plan: (group of rows, KV head) items, and past NTX_ATTN_SPLIT positions
 * (group, KV head, split) ones, the last of a head's splits folding them. */
static void op_attn(const ntx_instr *in, const ntx_header *h, char *arena, const ntx_model *md,
                    const ntx_attn_plan *plan, float *scratch, int t, int nt) {
    int64_t lo, hi;
    share(plan->n_items, 1, t, nt, &lo, &hi);
    for (int64_t it = lo; it < hi; it++)
        ntx_attn_item(plan, md, h, F(arena, in->x), F(arena, in->out), in->kv_k, in->kv_v, it, scratch);
}

/* Chunks per thread of each instruction: a thread that the OS takes off its core for a while
 * holds up at most the one chunk it claimed, not a share of every phase (a 2-thread team on a
 * loaded 2-core host). */
#define NTX_CHUNKS_PER_THREAD 4

static void run_chunk(const ntx_instr *in, const ntx_header *h, char *arena, const ntx_model *md,
                      const ntx_attn_plan *plan, float *mine, int c, int nc) {
    switch (in->op) {
    case NTX_OP_EMBED: op_embed(in, h, arena, c, nc); break;
    case NTX_OP_RMS_NORM: op_rms_norm(in, h, arena, c, nc); break;
    case NTX_OP_QUANT: op_quant(in, h, arena, c, nc); break;
    case NTX_OP_MATMUL: op_matmul(in, h, arena, c, nc); break;
    case NTX_OP_SWIGLU: op_swiglu(in, h, arena, c, nc); break;
    case NTX_OP_ROWS: op_rows(in, h, arena, c, nc); break;
    case NTX_OP_ATTN_WRITE: op_attn_write(in, h, arena, md, c, nc); break;
    case NTX_OP_ATTN: op_attn(in, h, arena, md, plan, mine, c, nc); break;
    default: break;
    }
}

/* Wait until `*done` reaches `target`: spin briefly, then give the core away between looks. */
static inline void wait_done(const int32_t *done, int32_t target) {
    for (int spin = 0; __atomic_load_n(done, __ATOMIC_ACQUIRE) < target; spin++) {
        if (spin < 2000) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
        } else
            sched_yield();
    }
}

/* The instructions run phase by phase (a phase: instructions up to one without
 * NTX_SAME_PHASE). Each instruction is cut into the same chunks whoever runs them (each op's
 * result does not depend on how its items are split); the threads claim chunks from a counter
 * and count them done, and a phase ends when all of its chunks are done, so no thread waits
 * for another to arrive, only for claimed work to finish. */
int ntx_step(const ntx_instr *prog, int n_instr, const ntx_header *h, char *arena,
             const ntx_model *md, float *scratch, int64_t scratch_per_thread, int n_threads,
             float *parts, int64_t n_parts) {
    if (n_threads < 1) n_threads = 1;
    if (md->head_dim > 256 || md->n_heads / md->n_kv_heads > 16 || md->head_dim > 1024)
        return -1;
    if (md->kv_block < 1 || ntx_kv_row_bytes(md->kv_type, md->head_dim) != md->kv_row_bytes)
        return -3;
    if (scratch_per_thread < ntx_attn_scratch(md)) return -4;
    int nc = n_threads * NTX_CHUNKS_PER_THREAD;
    int32_t *ctr = calloc((size_t)n_instr * 2 + 2, sizeof(int32_t)); /* claimed, done per phase */
    ntx_attn_plan plan; /* attention's items, the same for every layer */
    if (!ctr || ntx_attn_plan_init(&plan, md, h, NTX_ATTN_STEP, parts, parts ? n_parts : 0) != 0) {
        free(ctr);
        return -2;
    }
#pragma omp parallel num_threads(n_threads)
    {
        int t = omp_get_thread_num();
        float *mine = scratch + t * scratch_per_thread;
        for (int a = 0; a < n_instr;) {
            int b = a;
            while (b + 1 < n_instr && (prog[b].flags & NTX_SAME_PHASE)) b++;
            int32_t total = (int32_t)(b - a + 1) * nc, *claimed = ctr + 2 * a, *done = claimed + 1;
            for (;;) {
                int32_t k = __atomic_fetch_add(claimed, 1, __ATOMIC_RELAXED);
                if (k >= total) break;
                run_chunk(prog + a + k / nc, h, arena, md, &plan, mine, k % nc, nc);
                __atomic_fetch_add(done, 1, __ATOMIC_RELEASE);
            }
            wait_done(done, total);
            a = b + 1;
        }
    }
    free(ctr);
    ntx_attn_plan_free(&plan);
    return 0;
}

/* Each row's k largest values (ties: lower id first) and their ids, NaN counted and treated as
 * -inf: what the sampler needs instead of the whole row. Rows split over threads. */
void ntx_topk(const float *x, int64_t rows, int64_t V, int k, int64_t *ids, float *vals,
              int64_t *nan_count, int n_threads) {
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * V;
        int64_t *id = ids + r * k;
        float *vl = vals + r * k;
        int n = 0;
        int64_t nans = 0;
        for (int64_t j = 0; j < V; j++) {
            float v = row[j];
            if (isnan(v)) {
                nans++;
                v = -INFINITY;
            }
            if (n == k && !(v > vl[k - 1])) continue;
            int p = n < k ? n++ : k - 1;
            while (p > 0 && v > vl[p - 1]) {
                vl[p] = vl[p - 1];
                id[p] = id[p - 1];
                p--;
            }
            vl[p] = v;
            id[p] = j;
        }
        nan_count[r] = nans;
    }
}

/* sizeof of the structures Python mirrors, checked at load. */
void ntx_struct_sizes(int64_t *out) {
    out[0] = (int64_t)sizeof(ntx_instr);
    out[1] = (int64_t)sizeof(ntx_header);
    out[2] = (int64_t)sizeof(ntx_model);
}

/* Read `bytes` of `buf` with n_threads threads, `rounds` times; returns a sum so the reads
 * cannot be elided. The host's read bandwidth that the decode figures are compared with. */
double ntx_read_probe(const void *buf, int64_t bytes, int rounds, int n_threads) {
    const int64_t *p = (const int64_t *)buf;
    int64_t n = bytes / 8;
    int64_t total = 0;
    for (int r = 0; r < rounds; r++) {
#pragma omp parallel for num_threads(n_threads) reduction(+ : total) schedule(static)
        for (int64_t i = 0; i < n; i++) total += p[i];
    }
    return (double)total;
}

int ntx_attention(const ntx_model *md, const ntx_header *h, const float *q, float *out, const void *kv_k,
                  const void *kv_v, int n_threads, int kernel) {
    if (n_threads < 1) n_threads = 1;
    int64_t per = ntx_attn_scratch(md), n_parts = kernel == NTX_ATTN_STEP ? ntx_attn_parts(md) : 0;
    float *scratch = malloc((size_t)(per * n_threads + n_parts) * sizeof(float));
    ntx_attn_plan plan;
    if (!scratch || ntx_attn_plan_init(&plan, md, h, kernel, scratch + per * n_threads, n_parts) != 0) {
        free(scratch);
        return -2;
    }
    /* items claimed as they come, as a step's threads claim chunks: a thread the host slows
     * (a shared core) takes fewer of them */
#pragma omp parallel for num_threads(n_threads) schedule(dynamic)
    for (int64_t it = 0; it < plan.n_items; it++)
        ntx_attn_item(&plan, md, h, q, out, kv_k, kv_v, it, scratch + omp_get_thread_num() * per);
    free(scratch);
    ntx_attn_plan_free(&plan);
    return 0;
}
