/* The elementwise steps of a bfloat16 decoder layer, each one pass over its rows
   (`layer_ops.py`). Each computes in float32 and rounds to bfloat16 (nearest even) where
   torch's bfloat16 ops round, and adds a row's squares in the order torch's sum kernel adds
   them, so the results are torch's bit for bit.

   rms_norm:     out = x * rsqrt(mean(x^2) + eps) * w                 x, out [m, k]
   sum_squares:  out = sum(x^2) of each row, as rms_norm adds them    x [m, k], out [m] float
   add_rms_norm: h = x + y; out = rms_norm(h)                          x, y, h, out [m, k]
   rope:         in place, on the first `heads` heads of each row of x (row stride `stride`),
                 half-split layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each
                 product and sum rounded; cos, sin [m, d/2]
   rope_write_kv: rope on the Q and K heads of each row of a fused QKV output, then the row's
                 K and V heads (after Q's) copied to its KV cache slot: slots [m] int64,
                 k_cache, v_cache [slots, kv_heads, d]

   Built by lockgate/llm/native.py; rows are shared over the calling thread's OpenMP team when
   there are enough of them. The build flags let the compiler reassociate float sums and fuse
   multiplies into adds; this file keeps both off, since the order and rounding of each
   operation is what makes the results torch's. */

#if defined(__clang__)
#pragma clang fp reassociate(off) contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define PARALLEL_FROM 32768 /* elements from which the rows are split over threads */

static inline float round_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

static inline int team(int threads, int64_t m, int64_t elements) {
    return threads > 1 && m > 1 && elements >= PARALLEL_FROM ? threads : 1;
}

#define MAX_LANES 16
#define ILP 4    /* torch's row_sum: a row read as 4 interleaved partial sums */
#define LEVELS 4 /* torch's multi_row_sum: 4 cascade levels of partial sums */

static inline int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) bits++;
    return bits;
}

/* acc[l] += the squares of the `lanes` values of h from `at`, each square rounded to float
   (torch squares into a float tensor, then sums it) */
static inline void add_squares(float *acc, const uint16_t *h, int64_t at, int lanes) {
    for (int l = 0; l < lanes; l++) {
        const float v = bf16_to_float(h[at + l]);
        const float square = v * v;
        acc[l] += square;
    }
}

/* The sum of the squares of one row of k values, in the order of torch's cascade_sum over a
   contiguous float row (aten/src/ATen/native/cpu/SumKernel.cpp, vectorized_inner_sum, with
   Vectorized<float> of `lanes` lanes): the row's k / lanes vectors are summed by row_sum
   (ILP interleaved partial sums, each a multi_row_sum of LEVELS cascade levels), the
   leftover values added one by one to zero, then the vector's lanes in order. */
