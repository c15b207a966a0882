/* Paged prefill attention for the CPU: each sequence's new tokens attend causally to its context (a cached
 * prefix and themselves), reading K and V from the blocks where they lie. The new tokens' K and V are in the cache
 * already (store_kv ran first).
 *
 * One work item is LANES new tokens (16 or 8, vectors.h) of one sequence and one head. Its queries are held
 * transposed, one vector of LANES rows per dimension, so that every product runs across the rows at once and needs
 * no horizontal sums: scores for LANES keys at a time are LANES vectors built dimension by dimension (a broadcast
 * of the key's value times the queries' vector), then one online-softmax update per chunk of keys (flash
 * attention's), then V is added the same way. Items are shared between threads by OpenMP.
 * K and V are fp32, fp16 or bf16 as the cache stores them (vectors.h's kv_type; one entry point each). A half-precision
 * chunk of keys is widened into fp32 scratch once, then read as an fp32 one is.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vectors.h"

#define KEYS LANES /* keys per chunk: a constant trip count keeps the score vectors in registers */

static inline __attribute__((always_inline)) void attend_tile(const float *query, int64_t q_row_stride, int rows,
                                                              int first_pos, const void *k_cache, const void *v_cache,
                                                              int64_t block_stride, int64_t token_stride,
                                                              const int32_t *blocks, int block_size, int head_dim,
                                                              float scale, vfloat *qt, vfloat *ot, float *wide,
                                                              float *out, int64_t out_row_stride,
                                                              const enum kv_type type) {
    /* qt, ot: [head_dim] vectors of LANES rows each. Lane r is the query at position first_pos + r. wide: room for a
     * chunk's K and V in fp32, [2][KEYS][head_dim] (unused for an fp32 cache). */
    for (int d = 0; d < head_dim; d++) {
        vfloat column = {0};
        for (int r = 0; r < rows; r++)
            column[r] = query[r * q_row_stride + d] * scale;
        qt[d] = column;
        ot[d] = splat(0.0f);
    }
    vfloat top = splat(-INFINITY), total = splat(0.0f), position = {0};
    for (int r = 0; r < LANES; r++)
        position[r] = (float)(first_pos + r);
    int keys = first_pos + rows; /* the last row sees keys 0 .. first_pos + rows - 1 */
    for (int j0 = 0; j0 < keys; j0 += KEYS) {
        const float *k[KEYS], *v[KEYS];
        for (int i = 0; i < KEYS; i++) {
            int j = j0 + i < keys ? j0 + i : j0; /* past the end: any real key, masked out below */
            int64_t at = (int64_t)blocks[j / block_size] * block_stride + (j % block_size) * token_stride;
            if (type == KV_F32) {
                k[i] = (const float *)k_cache + at;
                v[i] = (const float *)v_cache + at;
                continue;
            }
            float *wide_k = wide + i * head_dim, *wide_v = wide + (KEYS + i) * head_dim;
            for (int d = 0; d < head_dim; d += LANES) {
                store(wide_k + d, load_kv(k_cache, at + d, type));
                store(wide_v + d, load_kv(v_cache, at + d, type));
            }
            k[i] = wide_k;
            v[i] = wide_v;
        }
        vfloat s[KEYS];
        for (int i = 0; i < KEYS; i++)
            s[i] = splat(0.0f);
        for (int d = 0; d < head_dim; d++) {
            vfloat q = qt[d];
            for (int i = 0; i < KEYS; i++)
                s[i] += q * splat(k[i][d]);
        }
        vfloat highest = top;
        for (int i = 0; i < KEYS; i++) {
            vint seen = position >= splat((float)(j0 + i)); /* causal: row r sees key j when j <= its position */
            if (j0 + i >= keys)
                seen = (vint){0};
            s[i] = pick(seen, s[i], splat(-INFINITY));
            highest = pick(s[i] > highest, s[i], highest);
        }
        /* Every row sees key 0, so after the first chunk highest is finite; before it, nothing is summed. */
        vfloat shrink = exp_vector(top - highest), sum = splat(0.0f);
        for (int i = 0; i < KEYS; i++) {
            vint seen = s[i] > splat(-INFINITY);
            s[i] = pick(seen, exp_vector(s[i] - highest), splat(0.0f));
            sum += s[i];
        }
        total = total * shrink + sum;
        top = highest;
        for (int d = 0; d < head_dim; d++) {
            vfloat o = ot[d] * shrink;
            for (int i = 0; i < KEYS; i++)
                o += s[i] * splat(v[i][d]);
            ot[d] = o;
        }
    }
    vfloat inverse = splat(1.0f) / total;
    for (int d = 0; d < head_dim; d++) {
        vfloat o = ot[d] * inverse;
        for (int r = 0; r < rows; r++)
            out[r * out_row_stride + d] = o[r];
    }
}

