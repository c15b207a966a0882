/* The filtered rows' draw (top_k, top_p, min_p; common/model/sampler.py), without sorting the vocabulary. Per row:
 * its weights (row_weights.h) stored, the kept set's last token found by selection on the weights' bits, the weights
 * after it zeroed, then the inverse CDF over what is left in token-id order, two levels as the plain rows' draw.
 *
 * The canonical order is by weight descending, then token id ascending, and each filter keeps a prefix of it: top_k
 * its first k tokens; top_p the tokens whose mass before them is below top_p times the top_k prefix's mass (the
 * row's, without a top_k); min_p the tokens weighing at least min_p times the likeliest. The kept set is the
 * shortest of the three. Each prefix ends at the first token where a running count (top_k, min_p) or mass (top_p)
 * reaches a target: a radix selection, ten bits of the weight at a time from the top (a non-negative float's bits
 * order as its value), with the mass of the tokens above summed digit by digit in float64. The PyTorch path sums in
 * canonical order: a cut differs from its only where a token's mass before it is within rounding of the target.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "row_weights.h"

#define DIGITS 1024
#define MAX_TRIES 8 /* sampler.py's FILTER_TRIES */
/* A weight is at most 1 (bits 0x3F800000), within rounding: its bits from 20 up stay below DIGITS. */
static const int SHIFTS[3] = {20, 10, 0};

typedef struct {
    float w;
    int32_t id;
} token;

typedef struct {
    float *w;     /* the row's weights, vocab of them */
    token *cand;  /* the selection's candidates, in token-id order */
    uint16_t *digits; /* each token's first digit */
} scratch;

