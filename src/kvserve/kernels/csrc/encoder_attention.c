/* Bidirectional attention of an encoder (BERT) over whole sequences packed one after
 * another in a step's rows: every token of a sequence attends to every token of it, and to
 * nothing else. No KV cache is involved: q, k and v are the fused projection's output rows.
 *
 * The unit of work is one (sequence, head) pair; all of them are handed out from one
 * parallel loop, so a step of thirty short sentences and twelve heads is one parallel
 * region per layer instead of several small PyTorch calls per sentence, each with its own
 * thread wake-up. Sentences are short (tens of tokens), so a pair's keys and values stay
 * in L1 while each query row scores them, takes the softmax and sums the values; the
 * scores of one row are kept in a per-thread buffer as long as the longest sequence. */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"
#include "vec.h"

/* The longest head the value sums keep in registers-sized stack arrays. */
#define MAX_HEAD_DIM 256

static inline float dot8(const float *a, const float *b, int64_t D) {
    v8f s = v8f_splat(0.0f);
    for (int64_t d = 0; d < D; d += 8) s += v8f_load(a + d) * v8f_load(b + d);
    return v8f_sum(s);
}

/* One head of one sequence: rows [0, L) at ``base`` (row stride ``stride``), q at column
 * ``qo``, k at ``ko``, v at ``vo``; the output row stride is ``out_stride``. */
static void attend_pair(const float *base, int64_t stride, int64_t qo, int64_t ko, int64_t vo,
                        int64_t L, int64_t D, float scale, float *out, int64_t out_stride,
                        float *scores) {
    float acc[MAX_HEAD_DIM];
    for (int64_t i = 0; i < L; i++) {
        const float *q = base + i * stride + qo;
        float m = -INFINITY;
        for (int64_t j = 0; j < L; j++) {
            const float s = scale * dot8(q, base + j * stride + ko, D);
            scores[j] = s;
            m = s > m ? s : m;
        }
        float sum = 0.0f;
        int64_t j = 0;
        const v8f mv = v8f_splat(m);
        v8f sums = v8f_splat(0.0f);
        for (; j + 8 <= L; j += 8) {
            const v8f e = v8f_exp(v8f_load(scores + j) - mv);
            v8f_store(scores + j, e);
            sums += e;
        }
        sum = v8f_sum(sums);
        for (; j < L; j++) {
            scores[j] = expf(scores[j] - m);
            sum += scores[j];
        }
        for (int64_t d = 0; d < D; d += 8) v8f_store(acc + d, v8f_splat(0.0f));
        for (int64_t t = 0; t < L; t++) {
            const v8f p = v8f_splat(scores[t]);
            const float *v = base + t * stride + vo;
            for (int64_t d = 0; d < D; d += 8) v8f_store(acc + d, v8f_load(acc + d) + p * v8f_load(v + d));
        }
        const v8f inv = v8f_splat(1.0f / sum);
        float *o = out + i * out_stride;
        for (int64_t d = 0; d < D; d += 8) v8f_store(o + d, v8f_load(acc + d) * inv);
    }
}

/* qkv: float32 [T, 3 H D] (q heads, then k heads, then v heads); out: float32 [T, H D].
 * starts/lens: the rows of each of the num_seqs sequences (each row in at most one).
 * Returns 0, 1 for a head_dim it does not take (a multiple of 8 up to MAX_HEAD_DIM), 2
 * when the scores' buffer could not be allocated. */
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
    int failed = 0;
    /* A few hundred thousand multiply-adds do not pay for waking the other threads. */
#pragma omp parallel num_threads(num_threads) if (total * H * D >= 32768)
    {
        float *scores = malloc((size_t)longest * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < pairs; p++) {
            if (scores == NULL) continue;
            const int64_t s = p / H, h = p % H;
            const float *base = qkv + starts[s] * stride;
            attend_pair(base, stride, h * D, (H + h) * D, (2 * H + h) * D, lens[s], D, scale,
                        out + starts[s] * out_stride + h * D, out_stride, scores);
        }
        free(scores);
    }
    return failed ? 2 : 0;
}