/* query: [tokens][heads * head_dim] rows q_row_stride apart; out: [tokens][heads][head_dim] contiguous.
 * cu_seqlens: [num_seqs + 1] new-token offsets; context_lens: [num_seqs], new tokens included; the caches'
 * strides and block_tables as in decode_attention.c. Returns 0, or -1 if scratch memory ran out. */
static int prefill_attention(const float *query, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                             int64_t block_stride, int64_t token_stride, int64_t head_stride,
                             const int32_t *block_tables, int64_t table_stride, const int32_t *cu_seqlens,
                             const int32_t *context_lens, float *out, int num_seqs, int num_heads, int num_kv_heads,
                             int head_dim, int block_size, float scale, int num_threads, enum kv_type type) {
    int group = num_heads / num_kv_heads, failed = 0;
    int *first_tile = malloc(sizeof(int) * ((size_t)num_seqs + 1)); /* tiles of the sequences before each */
    if (first_tile == NULL)
        return -1;
    first_tile[0] = 0;
    for (int s = 0; s < num_seqs; s++)
        first_tile[s + 1] = first_tile[s] + (cu_seqlens[s + 1] - cu_seqlens[s] + LANES - 1) / LANES;
    int64_t items = (int64_t)first_tile[num_seqs] * num_heads;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* the queries' and outputs' vectors, then room for a chunk of K and V widened to fp32 */
        vfloat *scratch = aligned_alloc(sizeof(vfloat), sizeof(vfloat) * 2 * (size_t)head_dim +
                                                            sizeof(float) * 2 * KEYS * (size_t)head_dim);
        failed = scratch == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = items - 1; item >= 0; item--) { /* the latest tiles, which see the most keys, first */
            if (scratch == NULL)
                continue;
            int tile = (int)(item / num_heads), head = (int)(item % num_heads), seq = 0;
            while (first_tile[seq + 1] <= tile)
                seq++;
            int q_start = cu_seqlens[seq], q_len = cu_seqlens[seq + 1] - q_start;
            int row0 = (tile - first_tile[seq]) * LANES, rows = q_len - row0 < LANES ? q_len - row0 : LANES;
            int first_pos = context_lens[seq] - q_len + row0;
            int64_t token = q_start + row0;
            const int64_t own = (head / group) * head_stride; /* elements into the caches */
            const char *k_head = (const char *)k_cache + own * kv_size(type);
            const char *v_head = (const char *)v_cache + own * kv_size(type);
#define TILE(T)                                                                                                    \
    attend_tile(query + token * q_row_stride + (int64_t)head * head_dim, q_row_stride, rows, first_pos, k_head,      \
                v_head, block_stride, token_stride, block_tables + seq * table_stride, block_size, head_dim, scale, \
                scratch, scratch + head_dim, (float *)(scratch + 2 * head_dim),                                    \
                out + (token * num_heads + head) * head_dim, (int64_t)num_heads * head_dim, T)
            switch (type) { /* each a copy where the type is a constant */
            case KV_F16:
                TILE(KV_F16);
                break;
            case KV_BF16:
                TILE(KV_BF16);
                break;
            default:
                TILE(KV_F32);
            }
#undef TILE
        }
        free(scratch);
    }
    free(first_tile);
    return failed ? -1 : 0;
}

/* The entry points, one per KV element type, all with the arguments above (k_cache and v_cache in that type). */
#define ENTRY(NAME, T)                                                                                              \
    int NAME(const float *query, int64_t q_row_stride, const void *k_cache, const void *v_cache,                    \
             int64_t block_stride, int64_t token_stride, int64_t head_stride, const int32_t *block_tables,          \
             int64_t table_stride, const int32_t *cu_seqlens, const int32_t *context_lens, float *out, int num_seqs, \
             int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int num_threads) {         \
        return prefill_attention(query, q_row_stride, k_cache, v_cache, block_stride, token_stride, head_stride,    \
                                 block_tables, table_stride, cu_seqlens, context_lens, out, num_seqs, num_heads,    \
                                 num_kv_heads, head_dim, block_size, scale, num_threads, T);                       \
    }
ENTRY(kvferry_paged_prefill_attention_f32, KV_F32)
ENTRY(kvferry_paged_prefill_attention_f16, KV_F16)
ENTRY(kvferry_paged_prefill_attention_bf16, KV_BF16)
#undef ENTRY

/* Which element types this build takes, a bit per kv_type: fp16 only where the CPU converts it (vectors.h). */
int kvferry_kv_types(void) { return KV_TYPES; }
