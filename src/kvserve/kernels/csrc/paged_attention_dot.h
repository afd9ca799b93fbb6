/* The paged decode kernel's inner loops for a bfloat16 pool on a CPU with AVX512-BF16.
 *
 * VDPBF16PS multiplies 32 bfloat16 pairs and adds them into sixteen float32 sums. Widening
 * each K and V element to float32 before a multiply-add costs about three instructions per
 * sixteen elements; with the dot product it is one, and the kernel, which on a bf16 pool is
 * bound by its arithmetic rather than by memory, runs about twice as fast.
 *
 * Scores: the query is rounded to bfloat16 once per unit, and each key row is a run of
 * bfloat16 that pairs with it directly. Values: the instruction sums over pairs of adjacent
 * elements, so two keys' value rows are interleaved (VPUNPCKL/HWD) into pairs
 * (v_k[d], v_k+1[d]) and multiplied by the pair of their softmax weights, rounded to
 * bfloat16. The interleave works within 128-bit lanes, which leaves each 32-dimension
 * chunk's sums in a fixed shuffled order: the unit keeps its output in that order (the
 * softmax only ever scales whole rows) and puts it right once, at the end.
 *
 * With sixteen keys to a block (the default), a head's sixteen scores are finished together
 * (sum_lanes16, paged_attention.c) and its online-softmax step runs in one register (softmax16).
 *
 * Rounding the query and the weights to bfloat16 is what a bf16 model does in its
 * attention matmuls anyway; the sums, the maxima and the softmax stay in float32.
 *
 * Part of paged_attention.c, which includes it after its Pool, Prefetch and sum_lanes8. */
#ifndef KVSERVE_PAGED_ATTENTION_DOT_H
#define KVSERVE_PAGED_ATTENTION_DOT_H

#ifdef __AVX512BF16__
#define KV_HAVE_BF16_DOT 1
#include <immintrin.h>

/* n float32 values (a multiple of 16) rounded to bfloat16. */
static inline void round_to_bf16(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
}

/* The n weights of one head (float32), rounded to bfloat16 pairs; an odd count gets a
 * zero partner, so the last pair adds nothing for the missing key. */
static inline void weights_to_bf16(const float *p, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const int64_t left = n - i < 16 ? n - i : 16;
        const __mmask16 mask = (__mmask16)((1u << left) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(mask, p + i);
        _mm256_mask_storeu_epi16(dst + i, mask, (__m256i)_mm512_cvtneps_pbh(x));
    }
    if (n % 2) dst[n] = 0;
}

/* scores[h * block_size + i] = scale * qb_h . k_i for every query head h and the n key rows
 * of one block (bfloat16, token_stride apart, KV head h / group at offset (h / group) * D);
 * qb: the query heads in bfloat16, D apart; D a multiple of 32. */
static inline __attribute__((always_inline)) void score_block_dot(const Pool *pool, const uint16_t *qb,
                                                                 const uint16_t *k, int64_t n,
                                                                 float *scores, Prefetch *pf) {
    const int64_t D = pool->head_dim, stride = pool->num_kv_heads * D, bs = pool->block_size;
    const v8f scale = v8f_splat(pool->scale);
    int64_t i = 0;
    /* Sixteen keys per pass where the block has room for them (the default block size),
     * then eight, then one at a time: chosen by the block's size, not by how many of its
     * keys the unit reads, so each key's score is summed the same way whichever row reads
     * it (the slots past n are scored too, from whatever they hold, and never used). */
    for (; i < n && i + 16 <= bs; i += 16) {
        for (int64_t h = 0; h < pool->num_heads; h++) {
            prefetch_some(pf);
            const uint16_t *rows = k + i * stride + (h / pool->group) * D;
            __m512 acc[16];
            for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 32) {
                const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + h * D + d);
                for (int r = 0; r < 16; r++)
                    acc[r] = _mm512_dpbf16_ps(acc[r], qv, (__m512bh)_mm512_loadu_si512(rows + r * stride + d));
            }
            _mm512_storeu_ps(scores + h * bs + i, _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(pool->scale)));
        }
    }
    for (; i < n && i + 8 <= bs; i += 8) {
        for (int64_t h = 0; h < pool->num_heads; h++) {
            prefetch_some(pf);
            const uint16_t *rows = k + i * stride + (h / pool->group) * D;
            __m512 acc[8];
            for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 32) {
                const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + h * D + d);
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++)
                    acc[r] = _mm512_dpbf16_ps(acc[r], qv, (__m512bh)_mm512_loadu_si512(rows + r * stride + d));
            }
            v8f folded[8];
            for (int r = 0; r < 8; r++) folded[r] = v16f_fold((v16f)acc[r]);
            v8f_store(scores + h * bs + i, sum_lanes8(folded) * scale);
        }
    }
    for (; i < n; i++)
        for (int64_t h = 0; h < pool->num_heads; h++) {
            const uint16_t *row = k + i * stride + (h / pool->group) * D;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qb + h * D + d),
                                       (__m512bh)_mm512_loadu_si512(row + d));
            scores[h * bs + i] = _mm512_reduce_add_ps(acc) * pool->scale;
        }
}

