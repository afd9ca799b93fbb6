/* Greedy sampling: the index of each row's largest logit.
 *
 * PyTorch's argmax over a [64, 49152] float32 batch of logits runs at about a third of
 * the memory bandwidth on two cores; here each lane keeps its own running maximum and
 * where it was seen, the rows are shared between threads, and a row costs one pass. */
#include <math.h>

#include "kernels.h"
#include "vec.h"

/* The first index of row's largest value; a NaN wins over any number, and the first NaN
 * over the rest (as torch.argmax). */
static int64_t argmax_row(const float *row, int64_t n) {
    int64_t j = 0;
    if (n >= 16) {
        v8f best = v8f_load(row);
        v8i where = {0, 1, 2, 3, 4, 5, 6, 7}, at = where + 8;
        v8i nan_seen = (v8i)(best != best);
        for (j = 8; j + 8 <= n; j += 8, at += 8) {
            const v8f x = v8f_load(row + j);
            const v8i greater = x > best;
            best = v8f_select(greater, x, best);
            where = (greater & at) | (~greater & where);
            nan_seen |= x != x;
        }
        int any_nan = 0;
        for (int lane = 0; lane < 8; lane++) any_nan |= nan_seen[lane] != 0;
        if (!any_nan) {
            /* The lanes' winners, then the tail: the largest value, the first index on ties. */
            float m = best[0];
            int64_t arg = where[0];
            for (int lane = 1; lane < 8; lane++)
                if (best[lane] > m || (best[lane] == m && where[lane] < arg)) {
                    m = best[lane];
                    arg = where[lane];
                }
            for (; j < n; j++) {
                if (isnan(row[j])) return j;
                if (row[j] > m) {
                    m = row[j];
                    arg = j;
                }
            }
            return arg;
        }
        j = 0; /* a NaN somewhere: the plain walk below finds the first */
    }
    int64_t arg = 0;
    for (; j < n; j++) {
        if (isnan(row[j])) return j;
        if (row[j] > row[arg]) arg = j;
    }
    return arg;
}

/* out[r] = argmax of row r of x ([rows, cols], contiguous), for cols >= 1. */
void kv_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * cols, cols);
}
