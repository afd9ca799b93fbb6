/* Quantized linear weights as GGUF stores them, multiplied without dequantizing them first.
 *
 * A quantized weight is read in GGUF's own layout: each row of K inputs is K / block
 * consecutive blocks of its type (ggml's block_q8_0, block_q4_K, ...), rows one after
 * another. A fused projection (qkv, gate_up) may hold pieces of different types (a
 * Q4_K_M file stores attn_v in Q6_K or Q8_0 beside a Q4_K or Q5_0 attn_q), so a weight is
 * up to KV_QUANT_MAX_SEGMENTS segments of rows, each with its own type.
 *
 * Activations are quantized once per call to KvQ8Block rows (32 values each, for every
 * type: the 32-value sub-blocks of the K-quants line up with them), and every segment
 * reads the same quantized rows. */
#ifndef KVSERVE_QUANT_H
#define KVSERVE_QUANT_H

#include <stdint.h>

/* ggml's type numbers (GGMLQuantizationType in the gguf package). */
enum {
    KV_GGML_Q4_0 = 2,
    KV_GGML_Q4_1 = 3,
    KV_GGML_Q5_0 = 6,
    KV_GGML_Q5_1 = 7,
    KV_GGML_Q8_0 = 8,
    KV_GGML_Q4_K = 12,
    KV_GGML_Q5_K = 13,
    KV_GGML_Q6_K = 14,
    /* Not a GGUF type: Q4_K blocks with their quants reordered for the dot product
     * (kv_q4_k_repack_rows in quant_k.h); same size, same values. */
    KV_Q4_K_R = 112,
    /* Q6_K blocks with their quants and scales reordered the same way for 16-value
     * sub-blocks (kv_q6_k_repack_rows in quant_k.h); same size, same values. */
    KV_Q6_K_R = 113,
    /* Not GGUF types: block-32 rows interleaved eight at a time (the "x8" layout,
     * kv_q32_x8_repack_rows below); same size, same values. */
    KV_Q4_0_X8 = 122,
    KV_Q4_1_X8 = 123,
    KV_Q5_0_X8 = 126,
    KV_Q5_1_X8 = 127,
    KV_Q8_0_X8 = 128,
};

/* The x8 layout: a group of eight rows (8 * row bytes, where the eight rows were) holds,
 * for each block b in order, the eight rows' blocks b field by field: the eight scales d
 * (IEEE halves), the Q4_1/Q5_1 minimums, the Q5 types' 32-bit fifth bits, then the
 * quants four bytes at a time, row by row. In general the field at byte `at` of a GGUF
 * block (2 bytes for d and m, 4 for qh and for each run of four quant bytes) lies at
 * 8 * at of the x8 block, row j's at 8 * at + j * size: for the quants, bytes 4c .. 4c + 3
 * of row j's at 8 * qs + 32c + 4j. A 32-byte load then holds the same four quant bytes
 * of eight rows, each 32-bit lane one row's, and one integer dot product against four
 * activations (broadcast to every lane) adds to all eight rows' sums at once: no sums
 * across lanes, and one activation row reads eight weight rows. */
#define KV_X8_OFFSET 120
/* 1 where this build multiplies the x8 layout (x86 with AVX2); 0: keep GGUF's. */
int kv_q32_x8_pays(void);
/* rows (a multiple of 8) rows of K values of a block-32 type at src, in GGUF's
 * layout, written in the x8 layout to dst (as many bytes). Returns 0, or -1 when type,
 * rows or K do not fit. */
int kv_q32_x8_repack_rows(int64_t type, const uint8_t *src, int64_t rows, int64_t K,
                          uint8_t *dst, int num_threads);
/* Row r of x8-layout data (type: its KV_*_X8 id) in GGUF's layout, written to out
 * (kv_quant_row_bytes(type, K) bytes). */
void kv_q32_x8_row(int64_t type, const uint8_t *data, int64_t r, int64_t K, uint8_t *out);

#define KV_QUANT_MAX_SEGMENTS 4

typedef struct {
    int64_t type; /* KV_GGML_* */
    int64_t rows;
    const uint8_t *data; /* rows * kv_quant_row_bytes(type, K) bytes, GGUF layout */
} KvQuantSegment;

typedef struct {
    int64_t num_segments;
    KvQuantSegment seg[KV_QUANT_MAX_SEGMENTS];
} KvQuantWeight;

/* 32 activations: q[i] * d approximates x[i]; s = d * (q[0] + ... + q[31]), for the
 * formats with a per-block minimum or offset. */
typedef struct {
    float d, s;
    int8_t q[32];
} KvQ8Block;

/* Bytes of one row of K values of type, or 0 where the type is not supported or K is
 * not a whole number of its blocks. */
int64_t kv_quant_row_bytes(int64_t type, int64_t K);

/* Eight KvQ8Blocks (one super-block of 256 activations) laid out for KV_Q4_K_R weights:
 * 32-bit word j of group k of q is word k of block j's quants (values 4k .. 4k + 3 of
 * block j); d and s are the blocks' scales and sums. */
typedef struct {
    int8_t q[256];
    float d[8], s[8];
} KvQ8T;

void kv_q8_transpose(const KvQ8Block *xb, KvQ8T *out);

