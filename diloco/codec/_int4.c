/*
 * Fused int4 block quantization kernels for diloco.codec (format: see int4.py).
 *
 * Why C: the torch-ops version makes ~10 passes over memory (abs, amax, div, round,
 * cast, shifts, or, ...) and runs at a few percent of memcpy. Here each block is read
 * once from memory and stays in L1 while its scale is computed and it is quantized and
 * packed.
 *
 * Bit-identity contract: the learner and the shard must dequantize the same bytes to the
 * same float32 values whichever path each runs, and the shard's error feedback must see
 * exactly what a learner will apply. Every value here is produced by the same correctly
 * rounded IEEE single-precision operations as the torch reference in int4.py: x / scale
 * (a true division, as torch does it), round-half-even or floor, float(q) * scale. There
 * is no multiply-add anywhere, so FMA contraction could not change a result; we build
 * with -ffp-contract=off anyway. -ffast-math would break it (ROUND_MAGIC below) and must
 * never be added. Like torch, we assume the default rounding mode and no flush-to-zero.
 *
 * Threads: the work is split into ranges of whole blocks that start on an even element,
 * so no two threads ever write the same byte; the GIL is released for the whole call.
 * pthreads rather than OpenMP: torch ships its own libgomp, and two OpenMP runtimes in
 * one process fight over cores.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__) && !defined(DILOCO_INT4_PORTABLE)
#include <emmintrin.h>
#define HAVE_SSE2_KERNEL 1
#endif

#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "bit-identical results need plain single-precision evaluation (FLT_EVAL_METHOD == 0)"
#endif

/* The per-block sparse loops, compiled twice on x86-64: for AVX2 (chosen at load time on a
 * CPU that has it) and for the baseline. The same IEEE operations either way (no FMA:
 * -ffp-contract=off), so both write the same bits. */
#if defined(__x86_64__) && defined(__has_attribute) && !defined(DILOCO_INT4_PORTABLE) && !defined(DILOCO_NO_CLONES)
#if __has_attribute(target_clones)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef VECTOR_CLONES
#define VECTOR_CLONES
#endif

/* Eight int32 lanes (GCC's vector extension): AVX2 in the AVX2 clones, two SSE2 halves else. */
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* Reading the input both as floats and as their bit patterns; may_alias keeps that legal. */
typedef uint32_t __attribute__((may_alias)) u32_alias;

enum { STATUS_OK = 0, STATUS_NONFINITE = 1, STATUS_SCALE_OVERFLOW = 2 };

/* Below this many elements per thread, starting a thread costs more than it saves. */
#define MIN_ELEMENTS_PER_THREAD ((size_t)1 << 18)
#define MAX_THREADS 64
#define MIRROR_MAX_BLOCK 4096 /* values per mirror block mirror_condense holds on its stack */

/* ---------------------------------------------------------------------------------- */
/* Scalar helpers (once per block).                                                     */

static inline float bits_to_float(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint32_t float_to_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    if (exp == 0) {
        /* Subnormal half: man * 2^-24, exact in float. */
        float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    if (exp == 31) return bits_to_float(sign | 0x7F800000u | (man << 13));
    return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

/* The smallest half >= t, for finite t >= 0 (0x7C00, +inf, when t > 65504). */
static inline uint16_t half_ceil(float t) {
    if (t == 0.0f) return 0;
    if (t > 65504.0f) return 0x7C00u;
    if (t < 6.103515625e-05f) {
        /* Half subnormal range: k * 2^-24 with k = ceil(t * 2^24) <= 1024 (1024 is the
         * bit pattern of the smallest normal half, so the carry is right too). */
        float v = t * 16777216.0f; /* exact: power-of-two scaling, no overflow */
        uint32_t k = (uint32_t)v;
        if ((float)k < v) k += 1;
        return (uint16_t)k;
    }
    uint32_t b = float_to_bits(t);
    uint32_t man = b & 0x7FFFFFu;
    uint32_t h = (((b >> 23) - 112u) << 10) | (man >> 13);
    if (man & 0x1FFFu) h += 1; /* a carry into the exponent is still the next half up */
    return (uint16_t)h;
}

/*
 * The block scale, chosen so that x / scale, as computed in float, lies in [-7, 7] for
 * every element of the block (division is monotonic, so checking absmax is enough).
 * Half: the smallest half with 7 * scale >= absmax; scale * 7 is exact in float (11 + 3
 * significant bits), so the test is exact. Float: round(absmax / 7), one step up if
 * absmax / scale still rounds above 7 (one step always suffices; it also lifts a scale
 * that underflowed to 0 for a subnormal absmax).
 * Returns 0 on success, -1 if a half scale overflows. *bits gets the stored pattern.
 */
static inline int block_scale(float absmax, int scale_size, float *scale, uint32_t *bits) {
    float t = absmax / 7.0f;
    if (scale_size == 2) {
        uint32_t h = half_ceil(t);
        if (h < 0x7C00u && half_to_float((uint16_t)h) * 7.0f < absmax) h += 1;
        if (h >= 0x7C00u) return -1;
        *scale = half_to_float((uint16_t)h);
        *bits = h;
    } else {
        /* t >= 0 and finite, so the next float up is the next bit pattern. */
        if (absmax / t > 7.0f) t = bits_to_float(float_to_bits(t) + 1u);
        *scale = t;
        *bits = float_to_bits(t);
    }
    return 0;
}

static inline void store_scale(unsigned char *scales, size_t block, int scale_size, uint32_t bits) {
    /* Native byte order; the module only loads on little-endian hosts (see int4.py). */
    if (scale_size == 2) {
        uint16_t h = (uint16_t)bits;
        memcpy(scales + block * 2, &h, 2);
    } else {
        memcpy(scales + block * 4, &bits, 4);
    }
}

static inline float load_scale(const unsigned char *scales, size_t block, int scale_size) {
    if (scale_size == 2) {
        uint16_t h;
        memcpy(&h, scales + block * 2, 2);
        return half_to_float(h);
    }
    float f;
    memcpy(&f, scales + block * 4, 4);
    return f;
}

/* ---------------------------------------------------------------------------------- */
/* Per-element loops, portable C. Plain counted loops over restrict pointers with        */
/* branch-free bodies, the shape gcc -O3 auto-vectorises.                                */

static uint32_t abs_max_bits(const float *restrict x, size_t len) {
    /* |x| as bits: for non-negative floats integer order is float order, and NaN/Inf
     * land at >= 0x7F800000, so one integer max both finds absmax and flags non-finite
     * input. Signed compare: SSE2 has it, and the values fit in 31 bits. */
    const u32_alias *restrict xb = (const u32_alias *)x;
    int32_t m = 0;
    for (size_t i = 0; i < len; i++) {
        int32_t v = (int32_t)(xb[i] & 0x7FFFFFFFu);
        m = v > m ? v : m;
    }
    return (uint32_t)m;
}

/* Round to nearest, ties to even, as torch.round does: adding 1.5 * 2^23 pushes the
 * fraction out of the significand in the current (nearest-even) rounding mode. Exact
 * for |y| < 2^22; here |y| <= 7. */
#define ROUND_MAGIC 12582912.0f

static inline uint32_t quant_nearest(float x, float s) {
    /* block_scale guarantees |x / s| <= 7, so no clamp is needed. */
    float r = (x / s + ROUND_MAGIC) - ROUND_MAGIC;
    return (uint32_t)(int32_t)r & 15u;
}

static inline uint32_t quant_stochastic(float x, float s, float u) {
    /* x / s >= -7 and u >= 0 keep the floor >= -7; but x / s = 7 plus u just below 1
     * rounds to 8.0f, hence the clamp. Integer compares keep the loop branch-free
     * (float ones would not be if-converted under the default -ftrapping-math). */
    float y = x / s + u;
    int32_t t = (int32_t)y;      /* truncation toward zero, |y| <= 8 */
    t -= (float)t > y;           /* floor */
    t = t > 7 ? 7 : t;
    return (uint32_t)t & 15u;
}

/* Elements x[0..2*pairs) -> bytes out[0..pairs): even element low nibble, odd high. */
static void pack_nearest(const float *restrict x, size_t pairs, float s, unsigned char *restrict out) {
    for (size_t j = 0; j < pairs; j++) {
        uint32_t lo = quant_nearest(x[2 * j], s);
        uint32_t hi = quant_nearest(x[2 * j + 1], s);
        out[j] = (unsigned char)(lo | (hi << 4));
    }
}

static void pack_stochastic(const float *restrict x, const float *restrict u, size_t pairs, float s,
                            unsigned char *restrict out) {
    for (size_t j = 0; j < pairs; j++) {
        uint32_t lo = quant_stochastic(x[2 * j], s, u[2 * j]);
        uint32_t hi = quant_stochastic(x[2 * j + 1], s, u[2 * j + 1]);
        out[j] = (unsigned char)(lo | (hi << 4));
    }
}

/* ---------------------------------------------------------------------------------- */
/* Range workers: blocks [block_begin, block_end), block_begin * block_size even.       */

typedef struct {
    /* inputs */
    const float *x;
    const float *u; /* NULL: round to nearest */
    size_t n;
    size_t block_size;
    int scale_size;
    size_t block_begin, block_end;
    /* outputs */
    unsigned char *packed;
    unsigned char *scales;
    int status;
    size_t bad_block;
} QuantJob;

static inline uint32_t quant_one(const QuantJob *job, size_t i, float s) {
    return job->u ? quant_stochastic(job->x[i], s, job->u[i]) : quant_nearest(job->x[i], s);
}

#ifdef HAVE_SSE2_KERNEL
/* ---------------------------------------------------------------------------------- */
/* SSE2, the x86-64 baseline (no -march needed). gcc's vectorisation of the portable   */
/* packers reaches about half this speed: it deinterleaves even/odd elements and       */
/* narrows int32 to bytes through long shuffle chains. Here 16 consecutive elements    */
/* are converted, narrowed with saturating packs and paired into nibbles with one      */
/* 16-bit shift. Same IEEE operations, so bit-identical to the portable path: divps is */
/* divss four times, and cvtps2dq rounds half-to-even like ROUND_MAGIC.                */

static inline __m128i quant4_nearest(const float *x, __m128 s) {
    return _mm_cvtps_epi32(_mm_div_ps(_mm_loadu_ps(x), s));
}

static inline __m128i quant4_stochastic(const float *x, const float *u, __m128 s) {
    __m128 y = _mm_add_ps(_mm_div_ps(_mm_loadu_ps(x), s), _mm_loadu_ps(u));
    __m128i t = _mm_cvttps_epi32(y);
    /* floor: subtract 1 (add the all-ones mask) where truncation went up */
    return _mm_add_epi32(t, _mm_castps_si128(_mm_cmpgt_ps(_mm_cvtepi32_ps(t), y)));
}

/*
 * Full blocks [b0, b1) of a block size that is a multiple of 16. Returns 0, or -1 when
 * some block is non-finite or overflows: the caller then redoes the range with the
 * portable code, which names the first bad block (errors are rare; speed there is moot).
 * A NaN is caught late: maxps drops NaN operands, so the absmax of a block holding one
 * may be wrong, but cvt(t)ps2dq turns the NaN into INT_MIN, which the saturating packs
 * keep far below -7.
 */
static inline __attribute__((always_inline)) int quantize_blocks_sse2(const QuantJob *job, size_t b0, size_t b1,
                                                                       const size_t B, const int stochastic) {
    const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF));
    const __m128i seven = _mm_set1_epi16(7), nibble = _mm_set1_epi8(15), low_byte = _mm_set1_epi16(0xFF);
    __m128i lowest = _mm_setzero_si128();
    for (size_t b = b0; b < b1; b++) {
        const float *x = job->x + b * B;
        __m128 m0 = _mm_setzero_ps(), m1 = m0, m2 = m0, m3 = m0;
        for (size_t i = 0; i < B; i += 16) {
            m0 = _mm_max_ps(m0, _mm_and_ps(_mm_loadu_ps(x + i), abs_mask));
            m1 = _mm_max_ps(m1, _mm_and_ps(_mm_loadu_ps(x + i + 4), abs_mask));
            m2 = _mm_max_ps(m2, _mm_and_ps(_mm_loadu_ps(x + i + 8), abs_mask));
            m3 = _mm_max_ps(m3, _mm_and_ps(_mm_loadu_ps(x + i + 12), abs_mask));
        }
        __m128 m = _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3));
        m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
        m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
        float absmax = _mm_cvtss_f32(m), scale;
        uint32_t sbits;
        if (!(absmax <= FLT_MAX) || block_scale(absmax, job->scale_size, &scale, &sbits) != 0) return -1;
        store_scale(job->scales, b, job->scale_size, sbits);
        const __m128 s = _mm_set1_ps(scale == 0.0f ? 1.0f : scale);

        unsigned char *out = job->packed + b * B / 2;
        for (size_t i = 0; i < B; i += 16) {
            __m128i w0, w1;
            if (stochastic) {
                const float *u = job->u + b * B + i;
                w0 = _mm_packs_epi32(quant4_stochastic(x + i, u, s), quant4_stochastic(x + i + 4, u + 4, s));
                w1 = _mm_packs_epi32(quant4_stochastic(x + i + 8, u + 8, s),
                                     quant4_stochastic(x + i + 12, u + 12, s));
                lowest = _mm_min_epi16(lowest, _mm_min_epi16(w0, w1));
                w0 = _mm_min_epi16(w0, seven);
                w1 = _mm_min_epi16(w1, seven);
            } else {
                w0 = _mm_packs_epi32(quant4_nearest(x + i, s), quant4_nearest(x + i + 4, s));
                w1 = _mm_packs_epi32(quant4_nearest(x + i + 8, s), quant4_nearest(x + i + 12, s));
                lowest = _mm_min_epi16(lowest, _mm_min_epi16(w0, w1));
            }
            /* 16 int8 q's; as 16-bit lanes each holds (even q) | (odd q) << 8 */
            __m128i q = _mm_and_si128(_mm_packs_epi16(w0, w1), nibble);
            q = _mm_and_si128(_mm_or_si128(q, _mm_srli_epi16(q, 4)), low_byte);
            _mm_storel_epi64((__m128i *)(out + i / 2), _mm_packus_epi16(q, q));
        }
    }
    return _mm_movemask_epi8(_mm_cmplt_epi16(lowest, _mm_set1_epi16(-8))) ? -1 : 0;
}

