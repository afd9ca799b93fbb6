/* The body of the linear kernels, included once per weight type by linear.c.
 * The includer defines WEIGHT_T (the stored element), LOAD_W (eight weights as
 * floats), SCALAR_W (one weight as a float) and FN (the name suffix). */


/* Four rows of x against three weight rows: twelve running dot products, which with
 * the seven vectors loaded per step fill the sixteen registers of AVX2. */
static void FN(tile_4x3)(const float *x, const WEIGHT_T *w, int64_t K, float out[4][3]) {
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
    const WEIGHT_T *w0 = w, *w1 = w + K, *w2 = w + 2 * K;
    v8f a00 = {0}, a01 = {0}, a02 = {0}, a10 = {0}, a11 = {0}, a12 = {0};
    v8f a20 = {0}, a21 = {0}, a22 = {0}, a30 = {0}, a31 = {0}, a32 = {0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        v8f b0 = LOAD_W(w0 + k), b1 = LOAD_W(w1 + k), b2 = LOAD_W(w2 + k);
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
            for (int n = 0; n < 3; n++) s[m][n] += x[m * K + k] * SCALAR_W(w[n * K + k]);
    memcpy(out, s, sizeof s);
}

/* Two rows of x against four weight rows: eight running dot products. */
static void FN(tile_2x4)(const float *x0, const float *x1, const WEIGHT_T *w, int64_t K, float out[2][TILE_N]) {
    const WEIGHT_T *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    v8f a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        v8f xa = v8f_load(x0 + k), xb = v8f_load(x1 + k);
        v8f b0 = LOAD_W(w0 + k), b1 = LOAD_W(w1 + k);
        v8f b2 = LOAD_W(w2 + k), b3 = LOAD_W(w3 + k);
        a00 += xa * b0; a01 += xa * b1; a02 += xa * b2; a03 += xa * b3;
        a10 += xb * b0; a11 += xb * b1; a12 += xb * b2; a13 += xb * b3;
    }
    float s[2][TILE_N] = {
        {v8f_sum(a00), v8f_sum(a01), v8f_sum(a02), v8f_sum(a03)},
        {v8f_sum(a10), v8f_sum(a11), v8f_sum(a12), v8f_sum(a13)},
    };
    for (; k < K; k++) {
        for (int n = 0; n < TILE_N; n++) {
            s[0][n] += x0[k] * SCALAR_W(w[n * K + k]);
            s[1][n] += x1[k] * SCALAR_W(w[n * K + k]);
        }
    }
    memcpy(out, s, sizeof s);
}

/* One row of x against four weight rows. */
static void FN(tile_1x4)(const float *x0, const WEIGHT_T *w, int64_t K, float out[TILE_N]) {
    const WEIGHT_T *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        v8f xa = v8f_load(x0 + k);
        a0 += xa * LOAD_W(w0 + k);
        a1 += xa * LOAD_W(w1 + k);
        a2 += xa * LOAD_W(w2 + k);
        a3 += xa * LOAD_W(w3 + k);
    }
    float s[TILE_N] = {v8f_sum(a0), v8f_sum(a1), v8f_sum(a2), v8f_sum(a3)};
    for (; k < K; k++)
        for (int n = 0; n < TILE_N; n++) s[n] += x0[k] * SCALAR_W(w[n * K + k]);
    memcpy(out, s, sizeof s);
}

static float FN(dot)(const float *a, const WEIGHT_T *b, int64_t K) {
    v8f acc = {0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) acc += v8f_load(a + k) * LOAD_W(b + k);
    float s = v8f_sum(acc);
    for (; k < K; k++) s += a[k] * SCALAR_W(b[k]);
    return s;
}

/* Rows n0 .. n0 + PANEL_N - 1 of the output, for every row of x. */
static void FN(panel)(const float *x, const WEIGHT_T *w, const float *bias, float *y, int64_t M, int64_t K,
                  int64_t N, int64_t n0) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        for (int64_t n = n0; n < n0 + PANEL_N; n += 3) {
            float out[4][3];
            FN(tile_4x3)(x + m * K, w + n * K, K, out);
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 3; j++) y[(m + i) * N + n + j] = out[i][j] + bias_at(bias, n + j);
        }
    }
    for (; m + 2 <= M; m += 2) {
        for (int64_t n = n0; n < n0 + PANEL_N; n += TILE_N) {
            float out[2][TILE_N];
            FN(tile_2x4)(x + m * K, x + (m + 1) * K, w + n * K, K, out);
            for (int j = 0; j < TILE_N; j++) {
                y[m * N + n + j] = out[0][j] + bias_at(bias, n + j);
                y[(m + 1) * N + n + j] = out[1][j] + bias_at(bias, n + j);
            }
        }
    }
    if (m < M) {
        for (int64_t n = n0; n < n0 + PANEL_N; n += TILE_N) {
            float out[TILE_N];
            FN(tile_1x4)(x + m * K, w + n * K, K, out);
            for (int j = 0; j < TILE_N; j++) y[m * N + n + j] = out[j] + bias_at(bias, n + j);
        }
    }
}

/* x: [M, K], w: [N, K], bias: [N] or NULL, y: [M, N]; all contiguous float32. */
void FN(kv_linear)(const float *x, const WEIGHT_T *w, const float *bias, float *y, int64_t M,
                   int64_t K, int64_t N, int num_threads) {
    const int64_t num_panels = N / PANEL_N;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < num_panels; p++) FN(panel)(x, w, bias, y, M, K, N, p * PANEL_N);
        /* The last N % PANEL_N rows, one dot product each. */
#pragma omp for schedule(static)
        for (int64_t n = num_panels * PANEL_N; n < N; n++)
            for (int64_t m = 0; m < M; m++) y[m * N + n] = FN(dot)(x + m * K, w + n * K, K) + bias_at(bias, n);
    }
}
