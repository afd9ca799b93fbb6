/* The K-quants (Q4_K, Q5_K, Q6_K): not yet implemented; quant.c refuses them. */
#include <stdlib.h>

#include "quant.h"

void kv_qk_dot_rows(int64_t type, const KvQ8Block *xq, int64_t M, int64_t K, const uint8_t *w,
                    int64_t n0, int64_t n1, float *y, int64_t ldy) {
    (void)type, (void)xq, (void)M, (void)K, (void)w, (void)n0, (void)n1, (void)y, (void)ldy;
    abort();
}

void kv_qk_dequant_row(int64_t type, const uint8_t *row, int64_t K, float *out) {
    (void)type, (void)row, (void)K, (void)out;
    abort();
}
