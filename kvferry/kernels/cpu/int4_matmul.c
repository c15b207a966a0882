/* y = x · wᵀ with w in 4-bit groups (common/model/int4_linear.py: GGUF's Q4_1 numbers, kvferry's byte order) and x
 * in int8 rows (layer_ops.c's quantize_rows, one scale per row), each group's int32 sum scaled in the same pass.
 *
 * A weight row of k is k / 32 groups, each 32 four-bit values q in [0, 15] standing for q * scale + min, its
 * group's half-precision scale and minimum. So a group's part of a product is scale * Σ q·x + min * Σ x: the first
 * sum runs in int32 over unsigned q and signed x (vpdpbusd, vpmaddubsw take exactly that), the second needs only
 * each group's sum of x, computed once per call. The values are packed 64 at a time into 32 bytes, byte i holding value i in its low half and
 * value i + 32 in its high half: one 32-byte load, shifted and masked, gives the 64 values in order as bytes, two
 * groups side by side, for AVX-512 in one vector, for AVX2 in two.
 *
 * At a few rows this is bound by reading the weights, five bits a weight against int8's eight; at more rows by the
 * arithmetic: each group's sum must be converted to float and scaled on its own (a multiply-add per 16 of them with
 * AVX-512), where int8's one scale per row lets its sums run to the end in integers. Each block of weight rows is
 * unpacked once for up to MAX_ROWS x rows, and every group of x rows passes over a block while it is in the cache,
 * as in small_matmul.c.
 *
 * Each output is summed in the same order whatever the batch and the thread count, so a request's output does not
 * depend on its neighbours; the outlier channels and the bias are added by outlier_columns.h's loop.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "outlier_columns.h"
#include "row_shares.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define GROUP 32        /* weights per scale (int4_linear.py's GROUP) */
#define CHUNK 64        /* weights per 32 packed bytes */
#define MAX_ROWS 4      /* of x at once */
#define WEIGHT_ROWS 4   /* of w at once: MAX_ROWS x WEIGHT_ROWS accumulators in registers */
#define WEIGHT_BLOCK 32 /* weight rows that every group of x rows passes over in turn */
#define SHARE_ROWS 16   /* a thread's share of the rows starts at a multiple of this */
#define PARALLEL_WEIGHT_BYTES (256 * 1024)
_Static_assert(SHARE_ROWS % WEIGHT_ROWS == 0 && WEIGHT_BLOCK % WEIGHT_ROWS == 0, "blocks start at a block's start");

/* Value d (0 <= d < k) of a packed weight row: its four-bit q, 0 to 15. */
static inline int nibble(const uint8_t *row, int d) {
    uint8_t byte = row[d / CHUNK * (CHUNK / 2) + d % (CHUNK / 2)];
    return d % CHUNK < CHUNK / 2 ? byte & 15 : byte >> 4;
}

/* Each group's sum of x, as a float (exact: at most 32 * 127), [rows][k / 32]. */
static void group_sums(const int8_t *x, int rows, int k, float *out) {
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < k / GROUP; g++) {
            int32_t sum = 0;
            for (int d = g * GROUP; d < (g + 1) * GROUP; d++)
                sum += x[(int64_t)r * k + d];
            out[(int64_t)r * (k / GROUP) + g] = (float)sum;
        }
}

/* Σ_g min[g] * x_sums[g] over a row's groups: sixteen lanes at a time where AVX-512 is compiled, the rest in order. */
static inline float min_term(const uint16_t *mins, const float *x_sums, int groups) {
    float sum = 0.0f;
    int g = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; g + 16 <= groups; g += 16)
        acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + g))),
                              _mm512_loadu_ps(x_sums + g), acc);
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; g < groups; g++)
        sum = fmaf(half_to_float(mins[g]), x_sums[g], sum);
    return sum;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* The scales of groups g and g + 1 of a row: eight lanes of each, the lanes their sums come out in. */
