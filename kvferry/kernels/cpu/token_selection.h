/* Selecting tokens by the canonical order of a row's weights (draw_filtered.c): by weight descending, then token id
 * ascending. locate() finds the first token at which a running count or mass reaches a target, by radix selection:
 * ten bits of the weight at a time from the top (a non-negative float's bits order as its value), the count and
 * float64 mass of the tokens above summed digit by digit; likeliest_by_heap() the k likeliest tokens, for a small k. */
#ifndef KVFERRY_TOKEN_SELECTION_H
#define KVFERRY_TOKEN_SELECTION_H

#include <stdint.h>
#include <string.h>

#include "vectors.h"

/* Three digits of a non-negative float's 31 bits: 10 from bit 21 (any finite weight's: below 0x7F800000, so no
 * clamp, where a fused multiply-add can leave the likeliest tokens' weights above 1; row_weights.h), 11 from bit
 * 10, then the last 10. */
#define DIGITS 2048
static const int SHIFTS[3] = {21, 10, 0};
static const uint32_t MASKS[3] = {0x3FF, 0x7FF, 0x3FF};

typedef struct {
    float w;
    int32_t id;
} token;

/* The selection's room: the row's weights, candidates, and each token's first digit, vocab of each. */
typedef struct {
    float *w;         /* the row's weights */
    token *cand;      /* the selection's candidates, in token-id order */
    uint16_t *digits; /* each token's first digit */
} scratch;

static inline uint32_t bits_of(float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

static inline int digit_of(float v, int level) { return (int)(bits_of(v) >> SHIFTS[level] & MASKS[level]); }

/* The first digit's counts and masses over the whole row: each token's digit first (vectors), then four
 * histograms, token i into the (i % 4)th, summed at the end. In a flat row most tokens share a few digits, and one
 * histogram's additions would each wait for the last one's store; and left to itself GCC makes the four into
 * AVX-512 scatters, which run at half the speed. */
__attribute__((optimize("no-tree-vectorize"))) static void count_digits(const float *w, const uint16_t *digits,
                                                                       int n, int32_t *count, double *mass) {
    enum { FIRST = 1024 }; /* MASKS[0] + 1: the first digit's values */
    int32_t counts[4][FIRST] = {{0}};
    double masses[4][FIRST] = {{0}};
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
    for (int d = 0; d < FIRST; d++) {
        count[d] = (counts[0][d] + counts[1][d]) + (counts[2][d] + counts[3][d]);
        mass[d] = (masses[0][d] + masses[1][d]) + (masses[2][d] + masses[3][d]);
    }
}

static void histogram(const float *w, int n, int32_t *count, double *mass, uint16_t *digits) {
    for (int i = 0; i < n; i++)
        digits[i] = (uint16_t)digit_of(w[i], 0);
    count_digits(w, digits, n, count, mass);
}

/* The first token in canonical order at which the running count (by_mass 0) or mass (by_mass 1) of the tokens up
 * to it reaches target; where rounding leaves none, the last token. *through (unless NULL): that running mass. */
static int32_t locate(const float *w, int n, double target, int by_mass, scratch *s, double *through) {
    double above_count = 0.0, above_mass = 0.0; /* the tokens before every candidate */
    int m = 0;
    for (int level = 0; level < 3; level++) {
        int32_t count[DIGITS] = {0};
        double mass[DIGITS] = {0};
        if (level == 0)
            histogram(w, n, count, mass, s->digits);
        else
            for (int j = 0; j < m; j++) {
                int d = digit_of(s->cand[j].w, level);
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
                kept += digit_of(s->cand[j].w, level) == chosen;
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

/* Whether token a comes after token b in canonical order. */
static inline int after(token a, token b) { return a.w < b.w || (a.w == b.w && a.id > b.id); }

/* Restore a heap of n tokens, the canonically last at its root, below position i. */
static void sift_down(token *heap, int n, int i) {
    for (;;) {
        int last = i, l = 2 * i + 1, r = l + 1;
        if (l < n && after(heap[l], heap[last]))
            last = l;
        if (r < n && after(heap[r], heap[last]))
            last = r;
        if (last == i)
            return;
        token t = heap[i];
        heap[i] = heap[last];
        heap[last] = t;
        i = last;
    }
}

/* The k (< n) likeliest tokens into heap, in no order: a heap of the likeliest k seen so far, the last of them in
 * canonical order at its root, in one pass in token-id order. A later token enters only if heavier than the root
 * (an equal one comes after it), and runs of four vectors of lighter ones are skipped. In random order about
 * k ln(n / k) tokens enter. */
static void likeliest_by_heap(const float *w, int n, int k, token *heap) {
    for (int i = 0; i < k; i++)
        heap[i] = (token){w[i], i};
    for (int i = k / 2 - 1; i >= 0; i--)
        sift_down(heap, k, i);
    float edge = heap[0].w; /* the heap's last token's weight */
    const vint none = {0};
    int i = k;
    for (; i + 4 * LANES <= n; i += 4 * LANES) {
        vfloat v = load(w + i);
        for (int j = 1; j < 4; j++)
            v = pick(load(w + i + j * LANES) > v, load(w + i + j * LANES), v);
        vint heavier = v > splat(edge);
        if (memcmp(&heavier, &none, sizeof heavier) == 0)
            continue;
        for (int j = i; j < i + 4 * LANES; j++)
            if (w[j] > edge) {
                heap[0] = (token){w[j], j};
                sift_down(heap, k, 0);
                edge = heap[0].w;
            }
    }
    for (; i < n; i++)
        if (w[i] > edge) {
            heap[0] = (token){w[i], i};
            sift_down(heap, k, 0);
            edge = heap[0].w;
        }
}

static int by_canonical_order(const void *a, const void *b) {
    token x = *(const token *)a, y = *(const token *)b;
    return after(x, y) - after(y, x);
}

#endif
