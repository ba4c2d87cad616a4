/* Prefill attention over the paged KV cache, on CPUs with AVX-512 BF16 (Zen 4, Sapphire Rapids and
 * later), for a bfloat16 cache and query.
 *
 * Several new tokens per sequence (a prompt, a chunk of one, or the part after a cached prefix),
 * each attending causally to its cached context. Flash-attention style: queries in tiles of
 * QUERY_TILE tokens, keys in tiles of 16 (one vector of scores), an online softmax, nothing
 * materialised beyond a tile. Both products run on the CPU's bfloat16 dot-product instruction,
 * which multiplies pairs of bfloat16 and adds into float32: q.k over pairs of the head's
 * dimensions, p.v over pairs of keys. The probabilities are rounded to bfloat16 for p.v, as GPU
 * flash kernels do; the scores, the softmax and the sums are float32.
 *
 * PyTorch's CPU flash kernel does the same work in float32 and spends most of it outside the
 * matrix products: on a Zen 4 it ran 64 prompts of 128-512 tokens through the bundled model's 30
 * layers in 4.4 s of a 21 s benchmark.
 *
 * Parallel over (sequence, KV head, query tile) with OpenMP, on PyTorch's threads (see
 * paged_decode.c). Without AVX-512 BF16 at build time, paged_prefill_supported() returns 0 and
 * the caller keeps its PyTorch path.
 *
 * Layouts:
 *   query, out       bfloat16 [num_tokens, num_heads, head_dim]; a token's heads are contiguous,
 *                    tokens query_stride (out: num_heads * head_dim) elements apart
 *   k_cache, v_cache bfloat16 [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables     int32 [num_seqs, table_width]
 *   query_start_loc  int32 [num_seqs + 1]: sequence s owns tokens query_start_loc[s] .. [s+1] - 1
 *   context_lens     int32 [num_seqs]: cached tokens once this step's are written; the new tokens
 *                    are the last ones
 * Sequences with a single new token are skipped (the decode kernel takes them).
 * head_dim: a multiple of 32 up to 256; block_size: a multiple of 16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

#define QUERY_TILE 32
#define KEY_TILE 16
#define MAX_PAIRS 128 /* head_dim / 2 */
#define MAX_CHUNKS 16 /* head_dim / 16 */

int paged_prefill_supported(void) { return 1; }

/* e^x for x <= 0: fast_exp.h's arithmetic on 16 lanes. */
static inline __m512 exp_nonpositive_v(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x); /* in this order a NaN stays NaN */
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i two_to_n = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(two_to_n));
}

static inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* Per-thread scratch: a query tile's running maxima, sums and float32 outputs. */
typedef struct {
    float *peak, *total, *acc;
} Scratch;

/* One query tile of one sequence against one KV head: rows = tokens x the head's query heads
 * (row r is token r / group, query head first_head + r % group). */
