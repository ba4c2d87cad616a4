/* Decode attention over the paged KV cache, on the CPU, reading blocks where they lie.
 *
 * One new token per sequence. The softmax is exact (two passes: scores, then the weighted sum of
 * values), and nothing is copied out of the cache: the PyTorch path's gather writes and re-reads
 * every context, which on a small CPU costs more than the attention itself.
 *
 * Written with the compiler's vector extensions (GCC and Clang): a head is head_dim / LANES
 * vectors of LANES floats (16 with AVX-512, else 8; see below), kept in registers across the whole
 * context, so each cached token costs a few vector loads and multiply-adds per head. The compiler
 * maps the vectors onto whatever the CPU has (one AVX-512 or AVX2 register, two NEON ones).
 * head_dim must be a multiple of 16.
 *
 * Two builds of the same code: paged_decode_f32 for a float32 cache and paged_decode_bf16 for a
 * bfloat16 one (the top 16 bits of a float32, widened exactly on load). Both compute in float32.
 *
 * Parallel over sequences with OpenMP. Built with -fopenmp, the library uses the
 * OpenMP runtime PyTorch has already loaded (same soname), so it runs on PyTorch's threads: the
 * ones that have just finished the step's previous operation and are still spinning for work.
 * Threads of our own would compete with those for the cores.
 *
 * Layouts (all contiguous):
 *   query, out       float32 [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache float32 or bfloat16 [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables     int32 [num_seqs, table_width]
 *   context_lens     int32 [num_seqs], each at most max_context
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"

/* A vector is 16 floats where the CPU has 16-float registers (AVX-512), else 8. Measured on an
 * AVX2-only EPYC: with 16-float vectors GCC moved every load through the stack, and the kernel
 * ran 2.4-2.9x slower than with 8 (float32 and bfloat16 caches, 64 sequences of 282-420 tokens). */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define MAX_VECTORS (256 / LANES) /* head_dim up to 256 */
#define MAX_HEADS 4    /* query heads attended together */

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t vu32 __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t vu16 __attribute__((vector_size(LANES * sizeof(uint16_t))));

/* memcpy: the cache and the query need not be aligned to a whole vector. */
static inline vfloat load_f32(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vfloat load_bf16(const uint16_t *p) {
    vu16 half;
    memcpy(&half, p, sizeof half);
    const vu32 bits = __builtin_convertvector(half, vu32) << 16;
    vfloat v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline float sum_lanes(vfloat v) {
    float sum = 0.0f;
    for (int i = 0; i < LANES; i++) sum += v[i];
    return sum;
}

/* e^x for the softmax's x <= 0. */
static inline float exp_nonpositive(float x) { return fast_exp(x < -87.0f ? -87.0f : x); }

static inline void softmax(float *row, int n, float peak) {
    float total = 0.0f;
    for (int t = 0; t < n; t++) total += (row[t] = exp_nonpositive(row[t] - peak));
    const float norm = 1.0f / total;
    for (int t = 0; t < n; t++) row[t] *= norm;
}

/* Blocks are read this many ahead of use: the hardware prefetchers follow a stream within a block
 * but not the jump to the next one, which the block table decides. Measured on a Zen 4 (64
 * sequences of ~384 tokens, 30 layers' caches, far larger than the caches): a pass over the
 * bfloat16 cache took 29 ms with no software prefetch, 22 ms one block ahead, 19 ms two or three
 * ahead, 21-22 ms four or six ahead. */
#define PREFETCH_AHEAD 2

/* Ask for one head's rows of a block's tokens (row_bytes each, stride_bytes apart). */
static inline void prefetch_block(const void *base, int tokens, int64_t stride_bytes, int row_bytes) {
    const char *p = (const char *)base;
    for (int t = 0; t < tokens; t++, p += stride_bytes)
        for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b, 0, 0);
}

/* The block `ahead` blocks past the one starting at token t0, if the context reaches it. */
#define PREFETCH(cache, t0, ahead)                                                                 \
    do {                                                                                           \
        if ((t0) + (ahead) * block_size < context)                                                 \
            prefetch_block((cache) + (int64_t)table[(t0) / block_size + (ahead)] * block_size     \
                           * token_stride, block_size, token_stride * (int64_t)sizeof(*(cache)),   \
                           head_dim * (int)sizeof(*(cache)));                                      \
    } while (0)

/* The dispatch's calls, in the scope of paged_decode_NAME's loop. */
#define ATTEND_HEADS(NAME, VECTORS, HEADS)                                                         \
    attend_heads_##NAME(q, k, v, table, n, out + at, rows, block_size, token_stride, scale,       \
                        VECTORS, HEADS)
#define ATTEND_HEAD(NAME, VECTORS)                                                                 \
    attend_head_##NAME(q, k, v, table, n, out + at, rows, block_size, token_stride, scale, VECTORS)

