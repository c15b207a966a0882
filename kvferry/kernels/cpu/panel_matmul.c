/* y = x · W + bias for a few rows of x, fp32, with W in the panels oneDNN packs a linear layer's weight into:
 * [ceil(n / width)][k][width] floats, the columns past n zero (cpu_linear.py checks the layout at load).
 *
 * At one to a few rows a linear layer is a matrix-vector product bound by reading the weights, and oneDNN's GEMM,
 * tuned for a batch, reads them at a fraction of the memory's pace (docs/benchmarks.md). A panel is read straight
 * through: for each of its k rows, x's value times the row's width columns, into width / LANES accumulators, so
 * each output is x's products summed in order of k. The panels are split between the threads; a second row of x
 * reads the panel again, from the cache.
 */
#include <stdint.h>

#include "vectors.h"

/* Sixteen accumulator vectors at most. oneDNN's panels here are 16-64 columns: 2-8 vectors on AVX2, which stay in its
 * sixteen registers beside the broadcast and the loaded row; wider ones would spill, still correctly. */
#define MAX_WIDTH (16 * LANES)
#define PARALLEL_WEIGHT_FLOATS (64 * 1024) /* below this, the second thread's wake-up costs more than it saves */

/* Whether this file takes panels of this width. */
int kvferry_panel_width_fits(int width) { return width > 0 && width % LANES == 0 && width <= MAX_WIDTH; }

static inline __attribute__((always_inline)) void panel_row(const float *x, int k, const float *panel, int vectors,
                                                            float *acc) {
    vfloat sum[MAX_WIDTH / LANES];
    for (int v = 0; v < vectors; v++)
        sum[v] = splat(0.0f);
    for (int d = 0; d < k; d++) {
        vfloat xd = splat(x[d]);
        const float *row = panel + (int64_t)d * vectors * LANES;
        for (int v = 0; v < vectors; v++)
            sum[v] += xd * load(row + v * LANES);
    }
    for (int v = 0; v < vectors; v++)
        store(acc + v * LANES, sum[v]);
}

/* x [rows][k], panels as above, bias [n] (NULL: none) -> y [rows][n]. */
void kvferry_panel_matmul_f32(const float *x, int rows, int k, const float *panels, int width, int n,
                              const float *bias, float *y, int num_threads) {
    int count = (n + width - 1) / width;
#pragma omp parallel num_threads(num_threads) if ((int64_t)count * width * k >= PARALLEL_WEIGHT_FLOATS)
    {
        float acc[MAX_WIDTH];
#pragma omp for schedule(static)
        for (int p = 0; p < count; p++) {
            const float *panel = panels + (int64_t)p * k * width;
            int first = p * width, columns = n - first < width ? n - first : width;
            for (int r = 0; r < rows; r++) {
                /* A constant trip count for the common widths keeps the accumulators in registers. */
                if (width == 8 * LANES)
                    panel_row(x + (int64_t)r * k, k, panel, 8, acc);
                else if (width == 4 * LANES)
                    panel_row(x + (int64_t)r * k, k, panel, 4, acc);
                else
                    panel_row(x + (int64_t)r * k, k, panel, width / LANES, acc);
                float *out = y + (int64_t)r * n + first;
                for (int c = 0; c < columns; c++)
                    out[c] = bias != NULL ? acc[c] + bias[first + c] : acc[c];
            }
        }
    }
}
