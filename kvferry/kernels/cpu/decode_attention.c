/* Paged decode attention for the CPU: one new query token per sequence attends to its cached context,
 * reading K and V from the blocks where they lie instead of gathering them into a copy first.
 *
 * One work item is one sequence with all its heads: first its new token's K and V go into their slot, then its
 * blocks are taken one at a time (flash-decoding's online softmax): score the block's tokens, rescale what was
 * summed so far if the running maximum rose, add the block's V. The next block is prefetched while this one is
 * computed, and a block's K and V stay in cache while each head passes over them: K and V are read from memory
 * once per layer.
 * Sequences are shared between threads by OpenMP; the library links the libgomp that torch has already loaded,
 * so these are torch's own threads. With fewer sequences than threads (one stream alone), each sequence's heads are
 * split between them too: a head's sums never touch another head's, so the output is the same bit for bit however
 * they are split.
 *
 * A head's vector is a whole number of LANES-float vectors (vectors.h; the Python side checks head_dim % 16 == 0).
 * K and V are fp32, fp16 or bf16 as the cache stores them (vectors.h's kv_type; one entry point each), widened to
 * fp32 as they are read; the query, the sums and the output are fp32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vectors.h"

#define MAX_CHUNKS (256 / LANES) /* head_dim up to 256 */
#define LINE_BYTES 64 /* a cache line: the prefetches' step (a row is a multiple of 16 elements, 32 or 64 bytes) */
#ifndef PARALLEL_SPLIT_ELEMENTS
#define PARALLEL_SPLIT_ELEMENTS 16384 /* of K in the longest context: below, a second thread's wake-up costs more */
#endif

/* Heads [first, last) of one sequence. Inlined into a copy per common head size (see attend_sequence), so that
 * head_dim is a constant there: the loops over a head's chunks unroll, and its running sum stays in registers across
 * a block. scores: [block_size] scratch; acc: [num_heads][head_dim] scratch. */
static inline __attribute__((always_inline)) void attend(const float *q, const void *k_cache, const void *v_cache,
                                                         int64_t block_stride, int64_t token_stride,
                                                         int64_t head_stride, int kv_heads, const int32_t *blocks,
                                                         int context_len, int block_size, int num_heads,
                                                         int first, int last, const int head_dim, float scale,
                                                         float *s, float *acc, float *out, const enum kv_type type) {
    const int chunks = head_dim / LANES, group = num_heads / kv_heads;
    const int64_t own_heads = (int64_t)(first / group) * head_stride; /* the first of these heads' KV heads */
    const int line_elements = LINE_BYTES / (int)kv_size(type);
    const int lines_per_row = ((last - 1) / group + 1 - first / group) * head_dim / line_elements;
    float top[num_heads], total[num_heads];
    for (int h = first; h < last; h++)
        top[h] = -INFINITY, total[h] = 0.0f;
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int t0 = 0, b = 0; t0 < context_len; t0 += block_size, b++) {
        const int64_t block = (int64_t)blocks[b] * block_stride; /* elements into either cache */
        int n = context_len - t0 < block_size ? context_len - t0 : block_size;
        /* The next block's lines of these heads' KV heads are prefetched into L2 a few at a time, spread over this
         * block's work: issued all at once, they would fill the core's miss buffers and stall the arithmetic until
         * they arrived. Only these: at one sequence the KV streams from memory, and each thread must bring in only
         * its own share of it. */
        int64_t next = t0 + block_size < context_len ? (int64_t)blocks[b + 1] * block_stride + own_heads : -1;
        const int lines = 2 * block_size * lines_per_row; /* K's and V's */
        const int per_step = (lines + (last - first) * n - 1) / ((last - first) * n);
        int issued = next >= 0 ? 0 : lines;
        for (int h = first; h < last; h++) {
            const int64_t head = block + (h / group) * head_stride;
            vfloat qh[MAX_CHUNKS], a[MAX_CHUNKS];
            for (int c = 0; c < chunks; c++)
                qh[c] = load(q + h * head_dim + c * LANES);
            float highest = top[h], sum = 0.0f;
            for (int t = 0; t < n; t++) {
                for (int j = 0; j < per_step && issued < lines; j++, issued++) {
                    int line = issued >> 1;
                    int64_t at = next + (line / lines_per_row) * token_stride + (line % lines_per_row) * line_elements;
                    __builtin_prefetch((const char *)(issued & 1 ? v_cache : k_cache) + at * kv_size(type), 0, 2);
                }
                const int64_t k = head + t * token_stride;
                vfloat even = {0}, odd = {0}; /* two chains: the products do not wait on one another */
                for (int c = 0; c < chunks; c += 2) {
                    even += qh[c] * load_kv(k_cache, k + c * LANES, type);
                    if (c + 1 < chunks)
                        odd += qh[c + 1] * load_kv(k_cache, k + (c + 1) * LANES, type);
                }
                s[t] = sum_lanes(even + odd) * scale;
                highest = s[t] > highest ? s[t] : highest;
            }
            for (int c = 0; c < chunks; c++)
                a[c] = load(acc + h * head_dim + c * LANES);
            if (highest > top[h]) { /* e^(old - new) <= 1; on the first block nothing is summed yet */
                float shrink = top[h] == -INFINITY ? 0.0f : exp_one(top[h] - highest);
                for (int c = 0; c < chunks; c++)
                    a[c] *= splat(shrink);
                total[h] *= shrink;
                top[h] = highest;
            }
            int t = 0;
            for (; t + LANES <= n; t += LANES) {
                vfloat e = exp_vector(load(s + t) - splat(highest));
                store(s + t, e);
                sum += sum_lanes(e);
            }
            for (; t < n; t++) {
                s[t] = exp_one(s[t] - highest);
                sum += s[t];
            }
            total[h] += sum;
            for (t = 0; t < n; t++) {
                const int64_t v = head + t * token_stride;
                vfloat w = splat(s[t]);
                for (int c = 0; c < chunks; c++)
                    a[c] += w * load_kv(v_cache, v + c * LANES, type);
            }
            for (int c = 0; c < chunks; c++)
                store(acc + h * head_dim + c * LANES, a[c]);
        }
    }
    for (int h = first; h < last; h++)
        for (int c = 0; c < chunks; c++)
            store(out + h * head_dim + c * LANES, load(acc + h * head_dim + c * LANES) * splat(1.0f / total[h]));
}

