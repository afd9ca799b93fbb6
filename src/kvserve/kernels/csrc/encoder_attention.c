/* Bidirectional attention of an encoder (BERT) over whole sequences packed one after
 * another in a step's rows: every token of a sequence attends to every token of it, and to
 * nothing else. No KV cache is involved: q, k and v are the fused projection's output rows.
 *
 * The unit of work is one (sequence, head) pair; all of them are handed out from one
 * parallel loop, so a step of thirty short sentences and twelve heads is one parallel
 * region per layer instead of several small PyTorch calls per sentence, each with its own
 * thread wake-up.
 *
 * Within a pair the products are laid out so that every multiply-add fills all eight lanes
 * and no dot product ends in a horizontal sum: the pair's keys are first copied transposed
 * (and pre-scaled) into a per-thread buffer, so the scores of one query against eight keys
 * are D broadcast multiply-adds; and the value sums run along the head dimension. Queries
 * go four at a time, so each key or value load serves four rows. Sentences are short (tens
 * of tokens), so a pair's keys and values stay in L1 throughout. */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"
#include "vec.h"

/* The longest head this kernel takes. */
#define MAX_HEAD_DIM 256
/* Query rows computed together. */
#define QUERY_ROWS 4
/* Value columns summed together per pass (four 8-lane accumulators per query row). */
#define VALUE_COLS 32

#ifdef KV_HAVE_V16
/* e^x for sixteen lanes with x <= 0 (a score minus its row's maximum), from exp16_parts
 * (vec.h), scalef doing the 2^n; inputs below -87 give e^-87 (expf would give 0 or a
 * denormal). 1 + r is rounded before the last multiply-add (the paged kernel's exp16 rounds
 * r + pr * r first: at most one ulp apart, but each kernel keeps its own floats). */
static inline __m512 exp16(__m512 x) {
    const Exp16Parts e = exp16_parts(x);
    return _mm512_scalef_ps(_mm512_fmadd_ps(e.pr, e.r, _mm512_add_ps(e.r, _mm512_set1_ps(1.0f))),
                            e.n);
}
#endif

/* Rows [0, n) of the scores ``s`` (row i at s + i * Lp) become softmax weights over their
 * first L entries (unnormalised: exp(s - max)); returns nothing, writes 1/sum to inv[i]. */
static void softmax_rows(float *s, int64_t Lp, int64_t L, int n, float *inv) {
    for (int i = 0; i < n; i++) {
        float *row = s + i * Lp;
        v8f mv = v8f_splat(-INFINITY);
        int64_t j = 0;
        for (; j + 8 <= L; j += 8) mv = v8f_max(mv, v8f_load(row + j));
        float m = v8f_hmax(mv);
        for (; j < L; j++) m = row[j] > m ? row[j] : m;
        const v8f mm = v8f_splat(m);
        v8f sums = v8f_splat(0.0f);
        j = 0;
#ifdef KV_HAVE_V16
        const __m512 m16 = _mm512_set1_ps(m);
        __m512 sums16 = _mm512_setzero_ps();
        for (; j + 16 <= L; j += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), m16));
            _mm512_storeu_ps(row + j, e);
            sums16 = _mm512_add_ps(sums16, e);
        }
        sums = v16f_fold((v16f)sums16);
#endif
        for (; j + 8 <= L; j += 8) {
            const v8f e = v8f_exp(v8f_load(row + j) - mm);
            v8f_store(row + j, e);
            sums += e;
        }
        float sum = v8f_sum(sums);
        for (; j < L; j++) {
            row[j] = expf(row[j] - m);
            sum += row[j];
        }
        inv[i] = 1.0f / sum;
    }
}

/* One head of one sequence: rows [0, L) at ``base`` (row stride ``stride``), q at column
 * ``qo``, k at ``ko``, v at ``vo``; the output row stride is ``out_stride``.
 * kt: scratch of D * Lp floats; scores: scratch of QUERY_ROWS * Lp floats (Lp = L rounded
 * up to 8). */
