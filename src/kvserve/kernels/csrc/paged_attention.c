/* Decode attention straight from the paged KV pool: one query token per sequence.
 *
 * Each (sequence, KV head) pair is one unit of work: the pair's keys are read
 * in place, block by block through the sequence's block table, scored against
 * all the query heads that share the KV head (grouped-query attention), then
 * the values are read once and summed with the softmax weights. Nothing is
 * gathered or padded, so a step reads each live KV entry exactly once. */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"
#include "vec.h"


static inline float dot_scaled(const float *a, const float *b, int64_t n, float scale) {
    /* Two accumulators halve the dependency chain of the fused multiply-adds. */
    v8f acc0 = {0}, acc1 = {0};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        acc0 += v8f_load(a + d) * v8f_load(b + d);
        acc1 += v8f_load(a + d + 8) * v8f_load(b + d + 8);
    }
    if (d < n) acc0 += v8f_load(a + d) * v8f_load(b + d);
    return v8f_sum(acc0 + acc1) * scale;
}

/* One sequence, all heads: its K/V rows are read block by block in slot order, each once.
 * Loops run over blocks, then slots, then KV heads and their query heads, so no index
 * needs a division in the inner loops. */
static void attend_sequence(const float *q, const float *key_cache, const float *value_cache,
                            const int64_t *block_table, int64_t seq_len, float *out, float *scores,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    /* scores[head * seq_len + t] = scale * q_head . k_t */
    for (int64_t j = 0; j < num_blocks; j++) {
        const float *block = key_cache + block_table[j] * block_size * token_stride;
        const int64_t first = j * block_size, count = min_i64(block_size, seq_len - first);
        for (int64_t i = 0; i < count; i++) {
            const float *k = block + i * token_stride;
            for (int64_t kv_head = 0, head = 0; kv_head < num_kv_heads; kv_head++, k += head_dim)
                for (int64_t g = 0; g < group; g++, head++)
                    scores[head * seq_len + first + i] = dot_scaled(q + head * head_dim, k, head_dim, scale);
        }
    }
    /* Softmax numerators in place; their sums normalise at the end. */
    float row_sum[num_heads];
    for (int64_t head = 0; head < num_heads; head++) {
        float *s = scores + head * seq_len;
        float row_max = -INFINITY;
        for (int64_t t = 0; t < seq_len; t++) row_max = s[t] > row_max ? s[t] : row_max;
        v8f m = v8f_splat(row_max), total = {0};
        int64_t t = 0;
        for (; t + 8 <= seq_len; t += 8) {
            v8f e = v8f_exp(v8f_load(s + t) - m);
            v8f_store(s + t, e);
            total += e;
        }
        float sum = v8f_sum(total);
        for (; t < seq_len; t++) {
            s[t] = expf(s[t] - row_max);
            sum += s[t];
        }
        row_sum[head] = sum;
    }
    /* Weighted sum of the values, head by head, 32 (or 8) dimensions at a time held in
     * registers across the whole sequence; the rows come from L1/L2 after the first head. */
    for (int64_t kv_head = 0, head = 0; kv_head < num_kv_heads; kv_head++) {
        for (int64_t g = 0; g < group; g++, head++) {
            const float *p = scores + head * seq_len;
            const float inv = 1.0f / row_sum[head];
            for (int64_t d0 = 0; d0 < head_dim;) {
                const int wide = d0 + 32 <= head_dim;
                v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int64_t j = 0; j < num_blocks; j++) {
                    const float *v = value_cache + block_table[j] * block_size * token_stride + kv_head * head_dim + d0;
                    const int64_t first = j * block_size, count = min_i64(block_size, seq_len - first);
                    for (int64_t i = 0; i < count; i++, v += token_stride) {
                        const v8f weight = v8f_splat(p[first + i]);
                        a0 += weight * v8f_load(v);
                        if (wide) {
                            a1 += weight * v8f_load(v + 8);
                            a2 += weight * v8f_load(v + 16);
                            a3 += weight * v8f_load(v + 24);
                        }
                    }
                }
                float *o = out + head * head_dim + d0;
                const v8f scale_out = v8f_splat(inv);
                v8f_store(o, a0 * scale_out);
                if (wide) {
                    v8f_store(o + 8, a1 * scale_out);
                    v8f_store(o + 16, a2 * scale_out);
                    v8f_store(o + 24, a3 * scale_out);
                }
                d0 += wide ? 32 : 8;
            }
        }
    }
}

/* query: [num_seqs, num_heads, head_dim] with rows query_stride floats apart; out: [num_seqs,
 * num_heads, head_dim] contiguous; key_cache, value_cache: [num_blocks, block_size,
 * num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks]; seq_lens: [num_seqs], each >= 1.
 * head_dim must be a multiple of 8.
 * Returns 0; -1 when the shapes are outside what the kernel handles, -2 when out of memory. */
int kv_paged_decode_f32(const float *query, int64_t query_stride, const float *key_cache,
                        const float *value_cache, const int64_t *block_tables,
                        const int64_t *seq_lens, float *out, int64_t num_seqs, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t max_blocks, float scale, int num_threads) {
    if (head_dim % 8 != 0 || num_heads % num_kv_heads != 0)
        return -1;
    int64_t longest = 1;
    for (int64_t b = 0; b < num_seqs; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * num_heads * longest);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_seqs; b++) {
            if (scores == NULL) continue;
            attend_sequence(query + b * query_stride, key_cache, value_cache,
                            block_tables + b * max_blocks, seq_lens[b],
                            out + b * num_heads * head_dim, scores, num_heads, num_kv_heads,
                            head_dim, block_size, scale);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