/* Instantiated for the default block size so its inner loops unroll completely. */
static int quantize_full_blocks(const QuantJob *job, size_t b0, size_t b1) {
    if (job->block_size == 64)
        return job->u ? quantize_blocks_sse2(job, b0, b1, 64, 1) : quantize_blocks_sse2(job, b0, b1, 64, 0);
    return job->u ? quantize_blocks_sse2(job, b0, b1, job->block_size, 1)
                  : quantize_blocks_sse2(job, b0, b1, job->block_size, 0);
}
#endif /* HAVE_SSE2_KERNEL */

/* One block, any size or alignment, plain C; also the reference for the SSE2 path. */
static int quantize_block(const QuantJob *job, size_t b) {
    const size_t B = job->block_size;
    size_t start = b * B;
    size_t end = start + B < job->n ? start + B : job->n;
    uint32_t mbits = abs_max_bits(job->x + start, end - start);
    if (mbits >= 0x7F800000u) return STATUS_NONFINITE;
    float scale;
    uint32_t sbits;
    if (block_scale(bits_to_float(mbits), job->scale_size, &scale, &sbits) != 0) return STATUS_SCALE_OVERFLOW;
    store_scale(job->scales, b, job->scale_size, sbits);
    /* An all-zero block has scale 0; dividing its zeros by 1 gives q = 0. */
    float s = scale == 0.0f ? 1.0f : scale;

    size_t i = start;
    if (i & 1) {
        /* Odd block size only: this block starts in the high nibble of a byte whose low
         * nibble the previous block (same thread) has just written. */
        job->packed[i >> 1] |= (unsigned char)(quant_one(job, i, s) << 4);
        i++;
    }
    size_t pairs = (end - i) / 2;
    if (job->u)
        pack_stochastic(job->x + i, job->u + i, pairs, s, job->packed + (i >> 1));
    else
        pack_nearest(job->x + i, pairs, s, job->packed + (i >> 1));
    i += 2 * pairs;
    if (i < end) /* odd tail: low nibble; the high one stays zero or the next block fills it */
        job->packed[i >> 1] = (unsigned char)quant_one(job, i, s);
    return STATUS_OK;
}

static void quantize_range(QuantJob *job) {
    size_t b = job->block_begin;
    job->status = STATUS_OK;
#ifdef HAVE_SSE2_KERNEL
    if (job->block_size % 16 == 0) {
        size_t full_end = job->n / job->block_size;
        if (full_end > job->block_end) full_end = job->block_end;
        if (b < full_end) {
            if (quantize_full_blocks(job, b, full_end) == 0)
                b = full_end;
            /* else: fall through and let the plain code find the first bad block */
        }
    }
#endif
    for (; b < job->block_end; b++) {
        int status = quantize_block(job, b);
        if (status != STATUS_OK) {
            job->status = status;
            job->bad_block = b;
            return;
        }
    }
}

/* Two's complement nibble -> value, without relying on signed shifts. */
#define NIBBLE_LO(b) ((int32_t)(((uint32_t)(b) & 15u) ^ 8u) - 8)
#define NIBBLE_HI(b) ((int32_t)(((uint32_t)(b) >> 4) ^ 8u) - 8)

static void unpack(const unsigned char *restrict in, size_t pairs, float s, float *restrict out) {
    for (size_t j = 0; j < pairs; j++) {
        uint32_t b = in[j];
        out[2 * j] = (float)NIBBLE_LO(b) * s;
        out[2 * j + 1] = (float)NIBBLE_HI(b) * s;
    }
}

typedef struct {
    const unsigned char *packed;
    const unsigned char *scales;
    size_t n;
    size_t block_size;
    int scale_size;
    size_t block_begin, block_end;
    float *out;
    /* mode 0: out = q*s; mode 2: sum of (q*s)^2 into sumsq; axpy_block (out += alpha * (q*s))
     * reads alpha and is called block by block by axpy_many */
    int mode;
    float alpha;
    double sumsq;
} DequantJob;

/* out[i] += alpha * (q*s) for one block: the merge accumulates decoded deltas without
 * materialising them (one pass over the int4 bytes instead of decode + add). */
static void axpy_pairs(const unsigned char *restrict in, size_t pairs, float s, float a, float *restrict out) {
    for (size_t j = 0; j < pairs; j++) {
        uint32_t b = in[j];
        out[2 * j] += a * ((float)NIBBLE_LO(b) * s);
        out[2 * j + 1] += a * ((float)NIBBLE_HI(b) * s);
    }
}

static void axpy_block(const DequantJob *job, size_t start, size_t end, float s) {
    const float a = job->alpha;
    size_t i = start;
    if (i & 1) {
        job->out[i] += a * ((float)NIBBLE_HI(job->packed[i >> 1]) * s);
        i++;
    }
    size_t pairs = (end - i) / 2;
    axpy_pairs(job->packed + (i >> 1), pairs, s, a, job->out + i);
    i += 2 * pairs;
    if (i < end) job->out[i] += a * ((float)NIBBLE_LO(job->packed[i >> 1]) * s);
}

static double sumsq_block(const DequantJob *job, size_t start, size_t end, float s) {
    int32_t acc = 0; /* at most 64 * block elements: no overflow for any sane block size */
    size_t i = start;
    if (i & 1) {
        int32_t q = NIBBLE_HI(job->packed[i >> 1]);
        acc += q * q;
        i++;
    }
    size_t pairs = (end - i) / 2;
    const unsigned char *in = job->packed + (i >> 1);
    for (size_t j = 0; j < pairs; j++) {
        int32_t lo = NIBBLE_LO(in[j]), hi = NIBBLE_HI(in[j]);
        acc += lo * lo + hi * hi;
    }
    i += 2 * pairs;
    if (i < end) {
        int32_t q = NIBBLE_LO(job->packed[i >> 1]);
        acc += q * q;
    }
    return (double)acc * (double)s * (double)s;
}

static void dequantize_range(DequantJob *job) {
    const size_t B = job->block_size;
    if (job->mode == 2) {
        for (size_t b = job->block_begin; b < job->block_end; b++) {
            size_t start = b * B;
            size_t end = start + B < job->n ? start + B : job->n;
            job->sumsq += sumsq_block(job, start, end, load_scale(job->scales, b, job->scale_size));
        }
        return;
    }
    for (size_t b = job->block_begin; b < job->block_end; b++) {
        size_t start = b * B;
        size_t end = start + B < job->n ? start + B : job->n;
        float s = load_scale(job->scales, b, job->scale_size);
        size_t i = start;
        if (i & 1) {
            job->out[i] = (float)NIBBLE_HI(job->packed[i >> 1]) * s;
            i++;
        }
        size_t pairs = (end - i) / 2;
        unpack(job->packed + (i >> 1), pairs, s, job->out + i);
        i += 2 * pairs;
        if (i < end) job->out[i] = (float)NIBBLE_LO(job->packed[i >> 1]) * s;
    }
}

/* ---------------------------------------------------------------------------------- */
/* Splitting work over threads.                                                          */

/* Number of ranges and their block bounds; every range starts on an even element. */
static size_t plan_ranges(size_t n, size_t block_size, size_t max_threads, size_t *bounds) {
    size_t blocks = (n + block_size - 1) / block_size;
    size_t threads = n / MIN_ELEMENTS_PER_THREAD;
    if (threads > max_threads) threads = max_threads;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    size_t step = (blocks + threads - 1) / threads;
    if ((block_size & 1) && (step & 1)) step++; /* odd blocks: keep range starts even */
    size_t count = 0;
    for (size_t b = 0; b < blocks; b += step) bounds[count++] = b;
    bounds[count] = blocks;
    return count;
}

typedef void (*range_fn)(void *);

typedef struct {
    range_fn fn;
    void *job;
} ThreadArg;

static void *thread_main(void *arg) {
    ThreadArg *a = (ThreadArg *)arg;
    a->fn(a->job);
    return NULL;
}

/* Runs fn on jobs[0..count) (stride job_size): count - 1 new threads plus this one. If a
 * thread cannot be started its range runs here instead: slower, never wrong. */
