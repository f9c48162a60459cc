/* Prefill attention over a paged KV cache, read in place: causal, grouped-query.

   A prefill segment is a sequence whose query is several tokens: a whole prompt (context 0)
   or a chunk of one after `context` tokens already in the cache. This step's keys and values
   are in the cache before attention runs, so both attend the same way: query row i of a
   segment sits at position context + i and sees keys 0..context + i, read from the blocks
   its block table names. No gather, no mask tensor.

   Work items are (segment, KV head, tile of TILE query rows), shared out over the OpenMP team
   of the calling thread, the longest first. A tile's query rows and the group's query heads
   (grouped-query attention) read each key and value row once, together, a chunk of CHUNK keys
   at a time, with an online (flash-style) softmax in float32.

   Shapes (q and out in the cache's dtype; rows may be strided, heads are contiguous):
     q            [T, nh, d]    row i at q + i * q_stride
     k_cache      [num_blocks, block_size, kvh, d]   (float32 or bfloat16)
     v_cache      [num_blocks, block_size, kvh, d]
     block_tables [P, table_width] int64
     starts       [P] int64     first row of each segment in q and out
     query_lens   [P] int64
     context_lens [P] int64
     out          [T, nh, d]    row i at out + i * out_stride; rows of no segment untouched

   Three tile routines. At head sizes 64 and 128 with AVX-512 the scores are computed with
   the 16 lanes over a tile's query rows (a key element broadcast against 16 rows' query
   elements), so the softmax is lane-wise, and the weighted sums of values with the lanes
   over the head's dimensions. With AVX-512 BF16 and a bfloat16 cache the products run in
   `vdpbf16ps` (bfloat16 pairs multiplied, summed into float32 lanes), the weights rounded to
   bfloat16 as SDPA's bfloat16 kernel rounds them; otherwise in float32 FMAs (a bfloat16
   cache widened as it is read). Elsewhere (other head sizes, another CPU) a portable loop
   in float32.

   Built by lockgate/llm/native.py with -O3 -march=native -fassociative-math -fopenmp, never
   -ffast-math: in a shared library that would set flush-to-zero for the whole process. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_GROUP 32
#define MAX_HEAD_DIM 256
#define TILE 16  /* query rows per work item: the 16 float32 lanes of a 512-bit vector */
#define CHUNK 16 /* keys per step of the online softmax */

/* One tile's place: segment rows [r0, r0 + rows) of KV head `head`, keys 0..context + r0 +
   rows - 1 through `table`. */
typedef struct {
    const void *q;
    int64_t q_stride;
    const void *k_cache, *v_cache;
    const int64_t *table;
    int64_t row0;    /* first row of the tile in q and out */
    int64_t rows;    /* query rows in the tile, 1..TILE */
    int64_t first;   /* position of the tile's first query row: context + r0 */
    int64_t head;    /* KV head */
    int64_t group;   /* query heads per KV head */
    int64_t d, kvh, block_size;
    float scale;
    void *out;
    int64_t out_stride;
} Tile;

/* Scratch of one thread: enough for any tile of the call. */
typedef struct {
    float *acc;     /* [group, TILE, d] running weighted sums of values */
    float *stats;   /* [2, group, TILE] running max and sum of each query's softmax */
    float *scores;  /* [group, TILE, CHUNK] weights of a chunk's keys */
    float *kv;      /* [2, CHUNK, d] a chunk's keys and values in float32 */
    float *qt;      /* [group, d, TILE] the queries transposed (AVX-512 float32) */
    uint16_t *packed; /* [group, d / 2, TILE, 2] + [CHUNK, d] + [CHUNK / 2, d, 2] (AVX-512) */
} Scratch;

static inline const void *cache_row(const void *cache, const Tile *t, int64_t key, int bf16) {
    const int64_t slot = t->table[key / t->block_size] * t->block_size + key % t->block_size;
    const int64_t at = (slot * t->kvh + t->head) * t->d;
    return bf16 ? (const void *)((const uint16_t *)cache + at)
                : (const void *)((const float *)cache + at);
}

