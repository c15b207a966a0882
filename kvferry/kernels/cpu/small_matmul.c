/* y = x · wᵀ in int8 for a few rows of x, with w in nn.Linear's own layout ([n][k], row-major), each sum scaled
 * back to fp32 in the same pass.
 *
 * At one to a few rows a linear layer is a matrix-vector product: each weight is read once per step and used once
 * per row, so the step is bound by how fast the weights stream from memory. Each weight row is read straight
 * through, four rows at a time, with every x row's product taken from the same load (VNNI's vpdpbusd, 64 bytes an
 * instruction); the weight's rows are split between the threads, and x stays in the first-level cache. Against
 * torch._int_mm and a separate scaling pass, this saves the pass and reads the weights faster (docs/benchmarks.md).
 *
 * The sums are int32 and exact, so they equal torch._int_mm's bit for bit; the outlier channels and the bias are
 * added by the same loop as after torch._int_mm (outlier_columns.h), so the whole output is the same bit for bit.
 */
#include <omp.h>
#include <stdint.h>

#include "outlier_columns.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_ROWS 4      /* of x, at most */
#define WEIGHT_ROWS 4   /* of w at once: four streams from memory, and MAX_ROWS x 4 accumulators in registers */
#define PREFETCH_ROWS 8 /* rows are short, so the prefetcher is told two groups ahead (measured best) */
#define PARALLEL_WEIGHT_BYTES (256 * 1024) /* below this, the second thread's wake-up costs more than it saves */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* The sums of four vectors' lanes, as one vector of four: pairs interleaved and added, twice, then the four
 * 128-bit quarters added, instead of four separate reductions. */
static inline __m128i sum_four(__m512i a, __m512i b, __m512i c, __m512i d) {
    __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}
#endif

/* The int8 product's weight rows [first, last), each sum then scaled as the PyTorch path does it:
 * float(sum) * row_scale[r] * col_scale[j], in that order. */
static inline __attribute__((always_inline)) void i8_block(const int8_t *x, int rows, int k, const int8_t *w,
                                                           const int32_t *w_sums, int n, const float *row_scale,
                                                           const float *col_scale, float *y, int first, int last) {
    int j = first;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    /* vpdpbusd multiplies unsigned bytes by signed ones, 64 at a time: x is taken as x + 128 (its sign bit
     * flipped), and 128 times the weight row's sum (w_sums, computed once) is taken off. Rows of k bytes,
     * k a multiple of 64 (hidden sizes are); other widths take the loop below. */
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (; k % 64 == 0 && j + WEIGHT_ROWS <= last; j += WEIGHT_ROWS) {
        __m512i acc[MAX_ROWS][WEIGHT_ROWS];
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < WEIGHT_ROWS; i++)
                acc[r][i] = _mm512_setzero_si512();
        const int8_t *wj = w + (int64_t)j * k;
        for (int d = 0; d < k; d += 64) {
            __m512i wv[WEIGHT_ROWS];
            for (int i = 0; i < WEIGHT_ROWS; i++) {
                wv[i] = _mm512_loadu_si512(wj + (int64_t)i * k + d);
                /* Into the second-level cache: prefetched into the first, the lines held the miss buffers that the
                 * loads need, and a step's products took longer (docs/benchmarks.md). Past the last row this hints at
                 * memory that is not read: a prefetch never faults. */
                _mm_prefetch((const char *)(wj + (int64_t)(i + PREFETCH_ROWS) * k + d), _MM_HINT_T2);
            }
            for (int r = 0; r < rows; r++) {
                __m512i xv = _mm512_xor_si512(_mm512_loadu_si512(x + (int64_t)r * k + d), flip);
                for (int i = 0; i < WEIGHT_ROWS; i++)
                    acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], xv, wv[i]);
            }
        }
        for (int r = 0; r < rows; r++) {
            int32_t sums[WEIGHT_ROWS];
            _mm_storeu_si128((__m128i *)sums, sum_four(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
            for (int i = 0; i < WEIGHT_ROWS; i++)
                y[(int64_t)r * n + j + i] =
                    (float)(sums[i] - 128 * w_sums[j + i]) * row_scale[r] * col_scale[j + i];
        }
    }
#endif
    /* The rows left over, or all of them without VNNI or at other widths: the compiler's own vectors, the same
     * sums, several times slower. */
    for (; j < last; j++) {
        const int8_t *wj = w + (int64_t)j * k;
        for (int r = 0; r < rows; r++) {
            int32_t sum = 0;
            for (int d = 0; d < k; d++)
                sum += (int32_t)x[(int64_t)r * k + d] * wj[d];
            y[(int64_t)r * n + j] = (float)sum * row_scale[r] * col_scale[j];
        }
    }
}

/* This thread's share of a weight's n rows: one contiguous run, a multiple of WEIGHT_ROWS except at the end. */
static inline void my_share(int n, int *first, int *last) {
    int threads = omp_get_num_threads(), me = omp_get_thread_num();
    int groups = (n + WEIGHT_ROWS - 1) / WEIGHT_ROWS;
    *first = (int)((int64_t)groups * me / threads) * WEIGHT_ROWS;
    *last = (int)((int64_t)groups * (me + 1) / threads) * WEIGHT_ROWS;
    *last = *last < n ? *last : n;
}

/* y [rows][n] = (x [rows][k] · w [n][k]ᵀ, summed in int32) * row_scale[r] * col_scale[j], 1 <= rows <= MAX_ROWS;
 * w_sums [n]: each weight row's sum. Then the outlier channels x_out [rows][count] · wt [count][n] and the bias [n]
 * (NULL: none) are added (outlier_columns.h). */
void kvferry_small_matmul_i8(const int8_t *x, int rows, int k, const int8_t *w, const int32_t *w_sums, int n,
                             const float *row_scale, const float *col_scale, const float *x_out, const uint16_t *wt,
                             int count, const float *bias, float *y, int num_threads) {
#pragma omp parallel num_threads(num_threads) if ((int64_t)n * k >= PARALLEL_WEIGHT_BYTES)
    {
        int first, last;
        my_share(n, &first, &last);
        switch (rows) {
        case 1: i8_block(x, 1, k, w, w_sums, n, row_scale, col_scale, y, first, last); break;
        case 2: i8_block(x, 2, k, w, w_sums, n, row_scale, col_scale, y, first, last); break;
        case 3: i8_block(x, 3, k, w, w_sums, n, row_scale, col_scale, y, first, last); break;
        default: i8_block(x, 4, k, w, w_sums, n, row_scale, col_scale, y, first, last); break;
        }
        add_outlier_columns(y, rows, n, x_out, wt, count, bias, first, last);
    }
}
