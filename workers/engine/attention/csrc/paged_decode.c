/* Decode attention over the paged KV cache, on the CPU, reading blocks where they lie.
 *
 * One new token per sequence. For each (sequence, KV head) the keys are read once for all the
 * query heads that share them (grouped-query attention), the softmax is exact (two passes:
 * scores, then the weighted sum of values), and nothing is copied out of the cache: the PyTorch
 * path's gather writes and re-reads every context, which on a small CPU costs more than the
 * attention itself.
 *
 * Layouts (all contiguous, float32):
 *   query, out     [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables   int32 [num_seqs, table_width]
 *   context_lens   int32 [num_seqs]
 * The caller splits the sequences into ranges [first, last) to run on several threads.
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

int paged_decode_f32(const float *query, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, int table_width, const int32_t *context_lens,
                     float *out, int first, int last, int num_heads, int num_kv_heads,
                     int head_dim, int block_size, float scale) {
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    int capacity = 0;
    float *scores = NULL; /* [group, context] */
    for (int s = first; s < last; s++) {
        const int context = context_lens[s];
        const int32_t *table = block_tables + (int64_t)s * table_width;
        if (context > capacity) {
            free(scores);
            capacity = context;
            scores = malloc(sizeof(float) * (size_t)group * (size_t)capacity);
            if (!scores) return -1;
        }
        for (int kv = 0; kv < num_kv_heads; kv++) {
            const float *q = query + ((int64_t)s * num_heads + (int64_t)kv * group) * head_dim;
            float *o = out + ((int64_t)s * num_heads + (int64_t)kv * group) * head_dim;
            for (int t = 0; t < context; t++) {
                const float *k = token(k_cache, table, t, block_size, token_stride) + (int64_t)kv * head_dim;
                for (int g = 0; g < group; g++)
                    scores[(int64_t)g * context + t] = dot(q + (int64_t)g * head_dim, k, head_dim) * scale;
            }
            for (int g = 0; g < group; g++) {
                float *row = scores + (int64_t)g * context;
                float peak = -INFINITY, total = 0.0f;
                for (int t = 0; t < context; t++) peak = row[t] > peak ? row[t] : peak;
                for (int t = 0; t < context; t++) total += (row[t] = expf(row[t] - peak));
                const float norm = 1.0f / total;
                for (int t = 0; t < context; t++) row[t] *= norm;
                float *og = o + (int64_t)g * head_dim;
                for (int d = 0; d < head_dim; d++) og[d] = 0.0f;
            }
            for (int t = 0; t < context; t++) {
                const float *v = token(v_cache, table, t, block_size, token_stride) + (int64_t)kv * head_dim;
                for (int g = 0; g < group; g++) {
                    const float p = scores[(int64_t)g * context + t];
                    float *og = o + (int64_t)g * head_dim;
                    for (int d = 0; d < head_dim; d++) og[d] += p * v[d];
                }
            }
        }
    }
    free(scores);
    return 0;
}
