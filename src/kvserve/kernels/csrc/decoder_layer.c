/* Every Llama decoder layer of a decode step, in one call.
 *
 * At decode time a layer is ten small operations. Called one by one from Python,
 * each paid for a dispatch, a tensor allocation and a thread-pool wake-up; called
 * once per layer, the Python between layers still cost ~4 ms of a 30 ms batch-1
 * step (the interpreter's data is cold after each layer's 14 MB of weights). Here
 * one call runs the whole stack with its scratch space allocated once. Numerically
 * it is exactly the sequence of kernels the Python path calls. */
#include <stdlib.h>

#include "kernels.h"

/* Per-step inputs and shapes shared by every layer. */
typedef struct {
    const float *cos_sin;
    const int64_t *slot_mapping, *block_tables, *seq_lens;
    int64_t max_blocks, block_size, T, hidden_size, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    int weight_kind, kv_bf16, num_threads;
} StepShapes;

/* Scratch reused by every layer: the normed rows, qkv (then gate_up), the attention
 * output (then silu(gate) * up). */
typedef struct {
    float *normed, *wide, *narrow;
} Scratch;

static int linear(const StepShapes *s, const float *x, const void *w, const float *bias, float *y,
                  int64_t K, int64_t N) {
    switch (s->weight_kind) {
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

/* One layer. hidden: the previous layer's output, added to residual first (NULL for
 * the first layer, whose input residual already holds); out may alias hidden, which
 * is read before out is written. */
static int decode_layer(const KvDecodeLayer *l, const StepShapes *s, const Scratch *sc,
                        const float *hidden, float *residual, float *out) {
    const int64_t T = s->T, H = s->hidden_size, I = s->intermediate;
    const int64_t q_size = s->num_heads * s->head_dim, kv_size = s->num_kv_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    /* Attention block. */
    kv_add_rms_norm_f32(hidden ? hidden : residual, hidden ? residual : NULL, l->input_norm,
                        sc->normed, T, H, s->eps, s->num_threads);
    int status = linear(s, sc->normed, l->qkv, l->qkv_bias, sc->wide, H, qkv_size);
    if (status != 0) return status;
    kv_rotary_f32(sc->wide, s->cos_sin, T, s->num_heads + s->num_kv_heads, s->head_dim, qkv_size,
                  s->num_threads);
    kv_write_cache(sc->wide + q_size, sc->wide + q_size + kv_size, l->key_cache, l->value_cache,
                   s->kv_bf16, s->slot_mapping, T, kv_size, qkv_size, qkv_size, s->num_threads);
    status = kv_paged_decode(sc->wide, qkv_size, l->key_cache, l->value_cache, s->kv_bf16,
                             s->block_tables, s->seq_lens, sc->narrow, T, s->num_heads,
                             s->num_kv_heads, s->head_dim, s->block_size, s->max_blocks, s->scale, 0,
                             0.0f, s->num_threads);
    if (status != 0) return status;
    if ((status = linear(s, sc->narrow, l->o_proj, NULL, sc->normed, q_size, H)) != 0) return status;
    /* MLP block: residual += attention output, then norm. */
    kv_add_rms_norm_f32(sc->normed, residual, l->post_norm, sc->normed, T, H, s->eps, s->num_threads);
    if ((status = linear(s, sc->normed, l->gate_up, NULL, sc->wide, H, 2 * I)) != 0) return status;
    kv_silu_mul_f32(sc->wide, sc->narrow, T, I, s->num_threads);
    return linear(s, sc->narrow, l->down, NULL, out, I, H);
}

/* residual: [T, H], the embeddings on entry, the residual stream on return;
 * out: [T, H], the last layer's output (the final norm adds it to residual).
 * Returns 0, -1 when a kernel refuses its shapes or is not built for this CPU, -2 when out
 * of memory. */
int kv_llama_decode_layers(const KvDecodeLayer *layers, int64_t num_layers, float *residual,
                           float *out, float eps, int weight_kind, int kv_bf16, const float *cos_sin,
                           const int64_t *slot_mapping, const int64_t *block_tables,
                           const int64_t *seq_lens, int64_t max_blocks, int64_t block_size,
                           int64_t T, int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t intermediate, float scale, int num_threads) {
    const StepShapes s = {cos_sin,    slot_mapping, block_tables, seq_lens,     max_blocks,
                          block_size, T,            hidden_size,  num_heads,    num_kv_heads,
                          head_dim,   intermediate, eps,          scale,        weight_kind,
                          kv_bf16,    num_threads};
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
