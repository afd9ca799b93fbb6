/* The K-quants (Q4_K, Q5_K, Q6_K) multiplied as GGUF stores them, and Q4_K quantization.
 *
 * A K-quant row is super-blocks of 256 values. Q4_K and Q5_K split one into eight
 * sub-blocks of 32, each with a 6-bit scale and a 6-bit minimum (value = d * sc * q -
 * dmin * m, q in 0..15 or 0..31); Q6_K into sixteen of 16 with a signed 8-bit scale
 * (value = d * sc * (q - 32), q in 0..63). The activations come quantized to KvQ8Block
 * (32 int8 values, a float scale and a float sum), one block per 32 inputs, so every
 * sub-block of 32 (or pair of 16) meets exactly one activation block: its products are
 * summed in integers and scaled once in float. The minimum's share needs no products
 * at all, only the block's sum s.
 *
 * On x86 with AVX2 each weight sub-block is unpacked to 32 unsigned bytes and multiplied
 * against the signed activation bytes eight lanes at a time (VPDPBUSD where the CPU has
 * VNNI, VPMADDUBSW + VPMADDWD otherwise); the eight lanes of every sub-block are then
 * summed with one tree of horizontal adds for the whole super-block, so the float work
 * is one multiply-add per super-block rather than one per sub-block. Several weight rows
 * share each activation block's scales, and for a few rows of activations several share
 * each unpacked weight super-block. Q4_K repacked (KV_Q4_K_R) needs no horizontal adds
 * at all; where the CPU has AVX-512 with VNNI its low and high nibbles are multiplied
 * together in 512-bit registers, to the same integers and the same floats. Elsewhere a
 * plain C path computes the same sums. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "quant_k.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KV_QK_AVX2 1
#endif

#define QK_K 256
#define Q5_K_BLOCK_BYTES 176
#define Q6_K_BLOCK_BYTES 210

/* ---- fp16 <-> float32 ------------------------------------------------------------- */

static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        /* Zero or subnormal: mantissa * 2^-24, exact in float32. */
        const float f = (float)mantissa * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* Round to nearest even, as the hardware conversion does. */
static inline uint16_t float_to_half(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00; /* NaN */
    if (ax >= 0x477ff000u) return sign | 0x7c00; /* 65520 and above round to infinity */
    if (ax < 0x38800000u) {                       /* below 2^-14: a subnormal half */
        float magnitude;
        memcpy(&magnitude, &ax, sizeof magnitude);
        return sign | (uint16_t)nearbyintf(magnitude * 0x1p24f);
    }
    /* Drop 13 mantissa bits, rounding half to even; a carry lands in the exponent. */
    const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);
    return sign | (uint16_t)((rounded - (112u << 23)) >> 13);
#endif
}

/* The smallest fp16 at or above a non-negative f (capped at the largest finite one), so
 * a scale derived from it never falls short of the range it must cover. */
static uint16_t float_to_half_up(float f) {
    if (!(f < 65504.0f)) return 0x7bff;
    uint16_t h = float_to_half(f);
    if (half_to_float(h) < f) h++;
    return h;
}

/* ---- block layouts ------------------------------------------------------------------ */

/* Q4_K and Q5_K keep eight 6-bit scales and eight 6-bit minimums in 12 bytes: bytes 0-3
 * hold scales 0-3 in their low six bits, bytes 4-7 minimums 0-3, and bytes 8-11 the low
 * four bits of scale 4+i (low nibble) and minimum 4+i (high nibble), whose top two bits
 * sit in the spare top bits of bytes i and 4+i. Unpacked here into eight bytes each, as
 * one 64-bit word (byte j = sub-block j; little-endian). */
static inline void unpack_scales_mins(const uint8_t *packed, uint64_t *scales, uint64_t *mins) {
    uint32_t a, b, c;
    memcpy(&a, packed, 4);
    memcpy(&b, packed + 4, 4);
    memcpy(&c, packed + 8, 4);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, bits45 = 0x30303030u;
    const uint32_t scales_hi = (c & low4) | ((a >> 2) & bits45);
    const uint32_t mins_hi = ((c >> 4) & low4) | ((b >> 2) & bits45);
    *scales = (uint64_t)(a & low6) | (uint64_t)scales_hi << 32;
    *mins = (uint64_t)(b & low6) | (uint64_t)mins_hi << 32;
}

static inline int byte_of(uint64_t word, int j) { return (int)((word >> (8 * j)) & 0xff); }

/* A Q4_K or Q5_K super-block's 256 quants (0..15 or 0..31), in value order: sub-blocks 2g
 * and 2g+1 are the low and the high nibbles of the same 32 bytes, and Q5_K's fifth bit of
 * value l of sub-block j is bit j of byte l of its 32 high-bit bytes. */
static inline void unpack_q45_quants(const uint8_t *block, int five, uint8_t q[QK_K]) {
    const uint8_t *qh = block + 16;
    const uint8_t *qs = block + 16 + (five ? 32 : 0);
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l++) {
            q[64 * g + l] = qs[32 * g + l] & 15;
            q[64 * g + 32 + l] = qs[32 * g + l] >> 4;
        }
    if (five)
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) q[32 * j + l] |= ((qh[l] >> j) & 1) << 4;
}

/* A Q6_K super-block's 256 quants less 32 (-32..31), in value order. Each half of 128
 * values takes 64 bytes of low nibbles (values 0-63 from their low halves, 64-127 from
 * their high halves) and 32 bytes holding the two high bits of four values each. */
static inline void unpack_q6_quants(const uint8_t *block, int8_t q[QK_K]) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = block + 64 * h, *qh = block + 128 + 32 * h;
        for (int l = 0; l < 32; l++) {
            q[128 * h + l] = (int8_t)(((ql[l] & 15) | (qh[l] & 3) << 4) - 32);
            q[128 * h + 32 + l] = (int8_t)(((ql[32 + l] & 15) | ((qh[l] >> 2) & 3) << 4) - 32);
            q[128 * h + 64 + l] = (int8_t)(((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
            q[128 * h + 96 + l] = (int8_t)(((ql[32 + l] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
        }
    }
}

/* ---- Q4_K repacked (KV_Q4_K_R) -------------------------------------------------------- */

/* Byte 4j + t of group L holds values 8L + t (low nibble) and 8L + 4 + t (high nibble) of
 * sub-block j; Q4_K's group g holds value l of sub-blocks 2g and 2g + 1 in byte l. */
static void repack_q4_k_block(const uint8_t *src, uint8_t *dst) {
    uint8_t q[QK_K];
    unpack_q45_quants(src, 0, q);
    memcpy(dst, src, 16);
    for (int L = 0; L < 4; L++)
        for (int j = 0; j < 8; j++)
            for (int t = 0; t < 4; t++)
                dst[16 + 32 * L + 4 * j + t] =
                    (uint8_t)(q[32 * j + 8 * L + t] | q[32 * j + 8 * L + 4 + t] << 4);
}

#ifdef KV_QK_AVX2
/* The same in registers: the low and high nibbles of the four groups are eight vectors
 * whose 32-bit word j belongs to sub-block j; transposed as an 8 x 8 matrix of words,
 * vector j holds sub-block j's 32 values in order (the prefill path reads every block of
 * a weight this way, so it must cost little beside the dequantization). */
static void unrepack_q4_k_block(const uint8_t *src, uint8_t *dst) {
    memcpy(dst, src, 16);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i r[8], t[8], u[8];
    for (int L = 0; L < 4; L++) {
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(src + 16 + 32 * L));
        r[2 * L] = _mm256_and_si256(packed, low4);
        r[2 * L + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    }
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm256_unpacklo_epi32(r[k], r[k + 1]);
        t[k + 1] = _mm256_unpackhi_epi32(r[k], r[k + 1]);
    }
    for (int k = 0; k < 8; k += 4) {
        u[k] = _mm256_unpacklo_epi64(t[k], t[k + 2]);
        u[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]);
        u[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]);
        u[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]);
    }
    __m256i v[8]; /* v[j]: sub-block j's values */
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
        v[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
    }
    for (int g = 0; g < 4; g++)
        _mm256_storeu_si256((__m256i *)(dst + 16 + 32 * g),
                            _mm256_or_si256(v[2 * g], _mm256_slli_epi16(v[2 * g + 1], 4)));
}
#else
static void unrepack_q4_k_block(const uint8_t *src, uint8_t *dst) {
    uint8_t q[QK_K]; /* sub-block j's values at 32 j .. 32 j + 31 */
    for (int L = 0; L < 4; L++)
        for (int j = 0; j < 8; j++)
            for (int t = 0; t < 4; t++) {
                const uint8_t byte = src[16 + 32 * L + 4 * j + t];
                q[32 * j + 8 * L + t] = byte & 0x0F;
                q[32 * j + 8 * L + 4 + t] = byte >> 4;
            }
    memcpy(dst, src, 16);
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l++)
            dst[16 + 32 * g + l] = (uint8_t)(q[64 * g + l] | q[64 * g + 32 + l] << 4);
}
#endif

