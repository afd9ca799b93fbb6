/* The block-32 dot products on AVX2 CPUs, and on AVX-512 ones with VNNI's one-instruction
 * byte product (VPDPBUSD, in its 256-bit form) and byte masks for Q5's fifth bits.
 *
 * Four weight rows at a time: each block of each row is unpacked to 32 bytes once and
 * multiplied with the matching activation block of up to four rows of x; the four rows'
 * 32-bit partial sums are added across lanes together (three VPHADDD for four rows) and
 * scaled in float32 with the four rows' block scales, converted together.
 *
 * Part of quant.c, which includes it after block_bytes and defines KV_Q32_AVX2 where the
 * CPU has AVX2, F16C and FMA. */
#ifndef KVSERVE_QUANT_Q32_AVX2_H
#define KVSERVE_QUANT_Q32_AVX2_H

#ifdef KV_Q32_AVX2
#include <immintrin.h>

/* Non-temporal prefetches or not (kv_quant_set_stream_nta, quant_many.c). */
extern int kv_stream_nta;
/* Rows of x from which x8 groups are multiplied two at a time in 512-bit registers
 * (tile_x16; kv_quant_set_x8_wide_rows, quant.c). */
extern int64_t kv_x8_wide_rows;

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* Block blk's 32 quants as bytes, element i in byte i: as stored (unsigned) for the Q4 and
 * Q5 types, signed for Q8_0. type is a constant where this is inlined. */
static ALWAYS_INLINE __m256i quants_avx2(const int type, const uint8_t *blk) {
    if (type == KV_GGML_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const int qs_at = type == KV_GGML_Q4_0 ? 2 : type == KV_GGML_Q4_1 ? 4 : type == KV_GGML_Q5_0 ? 6 : 8;
    /* The 16 packed bytes in both lanes, the high lane shifted down four bits: low nibbles
     * are elements 0..15 (the low lane), high nibbles 16..31. (Shifting 32-bit lanes moves
     * the next byte's low bits into each byte's high nibble, which the mask clears.) */
    const __m256i packed = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + qs_at)));
    __m256i q = _mm256_and_si256(_mm256_srlv_epi32(packed, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                 _mm256_set1_epi8(0x0F));
    if (type == KV_GGML_Q5_0 || type == KV_GGML_Q5_1) {
        uint32_t qh;
        memcpy(&qh, blk + (type == KV_GGML_Q5_0 ? 2 : 4), sizeof qh);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        /* qh is a byte mask: where bit i is set, element i gains 16. */
        q = _mm256_mask_add_epi8(q, (__mmask32)qh, q, _mm256_set1_epi8(0x10));
#else
        /* Byte i takes byte i / 8 of qh (each lane holds all four), then keeps bit i % 8:
         * where it is set, the element gains 16. */
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32((int)qh),
            _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
#endif
    }
    return q;
}

/* Eight sums of four products each of unsigned u and signed s bytes (no overflow: the
 * quants are at most 31, or 128 for |Q8_0|, and activations at most 127 in magnitude). */
static ALWAYS_INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* The totals of a, b, c and d (eight int32 each), as four floats. */
static ALWAYS_INLINE __m128 total4(__m256i a, __m256i b, __m256i c, __m256i d) {
    /* Per 128-bit lane: [a, b, c, d] partial sums; the two lanes are then added. */
    const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_cvtepi32_ps(
        _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1)));
}

/* The halves at p0 .. p3 (four rows' scales or minimums) as four floats. */
static ALWAYS_INLINE __m128 halves4(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2,
                                    const uint8_t *p3) {
    uint16_t h[4];
    memcpy(&h[0], p0, 2), memcpy(&h[1], p1, 2), memcpy(&h[2], p2, 2), memcpy(&h[3], p3, 2);
    return _mm_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], 0, 0, 0, 0));
}

/* MR rows of xq (nb blocks each) against four weight rows: acc[r] holds x row r's dot
 * products with rows row[0..3]. type and MR are constants where this is inlined.
 * next: a later tile's four rows (contiguous, nb blocks each), asked for from memory a
 * slice per block; NULL: none. Rows of a few kilobytes are too short for the hardware
 * prefetcher to reach full speed on each before it ends. */
