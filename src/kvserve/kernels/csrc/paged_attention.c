/* Decode attention straight from the paged KV pool: one query token per sequence (and the
 * rows of a request verifying speculative proposals together, below).
 *
 * The unit of work is one sequence over a range of its tokens, all heads. The range is
 * the whole sequence when there are enough sequences to keep every thread busy; when
 * there are not (one long sequence, say), the tokens are split into block-aligned parts,
 * each part is attended on its own, and the parts are merged with their softmax
 * statistics (the "flash decoding" split). A unit walks its blocks in table order; each
 * block's keys and values are contiguous in the pool, so they stream from memory as
 * two runs. Per block it scores the keys against every query head (the heads sharing a
 * KV head are scored together: grouped-query attention), rescales its running sums when
 * a head's maximum grows (online softmax), and adds the block's values with the new
 * weights. Nothing is gathered or padded, and each live KV entry is read exactly once.
 *
 * Sliding-window layers see only a sequence's last ``window`` tokens: the walk starts at the
 * block holding the first visible one, and that block's earlier keys are masked, so blocks
 * before the window are never read (the KV cache may already have handed them back, leaving
 * the null block in their table entries). Consecutive rows with one block table and
 * lengths going up by one (a request's next token and its proposals, each seeing the ones
 * before it) are one unit: their heads are more query heads of one sequence, each masked
 * past its own row's length, so every key and value block is read once for all of them
 * rather than once per row (at batch 1 on a 1,300-token context, six rows cost 3.0x one
 * row read apart and 2.0x together; SmolLM2, Zen 4). Their scoring is then arithmetic:
 * eighteen query heads per KV head for SmolLM2 verifying five proposals. On a bfloat16 pool
 * without AVX512-BF16 (score_block_t) each KV head's keys of a block are transposed once,
 * so that every query head sharing them gets its sixteen scores in one register with
 * nothing summed across lanes (six rows on 1,000 keys: 0.70x the time of scoring them
 * head by head, three rows 0.77x, one row 0.96x; SmolLM2's heads, Ice Lake, two threads;
 * the AVX2 build of score_block_t on the same machine: 0.65x, 0.71x, 0.82x).
 * Soft-capped layers (Gemma 2) squash each scaled score through cap * tanh(score / cap)
 * before the softmax. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vec.h"

/* When sequences are too few to keep every thread busy, their keys are attended in parts
 * of this many blocks (64 tokens of 16-token blocks), split at the same places whatever
 * else is in the step (below). */
#define PART_BLOCKS 4
/* Query heads whose value sums are accumulated together (3 x 4 accumulators fit AVX2's
 * sixteen registers beside the four value vectors they share). */
#define HEADS_PER_PASS 3

typedef struct {
    /* [num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16 */
    const void *key_cache, *value_cache;
    int64_t num_heads, num_kv_heads, group, head_dim, block_size;
    float scale, soft_cap; /* soft_cap 0: none */
} Pool;

/* Eight K or V elements starting at element i of a pool row, widened to float32 when the
 * pool holds bfloat16. ``bf16`` is a constant wherever this is inlined, so each element
 * type gets its own copy of the loops below with no branch inside them. */
static inline __attribute__((always_inline)) v8f kv_load8(const void *base, int64_t i, const int bf16) {
    return bf16 ? v8bf16_load((const uint16_t *)base + i) : v8f_load((const float *)base + i);
}

#ifdef KV_HAVE_V16
static inline __attribute__((always_inline)) v16f kv_load16(const void *base, int64_t i, const int bf16) {
    return bf16 ? v16bf16_load((const uint16_t *)base + i) : v16f_load((const float *)base + i);
}
#endif

static inline const void *kv_at(const void *base, int64_t i, const int bf16) {
    return bf16 ? (const void *)((const uint16_t *)base + i) : (const void *)((const float *)base + i);
}

/* The next block's keys and values, requested a few cache lines at a time while the
 * current block is computed: a burst of hundreds of prefetches would stall the core
 * until most of them arrived, and nothing would overlap. */
typedef struct {
    const char *key, *value;
    int64_t done, lines, per_call;
} Prefetch;

static inline void prefetch_some(Prefetch *pf) {
    const int64_t stop = min_i64(pf->done + pf->per_call, pf->lines);
    for (; pf->done < stop; pf->done++) {
        __builtin_prefetch(pf->key + 64 * pf->done, 0, 3);
        __builtin_prefetch(pf->value + 64 * pf->done, 0, 3);
    }
}

static inline __attribute__((always_inline)) float dot_scaled(const float *a, const void *b,
                                                              int64_t n, float scale, const int bf16) {
    v8f acc0 = {0}, acc1 = {0};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        acc0 += v8f_load(a + d) * kv_load8(b, d, bf16);
        acc1 += v8f_load(a + d + 8) * kv_load8(b, d + 8, bf16);
    }
    if (d < n) acc0 += v8f_load(a + d) * kv_load8(b, d, bf16);
    return v8f_sum(acc0 + acc1) * scale;
}

/* Lane i of the result is the sum of the lanes of v[i]: eight dot products finished in
 * seven additions instead of eight separate horizontal sums. */
static inline v8f sum_lanes8(const v8f v[8]) {
    const v8i even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8f pairs[4], quads[2];
    for (int i = 0; i < 4; i++)
        pairs[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], even) +
                   __builtin_shuffle(v[2 * i], v[2 * i + 1], odd);
    for (int i = 0; i < 2; i++)
        quads[i] = __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], lo2) +
                   __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], hi2);
    return __builtin_shuffle(quads[0], quads[1], lo4) + __builtin_shuffle(quads[0], quads[1], hi4);
}

#ifdef KV_HAVE_V16
/* Lane i of the result is the sum of the lanes of a[i]: sixteen dot products finished in
 * four rounds of shuffles and adds, about half the work of folding them eight at a time. */