/* Defines paged_decode_NAME over a cache of ELEM, read through LOAD.
 *
 * attend_head_NAME: one query head of one sequence. attend_heads_NAME: `heads` query heads of one
 * sequence that share one KV head (grouped-query attention), so that each cached key and value is
 * loaded and widened once for all of them. k_cache and v_cache point at that KV head's first
 * element, token_stride apart from one token to the next; a block's tokens are consecutive. rows
 * holds heads * context scores. `vectors` and `heads` are constants where they are inlined, so the
 * compiler unrolls over them and keeps the queries, dot products and outputs in registers.
 *
 * Measured on a Zen 4 core (64 sequences of 300-540 tokens, 9 query heads over 3 KV heads): taking
 * a group's heads together makes the bfloat16 kernel 1.4x faster, since widening dominates, and
 * the float32 one slower, so float32 attends one head at a time. */
#define DEFINE_PAGED_DECODE(NAME, ELEM, LOAD)                                                      \
static inline __attribute__((always_inline)) void attend_head_##NAME(                               \
        const float *q, const ELEM *k_cache, const ELEM *v_cache, const int32_t *table,           \
        int context, float *o, float *row, int block_size, int64_t token_stride, float scale,     \
        const int vectors) {                                                                       \
    const int head_dim = vectors * LANES;                                                          \
    vfloat qv[MAX_VECTORS], acc[MAX_VECTORS];                                                      \
    for (int c = 0; c < vectors; c++) qv[c] = load_f32(q + c * LANES) * scale;                    \
    float peak = -INFINITY;                                                                        \
    for (int b = 1; b < PREFETCH_AHEAD; b++) PREFETCH(k_cache, 0, b);                              \
    for (int b = 0; b < PREFETCH_AHEAD; b++) PREFETCH(v_cache, 0, b);                              \
    for (int t0 = 0; t0 < context; t0 += block_size) {                                             \
        const ELEM *k = k_cache + (int64_t)table[t0 / block_size] * block_size * token_stride;    \
        const int end = context - t0 < block_size ? context - t0 : block_size;                     \
        PREFETCH(k_cache, t0, PREFETCH_AHEAD);                                                   \
        for (int t = 0; t < end; t++, k += token_stride) {                                         \
            vfloat dot = qv[0] * LOAD(k);                                                          \
            for (int c = 1; c < vectors; c++) dot += qv[c] * LOAD(k + c * LANES);                  \
            const float score = sum_lanes(dot);                                                    \
            row[t0 + t] = score;                                                                   \
            peak = score > peak ? score : peak;                                                    \
        }                                                                                          \
    }                                                                                              \
    softmax(row, context, peak);                                                                   \
    for (int c = 0; c < vectors; c++) acc[c] = (vfloat){0};                                        \
    for (int t0 = 0; t0 < context; t0 += block_size) {                                             \
        const ELEM *v = v_cache + (int64_t)table[t0 / block_size] * block_size * token_stride;    \
        const int end = context - t0 < block_size ? context - t0 : block_size;                     \
        PREFETCH(v_cache, t0, PREFETCH_AHEAD);                                                   \
        for (int t = 0; t < end; t++, v += token_stride) {                                         \
            const float p = row[t0 + t];                                                           \
            for (int c = 0; c < vectors; c++) acc[c] += p * LOAD(v + c * LANES);                   \
        }                                                                                          \
    }                                                                                              \
    for (int c = 0; c < vectors; c++) memcpy(o + c * LANES, &acc[c], sizeof acc[c]);               \
}                                                                                                  \
                                                                                                   \