static ALWAYS_INLINE void tile_avx2(const int type, const KvQ8Block *xq, int64_t nb,
                                    const uint8_t *const row[4], const uint8_t *next, int nta,
                                    const int MR, __m128 acc[4]) {
    const int64_t bytes = block_bytes(type);
    for (int r = 0; r < MR; r++) acc[r] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (next != NULL) {
            for (int64_t line = 0; line < 4 * bytes; line += 64) {
                if (nta)
                    __builtin_prefetch(next + b * 4 * bytes + line, 0, 0);
                else
                    __builtin_prefetch(next + b * 4 * bytes + line, 0, 2);
            }
        }
        const uint8_t *b0 = row[0] + b * bytes, *b1 = row[1] + b * bytes;
        const uint8_t *b2 = row[2] + b * bytes, *b3 = row[3] + b * bytes;
        const __m256i w0 = quants_avx2(type, b0), w1 = quants_avx2(type, b1);
        const __m256i w2 = quants_avx2(type, b2), w3 = quants_avx2(type, b3);
        const __m128 d = halves4(b0, b1, b2, b3);
        /* The offset o of each row's values (see the top of the file). */
        __m128 o = _mm_setzero_ps();
        if (type == KV_GGML_Q4_0) o = _mm_mul_ps(d, _mm_set1_ps(-8.0f));
        if (type == KV_GGML_Q5_0) o = _mm_mul_ps(d, _mm_set1_ps(-16.0f));
        if (type == KV_GGML_Q4_1 || type == KV_GGML_Q5_1) o = halves4(b0 + 2, b1 + 2, b2 + 2, b3 + 2);
        for (int r = 0; r < MR; r++) {
            const KvQ8Block *xb = xq + r * nb + b;
            const __m256i x = _mm256_loadu_si256((const __m256i *)xb->q);
            __m128 total;
            if (type == KV_GGML_Q8_0) {
                total = total4(dot_u8s8(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x, w0)),
                               dot_u8s8(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x, w1)),
                               dot_u8s8(_mm256_sign_epi8(w2, w2), _mm256_sign_epi8(x, w2)),
                               dot_u8s8(_mm256_sign_epi8(w3, w3), _mm256_sign_epi8(x, w3)));
            } else {
                total = total4(dot_u8s8(w0, x), dot_u8s8(w1, x), dot_u8s8(w2, x), dot_u8s8(w3, x));
            }
            acc[r] = _mm_fmadd_ps(_mm_mul_ps(d, _mm_set1_ps(xb->d)), total, acc[r]);
            if (type != KV_GGML_Q8_0) acc[r] = _mm_fmadd_ps(o, _mm_set1_ps(xb->s), acc[r]);
        }
    }
}