int kv_q4_k_repack_pays(void) {
#ifdef KV_QK_AVX2
    return 1;
#else
    return 0; /* the plain C path puts each block back in order first */
#endif
}

/* The rows x K values' super-blocks, block_bytes each, rewritten one by one by
 * repack_block. A repacked layout keeps every block's size and place and reads no other
 * block, so a large weight splits across threads freely. Returns 0, or -1 where K is not a
 * positive multiple of 256 or rows is negative. */
static int repack_blocks(const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst,
                         int num_threads, int64_t block_bytes,
                         void (*repack_block)(const uint8_t *src, uint8_t *dst)) {
    if (K <= 0 || K % QK_K || rows < 0) return -1;
    const int64_t blocks = rows * (K / QK_K);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (blocks >= 4096)
    for (int64_t b = 0; b < blocks; b++)
        repack_block(src + b * block_bytes, dst + b * block_bytes);
    return 0;
}

int kv_q4_k_repack_rows(const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst,
                        int num_threads) {
    return repack_blocks(src, rows, K, dst, num_threads, KV_Q4_K_BLOCK_BYTES, repack_q4_k_block);
}

void kv_q8_transpose(const KvQ8Block *xb, KvQ8T *out) {
    for (int j = 0; j < 8; j++) {
        for (int k = 0; k < 8; k++) memcpy(out->q + 32 * k + 4 * j, xb[j].q + 4 * k, 4);
        out->d[j] = xb[j].d;
        out->s[j] = xb[j].s;
    }
}

/* A block as the Q4_K reading code expects it: block itself, or KV_Q4_K_R's put back in
 * order into tmp. */
static inline const uint8_t *as_q4_k(int64_t type, const uint8_t *block, uint8_t *tmp) {
    if (type != KV_Q4_K_R) return block;
    unrepack_q4_k_block(block, tmp);
    return tmp;
}

/* ---- Q6_K repacked (KV_Q6_K_R) -------------------------------------------------------- */

/* Lane i of a half's dot products sums sub-block LANE_SUB_BLOCK[i] of that half: the
 * order in which the stored layout's kernel (sum_quarters) leaves the sums, so both add
 * the same floats in the same lanes. Within each 128-bit half of a vector the lanes are
 * then sub-blocks 0, 2, 4, 6 or 1, 3, 5, 7 of the half, and a 4 x 4 transposition of
 * 32-bit words in each half brings 32 values back into order (unrepack_q6_k_block). */
static const int LANE_SUB_BLOCK[8] = {0, 2, 4, 6, 1, 3, 5, 7};

/* The value index within a super-block of byte 4i + t of V[4h + L] (quant_k.h). */
static inline int q6r_value(int h, int L, int i, int t) {
    return 128 * h + 16 * LANE_SUB_BLOCK[i] + 4 * L + t;
}

static void repack_q6_k_block(const uint8_t *src, uint8_t *dst) {
    int8_t q[QK_K];
    unpack_q6_quants(src, q);
    memset(dst, 0, 192);
    for (int h = 0; h < 2; h++)
        for (int L = 0; L < 4; L++)
            for (int i = 0; i < 8; i++)
                for (int t = 0; t < 4; t++) {
                    const int v = q[q6r_value(h, L, i, t)] + 32, b = 4 * i + t;
                    dst[32 * L + b] |= (uint8_t)((v & 15) << (4 * h));
                    dst[128 + 32 * h + b] |= (uint8_t)((v >> 4) << (2 * L));
                }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 8; i++) dst[192 + 8 * h + i] = src[192 + 8 * h + LANE_SUB_BLOCK[i]];
    memcpy(dst + 208, src + 208, 2);
}

#ifdef KV_QK_AVX2
/* V[4h + L] of a KV_Q6_K_R block, its quants as unsigned bytes (0..63): the low nibbles
 * from the first 128 bytes, the top two bits from 2L of the next 64. */
static inline __attribute__((always_inline)) void unpack_q6r(const uint8_t *block,
                                                             __m256i v[8]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
    const __m256i high0 = _mm256_loadu_si256((const __m256i *)(block + 128));
    const __m256i high1 = _mm256_loadu_si256((const __m256i *)(block + 160));
    for (int L = 0; L < 4; L++) {
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + 32 * L));
        /* bits 2L, 2L + 1 of each high byte to bits 4, 5 (16-bit shifts, masked after) */
        __m256i top0, top1;
        switch (L) {
        case 0: top0 = _mm256_slli_epi16(high0, 4), top1 = _mm256_slli_epi16(high1, 4); break;
        case 1: top0 = _mm256_slli_epi16(high0, 2), top1 = _mm256_slli_epi16(high1, 2); break;
        case 2: top0 = high0, top1 = high1; break;
        default: top0 = _mm256_srli_epi16(high0, 2), top1 = _mm256_srli_epi16(high1, 2); break;
        }
        v[L] = _mm256_or_si256(_mm256_and_si256(packed, low4), _mm256_and_si256(top0, bits45));
        v[4 + L] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low4),
                                   _mm256_and_si256(top1, bits45));
    }
}

/* Back to GGUF's layout in registers: each half's four vectors transposed as 4 x 4
 * matrices of 32-bit words per 128-bit half give c[4h + k], values 128h + 32k .. + 31 in
 * order, which are packed as Q6_K stores them (unpack_q6_quants). */
static void unrepack_q6_k_block(const uint8_t *src, uint8_t *dst) {
    __m256i v[8];
    unpack_q6r(src, v);
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i *r = v + 4 * h;
        const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]);
        const __m256i t1 = _mm256_unpackhi_epi32(r[0], r[1]);
        const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]);
        const __m256i t3 = _mm256_unpackhi_epi32(r[2], r[3]);
        const __m256i c0 = _mm256_unpacklo_epi64(t0, t2), c1 = _mm256_unpackhi_epi64(t0, t2);
        const __m256i c2 = _mm256_unpacklo_epi64(t1, t3), c3 = _mm256_unpackhi_epi64(t1, t3);
        const __m256i ql0 = _mm256_or_si256(_mm256_and_si256(c0, low4),
                                            _mm256_slli_epi16(_mm256_and_si256(c2, low4), 4));
        const __m256i ql1 = _mm256_or_si256(_mm256_and_si256(c1, low4),
                                            _mm256_slli_epi16(_mm256_and_si256(c3, low4), 4));
        /* the top two bits of each value, moved to bits 0-1 (then 2-3, 4-5, 6-7) */
        const __m256i top0 = _mm256_and_si256(_mm256_srli_epi16(c0, 4), three);
        const __m256i top1 = _mm256_and_si256(_mm256_srli_epi16(c1, 4), three);
        const __m256i top2 = _mm256_and_si256(_mm256_srli_epi16(c2, 4), three);
        const __m256i top3 = _mm256_and_si256(_mm256_srli_epi16(c3, 4), three);
        const __m256i qh = _mm256_or_si256(
            _mm256_or_si256(top0, _mm256_slli_epi16(top1, 2)),
            _mm256_or_si256(_mm256_slli_epi16(top2, 4), _mm256_slli_epi16(top3, 6)));
        _mm256_storeu_si256((__m256i *)(dst + 64 * h), ql0);
        _mm256_storeu_si256((__m256i *)(dst + 64 * h + 32), ql1);
        _mm256_storeu_si256((__m256i *)(dst + 128 + 32 * h), qh);
    }
    /* the lanes' order of scales back to sub-block order */
    const __m128i order = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    _mm_storeu_si128((__m128i *)(dst + 192),
                     _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(src + 192)), order));
    memcpy(dst + 208, src + 208, 2);
}
#else
static void unrepack_q6_k_block(const uint8_t *src, uint8_t *dst) {
    uint8_t q[QK_K]; /* the stored quants (0..63), in value order */
    for (int h = 0; h < 2; h++)
        for (int L = 0; L < 4; L++)
            for (int i = 0; i < 8; i++)
                for (int t = 0; t < 4; t++) {
                    const int b = 4 * i + t;
                    const int low = (src[32 * L + b] >> (4 * h)) & 15;
                    const int top = (src[128 + 32 * h + b] >> (2 * L)) & 3;
                    q[q6r_value(h, L, i, t)] = (uint8_t)(low | top << 4);
                }
    for (int h = 0; h < 2; h++) {
        const uint8_t *c = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            dst[64 * h + l] = (uint8_t)((c[l] & 15) | (c[64 + l] & 15) << 4);
            dst[64 * h + 32 + l] = (uint8_t)((c[32 + l] & 15) | (c[96 + l] & 15) << 4);
            dst[128 + 32 * h + l] = (uint8_t)((c[l] >> 4) | (c[32 + l] >> 4) << 2 |
                                              (c[64 + l] >> 4) << 4 | (c[96 + l] >> 4) << 6);
        }
    }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 8; i++) dst[192 + 8 * h + LANE_SUB_BLOCK[i]] = src[192 + 8 * h + i];
    memcpy(dst + 208, src + 208, 2);
}
#endif

