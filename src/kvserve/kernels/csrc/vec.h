/* Portable 8-lane float vectors (GCC vector extensions): AVX2 registers on x86-64,
 * pairs of NEON registers on Arm. Loads and stores are unaligned. */
#ifndef KVSERVE_VEC_H
#define KVSERVE_VEC_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

static inline v8f v8f_load(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void v8f_store(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f v8f_splat(float s) { return (v8f){s, s, s, s, s, s, s, s}; }

static inline float v8f_sum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

typedef int32_t v8i __attribute__((vector_size(32)));

/* Lane-wise ``mask ? a : b`` for a comparison result ``mask``. */
static inline v8f v8f_select(v8i mask, v8f a, v8f b) {
    return (v8f)((mask & (v8i)a) | (~mask & (v8i)b));
}

static inline v8f v8f_max(v8f a, v8f b) { return v8f_select(a > b, a, b); }

static inline float v8f_hmax(v8f v) {
    float m = v[0];
    for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* e^x for eight lanes: 2^n * e^r with |r| <= ln2/2 and a degree-6 polynomial for e^r,
 * within 2 ulp of expf over the range softmax uses (x <= 0); -inf gives 0. */
static inline v8f v8f_exp(v8f x) {
    const v8f lo = v8f_splat(-87.0f), hi = v8f_splat(88.0f);
    x = v8f_select(x < lo, lo, x);
    x = v8f_select(x > hi, hi, x);
    v8f n = x * v8f_splat(1.44269504088896341f);
    /* Round to nearest: conversion truncates toward zero, so add +-0.5 first. */
    n = n + v8f_select(n < 0, v8f_splat(-0.5f), v8f_splat(0.5f));
    n = __builtin_convertvector(__builtin_convertvector(n, v8i), v8f);
    v8f r = x - n * v8f_splat(0.693359375f);
    r = r + n * v8f_splat(2.12194440e-4f);
    v8f p = v8f_splat(1.9875691500e-4f);
    p = p * r + v8f_splat(1.3981999507e-3f);
    p = p * r + v8f_splat(8.3334519073e-3f);
    p = p * r + v8f_splat(4.1665795894e-2f);
    p = p * r + v8f_splat(1.6666665459e-1f);
    p = p * r + v8f_splat(5.0000001201e-1f);
    p = p * r * r + r + v8f_splat(1.0f);
    v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    v8f scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

/* bfloat16 is the top half of a float32: widening is a shift, exact. */
static inline v8f v8bf16_load(const uint16_t *p) {
    v8u16 half;
    memcpy(&half, p, sizeof half);
    v8u32 bits = __builtin_convertvector(half, v8u32) << 16;
    v8f v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

#ifdef __AVX512F__
/* Sixteen lanes: one AVX-512 register. Only where the CPU has AVX-512 (on AVX2 a pair of
 * registers per vector would double the register pressure the 8-lane loops are tiled for). */
#define KV_HAVE_V16 1
#include <immintrin.h>
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

static inline v16f v16f_load(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void v16f_store(float *p, v16f v) { memcpy(p, &v, sizeof v); }

static inline v16f v16f_splat(float s) { return (v16f){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

/* Written with intrinsics: GCC splits the vector-extension form into eight-lane halves. */
static inline v16f v16bf16_load(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (v16f)_mm512_slli_epi32(wide, 16);
}

/* The low eight lanes plus the high eight. Intrinsics, not memcpy: a copy through memory
 * takes the vector's address, and an array of accumulators folded that way stays on the
 * stack, each multiply-add loading and storing its sum. */
static inline v8f v16f_fold(v16f v) {
    const __m512 w = (__m512)v;
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1));
    return (v8f)_mm256_add_ps(_mm512_castps512_ps256(w), hi);
}

/* The steps of a sixteen-lane e^x = 2^n * e^r that every caller shares: x clamped below at
 * -87 (so -inf, a masked score, gives e^-87, about 1.6e-38, instead of NaN), n = round(x /
 * ln 2), r = x - n ln 2 (ln 2 in two parts, so r keeps its low bits), and pr = P(r) * r with
 * the degree-6 polynomial of v8f_exp, so that e^r = 1 + r + pr * r. */
typedef struct {
    __m512 n, r, pr;
} Exp16Parts;

static inline __attribute__((always_inline)) Exp16Parts exp16_parts(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    return (Exp16Parts){.n = n, .r = r, .pr = _mm512_mul_ps(p, r)};
}
#endif

#endif