static ALWAYS_INLINE void dot_rows_avx2(const int type, const KvQ8Block *xq, int64_t M, int64_t K,
                                        const uint8_t *w, int64_t n0, int64_t n1, float *y,
                                        int64_t ldy) {
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(type);
    for (int64_t n = n0; n < n1; n += 4) {
        /* A last tile of fewer than four rows repeats its last row, and stores only its own. */
        const int64_t nr = min_i64(n1 - n, 4);
        const uint8_t *row[4];
        for (int64_t j = 0; j < 4; j++) row[j] = w + (n + min_i64(j, nr - 1)) * row_bytes;
        /* Prefetch the tile at least 4 KiB ahead: one tile ahead is too close for rows of
         * 1024 Q4_0 values (9 GB/s against 16 on one Zen 4 core). Where a tile is at most
         * 16 KiB the lines are asked for non-temporally (each weight is read once a step):
         * the two threads then streamed Q4_1 rows of 2048 values at 29-34 GB/s against 20-23
         * into L2, Q5_0 at 29-33 against 23-27, Q8_0 at 35-52 against 32-36 (Zen 4,
         * alternating runs; 2, 4 and 8 KiB ahead ran alike). A longer tile lands too far
         * ahead for the L1 that non-temporal lines go to (a model's 8192-wide Q8_0 rows
         * decoded 13% slower that way), so it goes to L2. All of this on Zen 4: where the
         * engine measured non-temporal lines slower (kv_quant_stream_nta), every tile's go
         * to L2. */
        const int64_t ahead = 4 * ((4096 + 4 * row_bytes - 1) / (4 * row_bytes));
        const int nta = kv_stream_nta && 4 * row_bytes <= 16384;
        const uint8_t *next = n + ahead + 4 <= n1 ? w + (n + ahead) * row_bytes : NULL;
        for (int64_t m = 0; m < M; m += 4) {
            const int64_t mr = min_i64(M - m, 4);
            __m128 acc[4];
            switch (mr) {
                case 4: tile_avx2(type, xq + m * nb, nb, row, m == 0 ? next : NULL, nta, 4, acc); break;
                case 3: tile_avx2(type, xq + m * nb, nb, row, m == 0 ? next : NULL, nta, 3, acc); break;
                case 2: tile_avx2(type, xq + m * nb, nb, row, m == 0 ? next : NULL, nta, 2, acc); break;
                default: tile_avx2(type, xq + m * nb, nb, row, m == 0 ? next : NULL, nta, 1, acc); break;
            }
            for (int64_t r = 0; r < mr; r++) {
                float *out = y + (m + r) * ldy + n;
                if (nr == 4) {
                    _mm_storeu_ps(out, acc[r]);
                } else {
                    float part[4];
                    _mm_storeu_ps(part, acc[r]);
                    memcpy(out, part, sizeof(float) * (size_t)nr);
                }
            }
        }
    }
}
/* ---- The x8 layout (quant.h): eight weight rows a vector ------------------------------ */

/* acc plus the eight sums of four products each of unsigned u and signed s bytes. */
static ALWAYS_INLINE __m256i dot_acc_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Activation bytes 4c .. 4c + 3 of a block in every 32-bit lane. */
static ALWAYS_INLINE __m256i four_bytes(const int8_t *q, int c) {
    int32_t v;
    memcpy(&v, q + 4 * c, sizeof v);
    return _mm256_set1_epi32(v);
}

/* q plus 16 in byte t of each 32-bit lane where bit first + t of that lane of qh is set
 * (first a constant where inlined). */
static ALWAYS_INLINE __m256i add_fifth_bits(__m256i q, __m256i qh, const int first) {
#if defined(__AVX512BITALG__) && defined(__AVX512VL__)
    /* One instruction picks each byte's bit from its 64-bit lane: lane j's bits are bits
     * 32 (j % 2) .. of the quadword holding rows j - j % 2 and j - j % 2 + 1. */
    const __m256i pick = _mm256_add_epi8(
        _mm256_set1_epi8((char)first),
        _mm256_setr_epi8(0, 1, 2, 3, 32, 33, 34, 35, 0, 1, 2, 3, 32, 33, 34, 35, 0, 1, 2, 3, 32,
                         33, 34, 35, 0, 1, 2, 3, 32, 33, 34, 35));
    const __mmask32 set = _mm256_bitshuffle_epi64_mask(qh, pick);
    return _mm256_mask_add_epi8(q, set, q, _mm256_set1_epi8(16));
#else
    /* Each lane's bits first .. first + 7 in its low byte, copied to its four bytes, then
     * byte t keeps bit t. */
    const __m256i low = _mm256_shuffle_epi8(
        _mm256_srli_epi32(qh, first),
        _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4,
                         8, 8, 8, 8, 12, 12, 12, 12));
    const __m256i bit = _mm256_set1_epi32(0x08040201);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(low, bit), bit);
    return _mm256_add_epi8(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
#endif
}

/* With VPDPBUSD (no 16-bit saturation), Q8_0 groups read each activation block's sum of
 * quants (kv_linear_quant makes them once per call). */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define X8_SUMS 1
#else
#define X8_SUMS 0
#endif