int kv_q6_k_repack_rows(const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst,
                        int num_threads) {
    return repack_blocks(src, rows, K, dst, num_threads, Q6_K_BLOCK_BYTES, repack_q6_k_block);
}

void kv_q8_transpose16(const KvQ8Block *xb, KvQ8T16 *out) {
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 8; i++) {
            const int sub = 8 * h + LANE_SUB_BLOCK[i]; /* values 16 sub .. 16 sub + 15 */
            const KvQ8Block *block = xb + sub / 2;
            const int8_t *q = block->q + 16 * (sub % 2);
            int32_t sum = 0;
            for (int l = 0; l < 16; l++) sum += q[l];
            for (int L = 0; L < 4; L++) memcpy(out->q + 32 * (4 * h + L) + 4 * i, q + 4 * L, 4);
            out->d[8 * h + i] = block->d;
            out->o[8 * h + i] = -32 * sum;
        }
}

/* A block as the Q6_K reading code expects it: block itself, or KV_Q6_K_R's put back in
 * order into tmp. */
static inline const uint8_t *as_q6_k(int64_t type, const uint8_t *block, uint8_t *tmp) {
    if (type != KV_Q6_K_R) return block;
    unrepack_q6_k_block(block, tmp);
    return tmp;
}

static inline int is_q6_k(int64_t type) { return type == KV_GGML_Q6_K || type == KV_Q6_K_R; }

/* ---- dequantization ----------------------------------------------------------------- */

/* Products and differences are rounded separately (no fused multiply-add), the order
 * gguf's reference dequantizer computes them in, so both give the same floats. */
__attribute__((optimize("fp-contract=off"))) static void dequant_q45(const uint8_t *block,
                                                                     int five, float *out) {
    const float d = half_to_float(read_u16(block)), dmin = half_to_float(read_u16(block + 2));
    uint64_t scales, mins;
    unpack_scales_mins(block + 4, &scales, &mins);
    uint8_t q[QK_K];
    unpack_q45_quants(block, five, q);
    for (int j = 0; j < 8; j++) {
        const float scale = d * (float)byte_of(scales, j), offset = dmin * (float)byte_of(mins, j);
        for (int l = 0; l < 32; l++) {
            const float product = scale * (float)q[32 * j + l];
            out[32 * j + l] = product - offset;
        }
    }
}

__attribute__((optimize("fp-contract=off"))) static void dequant_q6(const uint8_t *block,
                                                                    float *out) {
    const int8_t *scales = (const int8_t *)(block + 192);
    const float d = half_to_float(read_u16(block + 208));
    int8_t q[QK_K];
    unpack_q6_quants(block, q);
    for (int i = 0; i < QK_K; i++) out[i] = (d * (float)scales[i / 16]) * (float)q[i];
}

static int64_t block_bytes(int64_t type) {
    switch (type) {
    case KV_GGML_Q4_K: return KV_Q4_K_BLOCK_BYTES;
    case KV_Q4_K_R: return KV_Q4_K_BLOCK_BYTES;
    case KV_GGML_Q5_K: return Q5_K_BLOCK_BYTES;
    case KV_GGML_Q6_K: return Q6_K_BLOCK_BYTES;
    case KV_Q6_K_R: return Q6_K_BLOCK_BYTES;
    default: abort(); /* quant.c hands over the K-quants only */
    }
}

void kv_qk_dequant_row(int64_t type, const uint8_t *row, int64_t K, float *out) {
    const int64_t bytes = block_bytes(type);
    uint8_t tmp[Q6_K_BLOCK_BYTES];
    for (int64_t b = 0; b < K / QK_K; b++, row += bytes, out += QK_K) {
        if (is_q6_k(type))
            dequant_q6(as_q6_k(type, row, tmp), out);
        else
            dequant_q45(as_q4_k(type, row, tmp), type == KV_GGML_Q5_K, out);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* ---- dequantization to bfloat16, in registers (quant_many.c's weight panels) -------- */

/* 32 quants (bytes; signed where is_signed) as scale * q - offset, lanes 0-15 with scale
 * and offset lo, 16-31 with hi, rounded to 32 bfloat16 values at out. */
static inline __attribute__((always_inline)) void bf16_store32(
    uint16_t *out, __m256i q, int is_signed, __m512 scale_lo, __m512 offset_lo, __m512 scale_hi,
    __m512 offset_hi) {
    const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
    const __m512i w0 = is_signed ? _mm512_cvtepi8_epi32(q0) : _mm512_cvtepu8_epi32(q0);
    const __m512i w1 = is_signed ? _mm512_cvtepi8_epi32(q1) : _mm512_cvtepu8_epi32(q1);
    const __m512 lo = _mm512_fmsub_ps(scale_lo, _mm512_cvtepi32_ps(w0), offset_lo);
    const __m512 hi = _mm512_fmsub_ps(scale_hi, _mm512_cvtepi32_ps(w1), offset_hi);
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* The values of kv_qk_dequant_row rounded to bfloat16 (the scale's product and the
 * minimum's are fused here, one float32 rounding apart from the reference), a 32-value
 * sub-block per step with no float32 row in between. */
void kv_qk_dequant_row_bf16(int64_t type, const uint8_t *row, int64_t K, uint16_t *out) {
    const int64_t bytes = block_bytes(type);
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i three = _mm256_set1_epi8(3), bias32 = _mm256_set1_epi8(32);
    uint8_t tmp[Q6_K_BLOCK_BYTES];
    for (int64_t b = 0; b < K / QK_K; b++, row += bytes, out += QK_K) {
        if (is_q6_k(type)) {
            const uint8_t *blk = as_q6_k(type, row, tmp);
            const int8_t *scales = (const int8_t *)(blk + 192);
            const float d = half_to_float(read_u16(blk + 208));
            const __m512 zero = _mm512_setzero_ps();
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = blk + 64 * h, *qhp = blk + 128 + 32 * h;
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)qhp);
                __m256i q[4];
                q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4),
                                       _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
                q[1] = _mm256_or_si256(
                    _mm256_and_si256(l1, low4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4));
                q[2] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4));
                q[3] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4));
                for (int g = 0; g < 4; g++) {
                    const int c = 8 * h + 2 * g; /* the scales of values 16c .. 16c + 31 */
                    bf16_store32(out + 128 * h + 32 * g, _mm256_sub_epi8(q[g], bias32), 1,
                                 _mm512_set1_ps(d * (float)scales[c]), zero,
                                 _mm512_set1_ps(d * (float)scales[c + 1]), zero);
                }
            }
            continue;
        }
        const int five = type == KV_GGML_Q5_K;
        const uint8_t *blk = as_q4_k(type, row, tmp);
        const float d = half_to_float(read_u16(blk)), dmin = half_to_float(read_u16(blk + 2));
        uint64_t scales, mins;
        unpack_scales_mins(blk + 4, &scales, &mins);
        const uint8_t *qs = blk + 16 + (five ? 32 : 0);
        const __m256i qh =
            five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
            for (int half = 0; half < 2; half++) {
                const int j = 2 * g + half;
                __m256i q = half ? _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4)
                                 : _mm256_and_si256(packed, low4);
                if (five) /* bit j of each high-bit byte is the fifth bit of sub-block j */
                    q = _mm256_or_si256(q, _mm256_slli_epi16(
                                               _mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4));
                const __m512 scale = _mm512_set1_ps(d * (float)byte_of(scales, j));
                const __m512 offset = _mm512_set1_ps(dmin * (float)byte_of(mins, j));
                bf16_store32(out + 32 * j, q, 0, scale, offset, scale, offset);
            }
        }
    }
}
#endif

