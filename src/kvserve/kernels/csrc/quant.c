/* Quantized weights multiplied in GGUF's own blocks: the block-32 types (Q4_0, Q4_1, Q5_0,
 * Q5_1, Q8_0), and the entry points every quantized type goes through (kv_linear_quant,
 * kv_dequant_rows; the K-quants' blocks are quant_k.c's).
 *
 * Decoding one token multiplies every weight once, so a step takes as long as streaming
 * the weights from memory: Q4_0 is 4.5 bits a value against bf16's 16. The arithmetic
 * must keep up with that stream. Activations are rounded to int8 blocks of 32 once per
 * call (KvQ8Block), and each weight block meets its activation block in an integer dot
 * product of 32 pairs, scaled once per block in float32.
 *
 * A weight value is d * q + o, with q the block's stored quant and o a fixed offset
 * (-8 d for Q4_0, -16 d for Q5_0, 0 for Q8_0) or the block's minimum m (Q4_1, Q5_1). Then
 *     sum_i (d q_i + o) dx qx_i = d dx (sum_i q_i qx_i) + o s,   s = dx sum_i qx_i,
 * so the integer product takes the quants as stored, unsigned bytes, against signed
 * activations: the one product x86 does in a single instruction (VPMADDUBSW, VPDPBUSD).
 * Q8_0's quants are signed: the weight's sign moves onto the activation, |w| * sign(w) x. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "vec.h"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The AVX2 kernels (quant_q32_avx2.h; also what AVX-512 CPUs run, with VNNI's product). */
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KV_Q32_AVX2 1
#endif

#define QK 32 /* values per block of every block-32 type, and per KvQ8Block */
/* Rows of x one pass over the weights serves: 64 rows of 4096 activations are 320 KiB of
 * int8 blocks, which stay in L2 while each weight tile passes over them. */
#define ROW_BLOCK 64

static inline int is_q32(int64_t type) {
    return type == KV_GGML_Q4_0 || type == KV_GGML_Q4_1 || type == KV_GGML_Q5_0 ||
           type == KV_GGML_Q5_1 || type == KV_GGML_Q8_0;
}

/* The x8 layout's types (quant.h), and the GGUF type each holds. */
static inline int is_x8(int64_t type) {
    return type == KV_Q4_0_X8 || type == KV_Q4_1_X8 || type == KV_Q5_0_X8 || type == KV_Q5_1_X8 ||
           type == KV_Q8_0_X8;
}

static inline int64_t x8_base(int64_t type) { return is_x8(type) ? type - KV_X8_OFFSET : type; }

/* Bytes of one block: 32 values for the block-32 types, 256 for the K-quants; 0 otherwise. */
static inline int64_t block_bytes(int64_t type) {
    switch (type) {
        case KV_GGML_Q4_0: return 18;
        case KV_GGML_Q4_1: return 20;
        case KV_GGML_Q5_0: return 22;
        case KV_GGML_Q5_1: return 24;
        case KV_GGML_Q8_0: return 34;
        case KV_Q4_0_X8: return 18;
        case KV_Q4_1_X8: return 20;
        case KV_Q5_0_X8: return 22;
        case KV_Q5_1_X8: return 24;
        case KV_Q8_0_X8: return 34;
        case KV_GGML_Q4_K: return 144;
        case KV_Q4_K_R: return 144;
        case KV_GGML_Q5_K: return 176;
        case KV_GGML_Q6_K: return 210;
        case KV_Q6_K_R: return 210;
        default: return 0;
    }
}

int64_t kv_quant_row_bytes(int64_t type, int64_t K) {
    const int64_t values = is_q32(type) || is_x8(type) ? QK : 256;
    const int64_t bytes = block_bytes(type);
    if (bytes == 0 || K <= 0 || K % values) return 0;
    return K / values * bytes;
}