/* Rows of x at a time against one group: the group's unpacked quants stay in registers
 * while each row reads them (sixteen registers on AVX2, 32 with AVX-512). */
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define X8_MAX_MR 8
#else
#define X8_MAX_MR 4
#endif

/* How far ahead of the block being multiplied an x8 stream is prefetched: the groups of a
 * segment are one sequential stream, so a fixed distance serves every row length. */
#define X8_PREFETCH_BYTES 4096

/* MR rows of xq (nb blocks each) against the eight weight rows of an x8 group at grp:
 * acc[r] lane j is x row r's dot product with weight row j. The sums and their scaling
 * are tile_avx2's, operation for operation, so each output is the same float.
 * prefetch: ask for the stream X8_PREFETCH_BYTES ahead as the blocks go (the first pass
 * over a group; a second pass for more rows of x finds it in cache), non-temporally where
 * kv_quant_stream_nta() says so (each weight is read once a step). type and MR are constants where inlined. */
static ALWAYS_INLINE void tile_x8(const int type, const KvQ8Block *xq, const int32_t *xsum,
                                  int64_t nb, const uint8_t *grp, int prefetch, const int MR,
                                  __m256 acc[X8_MAX_MR]) {
    const int64_t xbytes = 8 * block_bytes(type);
    /* The fields of an x8 block: 8 times their bytes in a GGUF block (quant.h). */
    const int has_min = type == KV_GGML_Q4_1 || type == KV_GGML_Q5_1;
    const int has_qh = type == KV_GGML_Q5_0 || type == KV_GGML_Q5_1;
    const int qh_at = 16 + 16 * has_min, header = qh_at + 32 * has_qh;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = grp + b * xbytes, *qs = blk + header;
        if (prefetch && kv_stream_nta)
            for (int64_t line = 0; line < xbytes; line += 64)
                __builtin_prefetch(blk + X8_PREFETCH_BYTES + line, 0, 0);
        else if (prefetch)
            for (int64_t line = 0; line < xbytes; line += 64)
                __builtin_prefetch(blk + X8_PREFETCH_BYTES + line, 0, 2);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 o = _mm256_setzero_ps();
        if (type == KV_GGML_Q4_0) o = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        if (type == KV_GGML_Q5_0) o = _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
        if (has_min) o = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        if (type == KV_GGML_Q8_0) {
#if X8_SUMS
            /* Signed quants: w + 128 (unsigned) against x, less 128 times the block's sum
             * of x, is the same integer as w against x. */
            __m256i u[8];
            for (int c = 0; c < 8; c++)
                u[c] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)),
                                        _mm256_set1_epi8((char)0x80));
            for (int r = 0; r < MR; r++) {
                const KvQ8Block *xb = xq + r * nb + b;
                __m256i sum = _mm256_set1_epi32(-128 * xsum[r * nb + b]);
                for (int c = 0; c < 8; c++) sum = dot_acc_u8s8(sum, u[c], four_bytes(xb->q, c));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb->d)),
                                         _mm256_cvtepi32_ps(sum), acc[r]);
            }
#else
            /* Signed quants: |w| against the activation with w's sign, as tile_avx2 does
             * (VPMADDUBSW's 16-bit sums would saturate on w + 128). */
            (void)xsum;
            __m256i w[8], u[8];
            for (int c = 0; c < 8; c++) {
                w[c] = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                u[c] = _mm256_sign_epi8(w[c], w[c]);
            }
            for (int r = 0; r < MR; r++) {
                const KvQ8Block *xb = xq + r * nb + b;
                __m256i sum = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++)
                    sum = dot_acc_u8s8(sum, u[c], _mm256_sign_epi8(four_bytes(xb->q, c), w[c]));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb->d)),
                                         _mm256_cvtepi32_ps(sum), acc[r]);
            }