#ifndef KV_QK_AVX2
/* ---- dot products: plain C ---------------------------------------------------------- */

/* The loops over 32 (or 16) bytes are simple enough for the compiler to vectorize. */
static inline int32_t dot_u8_i8(const uint8_t *w, const int8_t *x, int n) {
    int32_t sum = 0;
    for (int l = 0; l < n; l++) sum += (int32_t)w[l] * x[l];
    return sum;
}

static inline int32_t dot_i8_i8(const int8_t *w, const int8_t *x, int n) {
    int32_t sum = 0;
    for (int l = 0; l < n; l++) sum += (int32_t)w[l] * x[l];
    return sum;
}

/* One weight super-block against the eight activation blocks it meets. */
static float dot_q45_plain(const uint8_t *block, int five, const KvQ8Block *xb) {
    const float d = half_to_float(read_u16(block)), dmin = half_to_float(read_u16(block + 2));
    uint64_t scales, mins;
    unpack_scales_mins(block + 4, &scales, &mins);
    uint8_t q[QK_K];
    unpack_q45_quants(block, five, q);
    float sum = 0.0f, offset = 0.0f;
    for (int j = 0; j < 8; j++) {
        const int32_t dot = dot_u8_i8(q + 32 * j, xb[j].q, 32);
        sum += (float)byte_of(scales, j) * xb[j].d * (float)dot;
        offset += (float)byte_of(mins, j) * xb[j].s;
    }
    return d * sum - dmin * offset;
}

static float dot_q6_plain(const uint8_t *block, const KvQ8Block *xb) {
    const int8_t *scales = (const int8_t *)(block + 192);
    int8_t q[QK_K];
    unpack_q6_quants(block, q);
    float sum = 0.0f;
    for (int t = 0; t < 8; t++) {
        const int32_t first = dot_i8_i8(q + 32 * t, xb[t].q, 16);
        const int32_t second = dot_i8_i8(q + 32 * t + 16, xb[t].q + 16, 16);
        sum += ((float)scales[2 * t] * (float)first + (float)scales[2 * t + 1] * (float)second) *
               xb[t].d;
    }
    return half_to_float(read_u16(block + 208)) * sum;
}

static void dot_rows_plain(int64_t type, const KvQ8Block *xq, int64_t M, int64_t K,
                           const uint8_t *w, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const int64_t bytes = block_bytes(type), blocks = K / QK_K, row_bytes = blocks * bytes;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m = 0; m < M; m++) {
            const KvQ8Block *x = xq + m * (K / 32);
            const uint8_t *row = w + n * row_bytes;
            float sum = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                uint8_t tmp[Q6_K_BLOCK_BYTES];
                sum += is_q6_k(type)
                           ? dot_q6_plain(as_q6_k(type, row + b * bytes, tmp), x + 8 * b)
                           : dot_q45_plain(as_q4_k(type, row + b * bytes, tmp),
                                           type == KV_GGML_Q5_K, x + 8 * b);
            }
            y[m * ldy + n] = sum;
        }
    }
}

#else
/* ---- dot products: AVX2, VNNI where present ----------------------------------------- */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Lane i: the sum of the four products of unsigned weight bytes 4i..4i+3 with signed
 * activation bytes. Weight bytes are at most 63, so VPMADDUBSW's 16-bit pair sums never
 * saturate (63 * 128 * 2 < 32767). */
ALWAYS_INLINE __m256i dot4_lanes(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

/* [sum of lanes 0-3 of a, b, c, d; sum of lanes 4-7 of a, b, c, d]. */
ALWAYS_INLINE __m256i sum_quarters(__m256i a, __m256i b, __m256i c, __m256i d) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
}

/* The eight lane sums of p[0..7], in order. */
ALWAYS_INLINE __m256i sum_eights(const __m256i p[8]) {
    const __m256i lo = sum_quarters(p[0], p[1], p[2], p[3]);
    const __m256i hi = sum_quarters(p[4], p[5], p[6], p[7]);
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                            _mm256_permute2x128_si256(lo, hi, 0x31));
}

ALWAYS_INLINE __m256 bytes_to_floats(uint64_t eight) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)eight)));
}

ALWAYS_INLINE __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* The scales and sums of the eight activation blocks of one super-block. */
typedef struct {
    __m256 d, s;
} ActScales;

ALWAYS_INLINE ActScales act_scales(const KvQ8Block *xb) {
    ActScales a;
    a.d = _mm256_setr_ps(xb[0].d, xb[1].d, xb[2].d, xb[3].d, xb[4].d, xb[5].d, xb[6].d, xb[7].d);
    a.s = _mm256_setr_ps(xb[0].s, xb[1].s, xb[2].s, xb[3].s, xb[4].s, xb[5].s, xb[6].s, xb[7].s);
    return a;
}

/* A Q4_K or Q5_K super-block's float factors (KV_Q4_K_R's are where Q4_K keeps them): d
 * times each sub-block's scale, dmin times each sub-block's minimum, unpacked in general
 * registers, leaving the vector units to the products. */
typedef struct {
    __m256 scale, min;
} Q45Factors;

ALWAYS_INLINE Q45Factors q45_factors(const uint8_t *block) {
    uint64_t scales, mins;
    unpack_scales_mins(block + 4, &scales, &mins);
    Q45Factors s;
    s.scale = _mm256_mul_ps(_mm256_set1_ps(half_to_float(read_u16(block))), bytes_to_floats(scales));
    s.min = _mm256_mul_ps(_mm256_set1_ps(half_to_float(read_u16(block + 2))), bytes_to_floats(mins));
    return s;
}

/* A Q4_K or Q5_K super-block unpacked: sub-block j's quants as 32 bytes, d * scale and
 * dmin * minimum per sub-block. */
typedef struct {
    __m256i q[8];
    __m256 scale, min;
} Q45Block;

/* Bit j of each byte of high, moved to bit 4 (16-bit shifts: bit 4 of a byte only ever
 * receives a bit of the same byte). */
ALWAYS_INLINE __m256i fifth_bit(__m256i high, int j) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    switch (j) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(high, 4), bit4);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(high, 3), bit4);
    case 2: return _mm256_and_si256(_mm256_slli_epi16(high, 2), bit4);
    case 3: return _mm256_and_si256(_mm256_slli_epi16(high, 1), bit4);
    case 4: return _mm256_and_si256(high, bit4);
    case 5: return _mm256_and_si256(_mm256_srli_epi16(high, 1), bit4);
    case 6: return _mm256_and_si256(_mm256_srli_epi16(high, 2), bit4);
    default: return _mm256_and_si256(_mm256_srli_epi16(high, 3), bit4);
    }
}

ALWAYS_INLINE void unpack_q45(const uint8_t *block, int five, Q45Block *u) {
    const Q45Factors factors = q45_factors(block);
    u->scale = factors.scale;
    u->min = factors.min;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const uint8_t *qs = block + 16 + (five ? 32 : 0);
    for (int g = 0; g < 4; g++) {
        const __m256i packed = load256(qs + 32 * g);
        u->q[2 * g] = _mm256_and_si256(packed, low4);
        u->q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    }
    if (five) {
        const __m256i high = load256(block + 16);
        for (int j = 0; j < 8; j++) u->q[j] = _mm256_or_si256(u->q[j], fifth_bit(high, j));
    }
}

/* acc += this super-block's share of one row's dot product with one activation row. */
ALWAYS_INLINE __m256 madd_q45(const Q45Block *u, const KvQ8Block *xb, ActScales a, __m256 acc) {
    __m256i p[8];
    for (int j = 0; j < 8; j++) p[j] = dot4_lanes(u->q[j], load256(xb[j].q));
    const __m256 dots = _mm256_cvtepi32_ps(sum_eights(p));
    acc = _mm256_fmadd_ps(dots, _mm256_mul_ps(u->scale, a.d), acc);
    return _mm256_fnmadd_ps(u->min, a.s, acc);
}