static inline __attribute__((always_inline)) __m512 sum_lanes16(const __m512 a[16]) {
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: partial sums of a[2i] and a[2i+1] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                                 _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: that lane's sums of a[4i] .. a[4i+3] */
        const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* then the 128-bit lanes added in pairs, twice */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

/* e^x, sixteen lanes, from exp16_parts (vec.h), scaled by VSCALEFPS. r + pr * r is rounded
 * before the 1 is added (the encoder kernel's exp16 rounds 1 + r first: at most one ulp
 * apart, but each kernel keeps its own floats). */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    const Exp16Parts e = exp16_parts(x);
    return _mm512_scalef_ps(_mm512_add_ps(_mm512_fmadd_ps(e.pr, e.r, e.r), _mm512_set1_ps(1.0f)),
                            e.n);
}

/* One head's online-softmax step over a block of n <= 16 scores of which the head sees the
 * first nh (the rest are another row's, -inf): the running maximum and sum move, the output
 * row (D floats, D % 16 == 0) is rescaled when the maximum grows, and the weights replace
 * the scores, 0 past nh, so that a row's sum is the same float whether it is attended
 * alone or beside rows that see more keys. */
static inline __attribute__((always_inline)) void softmax16_f32(float *s, int64_t n, int64_t nh,
                                                               float *row_max, float *row_sum,
                                                               float *out, int64_t D) {
    const __mmask16 all = (__mmask16)((1u << n) - 1), seen = (__mmask16)((1u << nh) - 1);
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), all, s);
    const float block_max = _mm512_reduce_max_ps(x);
    const float m = block_max > *row_max ? block_max : *row_max;
    if (m == -INFINITY) {
        /* Nothing seen yet (a part past a shorter row's end): every weight 0. */
        _mm512_mask_storeu_ps(s, all, _mm512_setzero_ps());
        return;
    }
    if (m > *row_max) {
        const float shrink = expf(*row_max - m); /* 0 on the first block */
        *row_sum *= shrink;
        const __m512 f = _mm512_set1_ps(shrink);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(out + d), f));
        *row_max = m;
    }
    const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, _mm512_set1_ps(m))));
    *row_sum += _mm512_reduce_add_ps(e);
    _mm512_mask_storeu_ps(s, all, e);
}

/* Lane j of r[i] moves to lane i of r[j]: a 16 x 16 transpose of 32-bit lanes in four
 * rounds of sixteen shuffles. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) { /* per 128-bit lane L: lanes 4L, 4L+1 (t[2i]), 4L+2, 4L+3 */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + c], 128-bit lane L: lane 4L + c of rows 4i .. 4i+3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) { /* then 128-bit lane L of r[c], r[4+c], r[8+c], r[12+c] */
        const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
        const __m512i v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
        const __m512i w0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
        const __m512i w1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
        t[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        t[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        t[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* The transposed scoring (score_block_t) on this build: query heads scored together, the
 * head size it needs a multiple of, and its transposes per KV head of a block. */
#define KV_HAVE_TRANSPOSED 1
#define KT_HEADS 6
#define KT_DIM_STEP 32
#define KT_TRANSPOSES(D) ((D) / 32)

/* nh heads' scores (q rows D apart) against sixteen keys transposed into kt (dimension d's
 * sixteen keys at kt + 16 d): each head's sum runs over the even dimensions and the odd
 * ones in order, in two chains, then adds the two. nh is a constant where inlined. */
static inline __attribute__((always_inline)) void score_heads_t(const float *q, int64_t D,
                                                               const float *kt, float scale,
                                                               float *scores, const int nh) {
    __m512 acc[KT_HEADS][2];
    for (int h = 0; h < nh; h++) acc[h][0] = acc[h][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 2) {
        const __m512 even = _mm512_loadu_ps(kt + 16 * d), odd = _mm512_loadu_ps(kt + 16 * d + 16);
        for (int h = 0; h < nh; h++) {
            acc[h][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * D + d]), even, acc[h][0]);
            acc[h][1] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * D + d + 1]), odd, acc[h][1]);
        }
    }
    for (int h = 0; h < nh; h++)
        _mm512_storeu_ps(scores + h * 16,
                         _mm512_mul_ps(_mm512_add_ps(acc[h][0], acc[h][1]), _mm512_set1_ps(scale)));
}

/* scores[h * 16 + i] = scale * q_h . k_i for every query head h and the sixteen key rows of a
 * bfloat16 block (token_stride apart; D % 32 == 0). Each KV head's keys are transposed once
 * into kt (16 * D floats of scratch), so that a head's sixteen scores come out of one
 * register, with no sum across lanes, and every query head of the KV head reads the same
 * transposed keys: the heads sharing a KV head (three for SmolLM2's grouped heads,
 * eighteen for a request verifying five proposals) pay for its reading once. bfloat16
 * needs no widening pass: a 32-bit lane holds two neighbouring dimensions, the even one
 * in its low half, so after the transpose one shift gives the even dimension and one mask
 * the odd. The slots past n are scored too, from whatever they hold, and never used. */
static inline __attribute__((always_inline)) void score_block_t(const Pool *pool, const float *q,
                                                               const uint16_t *k, float *scores,
                                                               float *kt, Prefetch *pf) {
    const int64_t D = pool->head_dim, stride = pool->num_kv_heads * D;
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t kv_head = 0; kv_head < pool->num_kv_heads; kv_head++) {
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            prefetch_some(pf);
            __m512i w[16];
            for (int i = 0; i < 16; i++) w[i] = _mm512_loadu_si512(k + i * stride + kv_head * D + d0);
            transpose16(w); /* w[j] lane i: key i's dimensions d0 + 2j (low half), d0 + 2j + 1 */
            for (int j = 0; j < 16; j++) {
                _mm512_storeu_si512(kt + 16 * (d0 + 2 * j), _mm512_slli_epi32(w[j], 16));
                _mm512_storeu_si512(kt + 16 * (d0 + 2 * j + 1), _mm512_and_si512(w[j], high));
            }
        }
        for (int64_t h0 = 0; h0 < pool->group; h0 += KT_HEADS) {
            prefetch_some(pf);
            const int64_t h = kv_head * pool->group + h0;
            const float *qh = q + h * D;
            float *sh = scores + h * 16;
            switch (min_i64(KT_HEADS, pool->group - h0)) {
                case 6: score_heads_t(qh, D, kt, pool->scale, sh, 6); break;
                case 5: score_heads_t(qh, D, kt, pool->scale, sh, 5); break;
                case 4: score_heads_t(qh, D, kt, pool->scale, sh, 4); break;
                case 3: score_heads_t(qh, D, kt, pool->scale, sh, 3); break;
                case 2: score_heads_t(qh, D, kt, pool->scale, sh, 2); break;
                default: score_heads_t(qh, D, kt, pool->scale, sh, 1); break;
            }
        }
    }
}
#endif

