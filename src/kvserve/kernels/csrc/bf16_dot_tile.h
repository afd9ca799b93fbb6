/* The register tile of the bfloat16 dot-product kernels (AVX512-BF16): up to four rows
 * of x against up to four weight rows, sixteen float32 accumulators of sixteen lanes.
 * linear_bf16_dot.c runs it over bfloat16 weights as stored, quant_many.c over tiles of
 * quantized weight rows dequantized to bfloat16. Include only where __AVX512BF16__. */
#ifndef KVSERVE_BF16_DOT_TILE_H
#define KVSERVE_BF16_DOT_TILE_H

#include <immintrin.h>
#include <stdint.h>

/* Four sums of sixteen lanes each, as one 4-lane vector. */
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    const __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
    const __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
    const __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
    /* Lane i of d's two halves holds half of row i's sum: add the halves. */
    const __m256 d = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
    return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}

/* MR rows of xb (bf16, rows Kp apart, zero past K) against NR weight rows (K apart), for
 * output columns n0 .. n0 + NR - 1. MR and NR are constants where this is inlined. */
static inline __attribute__((always_inline)) void tile(const uint16_t *xb, int64_t Kp,
                                                       const uint16_t *w, int64_t K,
                                                       const float *bias, float *y, int64_t N,
                                                       int64_t n0, const int MR, const int NR) {
    __m512 acc[4][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[4];
        for (int j = 0; j < NR; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
        for (int i = 0; i < MR; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + i * Kp + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    if (k < K) {
        /* The last K % 32 weights; x is zero there already. */
        const __mmask32 mask = (__mmask32)((1ULL << (K - k)) - 1);
        __m512bh wv[4];
        for (int j = 0; j < NR; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * K + k);
        for (int i = 0; i < MR; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + i * Kp + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < MR; i++) {
        if (NR == 4) {
            __m128 s = sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
            if (bias) s = _mm_add_ps(s, _mm_loadu_ps(bias + n0));
            _mm_storeu_ps(y + i * N + n0, s);
        } else {
            for (int j = 0; j < NR; j++)
                y[i * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[n0 + j] : 0.0f);
        }
    }
}

/* Rows m .. m + mr - 1 (mr <= 4) of the output at columns n0 .. n0 + NR - 1. */
static inline __attribute__((always_inline)) void tile_rows(const uint16_t *xb, int64_t Kp,
                                                            const uint16_t *w, int64_t K,
                                                            const float *bias, float *y, int64_t N,
                                                            int64_t n0, int64_t mr, const int NR) {
    switch (mr) {
        case 4: tile(xb, Kp, w, K, bias, y, N, n0, 4, NR); break;
        case 3: tile(xb, Kp, w, K, bias, y, N, n0, 3, NR); break;
        case 2: tile(xb, Kp, w, K, bias, y, N, n0, 2, NR); break;
        default: tile(xb, Kp, w, K, bias, y, N, n0, 1, NR); break;
    }
}

#endif