static void attend_tile(const uint16_t *query, int64_t query_stride, int tokens, int first_pos,
                        const uint16_t *k_head, const uint16_t *v_head, const int32_t *table,
                        int block_size, int64_t token_stride, int context, int first_head,
                        int group, int head_dim, float scale, uint16_t *out, int64_t out_stride,
                        Scratch *scratch) {
    const int pairs = head_dim / 2, chunks = head_dim / 16, rows = tokens * group;
    float *peak = scratch->peak, *total = scratch->total, *acc = scratch->acc;
    for (int r = 0; r < rows; r++) {
        peak[r] = -INFINITY;
        total[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)rows * head_dim);

    /* Key t of a tile sits token_stride elements after key t - 1: as 32-bit words, half that. */
    const __m512i key_offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)(token_stride / 2)));
    /* Interleaves the 16-bit elements of two 16-element halves: a0 b0 a1 b1 ... */
    static const uint16_t interleave_order[32] = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i interleave = _mm512_loadu_si512(interleave_order);
    __m512i keys[MAX_PAIRS];                   /* keys[p]: word p (dims 2p, 2p+1) of each key */
    __m512i values[KEY_TILE / 2][MAX_CHUNKS];  /* values[j][c]: keys 2j, 2j+1 interleaved, dims 16c.. */
    const int last_pos = first_pos + tokens - 1;

    for (int k0 = 0; k0 <= last_pos; k0 += KEY_TILE) {
        const int64_t slot = (int64_t)table[k0 / block_size] * block_size + k0 % block_size;
        const uint16_t *k_tile = k_head + slot * token_stride, *v_tile = v_head + slot * token_stride;
        const int valid = context - k0 < KEY_TILE ? context - k0 : KEY_TILE;
        const __mmask16 present = (__mmask16)((1u << valid) - 1);
        for (int p = 0; p < pairs; p++)
            keys[p] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, key_offsets,
                                                  (const int *)k_tile + p, 4);
        /* Values past the context are zeroed: whatever an earlier owner left there, maybe NaN,
         * would survive a zero probability. */
        for (int j = 0; j < KEY_TILE / 2; j++) {
            const uint16_t *a = v_tile + (int64_t)(2 * j) * token_stride, *b = a + token_stride;
            for (int c = 0; c < chunks; c++) {
                const __m256i va = 2 * j < valid ? _mm256_loadu_si256((const __m256i *)(a + 16 * c))
                                                 : _mm256_setzero_si256();
                const __m256i vb = 2 * j + 1 < valid ? _mm256_loadu_si256((const __m256i *)(b + 16 * c))
                                                     : _mm256_setzero_si256();
                values[j][c] = _mm512_permutex2var_epi16(_mm512_zextsi256_si512(va), interleave,
                                                         _mm512_zextsi256_si512(vb));
            }
        }
        for (int r = 0; r < rows; r++) {
            const int token = r / group, pos = first_pos + token;
            if (pos < k0) continue; /* every key of this tile is in the row's future */
            const __mmask16 visible = pos - k0 >= KEY_TILE - 1 ? (__mmask16)0xFFFF
                                                              : (__mmask16)((1u << (pos - k0 + 1)) - 1);
            const uint32_t *q = (const uint32_t *)(query + token * query_stride
                                                   + (int64_t)(first_head + r % group) * head_dim);
            __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
            for (int p = 0; p < pairs; p += 4) {
                s0 = dot(s0, _mm512_set1_epi32((int)q[p]), keys[p]);
                s1 = dot(s1, _mm512_set1_epi32((int)q[p + 1]), keys[p + 1]);
                s2 = dot(s2, _mm512_set1_epi32((int)q[p + 2]), keys[p + 2]);
                s3 = dot(s3, _mm512_set1_epi32((int)q[p + 3]), keys[p + 3]);
            }
            __m512 score = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)),
                                         _mm512_set1_ps(scale));
            score = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), visible, score);
            const float tile_peak = _mm512_reduce_max_ps(score);
            const float new_peak = tile_peak > peak[r] ? tile_peak : peak[r];
            const float shrink = new_peak > peak[r] ? expf(peak[r] - new_peak) : 1.0f; /* 0 on the first tile */
            const __m512 prob = _mm512_maskz_mov_ps(
                visible, exp_nonpositive_v(_mm512_sub_ps(score, _mm512_set1_ps(new_peak))));
            peak[r] = new_peak;
            total[r] = total[r] * shrink + _mm512_reduce_add_ps(prob);
            /* Pairs of probabilities as bfloat16, one 32-bit word per pair of keys. */
            uint32_t prob_pairs[KEY_TILE / 2];
            _mm256_storeu_si256((__m256i *)prob_pairs, (__m256i)_mm512_cvtneps_pbh(prob));
            float *o = acc + (int64_t)r * head_dim;
            const __m512 shrink_v = _mm512_set1_ps(shrink);
            __m512 sums[MAX_CHUNKS];
            if (shrink == 1.0f)
                for (int c = 0; c < chunks; c++) sums[c] = _mm512_loadu_ps(o + 16 * c);
            else
                for (int c = 0; c < chunks; c++) sums[c] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), shrink_v);
            const int used_pairs = (valid + 1) / 2;
            for (int j = 0; j < used_pairs; j++) {
                const __m512i pp = _mm512_set1_epi32((int)prob_pairs[j]);
                for (int c = 0; c < chunks; c++) sums[c] = dot(sums[c], pp, values[j][c]);
            }
            for (int c = 0; c < chunks; c++) _mm512_storeu_ps(o + 16 * c, sums[c]);
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m512 norm = _mm512_set1_ps(1.0f / total[r]);
        uint16_t *dst = out + (r / group) * out_stride + (int64_t)(first_head + r % group) * head_dim;
        const float *o = acc + (int64_t)r * head_dim;
        for (int c = 0; c < chunks; c++)
            _mm256_storeu_si256((__m256i *)(dst + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), norm)));
    }
}