#if !defined(KV_HAVE_V16) && defined(__AVX2__)
/* score_block_t with eight-lane registers (AVX2 without AVX-512), the same idea and
 * layout: the sixteen keys of a block are two registers per dimension. */
#define KV_HAVE_TRANSPOSED 1
#define KT_HEADS 3
#define KT_DIM_STEP 16
#define KT_TRANSPOSES(D) (2 * (D) / 16)
#include <immintrin.h>

/* Lane j of r[i] moves to lane i of r[j]: an 8 x 8 transpose of 32-bit lanes. */
static inline __attribute__((always_inline)) void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) { /* per 128-bit lane L: lanes 4L, 4L+1 (t[2i]), 4L+2, 4L+3 */
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* u[4i + c], 128-bit lane L: lane 4L + c of rows 4i .. 4i+3 */
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
}

/* score_heads_t with eight lanes: each head's keys 0-7 and 8-15 in two registers, each
 * summed over the even dimensions and the odd ones in two chains. */
static inline __attribute__((always_inline)) void score_heads_t(const float *q, int64_t D,
                                                                const float *kt, float scale,
                                                                float *scores, const int nh) {
    __m256 acc[KT_HEADS][2][2];
    for (int h = 0; h < nh; h++)
        for (int half = 0; half < 2; half++) acc[h][half][0] = acc[h][half][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 2) {
        for (int odd = 0; odd < 2; odd++) { /* unrolled: the chain is a constant index */
            const float *row = kt + 16 * (d + odd);
            const __m256 lo = _mm256_loadu_ps(row), hi = _mm256_loadu_ps(row + 8);
            for (int h = 0; h < nh; h++) {
                const __m256 qd = _mm256_broadcast_ss(q + h * D + d + odd);
                acc[h][0][odd] = _mm256_fmadd_ps(qd, lo, acc[h][0][odd]);
                acc[h][1][odd] = _mm256_fmadd_ps(qd, hi, acc[h][1][odd]);
            }
        }
    }
    for (int h = 0; h < nh; h++)
        for (int half = 0; half < 2; half++)
            _mm256_storeu_ps(scores + h * 16 + 8 * half,
                             _mm256_mul_ps(_mm256_add_ps(acc[h][half][0], acc[h][half][1]),
                                           _mm256_set1_ps(scale)));
}

/* score_block_t for AVX2: D % 16 == 0. */
static inline __attribute__((always_inline)) void score_block_t(const Pool *pool, const float *q,
                                                                const uint16_t *k, float *scores,
                                                                float *kt, Prefetch *pf) {
    const int64_t D = pool->head_dim, stride = pool->num_kv_heads * D;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t kv_head = 0; kv_head < pool->num_kv_heads; kv_head++) {
        for (int half = 0; half < 2; half++)
            for (int64_t d0 = 0; d0 < D; d0 += 16) {
                prefetch_some(pf);
                __m256i w[8];
                for (int i = 0; i < 8; i++)
                    w[i] = _mm256_loadu_si256(
                        (const __m256i *)(k + (8 * half + i) * stride + kv_head * D + d0));
                transpose8(w); /* w[j] lane i: key 8 half + i's dimensions d0 + 2j, d0 + 2j + 1 */
                for (int j = 0; j < 8; j++) {
                    float *at = kt + 16 * (d0 + 2 * j) + 8 * half;
                    _mm256_storeu_si256((__m256i *)at, _mm256_slli_epi32(w[j], 16));
                    _mm256_storeu_si256((__m256i *)(at + 16), _mm256_and_si256(w[j], high));
                }
            }
        for (int64_t h0 = 0; h0 < pool->group; h0 += KT_HEADS) {
            prefetch_some(pf);
            const int64_t h = kv_head * pool->group + h0;
            const float *qh = q + h * D;
            float *sh = scores + h * 16;
            switch (min_i64(KT_HEADS, pool->group - h0)) {
                case 3: score_heads_t(qh, D, kt, pool->scale, sh, 3); break;
                case 2: score_heads_t(qh, D, kt, pool->scale, sh, 2); break;
                default: score_heads_t(qh, D, kt, pool->scale, sh, 1); break;
            }
        }
    }
}
#endif

#include "paged_attention_dot.h"

/* scores[h * stride_s + i] = scale * q_h . k_i for every query head h and the n rows k_i of
 * one block (rows token_stride floats apart, KV head h / group at offset (h / group) *
 * head_dim); eight rows per pass where the block has room for them, the rest one by one. */
