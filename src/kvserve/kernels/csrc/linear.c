/* y = x @ w^T (+ bias) for few rows of x: the decode-time linear layer.
 *
 * With a handful of rows a linear layer is bound by streaming the weight from
 * memory, and BLAS libraries tuned for large products lose much of that
 * bandwidth to packing and blocking meant for many rows. Here each thread
 * walks its share of weight rows once, four at a time, and multiplies them
 * with every row of x while they sit in L1. */
#include "vec.h"

#define TILE_N 4
#define PANEL_N 12 /* weight rows a thread takes at a time: three 4-row or four 3-row tiles */

static inline float bias_at(const float *bias, int64_t n) { return bias ? bias[n] : 0.0f; }

/* float32 weights: kv_linear_f32. */
#define WEIGHT_T float
#define LOAD_W v8f_load
#define SCALAR_W(v) (v)
#define FN(name) name##_f32
#include "linear_impl.h"
#undef WEIGHT_T
#undef LOAD_W
#undef SCALAR_W
#undef FN

/* bfloat16 weights, float32 arithmetic: kv_linear_bf16w. Half the bytes to stream, so
 * decode (bound by reading the weights) runs up to twice as fast on CPUs without
 * bf16 arithmetic; each weight widens exactly to float32 in registers. */
#define WEIGHT_T uint16_t
#define LOAD_W v8bf16_load
#define SCALAR_W(v) bf16_to_f32(v)
#define FN(name) name##_bf16w
#include "linear_impl.h"