#endif
        } else {
            /* Low nibbles: values 4c .. 4c + 3 of each row; high nibbles: 16 + 4c ... */
            __m256i lo[4], hi[4];
            for (int c = 0; c < 4; c++) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                lo[c] = _mm256_and_si256(packed, low4);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
            }
            if (has_qh) {
                /* Lane j: row j's 32 fifth bits; byte t of lane j in lo[c] is value 4c + t
                 * (bit 4c + t), in hi[c] value 16 + 4c + t. */
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + qh_at));
                for (int c = 0; c < 4; c++) {
                    lo[c] = add_fifth_bits(lo[c], qh, 4 * c);
                    hi[c] = add_fifth_bits(hi[c], qh, 16 + 4 * c);
                }
            }
            for (int r = 0; r < MR; r++) {
                const KvQ8Block *xb = xq + r * nb + b;
#if X8_SUMS /* the CPU has VPDPBUSD */
                __m256i sum = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    sum = dot_acc_u8s8(sum, lo[c], four_bytes(xb->q, c));
                    sum = dot_acc_u8s8(sum, hi[c], four_bytes(xb->q, 4 + c));
                }
#else
                /* Without VPDPBUSD, VPMADDUBSW's 16-bit pair sums are added as 16 bits
                 * before one VPMADDWD widens them: a pair is at most 2 * 15 * 128 = 3,840
                 * in magnitude for 4-bit quants, 7,936 for 5-bit ones, so eight (four)
                 * of them add without overflow, and the int32 sum is the same integer. */
                __m256i part[2];
                for (int h = 0; h < 2; h++) {
                    const int c0 = 2 * h;
                    part[h] = _mm256_add_epi16(
                        _mm256_add_epi16(_mm256_maddubs_epi16(lo[c0], four_bytes(xb->q, c0)),
                                         _mm256_maddubs_epi16(hi[c0], four_bytes(xb->q, 4 + c0))),
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo[c0 + 1], four_bytes(xb->q, c0 + 1)),
                            _mm256_maddubs_epi16(hi[c0 + 1], four_bytes(xb->q, 5 + c0))));
                }
                const __m256i ones = _mm256_set1_epi16(1);
                const __m256i sum =
                    has_qh ? _mm256_add_epi32(_mm256_madd_epi16(part[0], ones),
                                              _mm256_madd_epi16(part[1], ones))
                           : _mm256_madd_epi16(_mm256_add_epi16(part[0], part[1]), ones);
#endif
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb->d)),
                                         _mm256_cvtepi32_ps(sum), acc[r]);
                acc[r] = _mm256_fmadd_ps(o, _mm256_set1_ps(xb->s), acc[r]);
            }
        }
    }
}

/* Two x8 groups side by side in 512-bit registers (AVX-512 with VNNI): rows 0-7 of a
 * vector are the group at grp, rows 8-15 the next one, group_bytes further. Each
 * activation block's four-byte broadcast and each product then serve sixteen weight rows,
 * half the instructions per product of tile_x8, whose sums and scaling it repeats lane
 * for lane: each output is the same float. */
/* Needs VPDPBUSD on 512 bits and, for Q8_0, the activation sums X8_SUMS makes (VL). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
#define X8_WIDE 1

static ALWAYS_INLINE __m512i two_groups(const uint8_t *a, int64_t apart) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)(a + apart)), 1);
}

static ALWAYS_INLINE __m512 two_groups_halves(const uint8_t *a, int64_t apart) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
        _mm_loadu_si128((const __m128i *)(a + apart)), 1));
}

/* add_fifth_bits for sixteen rows: one bit shuffle with AVX512-BITALG (every 64-bit lane
 * picks its bytes' bits alike), else add_fifth_bits on each half. */
static ALWAYS_INLINE __m512i add_fifth_bits_wide(__m512i q, __m512i qh, const int first) {
#if defined(__AVX512BITALG__)
    const __m512i pick = _mm512_add_epi8(
        _mm512_set1_epi8((char)first), _mm512_set1_epi64(0x2322212003020100LL));
    const __mmask64 set = _mm512_bitshuffle_epi64_mask(qh, pick);
    return _mm512_mask_add_epi8(q, set, q, _mm512_set1_epi8(16));
#else
    const __m256i low = add_fifth_bits(_mm512_castsi512_si256(q), _mm512_castsi512_si256(qh), first);
    const __m256i high = add_fifth_bits(_mm512_extracti64x4_epi64(q, 1),
                                        _mm512_extracti64x4_epi64(qh, 1), first);
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
#endif
}