static inline __attribute__((always_inline)) void score_block(const Pool *pool, const float *q,
                                                             const void *k, int64_t n, float *scores,
                                                             Prefetch *pf, const int bf16) {
    const int64_t D = pool->head_dim, stride = pool->num_kv_heads * D, bs = pool->block_size;
    const v8f scale = v8f_splat(pool->scale);
    int64_t i = 0;
    /* Eight keys per pass where the block has room for them: chosen by the block's size,
     * not by how many of its keys the unit reads, so each key's score is summed the same
     * way whichever row reads it (the slots past n are scored too and never used). */
#ifdef KV_HAVE_V16
    /* Sixteen dimensions per instruction where the head fits: half the instructions; and
     * sixteen keys per pass where the block has room for them (the default block size),
     * their sums finished together (sum_lanes16). */
    if (D % 16 == 0) {
        for (; i < n && i + 16 <= bs; i += 16) {
            for (int64_t h = 0; h < pool->num_heads; h++) {
                prefetch_some(pf);
                const int64_t rows = i * stride + (h / pool->group) * D;
                const float *qh = q + h * D;
                __m512 acc[16];
                for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                /* Key by key, 64 dimensions at a time (the query's four vectors stay in
                 * registers): each sum still runs over the dimensions in order. */
                int64_t d = 0;
                for (; d + 64 <= D; d += 64) {
                    __m512 qv[4];
                    for (int c = 0; c < 4; c++) qv[c] = _mm512_loadu_ps(qh + d + 16 * c);
#pragma GCC unroll 16
                    for (int r = 0; r < 16; r++)
#pragma GCC unroll 4
                        for (int c = 0; c < 4; c++)
                            acc[r] = _mm512_fmadd_ps(
                                qv[c], (__m512)kv_load16(k, rows + r * stride + d + 16 * c, bf16), acc[r]);
                }
                for (; d < D; d += 16) {
                    const __m512 qv = _mm512_loadu_ps(qh + d);
                    for (int r = 0; r < 16; r++)
                        acc[r] = _mm512_fmadd_ps(qv, (__m512)kv_load16(k, rows + r * stride + d, bf16), acc[r]);
                }
                _mm512_storeu_ps(scores + h * bs + i, _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(pool->scale)));
            }
        }
        for (; i < n && i + 8 <= bs; i += 8) {
            for (int64_t h = 0; h < pool->num_heads; h++) {
                prefetch_some(pf);
                const int64_t rows = i * stride + (h / pool->group) * D;
                const float *qh = q + h * D;
                v16f acc[8];
                for (int r = 0; r < 8; r++) acc[r] = v16f_splat(0.0f);
                for (int64_t d = 0; d < D; d += 16) {
                    const v16f qv = v16f_load(qh + d);
#pragma GCC unroll 8
                    for (int r = 0; r < 8; r++) acc[r] += qv * kv_load16(k, rows + r * stride + d, bf16);
                }
                v8f folded[8];
                for (int r = 0; r < 8; r++) folded[r] = v16f_fold(acc[r]);
                v8f_store(scores + h * bs + i, sum_lanes8(folded) * scale);
            }
        }
    }
#endif
    for (; i < n && i + 8 <= bs; i += 8) {
        for (int64_t h = 0; h < pool->num_heads; h++) {
            prefetch_some(pf);
            const int64_t rows = i * stride + (h / pool->group) * D;
            const float *qh = q + h * D;
            v8f acc[8] = {0};
            for (int64_t d = 0; d < D; d += 8) {
                const v8f qv = v8f_load(qh + d);
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) acc[r] += qv * kv_load8(k, rows + r * stride + d, bf16);
            }
            v8f_store(scores + h * bs + i, sum_lanes8(acc) * scale);
        }
    }
    for (; i < n; i++)
        for (int64_t h = 0; h < pool->num_heads; h++)
            scores[h * bs + i] = dot_scaled(q + h * D, kv_at(k, i * stride + (h / pool->group) * D, bf16),
                                            D, pool->scale, bf16);
}

/* acc[h][d0 .. d0 + 8 * nv) += sum_i p[h * block_size + i] * v_i[d0 ..] for nh query heads
 * (acc rows head_dim apart) and the n value rows of one KV head in a block. nh and nv are
 * constants where this is inlined, so the sums stay in registers across the block. */
static inline __attribute__((always_inline)) void weigh_block(
    const Pool *pool, const void *v, int64_t n, const float *p, float *acc, int64_t d0,
    const int nh, const int nv, const int bf16) {
    const int64_t D = pool->head_dim, stride = pool->num_kv_heads * D, bs = pool->block_size;
    v8f sums[HEADS_PER_PASS][4];
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < nv; c++) sums[h][c] = v8f_load(acc + h * D + d0 + 8 * c);
    for (int64_t i = 0; i < n; i++) {
        v8f x[4];
        for (int c = 0; c < nv; c++) x[c] = kv_load8(v, i * stride + d0 + 8 * c, bf16);
        for (int h = 0; h < nh; h++) {
            const v8f w = v8f_splat(p[h * bs + i]);
            for (int c = 0; c < nv; c++) sums[h][c] += w * x[c];
        }
    }
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < nv; c++) v8f_store(acc + h * D + d0 + 8 * c, sums[h][c]);
}

#ifdef KV_HAVE_V16
/* weigh_block with sixteen-lane vectors: nv of them (four cover a 64-wide head). */
static inline __attribute__((always_inline)) void weigh_block16(
    const Pool *pool, const void *v, int64_t n, const float *p, float *acc, int64_t d0,
    const int nh, const int nv, const int bf16) {
    const int64_t D = pool->head_dim, stride = pool->num_kv_heads * D, bs = pool->block_size;
    v16f sums[HEADS_PER_PASS][4];
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < nv; c++) sums[h][c] = v16f_load(acc + h * D + d0 + 16 * c);
    for (int64_t i = 0; i < n; i++) {
        v16f x[4];
        for (int c = 0; c < nv; c++) x[c] = kv_load16(v, i * stride + d0 + 16 * c, bf16);
        for (int h = 0; h < nh; h++) {
            const v16f w = v16f_splat(p[h * bs + i]);
            for (int c = 0; c < nv; c++) sums[h][c] += w * x[c];
        }
    }
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < nv; c++) v16f_store(acc + h * D + d0 + 16 * c, sums[h][c]);
}

#define WEIGH16(nh, nv) weigh_block16(pool, v, n, p, acc, d0, nh, nv, bf16)

static inline __attribute__((always_inline)) void weigh_block16_any(
    const Pool *pool, const void *v, int64_t n, const float *p, float *acc, int64_t d0, int nh,
    int nv, const int bf16) {
    if (nv == 4) {
        if (nh == 1) WEIGH16(1, 4); else if (nh == 2) WEIGH16(2, 4); else WEIGH16(3, 4);
    } else {
        if (nh == 1) WEIGH16(1, 1); else if (nh == 2) WEIGH16(2, 1); else WEIGH16(3, 1);
    }
}
#endif

#define WEIGH(nh, nv) weigh_block(pool, v, n, p, acc, d0, nh, nv, bf16)

static inline __attribute__((always_inline)) void weigh_block_any(
    const Pool *pool, const void *v, int64_t n, const float *p, float *acc, int64_t d0, int nh,
    int nv, const int bf16) {
    if (nv == 4) {
        if (nh == 1) WEIGH(1, 4); else if (nh == 2) WEIGH(2, 4); else WEIGH(3, 4);
    } else {
        if (nh == 1) WEIGH(1, 1); else if (nh == 2) WEIGH(2, 1); else WEIGH(3, 1);
    }
}

