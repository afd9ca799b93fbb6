/* Quantized weights against many rows of x: a batch of decoding sequences, or a prompt.
 *
 * The int8 path of quant.c unpacks every weight block again for each tile of four rows
 * of x, which is cheap next to streaming the weight from memory when x has a few rows,
 * and the larger part of the work when it has dozens. Here each thread takes a panel of
 * weight rows, dequantizes it once per call into a buffer that stays in L1/L2, and runs
 * a plain floating-point tile kernel over it for every row of x: the unpacking is paid
 * once per weight, however many rows x has.
 *
 * With AVX512-BF16 the panel is bfloat16 and the tile is linear_bf16_dot.c's (VDPBF16PS,
 * x rounded to bfloat16 once per call); elsewhere the panel is float32 and the tile uses
 * fused multiply-adds on 8-lane vectors (vec.h). Both sum in float32.
 *
 * kv_linear_quant takes this path from kv_quant_many_rows() rows of x up: a threshold the
 * engine measures on the machine that runs it when a quantized model loads
 * (kernels/tuning.py); the compiled default is where it starts (docs/architecture.md). */
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "vec.h"

/* The bfloat16 panels need AVX512-BF16, and AVX512-BW/VL for unpacking the blocks in
 * registers (every CPU with the first has the others). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KV_MANY_BF16 1
#endif

#ifdef KV_MANY_BF16
#include "bf16_dot_tile.h"
/* Weight rows a thread dequantizes at a time: four 4-row tiles. 16 rows of 2048 inputs
 * are 64 KiB of bfloat16. */
#define PANEL 16
#else
/* Tiles of six weight rows against sixteen rows of x (twelve accumulators, two vectors
 * of x and a broadcast weight fill the sixteen AVX2 registers); four tiles a panel. 24
 * rows of 2048 inputs are 192 KiB of float32. */
#define TILE_N 6
#define TILE_M 16
#define PANEL 24
#endif

/* From this many rows of x up (set by kv_quant_set_many_rows after the engine measures). */
static int64_t many_rows_min = KV_QUANT_MANY_ROWS_DEFAULT;

int64_t kv_quant_many_rows(void) { return many_rows_min; }

void kv_quant_set_many_rows(int64_t rows) { many_rows_min = rows < 1 ? 1 : rows; }

/* Read by the block-32 kernels (quant_q32_avx2.h) as they prefetch. */
int kv_stream_nta = 1;

int kv_quant_stream_nta(void) { return kv_stream_nta; }

void kv_quant_set_stream_nta(int nta) { kv_stream_nta = nta != 0; }

static inline int is_q32(int64_t type) {
    return type == KV_GGML_Q4_0 || type == KV_GGML_Q4_1 || type == KV_GGML_Q5_0 ||
           type == KV_GGML_Q5_1 || type == KV_GGML_Q8_0;
}

static inline int is_x8(int64_t type) {
    return type == KV_Q4_0_X8 || type == KV_Q4_1_X8 || type == KV_Q5_0_X8 || type == KV_Q5_1_X8 ||
           type == KV_Q8_0_X8;
}

/* Row n of a segment in GGUF's layout: where it is, or put back from the x8 layout into
 * tmp (row_bytes bytes); *type is then the GGUF type. */
static inline const uint8_t *gguf_row(const KvQuantSegment *seg, int64_t n, int64_t K,
                                      int64_t row_bytes, uint8_t *tmp, int64_t *type) {
    *type = seg->type;
    if (!is_x8(seg->type)) return seg->data + n * row_bytes;
    kv_q32_x8_row(seg->type, seg->data, n, K, tmp);
    *type = seg->type - KV_X8_OFFSET;
    return tmp;
}

static inline void dequant_row(int64_t type, const uint8_t *row, int64_t K, float *out) {
    if (is_q32(type))
        kv_q32_dequant_row(type, row, K, out);
    else
        kv_qk_dequant_row(type, row, K, out);
}

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define KV_Q32_UNPACK 1

