/* The filtered rows' draw (top_k, top_p, min_p; common/model/sampler.py), without sorting the vocabulary. Per row:
 * its weights (row_weights.h), stored; then up to MAX_TRIES tries, each the plain rows' inverse CDF over the whole
 * row at the next uniform, and the first token the filters keep is the row's (rejection: a draw from the kept set
 * that never builds it); where none is, the kept set itself, the weights after its last token zeroed, and the
 * inverse CDF over what is left at the uniform after the last try's.
 *
 * The canonical order is by weight descending, then token id ascending, and each filter keeps a prefix of it: top_k
 * its first k tokens; top_p the tokens whose float64 mass before them is below top_p times the top_k prefix's mass
 * (the row's, without a top_k); min_p the tokens weighing at least min_p times the likeliest. A try's token is kept
 * when it is in all three: its count and mass before it are two vector passes over the row, or with a top_k of at
 * most HEAP_K a search among the k likeliest, found first by heap. The kept set's end is found among those k, or by
 * radix selection (token_selection.h). The PyTorch path sums in canonical order: a token differs from its only
 * where a uniform, or a token's mass before it, is within rounding of a boundary.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "row_weights.h"
#include "token_selection.h"

#define HEAP_K 1024 /* the largest top_k found among the k likeliest by heap, not by radix selection */
#define MAX_TRIES 8 /* sampler.py's FILTER_TRIES */

/* Of two tokens, the one earlier in canonical order (-1: none yet). */
static inline int32_t earlier(const float *w, int32_t a, int32_t b) {
    if (a < 0)
        return b;
    return after((token){w[a], a}, (token){w[b], b}) ? b : a;
}

static int count_at_least(const float *w, int n, float threshold) {
    int count = 0;
    for (int i = 0; i < n; i++)
        count += w[i] >= threshold;
    return count;
}

/* Zero every weight after token last in canonical order. */
static void cut_after(float *w, int n, int32_t last) {
    vfloat edge = splat(w[last]);
    int i = 0;
    for (; i + LANES <= last + 1; i += LANES) /* up to last, ties with it are before it */
        store(w + i, pick(load(w + i) >= edge, load(w + i), splat(0.0f)));
    for (; i <= last; i++)
        w[i] = w[i] >= edge[0] ? w[i] : 0.0f;
    for (; i < n && i % LANES != 0; i++)
        w[i] = w[i] > edge[0] ? w[i] : 0.0f;
    for (; i + LANES <= n; i += LANES)
        store(w + i, pick(load(w + i) > edge, load(w + i), splat(0.0f)));
    for (; i < n; i++)
        w[i] = w[i] > edge[0] ? w[i] : 0.0f;
}

/* The inverse CDF over stored weights, at u (sums, cum: their blocks' sums and running sums). */
static int32_t draw_at(const float *w, int n, int block, const double *sums, const double *cum, double u) {
    double rest;
    int b = pick_block(sums, cum, (n + block - 1) / block, u, &rest);
    return b * block + pick_weight(w + (int64_t)b * block, block_len(n, block, b), rest);
}

/* The kept set's draw: the weights after token last zeroed (none where last < 0), the blocks summed again, and the
 * token at u. */
static int32_t draw_cut(float *w, int n, int block, int32_t last, double *sums, double *cum, double u) {
    if (last >= 0)
        cut_after(w, n, last);
    double running = 0.0;
    for (int b = 0; b * block < n; b++) {
        sums[b] = sum_of(w + (int64_t)b * block, block_len(n, block, b));
        cum[b] = running += sums[b];
    }
    return draw_at(w, n, block, sums, cum, u);
}

/* The float64 mass of tokens [start, end) weighing at least `edge` (or more, when strict), and their count (when
 * counting). Inlined where strict and counting are constants: a pass has no branch, and the mass alone no count. */
static inline __attribute__((always_inline)) void count_above(const float *w, int start, int end, float edge,
                                                              int strict, int counting, double *count,
                                                              double *mass) {
    vint counted = {0};
    vdouble acc = {0};
    vfloat e = splat(edge), zero = splat(0.0f);
    int i = start;
    for (; i + 4 * LANES <= end; i += 4 * LANES) {
        vfloat v[4];
        for (int k = 0; k < 4; k++) {
            vfloat x = load(w + i + k * LANES);
            vint in = strict ? x > e : x >= e;
            if (counting)
                counted -= in;
            v[k] = pick(in, x, zero);
        }
        add_double(&acc, (v[0] + v[1]) + (v[2] + v[3]));
    }
    double c = 0.0, m = 0.0;
    for (int lane = 0; lane < LANES; lane++)
        c += counted[lane];
    for (int lane = 0; lane < LANES / 2; lane++)
        m += acc[lane];
    for (; i < end; i++)
        if (strict ? w[i] > edge : w[i] >= edge) {
            c += 1.0;
            m += w[i];
        }
    *count += c;
    *mass += m;
}

/* Whether token x is in the kept set: the count and the mass of the tokens before it in canonical order (ties
 * with a lower id, and every heavier token) below top_k and the top_p target, its weight not below min_p's
 * threshold. Passes over the row only for what a filter asks (top_k < n, a finite target). */
static int is_kept(const float *w, int n, int32_t x, int64_t top_k, double target, float threshold) {
    if (w[x] < threshold)
        return 0;
    double count = 0.0, mass = 0.0;
    if (top_k < n) {
        count_above(w, 0, x, w[x], 0, 1, &count, &mass);
        count_above(w, x, n, w[x], 1, 1, &count, &mass);
    } else if (isfinite(target)) {
        count_above(w, 0, x, w[x], 0, 0, &count, &mass);
        count_above(w, x, n, w[x], 1, 0, &count, &mass);
    }
    return count < (double)top_k && mass < target;
}