static void attend_pair(const float *base, int64_t stride, int64_t qo, int64_t ko, int64_t vo,
                        int64_t L, int64_t D, float scale, float *out, int64_t out_stride,
                        float *kt, float *scores) {
    const int64_t Lp = (L + 7) / 8 * 8;
    /* kt[d][j] = scale * k[j][d], zero for the padding keys j >= L (their scores are
     * computed but never read). */
    for (int64_t j = 0; j < L; j++) {
        const float *k = base + j * stride + ko;
        for (int64_t d = 0; d < D; d++) kt[d * Lp + j] = scale * k[d];
    }
    for (int64_t j = L; j < Lp; j++)
        for (int64_t d = 0; d < D; d++) kt[d * Lp + j] = 0.0f;
    for (int64_t i0 = 0; i0 < L; i0 += QUERY_ROWS) {
        const int n = L - i0 < QUERY_ROWS ? (int)(L - i0) : QUERY_ROWS;
        const float *q[QUERY_ROWS];
        for (int r = 0; r < QUERY_ROWS; r++) q[r] = base + (i0 + (r < n ? r : 0)) * stride + qo;
        /* Scores: sixteen keys of four queries at a time (each query value broadcast
         * serves two multiply-adds), then eight for the last ones. */
        int64_t j = 0;
        for (; j + 16 <= Lp; j += 16) {
            v8f lo[QUERY_ROWS] = {{0}}, hi[QUERY_ROWS] = {{0}};
            for (int64_t d = 0; d < D; d++) {
                const v8f k0 = v8f_load(kt + d * Lp + j), k1 = v8f_load(kt + d * Lp + j + 8);
                for (int r = 0; r < QUERY_ROWS; r++) {
                    const v8f qv = v8f_splat(q[r][d]);
                    lo[r] += qv * k0;
                    hi[r] += qv * k1;
                }
            }
            for (int r = 0; r < QUERY_ROWS; r++) {
                v8f_store(scores + r * Lp + j, lo[r]);
                v8f_store(scores + r * Lp + j + 8, hi[r]);
            }
        }
        for (; j < Lp; j += 8) {
            v8f acc[QUERY_ROWS] = {{0}};
            for (int64_t d = 0; d < D; d++) {
                const v8f kv = v8f_load(kt + d * Lp + j);
                for (int r = 0; r < QUERY_ROWS; r++) acc[r] += v8f_splat(q[r][d]) * kv;
            }
            for (int r = 0; r < QUERY_ROWS; r++) v8f_store(scores + r * Lp + j, acc[r]);
        }
        float inv[QUERY_ROWS];
        softmax_rows(scores, Lp, L, n, inv);
        /* Weighted sums of the values, VALUE_COLS columns of four rows at a time. */
        for (int64_t d0 = 0; d0 < D; d0 += VALUE_COLS) {
            const int64_t width = D - d0 < VALUE_COLS ? D - d0 : VALUE_COLS;
            v8f acc[QUERY_ROWS][VALUE_COLS / 8] = {{{0}}};
            for (int64_t t = 0; t < L; t++) {
                const float *v = base + t * stride + vo + d0;
                v8f vv[VALUE_COLS / 8];
                for (int c = 0; c < VALUE_COLS / 8; c++)
                    vv[c] = c * 8 < width ? v8f_load(v + c * 8) : v8f_splat(0.0f);
                for (int r = 0; r < QUERY_ROWS; r++) {
                    const v8f p = v8f_splat(scores[r * Lp + t]);
                    for (int c = 0; c < VALUE_COLS / 8; c++) acc[r][c] += p * vv[c];
                }
            }
            for (int r = 0; r < n; r++) {
                float *o = out + (i0 + r) * out_stride + d0;
                const v8f iv = v8f_splat(inv[r]);
                for (int c = 0; c * 8 < width; c++) v8f_store(o + c * 8, acc[r][c] * iv);
            }
        }
    }
}

/* qkv: float32 [T, 3 H D] (q heads, then k heads, then v heads); out: float32 [T, H D].
 * starts/lens: the rows of each of the num_seqs sequences (each row in at most one).
 * Returns 0, 1 for a head_dim it does not take (a multiple of 8 up to MAX_HEAD_DIM), 2
 * when a scratch buffer could not be allocated. */
int kv_encoder_attention(const float *qkv, float *out, const int64_t *starts, const int64_t *lens,
                         int64_t num_seqs, int64_t H, int64_t D, float scale, int num_threads) {
    if (D % 8 != 0 || D > MAX_HEAD_DIM || D <= 0) return 1;
    int64_t longest = 0, total = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        longest = lens[s] > longest ? lens[s] : longest;
        total += lens[s] * lens[s];
    }
    if (longest == 0) return 0;
    const int64_t stride = 3 * H * D, out_stride = H * D, pairs = num_seqs * H;
    const int64_t longest_p = (longest + 7) / 8 * 8;
    int failed = 0;
    /* A few hundred thousand multiply-adds do not pay for waking the other threads. */
#pragma omp parallel num_threads(num_threads) if (total * H * D >= 32768)
    {
        float *kt = malloc((size_t)(D + QUERY_ROWS) * longest_p * sizeof(float));
        if (kt == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < pairs; p++) {
            if (kt == NULL) continue;
            const int64_t s = p / H, h = p % H;
            const float *base = qkv + starts[s] * stride;
            attend_pair(base, stride, h * D, (H + h) * D, (2 * H + h) * D, lens[s], D, scale,
                        out + starts[s] * out_stride + h * D, out_stride, kt,
                        kt + D * longest_p);
        }
        free(kt);
    }
    return failed ? 2 : 0;
}