/* Returns 0, -1 when a thread could not allocate its scratch, -2 for shapes it does not take. */
int paged_prefill_bf16(const uint16_t *query, int64_t query_stride, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int32_t *block_tables, int table_width,
                       const int32_t *query_start_loc, const int32_t *context_lens, uint16_t *out,
                       int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                       float scale) {
    if (head_dim % 32 || head_dim > 2 * MAX_PAIRS || block_size % KEY_TILE || num_kv_heads < 1
        || num_heads % num_kv_heads)
        return -2;
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim, out_stride = (int64_t)num_heads * head_dim;
    /* Work items, longest contexts' last tiles first: with a dynamic schedule, the big ones
     * start early and the small ones fill in at the end. Items are (sequence, tile) in reverse
     * order, times the KV heads. */
    int items = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int n = query_start_loc[s + 1] - query_start_loc[s];
        if (n > 1) items += (n + QUERY_TILE - 1) / QUERY_TILE;
    }
    int *seq_of = malloc(sizeof(int) * (size_t)(items > 0 ? items : 1));
    int *tile_of = malloc(sizeof(int) * (size_t)(items > 0 ? items : 1));
    if (!seq_of || !tile_of) {
        free(seq_of);
        free(tile_of);
        return -1;
    }
    int at = items;
    for (int s = 0; s < num_seqs; s++) {
        const int n = query_start_loc[s + 1] - query_start_loc[s];
        if (n <= 1) continue;
        for (int t = 0; t < (n + QUERY_TILE - 1) / QUERY_TILE; t++) {
            seq_of[--at] = s;
            tile_of[at] = t;
        }
    }
    int failed = 0;
    _Pragma("omp parallel")
    {
        const int rows = QUERY_TILE * group;
        Scratch scratch = {malloc(sizeof(float) * rows), malloc(sizeof(float) * rows),
                           malloc(sizeof(float) * (size_t)rows * head_dim)};
        const int ok = scratch.peak && scratch.total && scratch.acc;
        if (!ok) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(dynamic, 1) collapse(2)")
        for (int i = 0; i < items; i++) {
            for (int g = 0; g < num_kv_heads; g++) {
                if (!ok) continue;
                const int s = seq_of[i], start = query_start_loc[s];
                const int n = query_start_loc[s + 1] - start, t0 = tile_of[i] * QUERY_TILE;
                const int tokens = n - t0 < QUERY_TILE ? n - t0 : QUERY_TILE;
                const int first_pos = context_lens[s] - n + t0;
                attend_tile(query + (int64_t)(start + t0) * query_stride, query_stride, tokens,
                            first_pos, k_cache + (int64_t)g * head_dim, v_cache + (int64_t)g * head_dim,
                            block_tables + (int64_t)s * table_width, block_size, token_stride,
                            context_lens[s], g * group, group, head_dim, scale,
                            out + (int64_t)(start + t0) * out_stride, out_stride, &scratch);
            }
        }
        free(scratch.peak);
        free(scratch.total);
        free(scratch.acc);
    }
    free(seq_of);
    free(tile_of);
    return failed ? -1 : 0;
}

#else

int paged_prefill_supported(void) { return 0; }

int paged_prefill_bf16(const uint16_t *query, int64_t query_stride, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int32_t *block_tables, int table_width,
                       const int32_t *query_start_loc, const int32_t *context_lens, uint16_t *out,
                       int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                       float scale) {
    (void)query, (void)query_stride, (void)k_cache, (void)v_cache, (void)block_tables;
    (void)table_width, (void)query_start_loc, (void)context_lens, (void)out, (void)num_seqs;
    (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale;
    return -2;
}

#endif
