/* A row's weights for the CPU draws (draw_rows.c, draw_filtered.c; common/model/sampler.py): e^(x / T - max / T)
 * in float32 by exp_in_range, summed in float64, and the inverse CDF's search of cumulative sums. */
#ifndef KVFERRY_ROW_WEIGHTS_H
#define KVFERRY_ROW_WEIGHTS_H

#include <math.h>
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

/* The sum of n stored weights, in float64 as weights_of sums them. */
static inline double sum_of(const float *w, int n) {
    vdouble acc = {0};
    int i = 0;
    for (; i + 4 * LANES <= n; i += 4 * LANES)
        add_double(&acc, (load(w + i) + load(w + i + LANES)) + (load(w + i + 2 * LANES) + load(w + i + 3 * LANES)));
    double sum = 0.0;
    for (int lane = 0; lane < LANES / 2; lane++)
        sum += acc[lane];
    for (; i < n; i++)
        sum += w[i];
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

/* How a row's logits become weights (weight_lanes): 1 / T, the largest x / T, the largest x, and whether the row is
 * wide (see WIDE). */
typedef struct {
    float inverse_t, top, max;
    int wide;
} row_scale;

/* The row's scale; 0 where the row has no mass: a largest logit of +inf, every token -inf (a constraint's dead end),
 * or an overflowing x / T. A NaN logit shows later, in the sums. The PyTorch path's NaN probabilities, zeroed, draw
 * token 0 there, and so do the kernels. */
static inline int scale_of(const float *x, int vocab, float t, row_scale *s) {
    s->max = row_max(x, vocab);
    if (!isfinite(s->max / t))
        return 0;
    s->inverse_t = 1.0f / t;
    s->top = s->max * s->inverse_t;
    s->wide = !(fabsf(s->top) < WIDE);
    return 1;
}

/* The length of block b of a row of n tokens in blocks of `block`: the last one may be short. */
static inline int block_len(int n, int block, int b) { return n - b * block < block ? n - b * block : block; }

/* The row's weights, block by block, into w: each block at its own place (keep), or each over the last (w: one
 * block's room). Each block's sum into sums, their running sums into cum; returns the total. */
static inline double row_block_weights(const float *x, int vocab, int block, const row_scale *s, float *w, int keep,
                                       double *sums, double *cum) {
    double running = 0.0;
    for (int b = 0; b * block < vocab; b++) {
        int64_t at = (int64_t)b * block;
        sums[b] = block_weights(x + at, block_len(vocab, block, b), s->inverse_t, s->top, s->max, s->wide,
                                keep ? w + at : w);
        running += sums[b];
        cum[b] = running;
    }
    return running;
}

/* The inverse CDF's first level: the block holding u times the total, of num_blocks with these sums and running
 * sums; *rest: what of the target falls inside it, at least 0 (the block's own sums round differently from cum's). */
static inline int pick_block(const double *sums, const double *cum, int num_blocks, double u, double *rest) {
    double target = u * cum[num_blocks - 1];
    int b = pick_index(cum, num_blocks, target);
    *rest = target - (cum[b] - sums[b]);
    *rest = *rest > 0.0 ? *rest : 0.0;
    return b;
}

/* Its second level: of a block's n weights, the one where the running float64 sum passes rest (pick_index). */
static inline int pick_weight(const float *w, int n, double rest) {
    double inner[n], running = 0.0;
    for (int i = 0; i < n; i++) {
        running += w[i];
        inner[i] = running;
    }
    return pick_index(inner, n, rest);
}

#endif