/* Bytes of one block of a block-32 type. */
static inline int64_t q32_block_bytes(int64_t type) {
    return type == KV_GGML_Q4_0   ? 18
           : type == KV_GGML_Q4_1 ? 20
           : type == KV_GGML_Q5_0 ? 22
           : type == KV_GGML_Q5_1 ? 24
                                  : 34;
}

/* One block of a block-32 type in registers: its 32 signed quants (element i = value
 * i, offsets taken off), its scale *d and minimum *m (0 where the type has none), so
 * value i is d * q[i] + m. The many-row path's panels are built from these, a block at
 * a time, where the generic kv_q32_dequant_row unpacks through memory and costs as much
 * as the product at tens of rows. */
static inline __m256i q32_block(int64_t type, const uint8_t *blk, float *d, float *m) {
    uint16_t h;
    memcpy(&h, blk, sizeof h);
    *d = _cvtsh_ss(h);
    *m = 0.0f;
    if (type == KV_GGML_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    int32_t qh = 0;
    const uint8_t *qs;
    int offset = 0;
    switch (type) {
        case KV_GGML_Q4_0: qs = blk + 2, offset = 8; break;
        case KV_GGML_Q4_1: memcpy(&h, blk + 2, sizeof h), *m = _cvtsh_ss(h), qs = blk + 4; break;
        case KV_GGML_Q5_0: memcpy(&qh, blk + 2, 4), qs = blk + 6, offset = 16; break;
        default:
            memcpy(&h, blk + 2, sizeof h), *m = _cvtsh_ss(h);
            memcpy(&qh, blk + 4, 4), qs = blk + 8;
            break;
    }
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs);
    /* Low nibbles are values 0-15, high nibbles 16-31. */
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                                 _mm256_set1_epi8(0x0F));
    if (type == KV_GGML_Q5_0 || type == KV_GGML_Q5_1) {
        /* Byte i tests bit i of qh: bytes 0-7 look at qh's byte 0, and so on; where it
         * is set, the value gains 16. */
        const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                  0x0303030303030303);
        const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
        const __m256i set =
            _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(qh), spread), bit);
        q = _mm256_add_epi8(
            q, _mm256_and_si256(_mm256_cmpeq_epi8(set, bit), _mm256_set1_epi8(16)));
    }
    return _mm256_sub_epi8(q, _mm256_set1_epi8((char)offset));
}
#endif

#ifdef KV_MANY_BF16

/* A row of a block-32 type straight to bfloat16, a block (32 values) at a time in
 * registers: the quants widened to float32, d * q + m, rounded to nearest even. The
 * generic path (a float32 row, then rounded) costs several times this, and the
 * dequantization is what the many-row path pays on top of the product. */
static void q32_row_to_bf16(int64_t type, const uint8_t *row, int64_t K, uint16_t *out) {
    const int64_t bytes = q32_block_bytes(type);
    for (int64_t b = 0; b < K / 32; b++, row += bytes, out += 32) {
        float d, m;
        const __m256i q = q32_block(type, row, &d, &m);
        const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
        const __m512 lo = _mm512_fmadd_ps(
            vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), vm);
        const __m512 hi = _mm512_fmadd_ps(
            vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), vm);
        _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* Rows n0 .. n0 + rows - 1 of a segment (rows <= PANEL) against all M rows of xb. y and
 * bias start at the segment's first column. */
static void panel(const KvQuantSegment *seg, int64_t K, int64_t row_bytes, int64_t n0,
                  int64_t rows, const uint16_t *xb, int64_t M, uint16_t *wb,
                  const float *bias, float *y, int64_t N) {
    uint8_t tmp[is_x8(seg->type) ? row_bytes : 1];
    for (int64_t r = 0; r < rows; r++) {
        int64_t type;
        const uint8_t *row = gguf_row(seg, n0 + r, K, row_bytes, tmp, &type);
        if (is_q32(type)) {
            q32_row_to_bf16(type, row, K, wb + r * K);
            continue;
        }
        kv_qk_dequant_row_bf16(type, row, K, wb + r * K);
    }
    const int64_t full = rows / 4 * 4;
    for (int64_t m = 0; m < M; m += 4) {
        const int64_t mr = M - m < 4 ? M - m : 4;
        for (int64_t j = 0; j < full; j += 4)
            tile_rows(xb + m * K, K, wb + j * K, K, bias, y + m * N, N, n0 + j, mr, 4);
        for (int64_t j = full; j < rows; j++)
            tile_rows(xb + m * K, K, wb + j * K, K, bias, y + m * N, N, n0 + j, mr, 1);
    }
}