static ALWAYS_INLINE void tile_x16(const int type, const KvQ8Block *xq, const int32_t *xsum,
                                   int64_t nb, const uint8_t *grp, int64_t group_bytes,
                                   int prefetch, const int MR, __m512 acc[X8_MAX_MR]) {
    const int64_t xbytes = 8 * block_bytes(type);
    const int has_min = type == KV_GGML_Q4_1 || type == KV_GGML_Q5_1;
    const int has_qh = type == KV_GGML_Q5_0 || type == KV_GGML_Q5_1;
    const int qh_at = 16 + 16 * has_min, header = qh_at + 32 * has_qh;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = grp + b * xbytes, *qs = blk + header;
        if (prefetch) {
            const int hint_nta = kv_stream_nta;
            for (int64_t line = 0; line < xbytes; line += 64) {
                if (hint_nta) {
                    __builtin_prefetch(blk + X8_PREFETCH_BYTES + line, 0, 0);
                    __builtin_prefetch(blk + group_bytes + X8_PREFETCH_BYTES + line, 0, 0);
                } else {
                    __builtin_prefetch(blk + X8_PREFETCH_BYTES + line, 0, 2);
                    __builtin_prefetch(blk + group_bytes + X8_PREFETCH_BYTES + line, 0, 2);
                }
            }
        }
        const __m512 d = two_groups_halves(blk, group_bytes);
        __m512 o = _mm512_setzero_ps();
        if (type == KV_GGML_Q4_0) o = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        if (type == KV_GGML_Q5_0) o = _mm512_mul_ps(d, _mm512_set1_ps(-16.0f));
        if (has_min) o = two_groups_halves(blk + 16, group_bytes);
        if (type == KV_GGML_Q8_0) {
            __m512i u[8];
            for (int c = 0; c < 8; c++)
                u[c] = _mm512_xor_si512(two_groups(qs + 32 * c, group_bytes), _mm512_set1_epi8((char)0x80));
            for (int r = 0; r < MR; r++) {
                const KvQ8Block *xb = xq + r * nb + b;
                __m512i sum = _mm512_set1_epi32(-128 * xsum[r * nb + b]);
                for (int c = 0; c < 8; c++) {
                    int32_t v;
                    memcpy(&v, xb->q + 4 * c, sizeof v);
                    sum = _mm512_dpbusd_epi32(sum, u[c], _mm512_set1_epi32(v));
                }
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xb->d)),
                                         _mm512_cvtepi32_ps(sum), acc[r]);
            }
        } else {
            __m512i lo[4], hi[4];
            for (int c = 0; c < 4; c++) {
                const __m512i packed = two_groups(qs + 32 * c, group_bytes);
                lo[c] = _mm512_and_si512(packed, low4);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
            }
            if (has_qh) {
                const __m512i qh = two_groups(blk + qh_at, group_bytes);
                for (int c = 0; c < 4; c++) {
                    lo[c] = add_fifth_bits_wide(lo[c], qh, 4 * c);
                    hi[c] = add_fifth_bits_wide(hi[c], qh, 16 + 4 * c);
                }
            }
            for (int r = 0; r < MR; r++) {
                const KvQ8Block *xb = xq + r * nb + b;
                __m512i sum = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    int32_t v_lo, v_hi;
                    memcpy(&v_lo, xb->q + 4 * c, sizeof v_lo);
                    memcpy(&v_hi, xb->q + 16 + 4 * c, sizeof v_hi);
                    sum = _mm512_dpbusd_epi32(sum, lo[c], _mm512_set1_epi32(v_lo));
                    sum = _mm512_dpbusd_epi32(sum, hi[c], _mm512_set1_epi32(v_hi));
                }
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xb->d)),
                                         _mm512_cvtepi32_ps(sum), acc[r]);
                acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(xb->s), acc[r]);
            }
        }
    }
}
#else
#define X8_WIDE 0
#endif