static inline float load_elem(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* The portable tile: float32 throughout, loops over the head size that vectorise. */
static void tile_portable(const Tile *t, int bf16, Scratch *s) {
    const int64_t d = t->d, group = t->group, rows = t->rows;
    const int64_t keys = t->first + rows; /* keys the tile's last row sees */
    float *acc = s->acc, *top = s->stats, *sum = s->stats + group * TILE;
    float *kf = s->kv, *vf = s->kv + CHUNK * d;
    float qf[MAX_HEAD_DIM];
    memset(acc, 0, (size_t)(group * TILE * d) * sizeof(float));
    for (int64_t i = 0; i < group * TILE; i++) top[i] = -INFINITY, sum[i] = 0.0f;
    for (int64_t k0 = 0; k0 < keys; k0 += CHUNK) {
        const int64_t n = keys - k0 < CHUNK ? keys - k0 : CHUNK;
        for (int64_t j = 0; j < n; j++) {
            const void *key = cache_row(t->k_cache, t, k0 + j, bf16);
            const void *value = cache_row(t->v_cache, t, k0 + j, bf16);
            for (int64_t i = 0; i < d; i++) kf[j * d + i] = load_elem(key, i, bf16);
            for (int64_t i = 0; i < d; i++) vf[j * d + i] = load_elem(value, i, bf16);
        }
        for (int64_t g = 0; g < group; g++) {
            for (int64_t r = 0; r < rows; r++) {
                const int64_t sees = t->first + r + 1 - k0; /* keys of the chunk row r sees */
                if (sees <= 0) continue;
                const int64_t m = sees < n ? sees : n;
                const void *qrow = (const char *)t->q +
                    ((t->row0 + r) * t->q_stride + (t->head * group + g) * d) *
                        (bf16 ? 2 : 4);
                for (int64_t i = 0; i < d; i++) qf[i] = load_elem(qrow, i, bf16);
                float sc[CHUNK], best = top[g * TILE + r];
                for (int64_t j = 0; j < m; j++) {
                    float dot = 0.0f;
                    for (int64_t i = 0; i < d; i++) dot += qf[i] * kf[j * d + i];
                    sc[j] = dot * t->scale;
                    best = sc[j] > best ? sc[j] : best;
                }
                const float alpha = exp_nonpositive(top[g * TILE + r] - best);
                float *o = acc + (g * TILE + r) * d, total = sum[g * TILE + r] * alpha;
                for (int64_t i = 0; i < d; i++) o[i] *= alpha;
                for (int64_t j = 0; j < m; j++) {
                    const float p = exp_nonpositive(sc[j] - best);
                    total += p;
                    for (int64_t i = 0; i < d; i++) o[i] += p * vf[j * d + i];
                }
                top[g * TILE + r] = best;
                sum[g * TILE + r] = total;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        for (int64_t r = 0; r < rows; r++) {
            const float inv = 1.0f / sum[g * TILE + r];
            const float *o = acc + (g * TILE + r) * d;
            const int64_t at = (t->row0 + r) * t->out_stride + (t->head * group + g) * d;
            if (bf16) {
                uint16_t *dst = (uint16_t *)t->out + at;
                for (int64_t i = 0; i < d; i++) dst[i] = float_to_bf16(o[i] * inv);
            } else {
                float *dst = (float *)t->out + at;
                for (int64_t i = 0; i < d; i++) dst[i] = o[i] * inv;
            }
        }
    }
}

#ifdef __AVX512F__

/* e^x lane-wise, x <= 0: the same Cephes polynomial, 2^n applied by scalef. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* One chunk's step of the online softmax of one query head over a tile's rows (the lanes):
   sc [CHUNK] raw scores of keys k0.. become their weights e^(score - max) (0 where a row
   does not see the key), top and sum the running max and sum; returns the factor (per
   row) that rescales what was summed before, and in *same whether it is 1 for every row.
   `limit`: the last key each row sees. */
static inline __m512 softmax_step(__m512 sc[CHUNK], __m512 *top, __m512 *sum, __m512 scale,
                                  __m512i limit, int64_t k0, int masked, __mmask16 *same) {
    __mmask16 sees[CHUNK];
    __m512 best = *top;
    for (int j = 0; j < CHUNK; j++) {
        sc[j] = _mm512_mul_ps(sc[j], scale);
        if (masked) {
            sees[j] = _mm512_cmpge_epi32_mask(limit, _mm512_set1_epi32((int32_t)(k0 + j)));
            sc[j] = _mm512_mask_blend_ps(sees[j], _mm512_set1_ps(-INFINITY), sc[j]);
        }
        best = _mm512_max_ps(best, sc[j]);
    }
    const __m512 alpha = exp512(_mm512_sub_ps(*top, best));
    *same = _mm512_cmp_ps_mask(best, *top, _CMP_EQ_OQ);
    __m512 total = _mm512_mul_ps(*sum, alpha);
    for (int j = 0; j < CHUNK; j++) {
        sc[j] = exp512(_mm512_sub_ps(sc[j], best));
        if (masked) sc[j] = _mm512_maskz_mov_ps(sees[j], sc[j]);
        total = _mm512_add_ps(total, sc[j]);
    }
    *sum = total;
    *top = best;
    return alpha;
}

/* lane r sees keys up to first + r (rows past the tile's end: zero queries, never written) */
static inline __m512i row_limits(int64_t first) {
    return _mm512_add_epi32(_mm512_set1_epi32((int32_t)first),
                            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
}

/* out's rows of head g: acc's [TILE][d] times 1 / sum (per row), in the cache's dtype */
static inline void store_rows(const Tile *t, int64_t g, const float *acc, __m512 sum,
                              int bf16, int64_t d) {
    float inv[TILE];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
    for (int64_t r = 0; r < t->rows; r++) {
        const float *o = acc + r * d;
        const int64_t at = (t->row0 + r) * t->out_stride + (t->head * t->group + g) * d;
        for (int64_t c = 0; c < d; c += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o + c), _mm512_set1_ps(inv[r]));
            if (!bf16) {
                _mm512_storeu_ps((float *)t->out + at + c, x);
                continue;
            }
            float lanes[16];
            _mm512_storeu_ps(lanes, x);
            uint16_t *dst = (uint16_t *)t->out + at + c;
            for (int i = 0; i < 16; i++) dst[i] = float_to_bf16(lanes[i]);
        }
    }
}

/* The weighted sums of values of one head's rows, lanes over the head's D dimensions, RB
   rows at a time: acc [TILE][D] rescaled by alpha (unless it is 1 for every row), then
   acc[r] += sum over keys of weight(r, key) * value(key). WEIGH(i, r) is the broadcast
   weight of row r for key (or key pair) i, VALUE(i, c) the c-th 16 lanes of its value,
   STEP the fused multiply-add. */
#define SUM_VALUES(D, RB, KEYS, ACC_T, VALUE_T, VALUE, WEIGH, STEP)                           \
    do {                                                                                      \
        float alphas[TILE];                                                                   \
        _mm512_storeu_ps(alphas, alpha);                                                      \
        for (int64_t r0 = 0; r0 < rows; r0 += (RB)) {                                         \
            __m512 o[(RB)][(D) / 16];                                                         \
            float *block = (ACC_T) + r0 * (D);                                                \
            for (int r = 0; r < (RB); r++)                                                    \
                for (int c = 0; c < (D) / 16; c++) {                                          \
                    o[r][c] = _mm512_loadu_ps(block + r * (D) + 16 * c);                         \
                    if (same != 0xffff)                                                       \
                        o[r][c] = _mm512_mul_ps(o[r][c], _mm512_set1_ps(alphas[r0 + r]));     \
                }                                                                             \
            for (int i = 0; i < (KEYS); i++) {                                                \
                VALUE_T v[(D) / 16];                                                          \
                for (int c = 0; c < (D) / 16; c++) v[c] = VALUE(i, c);                        \
                for (int r = 0; r < (RB); r++) {                                              \
                    const VALUE_T w = WEIGH(i, r0 + r);                                       \
                    for (int c = 0; c < (D) / 16; c++) o[r][c] = STEP(o[r][c], v[c], w);      \
                }                                                                             \
            }                                                                                 \
            for (int r = 0; r < (RB); r++)                                                    \
                for (int c = 0; c < (D) / 16; c++)                                            \
                    _mm512_storeu_ps(block + r * (D) + 16 * c, o[r][c]);                         \
        }                                                                                     \
    } while (0)

/* The float32 tile for head size D (64 or 128), products in float32 FMAs: a float32 cache
   (BF16 0), or a bfloat16 cache on a CPU without AVX-512 BF16 (BF16 1, widened on load).
   Scratch: qt [group][D][TILE] the queries transposed (lanes over rows), kv [2][CHUNK][D]
   the chunk's keys and values, scores [group][CHUNK][TILE] the weights. */
#define TILE_F32(NAME, D, RB, BF16)                                                           \
    static void NAME(const Tile *t, Scratch *s) {                                             \
        const int64_t group = t->group, rows = t->rows;                                       \
        const int64_t keys = t->first + rows, dim = (D);                                      \
        float *qt = s->qt, *kb = s->kv, *vb = s->kv + CHUNK * (D), *acc = s->acc;             \
        __m512 top[MAX_GROUP], sum[MAX_GROUP];                                                \
        const __m512 scale = _mm512_set1_ps(t->scale);                                        \
        const __m512i limit = row_limits(t->first);                                           \
        const int64_t esize = (BF16) ? 2 : 4;                                                 \
        for (int64_t g = 0; g < group; g++) {                                                 \
            for (int64_t r = 0; r < TILE; r++) {                                              \
                float *dst = qt + g * (D) * TILE + r;                                         \
                const void *src = (const char *)t->q +                                        \
                    ((t->row0 + r) * t->q_stride + (t->head * group + g) * (D)) * esize;      \
                for (int64_t i = 0; i < (D); i++)                                             \
                    dst[i * TILE] = r < rows ? load_elem(src, i, (BF16)) : 0.0f;            \
            }                                                                                 \
            top[g] = _mm512_set1_ps(-INFINITY);                                               \
            sum[g] = _mm512_setzero_ps();                                                     \
        }                                                                                     \
        memset(acc, 0, (size_t)(group * TILE * (D)) * sizeof(float));                         \
        for (int64_t k0 = 0; k0 < keys; k0 += CHUNK) {                                        \
            const int64_t n = keys - k0 < CHUNK ? keys - k0 : CHUNK;                          \
            for (int64_t j = 0; j < CHUNK; j++) { /* past the last key: zeros, weighted 0 */  \
                if (j >= n) {                                                                 \
                    memset(kb + j * (D), 0, (D) * sizeof(float));                             \
                    memset(vb + j * (D), 0, (D) * sizeof(float));                             \
                    continue;                                                                 \
                }                                                                             \
                const void *key = cache_row(t->k_cache, t, k0 + j, (BF16));                   \
                const void *value = cache_row(t->v_cache, t, k0 + j, (BF16));                 \
                for (int64_t i = 0; i < (D); i++) kb[j * (D) + i] = load_elem(key, i, (BF16)); \
                for (int64_t i = 0; i < (D); i++)                                             \
                    vb[j * (D) + i] = load_elem(value, i, (BF16));                          \
            }                                                                                 \
            const int masked = k0 + CHUNK - 1 > t->first;                                     \
            for (int64_t g = 0; g < group; g++) {                                             \
                __m512 sc[CHUNK];                                                             \
                for (int j = 0; j < CHUNK; j++) sc[j] = _mm512_setzero_ps();                  \
                const float *qg = qt + g * (D) * TILE;                                        \
                for (int64_t i = 0; i < (D); i++) {                                           \
                    const __m512 qv = _mm512_loadu_ps(qg + i * TILE);                         \
                    _Pragma("GCC unroll 16") for (int j = 0; j < CHUNK; j++) sc[j] =          \
                        _mm512_fmadd_ps(qv, _mm512_set1_ps(kb[j * (D) + i]), sc[j]);          \
                }                                                                             \
                __mmask16 same;                                                               \
                const __m512 alpha =                                                          \
                    softmax_step(sc, &top[g], &sum[g], scale, limit, k0, masked, &same);      \
                float *pg = s->scores + g * CHUNK * TILE;                                     \
                for (int j = 0; j < CHUNK; j++) _mm512_storeu_ps(pg + j * TILE, sc[j]);       \
                float *ag = acc + g * TILE * (D);                                             \
                SUM_VALUES(D, RB, CHUNK, ag, __m512, F32_VALUE, F32_WEIGHT, F32_STEP);        \
            }                                                                                 \
        }                                                                                     \
        for (int64_t g = 0; g < group; g++)                                                   \
            store_rows(t, g, acc + g * TILE * (D), sum[g], (BF16), (D));                      \
    }
#define F32_VALUE(i, c) _mm512_loadu_ps(vb + (i) * dim + 16 * (c))
#define F32_WEIGHT(i, r) _mm512_set1_ps(pg[(i) * TILE + (r)])
#define F32_STEP(o, v, w) _mm512_fmadd_ps((v), (w), (o))

TILE_F32(tile_f32_64, 64, 4, 0)
TILE_F32(tile_f32_128, 128, 2, 0)
#ifndef __AVX512BF16__
TILE_F32(tile_wide_64, 64, 4, 1)
TILE_F32(tile_wide_128, 128, 2, 1)
#endif

#ifdef __AVX512BF16__

/* two bfloat16s read or written as one 32-bit word (of memory also read as uint16_t) */
typedef uint32_t __attribute__((may_alias)) pair;

/* The bfloat16 tile for head size D (64 or 128), products in AVX-512 BF16: see the top of
   the file. Scratch: qp [group][D/2][TILE] bfloat16 pairs (row r's elements 2i, 2i+1 of
   head g), kb [CHUNK][D] the chunk's keys as stored, vp [CHUNK/2][D][2] its values in pairs
   of keys, scores [group][CHUNK/2][TILE] pairs of weights (keys 2i, 2i+1) per row. */
#define TILE_BF16(NAME, D, RB)                                                                \
    static void NAME(const Tile *t, Scratch *s) {                                             \
        const int64_t group = t->group, rows = t->rows;                                       \
        const int64_t keys = t->first + rows, dim = (D);                                      \
        pair *qp = (pair *)s->packed;                                                         \
        uint16_t *kb = s->packed + group * (D) * TILE;                                        \
        uint16_t *vp = kb + CHUNK * (D);                                                      \
        float *acc = s->acc;                                                                  \
        __m512 top[MAX_GROUP], sum[MAX_GROUP];                                                \
        const __m512 scale = _mm512_set1_ps(t->scale);                                        \
        const __m512i limit = row_limits(t->first);                                           \
        const __m512i interleave = _mm512_set_epi16(                                          \
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,   \
            5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);                                            \
        for (int64_t g = 0; g < group; g++) {                                                 \
            for (int64_t r = 0; r < TILE; r++) {                                              \
                pair *dst = qp + g * ((D) / 2) * TILE + r;                                    \
                if (r >= rows) {                                                              \
                    for (int64_t i = 0; i < (D) / 2; i++) dst[i * TILE] = 0;                  \
                    continue;                                                                 \
                }                                                                             \
                const pair *src = (const pair *)((const uint16_t *)t->q +                     \
                    (t->row0 + r) * t->q_stride + (t->head * group + g) * (D));               \
                for (int64_t i = 0; i < (D) / 2; i++) dst[i * TILE] = src[i];                 \
            }                                                                                 \
            top[g] = _mm512_set1_ps(-INFINITY);                                               \
            sum[g] = _mm512_setzero_ps();                                                     \
        }                                                                                     \
        memset(acc, 0, (size_t)(group * TILE * (D)) * sizeof(float));                         \
        for (int64_t k0 = 0; k0 < keys; k0 += CHUNK) {                                        \
            const int64_t n = keys - k0 < CHUNK ? keys - k0 : CHUNK;                          \
            /* the chunk's keys as stored, its values interleaved by pairs of keys */         \
            for (int64_t j = 0; j < CHUNK; j += 2) {                                          \
                if (j >= n) { /* past the tile's last key: zeros, weighted 0 */               \
                    memset(kb + j * (D), 0, 2 * (D) * sizeof(uint16_t));                      \
                    memset(vp + j * (D), 0, 2 * (D) * sizeof(uint16_t));                      \
                    continue;                                                                 \
                }                                                                             \
                const int two = j + 1 < n;                                                    \
                const uint16_t *k_a = cache_row(t->k_cache, t, k0 + j, 1);                    \
                const uint16_t *v_a = cache_row(t->v_cache, t, k0 + j, 1);                    \
                const uint16_t *k_b = two ? cache_row(t->k_cache, t, k0 + j + 1, 1) : NULL;   \
                const uint16_t *v_b = two ? cache_row(t->v_cache, t, k0 + j + 1, 1) : NULL;   \
                memcpy(kb + j * (D), k_a, (D) * sizeof(uint16_t));                            \
                if (two) memcpy(kb + (j + 1) * (D), k_b, (D) * sizeof(uint16_t));             \
                else memset(kb + (j + 1) * (D), 0, (D) * sizeof(uint16_t));                   \
                for (int64_t c = 0; c < (D); c += 16) {                                       \
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(v_a + c));         \
                    const __m256i b = two ? _mm256_loadu_si256((const __m256i *)(v_b + c))    \
                                          : _mm256_setzero_si256();                           \
                    const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);   \
                    _mm512_storeu_si512(vp + j * (D) + 2 * c,                                 \
                                        _mm512_permutexvar_epi16(interleave, ab));            \
                }                                                                             \
            }                                                                                 \
            const int masked = k0 + CHUNK - 1 > t->first;                                     \
            for (int64_t g = 0; g < group; g++) {                                             \
                /* scores [CHUNK] over the tile's rows (lanes) */                             \
                __m512 sc[CHUNK];                                                             \
                for (int j = 0; j < CHUNK; j++) sc[j] = _mm512_setzero_ps();                  \
                const pair *qg = qp + g * ((D) / 2) * TILE;                                   \
                const pair *kw = (const pair *)kb;                                            \
                for (int64_t i = 0; i < (D) / 2; i++) {                                       \
                    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + i * TILE);          \
                    _Pragma("GCC unroll 16") for (int j = 0; j < CHUNK; j++) sc[j] =          \
                        _mm512_dpbf16_ps(sc[j], qv,                                           \
                                         (__m512bh)_mm512_set1_epi32(                         \
                                             (int32_t)kw[j * ((D) / 2) + i]));                \
                }                                                                             \
                __mmask16 same;                                                               \
                const __m512 alpha =                                                          \
                    softmax_step(sc, &top[g], &sum[g], scale, limit, k0, masked, &same);      \
                /* weights rounded to bfloat16, in pairs of keys per row */                   \
                pair *pg = (pair *)s->scores + g * (CHUNK / 2) * TILE;                        \
                for (int j = 0; j < CHUNK; j += 2) {                                          \
                    const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(sc[j + 1], sc[j]);        \
                    _mm512_storeu_si512(pg + (j / 2) * TILE,                                  \
                                        _mm512_permutexvar_epi16(interleave, ab));            \
                }                                                                             \
                float *ag = acc + g * TILE * (D);                                             \
                SUM_VALUES(D, RB, CHUNK / 2, ag, __m512bh, BF16_VALUE, BF16_WEIGHT,           \
                           _mm512_dpbf16_ps);                                                 \
            }                                                                                 \
        }                                                                                     \
        for (int64_t g = 0; g < group; g++)                                                   \
            store_rows(t, g, acc + g * TILE * (D), sum[g], 1, (D));                           \
    }