/* Two keys' rows of 32 value dimensions, interleaved into bfloat16 pairs: lo holds
 * dimensions 0-3, 8-11, 16-19, 24-27 of the chunk, hi the rest. */
static inline __attribute__((always_inline)) void interleave_rows(__m512i a, __m512i b, __m512i *lo,
                                                                  __m512i *hi) {
    *lo = _mm512_unpacklo_epi16(a, b);
    *hi = _mm512_unpackhi_epi16(a, b);
}

/* acc[h][d0 .. d0 + 32 * nc) += sum_i pb[h][i] * v_i[d0 ..] for nh query heads (acc rows D
 * apart, in the shuffled chunk order) and the n value rows of one KV head in a block; pb:
 * each head's bfloat16 weights, pb_stride apart, zero past an odd n. nh and nc are
 * constants where this is inlined, so the sums stay in registers across the block. */
static inline __attribute__((always_inline)) void weigh_block_dot(
    const Pool *pool, const uint16_t *v, int64_t n, const uint16_t *pb, int64_t pb_stride, float *acc,
    int64_t d0, const int nh, const int nc) {
    const int64_t D = pool->head_dim, stride = pool->num_kv_heads * D;
    __m512 sums[HEADS_PER_PASS][4];
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < 2 * nc; c++) sums[h][c] = _mm512_loadu_ps(acc + h * D + d0 + 16 * c);
    for (int64_t i = 0; i < n; i += 2) {
        __m512i x[4];
        for (int c = 0; c < nc; c++) {
            const __m512i a = _mm512_loadu_si512(v + i * stride + d0 + 32 * c);
            /* A block with an odd count pairs its last key with zeros, never with the
             * slot after it, which holds whatever was there before. */
            const __m512i b = i + 1 < n ? _mm512_loadu_si512(v + (i + 1) * stride + d0 + 32 * c)
                                        : _mm512_setzero_si512();
            interleave_rows(a, b, &x[2 * c], &x[2 * c + 1]);
        }
        for (int h = 0; h < nh; h++) {
            int32_t pair;
            memcpy(&pair, pb + h * pb_stride + i, sizeof pair);
            const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < 2 * nc; c++) sums[h][c] = _mm512_dpbf16_ps(sums[h][c], w, (__m512bh)x[c]);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < 2 * nc; c++) _mm512_storeu_ps(acc + h * D + d0 + 16 * c, sums[h][c]);
}

#define WEIGH_DOT(nh, nc) weigh_block_dot(pool, v, n, pb, pb_stride, acc, d0, nh, nc)

static inline __attribute__((always_inline)) void weigh_block_dot_any(
    const Pool *pool, const uint16_t *v, int64_t n, const uint16_t *pb, int64_t pb_stride, float *acc,
    int64_t d0, int nh, int nc) {
    if (nc == 2) {
        if (nh == 1) WEIGH_DOT(1, 2); else if (nh == 2) WEIGH_DOT(2, 2); else WEIGH_DOT(3, 2);
    } else {
        if (nh == 1) WEIGH_DOT(1, 1); else if (nh == 2) WEIGH_DOT(2, 1); else WEIGH_DOT(3, 1);
    }
}

/* One head's online-softmax step over a block of n <= 16 scores: the running maximum and
 * sum move, the output row (D floats, D % 16 == 0) is rescaled when the maximum grows, and
 * the weights land in pb as bfloat16 pairs. */
static inline __attribute__((always_inline)) void softmax16(const float *s, int64_t n, float *row_max,
                                                           float *row_sum, float *out, int64_t D,
                                                           uint16_t *pb) {
    const __mmask16 mask = (__mmask16)((1u << n) - 1);
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mask, s);
    const float m = _mm512_reduce_max_ps(x);
    if (m == -INFINITY && *row_max == -INFINITY) {
        /* Nothing seen yet (a part past a shorter row's end): every weight 0. */
        _mm256_mask_storeu_epi16(pb, mask, _mm256_setzero_si256());
        if (n % 2) pb[n] = 0;
        return;
    }
    if (m > *row_max) {
        const float shrink = expf(*row_max - m); /* 0 on the first block */
        *row_sum *= shrink;
        const __m512 f = _mm512_set1_ps(shrink);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(out + d), f));
        *row_max = m;
    }
    const __m512 e = exp16(_mm512_sub_ps(x, _mm512_set1_ps(*row_max)));
    *row_sum += _mm512_mask_reduce_add_ps(mask, e);
    _mm256_mask_storeu_epi16(pb, mask, (__m256i)_mm512_cvtneps_pbh(e));
    if (n % 2) pb[n] = 0;
}

/* Puts one row of D output values (D a multiple of 32) back in dimension order. */
static inline void unshuffle_row(float *row, int64_t D) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t d = 0; d < D; d += 32) {
        const __m512 lo = _mm512_loadu_ps(row + d), hi = _mm512_loadu_ps(row + d + 16);
        _mm512_storeu_ps(row + d, _mm512_permutex2var_ps(lo, first, hi));
        _mm512_storeu_ps(row + d + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}
#endif

#endif
