/* y = x · W + bias for the rows of a decode batch, fp32, with W in the panels oneDNN packs a linear layer's weight
 * into: [ceil(n / width)][k][width] floats, the columns past n zero (cpu_linear.py checks the layout at load).
 *
 * At one to a few rows a linear layer is a matrix-vector product bound by reading the weights, and oneDNN's GEMM,
 * tuned for a batch, reads them at a fraction of the memory's pace (docs/benchmarks.md). A panel is read straight
 * through: for each of its k rows, x's value times the row's width columns, into width / LANES accumulators, so
 * each output is x's products summed in order of k. The panels are split between the threads; a second row of x
 * reads the panel again, from the cache.
 * At more rows (AVX2 builds, up to kvferry_panel_max_rows) the product is bound by arithmetic: blocks of BLOCK_ROWS
 * rows pass over slices of CHUNK vectors of a panel with every sum in a register, each slice row loaded once for
 * the block. Each output is still summed in order of k, by the same fused multiply-adds: a row's output is the same
 * bit for bit at every row count, as int8's is.
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

#define CHUNK 2      /* vectors of a slice: BLOCK_ROWS x CHUNK sums, a slice row and a broadcast fill 15 registers */
#define BLOCK_ROWS 6 /* on AVX2's sixteen */
#define PREFETCH_ROWS 16

/* The most rows this file takes. Past four, measured only where it is one AVX2 register a vector (on par with
 * oneDNN's GEMM or faster up to 512 rows, docs/benchmarks.md); elsewhere oneDNN keeps them. */
int kvferry_panel_max_rows(void) {
#if LANES == 8
    return 256;
#else
    return 4;
#endif
}

/* rows (at most BLOCK_ROWS, a constant where inlined) rows of x times one slice of CHUNK vectors of a panel, row
 * stride width -> out [rows][CHUNK * LANES]. */
static inline __attribute__((always_inline)) void panel_block(const float *x, int rows, int k, const float *slice,
                                                              int width, float *out, int fetch_panel) {
    vfloat sum[BLOCK_ROWS][CHUNK];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < CHUNK; v++)
            sum[r][v] = splat(0.0f);
    for (int d = 0; d < k; d++) {
        /* The whole panel row PREFETCH_ROWS on, into L2, a 64-byte line at a time: the other slices' passes find it
         * there. Past the panel's end this hints at memory that is not read: a prefetch never faults. */
        if (fetch_panel)
            for (int line = 0; line < width; line += 16)
                __builtin_prefetch(slice + (int64_t)(d + PREFETCH_ROWS) * width + line, 0, 2);
        vfloat b[CHUNK];
        for (int v = 0; v < CHUNK; v++)
            b[v] = load(slice + (int64_t)d * width + v * LANES);
        for (int r = 0; r < rows; r++) {
            vfloat xd = splat(x[(int64_t)r * k + d]);
            for (int v = 0; v < CHUNK; v++)
                sum[r][v] += xd * b[v];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < CHUNK; v++)
            store(out + (r * CHUNK + v) * LANES, sum[r][v]);
}

/* Every row of x times the panels' slices, which the threads share. */
static void blocked_matmul(const float *x, int rows, int k, const float *panels, int width, int n, const float *bias,
                           float *y) {
    const int slice_width = CHUNK * LANES, slices = width / slice_width;
    float block[BLOCK_ROWS * CHUNK * LANES];
#pragma omp for schedule(static)
    for (int item = 0; item < (n + width - 1) / width * slices; item++) {
        int first = item / slices * width + item % slices * slice_width;
        const float *slice = panels + (int64_t)(item / slices) * k * width + item % slices * slice_width;
        int columns = n - first < slice_width ? n - first : slice_width;
        for (int r = 0; r < rows && columns > 0; r += BLOCK_ROWS) {
            const float *xr = x + (int64_t)r * k;
            int fetch = r == 0 && item % slices == 0; /* the first pass over a panel brings in all of it */
            int m = rows - r < BLOCK_ROWS ? rows - r : BLOCK_ROWS;
            switch (m) { /* each its own copy, with its sums in registers */
            case 6: panel_block(xr, 6, k, slice, width, block, fetch); break;
            case 5: panel_block(xr, 5, k, slice, width, block, fetch); break;
            case 4: panel_block(xr, 4, k, slice, width, block, fetch); break;
            case 3: panel_block(xr, 3, k, slice, width, block, fetch); break;
            case 2: panel_block(xr, 2, k, slice, width, block, fetch); break;
            default: panel_block(xr, 1, k, slice, width, block, fetch); break;
            }
            for (int i = 0; i < m; i++)
                for (int c = 0; c < columns; c++)
                    y[(int64_t)(r + i) * n + first + c] = bias != NULL ? block[i * slice_width + c] + bias[first + c]
                                                                       : block[i * slice_width + c];
        }
    }
}

/* Each row of x over each panel in turn, which the threads share: at a few rows, the panels stream once. */
static void row_matmul(const float *x, int rows, int k, const float *panels, int width, int n, const float *bias,
                       float *y) {
    float acc[MAX_WIDTH];
#pragma omp for schedule(static)
    for (int p = 0; p < (n + width - 1) / width; p++) {
        const float *panel = panels + (int64_t)p * k * width;
        int first = p * width, columns = n - first < width ? n - first : width;
        for (int r = 0; r < rows; r++) {
            /* A constant trip count for the common widths keeps the accumulators in registers, each sum one fused
             * multiply-add a step, as in panel_block (with a trip count it did not know, GCC left one vector's products
             * unfused: a row's output then depended on its batch) */
            if (width == 8 * LANES)
                panel_row(x + (int64_t)r * k, k, panel, 8, acc);
            else if (width == 4 * LANES)
                panel_row(x + (int64_t)r * k, k, panel, 4, acc);
            else if (width == 2 * LANES)
                panel_row(x + (int64_t)r * k, k, panel, 2, acc);
            else
                panel_row(x + (int64_t)r * k, k, panel, width / LANES, acc);
            float *out = y + (int64_t)r * n + first;
            for (int c = 0; c < columns; c++)
                out[c] = bias != NULL ? acc[c] + bias[first + c] : acc[c];
        }
    }
}

/* x [rows][k], rows up to kvferry_panel_max_rows; panels as above, bias [n] (NULL: none) -> y [rows][n]. */
void kvferry_panel_matmul_f32(const float *x, int rows, int k, const float *panels, int width, int n,
                              const float *bias, float *y, int num_threads) {
    int count = (n + width - 1) / width;
#pragma omp parallel num_threads(num_threads) if ((int64_t)count * width * k >= PARALLEL_WEIGHT_FLOATS)
    {
        /* Only widths that panel_row also takes with a constant trip count: its sums are then fused as these are */
        if (rows > 4 && (width == 2 * LANES || width == 4 * LANES || width == 8 * LANES))
            blocked_matmul(x, rows, k, panels, width, n, bias, y);
        else
            row_matmul(x, rows, k, panels, width, n, bias, y);
    }
}