/* Floats of scratch a unit needs (see attend_range): scores and the dot loops' bfloat16
 * copies, rounded up to a whole cache line, then a block's keys of one KV head transposed. */
#define SCRATCH_SHARED_FLOATS(H, D, bs) (((H) * (bs) + ((H) * (D) + (H) * ((bs) + 2)) / 2 + 16) / 16 * 16)
#define SCRATCH_FLOATS(H, D, bs) (SCRATCH_SHARED_FLOATS(H, D, bs) + 16 * (D))

/* One unit: every query head of one sequence (q rows head_dim apart) over tokens
 * [start, end), start on a block edge; keys before first_visible (a sliding window's start,
 * at most one block past start) get no weight. Leaves in out the attention output normalised by the
 * range's own softmax sum, in row_max and row_sum each head's maximum score and sum of
 * exp(score - maximum). scratch: SCRATCH_FLOATS(num_heads, head_dim, block_size) floats.
 * dot (with bf16): use the AVX512-BF16 loops of paged_attention_dot.h. */
static inline __attribute__((always_inline)) void attend_range(
    const Pool *pool, const float *q, const int64_t *block_table, int64_t start, int64_t end,
    int64_t first_visible, const int64_t *head_len, float *out, float *row_max, float *row_sum,
    float *scratch, const int bf16, const int dot) {
    const int64_t elem = bf16 ? 2 : 4;
    const int64_t H = pool->num_heads, D = pool->head_dim, bs = pool->block_size;
    const int64_t token_stride = pool->num_kv_heads * D;
    /* scores: [H, bs] float32; then for the dot loops the query and each head's weights in
     * bfloat16 ([H, D] and [H, pb_stride], pb_stride even so every weight pair is aligned). */
    float *scores = scratch;
    uint16_t *qb = (uint16_t *)(scores + H * bs);
    const int64_t pb_stride = bs + 2 - bs % 2;
    uint16_t *pb = qb + H * D;
    /* A bfloat16 block's keys, transposed (score_block_t), after the dot loops' copies. */
    float *kt = scratch + SCRATCH_SHARED_FLOATS(H, D, bs);
    int transposed = 0;
#ifdef KV_HAVE_TRANSPOSED
    transposed = bf16 && !dot && bs == 16 && D % KT_DIM_STEP == 0;
#endif
    (void)kt;
    (void)transposed;
#ifdef KV_HAVE_BF16_DOT
    if (dot) round_to_bf16(q, qb, H * D);
#else
    (void)qb;
    (void)pb;
    (void)pb_stride;
#endif
    for (int64_t h = 0; h < H; h++) {
        row_max[h] = -INFINITY;
        row_sum[h] = 0.0f;
        for (int64_t d = 0; d < D; d += 8) v8f_store(out + h * D + d, v8f_splat(0.0f));
    }
    for (int64_t t = start; t < end; t += bs) {
        const int64_t n = min_i64(bs, end - t), offset = block_table[t / bs] * bs * token_stride;
        /* Blocks are scattered through the pool, where the hardware cannot guess the next
         * one: fetch the next block's keys and values while this one is computed. */
        Prefetch pf = {0};
        if (t + bs < end) {
            const int64_t next = block_table[t / bs + 1] * bs * token_stride;
            pf.key = (const char *)pool->key_cache + next * elem;
            pf.value = (const char *)pool->value_cache + next * elem;
            pf.lines = (min_i64(bs, end - t - bs) * token_stride * elem + 63) / 64;
            /* Spread evenly over the block's work: one call per head per eight keys
             * scored, per head in the softmax, and per pass over the values. Every line
             * must be asked for before the block ends: the next block's computation
             * would otherwise wait on each miss in turn. */
            const int64_t head_passes =
                pool->num_kv_heads * ((pool->group + HEADS_PER_PASS - 1) / HEADS_PER_PASS);
            int64_t value_passes = D / 32 + D % 32 / 8;
#ifdef KV_HAVE_V16
            if (D % 16 == 0) value_passes = D / 64 + D % 64 / 16;
#endif
            if (dot) value_passes = D / 64 + D % 64 / 32;
            int64_t score_calls = H * (dot ? n / 16 + n % 16 / 8 : n / 8);
#ifdef KV_HAVE_V16
            if (D % 16 == 0) score_calls = H * (n / 16 + n % 16 / 8);
#endif
#ifdef KV_HAVE_TRANSPOSED
            if (transposed)
                score_calls = pool->num_kv_heads * (KT_TRANSPOSES(D) + (pool->group + KT_HEADS - 1) / KT_HEADS);
#endif
            const int64_t calls = score_calls + H + head_passes * value_passes;
            pf.per_call = (pf.lines + calls - 1) / calls;
        }
#ifdef KV_HAVE_BF16_DOT
        if (dot)
            score_block_dot(pool, qb, (const uint16_t *)pool->key_cache + offset, n, scores, &pf);
        else
#endif
#ifdef KV_HAVE_TRANSPOSED
        if (transposed)
            score_block_t(pool, q, (const uint16_t *)pool->key_cache + offset, scores, kt, &pf);
        else
#endif
            score_block(pool, q, kv_at(pool->key_cache, offset, bf16), n, scores, &pf, bf16);
        if (pool->soft_cap > 0.0f) {
            const float cap = pool->soft_cap, inv_cap = 1.0f / pool->soft_cap;
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < n; i++) scores[h * bs + i] = cap * tanhf(scores[h * bs + i] * inv_cap);
        }
        /* Keys before the window (only ever in the unit's first block) get no weight. */
        for (int64_t h = 0; t < first_visible && h < H; h++)
            for (int64_t i = 0; i < first_visible - t; i++) scores[h * bs + i] = -INFINITY;
        /* Rows attended together (below) see keys up to their own lengths only. */
        for (int64_t h = 0; head_len != NULL && h < H; h++)
            for (int64_t i = head_len[h] - t > 0 ? head_len[h] - t : 0; i < n; i++)
                scores[h * bs + i] = -INFINITY;
        /* Online softmax: move each head's running maximum, rescale what was summed under
         * the old one, and turn this block's scores into weights. */
        for (int64_t h = 0; h < H; h++) {
            prefetch_some(&pf);
#ifdef KV_HAVE_BF16_DOT
            if (dot && n <= 16) {
                softmax16(scores + h * bs, n, row_max + h, row_sum + h, out + h * D, D, pb + h * pb_stride);
                continue;
            }
#endif
#ifdef KV_HAVE_V16
            if (!dot && bs == 16 && D % 16 == 0) {
                const int64_t seen =
                    head_len == NULL ? n : min_i64(n, head_len[h] - t > 0 ? head_len[h] - t : 0);
                softmax16_f32(scores + h * bs, n, seen, row_max + h, row_sum + h, out + h * D, D);
                continue;
            }
#endif
            float *s = scores + h * bs;
            /* Keys of this block the head's row sees: the sums below run over them alone,
             * in the order a row attended by itself sums them (the rest weigh 0). */
            const int64_t nh =
                head_len == NULL ? n : min_i64(n, head_len[h] - t > 0 ? head_len[h] - t : 0);
            float m = row_max[h];
            int64_t j = 0;
            if (n >= 8) {
                v8f mv = v8f_load(s);
                for (j = 8; j + 8 <= n; j += 8) mv = v8f_max(mv, v8f_load(s + j));
                m = v8f_hmax(mv) > m ? v8f_hmax(mv) : m;
            }
            for (; j < n; j++) m = s[j] > m ? s[j] : m;
            if (m == -INFINITY) {
                /* Nothing seen yet (a part past a shorter row's end): every weight 0. */
                for (int64_t i = 0; i < n; i++) s[i] = 0.0f;
#ifdef KV_HAVE_BF16_DOT
                if (dot) weights_to_bf16(s, pb + h * pb_stride, n);
#endif
                continue;
            }
            if (m > row_max[h]) {
                const float shrink = expf(row_max[h] - m); /* 0 on the first block */
                row_sum[h] *= shrink;
                for (int64_t d = 0; d < D; d += 8)
                    v8f_store(out + h * D + d, v8f_load(out + h * D + d) * v8f_splat(shrink));
                row_max[h] = m;
            }
            const v8f mv = v8f_splat(m);
            v8f total = {0};
            int64_t i = 0;
            for (; i + 8 <= nh; i += 8) {
                const v8f e = v8f_exp(v8f_load(s + i) - mv);
                v8f_store(s + i, e);
                total += e;
            }
            float sum = v8f_sum(total);
            for (; i < nh; i++) {
                s[i] = expf(s[i] - m);
                sum += s[i];
            }
            for (; i < n; i++) s[i] = 0.0f;
            row_sum[h] += sum;
#ifdef KV_HAVE_BF16_DOT
            if (dot) weights_to_bf16(s, pb + h * pb_stride, n);
#endif
        }
        for (int64_t kv_head = 0; kv_head < pool->num_kv_heads; kv_head++) {
            const void *v = kv_at(pool->value_cache, offset + kv_head * D, bf16);
            for (int64_t h0 = 0; h0 < pool->group; h0 += HEADS_PER_PASS) {
                const int64_t first = kv_head * pool->group + h0;
                const int nh = (int)min_i64(HEADS_PER_PASS, pool->group - h0);
                int64_t d0 = 0;
#ifdef KV_HAVE_BF16_DOT
                if (dot)
                    for (; d0 < D;) {
                        prefetch_some(&pf);
                        const int nc = d0 + 64 <= D ? 2 : 1;
                        weigh_block_dot_any(pool, v, n, pb + first * pb_stride, pb_stride,
                                            out + first * D, d0, nh, nc);
                        d0 += 32 * nc;
                    }
#endif
#ifdef KV_HAVE_V16
                if (D % 16 == 0)
                    for (; d0 < D;) {
                        prefetch_some(&pf);
                        const int nv = d0 + 64 <= D ? 4 : 1;
                        weigh_block16_any(pool, v, n, scores + first * bs, out + first * D, d0, nh,
                                          nv, bf16);
                        d0 += 16 * nv;
                    }
#endif
                while (d0 < D) {
                    prefetch_some(&pf);
                    const int nv = d0 + 32 <= D ? 4 : 1;
                    weigh_block_any(pool, v, n, scores + first * bs, out + first * D, d0, nh, nv, bf16);
                    d0 += 8 * nv;
                }
            }
        }
        pf.per_call = pf.lines; /* whatever is left (a short block's rounding) */
        prefetch_some(&pf);
    }
    for (int64_t h = 0; h < H; h++) {
        /* A row that saw no key in this part (past its end) leaves zeros and a sum of 0. */
        const v8f inv = v8f_splat(row_sum[h] > 0.0f ? 1.0f / row_sum[h] : 0.0f);
        for (int64_t d = 0; d < D; d += 8) v8f_store(out + h * D + d, v8f_load(out + h * D + d) * inv);
#ifdef KV_HAVE_BF16_DOT
        if (dot) unshuffle_row(out + h * D, D);
#endif
    }
}