static inline __m512 two_scales(const uint16_t *scales, int g) {
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    uint32_t bits;
    memcpy(&bits, scales + g, sizeof bits);
    __m128 pair = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bits));
    return _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(pair));
}
#endif

/* Weight rows [first, last) of the product for `rows` x rows (a constant where inlined): y[r][j] = row_scale[r] *
 * (the sum over groups of scale[j][g] * the group's int32 sum of q·x, then min_term). x_sums: group_sums'. */
static inline __attribute__((always_inline)) void i4_block(const int8_t *x, const float *x_sums, int rows, int k,
                                                           const uint8_t *w, const uint16_t *scales,
                                                           const uint16_t *mins, int n, const float *row_scale,
                                                           float *y, int first, int last) {
    const int64_t row_bytes = k / 2, row_groups = k / GROUP;
    int j = first;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const __m512i low = _mm512_set1_epi8(15);
    for (; k % CHUNK == 0 && j + WEIGHT_ROWS <= last; j += WEIGHT_ROWS) {
        __m512 acc[MAX_ROWS][WEIGHT_ROWS];
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < WEIGHT_ROWS; i++)
                acc[r][i] = _mm512_setzero_ps();
        const uint8_t *wj = w + j * row_bytes;
        const uint16_t *sj = scales + j * row_groups;
        for (int d = 0; d < k; d += CHUNK) {
            __m512i wv[WEIGHT_ROWS];
            __m512 sv[WEIGHT_ROWS];
            for (int i = 0; i < WEIGHT_ROWS; i++) {
                const uint8_t *packed = wj + i * row_bytes + d / 2;
                __m256i bytes = _mm256_loadu_si256((const __m256i *)packed);
                _mm_prefetch((const char *)(packed + 8 * row_bytes), _MM_HINT_T2);
                __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
                wv[i] = _mm512_and_si512(both, low);
                sv[i] = two_scales(sj + i * row_groups, d / GROUP);
            }
            for (int r = 0; r < rows; r++) {
                __m512i xv = _mm512_loadu_si512(x + (int64_t)r * k + d);
                for (int i = 0; i < WEIGHT_ROWS; i++) {
                    __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[i], xv);
                    acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), sv[i], acc[r][i]);
                }
            }
        }
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < WEIGHT_ROWS; i++) {
                float mt = min_term(mins + (j + i) * row_groups, x_sums + (int64_t)r * row_groups, row_groups);
                y[(int64_t)r * n + j + i] = (_mm512_reduce_add_ps(acc[r][i]) + mt) * row_scale[r];
            }
    }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    /* vpmaddubsw multiplies the unsigned q by the signed x: pairs of at most 2 * 15 * 127, never saturating;
     * vpmaddwd widens them to int32. Two weight rows at a time: 2 x 4 accumulators, the unpacked weights and x fill
     * AVX2's sixteen registers. */
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (; k % CHUNK == 0 && j + 2 <= last; j += 2) {
        __m256 acc[MAX_ROWS][2];
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < 2; i++)
                acc[r][i] = _mm256_setzero_ps();
        const uint8_t *wj = w + j * row_bytes;
        const uint16_t *sj = scales + j * row_groups;
        for (int d = 0; d < k; d += CHUNK) {
            __m256i wv[2][2];
            __m256 sv[2][2];
            for (int i = 0; i < 2; i++) {
                __m256i bytes = _mm256_loadu_si256((const __m256i *)(wj + i * row_bytes + d / 2));
                wv[i][0] = _mm256_and_si256(bytes, low);
                wv[i][1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
                for (int h = 0; h < 2; h++)
                    sv[i][h] = _mm256_set1_ps(half_to_float(sj[i * row_groups + d / GROUP + h]));
            }
            for (int r = 0; r < rows; r++)
                for (int h = 0; h < 2; h++) {
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(x + (int64_t)r * k + d + h * GROUP));
                    for (int i = 0; i < 2; i++) {
                        __m256i pairs = _mm256_maddubs_epi16(wv[i][h], xv);
                        __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                        acc[r][i] = _mm256_fmadd_ps(sums, sv[i][h], acc[r][i]);
                    }
                }
        }
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < 2; i++) {
                __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r][i]), _mm256_extractf128_ps(acc[r][i], 1));
                s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                s = _mm_add_ss(s, _mm_movehdup_ps(s));
                float mt = min_term(mins + (j + i) * row_groups, x_sums + (int64_t)r * row_groups, row_groups);
                y[(int64_t)r * n + j + i] = (_mm_cvtss_f32(s) + mt) * row_scale[r];
            }
    }
