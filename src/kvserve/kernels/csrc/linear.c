/* y = x @ w^T (+ bias) at the sizes inference has: a few rows (decode) to a few
 * hundred (prefill chunks).
 *
 * With a handful of rows a linear layer is bound by streaming the weight from
 * memory, and BLAS libraries tuned for large products lose much of that
 * bandwidth to packing and blocking meant for many rows. Here each thread
 * walks its share of weight rows once, twelve at a time (a panel), and
 * multiplies them with every row of x while they sit in L1, four rows of x
 * against three of w in registers. */
#include <stdlib.h>

#include "kernels.h"
#include "vec.h"

#define TILE_N 4
#define PANEL_N 12 /* weight rows a thread takes at a time: three 4-row or four 3-row tiles */

static inline float bias_at(const float *bias, int64_t n) { return bias ? bias[n] : 0.0f; }

/* Four rows of x against three weight rows: twelve running dot products, which with
 * the seven vectors loaded per step fill the sixteen registers of AVX2. */
static void tile_4x3_f32(const float *x, const float *w, int64_t K, float out[4][3]) {
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K;
    v8f a00 = {0}, a01 = {0}, a02 = {0}, a10 = {0}, a11 = {0}, a12 = {0};
    v8f a20 = {0}, a21 = {0}, a22 = {0}, a30 = {0}, a31 = {0}, a32 = {0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        v8f b0 = v8f_load(w0 + k), b1 = v8f_load(w1 + k), b2 = v8f_load(w2 + k);
        v8f xa = v8f_load(x0 + k);
        a00 += xa * b0; a01 += xa * b1; a02 += xa * b2;
        xa = v8f_load(x1 + k);
        a10 += xa * b0; a11 += xa * b1; a12 += xa * b2;
        xa = v8f_load(x2 + k);
        a20 += xa * b0; a21 += xa * b1; a22 += xa * b2;
        xa = v8f_load(x3 + k);
        a30 += xa * b0; a31 += xa * b1; a32 += xa * b2;
    }
    float s[4][3] = {
        {v8f_sum(a00), v8f_sum(a01), v8f_sum(a02)},
        {v8f_sum(a10), v8f_sum(a11), v8f_sum(a12)},
        {v8f_sum(a20), v8f_sum(a21), v8f_sum(a22)},
        {v8f_sum(a30), v8f_sum(a31), v8f_sum(a32)},
    };
    for (; k < K; k++)
        for (int m = 0; m < 4; m++)
            for (int n = 0; n < 3; n++) s[m][n] += x[m * K + k] * w[n * K + k];
    memcpy(out, s, sizeof s);
}

/* Two rows of x against four weight rows: eight running dot products. */
static void tile_2x4_f32(const float *x0, const float *x1, const float *w, int64_t K, float out[2][TILE_N]) {
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    v8f a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        v8f xa = v8f_load(x0 + k), xb = v8f_load(x1 + k);
        v8f b0 = v8f_load(w0 + k), b1 = v8f_load(w1 + k);
        v8f b2 = v8f_load(w2 + k), b3 = v8f_load(w3 + k);
        a00 += xa * b0; a01 += xa * b1; a02 += xa * b2; a03 += xa * b3;
        a10 += xb * b0; a11 += xb * b1; a12 += xb * b2; a13 += xb * b3;
    }
    float s[2][TILE_N] = {
        {v8f_sum(a00), v8f_sum(a01), v8f_sum(a02), v8f_sum(a03)},
        {v8f_sum(a10), v8f_sum(a11), v8f_sum(a12), v8f_sum(a13)},
    };
    for (; k < K; k++) {
        for (int n = 0; n < TILE_N; n++) {
            s[0][n] += x0[k] * w[n * K + k];
            s[1][n] += x1[k] * w[n * K + k];
        }
    }
    memcpy(out, s, sizeof s);
}