/* One copy of the unit's loops per pool element type (and, for bfloat16, instruction set). */
static void attend_range_f32(const Pool *pool, const float *q, const int64_t *block_table,
                             int64_t start, int64_t end, int64_t first_visible,
                             const int64_t *head_len, float *out, float *row_max, float *row_sum,
                             float *scratch) {
    attend_range(pool, q, block_table, start, end, first_visible, head_len, out, row_max, row_sum,
                 scratch, 0, 0);
}

static void attend_range_bf16(const Pool *pool, const float *q, const int64_t *block_table,
                              int64_t start, int64_t end, int64_t first_visible,
                              const int64_t *head_len, float *out, float *row_max, float *row_sum,
                              float *scratch) {
    attend_range(pool, q, block_table, start, end, first_visible, head_len, out, row_max, row_sum,
                 scratch, 1, 0);
}

#ifdef KV_HAVE_BF16_DOT
static void attend_range_bf16_dot(const Pool *pool, const float *q, const int64_t *block_table,
                                  int64_t start, int64_t end, int64_t first_visible,
                                  const int64_t *head_len, float *out, float *row_max,
                                  float *row_sum, float *scratch) {
    attend_range(pool, q, block_table, start, end, first_visible, head_len, out, row_max, row_sum,
                 scratch, 1, 1);
}
#endif

