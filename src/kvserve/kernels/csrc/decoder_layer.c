/* A whole Llama decoder layer for a decode step, in one call.
 *
 * At decode time a layer is ten small operations; called one by one from Python,
 * each pays for a dispatch, a tensor allocation and a thread-pool wake-up, which at
 * batch 1 added up to a quarter of the step. Here the same kernels run back to back
 * with the layer's scratch space allocated once per call. Numerically it is exactly
 * the sequence of kernels the Python path calls. */
#include <stdlib.h>

#include "kernels.h"

/* The layer's weights (float32, or bfloat16 linear weights when weights_bf16). */
typedef struct {
    const float *input_norm, *post_norm;
    const void *qkv, *o_proj, *gate_up, *down;
    const float *qkv_bias; /* or NULL */
    float eps;
    int weights_bf16;
} LayerWeights;

static void linear(const LayerWeights *lw, const float *x, const void *w, const float *bias,
                   float *y, int64_t M, int64_t K, int64_t N, int num_threads) {
    if (lw->weights_bf16)
        kv_linear_bf16w(x, (const uint16_t *)w, bias, y, M, K, N, num_threads);
    else
        kv_linear_f32(x, (const float *)w, bias, y, M, K, N, num_threads);
}

/* hidden: [T, H], the previous layer's output (ignored when add_residual is 0: then
 * residual already holds this layer's input); residual: [T, H], updated in place;
 * out: [T, H], this layer's output. Returns 0, -1 when the attention kernel refuses
 * its shapes, -2 when out of memory. */
int kv_llama_decode_layer(const float *hidden, float *residual, int add_residual, float *out,
                          const float *input_norm, const float *post_norm, float eps,
                          const void *qkv_w, const float *qkv_bias, const void *o_w,
                          const void *gate_up_w, const void *down_w, int weights_bf16,
                          const float *cos_sin, float *key_cache, float *value_cache,
                          const int64_t *slot_mapping, const int64_t *block_tables,
                          const int64_t *seq_lens, int64_t max_blocks, int64_t block_size,
                          int64_t T, int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t intermediate, float scale, int num_threads) {
    const LayerWeights lw = {input_norm, post_norm, qkv_w, o_w, gate_up_w, down_w, qkv_bias, eps, weights_bf16};
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const int64_t widest = qkv_size > 2 * intermediate ? qkv_size : 2 * intermediate;
    float *normed = malloc(sizeof(float) * T * hidden_size);
    float *wide = malloc(sizeof(float) * T * widest);         /* qkv, then gate_up */
    float *narrow = malloc(sizeof(float) * T * (q_size > intermediate ? q_size : intermediate));
    int status = (normed && wide && narrow) ? 0 : -2;
    if (status == 0) {
        /* Attention block. */
        kv_add_rms_norm_f32(add_residual ? hidden : residual, add_residual ? residual : NULL,
                            input_norm, normed, T, hidden_size, eps, num_threads);
        linear(&lw, normed, qkv_w, qkv_bias, wide, T, hidden_size, qkv_size, num_threads);
        kv_rotary_f32(wide, cos_sin, T, num_heads + num_kv_heads, head_dim, qkv_size, num_threads);
        kv_write_cache_f32(wide + q_size, wide + q_size + kv_size, key_cache, value_cache,
                           slot_mapping, T, kv_size, qkv_size, qkv_size, num_threads);
        status = kv_paged_decode_f32(wide, qkv_size, key_cache, value_cache, block_tables, seq_lens,
                                     narrow, T, num_heads, num_kv_heads, head_dim, block_size,
                                     max_blocks, scale, num_threads);
    }
    if (status == 0) {
        linear(&lw, narrow, o_w, NULL, normed, T, q_size, hidden_size, num_threads);
        /* MLP block: residual += attention output, then norm. */
        kv_add_rms_norm_f32(normed, residual, post_norm, normed, T, hidden_size, eps, num_threads);
        linear(&lw, normed, gate_up_w, NULL, wide, T, hidden_size, 2 * intermediate, num_threads);
        kv_silu_mul_f32(wide, narrow, T, intermediate, num_threads);
        linear(&lw, narrow, down_w, NULL, out, T, intermediate, hidden_size, num_threads);
    }
    free(normed);
    free(wide);
    free(narrow);
    return status;
}
