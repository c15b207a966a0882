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

#include "row_weights.h"

static int64_t draw_row(const float *x, int vocab, int block, float t, double u) {
    row_scale s;
    if (!scale_of(x, vocab, t, &s))
        return 0;
    int num_blocks = (vocab + block - 1) / block;
    double sums[num_blocks], cum[num_blocks], rest;
    float w[block]; /* one block's weights at a time */
    if (isnan(row_block_weights(x, vocab, block, &s, w, 0, sums, cum)))
        return 0;
    int b = pick_block(sums, cum, num_blocks, u, &rest);
    int n = block_len(vocab, block, b);
    block_weights(x + (int64_t)b * block, n, s.inverse_t, s.top, s.max, s.wide, w);
    return (int64_t)b * block + pick_weight(w, n, rest);
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
