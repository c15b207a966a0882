/* y = x · wᵀ in int8, with w in nn.Linear's own layout ([n][k], row-major) or, on AVX2 CPUs without VNNI, in
 * groups of four rows interleaved (weight_at), each sum scaled back to fp32 in the same pass: for a few rows of x
 * everywhere, and for every row count where torch._int_mm has no fast path.
 *
 * At one to a few rows a linear layer is a matrix-vector product: each weight is read once per step and used once
 * per row, so the step is bound by how fast the weights stream from memory. Each weight row is read straight
 * through, four rows at a time (two with AVX2 at three or four x rows), with every x row's product taken from the
 * same load (VNNI's vpdpbusd, 64 bytes an instruction; AVX2's vpmaddubsw, 32); the weight's rows are split between
 * the threads, and x stays in the first-level cache. Against torch._int_mm and a separate scaling pass, this saves
 * the pass and reads the weights faster (docs/benchmarks.md). At more rows the same block runs over each group of
 * four x rows in turn while a block of weight rows stays in the cache.
 *
 * The sums are int32 and exact, so they equal torch._int_mm's bit for bit; the outlier channels and the bias are
 * added by the same loop as after torch._int_mm (outlier_columns.h), so the whole output is the same bit for bit.
 */
#include <omp.h>
#include <stdint.h>

#include "outlier_columns.h"
#include "row_shares.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_ROWS 4      /* of x at once: a call with more takes them in groups of this many */
#define WEIGHT_ROWS 4   /* of w at once with VNNI: four streams from memory, MAX_ROWS x 4 accumulators in registers */
#define PREFETCH_ROWS 8 /* rows are short, so the prefetcher is told a few groups ahead (measured best) */
#ifndef AVX2_PREFETCH_BYTES
#define AVX2_PREFETCH_BYTES 2048 /* interleaved weights: this far ahead in their one run */
#endif
#define WEIGHT_BLOCK 32 /* weight rows (a multiple of WEIGHT_ROWS) that every group of x rows passes over in turn */
#define PARALLEL_WEIGHT_BYTES (256 * 1024) /* below this, the second thread's wake-up costs more than it saves */
#define GROUP_ROWS 4 /* interleaved weights: groups of four rows (small_matmul.py's GROUP_ROWS, PIECE) */
#define PIECE 32     /* bytes of each row side by side */
#define SHARE_ROWS 16 /* a thread's share of the rows starts at a multiple of this */
/* The AVX2 loop reads a group's rows from its first, and the outlier loop a tile's columns from its first: every block
 * and thread share must start at a group's start, and every share at a tile's */
