/* Quantizing float weights into ggml's Q4_K blocks at load (weights from safetensors or
 * bf16 GGUF files served with --quantization q4_k), so they are multiplied by the same
 * kernels as a Q4_K GGUF file's. */
#ifndef KVSERVE_QUANT_K_H
#define KVSERVE_QUANT_K_H

#include <stdint.h>

/* Bytes of one Q4_K block of 256 values: fp16 d and dmin, 12 bytes of 6-bit scales and
 * minimums, 128 bytes of 4-bit quants. */
#define KV_Q4_K_BLOCK_BYTES 144

/* x: [rows, K] float32, K a multiple of 256 -> out: rows of K / 256 Q4_K blocks. Each
 * 32-value sub-block gets its own scale and minimum, rounded to 6 bits against the
 * super-block's fp16 d and dmin; every value then rounds to the nearest of its 16
 * levels. Returns the bytes written, or -1 when K is not a positive multiple of 256. */
int64_t kv_quantize_rows_q4_k(const float *x, int64_t rows, int64_t K, uint8_t *out,
                              int num_threads);

/* Q4_K rows (rows of K / 256 blocks) rewritten as KV_Q4_K_R rows at dst: every block keeps
 * its 16 bytes of scales, and its 128 bytes of quants are reordered so that byte 4j + t
 * of 32-byte group L holds, in its low and high nibbles, values 8L + t and 8L + 4 + t of
 * sub-block j (t < 4). Multiplied against activations laid out the same way, each 32-bit
 * lane of an integer dot product then sums one sub-block, and a super-block needs no
 * horizontal additions. Returns 0, or -1 where K is not a multiple of 256. */
int kv_q4_k_repack_rows(const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst,
                        int num_threads);

/* Q6_K rows rewritten as KV_Q6_K_R rows at dst. In each block the 256 quants are put in
 * eight 32-byte vectors V[4h + L] (h < 2, L < 4): byte 4i + t of V[4h + L] is value
 * 4L + t of sub-block 8h + (0, 2, 4, 6, 1, 3, 5, 7)[i], so against activations laid out the
 * same way (KvQ8T16) each 32-bit lane of an integer dot product sums one sub-block, in the
 * order the stored layout's kernel adds them. Bytes 0-127: byte b of 32-byte group L holds
 * the low four bits of V[L] byte b (low nibble) and of V[4 + L] byte b (high nibble);
 * bytes 128-191: byte b of group h holds the top two bits of V[4h + L] byte b at bits 2L
 * and 2L + 1; bytes 192-207: the sixteen scales in the same order as the lanes; bytes
 * 208-209: d, as stored. Returns 0, or -1 where K is not a multiple of 256. */
int kv_q6_k_repack_rows(const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst,
                        int num_threads);

/* 1 where this build multiplies KV_Q4_K_R and KV_Q6_K_R blocks faster than the stored
 * layouts (x86 with AVX2), else 0. */
int kv_q4_k_repack_pays(void);

#endif
