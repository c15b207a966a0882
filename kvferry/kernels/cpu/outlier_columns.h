/* An int8 linear layer's float part (common/model/int8_linear.py): the outlier input channels' product, then the
 * bias, added to the int8 product's scaled output. Both the few-rows product (small_matmul.c) and the pass after
 * torch._int_mm (layer_ops.c) include this one loop, so each output gets the same roundings in the same order
 * whatever the row count: a request's tokens do not depend on its batch.
 */
#ifndef KVFERRY_OUTLIER_COLUMNS_H
#define KVFERRY_OUTLIER_COLUMNS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* An IEEE half-precision value's bits -> the same value as a float (every half is a float exactly). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) /* infinity, NaN */
        bits = sign | 0x7f800000 | (mantissa << 13);
    else if (exponent != 0)
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else if (mantissa == 0)
        bits = sign;
    else { /* subnormal: shift the leading one up to the implicit bit */
        uint32_t shifts = 0;
        while (!(mantissa & 0x400))
            mantissa <<= 1, shifts++;
        bits = sign | ((113 - shifts) << 23) | ((mantissa & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define OUTLIER_ROWS 8 /* rows summed at once: each weight vector loaded serves eight of them */
#define OUTLIER_TILE 16 /* columns of a tile in the tiled layout (outlier_at) */

/* Where channel o's weight for column j lies. Plain: [count][n], a row per channel. Tiled (small_matmul.py's
 * tile_outliers, made with the interleaved int8 weights): [ceil(n / 16)][count][16], each 16 columns' weights for
 * every channel one run of memory, the last tile padded. Plain, a block of columns reads count rows n apart: more
 * streams than the prefetcher follows, and the loop waited on memory for about as long as the int8 product took
 * for its own weights (docs/benchmarks.md). */
static inline const uint16_t *outlier_at(const uint16_t *wt, int o, int j, int n, int count, int tiled) {
    if (!tiled)
        return wt + (int64_t)o * n + j;
    return wt + ((int64_t)(j / OUTLIER_TILE) * count + o) * OUTLIER_TILE + j % OUTLIER_TILE;
}

/* The vector operations the loop below needs, on whichever vectors the machine has: sixteen lanes with AVX-512,
 * eight with AVX2 (vcvtph2ps widens a half exactly, vfmadd rounds once as fmaf does). */
#if defined(__AVX512F__)
#define OUTLIER_LANES 16
typedef __m512 outlier_vec;
static inline outlier_vec outlier_widen(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline outlier_vec outlier_zero(void) { return _mm512_setzero_ps(); }
static inline outlier_vec outlier_fma(float a, outlier_vec w, outlier_vec sum) {
    return _mm512_fmadd_ps(_mm512_set1_ps(a), w, sum);
}
static inline void outlier_add_to(float *y, outlier_vec sum) {
    _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), sum));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define OUTLIER_LANES 8
typedef __m256 outlier_vec;
static inline outlier_vec outlier_widen(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline outlier_vec outlier_zero(void) { return _mm256_setzero_ps(); }
static inline outlier_vec outlier_fma(float a, outlier_vec w, outlier_vec sum) {
    return _mm256_fmadd_ps(_mm256_set1_ps(a), w, sum);
}
static inline void outlier_add_to(float *y, outlier_vec sum) {
    _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), sum));
}
#endif

#if defined(OUTLIER_LANES)
/* Rows [r, r + take) of columns [j, j + OUTLIER_LANES), within one tile where tiled; take at most OUTLIER_ROWS and a
 * constant where it is called, so that the sums stay in registers. */
static inline __attribute__((always_inline)) void outlier_block(float *y, int r, int take, int n, const float *x_out,
                                                                const uint16_t *wt, int count, int tiled, int j) {
    outlier_vec sum[OUTLIER_ROWS];
    for (int i = 0; i < take; i++)
        sum[i] = outlier_zero();
    const uint16_t *w0 = outlier_at(wt, 0, j, n, count, tiled);
    const int64_t channel_step = tiled ? OUTLIER_TILE : n;
    for (int o = 0; o < count; o++) {
        outlier_vec w = outlier_widen(w0 + o * channel_step);
        for (int i = 0; i < take; i++)
            sum[i] = outlier_fma(x_out[(int64_t)(r + i) * count + o], w, sum[i]);
    }
    for (int i = 0; i < take; i++)
        outlier_add_to(y + (int64_t)(r + i) * n + j, sum[i]);
}
#endif

/* y [rows][n], columns [first, last): y += x_out [rows][count] · wt [count][n], then += bias [n] (NULL: none);
 * wt in half precision (its bits), plain or tiled (outlier_at; then first is a multiple of OUTLIER_TILE), each weight
 * widened exactly before it is used.
 * Each output's sum starts at zero and takes the channels in order with a fused multiply-add each (fmaf, or the same
 * operation OUTLIER_LANES lanes at a time), then is added to y: the same roundings on every path. */
static inline void add_outlier_columns(float *y, int rows, int n, const float *x_out, const uint16_t *wt, int count,
                                       int tiled, const float *bias, int first, int last) {
    int j = first;
#if defined(OUTLIER_LANES)
    for (; count > 0 && j + OUTLIER_LANES <= last; j += OUTLIER_LANES) {
        int r = 0;
        for (; r + OUTLIER_ROWS <= rows; r += OUTLIER_ROWS)
            outlier_block(y, r, OUTLIER_ROWS, n, x_out, wt, count, tiled, j);
        for (; r < rows; r++)
            outlier_block(y, r, 1, n, x_out, wt, count, tiled, j);
    }
#endif
    for (; count > 0 && j < last; j++)
        for (int r = 0; r < rows; r++) {
            float sum = 0.0f;
            for (int o = 0; o < count; o++)
                sum = fmaf(x_out[(int64_t)r * count + o], half_to_float(*outlier_at(wt, o, j, n, count, tiled)), sum);
            y[(int64_t)r * n + j] += sum;
        }
    if (bias != NULL)
        for (int r = 0; r < rows; r++)
            for (j = first; j < last; j++)
                y[(int64_t)r * n + j] += bias[j];
}

#endif
