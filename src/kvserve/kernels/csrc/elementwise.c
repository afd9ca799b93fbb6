/* The small per-layer operations of a decoder, each in one pass over its data.
 *
 * In eager PyTorch an RMSNorm is seven operators and a rotary embedding six,
 * each a separate pass and a separate dispatch; at decode batch sizes the
 * dispatches cost more than the arithmetic. One call each here. Work is
 * split across threads only when there are enough rows to pay for it. */
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "vec.h"

#define PARALLEL_MIN_ROWS 16

/* Row t of the norms' input: residual's row after residual += x, or x's row without a
 * residual stream. */
static inline const float *add_residual_row(const float *x, float *residual, int64_t t, int64_t D) {
    const float *src = x + t * D;
    if (residual == NULL) return src;
    float *r = residual + t * D;
    for (int64_t d = 0; d < D; d++) r[d] += src[d];
    return r;
}

/* residual += x (when residual is not NULL); out = residual * rsqrt(mean(residual^2) + eps) * weight.
 * Without residual the input x itself is normalised. x, residual, out: [T, D]; weight: [D]. */
void kv_add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                         int64_t T, int64_t D, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T >= PARALLEL_MIN_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *src = add_residual_row(x, residual, t, D);
        v8f squares = {0};
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            v8f v = v8f_load(src + d);
            squares += v * v;
        }
        float sum = v8f_sum(squares);
        for (; d < D; d++) sum += src[d] * src[d];
        const float inv_rms = 1.0f / sqrtf(sum / (float)D + eps);
        float *o = out + t * D;
        for (d = 0; d < D; d++) o[d] = src[d] * inv_rms * weight[d];
    }
}

/* residual += x (when residual is not NULL); out = (r - mean(r)) / sqrt(var(r) + eps) * weight
 * + bias, where r is the updated residual (or x itself without one) and var the biased
 * variance, both in two passes as PyTorch's LayerNorm. x, residual, out: [T, D]; weight,
 * bias: [D] (bias may be NULL). out may alias x. */
void kv_add_layer_norm_f32(const float *x, float *residual, const float *weight,
                           const float *bias, float *out, int64_t T, int64_t D, float eps,
                           int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T >= PARALLEL_MIN_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *src = add_residual_row(x, residual, t, D);
        v8f sums = {0};
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) sums += v8f_load(src + d);
        float sum = v8f_sum(sums);
        for (; d < D; d++) sum += src[d];
        const float mean = sum / (float)D;
        v8f squares = {0};
        const v8f mean_v = v8f_splat(mean);
        for (d = 0; d + 8 <= D; d += 8) {
            const v8f c = v8f_load(src + d) - mean_v;
            squares += c * c;
        }
        float square_sum = v8f_sum(squares);
        for (; d < D; d++) square_sum += (src[d] - mean) * (src[d] - mean);
        const float inv_std = 1.0f / sqrtf(square_sum / (float)D + eps);
        float *o = out + t * D;
        for (d = 0; d < D; d++) o[d] = (src[d] - mean) * inv_std * weight[d] + (bias ? bias[d] : 0.0f);
    }
}

/* Rotary embedding (rotate-half layout), in place, on the first num_heads heads of each row.
 * x: [T, row_stride] with heads of head_dim at the start of each row;
 * cos_sin: [T, 2, head_dim], the cosines then the sines of each row's position. */
void kv_rotary_f32(float *x, const float *cos_sin, int64_t T, int64_t num_heads, int64_t head_dim,
                   int64_t row_stride, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (T >= PARALLEL_MIN_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *cos = cos_sin + t * 2 * head_dim, *sin = cos + head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float *lo = x + t * row_stride + h * head_dim, *hi = lo + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = lo[i], b = hi[i];
                lo[i] = a * cos[i] - b * sin[i];
                hi[i] = b * cos[half + i] + a * sin[half + i];
            }
        }
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]; gate_up: [T, 2 I], out: [T, I]. */
void kv_silu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T >= PARALLEL_MIN_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *gate = gate_up + t * 2 * I, *up = gate + I;
        float *o = out + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            v8f g = v8f_load(gate + i);
            v8f_store(o + i, g / (v8f_splat(1.0f) + v8f_exp(-g)) * v8f_load(up + i));
        }
        for (; i < I; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* float32 to bfloat16, rounding to nearest even as PyTorch's conversion does (NaN stays a
 * quiet NaN). Plain integer arithmetic, so it vectorises on any x86-64 or Arm CPU. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static void store_row(void *cache, int64_t slot, const float *src, int64_t row_len, int bf16) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)cache + slot * row_len;
        for (int64_t i = 0; i < row_len; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + slot * row_len, src, sizeof(float) * row_len);
    }
}

/* Store each token's K and V rows at its slot of the paged pool.
 * key, value: float32 rows of row_len, key_stride and value_stride apart;
 * key_cache, value_cache: [num_slots, row_len], float32 or (kv_bf16) bfloat16; slot_mapping: [T],
 * each in [0, num_slots): trusted here, checked by the Python wrappers (kernels/bounds.py). */
void kv_write_cache(const float *key, const float *value, void *key_cache, void *value_cache,
                    int kv_bf16, const int64_t *slot_mapping, int64_t T, int64_t row_len,
                    int64_t key_stride, int64_t value_stride, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T >= 4 * PARALLEL_MIN_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        store_row(key_cache, slot_mapping[t], key + t * key_stride, row_len, kv_bf16);
        store_row(value_cache, slot_mapping[t], value + t * value_stride, row_len, kv_bf16);
    }
}