/* IEEE half precision (a block's scale or minimum) to float32, exactly. */
static inline float half_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, rest = h & 0x7FFFu;
    uint32_t bits;
    if (rest >= 0x7C00u) {
        bits = sign | 0x7F800000u | (rest & 0x3FFu) << 13; /* inf, nan */
    } else if (rest >= 0x0400u) {
        bits = sign | ((rest << 13) + ((127u - 15u) << 23)); /* normal: rebias the exponent */
    } else {
        const float f = (float)rest * 0x1p-24f; /* subnormal or zero: rest units of 2^-24 */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* ---- Activations ---------------------------------------------------------------------- */

/* 32 values to int8 with d = max|x| / 127, rounded to nearest (ties to even); s = d sum(q). */
static inline void quantize_block(const float *x, KvQ8Block *out) {
    v8f v[4], amax = {0};
    for (int j = 0; j < 4; j++) {
        v[j] = v8f_load(x + 8 * j);
        amax = v8f_max(amax, v8f_select(v[j] < 0, -v[j], v[j]));
    }
    const float d = v8f_hmax(amax) / 127.0f;
    const v8f inv = v8f_splat(d > 0.0f ? 1.0f / d : 0.0f);
    /* Adding and taking away 1.5 * 2^23 leaves a float32 of magnitude below 2^22 rounded
     * to an integer (the addition rounds, in the current mode: to nearest even). */
    const v8f magic = v8f_splat(12582912.0f);
    int32_t sum = 0;
    for (int j = 0; j < 4; j++) {
        const v8i q = __builtin_convertvector((v[j] * inv + magic) - magic, v8i);
        for (int i = 0; i < 8; i++) {
            out->q[8 * j + i] = (int8_t)q[i];
            sum += q[i];
        }
    }
    out->d = d;
    out->s = d * (float)sum;
}

void kv_quantize_q8(const float *x, int64_t M, int64_t K, KvQ8Block *out, int num_threads) {
    const int64_t num_blocks = M * (K / QK);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_blocks >= 256)
    for (int64_t i = 0; i < num_blocks; i++) quantize_block(x + i * QK, out + i);
}

/* ---- Weights, portably ---------------------------------------------------------------- */

/* A block's 32 values as d * q[i] + m: q signed (the fixed offset of Q4_0 and Q5_0 taken
 * off), m the block minimum of Q4_1 and Q5_1, else 0. Element i is quant i: in the packed
 * types byte j holds element j in its low nibble and element j + 16 in its high one, and
 * the Q5 types' fifth bits are bit i of a 32-bit qh. */
static inline void unpack_block(int64_t type, const uint8_t *blk, int8_t q[QK], float *d, float *m) {
    *d = half_to_f32(blk);
    *m = 0.0f;
    uint32_t qh = 0;
    const uint8_t *qs;
    int offset;
    switch (type) {
        case KV_GGML_Q8_0:
            memcpy(q, blk + 2, QK);
            return;
        case KV_GGML_Q4_0: qs = blk + 2, offset = 8; break;
        case KV_GGML_Q4_1: *m = half_to_f32(blk + 2), qs = blk + 4, offset = 0; break;
        case KV_GGML_Q5_0: memcpy(&qh, blk + 2, 4), qs = blk + 6, offset = 16; break;
        default: /* KV_GGML_Q5_1 */
            *m = half_to_f32(blk + 2), memcpy(&qh, blk + 4, 4), qs = blk + 8, offset = 0;
            break;
    }
    for (int j = 0; j < QK / 2; j++) {
        q[j] = (int8_t)((qs[j] & 0x0F) + (int)((qh >> j) & 1) * 16 - offset);
        q[j + 16] = (int8_t)((qs[j] >> 4) + (int)((qh >> (j + 16)) & 1) * 16 - offset);
    }
}

void kv_q32_dequant_row(int64_t type, const uint8_t *row, int64_t K, float *out) {
    const int64_t bytes = block_bytes(type);
    for (int64_t b = 0; b < K / QK; b++) {
        int8_t q[QK];
        float d, m;
        unpack_block(type, row + b * bytes, q, &d, &m);
        for (int i = 0; i < QK; i++) out[b * QK + i] = d * (float)q[i] + m;
    }
}

/* ---- The x8 layout (quant.h) ---------------------------------------------------------- */

/* Bytes of the field at byte `at` of a GGUF block (quant.h's x8 layout moves each field
 * whole): the scale d and a minimum m are halves, the fifth bits qh and each run of four
 * quants four bytes. A field at byte `at` of the block lies at 8 * at in the x8 block,
 * row j's at 8 * at + j * its size. */
