/* Every decoder layer of a decode step, in one call.
 *
 * At decode time a layer is ten small operations. Called one by one from Python,
 * each paid for a dispatch, a tensor allocation and a thread-pool wake-up; called
 * once per layer, the Python between layers still cost ~4 ms of a 30 ms batch-1
 * step (the interpreter's data is cold after each layer's 14 MB of weights). Here
 * one call runs the whole stack with its scratch space allocated once. Numerically
 * it is exactly the sequence of kernels the Python path calls.
 *
 * One layer shape covers the families: a pre-norm attention block and a pre-norm MLP
 * block on a residual stream, with optional parts (LayerNorm biases, post-norms,
 * q/k norms, biases, RoPE, sliding windows, soft-capping) switched on per layer. */
#include <stdlib.h>

#include "kernels.h"

/* Per-step inputs and shapes shared by every layer. */
typedef struct {
    const float *const *rope_tables;
    const int64_t *const *slot_mappings, *const *block_tables, *max_blocks, *seq_lens;
    int64_t block_size, T, hidden_size, num_heads, num_kv_heads, head_dim, intermediate;
    float eps;
    int norm_kind, act_kind, kv_bf16, num_threads;
} StepShapes;

/* Scratch reused by every layer: the normed rows, qkv (then gate_up), the attention
 * output (then the activation's). */
typedef struct {
    float *normed, *wide, *narrow;
} Scratch;

/* y [T, N] = x [T, K] @ w^T (+ bias), w stored as kind says (a quantized weight knows its
 * N: the sum of its segments' rows, checked against the layer's shape in Python). */
static int linear(const StepShapes *s, int64_t kind, const float *x, const void *w,
                  const float *bias, float *y, int64_t K, int64_t N) {
    switch (kind) {
        case KV_WEIGHTS_QUANT:
            return kv_linear_quant(x, (const KvQuantWeight *)w, bias, y, s->T, K, s->num_threads);
        case KV_WEIGHTS_BF16_DOT:
            return kv_linear_bf16_dot(x, (const uint16_t *)w, bias, y, s->T, K, N, s->num_threads);
        case KV_WEIGHTS_BF16_WIDEN:
            kv_linear_bf16w(x, (const uint16_t *)w, bias, y, s->T, K, N, s->num_threads);
            return 0;
        default:
            kv_linear_f32(x, (const float *)w, bias, y, s->T, K, N, s->num_threads);
            return 0;
    }
}

/* residual += x (when residual is not NULL), then out = the stack's norm of it. */
static void norm(const StepShapes *s, const float *x, float *residual, const float *weight,
                 const float *bias, float *out) {
    if (s->norm_kind == KV_NORM_LAYER)
        kv_add_layer_norm_f32(x, residual, weight, bias, out, s->T, s->hidden_size, s->eps,
                              s->num_threads);
    else
        kv_add_rms_norm_f32(x, residual, weight, out, s->T, s->hidden_size, s->eps, s->num_threads);
}

/* One layer. hidden: the previous layer's output, added to residual first (NULL for
 * the first layer, whose input residual already holds); out may alias hidden, which
 * is read before out is written. */