#endif
    /* The rows left over, or all of them without these instruction sets or where k is not in whole chunks. */
    for (; j < last; j++) {
        const uint8_t *row = w + j * row_bytes;
        for (int r = 0; r < rows; r++) {
            float sum = 0.0f;
            for (int g = 0; g < row_groups; g++) {
                int32_t group = 0;
                for (int d = g * GROUP; d < (g + 1) * GROUP; d++)
                    group += nibble(row, d) * x[(int64_t)r * k + d];
                sum = fmaf((float)group, half_to_float(scales[j * row_groups + g]), sum);
            }
            float mt = min_term(mins + j * row_groups, x_sums + (int64_t)r * row_groups, row_groups);
            y[(int64_t)r * n + j] = (sum + mt) * row_scale[r];
        }
    }
}

/* y [rows][n] = x [rows][k] (int8 in [-127, 127]) · w [n][k / 2] (packed, above) with scales and mins [n][k / 32]
 * (half precision bits), times row_scale [rows]; then the outlier channels x_out [rows][count] · wt [count][n] and the bias
 * [n] (NULL: none) added (outlier_columns.h, plain layout). k a multiple of 32. Returns 0, or -1 when there was no
 * memory for the scratch. */
int kvferry_matmul_i4(const int8_t *x, int rows, int k, const uint8_t *w, const uint16_t *scales,
                      const uint16_t *mins, int n, const float *row_scale, const float *x_out, const uint16_t *wt,
                      int count, const float *bias, float *y, int num_threads) {
    float *x_sums = malloc(sizeof(float) * ((size_t)rows * (k / GROUP) + 1));
    if (x_sums == NULL)
        return -1;
    group_sums(x, rows, k, x_sums);
    int64_t groups = (rows + MAX_ROWS - 1) / MAX_ROWS;
#pragma omp parallel num_threads(num_threads) if ((int64_t)n * k / 2 * groups >= PARALLEL_WEIGHT_BYTES)
    {
        int first, last;
        my_share(n, SHARE_ROWS, &first, &last);
        for (int block = first; block < last; block += WEIGHT_BLOCK) {
            int end = block + WEIGHT_BLOCK < last ? block + WEIGHT_BLOCK : last;
            for (int r = 0; r < rows; r += MAX_ROWS) {
                const int8_t *xr = x + (int64_t)r * k;
                const float *sr = x_sums + (int64_t)r * (k / GROUP);
                const float *scale = row_scale + r;
                float *yr = y + (int64_t)r * n;
                switch (rows - r < MAX_ROWS ? rows - r : MAX_ROWS) { /* each its own copy of the loop */
                case 1: i4_block(xr, sr, 1, k, w, scales, mins, n, scale, yr, block, end); break;
                case 2: i4_block(xr, sr, 2, k, w, scales, mins, n, scale, yr, block, end); break;
                case 3: i4_block(xr, sr, 3, k, w, scales, mins, n, scale, yr, block, end); break;
                default: i4_block(xr, sr, 4, k, w, scales, mins, n, scale, yr, block, end); break;
                }
            }
        }
        add_outlier_columns(y, rows, n, x_out, wt, count, 0, bias, first, last);
    }
    free(x_sums);
    return 0;
}
