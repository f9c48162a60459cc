/* The two ends of an int8 matmul with activations quantized per row (`int8_linear.py`), and
   the SwiGLU between two of them.

   quantize_rows: x [m, k] (float32 or bfloat16, contiguous); each row to int8
   q = round(x * (1 / scale)), scale = max |x| / 127, at least MIN_SCALE (a row of zeros, or of
   values too small to matter, rounds to zeros). A row holding a NaN or an infinity gets a NaN
   scale and zeros, so its products come out NaN, as a float matmul's would. q and scales [m]
   out.

   dequantize_rows: acc [m, n] int32 (the products of q and an int8 weight) to
   out = acc * row_scales[m] * col_scales[n], float32 or bfloat16 (rounded to nearest even).

   swiglu_quantize_rows: acc [m, 2i] int32, the products of q and a fused gate/up weight (the
   gate's i outputs, then the up's), scaled back as dequantize_rows does: h = silu(gate) * up,
   each row of h then rounded to int8 as quantize_rows rounds a row, for the down projection.
   With bf16, gate, up, silu(gate) and h are rounded to bfloat16 where torch's bfloat16 ops
   (dequantize_rows' output, F.silu, mul_) round them, so the int8 rows are those of the
   unfused path but for SiLU's last bit (another exp); without, all stays float32. q [m, i]
   and scales [m] out; returns 0, or -1 where it could not have a row's buffer.

   Built by lockgate/llm/native.py; rows are shared over the calling thread's OpenMP team when
   there are enough of them. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"

#define PARALLEL_FROM 32768 /* elements from which the rows are split over threads */
#define MIN_SCALE 1e-12f    /* as the weight's scales (int8_linear.py) */

/* The largest |x| of a row as the bits of a float32 with the sign cleared: their integer
   order is the order of the magnitudes (an integer max, which vectorises), and any value at
   or above 0x7f800000 is an infinity or a NaN. */
static inline uint32_t absmax_f32(const float *x, int64_t k) {
    uint32_t top = 0;
    for (int64_t j = 0; j < k; j++) {
        uint32_t bits;
        memcpy(&bits, x + j, sizeof bits);
        bits &= 0x7fffffffu;
        top = bits > top ? bits : top;
    }
    return top;
}

static inline uint32_t absmax_bf16(const uint16_t *x, int64_t k) {
    uint16_t top = 0;
    for (int64_t j = 0; j < k; j++) {
        const uint16_t bits = x[j] & 0x7fffu;
        top = bits > top ? bits : top;
    }
    return (uint32_t)top << 16;
}

#define QUANTIZE_ROW(ELEM, LOAD, ABSMAX)                                                     \
    {                                                                                       \
        const ELEM *xr = (const ELEM *)x + row * k;                                         \
        int8_t *qr = q + row * k;                                                           \
        const uint32_t top_bits = ABSMAX(xr, k);                                            \
        if (top_bits >= 0x7f800000u) { /* an infinity or a NaN */                           \
            scales[row] = NAN;                                                              \
            memset(qr, 0, (size_t)k);                                                       \
        } else {                                                                            \
            float top;                                                                      \
            memcpy(&top, &top_bits, sizeof top);                                            \
            const float scale = top / 127.0f > MIN_SCALE ? top / 127.0f : MIN_SCALE;        \
            const float inv = 1.0f / scale;                                                 \
            scales[row] = scale;                                                            \
            for (int64_t j = 0; j < k; j++) {                                               \
                float v = __builtin_rintf(LOAD(xr[j]) * inv);                               \
                v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);                      \
                qr[j] = (int8_t)v;                                                          \
            }                                                                               \
        }                                                                                   \
    }

#define LOAD_F32(v) (v)
#define LOAD_BF16(v) bf16_to_float(v)

void quantize_rows(const void *x, int bf16, int64_t m, int64_t k, int8_t *q, float *scales,
                   int threads) {
    const int team = threads > 1 && m > 1 && m * k >= PARALLEL_FROM ? threads : 1;
#pragma omp parallel for num_threads(team) if (team > 1)
    for (int64_t row = 0; row < m; row++) {
        if (bf16)
            QUANTIZE_ROW(uint16_t, LOAD_BF16, absmax_bf16)
        else
            QUANTIZE_ROW(float, LOAD_F32, absmax_f32)
    }
}

void dequantize_rows(const int32_t *acc, int64_t m, int64_t n, const float *row_scales,
                     const float *col_scales, int bf16, void *out, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && m > 1 && m * n >= PARALLEL_FROM)
    for (int64_t row = 0; row < m; row++) {
        const int32_t *ar = acc + row * n;
        const float scale = row_scales[row];
        if (bf16) {
            uint16_t *o = (uint16_t *)out + row * n;
            for (int64_t j = 0; j < n; j++) o[j] = float_to_bf16((float)ar[j] * scale * col_scales[j]);
        } else {
            float *o = (float *)out + row * n;
            for (int64_t j = 0; j < n; j++) o[j] = (float)ar[j] * scale * col_scales[j];
        }
    }
}

/* one row of h (float32, [k]) to int8, as QUANTIZE_ROW rounds x's */
static inline void quantize_f32_row(const float *hr, int64_t k, int8_t *qr, float *scale_out) {
    const uint32_t top_bits = absmax_f32(hr, k);
    if (top_bits >= 0x7f800000u) {
        *scale_out = NAN;
        memset(qr, 0, (size_t)k);
        return;
    }
    float top;
    memcpy(&top, &top_bits, sizeof top);
    const float scale = top / 127.0f > MIN_SCALE ? top / 127.0f : MIN_SCALE;
    const float inv = 1.0f / scale;
    *scale_out = scale;
    for (int64_t j = 0; j < k; j++) {
        float v = __builtin_rintf(hr[j] * inv);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        qr[j] = (int8_t)v;
    }
}

/* silu(g) = g * sigmoid(g), with e^-|g| (never above 1) for both signs */
static inline float silu(float g) {
    const float e = exp_nonpositive(-__builtin_fabsf(g));
    return g * (g >= 0.0f ? 1.0f : e) / (1.0f + e);
}

static inline float round_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

int swiglu_quantize_rows(const int32_t *acc, int64_t m, int64_t i, const float *row_scales,
                         const float *col_scales, int bf16, int8_t *q, float *scales,
                         int threads) {
    const int team = threads > 1 && m > 1 && 2 * m * i >= PARALLEL_FROM ? threads : 1;
    int failed = 0;
#pragma omp parallel num_threads(team) if (team > 1) reduction(| : failed)
    {
        float *h = malloc((size_t)i * sizeof *h);
        if (h == NULL) failed = 1;
#pragma omp for
        for (int64_t row = 0; row < m; row++) {
            if (h == NULL) continue;
            const int32_t *gate = acc + row * 2 * i, *up = gate + i;
            const float *gate_scales = col_scales, *up_scales = col_scales + i;
            const float scale = row_scales[row];
            if (bf16)
                for (int64_t j = 0; j < i; j++) {
                    const float g = round_bf16((float)gate[j] * scale * gate_scales[j]);
                    const float u = round_bf16((float)up[j] * scale * up_scales[j]);
                    h[j] = round_bf16(round_bf16(silu(g)) * u);
                }
            else
                for (int64_t j = 0; j < i; j++)
                    h[j] = silu((float)gate[j] * scale * gate_scales[j]) *
                           ((float)up[j] * scale * up_scales[j]);
            quantize_f32_row(h, i, q + row * i, scales + row);
        }
        free(h);
    }
    return failed ? -1 : 0;
}