/* A Q6_K super-block unpacked: chunk t's 32 quants (0..63) as bytes, and d * scale for
 * its 16 sub-blocks in the order the sums come out of sum_quarters: [0 2 4 6 1 3 5 7] for
 * chunks 0-3, [8 10 12 14 9 11 13 15] for chunks 4-7. */
typedef struct {
    __m256i q[8];
    __m256 scale_lo, scale_hi;
} Q6Block;

ALWAYS_INLINE void unpack_q6(const uint8_t *block, Q6Block *u) {
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    const __m128i scales = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(block + 192)), order);
    const __m256 d = _mm256_set1_ps(half_to_float(read_u16(block + 208)));
    u->scale_lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales)));
    u->scale_hi =
        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8))));
    const __m256i low4 = _mm256_set1_epi8(0x0f), bits45 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i la = load256(block + 64 * h), lb = load256(block + 64 * h + 32);
        const __m256i high = load256(block + 128 + 32 * h);
        __m256i *q = u->q + 4 * h;
        q[0] = _mm256_or_si256(_mm256_and_si256(la, low4),
                               _mm256_and_si256(_mm256_slli_epi16(high, 4), bits45));
        q[1] = _mm256_or_si256(_mm256_and_si256(lb, low4),
                               _mm256_and_si256(_mm256_slli_epi16(high, 2), bits45));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), low4),
                               _mm256_and_si256(high, bits45));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(high, 2), bits45));
    }
}

/* One activation row's super-block for Q6_K: its scales, repeated per half-chunk pair
 * ([d0 d1 d2 d3 d0 d1 d2 d3] and [d4 .. d7 d4 .. d7]), and 32 times its sums of 16
 * values in sum_quarters order: the quants are stored 32 above their value. */
typedef struct {
    __m256 d_lo, d_hi;
    __m256i offset_lo, offset_hi;
} Q6Act;

ALWAYS_INLINE Q6Act q6_act(const KvQ8Block *xb) {
    Q6Act a;
    const __m256 d = act_scales(xb).d;
    a.d_lo = _mm256_permute2f128_ps(d, d, 0x00);
    a.d_hi = _mm256_permute2f128_ps(d, d, 0x11);
    const __m256i ones = _mm256_set1_epi8(1);
    __m256i p[8];
    for (int t = 0; t < 8; t++) p[t] = dot4_lanes(ones, load256(xb[t].q));
    a.offset_lo = _mm256_slli_epi32(sum_quarters(p[0], p[1], p[2], p[3]), 5);
    a.offset_hi = _mm256_slli_epi32(sum_quarters(p[4], p[5], p[6], p[7]), 5);
    return a;
}

ALWAYS_INLINE __m256 madd_q6(const Q6Block *u, const KvQ8Block *xb, const Q6Act *a, __m256 acc) {
    __m256i p[8];
    for (int t = 0; t < 8; t++) p[t] = dot4_lanes(u->q[t], load256(xb[t].q));
    const __m256i lo = _mm256_sub_epi32(sum_quarters(p[0], p[1], p[2], p[3]), a->offset_lo);
    const __m256i hi = _mm256_sub_epi32(sum_quarters(p[4], p[5], p[6], p[7]), a->offset_hi);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(u->scale_lo, a->d_lo), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(u->scale_hi, a->d_hi), acc);
}

static inline float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* Each weight row is short (a row of 2048 inputs is 18 cache lines of Q4_K) and a tile
 * walks several at once, too little of each for the hardware prefetcher to lock on: the
 * block at the same place one tile further on (the next rows are next in memory) is
 * fetched into L2 while this one is multiplied (into L2 rather than L1: measured faster,
 * the L1 has fewer misses in flight). Past the last row this touches no page it may not:
 * a prefetch never faults. */
ALWAYS_INLINE void prefetch_block(const uint8_t *p, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64)
        _mm_prefetch((const char *)(p + offset), _MM_HINT_T1);
    _mm_prefetch((const char *)(p + bytes - 1), _MM_HINT_T1); /* a block not line-aligned */
}

#define MAX_TILE_M 4
#define MAX_TILE_N 4

/* y[m][n] for MT activation rows (from x, stride x_stride blocks) and NR weight rows (from
 * w, stride row_bytes): each weight super-block is unpacked once for the MT activation
 * rows, each activation super-block's scales gathered once for the NR weight rows. */
ALWAYS_INLINE void tile_q45(int five, const KvQ8Block *x, int64_t x_stride, const uint8_t *w,
                            int64_t row_bytes, int64_t blocks, float *y, int64_t ldy,
                            const int MT, const int NR) {
    const int64_t bytes = five ? Q5_K_BLOCK_BYTES : KV_Q4_K_BLOCK_BYTES;
    __m256 acc[MAX_TILE_M][MAX_TILE_N];
    for (int m = 0; m < MT; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        ActScales a[MAX_TILE_M];
        for (int m = 0; m < MT; m++) a[m] = act_scales(x + m * x_stride + 8 * b);
        for (int r = 0; r < NR; r++) {
            Q45Block u;
            prefetch_block(w + (r + NR) * row_bytes + b * bytes, bytes);
            unpack_q45(w + r * row_bytes + b * bytes, five, &u);
            for (int m = 0; m < MT; m++)
                acc[m][r] = madd_q45(&u, x + m * x_stride + 8 * b, a[m], acc[m][r]);
        }
    }
    for (int m = 0; m < MT; m++)
        for (int r = 0; r < NR; r++) y[m * ldy + r] = hsum(acc[m][r]);
}

ALWAYS_INLINE void tile_q6(const KvQ8Block *x, int64_t x_stride, const uint8_t *w,
                           int64_t row_bytes, int64_t blocks, float *y, int64_t ldy, const int MT,
                           const int NR) {
    __m256 acc[MAX_TILE_M][MAX_TILE_N];
    for (int m = 0; m < MT; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        Q6Act a[MAX_TILE_M];
        for (int m = 0; m < MT; m++) a[m] = q6_act(x + m * x_stride + 8 * b);
        for (int r = 0; r < NR; r++) {
            Q6Block u;
            prefetch_block(w + (r + NR) * row_bytes + b * Q6_K_BLOCK_BYTES, Q6_K_BLOCK_BYTES);
            unpack_q6(w + r * row_bytes + b * Q6_K_BLOCK_BYTES, &u);
            for (int m = 0; m < MT; m++)
                acc[m][r] = madd_q6(&u, x + m * x_stride + 8 * b, &a[m], acc[m][r]);
        }
    }
    for (int m = 0; m < MT; m++)
        for (int r = 0; r < NR; r++) y[m * ldy + r] = hsum(acc[m][r]);
}

/* acc + the integer dot products of 32 weight bytes with 32 activation bytes, per 32-bit
 * lane (four products each). */
ALWAYS_INLINE __m256i dot4_acc(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

/* acc + one super-block's float work once its eight sub-block sums are in dots: each sum
 * times its factor and the activations' sub-block scale, less the sub-block's minimum
 * times the activations' sub-block sums. */
ALWAYS_INLINE __m256 q4kr_scaled(Q45Factors s, __m256 dots, const KvQ8T *x, __m256 acc) {
    acc = _mm256_fmadd_ps(dots, _mm256_mul_ps(s.scale, _mm256_loadu_ps(x->d)), acc);
    return _mm256_fnmadd_ps(s.min, _mm256_loadu_ps(x->s), acc);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KV_Q4R_AVX512 1
/* A KV_Q4_K_R super-block's quants ready for VPDPBUSD, with AVX-512: group L's 32 packed
 * bytes fill both halves of one register, the low nibbles kept in the lower half and the
 * high nibbles in place (16 times their value) in the upper, so one VPDPBUSD meets them
 * with the 64 activation bytes at x->q + 64 L (those for the low nibbles, then those for
 * the high ones). */
typedef struct {
    __m512i q[4];
} Q4krQuants;

ALWAYS_INLINE void q4kr_quants(const uint8_t *block, Q4krQuants *u) {
    const __m512i nibbles =
        _mm512_inserti64x4(_mm512_set1_epi8(0x0f), _mm256_set1_epi8((char)0xf0), 1);
    for (int L = 0; L < 4; L++)
        u->q[L] = _mm512_and_si512(_mm512_broadcast_i64x4(load256(block + 16 + 32 * L)), nibbles);
}

/* The eight sub-block sums of one row's super-block against one activation row's. The
 * upper half's sums are exactly 16 times the high nibbles' (at most 16 * 15 * 128 * 16,
 * far from overflowing) and one shift per super-block, not one per group, brings them
 * down: lane j of the two halves' sum is sub-block j's whole sum, the integers the AVX2
 * version gets, so the same floats come out. (Unpacking the scales and minimums in vector
 * registers too was measured slower on Zen 4: the vector units are the bottleneck.) */
ALWAYS_INLINE __m256 q4kr_dots(const Q4krQuants *u, const KvQ8T *x) {
    __m512i sums = _mm512_setzero_si512();
    for (int L = 0; L < 4; L++)
        sums = _mm512_dpbusd_epi32(sums, u->q[L], _mm512_loadu_si512(x->q + 64 * L));
    const __m256i high = _mm256_srai_epi32(_mm512_extracti64x4_epi64(sums, 1), 4);
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm512_castsi512_si256(sums), high));
}
#else
/* The same with AVX2: the low and the high nibbles of each group in registers of their
 * own; lane j of the integer sums is sub-block j's whole sum, so the same float work as
 * madd_q45 follows with no horizontal additions (and the same floats come out). */