#define BF16_VALUE(i, c) (__m512bh) _mm512_loadu_si512(vp + (i) * 2 * dim + 32 * (c))
#define BF16_WEIGHT(i, r) (__m512bh) _mm512_set1_epi32((int32_t)pg[(i) * TILE + (r)])

TILE_BF16(tile_bf16_64, 64, 4)
TILE_BF16(tile_bf16_128, 128, 2)

#endif /* __AVX512BF16__ */
#endif /* __AVX512F__ */

static void attend_tile(const Tile *t, int bf16, Scratch *s) {
#ifdef __AVX512F__
#ifdef __AVX512BF16__
    void (*const tiles[2][2])(const Tile *, Scratch *) = {{tile_f32_64, tile_f32_128},
                                                          {tile_bf16_64, tile_bf16_128}};
#else
    void (*const tiles[2][2])(const Tile *, Scratch *) = {{tile_f32_64, tile_f32_128},
                                                          {tile_wide_64, tile_wide_128}};
#endif
    if (t->d == 64 || t->d == 128) {
        tiles[bf16 != 0][t->d == 128](t, s);
        return;
    }
#endif
    tile_portable(t, bf16, s);
}

/* How this build's head sizes 64 and 128 are attended: 0, the portable loop; 1, float32
   FMAs in AVX-512 (a bfloat16 cache widened on load); 2, as 1 but a bfloat16 cache's
   products in AVX-512 BF16. */