/* Output rows n0 .. n1 - 1 (multiples of 8) of x8-layout weights of GGUF type `type`. */
static ALWAYS_INLINE void dot_rows_x8(const int type, const KvQ8Block *xq, const int32_t *xsum,
                                      int64_t M, int64_t K, const uint8_t *w, int64_t n0,
                                      int64_t n1, float *y, int64_t ldy) {
    const int64_t nb = K / QK, group_bytes = 8 * nb * block_bytes(type);
    for (int64_t n = n0; n < n1; n += 8) {
        const uint8_t *grp = w + n / 8 * group_bytes;
#if X8_WIDE
        if (M >= kv_x8_wide_rows && n + 16 <= n1) {
            for (int64_t m = 0; m < M; m += X8_MAX_MR) {
                const int64_t mr = min_i64(M - m, X8_MAX_MR);
                const KvQ8Block *xm = xq + m * nb;
                const int32_t *sm = xsum == NULL ? NULL : xsum + m * nb;
                const int pf = m == 0;
                __m512 acc[X8_MAX_MR];
                switch (mr) {
                    case 8: tile_x16(type, xm, sm, nb, grp, group_bytes, pf, 8, acc); break;
                    case 7: tile_x16(type, xm, sm, nb, grp, group_bytes, pf, 7, acc); break;
                    case 6: tile_x16(type, xm, sm, nb, grp, group_bytes, pf, 6, acc); break;
                    case 5: tile_x16(type, xm, sm, nb, grp, group_bytes, pf, 5, acc); break;
                    case 4: tile_x16(type, xm, sm, nb, grp, group_bytes, pf, 4, acc); break;
                    case 3: tile_x16(type, xm, sm, nb, grp, group_bytes, pf, 3, acc); break;
                    case 2: tile_x16(type, xm, sm, nb, grp, group_bytes, pf, 2, acc); break;
                    default: tile_x16(type, xm, sm, nb, grp, group_bytes, pf, 1, acc); break;
                }
                for (int64_t r = 0; r < mr; r++) _mm512_storeu_ps(y + (m + r) * ldy + n, acc[r]);
            }
            n += 8; /* the loop's step adds the other eight */
            continue;
        }
#endif
        for (int64_t m = 0; m < M; m += X8_MAX_MR) {
            const int64_t mr = min_i64(M - m, X8_MAX_MR);
            const int pf = m == 0;
            __m256 acc[X8_MAX_MR];
            switch (mr) {
#if X8_MAX_MR == 8
                case 8: tile_x8(type, xq + m * nb, xsum == NULL ? NULL : xsum + m * nb, nb, grp, pf, 8, acc); break;
                case 7: tile_x8(type, xq + m * nb, xsum == NULL ? NULL : xsum + m * nb, nb, grp, pf, 7, acc); break;
                case 6: tile_x8(type, xq + m * nb, xsum == NULL ? NULL : xsum + m * nb, nb, grp, pf, 6, acc); break;
                case 5: tile_x8(type, xq + m * nb, xsum == NULL ? NULL : xsum + m * nb, nb, grp, pf, 5, acc); break;
#endif
                case 4: tile_x8(type, xq + m * nb, xsum == NULL ? NULL : xsum + m * nb, nb, grp, pf, 4, acc); break;
                case 3: tile_x8(type, xq + m * nb, xsum == NULL ? NULL : xsum + m * nb, nb, grp, pf, 3, acc); break;
                case 2: tile_x8(type, xq + m * nb, xsum == NULL ? NULL : xsum + m * nb, nb, grp, pf, 2, acc); break;
                default: tile_x8(type, xq + m * nb, xsum == NULL ? NULL : xsum + m * nb, nb, grp, pf, 1, acc); break;
            }
            for (int64_t r = 0; r < mr; r++) _mm256_storeu_ps(y + (m + r) * ldy + n, acc[r]);
        }
    }
}
#endif /* KV_Q32_AVX2 */

#endif