/* uniform's successor for a filtered row's next try: 53 bits of splitmix64 of its own 53 bits (sampler.py). */
static double next_uniform(double u) {
    uint64_t z = (uint64_t)(u * 9007199254740992.0) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (double)((z ^ (z >> 31)) >> 11) * 0x1p-53;
}

/* A row with a top_k of at most HEAP_K: its k likeliest tokens in canonical order (by heap, then sorted) and their
 * running masses. A try's token is kept when it is among them, the mass before it is below the target and its weight
 * not below the threshold; the kept set ends at the first of them whose running mass reaches the target, or at the
 * last not below the threshold. */
static int64_t draw_within_top_k(float *w, int n, int block, int k, float top_p, float threshold, double u,
                                 double *sums, double *cum, scratch *s) {
    token *top = s->cand;
    double run[k];
    likeliest_by_heap(w, n, k, top);
    qsort(top, k, sizeof *top, by_canonical_order);
    double running = 0.0;
    for (int j = 0; j < k; j++)
        run[j] = running += top[j].w;
    double target = top_p < 1.0f ? (double)top_p * run[k - 1] : INFINITY;
    for (int try = 0; try < MAX_TRIES; try++, u = next_uniform(u)) {
        token drawn = {0.0f, draw_at(w, n, block, sums, cum, u)};
        drawn.w = w[drawn.id];
        if (after(drawn, top[k - 1]) || drawn.w < threshold)
            continue;
        int lo = 0, hi = k - 1; /* its place among the k: the first not before it */
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (after(drawn, top[mid]))
                lo = mid + 1;
            else
                hi = mid;
        }
        if ((lo > 0 ? run[lo - 1] : 0.0) < target)
            return drawn.id;
    }
    int last = 0;
    while (last < k - 1 && run[last] < target && top[last + 1].w >= threshold)
        last++;
    return draw_cut(w, n, block, top[last].id, sums, cum, u);
}

static int64_t draw_filtered_row(const float *x, int vocab, int block, float t, int64_t top_k, float top_p,
                                 float min_p, double u, scratch *s) {
    row_scale sc;
    if (!scale_of(x, vocab, t, &sc))
        return 0;
    float *w = s->w;
    int num_blocks = (vocab + block - 1) / block;
    double sums[num_blocks], cum[num_blocks];
    double total = row_block_weights(x, vocab, block, &sc, w, 1, sums, cum); /* sums as draw_cut's sum_of adds */
    if (isnan(total))
        return 0;
    int64_t k = top_k > 0 && top_k < vocab ? top_k : vocab;
    /* The likeliest token's weight as stored (about 1; a scalar exponential of the maximum can round otherwise). */
    float threshold = min_p > 0.0f ? min_p * row_max(w, vocab) : 0.0f;
    if (k < vocab && k <= HEAP_K)
        return draw_within_top_k(w, vocab, block, (int)k, top_p, threshold, u, sums, cum, s);
    double mass_k = total; /* the top_k prefix's mass: only top_p's target needs it before the fallback */
    int32_t last_k = k < vocab && top_p < 1.0f ? locate(w, vocab, (double)k, 0, s, &mass_k) : -1;
    double target = top_p < 1.0f ? (double)top_p * mass_k : INFINITY;
    /* Tries: a token drawn from the whole row, kept if the filters keep it, which draws from the kept set. */
    for (int try = 0; try < MAX_TRIES; try++, u = next_uniform(u)) {
        int32_t token = draw_at(w, vocab, block, sums, cum, u);
        if (is_kept(w, vocab, token, k, target, threshold))
            return token;
    }
    /* The kept set itself, then a draw over it at the next uniform (one that no try has seen). */
    int32_t last = k < vocab && last_k < 0 ? locate(w, vocab, (double)k, 0, s, NULL) : last_k;
    if (top_p < 1.0f)
        last = earlier(w, last, locate(w, vocab, target, 1, s, NULL));
    if (min_p > 0.0f)
        last = earlier(w, last, locate(w, vocab, (double)count_at_least(w, vocab, threshold), 0, s, NULL));
    return draw_cut(w, vocab, block, last, sums, cum, u);
}

/* tokens[r] for each of num_rows rows: the row rows[r] of logits (r itself when rows is NULL), each row_stride
 * floats from the last, with temperature temperatures[r], top_ks[r] (0 or less: none), top_ps[r] (1: none),
 * min_ps[r] (NULL or 0: none) and uniform uniforms[r] in [0, 1). Returns 0, or -1 where scratch memory could not
 * be had (tokens then undefined). */
int kvferry_draw_filtered_f32(const float *logits, int64_t row_stride, const int64_t *rows, int num_rows, int vocab,
                              int block, const float *temperatures, const int64_t *top_ks, const float *top_ps,
                              const float *min_ps, const double *uniforms, int64_t *tokens, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_rows > 1) reduction(| : failed)
    {
        char *memory = malloc((size_t)vocab * (sizeof(token) + sizeof(float) + sizeof(uint16_t)));
        token *cand = (token *)memory; /* first: its 8-byte tokens aligned as malloc aligns */
        float *w = (float *)(cand + vocab);
        scratch s = {w, cand, (uint16_t *)(w + vocab)};
        failed = memory == NULL;
#pragma omp for
        for (int r = 0; r < num_rows; r++) {
            if (memory == NULL)
                continue;
            const float *x = logits + (rows != NULL ? rows[r] : r) * row_stride;
            tokens[r] = draw_filtered_row(x, vocab, block, temperatures[r], top_ks[r], top_ps[r],
                                          min_ps != NULL ? min_ps[r] : 0.0f, uniforms[r], &s);
        }
        free(memory);
    }
    return failed ? -1 : 0;
}
