/* Decode attention over the paged KV pool, bf16 on CPU (built and loaded by model/c_kernel.py).

   One query token per sequence against its cached keys and values, which live in scattered rows
   of the pool. One task per sequence: it reads each of its key rows once, every head of the row
   while it is in cache (a row holds all KV heads), with the rows a few positions ahead
   prefetched, since they are out of cache in a real step. Scores, softmax and the weighted sum
   are in fp32, the output is rounded once to bf16 (nearest even, as torch rounds).

   A sequence's result depends on its own query and rows only: not on the batch, the padding of
   the read table, or the thread count (a task runs on one thread, in a fixed order), so the
   same step gives the same bits in one process and in a swarm.

   Shapes: b sequences, nH query heads, nKV key-value heads (G = nH / nKV query heads per KV
   head), D head dim, mk the read table's width, W = nKV * D a pool row. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH 4 /* rows ahead */

static inline float bf16_to_float(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* e^x for x <= 0, in a form the compiler vectorises: x = n ln2 + r with |r| <= ln2 / 2, e^r by
   a degree-6 polynomial (relative error about 2e-7), 2^n built in the exponent bits. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* Pool row rows[j] [W] as fp32 into out, with row rows[j + PREFETCH] asked into cache meanwhile. */
static inline void load_row(float *out, const uint16_t *pool, const int64_t *rows, int64_t j, int64_t n, int64_t W) {
    if (j + PREFETCH < n) {
        const char *ahead = (const char *)(pool + rows[j + PREFETCH] * W);
        for (int64_t c = 0; c < W * 2; c += 64) __builtin_prefetch(ahead + c);
    }
    const uint16_t *r = pool + rows[j] * W;
#pragma omp simd
    for (int64_t x = 0; x < W; x++) out[x] = bf16_to_float(r[x]);
}

/* q [b, nH, D] bf16; k, v [S, nKV, D] bf16 pools; read [b, mk] int64 pool rows by position;
   keys [lo[i], hi[i]) of sequence i count; out [b, nH, D] bf16. Returns 0, or -1 when scratch
   memory could not be allocated (out is then incomplete). */
int p2p_decode_attend_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *read,
                           const int64_t *lo, const int64_t *hi, uint16_t *out, int64_t b, int64_t nH,
                           int64_t nKV, int64_t D, int64_t mk, float scale) {
    const int64_t G = nH / nKV, W = nKV * D;
    int failed = 0;
#pragma omp parallel
    {
        float *s = NULL; /* scores, then probabilities: [nH, n] */
        int64_t cap = 0;
        /* the scaled queries and the weighted sums [nH, D], a pool row [W], per-head max and 1 / sum */
        float *qf = (float *)malloc(sizeof(float) * (2 * nH * D + W + 2 * nH));
        float *acc = qf ? qf + nH * D : NULL, *row = qf ? acc + nH * D : NULL;
        float *top = qf ? row + W : NULL, *inv = qf ? top + nH : NULL;
        if (qf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < b; i++) {
            if (qf == NULL) continue;
            const int64_t a = lo[i], n = hi[i] - a;
            const int64_t *rows = read + i * mk + a;
            uint16_t *o = out + i * nH * D;
            if (n <= 0 || n * nH > cap) {
                free(s);
                cap = n > 0 ? n * nH : 0;
                s = cap ? (float *)malloc(sizeof(float) * cap) : NULL;
            }
            if (s == NULL) { /* nothing to attend to, or no memory */
                if (n > 0) {
#pragma omp atomic write
                    failed = 1;
                }
                memset(o, 0, sizeof(uint16_t) * nH * D);
                continue;
            }
            for (int64_t x = 0; x < nH * D; x++) qf[x] = bf16_to_float(q[i * nH * D + x]) * scale;
            for (int64_t h = 0; h < nH; h++) top[h] = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                load_row(row, k, rows, j, n, W);
                for (int64_t h = 0; h < nH; h++) {
                    const float *kh = row + (h / G) * D, *qh = qf + h * D;
                    float t = 0.f;
#pragma omp simd reduction(+ : t)
                    for (int64_t d = 0; d < D; d++) t += qh[d] * kh[d];
                    s[h * n + j] = t;
                    top[h] = t > top[h] ? t : top[h];
                }
            }
            for (int64_t h = 0; h < nH; h++) {
                float z = 0.f, *sh = s + h * n;
                const float m = top[h];
#pragma omp simd reduction(+ : z)
                for (int64_t j = 0; j < n; j++) {
                    const float p = exp_nonpositive(sh[j] - m);
                    sh[j] = p;
                    z += p;
                }
                inv[h] = 1.f / z;
            }
            memset(acc, 0, sizeof(float) * nH * D);
            for (int64_t j = 0; j < n; j++) {
                load_row(row, v, rows, j, n, W);
                for (int64_t h = 0; h < nH; h++) {
                    const float p = s[h * n + j], *vh = row + (h / G) * D;
                    float *ah = acc + h * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) ah[d] += p * vh[d];
                }
            }
            for (int64_t h = 0; h < nH; h++)
                for (int64_t d = 0; d < D; d++) o[h * D + d] = float_to_bf16(acc[h * D + d] * inv[h]);
        }
        free(s);
        free(qf);
    }
    return failed ? -1 : 0;
}