/* Rows attended together at most (a request's proposals, 16 at most, and its next token). */
#define MAX_JOINT_ROWS 17

/* Whether two rows' block tables hold the same first ``blocks`` blocks. */
static inline int same_table(const int64_t *a, const int64_t *b, int64_t blocks) {
    return memcmp(a, b, sizeof(int64_t) * (size_t)blocks) == 0;
}

/* Where joint head j of the group of ``rows`` rows from row b goes in out ([rows of the
 * batch, H, D]): joint heads run (KV head, row, head in its group). With one row it is
 * head j of row b. */
static inline float *joint_row(float *out, int64_t b, int64_t rows, int64_t H, int64_t group,
                               int64_t D, int64_t j) {
    const int64_t r = j % (rows * group) / group, h = j / (rows * group) * group + j % group;
    return out + ((b + r) * H + h) * D;
}

/* The first position of the block holding a sequence's first visible key. */
static inline int64_t first_block_start(int64_t seq_len, int64_t window, int64_t block_size) {
    const int64_t first_visible = window > 0 && seq_len > window ? seq_len - window : 0;
    return first_visible / block_size * block_size;
}

/* query: [num_seqs, num_heads, head_dim] with rows query_stride floats apart; out: [num_seqs,
 * num_heads, head_dim] contiguous; key_cache, value_cache: [num_blocks, block_size,
 * num_kv_heads, head_dim], float32 or (kv_bf16, a KV_POOL_* kind) bfloat16, read with the
 * AVX512-BF16 loops for KV_POOL_BF16_DOT (-1 where the build lacks them); block_tables:
 * [num_seqs, max_blocks];
 * seq_lens: [num_seqs], each >= 1; window: keys a query sees (its own included), 0 for all of
 * them; soft_cap: 0 for none. head_dim must be a multiple of 8. Block ids and lengths are
 * trusted: the Python wrappers check them against the pool and the table (kernels/bounds.py).
 * Returns 0; -1 when the shapes are outside what the kernel handles or a length is below 1,
 * -2 when out of memory. */