static inline int64_t x8_field_bytes(int64_t base, int64_t at) {
    return at == 0 || (at == 2 && (base == KV_GGML_Q4_1 || base == KV_GGML_Q5_1)) ? 2 : 4;
}

int kv_q32_x8_pays(void) {
#ifdef KV_Q32_AVX2
    return 1;
#else
    return 0;
#endif
}

int kv_q32_x8_repack_rows(int64_t type, const uint8_t *src, int64_t rows, int64_t K,
                          uint8_t *dst, int num_threads) {
    if (!is_q32(type) || rows < 0 || rows % 8 || K <= 0 || K % QK) return -1;
    const int64_t bytes = block_bytes(type), nb = K / QK, row_bytes = nb * bytes;
    const int64_t blocks = rows / 8 * nb;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (blocks >= 4096)
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t g = i / nb, b = i % nb;
        uint8_t *out = dst + g * 8 * row_bytes + b * 8 * bytes;
        for (int64_t j = 0; j < 8; j++) {
            const uint8_t *blk = src + (8 * g + j) * row_bytes + b * bytes;
            for (int64_t at = 0, size; at < bytes; at += size) {
                size = x8_field_bytes(type, at);
                memcpy(out + 8 * at + size * j, blk + at, (size_t)size);
            }
        }
    }
    return 0;
}

void kv_q32_x8_row(int64_t type, const uint8_t *data, int64_t r, int64_t K, uint8_t *out) {
    const int64_t base = x8_base(type), bytes = block_bytes(base), nb = K / QK;
    const int64_t j = r % 8;
    const uint8_t *group = data + (r - j) * nb * bytes;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *in = group + b * 8 * bytes;
        uint8_t *blk = out + b * bytes;
        for (int64_t at = 0, size; at < bytes; at += size) {
            size = x8_field_bytes(base, at);
            memcpy(blk + at, in + 8 * at + size * j, (size_t)size);
        }
    }
}

#ifndef KV_Q32_AVX2
/* Any CPU: one weight row at a time against up to four rows of x, so each block is
 * unpacked once per four rows. */
static void dot_rows_portable(int64_t type, const KvQ8Block *xq, int64_t M, int64_t K,
                              const uint8_t *w, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const int64_t nb = K / QK, bytes = block_bytes(type);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * nb * bytes;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mr = min_i64(M - m0, 4);
            float acc[4] = {0};
            for (int64_t b = 0; b < nb; b++) {
                int8_t q[QK];
                float d, m;
                unpack_block(type, row + b * bytes, q, &d, &m);
                for (int64_t r = 0; r < mr; r++) {
                    const KvQ8Block *xb = xq + (m0 + r) * nb + b;
                    int32_t dot = 0;
                    for (int i = 0; i < QK; i++) dot += q[i] * xb->q[i];
                    acc[r] += d * xb->d * (float)dot + m * xb->s;
                }
            }
            for (int64_t r = 0; r < mr; r++) y[(m0 + r) * ldy + n] = acc[r];
        }
    }
}
#endif

/* ---- Weights, AVX2 (and VNNI) --------------------------------------------------------- */

#include "quant_q32_avx2.h"

int64_t kv_x8_wide_rows = 1;

int kv_quant_x8_wide_built(void) {
#if defined(KV_Q32_AVX2) && X8_WIDE
    return 1;
#else
    return 0;
#endif
}

int64_t kv_quant_x8_wide_rows(void) { return kv_x8_wide_rows; }

void kv_quant_set_x8_wide_rows(int64_t rows) { kv_x8_wide_rows = rows < 1 ? 1 : rows; }

void kv_q32_dot_rows(int64_t type, const KvQ8Block *xq, int64_t M, int64_t K, const uint8_t *w,
                     int64_t n0, int64_t n1, float *y, int64_t ldy) {
#ifdef KV_Q32_AVX2
    switch (type) {
        case KV_GGML_Q4_0: dot_rows_avx2(KV_GGML_Q4_0, xq, M, K, w, n0, n1, y, ldy); break;
        case KV_GGML_Q4_1: dot_rows_avx2(KV_GGML_Q4_1, xq, M, K, w, n0, n1, y, ldy); break;
        case KV_GGML_Q5_0: dot_rows_avx2(KV_GGML_Q5_0, xq, M, K, w, n0, n1, y, ldy); break;
        case KV_GGML_Q5_1: dot_rows_avx2(KV_GGML_Q5_1, xq, M, K, w, n0, n1, y, ldy); break;
        case KV_GGML_Q8_0: dot_rows_avx2(KV_GGML_Q8_0, xq, M, K, w, n0, n1, y, ldy); break;
        default: break; /* kv_linear_quant refuses other types before calling */
    }
#else
    if (is_q32(type)) dot_rows_portable(type, xq, M, K, w, n0, n1, y, ldy);
#endif
}