#else

#ifdef KV_Q32_UNPACK
/* A block-32 row to float32, a block at a time in registers (q32_block). */
static void q32_row_to_f32(int64_t type, const uint8_t *row, int64_t K, float *out) {
    const int64_t bytes = q32_block_bytes(type);
    for (int64_t b = 0; b < K / 32; b++, row += bytes, out += 32) {
        float d, m;
        const __m256i q = q32_block(type, row, &d, &m);
        const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
        const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
        const __m128i parts[4] = {q0, _mm_srli_si128(q0, 8), q1, _mm_srli_si128(q1, 8)};
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(
                out + 8 * i,
                _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i])), vm));
    }
}
#endif

static inline void dequant_row_f32(int64_t type, const uint8_t *row, int64_t K, float *out) {
#ifdef KV_Q32_UNPACK
    if (is_q32(type)) {
        q32_row_to_f32(type, row, K, out);
        return;
    }
#endif
    dequant_row(type, row, K, out);
}

/* x [M, K] transposed in tiles of TILE_M rows: tile t is [K][TILE_M] floats, its rows
 * past M zero. The tile kernel then reads two vectors of x per k. */
static void pack_x(const float *x, int64_t M, int64_t K, float *xt, int64_t t) {
    float *tile = xt + t * K * TILE_M;
    const int64_t m0 = t * TILE_M, mr = min_i64(TILE_M, M - m0);
    for (int64_t k = 0; k < K; k++) {
        for (int64_t i = 0; i < mr; i++) tile[k * TILE_M + i] = x[(m0 + i) * K + k];
        for (int64_t i = mr; i < TILE_M; i++) tile[k * TILE_M + i] = 0.0f;
    }
}

/* NR rows of the float32 panel w (row stride K) against one tile of x's transpose: each
 * weight value is broadcast once and multiplied into VM vectors of x (VM * 8 rows of x),
 * so the sums need no horizontal additions. Columns n .. n + NR - 1 of y's rows m ..
 * m + mr - 1. */
static inline __attribute__((always_inline)) void tile_f32(const float *xt, const float *w,
                                                           int64_t K, const float *bias,
                                                           float *y, int64_t N, int64_t n,
                                                           int64_t m, int64_t mr,
                                                           const int NR, const int VM) {
    v8f acc[TILE_N][2];
    for (int i = 0; i < NR; i++)
        for (int v = 0; v < VM; v++) acc[i][v] = v8f_splat(0.0f);
    for (int64_t k = 0; k < K; k++) {
        v8f xv[2];
        for (int v = 0; v < VM; v++) xv[v] = v8f_load(xt + k * TILE_M + 8 * v);
        for (int i = 0; i < NR; i++) {
            const v8f wv = v8f_splat(w[i * K + k]);
            for (int v = 0; v < VM; v++) acc[i][v] += wv * xv[v];
        }
    }
    for (int i = 0; i < NR; i++) {
        const float b = bias ? bias[n + i] : 0.0f;
        for (int64_t r = 0; r < mr; r++) y[(m + r) * N + n + i] = acc[i][r / 8][r % 8] + b;
    }
}