static inline uint32_t bits_of(float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

static inline int digit_of(float v, int shift) {
    uint32_t d = bits_of(v) >> shift;
    return shift == SHIFTS[0] ? (d < DIGITS ? (int)d : DIGITS - 1) : (int)(d & (DIGITS - 1));
}

/* Of two tokens, the one earlier in canonical order (-1: none yet). */
static inline int32_t earlier(const float *w, int32_t a, int32_t b) {
    if (a < 0)
        return b;
    return w[a] > w[b] || (w[a] == w[b] && a < b) ? a : b;
}

/* The first digit's counts and masses over the whole row: each token's digit first (vectors), then four
 * histograms, token i into the (i % 4)th, summed at the end. In a flat row most tokens share a few digits, and one
 * histogram's additions would each wait for the last one's store; and left to itself GCC makes the four into
 * AVX-512 scatters, which run at half the speed. */
__attribute__((optimize("no-tree-vectorize"))) static void count_digits(const float *w, const uint16_t *digits,
                                                                       int n, int32_t *count, double *mass) {
    int32_t counts[4][DIGITS] = {{0}};
    double masses[4][DIGITS] = {{0}};
    int i = 0;
    for (; i + 4 <= n; i += 4)
        for (int k = 0; k < 4; k++) {
            counts[k][digits[i + k]]++;
            masses[k][digits[i + k]] += w[i + k];
        }
    for (; i < n; i++) {
        counts[0][digits[i]]++;
        masses[0][digits[i]] += w[i];
    }
    for (int d = 0; d < DIGITS; d++) {
        count[d] = (counts[0][d] + counts[1][d]) + (counts[2][d] + counts[3][d]);
        mass[d] = (masses[0][d] + masses[1][d]) + (masses[2][d] + masses[3][d]);
    }
}

static void histogram(const float *w, int n, int32_t *count, double *mass, uint16_t *digits) {
    for (int i = 0; i < n; i++)
        digits[i] = (uint16_t)digit_of(w[i], SHIFTS[0]);
    count_digits(w, digits, n, count, mass);
}

/* The first token in canonical order at which the running count (by_mass 0) or mass (by_mass 1) of the tokens up
 * to it reaches target; where rounding leaves none, the last token. *through (unless NULL): that running mass. */
static int32_t locate(const float *w, int n, double target, int by_mass, scratch *s, double *through) {
    double above_count = 0.0, above_mass = 0.0; /* the tokens before every candidate */
    int m = 0;
    for (int level = 0; level < 3; level++) {
        int shift = SHIFTS[level];
        int32_t count[DIGITS] = {0};
        double mass[DIGITS] = {0};
        if (level == 0)
            histogram(w, n, count, mass, s->digits);
        else
            for (int j = 0; j < m; j++) {
                int d = digit_of(s->cand[j].w, shift);
                count[d]++;
                mass[d] += s->cand[j].w;
            }
        int lowest = 0;
        while (count[lowest] == 0)
            lowest++;
        int chosen = lowest;
        for (int d = DIGITS - 1; d > lowest; d--) {
            if (count[d] == 0)
                continue;
            if ((by_mass ? above_mass + mass[d] : above_count + count[d]) >= target) {
                chosen = d;
                break;
            }
            above_count += count[d];
            above_mass += mass[d];
        }
        int kept = 0; /* the chosen digit's tokens, in token-id order (written always, kept where they match) */
        if (level == 0) {
            for (int i = 0; i < n; i++) {
                s->cand[kept] = (token){w[i], i};
                kept += s->digits[i] == chosen;
            }
        } else {
            for (int j = 0; j < m; j++) {
                s->cand[kept] = s->cand[j];
                kept += digit_of(s->cand[j].w, shift) == chosen;
            }
        }
        m = kept;
    }
    /* Every candidate now weighs the same: in canonical order, they go by token id. */
    int j = 0;
    for (; j < m - 1; j++) {
        above_count += 1.0;
        above_mass += s->cand[j].w;
        if ((by_mass ? above_mass : above_count) >= target)
            break;
    }
    if (j == m - 1)
        above_mass += s->cand[j].w;
    if (through != NULL)
        *through = above_mass;
    return s->cand[j].id;
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

/* The inverse CDF over stored weights: each block's sum and their running sums. */
static void block_sums(const float *w, int n, int block, double *sums, double *cum) {
    double running = 0.0;
    for (int b = 0; b * block < n; b++) {
        int len = n - b * block < block ? n - b * block : block;
        sums[b] = sum_of(w + (int64_t)b * block, len);
        running += sums[b];
        cum[b] = running;
    }
}

/* Then the token at u: the block holding u times the total, then the token inside it. */
static int32_t draw_at(const float *w, int n, int block, const double *sums, const double *cum, double u) {
    int num_blocks = (n + block - 1) / block;
    double target = u * cum[num_blocks - 1];
    int b = pick_index(cum, num_blocks, target);
    double rest = target - (cum[b] - sums[b]); /* at least 0: the block's own sums round differently from cum's */
    rest = rest > 0.0 ? rest : 0.0;
    int len = n - b * block < block ? n - b * block : block;
    double inner[block], running = 0.0;
    for (int i = 0; i < len; i++) {
        running += w[(int64_t)b * block + i];
        inner[i] = running;
    }
    return b * block + pick_index(inner, len, rest);
}

/* The count and the float64 mass of tokens [start, end) weighing at least `edge` (or more, when strict). */
static void count_above(const float *w, int start, int end, float edge, int strict, double *count, double *mass) {
    vint counted = {0};
    vdouble acc = {0};
    vfloat e = splat(edge), zero = splat(0.0f);
    int i = start;
    for (; i + 4 * LANES <= end; i += 4 * LANES) {
        vfloat v[4];
        for (int k = 0; k < 4; k++) {
            vfloat x = load(w + i + k * LANES);
            vint in = strict ? x > e : x >= e;
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
 * threshold. */
static int is_kept(const float *w, int n, int32_t x, int64_t top_k, double target, float threshold) {
    if (w[x] < threshold)
        return 0;
    double count = 0.0, mass = 0.0;
    count_above(w, 0, x, w[x], 0, &count, &mass);
    count_above(w, x, n, w[x], 1, &count, &mass);
    return count < (double)top_k && mass < target;
}

/* uniform's successor for a filtered row's next try: 53 bits of splitmix64 of its own 53 bits (sampler.py). */
static double next_uniform(double u) {
    uint64_t z = (uint64_t)(u * 9007199254740992.0) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (double)((z ^ (z >> 31)) >> 11) * 0x1p-53;
}

static int64_t draw_filtered_row(const float *x, int vocab, int block, float t, int64_t top_k, float top_p,
                                 float min_p, double u, scratch *s) {
    row_scale sc;
    if (!scale_of(x, vocab, t, &sc))
        return 0;
    float *w = s->w;
    double total = block_weights(x, vocab, sc.inverse_t, sc.top, sc.max, sc.wide, w);
    if (isnan(total))
        return 0;
    int64_t k = top_k > 0 && top_k < vocab ? top_k : vocab;
    double mass_k = total; /* the top_k prefix's mass: only top_p's target needs it before the fallback */
    int32_t last_k = k < vocab && top_p < 1.0f ? locate(w, vocab, (double)k, 0, s, &mass_k) : -1;
    double target = top_p < 1.0f ? (double)top_p * mass_k : INFINITY;
    float likeliest = weight_lanes(splat(sc.max), splat(sc.inverse_t), splat(sc.top), splat(sc.max), sc.wide)[0];
    float threshold = min_p > 0.0f ? min_p * likeliest : 0.0f;
    int num_blocks = (vocab + block - 1) / block;
    double sums[num_blocks], cum[num_blocks];
    block_sums(w, vocab, block, sums, cum);
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
    if (last >= 0)
        cut_after(w, vocab, last);
    block_sums(w, vocab, block, sums, cum);
    return draw_at(w, vocab, block, sums, cum, u);
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
        /* The candidates start 64 bytes past a multiple of 4 KiB from the weights: loads of one and stores to the
         * other at the same offset would look alike to the CPU's store forwarding (4K aliasing). */
        size_t offset = ((size_t)vocab * sizeof(float) + 4095) / 4096 * 4096 + 64;
        char *memory = malloc(offset + (size_t)vocab * (sizeof(token) + sizeof(uint16_t)));
        scratch s = {(float *)memory, (token *)(memory + offset), (uint16_t *)(memory + offset + vocab * sizeof(token))};
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