/* One row of x against four weight rows. */
static void tile_1x4_f32(const float *x0, const float *w, int64_t K, float out[TILE_N]) {
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        v8f xa = v8f_load(x0 + k);
        a0 += xa * v8f_load(w0 + k);
        a1 += xa * v8f_load(w1 + k);
        a2 += xa * v8f_load(w2 + k);
        a3 += xa * v8f_load(w3 + k);
    }
    float s[TILE_N] = {v8f_sum(a0), v8f_sum(a1), v8f_sum(a2), v8f_sum(a3)};
    for (; k < K; k++)
        for (int n = 0; n < TILE_N; n++) s[n] += x0[k] * w[n * K + k];
    memcpy(out, s, sizeof s);
}

static float dot_f32(const float *a, const float *b, int64_t K) {
    v8f acc = {0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) acc += v8f_load(a + k) * v8f_load(b + k);
    float s = v8f_sum(acc);
    for (; k < K; k++) s += a[k] * b[k];
    return s;
}

/* Rows n0 .. n0 + PANEL_N - 1 of the output, for every row of x; w points at weight row n0. */
static void panel_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t K,
                      int64_t N, int64_t n0) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        for (int64_t n = n0; n < n0 + PANEL_N; n += 3) {
            float out[4][3];
            tile_4x3_f32(x + m * K, w + (n - n0) * K, K, out);
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 3; j++) y[(m + i) * N + n + j] = out[i][j] + bias_at(bias, n + j);
        }
    }
    for (; m + 2 <= M; m += 2) {
        for (int64_t n = n0; n < n0 + PANEL_N; n += TILE_N) {
            float out[2][TILE_N];
            tile_2x4_f32(x + m * K, x + (m + 1) * K, w + (n - n0) * K, K, out);
            for (int j = 0; j < TILE_N; j++) {
                y[m * N + n + j] = out[0][j] + bias_at(bias, n + j);
                y[(m + 1) * N + n + j] = out[1][j] + bias_at(bias, n + j);
            }
        }
    }
    if (m < M) {
        for (int64_t n = n0; n < n0 + PANEL_N; n += TILE_N) {
            float out[TILE_N];
            tile_1x4_f32(x + m * K, w + (n - n0) * K, K, out);
            for (int j = 0; j < TILE_N; j++) y[m * N + n + j] = out[j] + bias_at(bias, n + j);
        }
    }
}

/* x: [M, K], w: [N, K], bias: [N] or NULL, y: [M, N]; all contiguous float32. */
void kv_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t M,
                   int64_t K, int64_t N, int num_threads) {
    const int64_t num_panels = N / PANEL_N;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < num_panels; p++) panel_f32(x, w + p * PANEL_N * K, bias, y, M, K, N, p * PANEL_N);
        /* The last N % PANEL_N rows, one dot product each. */
#pragma omp for schedule(static)
        for (int64_t n = num_panels * PANEL_N; n < N; n++)
            for (int64_t m = 0; m < M; m++) y[m * N + n] = dot_f32(x + m * K, w + n * K, K) + bias_at(bias, n);
    }
}

/* bfloat16 weights, float32 arithmetic: kv_linear_bf16w, for CPUs without bf16 arithmetic.
 * Half the bytes to stream; at one row it was 1.3x the float32 kernel on an AVX2 EPYC,
 * where widening, not memory, then bounds it. Sixteen weights are read at a time and widened in two operations: in each
 * 32-bit lane, the even-indexed weight is the low half (shift it up) and the odd-indexed
 * one the high half (mask the low half off). x is rearranged once per call to match:
 * each run of 16 values becomes its 8 even-indexed then its 8 odd-indexed values. */
static inline void widen_bf16x16(const uint16_t *p, v8f *even, v8f *odd) {
    v8u32 bits;
    memcpy(&bits, p, sizeof bits);
    v8u32 lo = bits << 16, hi = bits & 0xFFFF0000u;
    memcpy(even, &lo, sizeof *even);
    memcpy(odd, &hi, sizeof *odd);
}

