/* The plain rows' draw (common/model/sampler.py): softmax(logits / T) by inverse CDF, two levels, without the
 * [rows, vocab] temporaries of PyTorch's softmax, block sums and searches. Per row: one pass for the maximum, one
 * for the weights' sums per block of `block` tokens, then one block's weights again for the token inside it.
 *
 * Weights are e^(x / T - max / T), unnormalized, in float32 (x times 1 / T, exp_in_range's exponential, fused
 * multiply-adds where the machine has them), summed in float64: they differ from PyTorch's softmax in the last bits,
 * so a token differs from the PyTorch path's only where u lands within rounding of a boundary of the cumulative
 * distribution.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "vectors.h"

/* Half a vector's floats, and as many doubles: one register each (GCC keeps a wider generic vector in memory). */
typedef float vhalf __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef double vdouble __attribute__((vector_size(LANES / 2 * sizeof(double))));

/* Below e^-87 a float's exponent runs out (exp_vector would clamp there, and give -inf's token a weight): such tokens
 * weigh nothing. */
#define LOWEST -87.0f

/* From here on (|max / T| of 2^30), x / T - top no longer makes the likeliest token's 0: the fused multiply-add leaves
 * it top's rounding, up to half a float's spacing there (64, then more), which took its weight past exp_in_range's
 * range or to nothing, and with it the row's mass (token 0, perhaps a masked one). Such a row weighs e^((x - max) / T),
 * 0 at the maximum. Below, that shift is at most 32 and the same for every token: its weights are left as they were. */
#define WIDE 1073741824.0f

/* The row's largest logit, NaN skipped (a comparison with NaN is false; the NaN shows in the sums instead): -inf when
 * every token is -inf. Four accumulators: one's compare and blend would make each step wait for the last. */
static inline float row_max(const float *x, int n) {
    vfloat acc[4] = {splat(-INFINITY), splat(-INFINITY), splat(-INFINITY), splat(-INFINITY)};
    int i = 0;
    for (; i + 4 * LANES <= n; i += 4 * LANES)
        for (int k = 0; k < 4; k++) {
            vfloat v = load(x + i + k * LANES);
            acc[k] = pick(v > acc[k], v, acc[k]);
        }
    float m = -INFINITY;
    for (int lane = 0; lane < LANES; lane++)
        for (int k = 0; k < 4; k++)
            m = acc[k][lane] > m ? acc[k][lane] : m;
    for (; i < n; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}

/* e^(x / T - top), top the largest x / T (wide: e^((x - max) / T), see WIDE): at most 0 (within rounding), so no
 * upper clamp; below LOWEST (-inf among them), whatever exp_in_range made of it, zero. A NaN stays NaN, and so makes
 * its row's sums. */
static inline vfloat weight_lanes(vfloat x, vfloat inverse_t, vfloat top, vfloat max, int wide) {
    vfloat d = wide ? (x - max) * inverse_t : x * inverse_t - top;
    return pick(d < splat(LOWEST), splat(0.0f), exp_in_range(d));
}

static inline void add_double(vdouble *sum, vfloat v) {
    vhalf halves[2];
    memcpy(halves, &v, sizeof v);
    *sum += __builtin_convertvector(halves[0], vdouble) + __builtin_convertvector(halves[1], vdouble);
}

/* n <= block weights into w; returns their sum. Four vectors are added in float32 before the sum in float64:
 * converting each one to double cost about as much as its exponentials. Inlined with wide a constant (block_weights):
 * the loop has no branch. */
static inline __attribute__((always_inline)) double weights_of(const float *x, int n, float inverse_t, float top,
                                                               float max, int wide, float *w) {
    vdouble acc = {0};
    int i = 0;
    for (; i + 4 * LANES <= n; i += 4 * LANES) {
        vfloat v[4];
        for (int k = 0; k < 4; k++) {
            v[k] = weight_lanes(load(x + i + k * LANES), splat(inverse_t), splat(top), splat(max), wide);
            store(w + i + k * LANES, v[k]);
        }
        add_double(&acc, (v[0] + v[1]) + (v[2] + v[3]));
    }
    double sum = 0.0;
    for (int lane = 0; lane < LANES / 2; lane++)
        sum += acc[lane];
    for (; i < n; i++) {
        w[i] = weight_lanes(splat(x[i]), splat(inverse_t), splat(top), splat(max), wide)[0];
        sum += w[i];
    }
    return sum;
}

static inline double block_weights(const float *x, int n, float inverse_t, float top, float max, int wide,
                                   float *w) {
    return wide ? weights_of(x, n, inverse_t, top, max, 1, w) : weights_of(x, n, inverse_t, top, max, 0, w);
}

/* cum non-decreasing, n of them: the first index whose value exceeds target; where none does (the target rounded
 * up to the total), the first reaching the total. As sampler._pick: never an index that adds no mass. */
static inline int pick_index(const double *cum, int n, double target) {
    for (int i = 0; i < n; i++)
        if (cum[i] > target)
            return i;
    for (int i = 0; i < n; i++)
        if (cum[i] >= cum[n - 1])
            return i;
    return n - 1;
}

static int64_t draw_row(const float *x, int vocab, int block, float t, double u) {
    float max = row_max(x, vocab);
    /* +inf, every token -inf (a constraint's dead end) or an overflowing x / T, and below a NaN: no mass, token 0,
     * as the PyTorch path's NaN probabilities, zeroed, give. */
    if (!isfinite(max / t))
        return 0;
    float inverse_t = 1.0f / t;
    float top = max * inverse_t;
    int wide = !(fabsf(top) < WIDE);
    int num_blocks = (vocab + block - 1) / block;
    double sums[num_blocks], cum[num_blocks], inner[block];
    float w[block];
    double running = 0.0;
    for (int b = 0; b < num_blocks; b++) {
        int n = vocab - b * block < block ? vocab - b * block : block;
        sums[b] = block_weights(x + (int64_t)b * block, n, inverse_t, top, max, wide, w);
        running += sums[b];
        cum[b] = running;
    }
    if (isnan(running))
        return 0;
    double target = u * running;
    int b = pick_index(cum, num_blocks, target);
    /* What falls inside the block; at least 0, as the block's own sums round differently from cum's. */
    double rest = target - (cum[b] - sums[b]);
    rest = rest > 0.0 ? rest : 0.0;
    int n = vocab - b * block < block ? vocab - b * block : block;
    block_weights(x + (int64_t)b * block, n, inverse_t, top, max, wide, w);
    running = 0.0;
    for (int i = 0; i < n; i++) {
        running += w[i];
        inner[i] = running;
    }
    return (int64_t)b * block + pick_index(inner, n, rest);
}

/* tokens[r] for each of num_rows rows: the row rows[r] of logits (r itself when rows is NULL), each row_stride
 * floats from the last, with temperature temperatures[r] and uniform uniforms[r] in [0, 1). */
void kvferry_draw_rows_f32(const float *logits, int64_t row_stride, const int64_t *rows, int num_rows, int vocab,
                           int block, const float *temperatures, const double *uniforms, int64_t *tokens,
                           int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_rows > 1)
    for (int r = 0; r < num_rows; r++) {
        const float *x = logits + (rows != NULL ? rows[r] : r) * row_stride;
        tokens[r] = draw_row(x, vocab, block, temperatures[r], uniforms[r]);
    }
}