typedef struct {
    __m256i lo[4], hi[4];
} Q4krQuants;

ALWAYS_INLINE void q4kr_quants(const uint8_t *block, Q4krQuants *u) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int L = 0; L < 4; L++) {
        const __m256i packed = load256(block + 16 + 32 * L);
        u->lo[L] = _mm256_and_si256(packed, low4);
        u->hi[L] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    }
}

ALWAYS_INLINE __m256 q4kr_dots(const Q4krQuants *u, const KvQ8T *x) {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int L = 0; L < 4; L++) {
        lo = dot4_acc(lo, u->lo[L], load256(x->q + 64 * L));
        hi = dot4_acc(hi, u->hi[L], load256(x->q + 64 * L + 32));
    }
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
}
#endif

/* acc += a KV_Q4_K_R super-block's share of one row's dot product. */
ALWAYS_INLINE __m256 madd_q4kr(const uint8_t *block, const KvQ8T *x, __m256 acc) {
    Q4krQuants u;
    q4kr_quants(block, &u);
    return q4kr_scaled(q45_factors(block), q4kr_dots(&u, x), x, acc);
}

/* Activation rows taken together against each tile of four weight rows when there are
 * several (a batch, a prompt): each weight block's quants are unpacked once for all of
 * them, and its float factors once per call. With AVX-512, four activation rows against
 * the tile's four weight rows at once; with AVX2, four against one weight row at a time
 * (q4kr_row below). */
#ifdef KV_Q4R_AVX512
#define Q4KR_MT 4

/* MT activation rows (x, consecutive rows of blocks super-blocks) against the four weight
 * rows row[], whose factors are sc[4 b + r]; y[m][r] for r < nr. ahead: how far on to
 * prefetch each block (0: not at all). Each (activation row,
 * weight row) pair adds its super-blocks in order with the arithmetic of madd_q4kr, so
 * every output is the float one row at a time gives. */
ALWAYS_INLINE void q4kr_rows(const KvQ8T *x, int64_t blocks, const uint8_t *const row[4],
                             const Q45Factors *sc, int64_t ahead, float *y, int64_t ldy,
                             int64_t nr, const int MT) {
    __m256 acc[Q4KR_MT][4];
    for (int m = 0; m < MT; m++)
        for (int r = 0; r < 4; r++) acc[m][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++)
        for (int r = 0; r < 4; r++) {
            const uint8_t *block = row[r] + b * KV_Q4_K_BLOCK_BYTES;
            if (ahead) prefetch_block(block + ahead, KV_Q4_K_BLOCK_BYTES);
            Q4krQuants u;
            q4kr_quants(block, &u);
            for (int m = 0; m < MT; m++) {
                const KvQ8T *xm = x + m * blocks + b;
                acc[m][r] = q4kr_scaled(sc[4 * b + r], q4kr_dots(&u, xm), xm, acc[m][r]);
            }
        }
    for (int m = 0; m < MT; m++)
        for (int64_t r = 0; r < nr; r++) y[m * ldy + r] = hsum(acc[m][r]);
}
#else
/* With AVX2's sixteen registers, MT activation rows against one weight row at a time: its
 * block's quants (eight registers) are unpacked once for the MT rows, whose sums (MT
 * more) fit beside them, where four weight rows' sums for two activation rows spilled.
 * sc: this row's factors, sc[4 b] for block b. The arithmetic of each (activation row,
 * weight row) pair is madd_q4kr's, block after block, so the same floats come out. */
#define Q4KR_ROW_MT 4
ALWAYS_INLINE void q4kr_row(const KvQ8T *x, int64_t blocks, const uint8_t *row,
                            const Q45Factors *sc, int64_t ahead, float *y, int64_t ldy,
                            const int MT) {
    __m256 acc[Q4KR_ROW_MT];
    for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + b * KV_Q4_K_BLOCK_BYTES;
        if (ahead) prefetch_block(block + ahead, KV_Q4_K_BLOCK_BYTES);
        Q4krQuants u;
        q4kr_quants(block, &u);
        for (int m = 0; m < MT; m++) {
            const KvQ8T *xm = x + m * blocks + b;
            acc[m] = q4kr_scaled(sc[4 * b], q4kr_dots(&u, xm), xm, acc[m]);
        }
    }
    for (int m = 0; m < MT; m++) y[m * ldy] = hsum(acc[m]);
}
#endif

/* Four weight rows at a time against each row of xt in turn (the four rows stay in L1
 * between activation rows); a last tile of fewer rows repeats its last row and stores
 * only its own. */
static void dot_rows_q4kr(const KvQ8T *xt, int64_t M, int64_t K, const uint8_t *w, int64_t n0,
                          int64_t n1, float *y, int64_t ldy) {
    const int64_t blocks = K / QK_K, row_bytes = blocks * KV_Q4_K_BLOCK_BYTES;
    int64_t ahead = 4 * row_bytes; /* the same block of the next tile's rows */
#ifdef KV_Q4R_AVX512
    /* A tile of short rows goes by so fast here that one tile ahead is too late for
     * memory: at least 8 KiB ahead (two tiles for rows of 2048 inputs, one for 8192). */
    while (ahead < 8192) ahead += 4 * row_bytes;
#endif
    /* The float factors of a tile's blocks, when activation rows share them. */
    Q45Factors *sc = M > 1 ? aligned_alloc(32, sizeof(Q45Factors) * (size_t)(4 * blocks)) : NULL;
    if (M > 1 && sc == NULL) abort();
    for (int64_t n = n0; n < n1; n += 4) {
        const int64_t nr = n1 - n < 4 ? n1 - n : 4;
        const uint8_t *row[4];
        for (int64_t r = 0; r < 4; r++) row[r] = w + (n + (r < nr ? r : nr - 1)) * row_bytes;
        if (M == 1) { /* one stream: the factors unpacked as the blocks go by */
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
            for (int64_t b = 0; b < blocks; b++)
                for (int r = 0; r < 4; r++) {
                    const uint8_t *block = row[r] + b * KV_Q4_K_BLOCK_BYTES;
                    prefetch_block(block + ahead, KV_Q4_K_BLOCK_BYTES);
                    acc[r] = madd_q4kr(block, xt + b, acc[r]);
                }
            for (int64_t r = 0; r < nr; r++) y[n + r] = hsum(acc[r]);
            continue;
        }
        for (int64_t b = 0; b < blocks; b++)
            for (int r = 0; r < 4; r++)
                sc[4 * b + r] = q45_factors(row[r] + b * KV_Q4_K_BLOCK_BYTES);
        int64_t m = 0;
#ifdef KV_Q4R_AVX512
        for (; m + Q4KR_MT <= M; m += Q4KR_MT)
            q4kr_rows(xt + m * blocks, blocks, row, sc, m == 0 ? ahead : 0,
                      y + m * ldy + n, ldy, nr, Q4KR_MT);
        for (; m < M; m++)
            q4kr_rows(xt + m * blocks, blocks, row, sc, m == 0 ? ahead : 0,
                      y + m * ldy + n, ldy, nr, 1);
#else
        for (; m + Q4KR_ROW_MT <= M; m += Q4KR_ROW_MT)
            for (int64_t r = 0; r < nr; r++)
                q4kr_row(xt + m * blocks, blocks, row[r], sc + r, m == 0 ? ahead : 0,
                         y + m * ldy + n + r, ldy, Q4KR_ROW_MT);
        for (; m < M; m++)
            for (int64_t r = 0; r < nr; r++)
                q4kr_row(xt + m * blocks, blocks, row[r], sc + r, m == 0 ? ahead : 0,
                         y + m * ldy + n + r, ldy, 1);
#endif
    }
    free(sc);
}

