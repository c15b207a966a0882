/* A decoder layer's elementwise work for the CPU, fp32, one call each where PyTorch takes several ops: at decode
 * batch sizes each op's dispatch costs more than its arithmetic.
 *
 * Built with -ffp-contract=off, so no multiply and add fuse into one rounding: the residual add and RoPE give
 * PyTorch's results bit for bit; the norm's sum of squares and SiLU's exponential round differently from
 * PyTorch's, by about an ulp. Rows are shared between threads only when there are enough of them to pay for it.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "outlier_columns.h"
#include "vectors.h"

/* Below these many elements, waking a second thread costs more than it saves (SiLU's exponential and division
 * make its elements dearer than a norm's or RoPE's). */
#define PARALLEL_ELEMENTS 65536
#define PARALLEL_SILU_ELEMENTS 8192

static inline float sum_of_squares(const float *x, int dim) {
    vfloat acc = {0};
    int d = 0;
    for (; d + LANES <= dim; d += LANES) {
        vfloat v = load(x + d);
        acc += v * v;
    }
    float sum = sum_lanes(acc);
    for (; d < dim; d++)
        sum += x[d] * x[d];
    return sum;
}

/* With residual: residual += x, then out = residual / rms(residual) * weight (a layer's skip connection and the
 * next norm, as vLLM fuses them). Without (residual NULL): out = x / rms(x) * weight. All rows contiguous. */
void kvferry_add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int rows, int dim,
                              float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * dim >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float *in = x + (int64_t)r * dim;
        float *o = out + (int64_t)r * dim;
        if (residual != NULL) {
            float *res = residual + (int64_t)r * dim;
            for (int d = 0; d < dim; d++)
                res[d] = in[d] + res[d];
            in = res;
        }
        float scale = 1.0f / sqrtf(sum_of_squares(in, dim) / (float)dim + eps);
        for (int d = 0; d < dim; d++)
            o[d] = weight[d] * (in[d] * scale);
    }
}

/* RoPE in place, as transformers' rotate_half: the first half of each head becomes x1 cos - x2 sin, the second
 * x2 cos + x1 sin. x: rows of heads * head_dim floats (from row_stride apart); cos, sin: [rows][head_dim]. */
void kvferry_rope_f32(float *x, int64_t row_stride, int rows, int heads, int head_dim, const float *cos,
                      const float *sin, int num_threads) {
    int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * heads * head_dim >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float *c = cos + (int64_t)r * head_dim, *s = sin + (int64_t)r * head_dim;
        for (int h = 0; h < heads; h++) {
            float *v = x + (int64_t)r * row_stride + (int64_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                float first = v[i], second = v[i + half];
                v[i] = first * c[i] - second * s[i];
                v[i + half] = second * c[i + half] + first * s[i + half];
            }
        }
    }
}

/* out = silu(gate) * up, silu(g) = g / (1 + e^-g); gate_up: rows of gate (width floats) then up (width floats). */
void kvferry_silu_mul_f32(const float *gate_up, float *out, int rows, int width, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * width >= PARALLEL_SILU_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float *gate = gate_up + (int64_t)r * 2 * width, *up = gate + width;
        float *o = out + (int64_t)r * width;
        int d = 0;
        for (; d + LANES <= width; d += LANES) {
            vfloat g = load(gate + d);
            store(o + d, g / (splat(1.0f) + exp_vector(-g)) * load(up + d));
        }
        for (; d < width; d++)
            o[d] = gate[d] / (1.0f + exp_one(-gate[d])) * up[d];
    }
}

/* The largest |x| of n floats, NaN skipped (a comparison with NaN is false): the order of a maximum does not
 * change it, so the lanes give the scalar loop's value exactly. */
static inline float max_abs(const float *x, int n, float top) {
    const vint magnitude = (vint){0} + 0x7fffffff;
    vfloat acc = splat(top);
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
        vfloat a = (vfloat)((vint)load(x + i) & magnitude);
        acc = pick(a > acc, a, acc);
    }
    for (int lane = 0; lane < LANES; lane++)
        top = acc[lane] > top ? acc[lane] : top;
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        top = a > top ? a : top;
    }
    return top;
}