/* One (rearranged) row of x against four weight rows, over the first K16 inputs.
 * next: four later weight rows (contiguous), asked for from memory two lines per step so
 * they have arrived when their turn comes; NULL: none. A row of a thousand-odd bf16
 * values is too short for the hardware prefetcher to reach full speed before it ends,
 * and one stream of the decode step is bound by how fast the weights arrive. */
static void tile_bf16w_1x4(const float *xr, const uint16_t *w, int64_t K, int64_t K16,
                           const uint16_t *next, float out[4]) {
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t k = 0; k < K16; k += 16) {
        if (next != NULL) {
            /* The four rows take 8 K bytes over K16 / 16 steps: 128 bytes a step. */
            const char *ahead = (const char *)next + 8 * k;
            __builtin_prefetch(ahead, 0, 2);
            __builtin_prefetch(ahead + 64, 0, 2);
        }
        const v8f xe = v8f_load(xr + k), xo = v8f_load(xr + k + 8);
        v8f e0, o0, e1, o1, e2, o2, e3, o3;
        widen_bf16x16(w + k, &e0, &o0);
        widen_bf16x16(w + K + k, &e1, &o1);
        widen_bf16x16(w + 2 * K + k, &e2, &o2);
        widen_bf16x16(w + 3 * K + k, &e3, &o3);
        a0 += xe * e0 + xo * o0;
        a1 += xe * e1 + xo * o1;
        a2 += xe * e2 + xo * o2;
        a3 += xe * e3 + xo * o3;
    }
    out[0] = v8f_sum(a0), out[1] = v8f_sum(a1), out[2] = v8f_sum(a2), out[3] = v8f_sum(a3);
}

/* Four (rearranged) rows of x against two weight rows: eight running sums. */
static void tile_bf16w_4x2(const float *xr, const uint16_t *w, int64_t K, int64_t K16, float out[4][2]) {
    v8f a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
    for (int64_t k = 0; k < K16; k += 16) {
        v8f e0, o0, e1, o1;
        widen_bf16x16(w + k, &e0, &o0);
        widen_bf16x16(w + K + k, &e1, &o1);
        v8f xe = v8f_load(xr + k), xo = v8f_load(xr + k + 8);
        a00 += xe * e0 + xo * o0; a01 += xe * e1 + xo * o1;
        xe = v8f_load(xr + K16 + k), xo = v8f_load(xr + K16 + k + 8);
        a10 += xe * e0 + xo * o0; a11 += xe * e1 + xo * o1;
        xe = v8f_load(xr + 2 * K16 + k), xo = v8f_load(xr + 2 * K16 + k + 8);
        a20 += xe * e0 + xo * o0; a21 += xe * e1 + xo * o1;
        xe = v8f_load(xr + 3 * K16 + k), xo = v8f_load(xr + 3 * K16 + k + 8);
        a30 += xe * e0 + xo * o0; a31 += xe * e1 + xo * o1;
    }
    float s[4][2] = {{v8f_sum(a00), v8f_sum(a01)}, {v8f_sum(a10), v8f_sum(a11)},
                     {v8f_sum(a20), v8f_sum(a21)}, {v8f_sum(a30), v8f_sum(a31)}};
    memcpy(out, s, sizeof s);
}

/* Rows n0 .. n0 + 3 of the output for every row of x: the vector part from the tiles,
 * then the last K - K16 inputs one by one. */