/* ---- Entry points --------------------------------------------------------------------- */

/* Output rows n0 .. n1 - 1 of one segment (its columns of y start at y). */
static void segment_rows(const KvQuantSegment *seg, const KvQ8Block *xq, const KvQ8T *xt,
                         const KvQ8T16 *xt16, const int32_t *xsum, int64_t M, int64_t K,
                         int64_t n0, int64_t n1, float *y, int64_t ldy) {
#ifdef KV_Q32_AVX2
    if (is_x8(seg->type)) {
        const uint8_t *w = seg->data;
        switch (seg->type) {
            case KV_Q4_0_X8: dot_rows_x8(KV_GGML_Q4_0, xq, NULL, M, K, w, n0, n1, y, ldy); break;
            case KV_Q4_1_X8: dot_rows_x8(KV_GGML_Q4_1, xq, NULL, M, K, w, n0, n1, y, ldy); break;
            case KV_Q5_0_X8: dot_rows_x8(KV_GGML_Q5_0, xq, NULL, M, K, w, n0, n1, y, ldy); break;
            case KV_Q5_1_X8: dot_rows_x8(KV_GGML_Q5_1, xq, NULL, M, K, w, n0, n1, y, ldy); break;
            default: dot_rows_x8(KV_GGML_Q8_0, xq, xsum, M, K, w, n0, n1, y, ldy); break;
        }
        return;
    }
#else
    (void)xsum;
#endif
    if (is_q32(seg->type))
        kv_q32_dot_rows(seg->type, xq, M, K, seg->data, n0, n1, y, ldy);
    else
        kv_qk_dot_rows_t(seg->type, xq, xt, xt16, M, K, seg->data, n0, n1, y, ldy);
}

