/* Every decoder layer of one decode step on the CPU, int8, int4 or fp32 weights, in one call.
 *
 * At one to four rows a layer's work is small (a matrix-vector product over each weight, the rest elementwise), so
 * PyTorch's dispatch of each op and each call's Python cost about as much as the work: 30 layers of a dozen calls
 * each. At a batch of 32 they still cost about a fifth of an int8 step (decode_layers.py says which batches come
 * here). Here the same C functions the layer calls one by one from Python (layer_ops.c, small_matmul.c,
 * int4_matmul.c or panel_matmul.c, decode_attention.c) run in the same order on the same values, from one loop: the output is the
 * same bit for bit.
 * They come in as function pointers from their own libraries, each built with its own flags; this file does no
 * arithmetic of its own.
 *
 * The layer is common/model/llama.py's DecoderLayer: norm, q/k/v, RoPE on q and k, the new K/V stored and
 * attended over, o, the skip connection's add with the next norm, gate/up, SiLU·mul, down.
 */
#include <stdint.h>
#include <string.h>

typedef struct { /* a linear layer's buffers: an Int8Linear's (common/model/int8_linear.py), where group_scales is
                  * set an Int4Linear's (int4_linear.py), or, where panels is set, a PackedLinear's (cpu_linear.py) */
    const int8_t *qweight;     /* [n][k], or interleaved (small_matmul.c's weight_at); int4: [n][k / 2] packed */
    const uint16_t *group_scales, *group_mins; /* int4: [n][k / 32] half precision each; NULL otherwise */
    const int32_t *sums;       /* [n]: each weight row's sum */
    const float *scale;        /* [n] */
    const int64_t *outliers;   /* [count] sorted input channels kept in float, or NULL */
    const uint16_t *outlier_rows; /* [count][n] half precision, tiled where interleaved (outlier_at), or NULL */
    const float *bias;         /* [n], or NULL */
    const float *panels;       /* fp32 [ceil(n / width)][k][width], oneDNN's packed weight; NULL for int8 */
    int n, k, count, width, interleaved;
} Weights;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] each */
    Weights qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* this layer's: [blocks][block_size][kv_heads][head_dim] with the strides below, in
                              * the type of the attention entry point the caller chose (decode_attention.c) */
} Layer;

typedef struct { /* the functions the layer runs; their contracts are in their own files */
    void (*add_rms_norm)(const float *, float *, const float *, float *, int, int, float, int);
    void (*rope)(float *, int64_t, int, int, int, const float *, const float *, int);
    void (*silu_mul)(const float *, float *, int, int, int);
    void (*quantize_rows)(const float *, int, int, const int64_t *, int, int8_t *, float *, float *, int);
    void (*matmul_i8)(const int8_t *, int, int, const int8_t *, int, const int32_t *, int, const float *,
                      const float *, const float *, const uint16_t *, int, const float *, float *, int);
    int (*matmul_i4)(const int8_t *, int, int, const uint8_t *, const uint16_t *, const uint16_t *, int, const float *,
                     const float *, const uint16_t *, int, const float *, float *, int);
    void (*matmul_f32)(const float *, int, int, const float *, int, int, const float *, float *, int);
    int (*attention)(const float *, const float *, int64_t, const float *, int64_t, const int64_t *, void *,
                     void *, int64_t, int64_t, int64_t, const int32_t *, int64_t, const int32_t *, float *, int, int,
                     int, int, int, float, int);
} Kernels;

typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, attention_scale;
    int64_t block_stride, token_stride, head_stride; /* the caches' element strides, as decode_attention.c's */
} Shape;

typedef struct { /* room for the largest row count the caller sends */
    float *normed, *qkv, *query, *attended, *projected, *gate_up, *activated, *row_scale, *outlier_values;
    int8_t *quantized;
} Scratch;

/* Returns 0, or -1 when a product found no memory for its scratch. */
static int linear(const Kernels *f, const Weights *w, const float *x, int rows, Scratch *s, float *y,
                  int num_threads) {
    if (w->panels != NULL) {
        f->matmul_f32(x, rows, w->k, w->panels, w->width, w->n, w->bias, y, num_threads);
        return 0;
    }
    f->quantize_rows(x, rows, w->k, w->outliers, w->count, s->quantized, s->row_scale, s->outlier_values,
                     num_threads);
    if (w->group_scales != NULL)
        return f->matmul_i4(s->quantized, rows, w->k, (const uint8_t *)w->qweight, w->group_scales, w->group_mins,
                            w->n, s->row_scale, s->outlier_values, w->outlier_rows, w->count, w->bias, y,
                            num_threads);
    f->matmul_i8(s->quantized, rows, w->k, w->qweight, w->interleaved, w->sums, w->n, s->row_scale, w->scale,
                 s->outlier_values, w->outlier_rows, w->count, w->bias, y, num_threads);
    return 0;
}

/* x [rows][hidden]: the embeddings in, the last layer's MLP output out; residual [rows][hidden]: the residual
 * stream out (llama.py's LlamaModel.forward takes both to its final norm). cos, sin: [rows][head_dim]; slots [rows],
 * block_tables [rows][table_stride], context_lens [rows]: as decode_attention.c takes them. Returns 0, or -1 when
 * attention or a product found no memory for its scratch. */
int kvferry_decode_layers(const Kernels *f, const Shape *shape, const Layer *layers, Scratch *s, float *x,
                          float *residual, int rows, const float *cos, const float *sin, const int64_t *slots,
                          const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                          int num_threads) {
    const int hidden = shape->hidden, head_dim = shape->head_dim;
    const int q_size = shape->num_heads * head_dim, kv_size = shape->num_kv_heads * head_dim;
    const int qkv_width = q_size + 2 * kv_size;
    memcpy(residual, x, sizeof(float) * rows * hidden); /* the first layer's norm has no skip connection before it */
    for (int i = 0; i < shape->num_layers; i++) {
        const Layer *layer = &layers[i];
        f->add_rms_norm(x, i == 0 ? NULL : residual, layer->input_norm, s->normed, rows, hidden, shape->eps,
                        num_threads);
        if (linear(f, &layer->qkv, s->normed, rows, s, s->qkv, num_threads))
            return -1;
        f->rope(s->qkv, qkv_width, rows, shape->num_heads + shape->num_kv_heads, head_dim, cos, sin, num_threads);
        const float *query = s->qkv; /* one row's q is already contiguous; more rows' are gathered */
        if (rows > 1) {
            for (int r = 0; r < rows; r++)
                memcpy(s->query + (int64_t)r * q_size, s->qkv + (int64_t)r * qkv_width, sizeof(float) * q_size);
            query = s->query;
        }
        if (f->attention(query, s->qkv + q_size, qkv_width, s->qkv + q_size + kv_size, qkv_width, slots,
                         layer->k_cache, layer->v_cache, shape->block_stride, shape->token_stride, shape->head_stride,
                         block_tables, table_stride, context_lens, s->attended, rows, shape->num_heads,
                         shape->num_kv_heads, head_dim, shape->block_size, shape->attention_scale, num_threads))
            return -1;
        if (linear(f, &layer->o, s->attended, rows, s, s->projected, num_threads))
            return -1;
        f->add_rms_norm(s->projected, residual, layer->post_norm, s->normed, rows, hidden, shape->eps, num_threads);
        if (linear(f, &layer->gate_up, s->normed, rows, s, s->gate_up, num_threads))
            return -1;
        f->silu_mul(s->gate_up, s->activated, rows, shape->intermediate, num_threads);
        if (linear(f, &layer->down, s->activated, rows, s, x, num_threads))
            return -1;
    }
    return 0;
}
