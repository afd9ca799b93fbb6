/* The kernels' entry points: called from Python through ctypes, and from each other. */
#ifndef KVSERVE_KERNELS_H
#define KVSERVE_KERNELS_H

#include <stdint.h>

#include "quant.h"

void kv_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t M,
                   int64_t K, int64_t N, int num_threads);
void kv_linear_bf16w(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M,
                     int64_t K, int64_t N, int num_threads);
/* 1 when built with AVX512-BF16 (then kv_linear_bf16_dot runs), else 0. */
int kv_has_bf16_dot(void);
int kv_linear_bf16_dot(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M,
                       int64_t K, int64_t N, int num_threads);
/* How the paged KV pool is stored and read (kv_bf16 below; any nonzero value is a bf16 pool). */
enum {
    KV_POOL_F32 = 0,      /* float32 */
    KV_POOL_BF16 = 1,     /* bfloat16, widened to float32 as read (any CPU) */
    KV_POOL_BF16_DOT = 2, /* bfloat16, AVX512-BF16 dot products (paged_attention_dot.h) */
};

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
int kv_encoder_attention(const float *qkv, float *out, const int64_t *starts, const int64_t *lens,
                         int64_t num_seqs, int64_t H, int64_t D, float scale, int num_threads);
void kv_write_cache(const float *key, const float *value, void *key_cache, void *value_cache,
                    int kv_bf16, const int64_t *slot_mapping, int64_t T, int64_t row_len,
                    int64_t key_stride, int64_t value_stride, int num_threads);

void kv_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out, int num_threads);

/* How a decoder layer's linear weight is stored and multiplied (each linear its own). */
enum {
    KV_WEIGHTS_F32 = 0,      /* float32 */
    KV_WEIGHTS_BF16_WIDEN = 1, /* bfloat16, widened to float32 as streamed (any CPU) */
    KV_WEIGHTS_BF16_DOT = 2, /* bfloat16, AVX512-BF16 dot products */
    KV_WEIGHTS_QUANT = 3,    /* GGUF blocks: the pointer is a const KvQuantWeight * (quant.h) */
};

void kv_add_layer_norm_f32(const float *x, float *residual, const float *weight,
                           const float *bias, float *out, int64_t T, int64_t D, float eps,
                           int num_threads);
void kv_head_rms_norm_f32(float *x, const float *weight, int64_t T, int64_t num_heads,
                          int64_t head_dim, int64_t row_stride, float eps, int num_threads);
void kv_gelu_tanh_f32(const float *in, float *out, int64_t T, int64_t I, int gated,
                      int num_threads);

/* The norm every layer of a stack uses, and its MLP's activation. */
enum { KV_NORM_RMS = 0, KV_NORM_LAYER = 1 };
enum { KV_ACT_SILU_MUL = 0, KV_ACT_GELU_TANH_MUL = 1, KV_ACT_GELU_TANH = 2 };

/* One decoder layer: its weights (float32 norms and biases; linear weights as their
 * weight_kinds say) and its slice of the KV pool (key_cache, value_cache: [num_slots, num_kv_heads *
 * head_dim], float32 or bfloat16). Optional parts are NULL (or 0) when the family lacks them. */
typedef struct {
    /* Norms before attention and before the MLP (biases: LayerNorm only), and after the
     * attention and after the MLP (Gemma's post-norms). */
    const float *input_norm, *input_norm_bias, *post_norm, *post_norm_bias;
    const float *attn_out_norm, *mlp_out_norm;
    /* RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3). */
    const float *q_norm, *k_norm;
    /* gate_up: gate and up fused (gated activations) or the up projection alone; each
     * stored as its weight_kinds entry says. */
    const void *qkv, *o_proj, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    void *key_cache, *value_cache;
    int64_t kv_group;   /* which of the step's block tables and slot mappings it uses */
    int64_t rope_table; /* which of the step's RoPE tables rotates q and k; -1: none */
    int64_t window;     /* sliding window; 0: none */
    /* KV_WEIGHTS_* of qkv, o_proj, gate_up, down: a GGUF file may quantize some of a
     * layer's projections and not others, or in different types. */
    int64_t weight_kinds[4];
    float scale, soft_cap; /* soft_cap 0: none */
} KvDecodeLayer;

int kv_decode_layers(const KvDecodeLayer *layers, int64_t num_layers, float *residual, float *out,
                     int norm_kind, int act_kind, float eps, int kv_bf16,
                     const float *const *rope_tables, const int64_t *const *slot_mappings,
                     const int64_t *const *block_tables, const int64_t *max_blocks,
                     const int64_t *seq_lens, int64_t block_size, int64_t T, int64_t hidden_size, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                     int num_threads);

#endif