/* attend, compiled once per element type and common head size: those are constants there. */
static inline __attribute__((always_inline)) void attend_sized(const float *q, const void *k_cache,
                                                               const void *v_cache, int64_t block_stride,
                                                               int64_t token_stride, int64_t head_stride,
                                                               int kv_heads, const int32_t *blocks, int context_len,
                                                               int block_size, int num_heads, int first, int last,
                                                               int head_dim, float scale, float *s, float *acc,
                                                               float *out, const enum kv_type type) {
#define ATTEND(D)                                                                                                 \
    attend(q, k_cache, v_cache, block_stride, token_stride, head_stride, kv_heads, blocks, context_len, block_size, \
           num_heads, first, last, D, scale, s, acc, out, type)
    switch (head_dim) {
    case 64:
        ATTEND(64);
        break;
    case 128:
        ATTEND(128);
        break;
    default:
        ATTEND(head_dim);
    }
#undef ATTEND
}

static void attend_sequence(const float *q, const void *k_cache, const void *v_cache, int64_t block_stride,
                            int64_t token_stride, int64_t head_stride, int kv_heads, const int32_t *blocks,
                            int context_len, int block_size, int num_heads, int first, int last, int head_dim,
                            float scale, float *s, float *acc, float *out, enum kv_type type) {
#define ATTEND(T)                                                                                                 \
    attend_sized(q, k_cache, v_cache, block_stride, token_stride, head_stride, kv_heads, blocks, context_len,      \
                 block_size, num_heads, first, last, head_dim, scale, s, acc, out, T)
    switch (type) {
    case KV_F16:
        ATTEND(KV_F16);
        break;
    case KV_BF16:
        ATTEND(KV_BF16);
        break;
    default:
        ATTEND(KV_F32);
    }
#undef ATTEND
}

/* Write one sequence's new K and V (kv_heads vectors each, contiguous fp32) into its slot's place in the caches, in
 * the caches' type. */
static void store_token(const float *new_k, const float *new_v, void *k_cache, void *v_cache, int64_t slot,
                        int block_size, int64_t block_stride, int64_t token_stride, int64_t head_stride, int kv_heads,
                        int head_dim, enum kv_type type) {
    int64_t at = slot / block_size * block_stride + slot % block_size * token_stride;
    for (int h = 0; h < kv_heads; h++)
        for (int c = 0; c < head_dim; c += LANES) {
            store_kv(k_cache, at + h * head_stride + c, load(new_k + h * head_dim + c), type);
            store_kv(v_cache, at + h * head_stride + c, load(new_v + h * head_dim + c), type);
        }
}

