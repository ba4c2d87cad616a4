/* Decode attention over the paged KV cache, on the CPU, reading blocks where they lie.
 *
 * One new token per sequence. Each cached slot is read once per pass for all heads (grouped-query
 * attention: the query heads sharing a KV head read it together), the softmax is exact (two
 * passes: scores, then the weighted sum of values), and nothing is copied out of the cache: the PyTorch
 * path's gather writes and re-reads every context, which on a small CPU costs more than the
 * attention itself.
 *
 * Parallel over sequences with OpenMP. Built with -fopenmp, the library uses the
 * OpenMP runtime PyTorch has already loaded (same soname), so it runs on PyTorch's threads: the
 * ones that have just finished the step's previous operation and are still spinning for work.
 * Threads of our own would compete with those for the cores.
 *
 * Layouts (all contiguous, float32):
 *   query, out       [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables     int32 [num_seqs, table_width]
 *   context_lens     int32 [num_seqs], each at most max_context
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static float dot(const float *a, const float *b, int n) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* Where position t of a sequence lies in the cache: block table[t / block_size], slot t % block_size. */
static inline const float *token(const float *cache, const int32_t *table, int t, int block_size,
                                 int64_t token_stride) {
    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
    return cache + slot * token_stride;
}

/* One sequence, every head. A token's keys (or values) for all KV heads sit together in its slot,
 * so each slot is read once, front to back; query head h uses KV head h / group.
 * scores holds num_heads * context floats. */
static void attend_sequence(const float *q, const float *k_cache, const float *v_cache,
                            const int32_t *table, int context, float *o, float *scores,
                            int num_heads, int group, int head_dim, int block_size,
                            int64_t token_stride, float scale) {
    for (int t = 0; t < context; t++) {
        const float *k = token(k_cache, table, t, block_size, token_stride);
        for (int h = 0; h < num_heads; h++)
            scores[(int64_t)h * context + t] =
                dot(q + (int64_t)h * head_dim, k + (int64_t)(h / group) * head_dim, head_dim) * scale;
    }
    for (int h = 0; h < num_heads; h++) {
        float *row = scores + (int64_t)h * context;
        float peak = -INFINITY, total = 0.0f;
        for (int t = 0; t < context; t++) peak = row[t] > peak ? row[t] : peak;
        for (int t = 0; t < context; t++) total += (row[t] = expf(row[t] - peak));
        const float norm = 1.0f / total;
        for (int t = 0; t < context; t++) row[t] *= norm;
        float *oh = o + (int64_t)h * head_dim;
        for (int d = 0; d < head_dim; d++) oh[d] = 0.0f;
    }
    for (int t = 0; t < context; t++) {
        const float *v = token(v_cache, table, t, block_size, token_stride);
        for (int h = 0; h < num_heads; h++) {
            const float p = scores[(int64_t)h * context + t];
            const float *vh = v + (int64_t)(h / group) * head_dim;
            float *oh = o + (int64_t)h * head_dim;
            for (int d = 0; d < head_dim; d++) oh[d] += p * vh[d];
        }
    }
}

/* Returns 0, or -1 when a thread could not allocate its score buffer. */
int paged_decode_f32(const float *query, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, int table_width, const int32_t *context_lens,
                     float *out, int num_seqs, int max_context, int num_heads, int num_kv_heads,
                     int head_dim, int block_size, float scale) {
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)(max_context > 0 ? max_context : 1));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        /* Dynamic: contexts differ in length, so equal shares of sequences are not equal work. */
#pragma omp for schedule(dynamic, 1)
        for (int s = 0; s < num_seqs; s++) {
            if (!scores) continue;
            const int64_t head = (int64_t)s * num_heads;
            attend_sequence(query + head * head_dim, k_cache, v_cache,
                            block_tables + (int64_t)s * table_width, context_lens[s],
                            out + head * head_dim, scores, num_heads, group, head_dim, block_size,
                            token_stride, scale);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