static inline __attribute__((always_inline)) float row_squares_of(const uint16_t *h, int64_t k,
                                                                 const int lanes) {
    const int64_t vectors = k / lanes, size = vectors / ILP;
    const int64_t power = ceil_log2(size) / LEVELS > 4 ? ceil_log2(size) / LEVELS : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[LEVELS][ILP][MAX_LANES] = {{{0.0f}}};
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int r = 0; r < ILP; r++) add_squares(acc[0][r], h, (i * ILP + r) * lanes, lanes);
        for (int level = 1; level < LEVELS; level++) {
            for (int r = 0; r < ILP; r++)
                for (int l = 0; l < lanes; l++) {
                    acc[level][r][l] += acc[level - 1][r][l];
                    acc[level - 1][r][l] = 0.0f;
                }
            if ((i & (mask << (level * power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int r = 0; r < ILP; r++) add_squares(acc[0][r], h, (i * ILP + r) * lanes, lanes);
    for (int level = 1; level < LEVELS; level++)
        for (int r = 0; r < ILP; r++)
            for (int l = 0; l < lanes; l++) acc[0][r][l] += acc[level][r][l];
    float *sums = acc[0][0]; /* row_sum: the leftover vectors into the first partial sum */
    for (int64_t v = size * ILP; v < vectors; v++) add_squares(sums, h, v * lanes, lanes);
    for (int r = 1; r < ILP; r++)
        for (int l = 0; l < lanes; l++) sums[l] += acc[0][r][l];
    float total = 0.0f;
    for (int64_t j = vectors * lanes; j < k; j++) {
        const float v = bf16_to_float(h[j]);
        const float square = v * v;
        total += square;
    }
    for (int l = 0; l < lanes; l++) total += sums[l];
    return total;
}

/* row_squares_of with `lanes` a constant where it is one of the common widths (the lane loops
   then compile to vector instructions) */
static float row_squares(const uint16_t *h, int64_t k, int lanes) {
    switch (lanes) {
    case 8: return row_squares_of(h, k, 8);
    case 16: return row_squares_of(h, k, 16);
    default: return row_squares_of(h, k, lanes);
    }
}

/* out[row] = the sum of the squares of x's row, as rms_norm adds them (to check `lanes`) */
void sum_squares(const uint16_t *x, int64_t m, int64_t k, int lanes, float *out) {
    for (int64_t row = 0; row < m; row++) out[row] = row_squares(x + row * k, k, lanes);
}

/* torch's rms_norm in float32: rsqrt(sum / k + eps), x times it, times w, then rounded */
static inline void norm_row(const uint16_t *h, int64_t k, const uint16_t *w, float eps,
                            int lanes, uint16_t *out) {
    const float mean = row_squares(h, k, lanes) / (float)k;
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int64_t j = 0; j < k; j++) {
        const float scaled = bf16_to_float(h[j]) * scale;
        out[j] = float_to_bf16(scaled * bf16_to_float(w[j]));
    }
}

void rms_norm(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, float eps,
              int lanes, uint16_t *out, int threads) {
    const int n = team(threads, m, m * k);
#pragma omp parallel for num_threads(n) if (n > 1)
    for (int64_t row = 0; row < m; row++) norm_row(x + row * k, k, w, eps, lanes, out + row * k);
}

void add_rms_norm(const uint16_t *x, const uint16_t *y, int64_t m, int64_t k, const uint16_t *w,
                  float eps, int lanes, uint16_t *h, uint16_t *out, int threads) {
    const int n = team(threads, m, m * k);
#pragma omp parallel for num_threads(n) if (n > 1)
    for (int64_t row = 0; row < m; row++) {
        const uint16_t *xr = x + row * k, *yr = y + row * k;
        uint16_t *hr = h + row * k;
        for (int64_t j = 0; j < k; j++)
            hr[j] = float_to_bf16(bf16_to_float(xr[j]) + bf16_to_float(yr[j]));
        norm_row(hr, k, w, eps, lanes, out + row * k);
    }
}

static inline void rope_row(uint16_t *x, int64_t heads, int64_t d, const uint16_t *c,
                            const uint16_t *s) {
    const int64_t half = d / 2;
    for (int64_t head = 0; head < heads; head++) {
        uint16_t *x1 = x + head * d, *x2 = x1 + half;
        for (int64_t j = 0; j < half; j++) {
            const float a = bf16_to_float(x1[j]), b = bf16_to_float(x2[j]);
            const float cj = bf16_to_float(c[j]), sj = bf16_to_float(s[j]);
            x1[j] = float_to_bf16(round_bf16(a * cj) - round_bf16(b * sj));
            x2[j] = float_to_bf16(round_bf16(b * cj) + round_bf16(a * sj));
        }
    }
}

void rope(uint16_t *x, int64_t m, int64_t heads, int64_t stride, int64_t d, const uint16_t *cos,
          const uint16_t *sin, int threads) {
    const int64_t half = d / 2;
    const int n = team(threads, m, m * heads * d);
#pragma omp parallel for num_threads(n) if (n > 1)
    for (int64_t row = 0; row < m; row++)
        rope_row(x + row * stride, heads, d, cos + row * half, sin + row * half);
}

void rope_write_kv(uint16_t *x, int64_t m, int64_t q_heads, int64_t kv_heads, int64_t stride,
                   int64_t d, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                   uint16_t *k_cache, uint16_t *v_cache, int threads) {
    const int64_t half = d / 2, width = kv_heads * d;
    const int n = team(threads, m, m * (q_heads + 2 * kv_heads) * d);
#pragma omp parallel for num_threads(n) if (n > 1)
    for (int64_t row = 0; row < m; row++) {
        uint16_t *r = x + row * stride;
        rope_row(r, q_heads + kv_heads, d, cos + row * half, sin + row * half);
        memcpy(k_cache + slots[row] * width, r + q_heads * d, width * sizeof(uint16_t));
        memcpy(v_cache + slots[row] * width, r + (q_heads + kv_heads) * d, width * sizeof(uint16_t));
    }
}
