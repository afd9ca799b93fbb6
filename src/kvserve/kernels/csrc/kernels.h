/* The kernels' entry points: called from Python through ctypes, and from each other. */
#ifndef KVSERVE_KERNELS_H
#define KVSERVE_KERNELS_H

#include <stdint.h>

void kv_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t M,
                   int64_t K, int64_t N, int num_threads);
void kv_linear_bf16w(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M,
                     int64_t K, int64_t N, int num_threads);
/* 1 when built with AVX512-BF16 (then kv_linear_bf16_dot runs), else 0. */
int kv_has_bf16_dot(void);
int kv_linear_bf16_dot(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M,
                       int64_t K, int64_t N, int num_threads);
int kv_paged_decode(const float *query, int64_t query_stride, const void *key_cache,
                    const void *value_cache, int kv_bf16, const int64_t *block_tables,
                    const int64_t *seq_lens, float *out, int64_t num_seqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                    float scale, int64_t window, float soft_cap, int num_threads);
void kv_add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                         int64_t T, int64_t D, float eps, int num_threads);
void kv_rotary_f32(float *x, const float *cos_sin, int64_t T, int64_t num_heads, int64_t head_dim,
                   int64_t row_stride, int num_threads);
void kv_silu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I, int num_threads);
void kv_write_cache(const float *key, const float *value, void *key_cache, void *value_cache,
                    int kv_bf16, const int64_t *slot_mapping, int64_t T, int64_t row_len,
                    int64_t key_stride, int64_t value_stride, int num_threads);

/* How a decoder layer's linear weights are stored and multiplied. */
enum {
    KV_WEIGHTS_F32 = 0,      /* float32 */
    KV_WEIGHTS_BF16_WIDEN = 1, /* bfloat16, widened to float32 as streamed (any CPU) */
    KV_WEIGHTS_BF16_DOT = 2, /* bfloat16, AVX512-BF16 dot products */
};

/* One decoder layer's weights (float32, or bfloat16 linear weights) and its slice of the
 * KV pool (key_cache, value_cache: [num_slots, num_kv_heads * head_dim], float32 or
 * bfloat16). */
typedef struct {
    const float *input_norm, *post_norm;
    const void *qkv, *o_proj, *gate_up, *down;
    const float *qkv_bias; /* or NULL */
    void *key_cache, *value_cache;
} KvDecodeLayer;

int kv_llama_decode_layers(const KvDecodeLayer *layers, int64_t num_layers, float *residual,
                           float *out, float eps, int weight_kind, int kv_bf16, const float *cos_sin,
                           const int64_t *slot_mapping, const int64_t *block_tables,
                           const int64_t *seq_lens, int64_t max_blocks, int64_t block_size,
                           int64_t T, int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t intermediate, float scale, int num_threads);

#endif