static void panel_bf16w(const float *x, const float *xr, const uint16_t *w, const float *bias,
                        float *y, int64_t M, int64_t K, int64_t K16, int64_t N, int64_t n0,
                        const uint16_t *next) {
    float part[4][4];
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        float out[4][2];
        for (int c = 0; c < 4; c += 2) {
            tile_bf16w_4x2(xr + m * K16, w + (n0 + c) * K, K, K16, out);
            for (int r = 0; r < 4; r++) part[r][c] = out[r][0], part[r][c + 1] = out[r][1];
        }
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 4; c++) {
                float s = part[r][c];
                for (int64_t k = K16; k < K; k++) s += x[(m + r) * K + k] * bf16_to_f32(w[(n0 + c) * K + k]);
                y[(m + r) * N + n0 + c] = s + bias_at(bias, n0 + c);
            }
    }
    for (; m < M; m++) {
        tile_bf16w_1x4(xr + m * K16, w + n0 * K, K, K16, m == 0 ? next : NULL, part[0]);
        for (int c = 0; c < 4; c++) {
            float s = part[0][c];
            for (int64_t k = K16; k < K; k++) s += x[m * K + k] * bf16_to_f32(w[(n0 + c) * K + k]);
            y[m * N + n0 + c] = s + bias_at(bias, n0 + c);
        }
    }
}

/* Many rows of x (prefill): each thread widens one panel of weight rows into float32 once
 * and runs the float32 tiles on it, so the widening is paid once per weight, not once
 * per four rows of x. */
static void kv_linear_bf16w_widened(const float *x, const uint16_t *w, const float *bias, float *y,
                                    int64_t M, int64_t K, int64_t N, int num_threads) {
    const int64_t num_panels = N / PANEL_N;
#pragma omp parallel num_threads(num_threads)
    {
        float *panel_w = malloc(sizeof(float) * PANEL_N * K);
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < num_panels; p++) {
            if (panel_w == NULL) continue;
            const uint16_t *src = w + p * PANEL_N * K;
            for (int64_t e = 0; e < PANEL_N * K; e++) panel_w[e] = bf16_to_f32(src[e]);
            panel_f32(x, panel_w, bias, y, M, K, N, p * PANEL_N);
        }
#pragma omp for schedule(static)
        for (int64_t n = num_panels * PANEL_N; n < N; n++)
            for (int64_t m = 0; m < M; m++) {
                float s = 0.0f;
                for (int64_t k = 0; k < K; k++) s += x[m * K + k] * bf16_to_f32(w[n * K + k]);
                y[m * N + n] = s + bias_at(bias, n);
            }
        free(panel_w);
    }
}

void kv_linear_bf16w(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M,
                     int64_t K, int64_t N, int num_threads) {
    if (M >= 8) {
        kv_linear_bf16w_widened(x, w, bias, y, M, K, N, num_threads);
        return;
    }
    const int64_t K16 = K / 16 * 16;
    float *xr = malloc(sizeof(float) * (size_t)(M * K16 > 0 ? M * K16 : 1));
    if (xr == NULL) return;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K16; k += 16)
            for (int i = 0; i < 8; i++) {
                xr[m * K16 + k + i] = x[m * K + k + 2 * i];
                xr[m * K16 + k + 8 + i] = x[m * K + k + 2 * i + 1];
            }
    const int64_t num_panels = N / 4;
    const int64_t ahead = K > 0 ? (8192 + 8 * K - 1) / (8 * K) : 1;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < num_panels; p++) {
            /* Prefetch the panel at least 8 KiB ahead (a panel is 8 K bytes), within w. */
            const int64_t q = p + ahead;
            panel_bf16w(x, xr, w, bias, y, M, K, K16, N, 4 * p, q < num_panels ? w + q * 4 * K : NULL);
        }
        /* The last N % 4 rows, one plain dot product each. */
#pragma omp for schedule(static)
        for (int64_t n = 4 * num_panels; n < N; n++)
            for (int64_t m = 0; m < M; m++) {
                float s = 0.0f;
                for (int64_t k = 0; k < K; k++) s += x[m * K + k] * bf16_to_f32(w[n * K + k]);
                y[m * N + n] = s + bias_at(bias, n);
            }
    }
    free(xr);
}
