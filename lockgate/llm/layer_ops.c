/* The elementwise steps of a bfloat16 decoder layer, each one pass over its rows
   (`layer_ops.py`). Each computes in float32 and rounds to bfloat16 (nearest even) where
   torch's bfloat16 ops round, so the results are torch's but for the order of a row's sum of
   squares (RMSNorm) and the last bit of exp (SiLU).

   rms_norm:     out = x * rsqrt(mean(x^2) + eps) * w                 x, out [m, k]
   add_rms_norm: h = x + y; out = rms_norm(h)                          x, y, h, out [m, k]
   rope:         in place, on the first `heads` heads of each row of x (row stride `stride`),
                 half-split layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each
                 product and sum rounded; cos, sin [m, d/2]

   Built by lockgate/llm/native.py; rows are shared over the calling thread's OpenMP team when
   there are enough of them. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_FROM 32768 /* elements from which the rows are split over threads */

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float round_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

static inline int team(int threads, int64_t m, int64_t elements) {
    return threads > 1 && m > 1 && elements >= PARALLEL_FROM ? threads : 1;
}

static inline void norm_row(const uint16_t *h, int64_t k, const uint16_t *w, float eps,
                            uint16_t *out) {
    float squares = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const float v = bf16_to_float(h[j]);
        squares += v * v;
    }
    const float scale = 1.0f / sqrtf(squares / (float)k + eps);
    for (int64_t j = 0; j < k; j++)
        out[j] = float_to_bf16(bf16_to_float(h[j]) * scale * bf16_to_float(w[j]));
}

void rms_norm(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, float eps,
              uint16_t *out, int threads) {
    const int n = team(threads, m, m * k);
#pragma omp parallel for num_threads(n) if (n > 1)
    for (int64_t row = 0; row < m; row++) norm_row(x + row * k, k, w, eps, out + row * k);
}

void add_rms_norm(const uint16_t *x, const uint16_t *y, int64_t m, int64_t k, const uint16_t *w,
                  float eps, uint16_t *h, uint16_t *out, int threads) {
    const int n = team(threads, m, m * k);
#pragma omp parallel for num_threads(n) if (n > 1)
    for (int64_t row = 0; row < m; row++) {
        const uint16_t *xr = x + row * k, *yr = y + row * k;
        uint16_t *hr = h + row * k;
        for (int64_t j = 0; j < k; j++)
            hr[j] = float_to_bf16(bf16_to_float(xr[j]) + bf16_to_float(yr[j]));
        norm_row(hr, k, w, eps, out + row * k);
    }
}

void rope(uint16_t *x, int64_t m, int64_t heads, int64_t stride, int64_t d, const uint16_t *cos,
          const uint16_t *sin, int threads) {
    const int64_t half = d / 2;
    const int n = team(threads, m, m * heads * d);
#pragma omp parallel for num_threads(n) if (n > 1)
    for (int64_t row = 0; row < m; row++) {
        const uint16_t *c = cos + row * half, *s = sin + row * half;
        for (int64_t head = 0; head < heads; head++) {
            uint16_t *x1 = x + row * stride + head * d, *x2 = x1 + half;
            for (int64_t j = 0; j < half; j++) {
                const float a = bf16_to_float(x1[j]), b = bf16_to_float(x2[j]);
                const float cj = bf16_to_float(c[j]), sj = bf16_to_float(s[j]);
                x1[j] = float_to_bf16(round_bf16(a * cj) - round_bf16(b * sj));
                x2[j] = float_to_bf16(round_bf16(b * cj) + round_bf16(a * sj));
            }
        }
    }
}