static void tile_f32_any(const float *xt, const float *w, int64_t K, const float *bias,
                         float *y, int64_t N, int64_t n, int64_t m, int64_t mr, int64_t nr) {
#define KV_TILE_CASE(R)                                                  \
    case R:                                                              \
        if (mr > 8)                                                      \
            tile_f32(xt, w, K, bias, y, N, n, m, mr, R, 2);              \
        else                                                             \
            tile_f32(xt, w, K, bias, y, N, n, m, mr, R, 1);              \
        break;
    switch (nr) {
        KV_TILE_CASE(6)
        KV_TILE_CASE(5)
        KV_TILE_CASE(4)
        KV_TILE_CASE(3)
        KV_TILE_CASE(2)
        default: KV_TILE_CASE(1)
    }
#undef KV_TILE_CASE
}

static void panel(const KvQuantSegment *seg, int64_t K, int64_t row_bytes, int64_t n0,
                  int64_t rows, const float *xt, int64_t M, float *wf, const float *bias,
                  float *y, int64_t N) {
    uint8_t tmp[is_x8(seg->type) ? row_bytes : 1];
    for (int64_t r = 0; r < rows; r++) {
        int64_t type;
        const uint8_t *row = gguf_row(seg, n0 + r, K, row_bytes, tmp, &type);
        dequant_row_f32(type, row, K, wf + r * K);
    }
    for (int64_t m = 0; m < M; m += TILE_M) {
        const int64_t mr = min_i64(TILE_M, M - m);
        const float *tile = xt + m * K;
        for (int64_t j = 0; j < rows; j += TILE_N)
            tile_f32_any(tile, wf + j * K, K, bias, y, N, n0 + j, m, mr,
                         min_i64(TILE_N, rows - j));
    }
}

#endif

int kv_linear_quant_many(const float *x, const KvQuantWeight *w, const float *bias, float *y,
                         int64_t M, int64_t K, int64_t N, int num_threads) {
    int64_t num_panels = 0;
    for (int64_t s = 0; s < w->num_segments; s++)
        num_panels += (w->seg[s].rows + PANEL - 1) / PANEL;
#ifdef KV_MANY_BF16
    /* x to bfloat16 once (K is a multiple of 32: no padding). */
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(M * K));
    if (xb == NULL) return -2;
#else
    /* x transposed once, in tiles of TILE_M rows. */
    const int64_t x_tiles = (M + TILE_M - 1) / TILE_M;
    float *xt = malloc(sizeof(float) * (size_t)(x_tiles * TILE_M * K));
    if (xt == NULL) return -2;
#endif
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
#ifdef KV_MANY_BF16
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * K / 16; i++)
            _mm256_storeu_si256((__m256i *)(xb + 16 * i),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + 16 * i)));
        uint16_t *wb = malloc(sizeof(uint16_t) * (size_t)(PANEL * K));
        const int ok = wb != NULL;
#else
#pragma omp for schedule(static)
        for (int64_t t = 0; t < x_tiles; t++) pack_x(x, M, K, xt, t);
        float *wf = malloc(sizeof(float) * (size_t)(PANEL * K));
        const int ok = wf != NULL;
#endif
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* Panels in order, whole segments one after another; a thread's panels are
         * consecutive rows, one stream through memory. */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; p++) {
            if (!ok) continue;
            int64_t s = 0, first = p, column = 0;
            for (int64_t in_seg; first >= (in_seg = (w->seg[s].rows + PANEL - 1) / PANEL); s++)
                first -= in_seg, column += w->seg[s].rows;
            const KvQuantSegment *seg = &w->seg[s];
            const int64_t n0 = first * PANEL, rows = min_i64(PANEL, seg->rows - n0);
            const float *seg_bias = bias ? bias + column : NULL;
            const int64_t row_bytes = kv_quant_row_bytes(seg->type, K);
#ifdef KV_MANY_BF16
            panel(seg, K, row_bytes, n0, rows, xb, M, wb, seg_bias, y + column, N);
#else
            panel(seg, K, row_bytes, n0, rows, xt, M, wf, seg_bias, y + column, N);
#endif
        }
#ifdef KV_MANY_BF16
        free(wb);
#else
        free(wf);
#endif
    }
#ifdef KV_MANY_BF16
    free(xb);
#else
    free(xt);
#endif
    return failed ? -2 : 0;
}