static void run_ranges(range_fn fn, void *jobs, size_t job_size, size_t count) {
    pthread_t tids[MAX_THREADS];
    ThreadArg args[MAX_THREADS];
    int started[MAX_THREADS];
    for (size_t t = 1; t < count; t++) {
        args[t] = (ThreadArg){fn, (char *)jobs + t * job_size};
        started[t] = pthread_create(&tids[t], NULL, thread_main, &args[t]) == 0;
    }
    fn(jobs);
    for (size_t t = 1; t < count; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            fn(args[t].job);
    }
}

static void quantize_range_v(void *job) { quantize_range((QuantJob *)job); }
static void dequantize_range_v(void *job) { dequantize_range((DequantJob *)job); }

/* ---------------------------------------------------------------------------------- */
/* Python bindings.                                                                      */

static int check_common(Py_ssize_t n, Py_ssize_t block_size, int scale_size, int threads) {
    if (n < 0 || block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "need numel >= 0 and block_size > 0");
        return -1;
    }
    if (scale_size != 2 && scale_size != 4) {
        PyErr_SetString(PyExc_ValueError, "scale_size must be 2 or 4");
        return -1;
    }
    if (threads < 1) {
        PyErr_SetString(PyExc_ValueError, "threads must be >= 1");
        return -1;
    }
    return 0;
}

