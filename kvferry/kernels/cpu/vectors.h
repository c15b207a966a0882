/* GCC's generic vector types of LANES floats, shared by the CPU kernels: the compiler maps them onto whatever the
 * machine has (-march=native: 16 in one AVX-512 register, 8 in one AVX2 register, 16 in four NEON ones). */
#ifndef KVFERRY_VECTORS_H
#define KVFERRY_VECTORS_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || !defined(__AVX2__)
#define LANES 16
#else
#define LANES 8 /* one AVX2 register: GCC keeps a wider generic vector in memory, and every kernel ran at a fifth */
#endif
typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vfloat load(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vfloat v) { memcpy(p, &v, sizeof v); }

/* Every lane x: x into lane 0, then lane 0 everywhere (one vbroadcastss). `(vfloat){0} + x` cost an addition before
 * the broadcast, which the compiler must keep (it turns -0 into +0): in a GEMM's inner loop, half its speed. */
static inline vfloat splat(float x) {
    vfloat v = {x};
    return __builtin_shuffle(v, (vint){0});
}

/* Lanes of a where mask is set, else of b. */
static inline vfloat pick(vint mask, vfloat a, vfloat b) { return (vfloat)(((vint)a & mask) | ((vint)b & ~mask)); }

/* A tree of halvings, not LANES additions in a row: three or four dependent steps. */
static inline float sum_lanes(vfloat v) {
#if LANES == 16
    v += __builtin_shuffle(v, (vint){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vint){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vint){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vint){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
    v += __builtin_shuffle(v, (vint){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vint){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vint){1, 0, 3, 2, 5, 4, 7, 6});
#endif
    return v[0];
}

/* e^x within a few ulp for x in [-87, 88] (e^-87 is about 1.6e-38, e^88 near float's top), unchecked: x = n ln2 + r
 * with |r| <= ln2/2, e^r by a degree-6 polynomial, 2^n built in the exponent bits. */
static inline vfloat exp_in_range(vfloat x) {
    const vfloat round = splat(12582912.0f); /* 1.5 * 2^23: adding and taking it off rounds to an integer */
    vfloat n = (x * splat(1.44269504088896341f) + round) - round;
    vfloat r = x - n * splat(0.693145751953125f) - n * splat(1.42860682030941723212e-6f);
    vfloat p = splat(1.0f / 720.0f);
    p = p * r + splat(1.0f / 120.0f);
    p = p * r + splat(1.0f / 24.0f);
    p = p * r + splat(1.0f / 6.0f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
    return p * (vfloat)bits;
}

/* exp_in_range of x clamped to [-87, 88]. */
static inline vfloat exp_vector(vfloat x) {
    x = pick(x < splat(-87.0f), splat(-87.0f), x);
    x = pick(x > splat(88.0f), splat(88.0f), x);
    return exp_in_range(x);
}

static inline float exp_one(float x) { return exp_vector(splat(x))[0]; }

/* The KV cache's element types. The attention kernels take K and V as stored and widen them to fp32 on load, so a
 * half-precision cache costs half the memory and half the bytes read; all arithmetic stays fp32. */
enum kv_type { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };
typedef uint16_t vbits16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vuint __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* fp16 needs the CPU's conversion instructions (F16C with AVX2; AVX-512F): elsewhere the kernels refuse fp16 and the
 * PyTorch reference serves it. bf16 is fp32's top half: a shift, on any machine. */
#if (LANES == 16 && defined(__AVX512F__)) || (LANES == 8 && defined(__F16C__))
#include <immintrin.h>
#define KV_HAS_F16 1
#else
#define KV_HAS_F16 0
#endif
#define KV_TYPES ((1 << KV_F32) | (KV_HAS_F16 << KV_F16) | (1 << KV_BF16)) /* a bit per type the kernels read */

static inline size_t kv_size(enum kv_type type) { return type == KV_F32 ? sizeof(float) : sizeof(uint16_t); }

/* LANES elements of a KV cache at element `at` of base, as fp32. Called with a constant type, so it folds to one
 * load (and one conversion). */
static inline __attribute__((always_inline)) vfloat load_kv(const void *base, int64_t at, const enum kv_type type) {
    if (type == KV_F32)
        return load((const float *)base + at);
    vbits16 h;
    memcpy(&h, (const uint16_t *)base + at, sizeof h);
    if (type == KV_BF16)
        return (vfloat)(__builtin_convertvector(h, vuint) << 16);
#if KV_HAS_F16
#if LANES == 16
    return _mm512_cvtph_ps((__m256i)h);
#else
    return _mm256_cvtph_ps((__m128i)h);
#endif
#else
    return splat(0.0f); /* not reached: KV_TYPES has no fp16 here, and the Python side checks it */
#endif
}

/* Store LANES fp32 values into a KV cache at element `at`, rounded to nearest even as PyTorch's conversions round
 * (a cache written by the C kernels and by PyTorch's store_kv holds the same bits; a NaN stays a NaN, its payload
 * perhaps not PyTorch's). */
static inline __attribute__((always_inline)) void store_kv(void *base, int64_t at, vfloat v, const enum kv_type type) {
    if (type == KV_F32) {
        store((float *)base + at, v);
        return;
    }
    vbits16 h = {0};
    if (type == KV_BF16) {
        vuint bits = (vuint)v;
        vuint rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
        vuint quiet = (bits >> 16) | 0x40; /* a NaN stays a NaN: rounding could carry it into infinity */
        h = __builtin_convertvector((vuint)pick(v == v, (vfloat)rounded, (vfloat)quiet), vbits16);
    }
#if KV_HAS_F16
    else {
#if LANES == 16
        h = (vbits16)_mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT);
#else
        h = (vbits16)_mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT);
#endif
    }
#endif
    memcpy((uint16_t *)base + at, &h, sizeof h);
}

#endif
