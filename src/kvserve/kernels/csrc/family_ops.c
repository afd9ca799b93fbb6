/* The per-layer operations other model families add to Llama's: RMSNorm over each head
 * of q and k (Qwen3, Gemma 3), and GELU with the tanh approximation, gated (Gemma's
 * GeGLU) or not (GPT-2's MLP). One pass over the data each, as in elementwise.c (where
 * GPT-2's LayerNorm sits beside RMSNorm). */
#include <math.h>

#include "kernels.h"
#include "vec.h"

#define PARALLEL_MIN_ROWS 16

/* RMSNorm, in place, over each of num_heads heads of head_dim at the start of every row:
 * x: [T, row_stride]; weight: [head_dim], shared by the heads. */
void kv_head_rms_norm_f32(float *x, const float *weight, int64_t T, int64_t num_heads,
                          int64_t head_dim, int64_t row_stride, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T >= PARALLEL_MIN_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < num_heads; h++) {
            float *v = x + t * row_stride + h * head_dim;
            v8f squares = {0};
            int64_t d = 0;
            for (; d + 8 <= head_dim; d += 8) {
                const v8f e = v8f_load(v + d);
                squares += e * e;
            }
            float sum = v8f_sum(squares);
            for (; d < head_dim; d++) sum += v[d] * v[d];
            const float inv_rms = 1.0f / sqrtf(sum / (float)head_dim + eps);
            for (d = 0; d < head_dim; d++) v[d] = v[d] * inv_rms * weight[d];
        }
    }
}

/* gelu(x) = x / 2 * (1 + tanh(u)) with u = sqrt(2 / pi) * (x + 0.044715 x^3), written as
 * x / (1 + exp(-2u)): the same value, without the cancellation of 1 + tanh(u) for negative
 * x, where it would round small outputs to zero. */
static inline v8f v8f_gelu_tanh(v8f x) {
    const v8f u = v8f_splat(0.7978845608028654f) * (x + v8f_splat(0.044715f) * x * x * x);
    return x / (v8f_splat(1.0f) + v8f_exp(-(u + u)));
}

static inline float gelu_tanh(float x) {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x / (1.0f + expf(-2.0f * u));
}

/* out[t, i] = gelu(in[t, i]) * in[t, I + i] (gated; in: [T, 2 I]) or gelu(in[t, i])
 * (in: [T, I]); out: [T, I]. */
void kv_gelu_tanh_f32(const float *in, float *out, int64_t T, int64_t I, int gated,
                      int num_threads) {
    const int64_t in_stride = gated ? 2 * I : I;
#pragma omp parallel for num_threads(num_threads) if (T >= PARALLEL_MIN_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *x = in + t * in_stride, *up = x + I;
        float *o = out + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const v8f g = v8f_gelu_tanh(v8f_load(x + i));
            v8f_store(o + i, gated ? g * v8f_load(up + i) : g);
        }
        for (; i < I; i++) o[i] = gated ? gelu_tanh(x[i]) * up[i] : gelu_tanh(x[i]);
    }
}