static inline __attribute__((always_inline)) void attend_heads_##NAME(                              \
        const float *q, const ELEM *k_cache, const ELEM *v_cache, const int32_t *table,           \
        int context, float *o, float *rows, int block_size, int64_t token_stride, float scale,    \
        const int vectors, const int heads) {                                                      \
    const int head_dim = vectors * LANES;                                                          \
    vfloat qv[MAX_HEADS][MAX_VECTORS], kv[MAX_VECTORS];                                            \
    float peak[MAX_HEADS];                                                                         \
    for (int j = 0; j < heads; j++) {                                                              \
        peak[j] = -INFINITY;                                                                       \
        for (int c = 0; c < vectors; c++)                                                          \
            qv[j][c] = load_f32(q + j * head_dim + c * LANES) * scale;                             \
    }                                                                                              \
    for (int b = 1; b < PREFETCH_AHEAD; b++) PREFETCH(k_cache, 0, b);                              \
    for (int b = 0; b < PREFETCH_AHEAD; b++) PREFETCH(v_cache, 0, b);                              \
    for (int t0 = 0; t0 < context; t0 += block_size) {                                             \
        const ELEM *k = k_cache + (int64_t)table[t0 / block_size] * block_size * token_stride;    \
        const int end = context - t0 < block_size ? context - t0 : block_size;                     \
        PREFETCH(k_cache, t0, PREFETCH_AHEAD);                                                   \
        for (int t = 0; t < end; t++, k += token_stride) {                                         \
            for (int c = 0; c < vectors; c++) kv[c] = LOAD(k + c * LANES);                         \
            for (int j = 0; j < heads; j++) {                                                      \
                vfloat dot = qv[j][0] * kv[0];                                                     \
                for (int c = 1; c < vectors; c++) dot += qv[j][c] * kv[c];                         \
                const float score = sum_lanes(dot);                                                \
                rows[(int64_t)j * context + t0 + t] = score;                                       \
                peak[j] = score > peak[j] ? score : peak[j];                                       \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int j = 0; j < heads; j++) softmax(rows + (int64_t)j * context, context, peak[j]);       \
    vfloat acc[MAX_HEADS][MAX_VECTORS];                                                            \
    for (int j = 0; j < heads; j++)                                                                \
        for (int c = 0; c < vectors; c++) acc[j][c] = (vfloat){0};                                 \
    for (int t0 = 0; t0 < context; t0 += block_size) {                                             \
        const ELEM *v = v_cache + (int64_t)table[t0 / block_size] * block_size * token_stride;    \
        const int end = context - t0 < block_size ? context - t0 : block_size;                     \
        PREFETCH(v_cache, t0, PREFETCH_AHEAD);                                                   \
        for (int t = 0; t < end; t++, v += token_stride) {                                         \
            for (int c = 0; c < vectors; c++) kv[c] = LOAD(v + c * LANES);                         \
            for (int j = 0; j < heads; j++) {                                                      \
                const float p = rows[(int64_t)j * context + t0 + t];                               \
                for (int c = 0; c < vectors; c++) acc[j][c] += p * kv[c];                          \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int j = 0; j < heads; j++)                                                                \
        for (int c = 0; c < vectors; c++)                                                          \
            memcpy(o + j * head_dim + c * LANES, &acc[j][c], sizeof acc[j][c]);                    \
}                                                                                                  \
                                                                                                   \
/* Returns 0, or -1 when a thread could not allocate its score rows. */                            \
int paged_decode_##NAME(const float *query, const ELEM *k_cache, const ELEM *v_cache,              \
                        const int32_t *block_tables, int table_width,                              \
                        const int32_t *context_lens, float *out, int num_seqs, int max_context,    \
                        int num_heads, int num_kv_heads, int head_dim, int block_size,             \
                        float scale) {                                                             \
    const int group = num_heads / num_kv_heads, vectors = head_dim / LANES;                        \
    /* Query heads taken together (bfloat16): as many of a group as registers hold and divide it. */\
    const int together = sizeof(ELEM) == 4 ? 1                                                     \
                         : vectors == 4 && group % 3 == 0 ? 3                                      \
                         : vectors == 4 && group % 4 == 0 ? 4                                      \
                         : vectors <= 8 && group % 2 == 0 ? 2 : 1;                                 \
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;                                 \
    const size_t context_cap = (size_t)(max_context > 0 ? max_context : 1);                        \
    int failed = 0;                                                                                \
    _Pragma("omp parallel")                                                                        \
    {                                                                                              \
        float *rows = malloc(sizeof(float) * context_cap * (size_t)together);                      \
        if (!rows) {                                                                               \
            _Pragma("omp atomic write")                                                            \
            failed = 1;                                                                            \
        }                                                                                          \
        /* Dynamic: contexts differ in length, so equal shares of sequences are not equal work. */ \
        _Pragma("omp for schedule(dynamic, 1)")                                                    \
        for (int s = 0; s < num_seqs; s++) {                                                       \
            if (!rows) continue;                                                                   \
            const int32_t *table = block_tables + (int64_t)s * table_width;                        \
            for (int h = 0; h < num_heads; h += together) {                                        \
                const int64_t at = ((int64_t)s * num_heads + h) * head_dim;                        \
                const int64_t kv_head = (int64_t)(h / group) * head_dim;                           \
                const float *q = query + at;                                                       \
                const ELEM *k = k_cache + kv_head, *v = v_cache + kv_head;                         \
                const int n = context_lens[s];                                                     \
                /* Constant shapes where they are common, so that each is unrolled. */              \
                if (vectors == 4 && together == 3) ATTEND_HEADS(NAME, 4, 3);                       \
                else if (vectors == 4 && together == 4) ATTEND_HEADS(NAME, 4, 4);                  \
                else if (vectors == 4 && together == 2) ATTEND_HEADS(NAME, 4, 2);                  \
                else if (vectors == 8 && together == 2) ATTEND_HEADS(NAME, 8, 2);                  \
                else if (vectors == 4 && together == 1) ATTEND_HEAD(NAME, 4);                      \
                else if (vectors == 8 && together == 1) ATTEND_HEAD(NAME, 8);                      \
                else if (vectors == 16 && together == 1) ATTEND_HEAD(NAME, 16);                    \
                else ATTEND_HEADS(NAME, vectors, together);                                        \
            }                                                                                      \
        }                                                                                          \
        free(rows);                                                                                \
    }                                                                                              \
    return failed ? -1 : 0;                                                                        \
}

DEFINE_PAGED_DECODE(f32, float, load_f32)
DEFINE_PAGED_DECODE(bf16, uint16_t, load_bf16)
