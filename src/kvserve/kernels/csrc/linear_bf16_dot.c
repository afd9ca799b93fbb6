/* y = x @ w^T (+ bias) for bfloat16 weights on CPUs with AVX512-BF16.
 *
 * The rows of x are rounded to bfloat16 once per call, and VDPBF16PS multiplies 32
 * bfloat16 pairs and adds them to sixteen float32 sums in one instruction: twice the
 * work per instruction of widening the weights to float32 and using FMAs, which is
 * what bounds the product once a decode batch has more than a few rows. Sums stay in
 * float32. Weights are read in their plain row-major layout, so the same tensor serves
 * this kernel, the portable one (linear.c) and PyTorch.
 *
 * Tiles are four rows of x against four weight rows (sixteen accumulators of sixteen
 * lanes, eight loads per sixteen dot-product instructions). Each thread takes panels of
 * sixteen weight rows, which stay in L1/L2 while every row of x passes over them.
 *
 * Without AVX512-BF16 the file compiles to a stub that reports it is unavailable. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vec.h"

#ifdef __AVX512BF16__
#include <immintrin.h>

#include "bf16_dot_tile.h"

#define PANEL_ROWS 16
/* Rows of x a pass over the weights serves: 128 rows of a 1536-wide input are 384 KiB of
 * bf16, which stay in L2 while every panel passes over them (all of a 512-row prefill
 * chunk would not, and would be re-read from L3 for each panel). */
#define ROW_BLOCK 128
/* Row tiles per panel from which the next panel is prefetched (see the panel loop). */
#define PREFETCH_MIN_TILES 4

int kv_has_bf16_dot(void) { return 1; }

/* x: [M, K] float32, w: [N, K] bfloat16, bias: [N] float32 or NULL, y: [M, N] float32.
 * Returns 0, or -2 when out of memory. */
int kv_linear_bf16_dot(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M,
                       int64_t K, int64_t N, int num_threads) {
    const int64_t Kp = (K + 31) / 32 * 32;
    uint16_t *xb = aligned_alloc(64, (size_t)(M * Kp * 2 + 63) / 64 * 64);
    if (xb == NULL) return -2;
    const int64_t num_panels = N / PANEL_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        /* x to bfloat16 (round to nearest even), sixteen values at a time, zero past K. */
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const float *src = x + m * K;
            __m256i *dst = (__m256i *)(xb + m * Kp);
            for (int64_t k = 0; k < Kp; k += 16) {
                const int64_t left = K - k;
                const __mmask16 mask = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
                _mm256_storeu_si256(dst++, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + k)));
            }
        }
        for (int64_t m_start = 0; m_start < M; m_start += ROW_BLOCK) {
            const int64_t m_end = M - m_start < ROW_BLOCK ? M : m_start + ROW_BLOCK;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < num_panels; p++) {
                const int64_t n_start = p * PANEL_ROWS;
                /* The next panel's weights, asked for a slice per row tile while this panel
                 * is computed: a decode step's weights come from memory, and left to the
                 * hardware's prefetcher the first tile of each panel waits on them. With
                 * few tiles there is too little work to hide the fetch behind, and the
                 * hardware does better alone. */
                const int64_t tiles = (m_end - m_start + 3) / 4;
                const char *next = (const char *)(w + (n_start + PANEL_ROWS) * K);
                const int64_t next_lines =
                    p + 1 < num_panels && tiles >= PREFETCH_MIN_TILES ? PANEL_ROWS * K * 2 / 64 : 0;
                const int64_t per_tile = (next_lines + tiles - 1) / tiles;
                int64_t asked = 0;
                for (int64_t m = m_start; m < m_end; m += 4) {
                    const int64_t mr = m_end - m < 4 ? m_end - m : 4;
                    for (const int64_t stop = min_i64(asked + per_tile, next_lines); asked < stop; asked++)
                        __builtin_prefetch(next + 64 * asked, 0, 2);
                    for (int64_t n0 = n_start; n0 < n_start + PANEL_ROWS; n0 += 4)
                        tile_rows(xb + m * Kp, Kp, w + n0 * K, K, bias, y + m * N, N, n0, mr, 4);
                }
            }
            /* The last N % 16 weight rows, one at a time. */
#pragma omp for schedule(static)
            for (int64_t n0 = num_panels * PANEL_ROWS; n0 < N; n0++)
                for (int64_t m = m_start; m < m_end; m += 4) {
                    const int64_t mr = m_end - m < 4 ? m_end - m : 4;
                    tile_rows(xb + m * Kp, Kp, w + n0 * K, K, bias, y + m * N, N, n0, mr, 1);
                }
        }
    }
    free(xb);
    return 0;
}

#else

int kv_has_bf16_dot(void) { return 0; }

int kv_linear_bf16_dot(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M,
                       int64_t K, int64_t N, int num_threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)K, (void)N, (void)num_threads;
    return -1;
}

#endif
