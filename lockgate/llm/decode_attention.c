/* Decode attention over a paged KV cache, read in place.

   Each sequence has one query token per head; its keys and values stay in the cache blocks
   its block table names, and are read from there: no gather into a padded copy, no mask.
   Work items are (sequence, KV head) pairs, shared out over the OpenMP team of the calling
   thread; a pair's query heads (grouped-query attention) read each key and value row once,
   together.

   Shapes (float32 q and out, contiguous):
     q            [S, nh, d]
     k_cache      [num_blocks, block_size, kvh, d]   (float32 or bfloat16)
     v_cache      [num_blocks, block_size, kvh, d]
     block_tables [S, table_width] int64
     seq_lens     [S] int64
     out          [S, nh, d]

   Built by lockgate/llm/native.py with -O3 -march=native -fassociative-math -fopenmp
   (the float sums vectorise), never -ffast-math: in a shared library that would set
   flush-to-zero for the whole process. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"

#define MAX_GROUP 32
#define MAX_HEAD_DIM 256

/* One (sequence, KV head) pair: its `group` query heads q [group, d] attend its `len` keys
   and values, read in place through its block table; out [group, d]; scores [group, len]
   is scratch. DIM is the head size: a constant for the sizes models use (the loops over it
   unroll and vectorise), `d` for the rest. */
#define ATTEND(NAME, ELEM, LOAD, DIM)                                                        \
    static void NAME(const float *restrict q, const ELEM *restrict k_cache,                 \
                     const ELEM *restrict v_cache, const int64_t *restrict table,           \
                     int64_t len, int64_t row, int64_t offset, int64_t group, int64_t d,    \
                     int64_t block_size, float scale, float *restrict scores,               \
                     float *restrict out) {                                                 \
        (void)d;                                                                            \
        float row_f[MAX_HEAD_DIM];                                                          \
        for (int64_t t = 0, b = 0; t < len; b++) {                                          \
            const int64_t first = table[b] * block_size;                                    \
            const int64_t end = t + block_size < len ? t + block_size : len;                \
            for (int64_t slot = first; t < end; t++, slot++) {                              \
                const ELEM *key = k_cache + slot * row + offset;                            \
                for (int64_t i = 0; i < (DIM); i++) row_f[i] = LOAD(key[i]);               \
                for (int64_t g = 0; g < group; g++) {                                       \
                    const float *qg = q + g * (DIM);                                        \
                    float acc = 0.0f;                                                       \
                    for (int64_t i = 0; i < (DIM); i++) acc += qg[i] * row_f[i];           \
                    scores[g * len + t] = acc * scale;                                      \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        float total[MAX_GROUP];                                                             \
        for (int64_t g = 0; g < group; g++) {                                               \
            float *sg = scores + g * len;                                                   \
            float top = sg[0];                                                              \
            for (int64_t t = 1; t < len; t++) top = sg[t] > top ? sg[t] : top;             \
            float sum = 0.0f;                                                               \
            for (int64_t t = 0; t < len; t++) {                                             \
                sg[t] = exp_nonpositive(sg[t] - top);                                       \
                sum += sg[t];                                                               \
            }                                                                               \
            total[g] = sum;                                                                 \
            memset(out + g * (DIM), 0, (size_t)(DIM) * sizeof(float));                     \
        }                                                                                   \
        for (int64_t t = 0, b = 0; t < len; b++) {                                          \
            const int64_t first = table[b] * block_size;                                    \
            const int64_t end = t + block_size < len ? t + block_size : len;                \
            for (int64_t slot = first; t < end; t++, slot++) {                              \
                const ELEM *value = v_cache + slot * row + offset;                          \
                for (int64_t i = 0; i < (DIM); i++) row_f[i] = LOAD(value[i]);             \
                for (int64_t g = 0; g < group; g++) {                                       \
                    const float w = scores[g * len + t];                                    \
                    float *og = out + g * (DIM);                                            \
                    for (int64_t i = 0; i < (DIM); i++) og[i] += w * row_f[i];             \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int64_t g = 0; g < group; g++) {                                               \
            const float inv = 1.0f / total[g];                                              \
            float *og = out + g * (DIM);                                                    \
            for (int64_t i = 0; i < (DIM); i++) og[i] *= inv;                              \
        }                                                                                   \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_float(x)
ATTEND(attend_f32_64, float, LOAD_F32, 64)
ATTEND(attend_bf16_64, uint16_t, LOAD_BF16, 64)
ATTEND(attend_f32_128, float, LOAD_F32, 128)
ATTEND(attend_bf16_128, uint16_t, LOAD_BF16, 128)
ATTEND(attend_f32_any, float, LOAD_F32, d)
ATTEND(attend_bf16_any, uint16_t, LOAD_BF16, d)

typedef void (*attend_fn)(const float *, const void *, const void *, const int64_t *, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, float, float *, float *);

static attend_fn pick(int bf16, int64_t d) {
    if (d == 64) return bf16 ? (attend_fn)attend_bf16_64 : (attend_fn)attend_f32_64;
    if (d == 128) return bf16 ? (attend_fn)attend_bf16_128 : (attend_fn)attend_f32_128;
    return bf16 ? (attend_fn)attend_bf16_any : (attend_fn)attend_f32_any;
}

/* Returns 0, or -1 when a shape is out of the kernel's bounds or a block table names a block
   outside the cache (nothing is written, nothing out of bounds is read), or -2 when scratch
   memory could not be had. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                           int bf16, const int64_t *block_tables, int64_t table_width,
                           const int64_t *seq_lens, int64_t num_seqs, int64_t num_blocks,
                           int64_t nh, int64_t kvh, int64_t d, int64_t block_size, float scale,
                           int threads, float *out) {
    if (kvh <= 0 || nh % kvh != 0 || nh / kvh > MAX_GROUP || d <= 0 || d > MAX_HEAD_DIM ||
        block_size <= 0)
        return -1;
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (seq_lens[s] <= 0 || seq_lens[s] > table_width * block_size) return -1;
        longest = seq_lens[s] > longest ? seq_lens[s] : longest;
        const int64_t used = (seq_lens[s] + block_size - 1) / block_size;
        for (int64_t b = 0; b < used; b++) { /* every block read lies in the cache */
            const int64_t block = block_tables[s * table_width + b];
            if (block < 0 || block >= num_blocks) return -1;
        }
    }
    const int64_t group = nh / kvh;
    const attend_fn attend = pick(bf16, d);
    const int64_t items = num_seqs * kvh;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
    {
        float *scores = malloc((size_t)(group * longest) * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (scores == NULL) continue;
            const int64_t s = item / kvh, head = item % kvh;
            const float *qs = q + (s * nh + head * group) * d;
            float *os = out + (s * nh + head * group) * d;
            const int64_t *table = block_tables + s * table_width;
            attend(qs, k_cache, v_cache, table, seq_lens[s], kvh * d, head * d, group, d,
                   block_size, scale, scores, os);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