/* A KV_Q6_K_R super-block's float factors: d times its sixteen scales (stored in lane
 * order), the first half's eight then the second's. */
typedef struct {
    __m256 lo, hi;
} Q6krScales;

ALWAYS_INLINE Q6krScales q6kr_scales(const uint8_t *block) {
    const __m128i scales = _mm_loadu_si128((const __m128i *)(block + 192));
    const __m256 d = _mm256_set1_ps(half_to_float(read_u16(block + 208)));
    Q6krScales s;
    s.lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales)));
    s.hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8))));
    return s;
}

/* acc += a KV_Q6_K_R super-block's share of one row's dot product, its quants unpacked in
 * v (unpack_q6r). Each half's integer sums start from -32 times the activations' sums
 * (the quants are stored 32 above their values) and lane i ends with sub-block
 * LANE_SUB_BLOCK[i]'s whole sum, the integers madd_q6 gets from sum_quarters; the float
 * work after is madd_q6's, in the same lanes, so the same floats come out. */
ALWAYS_INLINE __m256 q6kr_madd(const __m256i v[8], Q6krScales s, const KvQ8T16 *x, __m256 acc) {
    __m256i lo = _mm256_loadu_si256((const __m256i *)x->o);
    __m256i hi = _mm256_loadu_si256((const __m256i *)(x->o + 8));
    for (int L = 0; L < 4; L++) {
        lo = dot4_acc(lo, v[L], load256(x->q + 32 * L));
        hi = dot4_acc(hi, v[4 + L], load256(x->q + 128 + 32 * L));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(s.lo, _mm256_loadu_ps(x->d)), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(s.hi, _mm256_loadu_ps(x->d + 8)),
                           acc);
}

#ifdef KV_Q4R_AVX512
/* q4kr_rows for KV_Q6_K_R: each weight block unpacked once for MT activation rows. */
ALWAYS_INLINE void q6kr_rows(const KvQ8T16 *x, int64_t blocks, const uint8_t *const row[4],
                             const Q6krScales *sc, int64_t ahead, float *y, int64_t ldy,
                             int64_t nr, const int MT) {
    __m256 acc[Q4KR_MT][4];
    for (int m = 0; m < MT; m++)
        for (int r = 0; r < 4; r++) acc[m][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++)
        for (int r = 0; r < 4; r++) {
            const uint8_t *block = row[r] + b * Q6_K_BLOCK_BYTES;
            if (ahead) prefetch_block(block + ahead, Q6_K_BLOCK_BYTES);
            __m256i v[8];
            unpack_q6r(block, v);
            for (int m = 0; m < MT; m++)
                acc[m][r] = q6kr_madd(v, sc[4 * b + r], x + m * blocks + b, acc[m][r]);
        }
    for (int m = 0; m < MT; m++)
        for (int64_t r = 0; r < nr; r++) y[m * ldy + r] = hsum(acc[m][r]);
}
#else
/* q4kr_row for KV_Q6_K_R: one weight row's unpacked block (eight registers) for MT
 * activation rows at a time; sc: this row's scales, sc[4 b] for block b. */
#define Q6KR_ROW_MT 4
ALWAYS_INLINE void q6kr_row(const KvQ8T16 *x, int64_t blocks, const uint8_t *row,
                            const Q6krScales *sc, int64_t ahead, float *y, int64_t ldy,
                            const int MT) {
    __m256 acc[Q6KR_ROW_MT];
    for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + b * Q6_K_BLOCK_BYTES;
        if (ahead) prefetch_block(block + ahead, Q6_K_BLOCK_BYTES);
        __m256i v[8];
        unpack_q6r(block, v);
        for (int m = 0; m < MT; m++) acc[m] = q6kr_madd(v, sc[4 * b], x + m * blocks + b, acc[m]);
    }
    for (int m = 0; m < MT; m++) y[m * ldy] = hsum(acc[m]);
}
#endif

/* dot_rows_q4kr's loop for KV_Q6_K_R. */
static void dot_rows_q6kr(const KvQ8T16 *xt, int64_t M, int64_t K, const uint8_t *w, int64_t n0,
                          int64_t n1, float *y, int64_t ldy) {
    const int64_t blocks = K / QK_K, row_bytes = blocks * Q6_K_BLOCK_BYTES;
    Q6krScales *sc = M > 1 ? aligned_alloc(32, sizeof(Q6krScales) * (size_t)(4 * blocks)) : NULL;
    if (M > 1 && sc == NULL) abort();
    for (int64_t n = n0; n < n1; n += 4) {
        const int64_t nr = n1 - n < 4 ? n1 - n : 4;
        const uint8_t *row[4];
        for (int64_t r = 0; r < 4; r++) row[r] = w + (n + (r < nr ? r : nr - 1)) * row_bytes;
        if (M == 1) {
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
            for (int64_t b = 0; b < blocks; b++)
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) {
                    const uint8_t *block = row[r] + b * Q6_K_BLOCK_BYTES;
                    prefetch_block(block + 4 * row_bytes, Q6_K_BLOCK_BYTES);
                    __m256i v[8];
                    unpack_q6r(block, v);
                    acc[r] = q6kr_madd(v, q6kr_scales(block), xt + b, acc[r]);
                }
            for (int64_t r = 0; r < nr; r++) y[n + r] = hsum(acc[r]);
            continue;
        }
        for (int64_t b = 0; b < blocks; b++)
            for (int r = 0; r < 4; r++)
                sc[4 * b + r] = q6kr_scales(row[r] + b * Q6_K_BLOCK_BYTES);
        int64_t m = 0;
#ifdef KV_Q4R_AVX512
        for (; m + Q4KR_MT <= M; m += Q4KR_MT)
            q6kr_rows(xt + m * blocks, blocks, row, sc, m == 0 ? 4 * row_bytes : 0,
                      y + m * ldy + n, ldy, nr, Q4KR_MT);
        for (; m < M; m++)
            q6kr_rows(xt + m * blocks, blocks, row, sc, m == 0 ? 4 * row_bytes : 0,
                      y + m * ldy + n, ldy, nr, 1);
#else
        for (; m + Q6KR_ROW_MT <= M; m += Q6KR_ROW_MT)
            for (int64_t r = 0; r < nr; r++)
                q6kr_row(xt + m * blocks, blocks, row[r], sc + r, m == 0 ? 4 * row_bytes : 0,
                         y + m * ldy + n + r, ldy, Q6KR_ROW_MT);
        for (; m < M; m++)
            for (int64_t r = 0; r < nr; r++)
                q6kr_row(xt + m * blocks, blocks, row[r], sc + r, m == 0 ? 4 * row_bytes : 0,
                         y + m * ldy + n + r, ldy, 1);
#endif
    }
    free(sc);
}

/* One instance per type and tile shape, so every loop over MT and NR unrolls. */
#define DEFINE_TILE(name, MT, NR)                                                               \
    static void name(int64_t type, const KvQ8Block *x, int64_t x_stride, const uint8_t *w,     \
                     int64_t row_bytes, int64_t blocks, float *y, int64_t ldy) {               \
        if (type == KV_GGML_Q6_K)                                                               \
            tile_q6(x, x_stride, w, row_bytes, blocks, y, ldy, MT, NR);                         \
        else if (type == KV_GGML_Q5_K)                                                          \
            tile_q45(1, x, x_stride, w, row_bytes, blocks, y, ldy, MT, NR);                     \
        else                                                                                    \
            tile_q45(0, x, x_stride, w, row_bytes, blocks, y, ldy, MT, NR);                     \
    }
DEFINE_TILE(tile_1x4, 1, 4)
DEFINE_TILE(tile_1x2, 1, 2)
DEFINE_TILE(tile_1x1, 1, 1)
DEFINE_TILE(tile_4x2, 4, 2)
DEFINE_TILE(tile_4x1, 4, 1)
DEFINE_TILE(tile_2x2, 2, 2)
DEFINE_TILE(tile_2x1, 2, 1)