/* query, out: [batch, heads, head_dim] contiguous, head_dim a multiple of 16 and at most 256. new_k, new_v: each
 * sequence's new token, kv_heads * head_dim floats, rows new_k_stride and new_v_stride apart, stored first at
 * slots[seq] (a negative slot stores nothing; slots NULL: none). k_cache, v_cache: element strides block_stride
 * (a block), token_stride (a token in its block) and head_stride (a KV head), the same for both. block_tables:
 * [batch, table_stride] int32; context_lens: [batch] int32, each at least 1, the new token included. Returns 0,
 * or -1 if scratch memory ran out. */
static int decode_attention(const float *query, const float *new_k, int64_t new_k_stride, const float *new_v,
                            int64_t new_v_stride, const int64_t *slots, void *k_cache, void *v_cache,
                            int64_t block_stride, int64_t token_stride, int64_t head_stride,
                            const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens, float *out,
                            int batch, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            int num_threads, enum kv_type type) {
    /* How many parts each sequence's heads are split into: one each at as many sequences as threads; at fewer,
     * enough for every thread, where the longest context makes the split worth a second thread's wake-up. */
    int parts = 1;
    if (batch < num_threads) {
        int longest = 0, wanted = (num_threads + batch - 1) / batch;
        for (int seq = 0; seq < batch; seq++)
            longest = context_lens[seq] > longest ? context_lens[seq] : longest;
        if ((int64_t)longest * num_heads * head_dim >= PARALLEL_SPLIT_ELEMENTS)
            parts = wanted < num_heads ? wanted : num_heads;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed) if (batch * parts > 1)
    {
        float *scratch = malloc(sizeof(float) * ((size_t)block_size + LANES + (size_t)num_heads * head_dim));
        failed = scratch == NULL;
        /* Every new token is in its slot before any part of its sequence reads it (the loop's barrier) */
        if (slots != NULL) {
#pragma omp for
            for (int seq = 0; seq < batch; seq++)
                if (slots[seq] >= 0)
                    store_token(new_k + seq * new_k_stride, new_v + seq * new_v_stride, k_cache, v_cache, slots[seq],
                                block_size, block_stride, token_stride, head_stride, num_kv_heads, head_dim, type);
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < batch * parts; item++) {
            if (scratch == NULL)
                continue;
            int seq = item / parts, part = item % parts;
            int64_t offset = (int64_t)seq * num_heads * head_dim;
            attend_sequence(query + offset, k_cache, v_cache, block_stride, token_stride, head_stride, num_kv_heads,
                            block_tables + seq * table_stride, context_lens[seq], block_size, num_heads,
                            num_heads * part / parts, num_heads * (part + 1) / parts, head_dim, scale, scratch,
                            scratch + block_size + LANES, out + offset, type);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* The entry points, one per KV element type, all with the arguments above (k_cache and v_cache in that type). */
#define ENTRY(NAME, T)                                                                                              \
    int NAME(const float *query, const float *new_k, int64_t new_k_stride, const float *new_v, int64_t new_v_stride, \
             const int64_t *slots, void *k_cache, void *v_cache, int64_t block_stride, int64_t token_stride,        \
             int64_t head_stride, const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,   \
             float *out, int batch, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,     \
             int num_threads) {                                                                                     \
        return decode_attention(query, new_k, new_k_stride, new_v, new_v_stride, slots, k_cache, v_cache,          \
                                block_stride, token_stride, head_stride, block_tables, table_stride, context_lens,  \
                                out, batch, num_heads, num_kv_heads, head_dim, block_size, scale, num_threads, T);  \
    }
ENTRY(kvferry_paged_decode_attention_f32, KV_F32)
ENTRY(kvferry_paged_decode_attention_f16, KV_F16)
ENTRY(kvferry_paged_decode_attention_bf16, KV_BF16)
#undef ENTRY

/* Which element types this build takes, a bit per kv_type: fp16 only where the CPU converts it (vectors.h). */
int kvferry_kv_types(void) { return KV_TYPES; }