int kv_paged_decode(const float *query, int64_t query_stride, const void *key_cache,
                    const void *value_cache, int kv_bf16, const int64_t *block_tables,
                    const int64_t *seq_lens, float *out, int64_t num_seqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                    float scale, int64_t window, float soft_cap, int num_threads) {
    if (head_dim % 8 != 0 || num_heads % num_kv_heads != 0 || num_seqs < 1 || window < 0 ||
        soft_cap < 0.0f)
        return -1;
    /* The split below divides by each length's part size: a zero length would trap. */
    for (int64_t b = 0; b < num_seqs; b++)
        if (seq_lens[b] < 1) return -1;
    const Pool pool = {key_cache, value_cache, num_heads, num_kv_heads, num_heads / num_kv_heads,
                       head_dim, block_size, scale, soft_cap};
    void (*attend)(const Pool *, const float *, const int64_t *, int64_t, int64_t, int64_t,
                   const int64_t *, float *, float *, float *, float *) =
        kv_bf16 ? attend_range_bf16 : attend_range_f32;
    if (kv_bf16 == KV_POOL_BF16_DOT) {
#ifdef KV_HAVE_BF16_DOT
        /* The dot-product loops take the head in chunks of 32; other widths widen. */
        if (head_dim % 32 == 0) attend = attend_range_bf16_dot;
#else
        return -1;
#endif
    }
    const int64_t H = num_heads, D = head_dim, group = pool.group;
    /* Rows of one table whose lengths go up by one (a request verifying its proposals:
     * its next positions, each seeing the ones before it) are attended together, as more
     * query heads of one sequence: each key and value block is read once for all of them
     * instead of once per row, and each row's scores past its own length are masked.
     * Sliding windows would start each row at a different key: those rows go alone. */
    int64_t *group_first = malloc(sizeof(int64_t) * (num_seqs + 1));
    int64_t *part_len = malloc(sizeof(int64_t) * num_seqs);
    int64_t *first_unit = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (group_first == NULL || part_len == NULL || first_unit == NULL) {
        free(group_first), free(part_len), free(first_unit);
        return -2;
    }
    int64_t num_groups = 0, most_rows = 1;
    for (int64_t b = 0; b < num_seqs;) {
        int64_t rows = 1;
        while (b + rows < num_seqs && rows < MAX_JOINT_ROWS &&
               seq_lens[b + rows] == seq_lens[b + rows - 1] + 1 &&
               (window == 0 || seq_lens[b + rows] <= window) &&
               same_table(block_tables + b * max_blocks, block_tables + (b + rows) * max_blocks,
                          (seq_lens[b + rows] + block_size - 1) / block_size))
            rows++;
        group_first[num_groups++] = b;
        most_rows = rows > most_rows ? rows : most_rows;
        b += rows;
    }
    group_first[num_groups] = num_seqs;
    /* Parts: with fewer groups than four a thread, a sequence's keys are cut every
     * PART_BLOCKS blocks from the block holding its first visible key (dynamic scheduling
     * spreads the parts over the threads); with more, each is one part (cutting them
     * would cost each step a few percent in setups and merges, measured at 64 sequences).
     * Where the cuts fall depends on nothing else in the step, so a row's attention is the
     * same float whether it is verified beside its proposals or decoded on its own, and
     * in any batch on the same side of that line (its parts, and the order each part
     * sums in, depend on its own length only). A group's parts run to its longest row's
     * end; a shorter row sees nothing in a part past its own. */
    const int cut = num_groups < 4 * (int64_t)num_threads;
    const int64_t part_tokens = cut ? PART_BLOCKS * block_size : INT64_MAX / 2;
    int any_split = 0;
    first_unit[0] = 0;
    for (int64_t g = 0; g < num_groups; g++) {
        const int64_t b = group_first[g], last_len = seq_lens[group_first[g + 1] - 1];
        /* The walk covers the blocks from the one holding the first visible key. */
        const int64_t len = last_len - first_block_start(seq_lens[b], window, block_size);
        const int64_t parts = (len + part_tokens - 1) / part_tokens;
        part_len[g] = part_tokens;
        any_split |= parts > 1;
        first_unit[g + 1] = first_unit[g] + parts;
    }
    int64_t *unit_head = malloc(sizeof(int64_t) * (first_unit[num_groups] + 1));
    if (unit_head == NULL) {
        free(group_first), free(part_len), free(first_unit);
        return -2;
    }
    unit_head[0] = 0;
    for (int64_t g = 0; g < num_groups; g++) {
        const int64_t rows = group_first[g + 1] - group_first[g];
        for (int64_t u = first_unit[g]; u < first_unit[g + 1]; u++) unit_head[u + 1] = unit_head[u] + rows * H;
    }
    const int64_t num_units = first_unit[num_groups], unit_heads = unit_head[num_units];
    /* Parts of split sequences land here before the merge: outputs, maxima, sums. */
    float *partial = any_split ? malloc(sizeof(float) * unit_heads * (D + 2)) : NULL;
    if (any_split && partial == NULL) {
        free(group_first), free(part_len), free(first_unit), free(unit_head);
        return -2;
    }
    float *partial_max = partial ? partial + unit_heads * D : NULL;
    float *partial_sum = partial ? partial_max + unit_heads : NULL;
    const int64_t HR = H * most_rows;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* Row maxima and sums, scores and the loops' bfloat16 copies, then for a group of
         * rows its queries head by head, its output before it is put back, and each head's
         * length. */
        const size_t joint = most_rows > 1 ? (size_t)(2 * HR * D + 2 * HR + 2) : 0;
        float *scratch = malloc(sizeof(float) * (2 * HR + SCRATCH_FLOATS(HR, D, block_size) + joint));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        float *scores = scratch == NULL ? NULL : scratch + 2 * HR;
        float *joint_q = NULL, *joint_out = NULL;
        int64_t *joint_len = NULL;
        if (scratch != NULL && joint) {
            joint_q = scores + SCRATCH_FLOATS(HR, D, block_size);
            joint_out = joint_q + HR * D;
            joint_len = (int64_t *)(((uintptr_t)(joint_out + HR * D) + 7) & ~(uintptr_t)7);
        }
        int64_t g = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < num_units; u++) {
            if (scratch == NULL) continue;
            while (first_unit[g + 1] <= u) g++;
            while (first_unit[g] > u) g--;
            const int64_t b = group_first[g], rows = group_first[g + 1] - b;
            const int64_t last_len = seq_lens[b + rows - 1];
            const int64_t first = first_block_start(seq_lens[b], window, block_size);
            const int64_t start = first + (u - first_unit[g]) * part_len[g];
            const int64_t end = min_i64(start + part_len[g], last_len);
            const int64_t first_visible = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0;
            const int64_t *table = block_tables + b * max_blocks;
            const int split = first_unit[g + 1] - first_unit[g] > 1;
            if (rows == 1) {
                const float *q = query + b * query_stride;
                if (!split)
                    attend(&pool, q, table, start, end, first_visible, NULL, out + b * H * D, scratch,
                           scratch + H, scores);
                else
                    attend(&pool, q, table, start, end, first_visible, NULL,
                           partial + unit_head[u] * D, partial_max + unit_head[u],
                           partial_sum + unit_head[u], scores);
                continue;
            }
            /* Joint head j = (kv head, row, head in its group): the rows' heads of one KV
             * head are consecutive, as grouped-query attention reads them. */
            Pool joint_pool = pool;
            joint_pool.num_heads = rows * H;
            joint_pool.group = rows * group;
            for (int64_t j = 0; j < rows * H; j++) {
                const int64_t r = j % (rows * group) / group;
                const int64_t h = j / (rows * group) * group + j % group;
                memcpy(joint_q + j * D, query + (b + r) * query_stride + h * D, sizeof(float) * D);
                joint_len[j] = seq_lens[b + r];
            }
            if (!split) {
                attend(&joint_pool, joint_q, table, start, end, first_visible, joint_len, joint_out,
                       scratch, scratch + HR, scores);
                for (int64_t j = 0; j < rows * H; j++)
                    memcpy(joint_row(out, b, rows, H, group, D, j), joint_out + j * D, sizeof(float) * D);
            } else {
                attend(&joint_pool, joint_q, table, start, end, first_visible, joint_len,
                       partial + unit_head[u] * D, partial_max + unit_head[u],
                       partial_sum + unit_head[u], scores);
            }
        }
        /* Merge the parts of each split group: weight part p by sum_p * exp(max_p - max). */
#pragma omp for schedule(static)
        for (int64_t gg = 0; gg < num_groups; gg++) {
            const int64_t first = first_unit[gg], parts = first_unit[gg + 1] - first;
            if (parts == 1 || failed) continue;
            const int64_t b = group_first[gg], rows = group_first[gg + 1] - b;
            for (int64_t j = 0; j < rows * H; j++) {
                float m = -INFINITY, total = 0.0f;
                int64_t live = 0, only = 0;
                for (int64_t p = 0; p < parts; p++) {
                    const int64_t at = unit_head[first + p] + j;
                    m = partial_max[at] > m ? partial_max[at] : m;
                    if (partial_sum[at] > 0.0f) live++, only = at;
                }
                float *o = joint_row(out, b, rows, H, group, D, j);
                if (live == 1) {
                    /* A row of a group whose keys all fell in one part (the others are past
                     * its end): that part is its attention, as when it is attended alone. */
                    memcpy(o, partial + only * D, sizeof(float) * D);
                    continue;
                }
                for (int64_t d = 0; d < D; d += 8) v8f_store(o + d, v8f_splat(0.0f));
                for (int64_t p = 0; p < parts; p++) {
                    const int64_t at = unit_head[first + p] + j;
                    const float weight = partial_sum[at] * expf(partial_max[at] - m);
                    total += weight;
                    const float *po = partial + at * D;
                    for (int64_t d = 0; d < D; d += 8)
                        v8f_store(o + d, v8f_load(o + d) + v8f_splat(weight) * v8f_load(po + d));
                }
                for (int64_t d = 0; d < D; d += 8) v8f_store(o + d, v8f_load(o + d) * v8f_splat(1.0f / total));
            }
        }
        free(scratch);
    }
    free(partial);
    free(group_first), free(part_len), free(first_unit), free(unit_head);
    return failed ? -2 : 0;
}