int kv_linear_quant(const float *x, const KvQuantWeight *w, const float *bias, float *y,
                    int64_t M, int64_t K, int num_threads) {
    if (w->num_segments < 1 || w->num_segments > KV_QUANT_MAX_SEGMENTS || M < 0 || K <= 0 || K % QK)
        return -1;
    int64_t N = 0;
    for (int64_t s = 0; s < w->num_segments; s++) {
        if (kv_quant_row_bytes(w->seg[s].type, K) == 0 || w->seg[s].rows < 0) return -1;
        if (is_x8(w->seg[s].type) && (w->seg[s].rows % 8 || !kv_q32_x8_pays())) return -1;
        N += w->seg[s].rows;
    }
    if (M == 0 || N == 0) return 0;
    if (M >= kv_quant_many_rows()) return kv_linear_quant_many(x, w, bias, y, M, K, N, num_threads);
    const int64_t nb = K / QK;
    KvQ8Block *xq = malloc(sizeof(KvQ8Block) * (size_t)(M * nb));
    if (xq == NULL) return -2;
    /* Repacked Q4_K and Q6_K segments read x transposed a super-block at a time, each
     * type its own way: done once here for the types present, block by block as x is
     * quantized (their rows are whole super-blocks). */
    int transposed = 0, transposed16 = 0;
    for (int64_t s = 0; s < w->num_segments; s++) {
        transposed |= w->seg[s].type == KV_Q4_K_R;
        transposed16 |= w->seg[s].type == KV_Q6_K_R;
    }
    KvQ8T *xt = transposed ? malloc(sizeof(KvQ8T) * (size_t)(M * nb / 8)) : NULL;
    KvQ8T16 *xt16 = transposed16 ? malloc(sizeof(KvQ8T16) * (size_t)(M * nb / 8)) : NULL;
    /* x8 Q8_0 segments read each block's sum of quants, where the CPU has VPDPBUSD. */
    int sums = 0;
#if defined(KV_Q32_AVX2) && X8_SUMS
    for (int64_t s = 0; s < w->num_segments; s++) sums |= w->seg[s].type == KV_Q8_0_X8;
#endif
    int32_t *xsum = sums ? malloc(sizeof(int32_t) * (size_t)(M * nb)) : NULL;
    if ((transposed && xt == NULL) || (transposed16 && xt16 == NULL) || (sums && xsum == NULL)) {
        free(xq);
        free(xt);
        free(xt16);
        free(xsum);
        return -2;
    }
    /* Each thread takes an equal share of the weight's bytes, cut at whole 8-row groups
     * (two 4-row tiles, or one group of the x8 layout): its rows are consecutive, one
     * stream through memory, and segments of different types share out by what they
     * stream. (Equal counts of equal-row chunks left one thread a chunk more than the
     * other on small weights: 8 against 7 on a 576-row projection.) */
    int64_t total = 0;
    for (int64_t s = 0; s < w->num_segments; s++)
        total += (w->seg[s].rows + 7) / 8 * 8 * kv_quant_row_bytes(w->seg[s].type, K);
#pragma omp parallel num_threads(num_threads)
    {
        if (transposed || transposed16) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < M * nb / 8; g++) {
                for (int64_t i = 8 * g; i < 8 * g + 8; i++) quantize_block(x + i * QK, xq + i);
                if (transposed) kv_q8_transpose(xq + 8 * g, xt + g);
                if (transposed16) kv_q8_transpose16(xq + 8 * g, xt16 + g);
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M * nb; i++) quantize_block(x + i * QK, xq + i);
        }
        if (sums) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M * nb; i++) {
                int32_t total_q = 0;
                for (int j = 0; j < QK; j++) total_q += xq[i].q[j];
                xsum[i] = total_q;
            }
        }
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t lo = total * me / team, hi = total * (me + 1) / team;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int64_t mr = min_i64(M - m0, ROW_BLOCK);
            int64_t start = 0, column = 0; /* segment s's first byte of the total, first column */
            for (int64_t s = 0; s < w->num_segments; column += w->seg[s].rows, s++) {
                const int64_t group = 8 * kv_quant_row_bytes(w->seg[s].type, K);
                const int64_t end = start + (w->seg[s].rows + 7) / 8 * group;
                /* A group goes to the thread whose share holds its first byte. */
                const int64_t g0 = lo <= start ? 0 : (lo - start + group - 1) / group;
                const int64_t g1 = hi >= end ? (end - start) / group : (hi - start + group - 1) / group;
                start = end;
                const int64_t n0 = 8 * g0, n1 = min_i64(8 * g1, w->seg[s].rows);
                if (n0 >= n1) continue;
                float *out = y + m0 * N + column;
                segment_rows(&w->seg[s], xq + m0 * nb, xt == NULL ? NULL : xt + m0 * (nb / 8),
                             xt16 == NULL ? NULL : xt16 + m0 * (nb / 8),
                             xsum == NULL ? NULL : xsum + m0 * nb, mr, K, n0, n1, out, N);
                if (bias != NULL)
                    for (int64_t m = 0; m < mr; m++)
                        for (int64_t n = n0; n < n1; n++) out[m * N + n] += bias[column + n];
            }
        }
    }
    free(xq);
    free(xt);
    free(xt16);
    free(xsum);
    return 0;
}

int kv_dequant_rows(int64_t type, const uint8_t *data, int64_t K, const int64_t *rows, int64_t R,
                    float *out, int num_threads) {
    const int64_t row_bytes = kv_quant_row_bytes(type, K);
    if (row_bytes == 0 || R < 0) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (R * K >= 65536)
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *row = data + rows[r] * row_bytes;
        if (is_x8(type)) {
            uint8_t gguf_row[row_bytes];
            kv_q32_x8_row(type, data, rows[r], K, gguf_row);
            kv_q32_dequant_row(x8_base(type), gguf_row, K, out + r * K);
        } else if (is_q32(type))
            kv_q32_dequant_row(type, row, K, out + r * K);
        else
            kv_qk_dequant_row(type, row, K, out + r * K);
    }
    return 0;
}