int prefill_attention_vectorised(void) {
#if defined(__AVX512BF16__)
    return 2;
#elif defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

typedef struct {
    int64_t segment, row0, work;
} Item;

static int by_work_descending(const void *a, const void *b) {
    const int64_t x = ((const Item *)a)->work, y = ((const Item *)b)->work;
    return (x < y) - (x > y);
}

/* Returns 0, or -1 when a shape is out of the kernel's bounds, a segment lies outside q or
   its table, or a table names a block outside the cache (nothing is written, nothing out of
   bounds is read), or -2 when scratch memory could not be had. */
int paged_prefill_attention(const void *q, int64_t q_stride, const void *k_cache,
                            const void *v_cache, int bf16, const int64_t *block_tables,
                            int64_t table_width, const int64_t *starts,
                            const int64_t *query_lens, const int64_t *context_lens,
                            int64_t num_segments, int64_t num_tokens, int64_t num_blocks,
                            int64_t nh, int64_t kvh, int64_t d, int64_t block_size, float scale,
                            int threads, void *out, int64_t out_stride) {
    if (kvh <= 0 || nh % kvh != 0 || nh / kvh > MAX_GROUP || d <= 0 || d > MAX_HEAD_DIM ||
        d % 2 != 0 || block_size <= 0 || q_stride < nh * d || out_stride < nh * d)
        return -1;
    int64_t tiles = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        const int64_t len = query_lens[s], seen = context_lens[s] + query_lens[s];
        if (len <= 0 || context_lens[s] < 0 || starts[s] < 0 || starts[s] + len > num_tokens ||
            seen > table_width * block_size)
            return -1;
        const int64_t used = (seen + block_size - 1) / block_size;
        for (int64_t b = 0; b < used; b++) { /* every block read lies in the cache */
            const int64_t block = block_tables[s * table_width + b];
            if (block < 0 || block >= num_blocks) return -1;
        }
        tiles += (len + TILE - 1) / TILE;
    }
    const int64_t group = nh / kvh;
    Item *items = malloc((size_t)(tiles > 0 ? tiles : 1) * sizeof(Item));
    if (items == NULL) return -2;
    int64_t n = 0;
    for (int64_t s = 0; s < num_segments; s++)
        for (int64_t r0 = 0; r0 < query_lens[s]; r0 += TILE)
            items[n++] = (Item){s, r0, context_lens[s] + r0 + TILE};
    qsort(items, (size_t)n, sizeof(Item), by_work_descending);
    const int64_t work = n * kvh; /* (tile, KV head) pairs, the longest tiles first */
    const size_t acc_size = (size_t)(group * TILE * d) * sizeof(float);
    const size_t stats_size = (size_t)(2 * group * TILE) * sizeof(float);
    const size_t scores_size = (size_t)(group * TILE * CHUNK) * sizeof(float);
    const size_t kv_size = (size_t)(2 * CHUNK * d) * sizeof(float);
    const size_t qt_size = (size_t)(group * d * TILE) * sizeof(float);
    const size_t packed_size = (size_t)(group * d * TILE + 2 * CHUNK * d) * sizeof(uint16_t);
    const size_t sizes[6] = {acc_size, stats_size, scores_size, kv_size, qt_size, packed_size};
    size_t total = 0;
    for (int i = 0; i < 6; i++) total += (sizes[i] + 63) / 64 * 64;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && work > 1)
    {
        Scratch s = {0};
        char *memory = aligned_alloc(64, total);
        if (memory == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            char *at[6] = {memory};
            for (int i = 1; i < 6; i++) at[i] = at[i - 1] + (sizes[i - 1] + 63) / 64 * 64;
            s.acc = (float *)at[0], s.stats = (float *)at[1], s.scores = (float *)at[2];
            s.kv = (float *)at[3], s.qt = (float *)at[4], s.packed = (uint16_t *)at[5];
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < work; w++) {
            if (memory == NULL) continue;
            const Item *item = &items[w / kvh];
            const int64_t seg = item->segment, len = query_lens[seg];
            const Tile t = {
                .q = q, .q_stride = q_stride, .k_cache = k_cache, .v_cache = v_cache,
                .table = block_tables + seg * table_width,
                .row0 = starts[seg] + item->row0,
                .rows = len - item->row0 < TILE ? len - item->row0 : TILE,
                .first = context_lens[seg] + item->row0, .head = w % kvh, .group = group,
                .d = d, .kvh = kvh, .block_size = block_size, .scale = scale, .out = out,
                .out_stride = out_stride,
            };
            attend_tile(&t, bf16, &s);
        }
        free(memory);
    }
    free(items);
    return failed ? -2 : 0;
}