static int check_len(const Py_buffer *view, Py_ssize_t expected, const char *what) {
    if (view->len != expected) {
        PyErr_Format(PyExc_ValueError, "%s buffer has %zd bytes, expected %zd", what, view->len, expected);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(quantize_doc,
"quantize(x, numel, block_size, scale_size, u, threads, packed=None, scales=None)\n"
"-> (status, bad_block, payload)\n\n"
"x: float32 buffer of numel elements; u: float32 uniforms in [0, 1) for stochastic\n"
"rounding, or None. With packed/scales None, returns a new bytes payload (packed nibbles\n"
"then scales); otherwise writes into those writable buffers and payload is None.\n"
"status: 0 ok, 1 non-finite input in bad_block, 2 half scale overflow in bad_block.");

static PyObject *py_quantize(PyObject *self, PyObject *args) {
    PyObject *x_obj, *u_obj, *packed_obj = Py_None, *scales_obj = Py_None;
    Py_ssize_t n, block_size;
    int scale_size, threads;
    if (!PyArg_ParseTuple(args, "OnniOi|OO", &x_obj, &n, &block_size, &scale_size, &u_obj, &threads,
                          &packed_obj, &scales_obj))
        return NULL;
    if (check_common(n, block_size, scale_size, threads) < 0) return NULL;
    if ((packed_obj == Py_None) != (scales_obj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "pass both packed and scales, or neither");
        return NULL;
    }
    size_t blocks = ((size_t)n + (size_t)block_size - 1) / (size_t)block_size;
    Py_ssize_t packed_len = (n + 1) / 2, scales_len = (Py_ssize_t)blocks * scale_size;

    Py_buffer xv = {0}, uv = {0}, pv = {0}, sv = {0};
    PyObject *payload = NULL, *result = NULL;
    if (PyObject_GetBuffer(x_obj, &xv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (check_len(&xv, n * 4, "x") < 0) goto done;
    if (u_obj != Py_None) {
        if (PyObject_GetBuffer(u_obj, &uv, PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (check_len(&uv, n * 4, "u") < 0) goto done;
    }
    unsigned char *packed, *scales;
    if (packed_obj == Py_None) {
        payload = PyBytes_FromStringAndSize(NULL, packed_len + scales_len);
        if (!payload) goto done;
        packed = (unsigned char *)PyBytes_AS_STRING(payload);
        scales = packed + packed_len;
    } else {
        if (PyObject_GetBuffer(packed_obj, &pv, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
        if (check_len(&pv, packed_len, "packed") < 0) goto done;
        if (PyObject_GetBuffer(scales_obj, &sv, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
        if (check_len(&sv, scales_len, "scales") < 0) goto done;
        packed = (unsigned char *)pv.buf;
        scales = (unsigned char *)sv.buf;
    }

    int status = STATUS_OK;
    size_t bad_block = 0;
    if (n > 0) {
        size_t bounds[MAX_THREADS + 1];
        size_t count = plan_ranges((size_t)n, (size_t)block_size, (size_t)threads, bounds);
        QuantJob jobs[MAX_THREADS];
        for (size_t t = 0; t < count; t++) {
            jobs[t] = (QuantJob){
                .x = (const float *)xv.buf,
                .u = uv.buf ? (const float *)uv.buf : NULL,
                .n = (size_t)n,
                .block_size = (size_t)block_size,
                .scale_size = scale_size,
                .block_begin = bounds[t],
                .block_end = bounds[t + 1],
                .packed = packed,
                .scales = scales,
            };
        }
        Py_BEGIN_ALLOW_THREADS
        run_ranges(quantize_range_v, jobs, sizeof(QuantJob), count);
        Py_END_ALLOW_THREADS
        /* Ranges are in block order: the first failing one has the earliest bad block. */
        for (size_t t = 0; t < count; t++) {
            if (jobs[t].status != STATUS_OK) {
                status = jobs[t].status;
                bad_block = jobs[t].bad_block;
                break;
            }
        }
    }
    if (status != STATUS_OK) Py_CLEAR(payload);
    result = Py_BuildValue("inO", status, (Py_ssize_t)bad_block, payload ? payload : Py_None);

done:
    Py_XDECREF(payload);
    if (xv.obj) PyBuffer_Release(&xv);
    if (uv.obj) PyBuffer_Release(&uv);
    if (pv.obj) PyBuffer_Release(&pv);
    if (sv.obj) PyBuffer_Release(&sv);
    return result;
}

PyDoc_STRVAR(dequantize_doc,
"dequantize(packed, scales, numel, block_size, scale_size, out, threads) -> None\n\n"
"Writes numel float32 values float(q) * scale into the writable buffer out. The caller\n"
"has already checked that every scale is finite and non-negative.");

/* Shared by dequantize (mode 0) and sumsq (mode 2, out is None). */
static PyObject *dequantize_mode(PyObject *packed_obj, PyObject *scales_obj, Py_ssize_t n, Py_ssize_t block_size,
                                 int scale_size, PyObject *out_obj, int threads, int mode, float alpha);

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    PyObject *packed_obj, *scales_obj, *out_obj;
    Py_ssize_t n, block_size;
    int scale_size, threads;
    if (!PyArg_ParseTuple(args, "OOnniOi", &packed_obj, &scales_obj, &n, &block_size, &scale_size, &out_obj,
                          &threads))
        return NULL;
    return dequantize_mode(packed_obj, scales_obj, n, block_size, scale_size, out_obj, threads, 0, 0.0f);
}

PyDoc_STRVAR(sumsq_doc,
"sumsq(packed, scales, numel, block_size, scale_size, threads) -> float\n\n"
"Sum of (float(q) * scale)^2 in double precision: the squared norm of the decoded tensor.");

static PyObject *py_sumsq(PyObject *self, PyObject *args) {
    PyObject *packed_obj, *scales_obj;
    Py_ssize_t n, block_size;
    int scale_size, threads;
    if (!PyArg_ParseTuple(args, "OOnnii", &packed_obj, &scales_obj, &n, &block_size, &scale_size, &threads))
        return NULL;
    return dequantize_mode(packed_obj, scales_obj, n, block_size, scale_size, NULL, threads, 2, 0.0f);
}

static PyObject *dequantize_mode(PyObject *packed_obj, PyObject *scales_obj, Py_ssize_t n, Py_ssize_t block_size,
                                 int scale_size, PyObject *out_obj, int threads, int mode, float alpha) {
    if (check_common(n, block_size, scale_size, threads) < 0) return NULL;
    size_t blocks = ((size_t)n + (size_t)block_size - 1) / (size_t)block_size;

    Py_buffer pv = {0}, sv = {0}, ov = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(packed_obj, &pv, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (check_len(&pv, (n + 1) / 2, "packed") < 0) goto done;
    if (PyObject_GetBuffer(scales_obj, &sv, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (check_len(&sv, (Py_ssize_t)blocks * scale_size, "scales") < 0) goto done;
    if (out_obj != NULL) {
        if (PyObject_GetBuffer(out_obj, &ov, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
        if (check_len(&ov, n * 4, "out") < 0) goto done;
    }
    double total = 0.0;

    if (n > 0) {
        size_t bounds[MAX_THREADS + 1];
        size_t count = plan_ranges((size_t)n, (size_t)block_size, (size_t)threads, bounds);
        DequantJob jobs[MAX_THREADS];
        for (size_t t = 0; t < count; t++) {
            jobs[t] = (DequantJob){
                .packed = (const unsigned char *)pv.buf,
                .scales = (const unsigned char *)sv.buf,
                .n = (size_t)n,
                .block_size = (size_t)block_size,
                .scale_size = scale_size,
                .block_begin = bounds[t],
                .block_end = bounds[t + 1],
                .out = (float *)ov.buf,
                .mode = mode,
                .alpha = alpha,
                .sumsq = 0.0,
            };
        }
        Py_BEGIN_ALLOW_THREADS
        run_ranges(dequantize_range_v, jobs, sizeof(DequantJob), count);
        Py_END_ALLOW_THREADS
        for (size_t t = 0; t < count; t++) total += jobs[t].sumsq;
    }
    result = mode == 2 ? PyFloat_FromDouble(total) : Py_NewRef(Py_None);

done:
    if (pv.obj) PyBuffer_Release(&pv);
    if (sv.obj) PyBuffer_Release(&sv);
    if (ov.obj) PyBuffer_Release(&ov);
    return result;
}

/* ---------------------------------------------------------------------------------- */
/* Many inputs at once: out += sum_k alpha_k * dequant(q_k). Each output block stays in L1
 * while every input adds into it, so memory traffic is one read+write of out plus one
 * read of each (8x smaller) int4 input, instead of one read+write of out per input. */

#define MAX_INPUTS 1024

typedef struct {
    const unsigned char **packed;
    const unsigned char **scales;
    const float *alphas;
    size_t inputs;
    size_t n;
    size_t block_size;
    int scale_size;
    size_t block_begin, block_end;
    float *out;
    int overwrite; /* out = sum instead of out += sum */
    double sumsq;  /* of the resulting out over this range */
} ManyJob;

#define MANY_CHUNK 256 /* elements summed in registers/L1 before touching out */

/* acc[0..len) += f * q for the nibbles of in (len even; element 2j in the low nibble). */
static inline void madd_nibbles(const unsigned char *restrict in, size_t len, float f, float *restrict acc) {
    size_t i = 0;
#ifdef HAVE_SSE2_KERNEL
    const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128 vf = _mm_set1_ps(f);
    for (; i + 32 <= len; i += 32) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(in + i / 2));
        __m128i lo = _mm_sub_epi8(_mm_xor_si128(_mm_and_si128(bytes, mask), eight), eight);
        __m128i hi = _mm_sub_epi8(_mm_xor_si128(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), eight), eight);
        __m128i halves[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)}; /* elements in order */
        for (int h = 0; h < 2; h++) {
            __m128i w0 = _mm_srai_epi16(_mm_unpacklo_epi8(halves[h], halves[h]), 8);
            __m128i w1 = _mm_srai_epi16(_mm_unpackhi_epi8(halves[h], halves[h]), 8);
            __m128i d[4] = {
                _mm_srai_epi32(_mm_unpacklo_epi16(w0, w0), 16), _mm_srai_epi32(_mm_unpackhi_epi16(w0, w0), 16),
                _mm_srai_epi32(_mm_unpacklo_epi16(w1, w1), 16), _mm_srai_epi32(_mm_unpackhi_epi16(w1, w1), 16),
            };
            float *a = acc + i + 16 * h;
            for (int q = 0; q < 4; q++)
                _mm_storeu_ps(a + 4 * q, _mm_add_ps(_mm_loadu_ps(a + 4 * q), _mm_mul_ps(_mm_cvtepi32_ps(d[q]), vf)));
        }
    }
#endif
    for (; i < len; i += 2) {
        uint32_t b = in[i / 2];
        acc[i] += (float)NIBBLE_LO(b) * f;
        acc[i + 1] += (float)NIBBLE_HI(b) * f;
    }
}

static void axpy_many_range(void *arg) {
    ManyJob *job = (ManyJob *)arg;
    const size_t B = job->block_size;
    float acc[MANY_CHUNK];
    for (size_t b = job->block_begin; b < job->block_end; b++) {
        size_t start = b * B;
        size_t end = start + B < job->n ? start + B : job->n;
        if ((start & 1) == 0) {
            /* Even start: unpack each input's chunk with its folded factor alpha*scale
             * (the merge needs no bit-exactness), sum in acc, add to out once. */
            for (size_t c0 = start; c0 < end; c0 += MANY_CHUNK) {
                size_t len = end - c0 < MANY_CHUNK ? end - c0 : MANY_CHUNK;
                size_t pairs = len / 2;
                for (size_t i = 0; i < len; i++) acc[i] = 0.0f;
                for (size_t k = 0; k < job->inputs; k++) {
                    float f = job->alphas[k] * load_scale(job->scales[k], b, job->scale_size);
                    const unsigned char *in = job->packed[k] + (c0 >> 1);
                    madd_nibbles(in, 2 * pairs, f, acc);
                    if (len & 1) acc[len - 1] += (float)NIBBLE_LO(in[pairs]) * f;
                }
                float *out = job->out + c0;
                double ss = 0.0;
                if (job->overwrite)
                    for (size_t i = 0; i < len; i++) out[i] = acc[i];
                else
                    for (size_t i = 0; i < len; i++) out[i] += acc[i];
                for (size_t i = 0; i < len; i++) ss += (double)out[i] * (double)out[i];
                job->sumsq += ss;
            }
            continue;
        }
        if (job->overwrite)
            for (size_t i = start; i < end; i++) job->out[i] = 0.0f;
        for (size_t k = 0; k < job->inputs; k++) {
            DequantJob one = {
                .packed = job->packed[k], .scales = job->scales[k], .n = job->n, .block_size = B,
                .scale_size = job->scale_size, .out = job->out, .alpha = job->alphas[k],
            };
            axpy_block(&one, start, end, load_scale(job->scales[k], b, job->scale_size));
        }
        for (size_t i = start; i < end; i++) job->sumsq += (double)job->out[i] * (double)job->out[i];
    }
}

PyDoc_STRVAR(axpy_many_doc,
"axpy_many(packed_list, scales_list, alphas, numel, block_size, scale_size, out, threads, overwrite)\n"
"    -> float\n\n"
"out (+)= sum_k alphas[k] * (float(q_k) * scale_k) in one pass over out; returns the\n"
"squared norm of the resulting out.");

static PyObject *py_axpy_many(PyObject *self, PyObject *args) {
    PyObject *packed_seq, *scales_seq, *alpha_seq, *out_obj;
    Py_ssize_t n, block_size;
    int scale_size, threads;
    int overwrite;
    if (!PyArg_ParseTuple(args, "OOOnniOip", &packed_seq, &scales_seq, &alpha_seq, &n, &block_size, &scale_size,
                          &out_obj, &threads, &overwrite))
        return NULL;
    if (check_common(n, block_size, scale_size, threads) < 0) return NULL;
    PyObject *pf = PySequence_Fast(packed_seq, "packed_list must be a sequence");
    PyObject *sf = pf ? PySequence_Fast(scales_seq, "scales_list must be a sequence") : NULL;
    PyObject *af = sf ? PySequence_Fast(alpha_seq, "alphas must be a sequence") : NULL;
    Py_ssize_t k = af ? PySequence_Fast_GET_SIZE(pf) : 0;
    PyObject *result = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t got = 0;
    Py_buffer ov = {0};
    const unsigned char **packed = NULL, **scales = NULL;
    float *alphas = NULL;
    double total = 0.0;
    if (!af) goto done;
    if (PySequence_Fast_GET_SIZE(sf) != k || PySequence_Fast_GET_SIZE(af) != k || k > MAX_INPUTS) {
        PyErr_SetString(PyExc_ValueError, "packed_list, scales_list and alphas must have the same length (<= 1024)");
        goto done;
    }
    size_t blocks = ((size_t)n + (size_t)block_size - 1) / (size_t)block_size;
    views = PyMem_Calloc((size_t)(2 * k + 1), sizeof(Py_buffer));
    packed = PyMem_Calloc((size_t)k + 1, sizeof(*packed));
    scales = PyMem_Calloc((size_t)k + 1, sizeof(*scales));
    alphas = PyMem_Calloc((size_t)k + 1, sizeof(*alphas));
    if (!views || !packed || !scales || !alphas) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(pf, i), &views[got], PyBUF_C_CONTIGUOUS) < 0) goto done;
        got++;
        if (check_len(&views[got - 1], (n + 1) / 2, "packed") < 0) goto done;
        packed[i] = (const unsigned char *)views[got - 1].buf;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(sf, i), &views[got], PyBUF_C_CONTIGUOUS) < 0) goto done;
        got++;
        if (check_len(&views[got - 1], (Py_ssize_t)blocks * scale_size, "scales") < 0) goto done;
        scales[i] = (const unsigned char *)views[got - 1].buf;
        double a = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(af, i));
        if (a == -1.0 && PyErr_Occurred()) goto done;
        alphas[i] = (float)a;
    }
    if (PyObject_GetBuffer(out_obj, &ov, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    if (check_len(&ov, n * 4, "out") < 0) goto done;
    if (n > 0 && k > 0) {
        size_t bounds[MAX_THREADS + 1];
        size_t count = plan_ranges((size_t)n, (size_t)block_size, (size_t)threads, bounds);
        ManyJob jobs[MAX_THREADS];
        for (size_t t = 0; t < count; t++) {
            jobs[t] = (ManyJob){
                .packed = packed, .scales = scales, .alphas = alphas, .inputs = (size_t)k, .n = (size_t)n,
                .block_size = (size_t)block_size, .scale_size = scale_size,
                .block_begin = bounds[t], .block_end = bounds[t + 1], .out = (float *)ov.buf,
                .overwrite = overwrite, .sumsq = 0.0,
            };
        }
        Py_BEGIN_ALLOW_THREADS
        run_ranges(axpy_many_range, jobs, sizeof(ManyJob), count);
        Py_END_ALLOW_THREADS
        for (size_t t = 0; t < count; t++) total += jobs[t].sumsq;
    } else if (n > 0 && overwrite) {
        memset(ov.buf, 0, (size_t)n * 4);
    }
    result = PyFloat_FromDouble(total);

done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    if (ov.obj) PyBuffer_Release(&ov);
    PyMem_Free(views);
    PyMem_Free(packed);
    PyMem_Free(scales);
    PyMem_Free(alphas);
    Py_XDECREF(pf);
    Py_XDECREF(sf);
    Py_XDECREF(af);
    return result;
}

/* ---------------------------------------------------------------------------------- */
/* The shard's outer step, fused, block by block (one pass over four fp32 arrays):      */
/*   d = c*delta; m = decay*m + d; step = lr*(d + look*m); u = r - step;               */
/*   q = int4(u) (exactly as quantize); a = float(q)*scale (exactly as dequantize);     */
/*   r = u - a; p += a.                                                                  */

#define OUTER_MAX_BLOCK 1024

typedef struct {
    const float *delta;
    float *momentum, *residual, *params;
    unsigned char *packed, *scales;
    size_t n, block_size;
    int scale_size;
    float c, lr, decay, look;
    size_t block_begin, block_end;
    int status;
} OuterJob;

static void outer_range(void *arg) {
    OuterJob *job = (OuterJob *)arg;
    const size_t B = job->block_size;
    float u[OUTER_MAX_BLOCK];
    job->status = STATUS_OK;
    for (size_t b = job->block_begin; b < job->block_end; b++) {
        size_t start = b * B;
        size_t len = (start + B < job->n ? start + B : job->n) - start;
        const float *d = job->delta + start;
        float *m = job->momentum + start, *r = job->residual + start, *p = job->params + start;
        for (size_t i = 0; i < len; i++) {
            float di = job->c * d[i];
            float mi = job->decay * m[i] + di;
            m[i] = mi;
            u[i] = r[i] - job->lr * (di + job->look * mi);
        }
        QuantJob q = {.x = u, .u = NULL, .n = len, .block_size = B, .scale_size = job->scale_size,
                      .packed = job->packed + start / 2, .scales = job->scales + b * (size_t)job->scale_size};
        int status = quantize_block(&q, 0);
        if (status != STATUS_OK) {
            job->status = status;
            return;
        }
        float sc = load_scale(job->scales, b, job->scale_size);
        const unsigned char *in = job->packed + start / 2;
        for (size_t j = 0; j < len / 2; j++) {
            float a0 = (float)NIBBLE_LO(in[j]) * sc, a1 = (float)NIBBLE_HI(in[j]) * sc;
            r[2 * j] = u[2 * j] - a0;
            r[2 * j + 1] = u[2 * j + 1] - a1;
            p[2 * j] += a0;
            p[2 * j + 1] += a1;
        }
        if (len & 1) {
            float a = (float)NIBBLE_LO(in[len / 2]) * sc;
            r[len - 1] = u[len - 1] - a;
            p[len - 1] += a;
        }
    }
}

PyDoc_STRVAR(outer_doc,
"outer_step(delta, momentum, residual, params, packed, scales, numel, block_size, scale_size, c, lr, decay,\n"
"           look, threads) -> int status\n\n"
"The fused outer step with int4 error feedback (see the comment in _int4.c): momentum <-\n"
"decay * momentum + c * delta; the step lr * (c * delta + look * momentum). Nesterov is\n"
"decay = look = mu; a delayed Nesterov round between two momentum steps decay 1, look 0. Even\n"
"block_size <= 1024. Status 0 on success, else the quantize status of the first bad block.");

static PyObject *py_outer_step(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    Py_ssize_t n, block_size;
    int scale_size, threads;
    float c, lr, decay, look;
    if (!PyArg_ParseTuple(args, "OOOOOOnniffffi", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &n,
                          &block_size, &scale_size, &c, &lr, &decay, &look, &threads))
        return NULL;
    if (check_common(n, block_size, scale_size, threads) < 0) return NULL;
    if (block_size > OUTER_MAX_BLOCK || (block_size & 1)) {
        PyErr_SetString(PyExc_ValueError, "outer_step needs an even block_size <= 1024");
        return NULL;
    }
    size_t blocks = ((size_t)n + (size_t)block_size - 1) / (size_t)block_size;
    Py_buffer v[6] = {{0}};
    const Py_ssize_t lens[6] = {n * 4, n * 4, n * 4, n * 4, (n + 1) / 2, (Py_ssize_t)blocks * scale_size};
    const char *names[6] = {"delta", "momentum", "residual", "params", "packed", "scales"};
    PyObject *result = NULL;
    int got = 0;
    for (; got < 6; got++) {
        int flags = PyBUF_C_CONTIGUOUS | (got == 0 ? 0 : PyBUF_WRITABLE);
        if (PyObject_GetBuffer(objs[got], &v[got], flags) < 0) goto done;
        if (check_len(&v[got], lens[got], names[got]) < 0) {
            got++;
            goto done;
        }
    }
    int status = STATUS_OK;
    if (n > 0) {
        size_t bounds[MAX_THREADS + 1];
        size_t count = plan_ranges((size_t)n, (size_t)block_size, (size_t)threads, bounds);
        OuterJob jobs[MAX_THREADS];
        for (size_t t = 0; t < count; t++) {
            jobs[t] = (OuterJob){
                .delta = (const float *)v[0].buf, .momentum = (float *)v[1].buf, .residual = (float *)v[2].buf,
                .params = (float *)v[3].buf, .packed = (unsigned char *)v[4].buf, .scales = (unsigned char *)v[5].buf,
                .n = (size_t)n, .block_size = (size_t)block_size, .scale_size = scale_size,
                .c = c, .lr = lr, .decay = decay, .look = look, .block_begin = bounds[t], .block_end = bounds[t + 1],
            };
        }
        Py_BEGIN_ALLOW_THREADS
        run_ranges(outer_range, jobs, sizeof(OuterJob), count);
        Py_END_ALLOW_THREADS
        for (size_t t = 0; t < count; t++)
            if (jobs[t].status != STATUS_OK) status = jobs[t].status;
    }
    result = PyLong_FromLong(status);

done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* ---------------------------------------------------------------------------------- */
/* A shard's mirrors of learners' anchors (diloco/syncer/core/mirrors.py): an int8 difference
 * from a shared float32 base, blocks of `block` values with a float32 scale. Each call is
 * one pass over its arrays; the numpy fallback in mirrors.py computes the same float32
 * operations in the same order (x = anchor - base; scale = absmax / 127; inverse =
 * 1 / scale; q = rint(x * inverse); value = base + float(q) * scale), bit for bit. */

VECTOR_CLONES
static double mirror_store_blocks(const float *anchor, const float *base, int8_t *codes, float *scales, Py_ssize_t n,
                                  Py_ssize_t block) {
    double lost = 0.0;
    for (Py_ssize_t b = 0, blocks = (n + block - 1) / block; b < blocks; b++) {
        Py_ssize_t lo = b * block, hi = lo + block < n ? lo + block : n;
        float absmax = 0.0f;
        for (Py_ssize_t i = lo; i < hi; i++) {
            float x = fabsf(anchor[i] - base[i]);
            absmax = x > absmax ? x : absmax;
        }
        float scale = absmax / 127.0f;
        float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        /* |q| <= 127 (the inverse of absmax / 127), so ROUND_MAGIC rounds half to even
         * exactly as rint does, without a libm call per value. */
        for (Py_ssize_t i = lo; i < hi; i++)
            codes[i] = (int8_t)(int32_t)(((anchor[i] - base[i]) * inverse + ROUND_MAGIC) - ROUND_MAGIC);
        scales[b] = scale;
        lost += (double)scale * (double)scale * (double)(hi - lo) / 12.0;
    }
    return lost;
}

VECTOR_CLONES
static void mirror_load_blocks(const int8_t *codes, const float *scales, const float *base, float *out, Py_ssize_t n,
                               Py_ssize_t block) {
    for (Py_ssize_t b = 0, blocks = (n + block - 1) / block; b < blocks; b++) {
        Py_ssize_t lo = b * block, hi = lo + block < n ? lo + block : n;
        float scale = scales[b];
        for (Py_ssize_t i = lo; i < hi; i++) out[i] = base[i] + (float)codes[i] * scale;
    }
}

PyDoc_STRVAR(mirror_store_doc,
"mirror_store(anchor, base, codes, scales, n, block) -> float\n\n"
"codes, scales <- the int8 blocks of anchor - base (float32 [n] each; codes int8 [n],\n"
"scales float32 [ceil(n / block)]). Returns the expected squared norm of the rounding:\n"
"sum of scale^2 * (values in the block) / 12.");

static PyObject *py_mirror_store(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    Py_ssize_t n, block;
    if (!PyArg_ParseTuple(args, "OOOOnn", &objs[0], &objs[1], &objs[2], &objs[3], &n, &block)) return NULL;
    if (n < 0 || block <= 0) {
        PyErr_SetString(PyExc_ValueError, "mirror_store needs n >= 0 and block > 0");
        return NULL;
    }
    Py_ssize_t blocks = (n + block - 1) / block;
    Py_buffer v[4] = {{0}};
    const Py_ssize_t lens[4] = {n * 4, n * 4, n, blocks * 4};
    const char *names[4] = {"anchor", "base", "codes", "scales"};
    PyObject *result = NULL;
    int got = 0;
    for (; got < 4; got++) {
        int flags = PyBUF_C_CONTIGUOUS | (got < 2 ? 0 : PyBUF_WRITABLE);
        if (PyObject_GetBuffer(objs[got], &v[got], flags) < 0) goto done;
        if (check_len(&v[got], lens[got], names[got]) < 0) {
            got++;
            goto done;
        }
    }
    double lost = 0.0;
    Py_BEGIN_ALLOW_THREADS
    lost = mirror_store_blocks((const float *)v[0].buf, (const float *)v[1].buf, (int8_t *)v[2].buf,
                               (float *)v[3].buf, n, block);
    Py_END_ALLOW_THREADS
    result = PyFloat_FromDouble(lost);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return result;
}

PyDoc_STRVAR(mirror_load_doc,
"mirror_load(codes, scales, base, out, n, block) -> None\n\n"
"out <- base + float(codes) * scale, block by block (float32 [n]).");

static PyObject *py_mirror_load(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    Py_ssize_t n, block;
    if (!PyArg_ParseTuple(args, "OOOOnn", &objs[0], &objs[1], &objs[2], &objs[3], &n, &block)) return NULL;
    if (n < 0 || block <= 0) {
        PyErr_SetString(PyExc_ValueError, "mirror_load needs n >= 0 and block > 0");
        return NULL;
    }
    Py_ssize_t blocks = (n + block - 1) / block;
    Py_buffer v[4] = {{0}};
    const Py_ssize_t lens[4] = {n, blocks * 4, n * 4, n * 4};
    const char *names[4] = {"codes", "scales", "base", "out"};
    PyObject *result = NULL;
    int got = 0;
    for (; got < 4; got++) {
        int flags = PyBUF_C_CONTIGUOUS | (got < 3 ? 0 : PyBUF_WRITABLE);
        if (PyObject_GetBuffer(objs[got], &v[got], flags) < 0) goto done;
        if (check_len(&v[got], lens[got], names[got]) < 0) {
            got++;
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    mirror_load_blocks((const int8_t *)v[0].buf, (const float *)v[1].buf, (const float *)v[2].buf,
                       (float *)v[3].buf, n, block);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* ---------------------------------------------------------------------------------- */
/* Sparse 2-bit blocks (format and contract: diloco/codec/sparse.py). Each block keeps  */
/* its `kept` largest |x| (ties to the lower index), each as a code c in 0..3 standing   */
/* for (c - 1.5) * scale; the scale is the smallest half (or float) with 1.5 * scale >=  */
/* the block's largest |x|. The same float32 operations as the numpy reference: one     */
/* true division, one add, floor; decoding one subtract (exact) and one multiply.       */

typedef struct {
    const float *x;
    size_t n, block_size, kept;
    int scale_size;
    size_t block_begin, block_end;
    unsigned char *indices; /* NULL: every value kept (dense), no indices */
    unsigned char *codes, *scales;
    int status;
    size_t bad_block;
} SparseJob;

/* The value at position k (0-based) of a[0..n) sorted in descending order; reorders a. */
static uint32_t kth_largest(uint32_t *a, long n, long k) {
    long lo = 0, hi = n - 1;
    while (lo < hi) {
        uint32_t pivot = a[lo + (hi - lo) / 2];
        long i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                uint32_t t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            return a[k];
    }
    return a[lo];
}

static inline int sparse_scale(float amax, int scale_size, float *scale, uint32_t *bits) {
    float t = amax / 1.5f;
    if (scale_size == 2) {
        uint32_t h = half_ceil(t);
        if (h < 0x7C00u && half_to_float((uint16_t)h) * 1.5f < amax) h += 1;
        if (h >= 0x7C00u) return -1;
        *scale = half_to_float((uint16_t)h);
        *bits = h;
    } else {
        if (t * 1.5f < amax) t = bits_to_float(float_to_bits(t) + 1u);
        *scale = t;
        *bits = float_to_bits(t);
    }
    return 0;
}

/* floor(x / scale + 2) clipped to 0..3, as numpy computes it: clipped to [0, 3] first, the
 * conversion then truncates, which is floor for the non-negative values it is given (no
 * libm call, and the loops over it vectorise: one true division per value). A zero scale
 * (every value of the block is 0) codes every value 2 (+0.5 x 0). */
static inline unsigned char sparse_code(float x, float scale) {
    float q = x / scale + 2.0f;
    q = q < 0.0f ? 0.0f : q;
    q = q > 3.0f ? 3.0f : q;
    return (unsigned char)(int)q;
}

/* The positions i < len (len <= 256) whose flag[i] is 1 (each flag 0 or 1, the flags
 * padded with 0 to a multiple of 64) as a bitmask, 64 positions to a word; returns how
 * many are set. The multiply gathers the low bit of each of 8 bytes into the top byte. */
static inline size_t flag_mask(const unsigned char *flag, size_t len, uint64_t mask[4]) {
    size_t set = 0;
    for (size_t w = 0; w < 4; w++) {
        uint64_t word = 0;
        if (64 * w < len)
            for (size_t c = 0; c < 8; c++) {
                uint64_t bytes;
                memcpy(&bytes, flag + 64 * w + 8 * c, 8);
                word |= ((bytes * 0x0102040810204080ull) >> 56) << (8 * c);
            }
        mask[w] = word;
        set += (size_t)__builtin_popcountll(word);
    }
    return set;
}

/* One block of `len` values, of which the `k` largest |x| are kept (ties to the lower
 * index): its scale (`*scale`, stored pattern `*bits`), the kept values' in-block
 * positions in ascending order (`where`, unless every value is kept: then position j is
 * j and `where` is not written) and their codes (`code`). `*ratio` carries the previous
 * block's threshold over its mean |x|, the next block's first guess. Returns a STATUS. */
VECTOR_CLONES
static int sparse_block(const float *x, size_t len, size_t k, int scale_size, float *ratio, float *scale,
                        uint32_t *bits, unsigned char *where, unsigned char *code) {
    uint32_t keys[256];
    unsigned char flag[256];
    uint32_t top = 0;
    for (size_t i = 0; i < len; i++) {
        keys[i] = ((const u32_alias *)x)[i] & 0x7FFFFFFFu;
        top = keys[i] > top ? keys[i] : top;
    }
    if (top >= 0x7F800000u) return STATUS_NONFINITE; /* a NaN or an infinity: the largest key says so */
    if (sparse_scale(bits_to_float(top), scale_size, scale, bits) < 0) return STATUS_SCALE_OVERFLOW;
    float s = *scale;
    if (k >= len) {
        if (s > 0.0f)
            for (size_t i = 0; i < len; i++) code[i] = sparse_code(x[i], s);
        else
            memset(code, 2, len);
        return STATUS_OK;
    }
    size_t padded = (len + 63) & ~(size_t)63;
    for (size_t i = len; i < padded; i++) keys[i] = 0, flag[i] = 0;
    /* The k-th largest key (the threshold) is searched for among the candidates, the keys
     * at or above a guess: 0.9 x the previous block's threshold as a multiple of its mean
     * |x| (steadier from block to block than the largest |x|), then 0.8 x that, then 0
     * (every key), until at least k keys are at or above it. A few dozen candidates rather
     * than the whole block; the guess changes only the work, never the result, as every key
     * below it is below the threshold. */
    float lane[8] = {0};
    for (size_t i = 0; i < padded; i += 8)
        for (size_t l = 0; l < 8; l++) lane[l] += bits_to_float(keys[i + l]);
    float mean = ((lane[0] + lane[1]) + (lane[2] + lane[3]) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))) / (float)len;
    float first = mean * (*ratio * 0.9f);
    uint32_t guess = first < bits_to_float(top) ? float_to_bits(first) : top;
    uint64_t mask[4];
    for (int attempt = 0;; attempt++) {
        for (size_t i = 0; i < len; i++) flag[i] = keys[i] >= guess;
        if (flag_mask(flag, len, mask) >= k || guess == 0) break;
        guess = attempt == 0 ? float_to_bits(bits_to_float(guess) * 0.8f) : 0;
    }
    int32_t cand[256 + 8];
    size_t m = 0;
    for (size_t w = 0; w < 4; w++)
        for (uint64_t bit = mask[w]; bit; bit &= bit - 1) cand[m++] = (int32_t)keys[64 * w + (size_t)__builtin_ctzll(bit)];
    uint32_t threshold;
    if (m <= 64) {
        /* Each candidate's count of larger ones, in vector lanes (no branch to mispredict):
         * the threshold is the smallest candidate with fewer than k larger. Keys are below
         * 2^31, so signed comparisons order them. */
        size_t rounded = (m + 7) & ~(size_t)7;
        for (size_t c = m; c < rounded; c++) cand[c] = 0x7FFFFFFF; /* never the threshold: k real ones are larger */
        int32_t best = 0x7FFFFFFF;
        for (size_t c = 0; c < rounded; c += 8) {
            i32x8 lanes, larger = {0};
            memcpy(&lanes, cand + c, sizeof lanes);
            for (size_t d = 0; d < m; d++) larger -= cand[d] > lanes; /* a true comparison is -1 */
            i32x8 v = lanes | ((larger >= (int32_t)k) & 0x7FFFFFFF); /* 2^31 - 1: not the threshold */
            for (size_t l = 0; l < 8; l++) best = v[l] < best ? v[l] : best;
        }
        threshold = (uint32_t)best;
    } else {
        threshold = kth_largest((uint32_t *)cand, (long)m, (long)k - 1);
    }
    if (mean > 0.0f) *ratio = bits_to_float(threshold) / mean;
    /* Kept: every key above the threshold, and of those equal to it the first k - (how
     * many are above), in ascending position. */
    uint64_t equal[4];
    for (size_t i = 0; i < len; i++) flag[i] = keys[i] == threshold;
    flag_mask(flag, len, equal);
    for (size_t i = 0; i < len; i++) flag[i] = keys[i] > threshold;
    size_t ties = k - flag_mask(flag, len, mask);
    for (size_t w = 0; w < 4 && ties; w++)
        for (; equal[w] && ties; ties--) {
            mask[w] |= equal[w] & -equal[w];
            equal[w] &= equal[w] - 1;
        }
    float chosen[256];
    size_t j = 0;
    for (size_t w = 0; w < 4; w++)
        for (uint64_t bit = mask[w]; bit; bit &= bit - 1) {
            size_t i = 64 * w + (size_t)__builtin_ctzll(bit);
            where[j] = (unsigned char)i;
            chosen[j++] = x[i];
        }
    if (s > 0.0f)
        for (j = 0; j < k; j++) code[j] = sparse_code(chosen[j], s);
    else
        memset(code, 2, k);
    return STATUS_OK;
}

/* Codes of one block, four to a byte from code position `offset` on (bytes shared with a
 * neighbouring block are OR-ed into; the caller zeroed them). */
VECTOR_CLONES
static void pack_codes(unsigned char *codes, size_t offset, const unsigned char *code, size_t k) {
    size_t j = 0;
    for (; j < k && ((offset + j) & 3); j++) codes[(offset + j) >> 2] |= (unsigned char)(code[j] << (2 * ((offset + j) & 3)));
    for (; j + 4 <= k; j += 4) { /* four codes (bytes 0..3) into one byte: t | t >> 6 | t >> 12 | t >> 18 */
        uint32_t t;
        memcpy(&t, code + j, 4);
        codes[(offset + j) >> 2] = (unsigned char)((t | t >> 6 | t >> 12 | t >> 18) & 0xFFu);
    }
    for (; j < k; j++) codes[(offset + j) >> 2] |= (unsigned char)(code[j] << (2 * ((offset + j) & 3)));
}

static void sparse_range(SparseJob *job) {
    float ratio = 1.5f;
    unsigned char where[256], code[256];
    for (size_t b = job->block_begin; b < job->block_end; b++) {
        size_t lo = b * job->block_size;
        size_t len = job->n - lo < job->block_size ? job->n - lo : job->block_size;
        size_t k = job->kept < len ? job->kept : len;
        size_t offset = b * job->kept; /* every block before the last is full */
        float scale;
        uint32_t bits;
        int status = sparse_block(job->x + lo, len, k, job->scale_size, &ratio, &scale, &bits, where, code);
        if (status != STATUS_OK) {
            job->status = status;
            job->bad_block = b;
            return;
        }
        store_scale(job->scales, b, job->scale_size, bits);
        if (job->indices) {
            if (k < len)
                memcpy(job->indices + offset, where, k);
            else
                for (size_t i = 0; i < len; i++) job->indices[offset + i] = (unsigned char)i;
        }
        pack_codes(job->codes, offset, code, k);
    }
}

/* The layout of a sparse payload of n values (format: diloco/codec/sparse.py), after
 * checking the parameters (a Python error set and -1 when they are bad). */
typedef struct {
    size_t blocks, total, index_len, code_len, bytes;
} SparseLayout;

static int sparse_layout(Py_ssize_t n, Py_ssize_t block_size, Py_ssize_t kept, int scale_size, int threads,
                         SparseLayout *l) {
    if (check_common(n, block_size, scale_size, threads) < 0) return -1;
    if (block_size > 256 || kept < 1 || kept > block_size) {
        PyErr_SetString(PyExc_ValueError, "need block_size <= 256 and 1 <= kept <= block_size");
        return -1;
    }
    size_t full = (size_t)n / (size_t)block_size, rest = (size_t)n % (size_t)block_size;
    l->blocks = full + (rest > 0);
    l->total = full * (size_t)kept + (rest < (size_t)kept ? rest : (size_t)kept);
    l->index_len = kept < block_size ? l->total : 0;
    l->code_len = (l->total + 3) / 4;
    l->bytes = l->index_len + l->code_len + l->blocks * (size_t)scale_size;
    return 0;
}

static void sparse_range_v(void *job) { sparse_range((SparseJob *)job); }

PyDoc_STRVAR(sparse_quantize_doc,
"sparse_quantize(x, numel, block_size, kept, scale_size, threads) -> (status, bad_block, payload)\n\n"
"The sparse payload of float32 x (indices unless kept >= block_size, codes, scales).\n"
"status: 0 ok, 1 non-finite input in bad_block, 2 half scale overflow in bad_block.");

static PyObject *py_sparse_quantize(PyObject *self, PyObject *args) {
    PyObject *x_obj;
    Py_ssize_t n, block_size, kept;
    int scale_size, threads;
    if (!PyArg_ParseTuple(args, "Onnnii", &x_obj, &n, &block_size, &kept, &scale_size, &threads)) return NULL;
    SparseLayout layout;
    if (sparse_layout(n, block_size, kept, scale_size, threads, &layout) < 0) return NULL;
    size_t blocks = layout.blocks, index_len = layout.index_len, code_len = layout.code_len;
    Py_buffer xv = {0};
    PyObject *payload = NULL, *result = NULL;
    if (PyObject_GetBuffer(x_obj, &xv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (check_len(&xv, n * 4, "x") < 0) goto done;
    payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)layout.bytes);
    if (!payload) goto done;
    unsigned char *base = (unsigned char *)PyBytes_AS_STRING(payload);
    memset(base + index_len, 0, code_len); /* codes are OR-ed in */
    int status = STATUS_OK;
    size_t bad_block = 0;
    if (n > 0) {
        /* Ranges start at blocks whose first code begins a byte: no byte is shared. */
        size_t align = 4 / ((size_t)kept % 4 == 0 ? 4 : (size_t)kept % 2 == 0 ? 2 : 1);
        size_t count = (size_t)threads, per = MIN_ELEMENTS_PER_THREAD / (size_t)block_size + 1;
        if (count > (blocks + per - 1) / per) count = (blocks + per - 1) / per;
        if (count > MAX_THREADS) count = MAX_THREADS;
        if (count < 1) count = 1;
        size_t step = (blocks + count - 1) / count;
        step = (step + align - 1) / align * align;
        SparseJob jobs[MAX_THREADS];
        size_t used = 0;
        for (size_t b = 0; b < blocks; b += step, used++) {
            jobs[used] = (SparseJob){
                .x = (const float *)xv.buf, .n = (size_t)n, .block_size = (size_t)block_size, .kept = (size_t)kept,
                .scale_size = scale_size, .block_begin = b, .block_end = b + step < blocks ? b + step : blocks,
                .indices = index_len ? base : NULL, .codes = base + index_len, .scales = base + index_len + code_len,
            };
        }
        Py_BEGIN_ALLOW_THREADS
        run_ranges(sparse_range_v, jobs, sizeof(SparseJob), used);
        Py_END_ALLOW_THREADS
        for (size_t t = 0; t < used; t++) {
            if (jobs[t].status != STATUS_OK) {
                status = jobs[t].status;
                bad_block = jobs[t].bad_block;
                break;
            }
        }
    }
    if (status != STATUS_OK) Py_CLEAR(payload);
    result = Py_BuildValue("inO", status, (Py_ssize_t)bad_block, payload ? payload : Py_None);
done:
    Py_XDECREF(payload);
    if (xv.obj) PyBuffer_Release(&xv);
    return result;
}

/* f32x4 lanes of one byte's four 2-bit codes, c - 1.5 each (exact), for byte b at row b. */
typedef float f32x4 __attribute__((vector_size(16)));
static f32x4 code_levels[256];

static void fill_code_levels(void) {
    for (unsigned b = 0; b < 256; b++)
        for (unsigned l = 0; l < 4; l++) code_levels[b][l] = (float)(b >> (2 * l) & 3u) - 1.5f;
}

/* The decoded values of a block's k codes from code position `offset` on: (c - 1.5) x
 * scale, exact as numpy computes it (one multiply of the exact level); four to a byte,
 * one row of code_levels each, when the block starts a byte. */
static void sparse_values(const unsigned char *codes, size_t offset, size_t k, float scale, float *v) {
    size_t j = 0;
    if ((offset & 3) == 0) {
        const unsigned char *c = codes + (offset >> 2);
        for (; j + 4 <= k; j += 4) {
            f32x4 row = code_levels[c[j >> 2]] * scale;
            memcpy(v + j, &row, sizeof row);
        }
    }
    for (; j < k; j++) v[j] = ((float)((codes[(offset + j) >> 2] >> (2 * ((offset + j) & 3))) & 3u) - 1.5f) * scale;
}

PyDoc_STRVAR(sparse_apply_doc,
"sparse_apply(payload, numel, block_size, kept, scale_size, out, alpha, mode) -> float\n\n"
"mode 0: out <- the decoded values (zero where nothing was kept); mode 1: out += alpha *\n"
"decoded at the kept positions; mode 2 (out None): the sum of squares of the decoded\n"
"values. The caller has checked the payload (indices, scales).");

static PyObject *py_sparse_apply(PyObject *self, PyObject *args) {
    PyObject *p_obj, *out_obj;
    Py_ssize_t n, block_size, kept;
    int scale_size, mode;
    float alpha;
    if (!PyArg_ParseTuple(args, "OnnniOfi", &p_obj, &n, &block_size, &kept, &scale_size, &out_obj, &alpha, &mode))
        return NULL;
    if (check_common(n, block_size, scale_size, 1) < 0) return NULL;
    if (block_size > 256 || kept < 1 || kept > block_size || mode < 0 || mode > 2 || (mode == 2) != (out_obj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "need block_size <= 256, 1 <= kept <= block_size, mode 0-2 (out None for 2)");
        return NULL;
    }
    SparseLayout layout;
    if (sparse_layout(n, block_size, kept, scale_size, 1, &layout) < 0) return NULL;
    size_t blocks = layout.blocks, index_len = layout.index_len, code_len = layout.code_len;
    Py_buffer pv = {0}, ov = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(p_obj, &pv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (check_len(&pv, (Py_ssize_t)layout.bytes, "payload") < 0) goto done;
    if (mode != 2) {
        if (PyObject_GetBuffer(out_obj, &ov, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
        if (check_len(&ov, n * 4, "out") < 0) goto done;
    }
    double sumsq = 0.0;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *base = (const unsigned char *)pv.buf, *codes = base + index_len;
    const unsigned char *scales = codes + code_len;
    float *out = (float *)ov.buf;
    if (mode == 0 && index_len) memset(out, 0, (size_t)n * 4); /* dense: every value is written below */
    for (size_t b = 0; b < blocks; b++) {
        size_t lo = b * (size_t)block_size;
        size_t len = (size_t)n - lo < (size_t)block_size ? (size_t)n - lo : (size_t)block_size;
        size_t k = (size_t)kept < len ? (size_t)kept : len, offset = b * (size_t)kept;
        float scale = load_scale(scales, b, scale_size);
        const unsigned char *where = index_len ? base + offset : NULL;
        float *o = out ? out + lo : NULL;
        float v[256];
        if (mode == 0 && !where) { /* dense: straight into out */
            sparse_values(codes, offset, k, scale, o);
            continue;
        }
        sparse_values(codes, offset, k, scale, v);
        if (mode == 2) {
            for (size_t j = 0; j < k; j++) sumsq += (double)v[j] * (double)v[j];
        } else if (mode == 0 && where) {
            for (size_t j = 0; j < k; j++) o[where[j]] = v[j];
        } else if (where) {
            for (size_t j = 0; j < k; j++) o[where[j]] = o[where[j]] + alpha * v[j];
        } else {
            for (size_t j = 0; j < k; j++) o[j] = o[j] + alpha * v[j];
        }
    }
    Py_END_ALLOW_THREADS
    result = PyFloat_FromDouble(sumsq);
done:
    if (pv.obj) PyBuffer_Release(&pv);
    if (ov.obj) PyBuffer_Release(&ov);
    return result;
}

typedef struct {
    const float *goal;
    float *anchor;
    size_t n, block_size, kept;
    int scale_size;
    unsigned char *indices; /* NULL: every value kept (dense), no indices */
    unsigned char *codes, *scales;
    int status;
    size_t bad_block;
    double left;
} CondenseJob;

/* One block b (len values at goal, anchor) of sparse_condense's pass: u = goal - anchor,
 * encoded into the job's payload, anchor += what the block decodes to (+0 where nothing
 * was kept), and the squared norm of u minus that added to job->left, in four running
 * sums (positions i % 4; a fixed order). Returns a STATUS (recorded in the job). Inlined
 * into each caller, so into each of their clones. */
static inline __attribute__((always_inline)) int condense_block(CondenseJob *job, size_t b, const float *goal,
                                                                 float *anchor, size_t len, float *ratio) {
    float u[256], d[256];
    unsigned char where[256], code[256];
    size_t k = job->kept < len ? job->kept : len, offset = b * job->kept;
    for (size_t i = 0; i < len; i++) u[i] = goal[i] - anchor[i];
    float scale;
    uint32_t bits;
    int status = sparse_block(u, len, k, job->scale_size, ratio, &scale, &bits, where, code);
    if (status != STATUS_OK) {
        job->status = status;
        job->bad_block = b;
        return status;
    }
    store_scale(job->scales, b, job->scale_size, bits);
    pack_codes(job->codes, offset, code, k);
    if (k < len) {
        if (job->indices) memcpy(job->indices + offset, where, k);
        memset(d, 0, len * sizeof *d);
        for (size_t j = 0; j < k; j++) d[where[j]] = ((float)code[j] - 1.5f) * scale;
    } else {
        if (job->indices)
            for (size_t i = 0; i < len; i++) job->indices[offset + i] = (unsigned char)i;
        for (size_t i = 0; i < len; i++) d[i] = ((float)code[i] - 1.5f) * scale;
    }
    for (size_t i = 0; i < len; i++) anchor[i] = anchor[i] + d[i];
    double lane[4] = {0.0, 0.0, 0.0, 0.0};
    size_t i = 0;
    for (; i + 4 <= len; i += 4)
        for (size_t l = 0; l < 4; l++) {
            double e = (double)u[i + l] - (double)d[i + l];
            lane[l] += e * e;
        }
    for (; i < len; i++) {
        double e = (double)u[i] - (double)d[i];
        lane[i & 3] += e * e;
    }
    job->left += (lane[0] + lane[1]) + (lane[2] + lane[3]);
    return STATUS_OK;
}

/* sparse_condense's pass, block by block. */
VECTOR_CLONES
static void condense_blocks(CondenseJob *job) {
    float ratio = 1.5f;
    size_t blocks = (job->n + job->block_size - 1) / job->block_size;
    for (size_t b = 0; b < blocks; b++) {
        size_t lo = b * job->block_size;
        size_t len = job->n - lo < job->block_size ? job->n - lo : job->block_size;
        if (condense_block(job, b, job->goal + lo, job->anchor + lo, len, &ratio) != STATUS_OK) return;
    }
}

PyDoc_STRVAR(sparse_condense_doc,
"sparse_condense(goal, anchor, numel, block_size, kept, scale_size) -> (status, bad_block, payload, left_sq)\n\n"
"The sparse payload of goal - anchor (float32 [numel] each, anchor writable), anchor +=\n"
"exactly what the payload decodes to (+0 where nothing was kept), and left_sq: the sum of\n"
"squares (double) of what it left out, (goal - anchor) - decoded. One pass, one thread.\n"
"status: 0 ok; else as sparse_quantize, the blocks before bad_block already advanced.");

static PyObject *py_sparse_condense(PyObject *self, PyObject *args) {
    PyObject *g_obj, *a_obj;
    Py_ssize_t n, block_size, kept;
    int scale_size;
    if (!PyArg_ParseTuple(args, "OOnnni", &g_obj, &a_obj, &n, &block_size, &kept, &scale_size)) return NULL;
    SparseLayout layout;
    if (sparse_layout(n, block_size, kept, scale_size, 1, &layout) < 0) return NULL;
    size_t index_len = layout.index_len, code_len = layout.code_len;
    Py_buffer gv = {0}, av = {0};
    PyObject *payload = NULL, *result = NULL;
    if (PyObject_GetBuffer(g_obj, &gv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (check_len(&gv, n * 4, "goal") < 0) goto done;
    if (PyObject_GetBuffer(a_obj, &av, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    if (check_len(&av, n * 4, "anchor") < 0) goto done;
    payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)layout.bytes);
    if (!payload) goto done;
    unsigned char *base = (unsigned char *)PyBytes_AS_STRING(payload);
    memset(base + index_len, 0, code_len); /* codes shared by two blocks are OR-ed in */
    CondenseJob job = {
        .goal = (const float *)gv.buf, .anchor = (float *)av.buf, .n = (size_t)n, .block_size = (size_t)block_size,
        .kept = (size_t)kept, .scale_size = scale_size, .indices = index_len ? base : NULL,
        .codes = base + index_len, .scales = base + index_len + code_len,
    };
    Py_BEGIN_ALLOW_THREADS
    condense_blocks(&job);
    Py_END_ALLOW_THREADS
    if (job.status != STATUS_OK) Py_CLEAR(payload);
    result = Py_BuildValue("inOd", job.status, (Py_ssize_t)job.bad_block, payload ? payload : Py_None, job.left);
done:
    Py_XDECREF(payload);
    if (gv.obj) PyBuffer_Release(&gv);
    if (av.obj) PyBuffer_Release(&av);
    return result;
}

PyDoc_STRVAR(sparse_dot_doc,
"sparse_dot(payload, numel, block_size, kept, scale_size, y) -> (dot, sumsq)\n\n"
"The decoded values' dot product with float32 y [numel] and their sum of squares, both\n"
"summed in double in index order: a push's agreement with a direction without decoding\n"
"it into an array. The caller has checked the payload (indices, scales).");

static PyObject *py_sparse_dot(PyObject *self, PyObject *args) {
    PyObject *p_obj, *y_obj;
    Py_ssize_t n, block_size, kept;
    int scale_size;
    if (!PyArg_ParseTuple(args, "OnnniO", &p_obj, &n, &block_size, &kept, &scale_size, &y_obj)) return NULL;
    SparseLayout layout;
    if (sparse_layout(n, block_size, kept, scale_size, 1, &layout) < 0) return NULL;
    size_t blocks = layout.blocks, index_len = layout.index_len, code_len = layout.code_len;
    Py_buffer pv = {0}, yv = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(p_obj, &pv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (check_len(&pv, (Py_ssize_t)layout.bytes, "payload") < 0) goto done;
    if (PyObject_GetBuffer(y_obj, &yv, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (check_len(&yv, n * 4, "y") < 0) goto done;
    double dot = 0.0, sumsq = 0.0;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *base = (const unsigned char *)pv.buf, *codes = base + index_len;
    const unsigned char *scales = codes + code_len;
    const float *y = (const float *)yv.buf;
    for (size_t b = 0; b < blocks; b++) {
        size_t lo = b * (size_t)block_size;
        size_t len = (size_t)n - lo < (size_t)block_size ? (size_t)n - lo : (size_t)block_size;
        size_t k = (size_t)kept < len ? (size_t)kept : len, offset = b * (size_t)kept;
        float v[256];
        sparse_values(codes, offset, k, load_scale(scales, b, scale_size), v);
        const unsigned char *where = index_len ? base + offset : NULL;
        double lane_dot[4] = {0.0, 0.0, 0.0, 0.0}, lane_sq[4] = {0.0, 0.0, 0.0, 0.0};
        for (size_t j = 0; j < k; j++) {
            double value = (double)v[j];
            lane_dot[j & 3] += value * (double)y[lo + (where ? where[j] : j)];
            lane_sq[j & 3] += value * value;
        }
        dot += (lane_dot[0] + lane_dot[1]) + (lane_dot[2] + lane_dot[3]);
        sumsq += (lane_sq[0] + lane_sq[1]) + (lane_sq[2] + lane_sq[3]);
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("dd", dot, sumsq);
done:
    if (pv.obj) PyBuffer_Release(&pv);
    if (yv.obj) PyBuffer_Release(&yv);
    return result;
}

/* ---------------------------------------------------------------------------------- */
/* A shard's condensed sparse reply, fused with the learner's mirror: per mirror block    */
/* (diloco/syncer/core/mirrors.py), the anchor loaded (mirror_load's operations), each    */
/* sparse block of it encoded towards the goal and advanced (condense_blocks'), then the  */
/* block stored against the new base (mirror_store's): one pass over the arrays, the same */
/* float operations in the same order as those three, so the same bits.                   */

typedef struct {
    int8_t *codes;        /* the mirror's int8 codes: read, then rewritten against new_base */
    float *mirror_scales; /* one per mirror block: read, then rewritten */
    const float *old_base, *new_base, *goal;
    size_t n, mirror_block;
    CondenseJob reply; /* n, block_size, kept, scale_size, indices, codes, scales; status, left */
    double drift;
} MirrorCondenseJob;

VECTOR_CLONES
static void mirror_condense_blocks(MirrorCondenseJob *job) {
    float anchor[MIRROR_MAX_BLOCK];
    float ratio = 1.5f;
    CondenseJob *r = &job->reply;
    size_t chunks = (job->n + job->mirror_block - 1) / job->mirror_block;
    for (size_t c = 0; c < chunks; c++) {
        size_t lo = c * job->mirror_block, hi = lo + job->mirror_block < job->n ? lo + job->mirror_block : job->n;
        float mscale = job->mirror_scales[c];
        for (size_t i = lo; i < hi; i++) anchor[i - lo] = job->old_base[i] + (float)job->codes[i] * mscale;
        for (size_t start = lo; start < hi; start += r->block_size) {
            size_t len = hi - start < r->block_size ? hi - start : r->block_size;
            if (condense_block(r, start / r->block_size, job->goal + start, anchor + (start - lo), len, &ratio) !=
                STATUS_OK)
                return;
        }
        job->drift += mirror_store_blocks(anchor, job->new_base + lo, job->codes + lo, job->mirror_scales + c,
                                          (Py_ssize_t)(hi - lo), (Py_ssize_t)(hi - lo));
    }
}

PyDoc_STRVAR(mirror_condense_doc,
"mirror_condense(codes, mirror_scales, old_base, new_base, goal, n, mirror_block, block_size, kept, scale_size)\n"
"    -> (status, bad_block, payload, left_sq, drift)\n\n"
"A condensed sparse reply from a mirrored anchor (old_base + codes x mirror_scales, per\n"
"mirror block) to goal, and the mirror advanced by what the reply decodes to and stored\n"
"against new_base (codes and mirror_scales rewritten): mirror_load, sparse_condense and\n"
"mirror_store in one pass, bit for bit. mirror_block must be a multiple of block_size (at\n"
"most 4096). drift: what mirror_store returns. On a status other than 0 (as\n"
"sparse_condense) the mirror blocks before the bad one are rewritten.");

static PyObject *py_mirror_condense(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    Py_ssize_t n, mirror_block, block_size, kept;
    int scale_size;
    if (!PyArg_ParseTuple(args, "OOOOOnnnni", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &n, &mirror_block,
                          &block_size, &kept, &scale_size))
        return NULL;
    if (check_common(n, block_size, scale_size, 1) < 0) return NULL;
    if (block_size > 256 || kept < 1 || kept > block_size || mirror_block <= 0 || mirror_block > MIRROR_MAX_BLOCK ||
        mirror_block % block_size) {
        PyErr_SetString(PyExc_ValueError,
                        "need block_size <= 256, 1 <= kept <= block_size, mirror_block a multiple of block_size <= 4096");
        return NULL;
    }
    SparseLayout layout;
    if (sparse_layout(n, block_size, kept, scale_size, 1, &layout) < 0) return NULL;
    size_t index_len = layout.index_len, code_len = layout.code_len;
    Py_ssize_t chunks = (n + mirror_block - 1) / mirror_block;
    Py_buffer v[5] = {{0}};
    const Py_ssize_t lens[5] = {n, chunks * 4, n * 4, n * 4, n * 4};
    const char *names[5] = {"codes", "mirror_scales", "old_base", "new_base", "goal"};
    PyObject *payload = NULL, *result = NULL;
    int got = 0;
    for (; got < 5; got++) {
        int flags = PyBUF_C_CONTIGUOUS | (got < 2 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[got], &v[got], flags) < 0) goto done;
        if (check_len(&v[got], lens[got], names[got]) < 0) {
            got++;
            goto done;
        }
    }
    payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)layout.bytes);
    if (!payload) goto done;
    unsigned char *base = (unsigned char *)PyBytes_AS_STRING(payload);
    memset(base + index_len, 0, code_len); /* codes shared by two blocks are OR-ed in */
    MirrorCondenseJob job = {
        .codes = (int8_t *)v[0].buf, .mirror_scales = (float *)v[1].buf, .old_base = (const float *)v[2].buf,
        .new_base = (const float *)v[3].buf, .goal = (const float *)v[4].buf, .n = (size_t)n,
        .mirror_block = (size_t)mirror_block,
        .reply = {.n = (size_t)n, .block_size = (size_t)block_size, .kept = (size_t)kept, .scale_size = scale_size,
                  .indices = index_len ? base : NULL, .codes = base + index_len, .scales = base + index_len + code_len},
    };
    Py_BEGIN_ALLOW_THREADS
    mirror_condense_blocks(&job);
    Py_END_ALLOW_THREADS
    if (job.reply.status != STATUS_OK) Py_CLEAR(payload);
    result = Py_BuildValue("inOdd", job.reply.status, (Py_ssize_t)job.reply.bad_block, payload ? payload : Py_None,
                           job.reply.left, job.drift);
done:
    Py_XDECREF(payload);
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return result;
}

PyDoc_STRVAR(scale_add_doc,
"scale_add(y, a, x, b) -> None\n\n"
"y <- y * a + x * b over float32 y and x of one size: two float32 products and a float32\n"
"sum per value (no FMA), as numpy's y *= a; y += b * x computes them, in one pass.");

VECTOR_CLONES
static void scale_add_values(float *y, float a, const float *x, float b, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = y[i] * a + x[i] * b;
}

static PyObject *py_scale_add(PyObject *self, PyObject *args) {
    PyObject *y_obj, *x_obj;
    float a, b;
    if (!PyArg_ParseTuple(args, "OfOf", &y_obj, &a, &x_obj, &b)) return NULL;
    Py_buffer yv = {0}, xv = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(y_obj, &yv, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    if (yv.len % 4) {
        PyErr_SetString(PyExc_ValueError, "scale_add needs float32 data");
        goto done;
    }
    if (PyObject_GetBuffer(x_obj, &xv, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (check_len(&xv, yv.len, "x") < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    scale_add_values((float *)yv.buf, a, (const float *)xv.buf, b, (size_t)yv.len / 4);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    if (yv.obj) PyBuffer_Release(&yv);
    if (xv.obj) PyBuffer_Release(&xv);
    return result;
}

PyDoc_STRVAR(dot_f32_doc,
"dot_f32(x, y) -> float\n\n"
"The dot product of float32 x and y of one size, in double: four running sums over the\n"
"positions i % 4, added (0 + 1) + (2 + 3) at the end; a fixed order, so the same result on\n"
"every run (dot_f32(x, x): x's sum of squares).");

static PyObject *py_dot_f32(PyObject *self, PyObject *args) {
    PyObject *x_obj, *y_obj;
    if (!PyArg_ParseTuple(args, "OO", &x_obj, &y_obj)) return NULL;
    Py_buffer xv = {0}, yv = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(x_obj, &xv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (xv.len % 4) {
        PyErr_SetString(PyExc_ValueError, "dot_f32 needs float32 data");
        goto done;
    }
    if (PyObject_GetBuffer(y_obj, &yv, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (check_len(&yv, xv.len, "y") < 0) goto done;
    size_t n = (size_t)xv.len / 4;
    double lane[4] = {0.0, 0.0, 0.0, 0.0};
    Py_BEGIN_ALLOW_THREADS
    const float *x = (const float *)xv.buf, *y = (const float *)yv.buf;
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (size_t l = 0; l < 4; l++) lane[l] += (double)x[i + l] * (double)y[i + l];
    for (; i < n; i++) lane[i & 3] += (double)x[i] * (double)y[i];
    Py_END_ALLOW_THREADS
    result = PyFloat_FromDouble((lane[0] + lane[1]) + (lane[2] + lane[3]));
done:
    if (xv.obj) PyBuffer_Release(&xv);
    if (yv.obj) PyBuffer_Release(&yv);
    return result;
}

static PyMethodDef methods[] = {
    {"quantize", py_quantize, METH_VARARGS, quantize_doc},
    {"dequantize", py_dequantize, METH_VARARGS, dequantize_doc},
    {"axpy_many", py_axpy_many, METH_VARARGS, axpy_many_doc},
    {"outer_step", py_outer_step, METH_VARARGS, outer_doc},
    {"sumsq", py_sumsq, METH_VARARGS, sumsq_doc},
    {"mirror_store", py_mirror_store, METH_VARARGS, mirror_store_doc},
    {"mirror_load", py_mirror_load, METH_VARARGS, mirror_load_doc},
    {"sparse_quantize", py_sparse_quantize, METH_VARARGS, sparse_quantize_doc},
    {"sparse_apply", py_sparse_apply, METH_VARARGS, sparse_apply_doc},
    {"sparse_condense", py_sparse_condense, METH_VARARGS, sparse_condense_doc},
    {"sparse_dot", py_sparse_dot, METH_VARARGS, sparse_dot_doc},
    {"mirror_condense", py_mirror_condense, METH_VARARGS, mirror_condense_doc},
    {"dot_f32", py_dot_f32, METH_VARARGS, dot_f32_doc},
    {"scale_add", py_scale_add, METH_VARARGS, scale_add_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "diloco.codec._int4",
    "Fused int4 block quantization kernels; see diloco/codec/int4.py for the contract.",
    -1,
    methods,
};

PyMODINIT_FUNC PyInit__int4(void) {
    fill_code_levels();
    return PyModule_Create(&module);
}