/* round(x / scale) to the nearest integer, halves to even, clamped to [-127, 127]; NaN gives -127, as fmaxf then
 * fminf give it. Adding 1.5 * 2^23 and taking it off rounds anything under 2^22 in magnitude to an integer in the
 * default rounding mode (ties to even, as nearbyintf); anything larger is clamped whatever the sum made of it. */
static inline vfloat quantize_lanes(vfloat x, vfloat scale) {
    const vfloat round = splat(12582912.0f);
    vfloat q = (x / scale + round) - round;
    q = pick(q > splat(-127.0f), q, splat(-127.0f));
    return pick(q < splat(127.0f), q, splat(127.0f));
}

/* Int8 activations for an int8 GEMM (common/model/int8_linear.py), in one pass over each row: the outlier
 * channels (sorted indices, may be none) copied out to x_out [rows][num_outliers] and taken as zero, then the row
 * quantized with its own scale, max|x| / 127 (at least 1e-12 / 127), rounded half to even: the same values, bit
 * for bit, as PyTorch's index_fill, abs, amax, clamp, division, round and clamp. Vectorized: at decode batch sizes
 * it runs before each of a layer's four products, and one element at a time it took a fifth of an int8 step. */
void kvferry_quantize_rows_f32(const float *x, int rows, int dim, const int64_t *outliers, int num_outliers,
                               int8_t *xq, float *row_scale, float *x_out, int num_threads) {
    typedef int8_t vbyte __attribute__((vector_size(LANES)));
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * dim >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float *in = x + (int64_t)r * dim;
        int8_t *q = xq + (int64_t)r * dim;
        float top = 0.0f;
        int start = 0; /* the runs between outlier channels */
        for (int o = 0; o < num_outliers; o++) {
            top = max_abs(in + start, (int)outliers[o] - start, top);
            start = (int)outliers[o] + 1;
        }
        top = max_abs(in + start, dim - start, top);
        float scale = (top > 1e-12f ? top : 1e-12f) / 127.0f;
        /* Within [-127, 127] already for finite values (|x| / scale <= 127); clamped so that no value, NaN and
         * infinities included, becomes -128, which small_matmul.c's AVX2 product cannot take. */
        int i = 0;
        for (; i + LANES <= dim; i += LANES) {
            vbyte b = __builtin_convertvector(__builtin_convertvector(quantize_lanes(load(in + i), splat(scale)), vint),
                                              vbyte);
            memcpy(q + i, &b, sizeof b);
        }
        for (; i < dim; i++)
            q[i] = (int8_t)quantize_lanes(splat(in[i]), splat(scale))[0];
        for (int o = 0; o < num_outliers; o++) {
            x_out[(int64_t)r * num_outliers + o] = in[outliers[o]];
            q[outliers[o]] = 0;
        }
        row_scale[r] = scale;
    }
}

/* y = acc * row_scale[r] * col_scale[c], in that order, as PyTorch's float(), mul_ and mul_ compute it. */
void kvferry_dequantize_f32(const int32_t *acc, const float *row_scale, const float *col_scale, float *y, int rows,
                            int cols, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * cols >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            y[(int64_t)r * cols + c] = (float)acc[(int64_t)r * cols + c] * row_scale[r] * col_scale[c];
}

/* The float part of an int8 layer after torch._int_mm and dequantize: outlier_columns.h's loop, the columns shared
 * between the threads in runs of 16. */
void kvferry_add_outlier_columns_f32(float *y, int rows, int n, const float *x_out, const uint16_t *wt, int count,
                                     const float *bias, int num_threads) {
#pragma omp parallel num_threads(num_threads) if ((int64_t)rows * n * (count + 1) >= PARALLEL_ELEMENTS)
    {
        int threads = omp_get_num_threads(), me = omp_get_thread_num(), runs = (n + 15) / 16;
        int first = (int)((int64_t)runs * me / threads) * 16, last = (int)((int64_t)runs * (me + 1) / threads) * 16;
        add_outlier_columns(y, rows, n, x_out, wt, count, 0, bias, first, last < n ? last : n);
    }
}