static int decode_layer(const KvDecodeLayer *l, const StepShapes *s, const Scratch *sc,
                        const float *hidden, float *residual, float *out) {
    const int64_t T = s->T, H = s->hidden_size, I = s->intermediate, D = s->head_dim;
    const int64_t q_size = s->num_heads * D, kv_size = s->num_kv_heads * D;
    const int64_t qkv_size = q_size + 2 * kv_size;
    /* Attention block. */
    norm(s, hidden ? hidden : residual, hidden ? residual : NULL, l->input_norm, l->input_norm_bias,
         sc->normed);
    int status = linear(s, l->weight_kinds[0], sc->normed, l->qkv, l->qkv_bias, sc->wide, H, qkv_size);
    if (status != 0) return status;
    if (l->q_norm) kv_head_rms_norm_f32(sc->wide, l->q_norm, T, s->num_heads, D, qkv_size, s->eps, s->num_threads);
    if (l->k_norm)
        kv_head_rms_norm_f32(sc->wide + q_size, l->k_norm, T, s->num_kv_heads, D, qkv_size, s->eps,
                             s->num_threads);
    if (l->rope_table >= 0)
        kv_rotary_f32(sc->wide, s->rope_tables[l->rope_table], T, s->num_heads + s->num_kv_heads, D,
                      qkv_size, s->num_threads);
    const int64_t g = l->kv_group;
    kv_write_cache(sc->wide + q_size, sc->wide + q_size + kv_size, l->key_cache, l->value_cache,
                   s->kv_bf16, s->slot_mappings[g], T, kv_size, qkv_size, qkv_size, s->num_threads);
    status = kv_paged_decode(sc->wide, qkv_size, l->key_cache, l->value_cache, s->kv_bf16,
                             s->block_tables[g], s->seq_lens, sc->narrow, T, s->num_heads,
                             s->num_kv_heads, D, s->block_size, s->max_blocks[g], l->scale,
                             l->window, l->soft_cap, s->num_threads);
    if (status != 0) return status;
    if ((status = linear(s, l->weight_kinds[1], sc->narrow, l->o_proj, l->o_bias, sc->normed, q_size, H)) != 0) return status;
    if (l->attn_out_norm) norm(s, sc->normed, NULL, l->attn_out_norm, NULL, sc->normed);
    /* MLP block: residual += attention output, then norm. */
    norm(s, sc->normed, residual, l->post_norm, l->post_norm_bias, sc->normed);
    const int gated = s->act_kind != KV_ACT_GELU_TANH;
    if ((status = linear(s, l->weight_kinds[2], sc->normed, l->gate_up, l->gate_up_bias, sc->wide, H, gated ? 2 * I : I)) != 0)
        return status;
    if (s->act_kind == KV_ACT_SILU_MUL)
        kv_silu_mul_f32(sc->wide, sc->narrow, T, I, s->num_threads);
    else
        kv_gelu_tanh_f32(sc->wide, sc->narrow, T, I, gated, s->num_threads);
    if ((status = linear(s, l->weight_kinds[3], sc->narrow, l->down, l->down_bias, out, I, H)) != 0) return status;
    if (l->mlp_out_norm) norm(s, out, NULL, l->mlp_out_norm, NULL, out);
    return 0;
}

/* residual: [T, H], the embeddings on entry, the residual stream on return;
 * out: [T, H], the last layer's output (the final norm adds it to residual).
 * rope_tables: the step's RoPE tables, each [T, 2, head_dim]; slot_mappings, block_tables
 * (rows max_blocks[g] apart): per KV cache group (layers pick theirs); seq_lens: shared.
 * Returns 0, -1 when a kernel refuses its shapes or is not built for this CPU, -2 when out
 * of memory. */
int kv_decode_layers(const KvDecodeLayer *layers, int64_t num_layers, float *residual, float *out,
                     int norm_kind, int act_kind, float eps, int kv_bf16,
                     const float *const *rope_tables, const int64_t *const *slot_mappings,
                     const int64_t *const *block_tables, const int64_t *max_blocks,
                     const int64_t *seq_lens, int64_t block_size, int64_t T, int64_t hidden_size, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                     int num_threads) {
    const StepShapes s = {rope_tables, slot_mappings, block_tables, max_blocks,   seq_lens,
                          block_size,  T,             hidden_size,  num_heads,    num_kv_heads,
                          head_dim,    intermediate,  eps,          norm_kind,    act_kind,
                          kv_bf16,     num_threads};
    const int64_t q_size = num_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * num_kv_heads * head_dim;
    const int64_t widest = qkv_size > 2 * intermediate ? qkv_size : 2 * intermediate;
    const Scratch sc = {malloc(sizeof(float) * T * hidden_size), malloc(sizeof(float) * T * widest),
                        malloc(sizeof(float) * T * (q_size > intermediate ? q_size : intermediate))};
    int status = (sc.normed && sc.wide && sc.narrow) ? 0 : -2;
    for (int64_t i = 0; i < num_layers && status == 0; i++)
        status = decode_layer(&layers[i], &s, &sc, i == 0 ? NULL : out, residual, out);
    free(sc.normed);
    free(sc.wide);
    free(sc.narrow);
    return status;
}