_Static_assert(WEIGHT_ROWS % GROUP_ROWS == 0 && WEIGHT_BLOCK % WEIGHT_ROWS == 0 && SHARE_ROWS % WEIGHT_ROWS == 0 &&
                   SHARE_ROWS % OUTLIER_TILE == 0,
               "blocks start at a group's start, shares at a tile's");

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
#elif defined(__AVX2__)
/* The sum of a vector's eight lanes. */
static inline int32_t sum_eight(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
#endif

/* Where weight row `row`'s byte d lies. Plain: nn.Linear's [n][k]. Interleaved (small_matmul.py's interleave):
 * each group of four rows is one run of 4k bytes, its rows' 32-byte pieces side by side, [n/4][k/32][4][32], so a
 * group's four rows stream from memory as one sequence, which the hardware prefetcher follows at full speed; four
 * rows 576 bytes apart it did not (docs/benchmarks.md). */
static inline const int8_t *weight_at(const int8_t *w, int row, int d, int k, int interleaved) {
    if (!interleaved)
        return w + (int64_t)row * k + d;
    return w + (int64_t)(row / GROUP_ROWS) * GROUP_ROWS * k + (int64_t)(d / PIECE) * GROUP_ROWS * PIECE +
           (row % GROUP_ROWS) * PIECE + d % PIECE;
}

/* The int8 product's weight rows [first, last), each sum then scaled as the PyTorch path does it:
 * float(sum) * row_scale[r] * col_scale[j], in that order. rows and interleaved are constants where it is inlined. */
static inline __attribute__((always_inline)) void i8_block(const int8_t *x, int rows, int k, const int8_t *w,
                                                           int interleaved, const int32_t *w_sums, int n,
                                                           const float *row_scale, const float *col_scale, float *y,
                                                           int first, int last) {
    int j = first;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    /* vpdpbusd multiplies unsigned bytes by signed ones, 64 at a time: x is taken as x + 128 (its sign bit
     * flipped), and 128 times the weight row's sum (w_sums, computed once) is taken off. Rows of k bytes,
     * k a multiple of 64 (hidden sizes are); other widths take the loop below, as do interleaved weights (made
     * only where this loop is not compiled). */
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (; !interleaved && k % 64 == 0 && j + WEIGHT_ROWS <= last; j += WEIGHT_ROWS) {
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
#elif defined(__AVX2__)
    /* vpmaddubsw multiplies unsigned bytes by signed ones and adds pairs into int16, saturating: |x| times w with
     * x's sign moved onto it (vpsignb), so a pair is at most 2 * 127 * 127 and never saturates, as x and w are both
     * in [-127, 127] (int8_linear.py's weights and layer_ops.c's activations are clamped there); vpmaddwd then
     * widens the pairs' sums into int32, exactly. |x| is taken once per x vector, for all the weight rows. Four
     * weight rows at a time at one or two x rows, two at more: MAX_ROWS x 2 accumulators, the weights and x fill
     * AVX2's sixteen registers. */
    const __m256i ones = _mm256_set1_epi16(1);
    const int weight_rows = rows <= 2 ? 4 : 2;
    /* Interleaved, j is a group's first row or its third (two rows at a time), so rows j.. stay in one group */
    const int64_t row_step = interleaved ? PIECE : k, column_step = interleaved ? GROUP_ROWS : 1;
    /* Where the rows read a few groups on will lie: a run of memory ahead in the interleaved layout, the same
     * columns of later rows in the plain one (both measured best) */
    const int64_t ahead = interleaved ? AVX2_PREFETCH_BYTES : (int64_t)PREFETCH_ROWS * k;
    for (; k % 32 == 0 && j + weight_rows <= last; j += weight_rows) {
        __m256i acc[MAX_ROWS][4];
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < weight_rows; i++)
                acc[r][i] = _mm256_setzero_si256();
        const int8_t *wj = weight_at(w, j, 0, k, interleaved);
        for (int d = 0; d < k; d += 32) {
            __m256i wv[4];
            for (int i = 0; i < weight_rows; i++) {
                const int8_t *piece = wj + i * row_step + d * column_step;
                wv[i] = _mm256_loadu_si256((const __m256i *)piece);
                if (interleaved ? i % 2 == 0 : d % 64 == 0) /* once per 64-byte line */
                    _mm_prefetch((const char *)(piece + ahead), _MM_HINT_T2);
            }
            for (int r = 0; r < rows; r++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(x + (int64_t)r * k + d));
                __m256i x_abs = _mm256_abs_epi8(xv);
                for (int i = 0; i < weight_rows; i++) {
                    __m256i pairs = _mm256_maddubs_epi16(x_abs, _mm256_sign_epi8(wv[i], xv));
                    acc[r][i] = _mm256_add_epi32(acc[r][i], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < weight_rows; i++)
                y[(int64_t)r * n + j + i] = (float)sum_eight(acc[r][i]) * row_scale[r] * col_scale[j + i];
    }
#endif
    /* The rows left over, or all of them without VNNI or AVX2 or at other widths: the compiler's own vectors, the same
     * sums, several times slower. */
    for (; j < last; j++) {
        for (int r = 0; r < rows; r++) {
            int32_t sum = 0;
            for (int d = 0; d < k; d++)
                sum += (int32_t)x[(int64_t)r * k + d] * *weight_at(w, j, d, k, interleaved);
            y[(int64_t)r * n + j] = (float)sum * row_scale[r] * col_scale[j];
        }
    }
}

/* Whether this file's loop should take every row count here, not just a few: PyTorch's torch._int_mm takes
 * oneDNN's int8 GEMM only with AVX-512 VNNI and otherwise a scalar loop, 30 times slower than an fp32 GEMM at 512
 * rows, where the AVX2 loop above is as fast as fp32 (docs/benchmarks.md). Without either, nothing was measured,
 * and torch._int_mm stays. */
int kvferry_takes_every_row_count(void) {
#if !defined(__AVX512VNNI__) && defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* y [rows][n] = (x [rows][k] · w [n][k]ᵀ, summed in int32) * row_scale[r] * col_scale[j]; x and w in [-127, 127];
 * w plain, or interleaved (n a multiple of 4 and k of 32; weight_at) where this file's AVX2 loop is compiled;
 * w_sums [n]: each weight row's sum. Then the outlier channels x_out [rows][count] · wt [count][n] and the bias [n]
 * (NULL: none) are added (outlier_columns.h); with interleaved weights, wt comes tiled (outlier_at). Each thread
 * takes a run of the weight's rows, WEIGHT_BLOCK at a time, and every group of MAX_ROWS x rows passes over a block
 * while it is in the cache. */
void kvferry_matmul_i8(const int8_t *x, int rows, int k, const int8_t *w, int interleaved, const int32_t *w_sums,
                       int n, const float *row_scale, const float *col_scale, const float *x_out, const uint16_t *wt,
                       int count, const float *bias, float *y, int num_threads) {
    int64_t groups = (rows + MAX_ROWS - 1) / MAX_ROWS;
#pragma omp parallel num_threads(num_threads) if ((int64_t)n * k * groups >= PARALLEL_WEIGHT_BYTES)
    {
        int first, last;
        my_share(n, SHARE_ROWS, &first, &last);
        for (int block = first; block < last; block += WEIGHT_BLOCK) {
            int end = block + WEIGHT_BLOCK < last ? block + WEIGHT_BLOCK : last;
            for (int r = 0; r < rows; r += MAX_ROWS) {
                const int8_t *xr = x + (int64_t)r * k;
                const float *scale = row_scale + r;
                float *yr = y + (int64_t)r * n;
                int case_ = (rows - r < MAX_ROWS ? rows - r : MAX_ROWS) * 2 + (interleaved != 0);
                switch (case_) { /* each its own copy of the loop, with rows and the layout constants */
                case 2: i8_block(xr, 1, k, w, 0, w_sums, n, scale, col_scale, yr, block, end); break;
                case 3: i8_block(xr, 1, k, w, 1, w_sums, n, scale, col_scale, yr, block, end); break;
                case 4: i8_block(xr, 2, k, w, 0, w_sums, n, scale, col_scale, yr, block, end); break;
                case 5: i8_block(xr, 2, k, w, 1, w_sums, n, scale, col_scale, yr, block, end); break;
                case 6: i8_block(xr, 3, k, w, 0, w_sums, n, scale, col_scale, yr, block, end); break;
                case 7: i8_block(xr, 3, k, w, 1, w_sums, n, scale, col_scale, yr, block, end); break;
                case 8: i8_block(xr, 4, k, w, 0, w_sums, n, scale, col_scale, yr, block, end); break;
                default: i8_block(xr, 4, k, w, 1, w_sums, n, scale, col_scale, yr, block, end); break;
                }
            }
        }
        add_outlier_columns(y, rows, n, x_out, wt, count, interleaved, bias, first, last);
    }
}