typedef void (*TileFn)(int64_t, const KvQ8Block *, int64_t, const uint8_t *, int64_t, int64_t,
                       float *, int64_t);

static void dot_rows_avx2(int64_t type, const KvQ8Block *xq, int64_t M, int64_t K,
                          const uint8_t *w, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const int64_t blocks = K / QK_K, row_bytes = blocks * block_bytes(type), x_stride = K / 32;
    /* Decode (a few activation rows): four weight rows per step share every activation
     * block. More rows: two weight rows against four activation rows (two for Q6_K, whose
     * activations take twice the registers), so each unpacked weight super-block serves
     * several; the weight rows stay in cache across the steps. */
    const int64_t tile_m = type == KV_GGML_Q6_K ? 2 : MAX_TILE_M;
    const int64_t step = M < tile_m ? 4 : 2;
    for (int64_t n = n0; n < n1; n += step) {
        const int64_t nr = n1 - n < step ? n1 - n : step;
        const uint8_t *wn = w + n * row_bytes;
        int64_t m = 0;
        for (; m + tile_m <= M; m += tile_m) {
            const TileFn tile = tile_m == 2 ? (nr == 2 ? tile_2x2 : tile_2x1)
                                            : (nr == 2 ? tile_4x2 : tile_4x1);
            tile(type, xq + m * x_stride, x_stride, wn, row_bytes, blocks, y + m * ldy + n, ldy);
        }
        for (; m < M; m++) {
            const KvQ8Block *x = xq + m * x_stride;
            float *out = y + m * ldy + n;
            int64_t done = 0;
            if (nr == 4) {
                tile_1x4(type, x, x_stride, wn, row_bytes, blocks, out, ldy);
                done = 4;
            }
            for (; done + 2 <= nr; done += 2)
                tile_1x2(type, x, x_stride, wn + done * row_bytes, row_bytes, blocks, out + done,
                         ldy);
            for (; done < nr; done++)
                tile_1x1(type, x, x_stride, wn + done * row_bytes, row_bytes, blocks, out + done,
                         ldy);
        }
    }
}
#endif

void kv_qk_dot_rows_t(int64_t type, const KvQ8Block *xq, const KvQ8T *xt, const KvQ8T16 *xt16,
                      int64_t M, int64_t K, const uint8_t *w, int64_t n0, int64_t n1, float *y,
                      int64_t ldy) {
#ifdef KV_QK_AVX2
    if (type == KV_Q6_K_R) {
        KvQ8T16 *own = NULL;
        if (xt16 == NULL) {
            const int64_t count = M * (K / QK_K);
            own = malloc(sizeof(KvQ8T16) * (size_t)(count > 0 ? count : 1));
            if (own == NULL) abort();
            for (int64_t i = 0; i < count; i++) kv_q8_transpose16(xq + 8 * i, own + i);
            xt16 = own;
        }
        dot_rows_q6kr(xt16, M, K, w, n0, n1, y, ldy);
        free(own);
        return;
    }
    if (type == KV_Q4_K_R) {
        KvQ8T *own = NULL;
        if (xt == NULL) {
            const int64_t count = M * (K / QK_K);
            own = malloc(sizeof(KvQ8T) * (size_t)(count > 0 ? count : 1));
            if (own == NULL) abort();
            for (int64_t i = 0; i < count; i++) kv_q8_transpose(xq + 8 * i, own + i);
            xt = own;
        }
        dot_rows_q4kr(xt, M, K, w, n0, n1, y, ldy);
        free(own);
        return;
    }
    dot_rows_avx2(type, xq, M, K, w, n0, n1, y, ldy);
#else
    (void)xt;
    (void)xt16;
    dot_rows_plain(type, xq, M, K, w, n0, n1, y, ldy);
#endif
}

void kv_qk_dot_rows(int64_t type, const KvQ8Block *xq, int64_t M, int64_t K, const uint8_t *w,
                    int64_t n0, int64_t n1, float *y, int64_t ldy) {
    kv_qk_dot_rows_t(type, xq, NULL, NULL, M, K, w, n0, n1, y, ldy);
}

/* ---- Q4_K quantization -------------------------------------------------------------- */

/* The largest error of 32 values x quantized as scale * q - offset, q in 0..15 rounded to
 * nearest; quants written to q when it is not NULL. */
static float q4_error(const float *x, float scale, float offset, uint8_t *q) {
    float worst = 0.0f;
    for (int l = 0; l < 32; l++) {
        int level = 0;
        if (scale > 0.0f) {
            level = (int)nearbyintf((x[l] + offset) / scale);
            level = level < 0 ? 0 : level > 15 ? 15 : level;
        }
        const float error = fabsf(scale * (float)level - offset - x[l]);
        worst = error > worst ? error : worst;
        if (q) q[l] = (uint8_t)level;
    }
    return worst;
}

/* The minimum (<= 0, as the format stores -dmin * m with m >= 0) is rounded up to a whole
 * multiple of dmin so that the lowest value stays reachable, the scale then taken from
 * whichever of the two neighbouring 6-bit steps leaves the smaller largest error. */
static void quantize_block_q4_k(const float *x, uint8_t *out) {
    float lowest[8], highest[8];
    float max_offset = 0.0f;
    for (int j = 0; j < 8; j++) {
        float lo = 0.0f, hi = x[32 * j];
        for (int l = 0; l < 32; l++) {
            lo = x[32 * j + l] < lo ? x[32 * j + l] : lo;
            hi = x[32 * j + l] > hi ? x[32 * j + l] : hi;
        }
        lowest[j] = lo;
        highest[j] = hi;
        max_offset = -lo > max_offset ? -lo : max_offset;
    }
    const uint16_t dmin_half = float_to_half_up(max_offset / 63.0f);
    const float dmin = half_to_float(dmin_half);
    int mins[8];
    float offsets[8], needed[8], max_needed = 0.0f;
    for (int j = 0; j < 8; j++) {
        int m = dmin > 0.0f ? (int)ceilf(-lowest[j] / dmin) : 0;
        mins[j] = m > 63 ? 63 : m;
        offsets[j] = dmin * (float)mins[j];
        needed[j] = (highest[j] + offsets[j]) / 15.0f; /* the step covering the whole range */
        max_needed = needed[j] > max_needed ? needed[j] : max_needed;
    }
    const uint16_t d_half = float_to_half_up(max_needed / 63.0f);
    const float d = half_to_float(d_half);
    int scales[8];
    uint8_t quants[8][32];
    for (int j = 0; j < 8; j++) {
        int best = 0;
        if (d > 0.0f) {
            const float ratio = needed[j] / d;
            int down = (int)floorf(ratio), up = (int)ceilf(ratio);
            down = down > 63 ? 63 : down;
            up = up > 63 ? 63 : up;
            best = up;
            if (down != up && q4_error(x + 32 * j, d * (float)down, offsets[j], NULL) <
                                  q4_error(x + 32 * j, d * (float)up, offsets[j], NULL))
                best = down;
        }
        scales[j] = best;
        q4_error(x + 32 * j, d * (float)best, offsets[j], quants[j]);
    }
    memcpy(out, &d_half, 2);
    memcpy(out + 2, &dmin_half, 2);
    uint8_t *packed = out + 4;
    for (int j = 0; j < 4; j++) {
        packed[j] = (uint8_t)((scales[j] & 63) | (scales[j + 4] >> 4) << 6);
        packed[j + 4] = (uint8_t)((mins[j] & 63) | (mins[j + 4] >> 4) << 6);
        packed[j + 8] = (uint8_t)((scales[j + 4] & 15) | (mins[j + 4] & 15) << 4);
    }
    uint8_t *qs = out + 16;
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l++)
            qs[32 * g + l] = (uint8_t)(quants[2 * g][l] | quants[2 * g + 1][l] << 4);
}

int64_t kv_quantize_rows_q4_k(const float *x, int64_t rows, int64_t K, uint8_t *out,
                              int num_threads) {
    if (K <= 0 || K % QK_K) return -1;
    const int64_t blocks = K / QK_K, row_bytes = blocks * KV_Q4_K_BLOCK_BYTES;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++)
            quantize_block_q4_k(x + r * K + b * QK_K, out + r * row_bytes + b * KV_Q4_K_BLOCK_BYTES);
    return rows * row_bytes;
}