/* Eight KvQ8Blocks laid out for KV_Q6_K_R weights, whose 32-bit lanes sum 16-value
 * sub-blocks in the order [0 2 4 6 1 3 5 7] (group G < 4) and [8 10 12 14 9 11 13 15]
 * (G >= 4), the order Q6_K's stored-layout kernel adds them in: word i of group G is
 * values 4 (G % 4) .. 4 (G % 4) + 3 of sub-block 8 (G / 4) + (0, 2, 4, 6, 1, 3, 5, 7)[i].
 * d[8h + i]: the scale of the block that sub-block lies in; o[8h + i]: -32 times the sum
 * of its 16 quants (the stored quants are 32 above their values). */
typedef struct {
    int8_t q[256];
    float d[16];
    int32_t o[16];
} KvQ8T16;

void kv_q8_transpose16(const KvQ8Block *xb, KvQ8T16 *out);

/* x: [M, K] float32 (K a multiple of 32) -> out: M rows of K / 32 blocks. */
void kv_quantize_q8(const float *x, int64_t M, int64_t K, KvQ8Block *out, int num_threads);

/* y[m * ldy + n] = dot(x row m, weight row n) for n0 <= n < n1 and every m < M, one
 * thread; xq: M rows of K / 32 blocks; w: the segment's data (row 0). Block-32 types
 * (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are quant.c's, the K-quants quant_k.c's. */
void kv_q32_dot_rows(int64_t type, const KvQ8Block *xq, int64_t M, int64_t K, const uint8_t *w,
                     int64_t n0, int64_t n1, float *y, int64_t ldy);
void kv_qk_dot_rows(int64_t type, const KvQ8Block *xq, int64_t M, int64_t K, const uint8_t *w,
                    int64_t n0, int64_t n1, float *y, int64_t ldy);
/* The same, with xt and xt16: xq's rows transposed by kv_q8_transpose and
 * kv_q8_transpose16 (M rows of K / 256 each), which KV_Q4_K_R and KV_Q6_K_R weights read;
 * either NULL to have it done here where the type needs it. */
void kv_qk_dot_rows_t(int64_t type, const KvQ8Block *xq, const KvQ8T *xt, const KvQ8T16 *xt16,
                      int64_t M, int64_t K, const uint8_t *w, int64_t n0, int64_t n1, float *y,
                      int64_t ldy);
/* One row of K values of type, dequantized to float32. */
void kv_q32_dequant_row(int64_t type, const uint8_t *row, int64_t K, float *out);
void kv_qk_dequant_row(int64_t type, const uint8_t *row, int64_t K, float *out);
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* The same values rounded to bfloat16 (to nearest even), straight from the blocks. */
void kv_qk_dequant_row_bf16(int64_t type, const uint8_t *row, int64_t K, uint16_t *out);
#endif

/* y = x @ w^T (+ bias): x [M, K] float32, y [M, N] with N the segments' rows summed.
 * Returns 0, -1 when a segment's type is not supported or K does not fit it, -2 when
 * out of memory. */
int kv_linear_quant(const float *x, const KvQuantWeight *w, const float *bias, float *y,
                    int64_t M, int64_t K, int num_threads);
/* The many-row path (quant_many.c): from kv_quant_many_rows() rows of x up,
 * kv_linear_quant dequantizes each weight panel once per call (to bfloat16 where the CPU
 * has AVX512-BF16, else float32) and multiplies it with x in floating point, instead of
 * rounding x to int8 blocks. The setter takes any row count (below 1 counts as 1), for
 * tests and for measuring the crossover; the default is KV_QUANT_MANY_ROWS_DEFAULT,
 * measured for each kind of panel (docs/architecture.md). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KV_QUANT_MANY_ROWS_DEFAULT 12
#else
/* The float32 panels' FMA tile does a quarter of VDPBF16PS's work per instruction, and
 * overtakes the int8 path only at prompt-sized row counts. */
#define KV_QUANT_MANY_ROWS_DEFAULT 128
#endif
int64_t kv_quant_many_rows(void);
void kv_quant_set_many_rows(int64_t rows);
/* Whether the block-32 kernels ask for the weight stream ahead non-temporally
 * (PREFETCHNTA) or into the caches (PREFETCHT1): on Zen 4 the first streamed 1.1-1.6x
 * faster, on Ice Lake it halved the rate, so the engine measures both when a quantized
 * model loads (kernels/tuning.py). Default: non-temporal (1). */
int kv_quant_stream_nta(void);
void kv_quant_set_stream_nta(int nta);
/* Where the build has AVX-512 with VNNI, the x8 kernels can multiply two groups of eight
 * weight rows at a time in 512-bit registers: half the instructions per product, the same
 * floats. Whether that is faster depends on the core (its 512-bit ports and clocks), so the
 * engine measures it when a model with block-32 weights loads (kernels/tuning.py) and sets
 * the row count of x from which the wide tiles are used (1 by default; past any batch:
 * never). kv_quant_x8_wide_built: 1 where the build has them. */
int kv_quant_x8_wide_built(void);
int64_t kv_quant_x8_wide_rows(void);
void kv_quant_set_x8_wide_rows(int64_t rows);
/* kv_linear_quant's many-row path, on a weight it has checked; N: the segments' rows. */
int kv_linear_quant_many(const float *x, const KvQuantWeight *w, const float *bias, float *y,
                         int64_t M, int64_t K, int64_t N, int num_threads);
/* out[r] = row rows[r] of a single-type weight (an embedding table), dequantized. */
int kv_dequant_rows(int64_t type, const uint8_t *data, int64_t K, const int64_t *rows, int64_t R,
                    float *out, int num_threads);

#endif
