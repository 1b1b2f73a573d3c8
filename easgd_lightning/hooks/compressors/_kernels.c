/* One-pass CPU kernels for the codecs (see _native.py, which builds and loads this file).
 *
 * Each kernel reads the tensor once and does what the eager version does in several
 * passes (mask, count, nonzero, gather; norm, noise, floor, cast; compare, pack). The
 * arithmetic is the eager arithmetic (built with -ffp-contract=off: no fused multiply-add),
 * so results match the eager fallbacks bit for bit except where a docstring in the Python
 * caller says otherwise (sums accumulate in double). Single-threaded: the callers run one
 * codec per tensor on the training process's own thread.
 */
#include <tgmath.h> /* floor, fabs, sqrt follow the argument type (floorf for float) */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#if defined(__AVX__) || defined(__AVX512F__) || defined(__BMI2__)
#include <immintrin.h>
#endif

#define BLOCK 16 /* entries tested together before the (rare) scalar gather */

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2 helpers for the paths below that mirror the AVX-512 ones lane for lane. */
static inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
static inline __m256d abs4(__m256d v) { return _mm256_andnot_pd(_mm256_set1_pd(-0.0), v); }

/* bit j set when |x_j| >= t (ge) or > t, for 8 floats / 4 doubles (NaN: unset) */
static inline uint32_t hits8_ps(__m256 a, __m256 t, int ge) {
    return (uint32_t)_mm256_movemask_ps(ge ? _mm256_cmp_ps(a, t, _CMP_GE_OQ) : _mm256_cmp_ps(a, t, _CMP_GT_OQ));
}
static inline uint32_t hits4_pd(__m256d a, __m256d t, int ge) {
    return (uint32_t)_mm256_movemask_pd(ge ? _mm256_cmp_pd(a, t, _CMP_GE_OQ) : _mm256_cmp_pd(a, t, _CMP_GT_OQ));
}

/* s[0..3] += 16 floats widened to double: s[0], s[1] are the AVX-512 code's first __m512d
 * sum (entries 0-7 of each 16), s[2], s[3] its second (entries 8-15) */
static inline void add16_pd(__m256d s[4], __m256 a0, __m256 a1) {
    s[0] = _mm256_add_pd(s[0], _mm256_cvtps_pd(_mm256_castps256_ps128(a0)));
    s[1] = _mm256_add_pd(s[1], _mm256_cvtps_pd(_mm256_extractf128_ps(a0, 1)));
    s[2] = _mm256_add_pd(s[2], _mm256_cvtps_pd(_mm256_castps256_ps128(a1)));
    s[3] = _mm256_add_pd(s[3], _mm256_cvtps_pd(_mm256_extractf128_ps(a1, 1)));
}

/* their total in the order of _mm512_reduce_add_pd(_mm512_add_pd(s0, s1)) (GCC's: the
 * high half plus the low half, again on the 128-bit halves, then the two doubles) */
static inline double reduce16_pd(const __m256d s[4]) {
    __m256d t = _mm256_add_pd(_mm256_add_pd(s[1], s[3]), _mm256_add_pd(s[0], s[2]));
    __m128d u = _mm_add_pd(_mm256_extractf128_pd(t, 1), _mm256_castpd256_pd128(t));
    return _mm_cvtsd_f64(u) + _mm_cvtsd_f64(_mm_unpackhi_pd(u, u));
}

/* the max of 16 float lanes (lo: 0-7, hi: 8-15) in the order of GCC's _mm512_reduce_max_ps */
static inline float reduce16_max_ps(__m256 lo, __m256 hi) {
    __m256 t = _mm256_max_ps(hi, lo);
    __m128 u = _mm_max_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    u = _mm_max_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    u = _mm_max_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(0, 1, 0, 1)));
    return _mm_cvtss_f32(u);
}

/* appends (i + j, x[i + j]) for the set bits j of k, lowest first, while c < cap, and counts
 * them all in c (the order and the cap rule of the scalar loop) */
#define APPEND_HITS(x, i, k, c, cap, idx, val)                                              \
    for (; k; k &= k - 1) {                                                                 \
        int64_t j_ = (i) + __builtin_ctz(k);                                                \
        if (c < cap) { idx[c] = j_; val[c] = x[j_]; }                                       \
        c++;                                                                                \
    }
#endif

/* ------------------------------------------------------------------ selection by |x| */

/* count |x_i| > thr (or >= thr when ge) */
#define DEF_COUNT(T, SFX)                                                                   \
    int64_t count_abs_##SFX(const T *x, int64_t n, T thr, int ge) {                        \
        int64_t c = 0;                                                                      \
        if (ge) {                                                                           \
            for (int64_t i = 0; i < n; i++) c += fabs(x[i]) >= thr;                         \
        } else {                                                                            \
            for (int64_t i = 0; i < n; i++) c += fabs(x[i]) > thr;                          \
        }                                                                                   \
        return c;                                                                           \
    }

/* indices (ascending) and values of the entries with |x_i| > thr (>= thr when ge); writes
 * at most cap of them and returns how many there are in all. */
#define HIT(a, thr, ge) ((ge) ? (a) >= (thr) : (a) > (thr))
#define DEF_SELECT_TAIL(T, SFX)                                                             \
    static int64_t select_tail_##SFX(const T *x, int64_t i, int64_t n, T thr, int ge,      \
                                     int64_t c, int64_t cap, int64_t *idx, T *val) {        \
        for (; i < n; i++)                                                                  \
            if (HIT(fabs(x[i]), thr, ge)) {                                                 \
                if (c < cap) { idx[c] = i; val[c] = x[i]; }                                 \
                c++;                                                                        \
            }                                                                               \
        return c;                                                                           \
    }
DEF_SELECT_TAIL(float, f32)
DEF_SELECT_TAIL(double, f64)

/* AVX-512: the survivors of whole vectors (16 floats, 8 doubles) compressed in registers
 * and stored at once (AVX2: appended one by one from the compare mask); returns where the
 * portable loop goes on (0 without either). */
static int64_t select_vec_f32(const float *x, int64_t n, float thr, int ge, int64_t cap,
                              int64_t *idx, float *val, int64_t *count) {
    int64_t i = 0;
#ifdef __AVX512F__
    int64_t c = *count;
    const __m512 t = _mm512_set1_ps(thr);
    const __m512i lo0 = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i hi0 = _mm512_setr_epi64(8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __m512 a = _mm512_abs_ps(v);
        __mmask16 k = ge ? _mm512_cmp_ps_mask(a, t, _CMP_GE_OQ) : _mm512_cmp_ps_mask(a, t, _CMP_GT_OQ);
        if (!k) continue;
        if (c + 16 <= cap) {
            __m512i base = _mm512_set1_epi64(i);
            int clo = __builtin_popcount(k & 0xFF);
            _mm512_storeu_ps(val + c, _mm512_maskz_compress_ps(k, v));
            _mm512_storeu_si512(idx + c, _mm512_maskz_compress_epi64((__mmask8)(k & 0xFF), _mm512_add_epi64(base, lo0)));
            _mm512_storeu_si512(idx + c + clo, _mm512_maskz_compress_epi64((__mmask8)(k >> 8), _mm512_add_epi64(base, hi0)));
            c += __builtin_popcount(k);
        } else {
            c = select_tail_f32(x, i, i + 16, thr, ge, c, cap, idx, val);
        }
    }
    *count = c;
#elif defined(__AVX2__)
    /* AVX2 has no compress: the compare mask of 16 floats, blocks without a hit skipped */
    int64_t c = *count;
    const __m256 t = _mm256_set1_ps(thr);
    for (; i + 16 <= n; i += 16) {
        uint32_t k = hits8_ps(abs8(_mm256_loadu_ps(x + i)), t, ge) |
                     hits8_ps(abs8(_mm256_loadu_ps(x + i + 8)), t, ge) << 8;
        APPEND_HITS(x, i, k, c, cap, idx, val)
    }
    *count = c;
#else
    (void)x; (void)n; (void)thr; (void)ge; (void)cap; (void)idx; (void)val; (void)count;
#endif
    return i;
}

static int64_t select_vec_f64(const double *x, int64_t n, double thr, int ge, int64_t cap,
                              int64_t *idx, double *val, int64_t *count) {
    int64_t i = 0;
#ifdef __AVX512F__
    int64_t c = *count;
    const __m512d t = _mm512_set1_pd(thr);
    const __m512i lo0 = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    for (; i + 8 <= n; i += 8) {
        __m512d v = _mm512_loadu_pd(x + i);
        __m512d a = _mm512_abs_pd(v);
        __mmask8 k = ge ? _mm512_cmp_pd_mask(a, t, _CMP_GE_OQ) : _mm512_cmp_pd_mask(a, t, _CMP_GT_OQ);
        if (!k) continue;
        if (c + 8 <= cap) {
            _mm512_storeu_pd(val + c, _mm512_maskz_compress_pd(k, v));
            _mm512_storeu_si512(idx + c, _mm512_maskz_compress_epi64(k, _mm512_add_epi64(_mm512_set1_epi64(i), lo0)));
            c += __builtin_popcount(k);
        } else {
            c = select_tail_f64(x, i, i + 8, thr, ge, c, cap, idx, val);
        }
    }
    *count = c;
#elif defined(__AVX2__)
    /* as for float32: 16 doubles per mask */
    int64_t c = *count;
    const __m256d t = _mm256_set1_pd(thr);
    for (; i + 16 <= n; i += 16) {
        uint32_t k = 0;
        for (int q = 0; q < 4; q++) k |= hits4_pd(abs4(_mm256_loadu_pd(x + i + 4 * q)), t, ge) << (4 * q);
        APPEND_HITS(x, i, k, c, cap, idx, val)
    }
    *count = c;
#else
    (void)x; (void)n; (void)thr; (void)ge; (void)cap; (void)idx; (void)val; (void)count;
#endif
    return i;
}

/* the vector part, then blocks whose compare mask is empty skipped and the rest gathered
 * one by one, then the tail */
#define DEF_SELECT(T, SFX)                                                                  \
    int64_t select_abs_##SFX(const T *x, int64_t n, T thr, int ge, int64_t cap, int64_t *idx, \
                             T *val) {                                                      \
        int64_t c = 0;                                                                      \
        int64_t i = select_vec_##SFX(x, n, thr, ge, cap, idx, val, &c);                     \
        for (; i + BLOCK <= n; i += BLOCK) {                                                \
            int any = 0;                                                                    \
            for (int j = 0; j < BLOCK; j++) any |= HIT(fabs(x[i + j]), thr, ge);            \
            if (any) c = select_tail_##SFX(x, i, i + BLOCK, thr, ge, c, cap, idx, val);     \
        }                                                                                   \
        return select_tail_##SFX(x, i, n, thr, ge, c, cap, idx, val);                       \
    }

DEF_SELECT(float, f32)
DEF_SELECT(double, f64)

/* Sums accumulate in double over LANES independent partial sums (the loops vectorize
 * without reassociating anything), added up at the end. */
#define LANES 16

/* sum of |x| (in double) and max of |x| in one pass */
#define DEF_ABS_SUM_MAX(T, SFX)                                                             \
    void abs_sum_max_##SFX(const T *x, int64_t n, double *sum, T *max) {                  \
        double acc[LANES] = {0};                                                            \
        T mx[LANES] = {0};                                                                  \
        int64_t i = 0;                                                                      \
        for (; i + LANES <= n; i += LANES)                                                  \
            for (int l = 0; l < LANES; l++) {                                               \
                T a = fabs(x[i + l]);                                                       \
                acc[l] += a;                                                                \
                mx[l] = a > mx[l] ? a : mx[l];                                              \
            }                                                                               \
        double s = 0.0;                                                                     \
        T m = 0;                                                                            \
        for (int l = 0; l < LANES; l++) { s += acc[l]; m = mx[l] > m ? mx[l] : m; }         \
        for (; i < n; i++) { T a = fabs(x[i]); s += a; m = a > m ? a : m; }                 \
        *sum = s;                                                                           \
        *max = m;                                                                           \
    }

/* DGC momentum correction, in place: u <- m u + g; v <- v + u
 * (Nesterov: u <- m (u + g); v <- v + u + g), with the eager rounding order. */
#define DEF_MOMENTUM(T, SFX)                                                                \
    void momentum_##SFX(T *u, T *v, const T *g, int64_t n, T m, int nesterov) {            \
        if (nesterov) {                                                                     \
            for (int64_t i = 0; i < n; i++) {                                               \
                T ui = (u[i] + g[i]) * m;                                                   \
                u[i] = ui;                                                                  \
                v[i] = (v[i] + ui) + g[i];                                                  \
            }                                                                               \
        } else {                                                                            \
            for (int64_t i = 0; i < n; i++) {                                               \
                T ui = u[i] * m + g[i];                                                     \
                u[i] = ui;                                                                  \
                v[i] = v[i] + ui;                                                           \
            }                                                                               \
        }                                                                                   \
    }

/* out <- a + b; streaming stores (no read of out's old contents) when out is aligned */
void add_out_f32(const float *a, const float *b, float *out, int64_t n) {
    int64_t i = 0;
#ifdef __AVX__
    if (((uintptr_t)out & 31) == 0) {
        for (; i + 8 <= n; i += 8)
            _mm256_stream_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        _mm_sfence();
    }
#endif
    for (; i < n; i++) out[i] = a[i] + b[i];
}

void add_out_f64(const double *a, const double *b, double *out, int64_t n) {
    int64_t i = 0;
#ifdef __AVX__
    if (((uintptr_t)out & 31) == 0) {
        for (; i + 4 <= n; i += 4)
            _mm256_stream_pd(out + i, _mm256_add_pd(_mm256_loadu_pd(a + i), _mm256_loadu_pd(b + i)));
        _mm_sfence();
    }
#endif
    for (; i < n; i++) out[i] = a[i] + b[i];
}

/* out[idx[j]] <- val[j] (idx int32 or int64), and x[idx[j]] <- 0 */
#define DEF_SCATTER(T, SFX)                                                                 \
    void scatter_i32_##SFX(T *out, const int32_t *idx, const T *val, int64_t k) {           \
        for (int64_t j = 0; j < k; j++) out[idx[j]] = val[j];                               \
    }                                                                                       \
    void scatter_i64_##SFX(T *out, const int64_t *idx, const T *val, int64_t k) {           \
        for (int64_t j = 0; j < k; j++) out[idx[j]] = val[j];                               \
    }                                                                                       \
    void scatter_add_i64_##SFX(T *out, const int64_t *idx, const T *val, int64_t k) {       \
        for (int64_t j = 0; j < k; j++) out[idx[j]] += val[j];                              \
    }                                                                                       \
    void zero_at_##SFX(T *x, const int64_t *idx, int64_t k) {                               \
        for (int64_t j = 0; j < k; j++) x[idx[j]] = 0;                                      \
    }

DEF_SCATTER(float, f32)
DEF_SCATTER(double, f64)
DEF_COUNT(float, f32)
DEF_COUNT(double, f64)
DEF_ABS_SUM_MAX(float, f32_scalar)

/* 16 floats at a time: |x| widened to double for the sum (16 lanes), max in float; the AVX2
 * path keeps the AVX-512 lanes and reduction order, so both give the same bits */
void abs_sum_max_f32(const float *x, int64_t n, double *sum, float *max) {
    int64_t i = 0;
    double s = 0.0;
    float m = 0.0f;
#ifdef __AVX512F__
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    __m512 mv = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
        s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(a)));
        s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
        mv = _mm512_max_ps(mv, a);
    }
    m = _mm512_reduce_max_ps(mv);
    s = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
#elif defined(__AVX2__)
    __m256d sv[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m256 a0 = abs8(_mm256_loadu_ps(x + i)), a1 = abs8(_mm256_loadu_ps(x + i + 8));
        add16_pd(sv, a0, a1);
        m0 = _mm256_max_ps(m0, a0);
        m1 = _mm256_max_ps(m1, a1);
    }
    m = reduce16_max_ps(m0, m1);
    s = reduce16_pd(sv);
#endif
    double tail_sum;
    float tail_max;
    abs_sum_max_f32_scalar(x + i, n - i, &tail_sum, &tail_max);
    *sum = s + tail_sum;
    *max = tail_max > m ? tail_max : m;
}
DEF_ABS_SUM_MAX(double, f64)
DEF_MOMENTUM(float, f32)
DEF_MOMENTUM(double, f64)

/* DGC's first round in the same pass as the momentum correction: updates u and v chunk by
 * chunk and gathers the entries with |v_i| >= thr from the chunk while it is in cache
 * (same contract as select_abs). */
#define CHUNK 4096
#define DEF_MOMENTUM_SELECT(T, SFX)                                                         \
    int64_t momentum_select_##SFX(T *u, T *v, const T *g, int64_t n, T m, int nesterov,    \
                                  T thr, int64_t cap, int64_t *idx, T *val) {               \
        int64_t c = 0;                                                                      \
        for (int64_t i = 0; i < n; i += CHUNK) {                                            \
            int64_t len = n - i < CHUNK ? n - i : CHUNK;                                    \
            momentum_##SFX(u + i, v + i, g + i, len, m, nesterov);                          \
            int64_t room = c < cap ? cap - c : 0;                                           \
            int64_t got = select_abs_##SFX(v + i, len, thr, 1, room, idx + (c < cap ? c : 0), \
                                           val + (c < cap ? c : 0));                        \
            int64_t wrote = got < room ? got : room;                                        \
            for (int64_t j = 0; j < wrote; j++) idx[c + j] += i;                            \
            c += got;                                                                       \
        }                                                                                   \
        return c;                                                                           \
    }

DEF_MOMENTUM_SELECT(float, f32)
DEF_MOMENTUM_SELECT(double, f64)

/* out[j] = |v'| at entry j * stride, where v' is v after the momentum correction (u, v, g
 * are only read): DGC's sample of the corrected v before the fused pass. */
#define DEF_MOMENTUM_SAMPLE(T, SFX)                                                         \
    void momentum_sample_##SFX(const T *u, const T *v, const T *g, int64_t n, int64_t stride,\
                               T m, int nesterov, T *out) {                                 \
        int64_t s = (n + stride - 1) / stride;                                              \
        for (int64_t j = 0; j < s; j++) {                                                   \
            int64_t i = j * stride;                                                         \
            if (j + 16 < s) {                                                               \
                __builtin_prefetch(u + i + 16 * stride);                                    \
                __builtin_prefetch(v + i + 16 * stride);                                    \
                __builtin_prefetch(g + i + 16 * stride);                                    \
            }                                                                               \
            T vi = nesterov ? (v[i] + (u[i] + g[i]) * m) + g[i] : v[i] + (u[i] * m + g[i]); \
            out[j] = fabs(vi);                                                              \
        }                                                                                   \
    }

DEF_MOMENTUM_SAMPLE(float, f32)
DEF_MOMENTUM_SAMPLE(double, f64)

/* ------------------------------------------------------------------ QSGD */

/* A counter-based 32-bit hash (an xor-shift-multiply mix): the uniform noise of entry i
 * is mix32((i + s0) ^ s1), top 24 bits / 2^24, in [0, 1). */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

static inline float uniform24(uint32_t i, uint32_t s0, uint32_t s1) {
    return (float)(mix32((i + s0) ^ s1) >> 8) * (1.0f / 16777216.0f);
}

/* ------------------------------------------------------------------ random-k */

/* Stratified shared draw: index j lies in [j n / k, (j + 1) n / k), at
 * start + floor(u_j size) with u_j = uniform24(j, s0, s1) (in double: exact); gathers
 * x[idx_j] and zeroes it when zero is set. */
#define PREFETCH 32 /* entries ahead: the gather is latency-bound, not bandwidth-bound */
#define DEF_RANDOMK(T, SFX)                                                                 \
    void randomk_gather_##SFX(T *x, int64_t n, int64_t k, uint32_t s0, uint32_t s1,         \
                              int zero, int64_t *idx, T *val) {                             \
        int64_t q = n / k, r = n % k, start = 0, rem = 0; /* start = j n / k, rem = j r % k */ \
        for (int64_t j = 0; j < k; j++) {                                                   \
            int64_t size = q + (rem + r >= k);                                              \
            double u = (double)(mix32(((uint32_t)j + s0) ^ s1) >> 8) / 16777216.0;          \
            idx[j] = start + (int64_t)(u * (double)size);                                   \
            start += size;                                                                  \
            rem += r;                                                                       \
            if (rem >= k) rem -= k;                                                         \
        }                                                                                   \
        for (int64_t j = 0; j < k; j++) {                                                   \
            if (j + PREFETCH < k) __builtin_prefetch(x + idx[j + PREFETCH], 1);             \
            int64_t i = idx[j];                                                             \
            val[j] = x[i];                                                                  \
            if (zero) x[i] = 0;                                                             \
        }                                                                                   \
    }

DEF_RANDOMK(float, f32)
DEF_RANDOMK(double, f64)

/* CRC-32 of n bytes (the IEEE polynomial, reflected, as zlib's crc32) */
static uint32_t crc32_bytes(const char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= (uint8_t)p[i];
        for (int b = 0; b < 8; b++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
    }
    return c ^ 0xFFFFFFFFu;
}

/* randomk.draw_seeds: the CRC-32 of "seed:step:key_hash:n" and of that text + ":randomk" */
static void randomk_seeds(int64_t seed, int64_t step, int64_t key_hash, int64_t n, uint32_t *s0,
                          uint32_t *s1) {
    char text[128];
    int len = snprintf(text, sizeof text - 8, "%lld:%lld:%lld:%lld", (long long)seed,
                       (long long)step, (long long)key_hash, (long long)n);
    *s0 = crc32_bytes(text, (size_t)len);
    memcpy(text + len, ":randomk", 8);
    *s1 = crc32_bytes(text, (size_t)len + 8);
}

/* Random-k per segment (randomk.compress on each tensor alone): segment s of x, k[s] draws
 * seeded by (seed, step, key_hash[s], len[s]); indices relative to x, segments in order. */
#define DEF_RANDOMK_SEGMENTS(T, SFX)                                                        \
    void randomk_segments_##SFX(T *x, int64_t nseg, const int64_t *off, const int64_t *len,\
                                const int64_t *k, const int64_t *key_hash, int64_t seed,    \
                                int64_t step, int zero, int64_t *idx, T *val) {             \
        int64_t c = 0;                                                                      \
        for (int64_t s = 0; s < nseg; s++) {                                                \
            uint32_t s0, s1;                                                                \
            randomk_seeds(seed, step, key_hash[s], len[s], &s0, &s1);                       \
            randomk_gather_##SFX(x + off[s], len[s], k[s], s0, s1, zero, idx + c, val + c); \
            for (int64_t j = 0; j < k[s]; j++) idx[c + j] += off[s];                        \
            c += k[s];                                                                      \
        }                                                                                   \
    }
DEF_RANDOMK_SEGMENTS(float, f32)
DEF_RANDOMK_SEGMENTS(double, f64)

/* sum of v_j^2 in double over LANES partial sums */
#define DEF_SUM_SQUARES(T, SFX)                                                             \
    static inline double sum_squares_##SFX(const T *v, int64_t len) {                      \
        double acc[LANES] = {0};                                                            \
        int64_t j = 0;                                                                      \
        for (; j + LANES <= len; j += LANES)                                                \
            for (int l = 0; l < LANES; l++) acc[l] += (double)v[j + l] * (double)v[j + l];  \
        double s = 0.0;                                                                     \
        for (int l = 0; l < LANES; l++) s += acc[l];                                        \
        for (; j < len; j++) s += (double)v[j] * (double)v[j];                              \
        return s;                                                                           \
    }

DEF_SUM_SQUARES(float, f32)
DEF_SUM_SQUARES(double, f64)

/* Per bucket of b entries: norm = ||v||_2; q_i = sign(v_i) min(s, floor(s |v_i| / norm + U)). */
#define DEF_QSGD(T, Q, SFX, TS)                                                             \
    void qsgd_quantize_##SFX(const T *x, int64_t n, int64_t b, T levels, uint32_t s0,      \
                             uint32_t s1, T *norms, Q *q) {                                 \
        int64_t nb = (n + b - 1) / b;                                                       \
        for (int64_t k = 0; k < nb; k++) {                                                  \
            const T *v = x + k * b;                                                         \
            Q *o = q + k * b;                                                               \
            int64_t len = (k + 1) * b <= n ? b : n - k * b;                                 \
            T norm = (T)sqrt(sum_squares_##TS(v, len));                                     \
            norms[k] = norm;                                                                \
            T scale = levels / (norm > 0 ? norm : (T)1);                                    \
            uint32_t base = (uint32_t)(k * b) + s0;                                         \
            for (int64_t j = 0; j < len; j++) {                                             \
                uint32_t h = mix32((base + (uint32_t)j) ^ s1);                              \
                T u = (T)(int32_t)(h >> 8) * (T)(1.0 / 16777216.0);                         \
                T xi = floor(fabs(v[j]) * scale + u);                                       \
                xi = xi > levels ? levels : xi;                                             \
                T sg = (T)((v[j] > 0) - (v[j] < 0));                                        \
                o[j] = (Q)(int32_t)(xi * sg);                                               \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    void qsgd_dequantize_##SFX(const Q *q, int64_t n, int64_t b, const T *norms, T levels, \
                               T *out) {                                                    \
        int64_t nb = (n + b - 1) / b;                                                       \
        for (int64_t k = 0; k < nb; k++) {                                                  \
            int64_t len = (k + 1) * b <= n ? b : n - k * b;                                 \
            T f = norms[k] / levels;                                                        \
            const Q *src = q + k * b;                                                       \
            T *dst = out + k * b;                                                           \
            for (int64_t j = 0; j < len; j++) dst[j] = (T)src[j] * f;                       \
        }                                                                                   \
    }

DEF_QSGD(float, int8_t, f32_i8_scalar, f32)
DEF_QSGD(double, int8_t, f64_i8, f64)
DEF_QSGD(float, int16_t, f32_i16, f32)

/* The default QSGD case (float32, s <= 127) and its decode, QVEC entries at a time with the
 * arithmetic of the scalar loops above (the same bits). */
#if defined(__AVX512F__)
#define QVEC 16
static inline __m512i mix32v(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bU));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* o[j] = the rounded level of v[j], j < 16, whose noise counter is ctr + j */
static inline void qsgd_round_vec(const float *v, float scale, float levels, uint32_t ctr,
                                  uint32_t s1, int8_t *o) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 lv = _mm512_set1_ps(levels), zero = _mm512_setzero_ps();
    __m512i h = mix32v(_mm512_xor_si512(_mm512_add_epi32(_mm512_set1_epi32((int)ctr), iota),
                                        _mm512_set1_epi32((int)s1)));
    __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), _mm512_set1_ps(1.0f / 16777216.0f));
    __m512 vv = _mm512_loadu_ps(v);
    __m512 xi = _mm512_add_ps(_mm512_mul_ps(_mm512_abs_ps(vv), _mm512_set1_ps(scale)), u);
    xi = _mm512_roundscale_ps(xi, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    xi = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(xi, lv, _CMP_GT_OQ), xi, lv);
    __m512i qi = _mm512_cvttps_epi32(xi);
    __mmask16 pos = _mm512_cmp_ps_mask(vv, zero, _CMP_GT_OQ);
    __mmask16 neg = _mm512_cmp_ps_mask(vv, zero, _CMP_LT_OQ);
    qi = _mm512_maskz_mov_epi32(pos | neg, qi);
    qi = _mm512_mask_sub_epi32(qi, neg, _mm512_setzero_si512(), qi);
    _mm_storeu_si128((__m128i *)o, _mm512_cvtepi32_epi8(qi));
}

/* dst[j] = q[j] * f, j < 16, one streaming store (dst 64-byte aligned) */
static inline void qsgd_scale_vec(const int8_t *q, float f, float *dst) {
    __m512i qi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
    _mm512_stream_ps(dst, _mm512_mul_ps(_mm512_cvtepi32_ps(qi), _mm512_set1_ps(f)));
}
#elif defined(__AVX2__)
#define QVEC 8
static inline __m256i mix32v(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bU));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* o[j] = the rounded level of v[j], j < 8, whose noise counter is ctr + j (the sign by
 * masks: 0 where v is 0 or NaN, negated where v < 0) */
static inline void qsgd_round_vec(const float *v, float scale, float levels, uint32_t ctr,
                                  uint32_t s1, int8_t *o) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 lv = _mm256_set1_ps(levels), zero = _mm256_setzero_ps();
    __m256i h = mix32v(_mm256_xor_si256(_mm256_add_epi32(_mm256_set1_epi32((int)ctr), iota),
                                        _mm256_set1_epi32((int)s1)));
    __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(1.0f / 16777216.0f));
    __m256 vv = _mm256_loadu_ps(v);
    __m256 xi = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(abs8(vv), _mm256_set1_ps(scale)), u));
    xi = _mm256_blendv_ps(xi, lv, _mm256_cmp_ps(xi, lv, _CMP_GT_OQ));
    __m256i qi = _mm256_cvttps_epi32(xi);
    __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(vv, zero, _CMP_GT_OQ));
    __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(vv, zero, _CMP_LT_OQ));
    qi = _mm256_and_si256(qi, _mm256_or_si256(pos, neg));
    qi = _mm256_sub_epi32(_mm256_xor_si256(qi, neg), neg);
    /* the low byte of each lane (a truncation, as _mm512_cvtepi32_epi8 and the scalar cast) */
    qi = _mm256_shuffle_epi8(qi, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                  0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    _mm_storel_epi64((__m128i *)o, _mm_unpacklo_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1)));
}

/* dst[j] = q[j] * f, j < 8, one streaming store (dst 32-byte aligned) */
static inline void qsgd_scale_vec(const int8_t *q, float f, float *dst) {
    __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q));
    _mm256_stream_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(qi), _mm256_set1_ps(f)));
}
#endif

void qsgd_quantize_f32_i8(const float *x, int64_t n, int64_t b, float levels, uint32_t s0,
                          uint32_t s1, float *norms, int8_t *q) {
#ifdef QVEC
    int64_t nb = (n + b - 1) / b;
    for (int64_t k = 0; k < nb; k++) {
        const float *v = x + k * b;
        int8_t *o = q + k * b;
        int64_t len = (k + 1) * b <= n ? b : n - k * b;
        float norm = (float)sqrt(sum_squares_f32(v, len));
        norms[k] = norm;
        float scale = levels / (norm > 0 ? norm : 1.0f);
        uint32_t base = (uint32_t)(k * b) + s0;
        int64_t j = 0;
        for (; j + QVEC <= len; j += QVEC) qsgd_round_vec(v + j, scale, levels, base + (uint32_t)j, s1, o + j);
        for (; j < len; j++) {
            uint32_t hh = mix32((base + (uint32_t)j) ^ s1);
            float u = (float)(int32_t)(hh >> 8) * (float)(1.0 / 16777216.0);
            float xi = floor(fabs(v[j]) * scale + u);
            xi = xi > levels ? levels : xi;
            float sg = (float)((v[j] > 0) - (v[j] < 0));
            o[j] = (int8_t)(int32_t)(xi * sg);
        }
    }
#else
    qsgd_quantize_f32_i8_scalar(x, n, b, levels, s0, s1, norms, q);
#endif
}

/* the same products as the scalar loop, written with streaming stores (the output is not
 * read back here, so its old contents need not be fetched) */
void qsgd_dequantize_f32_i8(const int8_t *q, int64_t n, int64_t b, const float *norms,
                            float levels, float *out) {
#ifdef QVEC
    if (((uintptr_t)out & (4 * QVEC - 1)) == 0 && b % QVEC == 0) {
        int64_t nb = (n + b - 1) / b;
        for (int64_t k = 0; k < nb; k++) {
            int64_t len = (k + 1) * b <= n ? b : n - k * b;
            float f = norms[k] / levels;
            const int8_t *src = q + k * b;
            float *dst = out + k * b;
            int64_t j = 0;
            for (; j + QVEC <= len; j += QVEC) qsgd_scale_vec(src + j, f, dst + j);
            for (; j < len; j++) dst[j] = (float)src[j] * f;
        }
        _mm_sfence();
        return;
    }
#endif
    qsgd_dequantize_f32_i8_scalar(q, n, b, norms, levels, out);
}
DEF_QSGD(double, int16_t, f64_i16, f64)

/* quantize._mix64 (SplitMix64's finalizer) */
static inline uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* QSGD per segment (qsgd.compress on each tensor alone): segment s of x quantized with
 * buckets of b entries (b = 0: the whole segment) and the noise words of
 * qsgd.noise_words(stream, key[s], call); its norms and levels follow the previous
 * segment's in norms and q. */
#define DEF_QSGD_SEGMENTS(T, Q, SFX, QUANT)                                                 \
    void qsgd_segments_##SFX(const T *x, int64_t nseg, const int64_t *off, const int64_t *len,\
                             const int64_t *key, int64_t b, T levels, uint64_t stream,     \
                             uint64_t call, T *norms, Q *q) {                               \
        int64_t nb = 0, c = 0;                                                              \
        for (int64_t s = 0; s < nseg; s++) {                                                \
            uint64_t h = mix64(mix64(mix64(stream) ^ (uint64_t)key[s]) ^ call);             \
            int64_t bs = b > 0 ? b : (len[s] > 0 ? len[s] : 1);                             \
            qsgd_quantize_##QUANT(x + off[s], len[s], bs, levels, (uint32_t)h,             \
                                     (uint32_t)(h >> 32), norms + nb, q + c);               \
            nb += (len[s] + bs - 1) / bs;                                                   \
            c += len[s];                                                                    \
        }                                                                                   \
    }                                                                                       \
    /* out[segment s] += level * (norm / levels) per bucket (one rank's payload) */         \
    void qsgd_dequantize_add_segments_##SFX(const Q *q, int64_t nseg, const int64_t *off,  \
                                            const int64_t *len, int64_t b, const T *norms,  \
                                            T levels, T *out) {                             \
        int64_t nb = 0, c = 0;                                                              \
        for (int64_t s = 0; s < nseg; s++) {                                                \
            int64_t bs = b > 0 ? b : (len[s] > 0 ? len[s] : 1);                             \
            for (int64_t i = 0; i < len[s]; i += bs, nb++) {                                \
                T f = norms[nb] / levels;                                                   \
                int64_t m = i + bs <= len[s] ? bs : len[s] - i;                             \
                const Q *src = q + c + i;                                                   \
                T *dst = out + off[s] + i;                                                  \
                for (int64_t j = 0; j < m; j++) dst[j] += (T)src[j] * f;                    \
            }                                                                               \
            c += len[s];                                                                    \
        }                                                                                   \
    }
DEF_QSGD_SEGMENTS(float, int8_t, f32, f32_i8)
DEF_QSGD_SEGMENTS(double, int8_t, f64, f64_i8)
DEF_QSGD_SEGMENTS(float, int16_t, f32_i16, f32_i16)
DEF_QSGD_SEGMENTS(double, int16_t, f64_i16, f64_i16)

/* QSGD's wire format: level i as a w-bit two's-complement field (w = ceil(log2(s + 1)) + 1:
 * the level's bits and a sign bit), packed little-endian: entry i holds stream bits
 * [i w, (i + 1) w), bit j of the stream is bit j % 8 of byte j / 8. w <= 17 here. For
 * w <= 8 eight entries fill exactly w bytes, so groups of 8 go through one 64-bit word. */
/* eight fields of w <= 8 bits in one word: with BMI2 one pext of the eight int8 levels */
static inline uint64_t pack8_generic(const int8_t *q, int w, uint64_t mask) {
    uint64_t acc = 0;
    for (int t = 0; t < 8; t++) acc |= ((uint64_t)(int64_t)q[t] & mask) << (t * w);
    return acc;
}
static inline uint64_t pack8_i8(const int8_t *q, int w, uint64_t mask) {
#ifdef __BMI2__
    uint64_t word;
    memcpy(&word, q, 8);
    (void)w;
    return _pext_u64(word, 0x0101010101010101ULL * mask);
#else
    return pack8_generic(q, w, mask);
#endif
}
#define PACK8_i8(q, w, mask) pack8_i8(q, w, mask)
#define PACK8_i16(q, w, mask) 0 /* w <= 8 never comes with int16 levels */

#define DEF_QSGD_PACK(Q, SFX)                                                               \
    void qsgd_pack_##SFX(const Q *q, int64_t n, int w, uint8_t *out) {                     \
        const uint64_t mask = (1ULL << w) - 1;                                              \
        const int64_t nbytes = (n * w + 7) / 8;                                             \
        int64_t i = 0;                                                                      \
        if (w <= 8)                                                                         \
            for (; i + 8 <= n && i / 8 * w + 8 <= nbytes; i += 8) {                         \
                uint64_t acc = PACK8_##SFX(q + i, w, mask);                                 \
                memcpy(out + i / 8 * w, &acc, 8); /* the next group overwrites the spill */ \
            }                                                                               \
        uint8_t *o = out + i / 8 * w; /* i is a multiple of 8: a byte boundary */           \
        uint64_t acc = 0;                                                                   \
        int fill = 0;                                                                       \
        for (; i < n; i++) {                                                                \
            acc |= ((uint64_t)(int64_t)q[i] & mask) << fill;                                \
            fill += w;                                                                      \
            for (; fill >= 8; fill -= 8, acc >>= 8) *o++ = (uint8_t)acc;                    \
        }                                                                                   \
        if (fill > 0) *o = (uint8_t)acc;                                                    \
    }
DEF_QSGD_PACK(int8_t, i8)
DEF_QSGD_PACK(int16_t, i16)

/* field i of the stream, sign-extended (random access; w <= 17 fits 3 bytes after a shift) */
static inline int64_t qsgd_field(const uint8_t *p, int64_t nbytes, int64_t i, int w) {
    int64_t bit = i * w, byte = bit >> 3;
    uint64_t acc = 0;
    for (int j = 0; j < 4 && byte + j < nbytes; j++) acc |= (uint64_t)p[byte + j] << (8 * j);
    const int up = 64 - w;
    return (int64_t)(((acc >> (bit & 7)) & ((1ULL << w) - 1)) << up) >> up;
}

/* For w < 8: q_i = level_i * 2^(8 - w) as int8 (the field in the high bits of a byte, so
 * the byte is its two's complement); the caller scales by norm / (s 2^(8 - w)), which is the
 * same product bit for bit (powers of two change no mantissa). With BMI2 one pdep per 8. */
void qsgd_unpack_i8(const uint8_t *p, int64_t n, int w, int8_t *q) {
    const int64_t nbytes = (n * w + 7) / 8;
    const uint64_t mask = (1ULL << w) - 1;
    int64_t i = 0;
    for (; i + 8 <= n && i / 8 * w + 8 <= nbytes; i += 8) {
        uint64_t acc, word = 0;
        memcpy(&acc, p + i / 8 * w, 8);
#ifdef __BMI2__
        word = _pdep_u64(acc, 0x0101010101010101ULL * (mask << (8 - w)));
#else
        for (int t = 0; t < 8; t++) word |= (((acc >> (t * w)) & mask) << (8 - w)) << (8 * t);
#endif
        memcpy(q + i, &word, 8);
    }
    for (; i < n; i++) q[i] = (int8_t)(qsgd_field(p, nbytes, i, w) * (1 << (8 - w)));
}

/* For 8 < w < 16 (s = 128 .. 16383): q_i = level_i * 2^(16 - w) as int16, scaled back by the
 * caller as qsgd_unpack_i8's levels are. */
void qsgd_unpack_i16(const uint8_t *p, int64_t n, int w, int16_t *q) {
    const int64_t nbytes = (n * w + 7) / 8;
    for (int64_t i = 0; i < n; i++) q[i] = (int16_t)(qsgd_field(p, nbytes, i, w) * (1 << (16 - w)));
}

/* Decode the packed levels of n entries and scale them: out_i = level_i * (norm_k / s). */
#define DEF_QSGD_UNPACK(T, SFX)                                                             \
    void qsgd_dequantize_packed_##SFX(const uint8_t *p, int64_t n, int64_t b,              \
                                      const T *norms, T levels, int w, T *out) {            \
        const int64_t nbytes = (n * w + 7) / 8;                                             \
        const uint64_t mask = (1ULL << w) - 1;                                              \
        const int up = 64 - w;                                                              \
        for (int64_t k = 0; k * b < n; k++) {                                               \
            const int64_t start = k * b, len = (k + 1) * b <= n ? b : n - k * b;            \
            const T f = norms[k] / levels;                                                  \
            T *dst = out + start;                                                           \
            int64_t j = 0;                                                                  \
            if (w <= 8 && start % 8 == 0)                                                   \
                for (; j + 8 <= len && (start + j) / 8 * w + 8 <= nbytes; j += 8) {         \
                    uint64_t acc;                                                           \
                    memcpy(&acc, p + (start + j) / 8 * w, 8);                               \
                    for (int t = 0; t < 8; t++)                                             \
                        dst[j + t] = (T)((int64_t)(((acc >> (t * w)) & mask) << up) >> up) * f; \
                }                                                                           \
            for (; j < len; j++) dst[j] = (T)qsgd_field(p, nbytes, start + j, w) * f;       \
        }                                                                                   \
    }
DEF_QSGD_UNPACK(float, f32)
DEF_QSGD_UNPACK(double, f64)

/* QSGD's Elias coding (the paper's section 3): a bit stream (bit j = bit j % 8 of byte
 * j / 8; each codeword written most significant bit first) holding omega(nnz + 1), then
 * per nonzero level, in index order, omega(index - previous index) (previous = -1 at
 * first), a sign bit (1: negative) and omega(|level|). omega is Elias's recursive code:
 * N > 1 is written as the binary groups of N_k ... N_1 N_0 (N_0 = N, N_{i+1} = bits(N_i) - 1,
 * down to 1), then a 0; N = 1 is the single 0. */
static inline int bit_length(uint64_t v) { return 64 - __builtin_clzll(v); }

static inline int64_t omega_bits(uint64_t v) {
    int64_t total = 1;
    while (v > 1) {
        int nb = bit_length(v);
        total += nb;
        v = (uint64_t)(nb - 1);
    }
    return total;
}

static inline void put_bits(uint8_t *out, int64_t cap_bits, int64_t *pos, uint64_t v, int nb) {
    for (int j = nb - 1; j >= 0; j--, (*pos)++)
        if (*pos < cap_bits && ((v >> j) & 1)) out[*pos >> 3] |= (uint8_t)(1u << (*pos & 7));
}

static inline void put_omega(uint8_t *out, int64_t cap_bits, int64_t *pos, uint64_t v) {
    uint64_t groups[8];
    int lens[8], g = 0;
    while (v > 1) {
        int nb = bit_length(v);
        groups[g] = v;
        lens[g++] = nb;
        v = (uint64_t)(nb - 1);
    }
    while (g-- > 0) put_bits(out, cap_bits, pos, groups[g], lens[g]);
    (*pos)++; /* the closing 0 */
}

/* Writes the stream into out (cap bytes, zeroed here) as far as it fits; returns the bits
 * the whole stream needs (the caller retries with a larger buffer when they exceed 8 cap). */
#define DEF_ELIAS_ENCODE(Q, SFX)                                                            \
    int64_t qsgd_elias_encode_##SFX(const Q *q, int64_t n, uint8_t *out, int64_t cap) {    \
        int64_t nnz = 0;                                                                    \
        for (int64_t i = 0; i < n; i++) nnz += q[i] != 0;                                   \
        memset(out, 0, (size_t)cap);                                                        \
        int64_t pos = 0, cap_bits = 8 * cap, prev = -1;                                     \
        put_omega(out, cap_bits, &pos, (uint64_t)nnz + 1);                                  \
        for (int64_t i = 0; i < n; i++) {                                                   \
            if (q[i] == 0) continue;                                                        \
            put_omega(out, cap_bits, &pos, (uint64_t)(i - prev));                           \
            put_bits(out, cap_bits, &pos, q[i] < 0, 1);                                     \
            put_omega(out, cap_bits, &pos, (uint64_t)(q[i] < 0 ? -(int64_t)q[i] : q[i]));   \
            prev = i;                                                                       \
        }                                                                                   \
        return pos;                                                                         \
    }
DEF_ELIAS_ENCODE(int8_t, i8)
DEF_ELIAS_ENCODE(int16_t, i16)

static inline int get_bit(const uint8_t *p, int64_t nbits, int64_t *pos) {
    int64_t j = (*pos)++;
    return j < nbits ? (p[j >> 3] >> (j & 7)) & 1 : 0;
}

/* omega's inverse; 0 when the stream is malformed (a group longer than 62 bits) */
static inline uint64_t get_omega(const uint8_t *p, int64_t nbits, int64_t *pos) {
    uint64_t v = 1;
    while (get_bit(p, nbits, pos)) {
        if (v > 62) return 0;
        uint64_t w = 1;
        for (uint64_t j = 0; j < v; j++) w = (w << 1) | (uint64_t)get_bit(p, nbits, pos);
        v = w;
    }
    return v;
}

/* The stream's next nonzero: its index (after *prev) and signed level; -1 when the stream is
 * malformed, points past n or holds a level above s, else 0. */
static inline int elias_entry(const uint8_t *p, int64_t nbits, int64_t *pos, int64_t n, uint64_t s,
                              int64_t *prev, int64_t *level) {
    uint64_t d = get_omega(p, nbits, pos);
    int neg = get_bit(p, nbits, pos);
    uint64_t lev = get_omega(p, nbits, pos);
    if (d == 0 || lev == 0 || lev > s || (uint64_t)(n - 1 - *prev) < d) return -1;
    *prev += (int64_t)d;
    *level = neg ? -(int64_t)lev : (int64_t)lev;
    return 0;
}

/* out_i = level_i * (norm_k / s) from the stream (zero elsewhere); returns -1 when the stream
 * is malformed or points past n, else 0. */
#define DEF_ELIAS_DECODE(T, SFX)                                                            \
    int64_t qsgd_elias_decode_##SFX(const uint8_t *p, int64_t nbytes, int64_t n, int64_t b, \
                                    const T *norms, T levels, T *out) {                     \
        int64_t pos = 0, nbits = 8 * nbytes, prev = -1, level;                              \
        memset(out, 0, (size_t)n * sizeof(T));                                              \
        uint64_t count = get_omega(p, nbits, &pos);                                         \
        if (count == 0) return -1;                                                          \
        for (uint64_t c = 1; c < count; c++) {                                              \
            if (elias_entry(p, nbits, &pos, n, UINT64_MAX, &prev, &level)) return -1;       \
            T f = norms[prev / b] / levels;                                                 \
            out[prev] = (T)level * f;                                                       \
        }                                                                                   \
        return 0;                                                                           \
    }
DEF_ELIAS_DECODE(float, f32)
DEF_ELIAS_DECODE(double, f64)

/* The signed levels of a stream (zero elsewhere) for the fused exchange, whose buckets
 * restart at every tensor; -1 when the stream is malformed, points past n or holds a level
 * above s, else 0. */
#define DEF_ELIAS_LEVELS(Q, SFX)                                                            \
    int64_t qsgd_elias_levels_##SFX(const uint8_t *p, int64_t nbytes, int64_t n, int64_t s, \
                                    Q *q) {                                                 \
        int64_t pos = 0, nbits = 8 * nbytes, prev = -1, level;                              \
        memset(q, 0, (size_t)n * sizeof(Q));                                                \
        uint64_t count = get_omega(p, nbits, &pos);                                         \
        if (count == 0) return -1;                                                          \
        for (uint64_t c = 1; c < count; c++) {                                              \
            if (elias_entry(p, nbits, &pos, n, (uint64_t)s, &prev, &level)) return -1;      \
            q[prev] = (Q)level;                                                             \
        }                                                                                   \
        return 0;                                                                           \
    }
DEF_ELIAS_LEVELS(int8_t, i8)
DEF_ELIAS_LEVELS(int16_t, i16)

/* ------------------------------------------------------------------ sign */

/* float32 rows of the table, two bytes (16 entries, one cache line) per streaming store
 * (AVX2: one byte per store); returns how many bytes it decoded */
static int64_t sign_unpack_stream(const uint8_t *packed, int64_t full, const void *table,
                                  void *out) {
    int64_t i = 0;
#ifdef __AVX512F__
    const float(*t)[8] = (const float(*)[8])table;
    float *o = (float *)out;
    for (; i + 2 <= full; i += 2) {
        __m256 lo = _mm256_loadu_ps(t[packed[i]]), hi = _mm256_loadu_ps(t[packed[i + 1]]);
        _mm512_stream_ps(o + 8 * i, _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1));
    }
    _mm_sfence();
#elif defined(__AVX2__)
    /* AVX2: one row (32 bytes) per streaming store */
    const float(*t)[8] = (const float(*)[8])table;
    float *o = (float *)out;
    for (; i < full; i++) _mm256_stream_ps(o + 8 * i, _mm256_loadu_ps(t[packed[i]]));
    _mm_sfence();
#else
    (void)packed; (void)full; (void)table; (void)out;
#endif
    return i;
}

/* bit j of byte i = (x[8i + j] >= 0); returns sum |x| (double). */
#define DEF_SIGN(T, SFX)                                                                    \
    static double sign_pack_tail_##SFX(const T *x, int64_t i, int64_t n, uint8_t *packed) {\
        double s = 0.0;                                                                     \
        for (; i < n; i += 8) {                                                             \
            uint32_t byte = 0;                                                              \
            for (int64_t j = i; j < n && j < i + 8; j++) {                                  \
                byte |= (uint32_t)(x[j] >= 0) << (j - i);                                   \
                s += fabs(x[j]);                                                            \
            }                                                                               \
            packed[i / 8] = (uint8_t)byte;                                                  \
        }                                                                                   \
        return s;                                                                           \
    }                                                                                       \
    /* out_i = bit ? scale : -scale, 8 entries at a time from a 256-row table */            \
    void sign_unpack_##SFX(const uint8_t *packed, int64_t n, T scale, T *out) {             \
        static __thread T table[256][8];                                                    \
        for (int b = 0; b < 256; b++)                                                       \
            for (int j = 0; j < 8; j++) table[b][j] = ((b >> j) & 1) ? scale : -scale;      \
        int64_t full = n / 8, i = 0;                                                        \
        if (sizeof(T) == 4 && ((uintptr_t)out & 63) == 0) i = sign_unpack_stream(packed, full, table, out); \
        for (; i < full; i++) memcpy(out + 8 * i, table[packed[i]], 8 * sizeof(T));        \
        for (int64_t i = 8 * full; i < n; i++)                                              \
            out[i] = ((packed[i >> 3] >> (i & 7)) & 1) ? scale : -scale;                    \
    }                                                                                       \
    /* in place: x_i <- x_i - (x_i >= 0 ? scale : -scale) (the EF-signSGD residual) */      \
    void sign_residual_##SFX(T *x, int64_t n, T scale) {                                    \
        for (int64_t i = 0; i < n; i++) x[i] = x[i] - (x[i] >= 0 ? scale : -scale);         \
    }

DEF_SIGN(float, f32)
DEF_SIGN(double, f64)

double sign_pack_f32(const float *x, int64_t n, uint8_t *packed) {
    int64_t i = 0;
    double s = 0.0;
#ifdef __AVX512F__
    const __m512 zero = _mm512_setzero_ps();
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __mmask16 k = _mm512_cmp_ps_mask(v, zero, _CMP_GE_OQ);
        packed[i / 8] = (uint8_t)(k & 0xFF);
        packed[i / 8 + 1] = (uint8_t)(k >> 8);
        __m512 a = _mm512_abs_ps(v);
        s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(a)));
        s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
    }
    s = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
#elif defined(__AVX2__)
    /* the bits from movemask; the sum in the AVX-512 lanes and order (the same bits) */
    const __m256 zero = _mm256_setzero_ps();
    __m256d sv[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    for (; i + 16 <= n; i += 16) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        packed[i / 8] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(v0, zero, _CMP_GE_OQ));
        packed[i / 8 + 1] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(v1, zero, _CMP_GE_OQ));
        add16_pd(sv, abs8(v0), abs8(v1));
    }
    s = reduce16_pd(sv);
#endif
    return s + sign_pack_tail_f32(x, i, n, packed);
}

double sign_pack_f64(const double *x, int64_t n, uint8_t *packed) {
    int64_t i = 0;
    double acc[LANES] = {0};
#ifdef __AVX512F__
    const __m512d zero = _mm512_setzero_pd();
    for (; i + 16 <= n; i += 16) {
        __mmask8 k0 = _mm512_cmp_pd_mask(_mm512_loadu_pd(x + i), zero, _CMP_GE_OQ);
        __mmask8 k1 = _mm512_cmp_pd_mask(_mm512_loadu_pd(x + i + 8), zero, _CMP_GE_OQ);
        packed[i / 8] = (uint8_t)k0;
        packed[i / 8 + 1] = (uint8_t)k1;
        for (int l = 0; l < 16; l++) acc[l] += fabs(x[i + l]);
    }
#elif defined(__AVX2__)
    /* the bits from movemask; acc[4 q + l] in lane l of a[q] */
    const __m256d zero = _mm256_setzero_pd();
    __m256d a[4] = {zero, zero, zero, zero};
    for (; i + 16 <= n; i += 16) {
        uint32_t k = 0;
        for (int q = 0; q < 4; q++) {
            __m256d v = _mm256_loadu_pd(x + i + 4 * q);
            k |= (uint32_t)_mm256_movemask_pd(_mm256_cmp_pd(v, zero, _CMP_GE_OQ)) << (4 * q);
            a[q] = _mm256_add_pd(a[q], abs4(v));
        }
        packed[i / 8] = (uint8_t)k;
        packed[i / 8 + 1] = (uint8_t)(k >> 8);
    }
    for (int q = 0; q < 4; q++) _mm256_storeu_pd(acc + 4 * q, a[q]);
#endif
    double s = 0.0;
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s + sign_pack_tail_f64(x, i, n, packed);
}

/* EF-signSGD per segment (signsgd.compress on each tensor alone): segment s is
 * x[off[s] : off[s] + len[s]]; its signs are packed from byte pos[s] of packed (each
 * segment starts on a byte) and its sum |x| (double) goes to sums[s]. */
#define DEF_SIGN_SEGMENTS(T, SFX)                                                           \
    void sign_pack_segments_##SFX(const T *x, int64_t nseg, const int64_t *off,            \
                                  const int64_t *len, const int64_t *pos, uint8_t *packed,  \
                                  double *sums) {                                           \
        for (int64_t s = 0; s < nseg; s++)                                                  \
            sums[s] = sign_pack_##SFX(x + off[s], len[s], packed + pos[s]);                 \
    }                                                                                       \
    /* in place per segment: x_i <- x_i - (x_i >= 0 ? scale[s] : -scale[s]) */              \
    void sign_residual_segments_##SFX(T *x, int64_t nseg, const int64_t *off,              \
                                      const int64_t *len, const T *scale) {                 \
        for (int64_t s = 0; s < nseg; s++) sign_residual_##SFX(x + off[s], len[s], scale[s]); \
    }                                                                                       \
    /* out_i += bit ? scale[s] : -scale[s] over every segment (one rank's decoded signs): \
     * whole bytes from a 256-row table of +-scale (8 adds a row, vectorized), for a       \
     * segment long enough to pay for its table; the rest entry by entry (the same sums) */ \
    void sign_unpack_add_segments_##SFX(const uint8_t *packed, int64_t nseg,               \
                                        const int64_t *off, const int64_t *len,             \
                                        const int64_t *pos, const T *scale, T *out) {       \
        static __thread T table[256][8];                                                    \
        for (int64_t s = 0; s < nseg; s++) {                                                \
            const uint8_t *p = packed + pos[s];                                             \
            T *o = out + off[s];                                                            \
            const T a = scale[s], b = -scale[s];                                            \
            int64_t i = 0;                                                                  \
            if (len[s] >= 4096) {                                                           \
                for (int r = 0; r < 256; r++)                                               \
                    for (int j = 0; j < 8; j++) table[r][j] = ((r >> j) & 1) ? a : b;       \
                for (; i + 8 <= len[s]; i += 8) {                                           \
                    const T *t = table[p[i >> 3]];                                          \
                    for (int j = 0; j < 8; j++) o[i + j] += t[j];                           \
                }                                                                           \
            }                                                                               \
            for (; i < len[s]; i++) o[i] += ((p[i >> 3] >> (i & 7)) & 1) ? a : b;          \
        }                                                                                   \
    }
DEF_SIGN_SEGMENTS(float, f32)
DEF_SIGN_SEGMENTS(double, f64)

/* ------------------------------------------------------------- k-th largest |x| (exact) */

/* The k-th largest |x_i| (1 <= k <= n) into *out, the same value as the minimum of
 * torch.topk(|x|, k): the bit patterns of non-negative floats sort as the values do (NaN
 * above +inf, as topk ranks it), so one pass counts the entries per value of the top 16
 * bits of |x|, the bin holding the k-th largest is found from the top, a second pass
 * collects that bin's entries (about n / 2^15 of them for spread-out data) and they are
 * sorted. Two reads of x instead of topk's heap of k entries. A NaN is among the k
 * largest whenever there is one, and then the minimum is NaN, as topk's is. Returns 0, or
 * -1 when memory runs out (the caller then uses topk). */
#include <stdlib.h>
static int cmp_desc_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x < y) - (x > y);
}
static int cmp_desc_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x < y) - (x > y);
}
#define KTH_BINS (1 << 15) /* the top 16 bits less the sign */
#define DEF_KTH_ABS(T, U, BITS, INF, CMP, SFX)                                                 \
    int kth_largest_abs_##SFX(const T *x, int64_t n, int64_t k, T *out) {                  \
        const int shift = BITS - 16;                                                        \
        const U mask = ~((U)1 << (BITS - 1));                                               \
        int64_t *hist = calloc(KTH_BINS, sizeof(int64_t));                                  \
        if (!hist) return -1;                                                               \
        int64_t nans = 0;                                                                   \
        for (int64_t i = 0; i < n; i++) {                                                   \
            U u;                                                                            \
            memcpy(&u, x + i, sizeof u);                                                    \
            u &= mask;                                                                      \
            hist[u >> shift]++;                                                             \
            nans += u > (U)(INF);                                                           \
        }                                                                                   \
        if (nans) {                                                                         \
            free(hist);                                                                     \
            *out = (T)NAN;                                                                  \
            return 0;                                                                       \
        }                                                                                   \
        int64_t bin = KTH_BINS - 1, above = 0;                                              \
        while (bin > 0 && above + hist[bin] < k) above += hist[bin--];                      \
        int64_t m = hist[bin];                                                              \
        free(hist);                                                                         \
        U *cand = malloc((size_t)(m > 0 ? m : 1) * sizeof(U));                              \
        if (!cand) return -1;                                                               \
        int64_t c = 0;                                                                      \
        for (int64_t i = 0; i < n && c < m; i++) {                                          \
            U u;                                                                            \
            memcpy(&u, x + i, sizeof u);                                                    \
            u &= mask;                                                                      \
            if ((int64_t)(u >> shift) == bin) cand[c++] = u;                                \
        }                                                                                   \
        qsort(cand, (size_t)c, sizeof(U), CMP);                                             \
        memcpy(out, cand + (k - above - 1), sizeof *out);                                   \
        free(cand);                                                                         \
        return 0;                                                                           \
    }
DEF_KTH_ABS(float, uint32_t, 32, 0x7f800000u, cmp_desc_u32, f32)
DEF_KTH_ABS(double, uint64_t, 64, 0x7ff0000000000000ull, cmp_desc_u64, f64)

/* ------------------------------------------------ segmented selection (the fused exchange) */

/* One call over the compressed segments of a flat buffer (hooks/_fused.py): each segment
 * keeps its own rule -- its own sample, threshold and k -- exactly as the per-tensor kernels
 * above compute them for that tensor alone; the survivors of every segment go to one output
 * (indices relative to the buffer, ascending within a segment, segments in order). */

/* the k-th largest of m non-negative float bit patterns (1 <= k <= m), a[] reordered
 * (Hoare's selection; unsigned order = value order, NaN above +inf) */
#define DEF_KTH_BITS(U, SFX)                                                                \
    static U kth_bits_##SFX(U *a, int64_t m, int64_t k) {                                  \
        int64_t lo = 0, hi = m - 1, want = k - 1; /* want-th in descending order */        \
        while (lo < hi) {                                                                   \
            U pivot = a[lo + (hi - lo) / 2];                                                \
            int64_t i = lo, j = hi;                                                         \
            while (i <= j) {                                                                \
                while (a[i] > pivot) i++;                                                   \
                while (a[j] < pivot) j--;                                                   \
                if (i <= j) { U t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }                \
            }                                                                               \
            if (want <= j) hi = j;                                                          \
            else if (want >= i) lo = i;                                                     \
            else return a[want];                                                            \
        }                                                                                   \
        return a[want];                                                                     \
    }
DEF_KTH_BITS(uint32_t, f32)
DEF_KTH_BITS(uint64_t, f64)

/* The k-th largest |s_j| of the sample s[0], s[stride], ... (m entries; work: m entries of
 * scratch), NaN when ``poison`` and the sample holds a NaN (torch.topk(...).values.min()
 * then is NaN; torch.kthvalue is a plain order statistic: poison = 0). */
#define DEF_SAMPLE_KTH(T, U, BITS, INF, SFX)                                                \
    static T sample_kth_##SFX(const T *s, int64_t stride, int64_t m, int64_t k, int poison, \
                              U *work) {                                                    \
        const U mask = ~((U)1 << (BITS - 1));                                               \
        int nan = 0;                                                                        \
        for (int64_t j = 0; j < m; j++) {                                                   \
            U u;                                                                            \
            memcpy(&u, s + j * stride, sizeof u);                                           \
            u &= mask;                                                                      \
            nan |= u > (U)(INF);                                                            \
            work[j] = u;                                                                    \
        }                                                                                   \
        T out;                                                                              \
        if (nan && poison) return (T)NAN;                                                   \
        /* a long sample: the histogram selection of kth_largest_abs (two passes) */        \
        if (m > 4096 && !nan && kth_largest_abs_##SFX((const T *)work, m, k, &out) == 0)      \
            return out;                                                                     \
        U bits = kth_bits_##SFX(work, m, k);                                                \
        memcpy(&out, &bits, sizeof out);                                                    \
        return out;                                                                         \
    }
DEF_SAMPLE_KTH(float, uint32_t, 32, 0x7f800000u, f32)
DEF_SAMPLE_KTH(double, uint64_t, 64, 0x7ff0000000000000ull, f64)

/* Gradient dropping per segment (topk.topk_select on each tensor alone): segment s is
 * x[off[s] : off[s] + len[s]]; its threshold is the (ks[s] + 1)-th largest |x| of the
 * sample x[off], x[off + stride[s]], ... (m[s] entries; ``poison[s]``: the torch.topk
 * regime, where a NaN in the sample makes it NaN), -1 when ks[s] = -1 (keep all above -1),
 * and ks[s] = -2 keeps every entry (k >= n). Selects |x| > thr; writes at most cap
 * survivors (int64 indices relative to x) and returns how many there are in all; with
 * ``zero_sent`` and when all fit, the sent entries of x are set to 0 (the residual). */
#define DEF_TOPK_SEGMENTS(T, U, SFX)                                                        \
    int64_t topk_segments_##SFX(T *x, int64_t nseg, const int64_t *off, const int64_t *len,\
                                const int64_t *stride, const int64_t *m, const int64_t *ks, \
                                const int64_t *poison, int zero_sent, int64_t cap,          \
                                int64_t *idx, T *val, U *work) {                            \
        int64_t c = 0;                                                                      \
        for (int64_t s = 0; s < nseg; s++) {                                                \
            const T *seg = x + off[s];                                                      \
            int64_t room = c < cap ? cap - c : 0, got;                                      \
            int64_t *oi = idx + (c < cap ? c : 0);                                          \
            T *ov = val + (c < cap ? c : 0);                                                \
            if (ks[s] == -2) {                                                              \
                got = len[s];                                                               \
                for (int64_t i = 0; i < len[s] && i < room; i++) { oi[i] = i; ov[i] = seg[i]; } \
            } else {                                                                        \
                T thr = ks[s] == -1 ? (T)-1 : sample_kth_##SFX(seg, stride[s], m[s], ks[s] + 1, \
                                                                (int)poison[s], work);      \
                got = select_abs_##SFX(seg, len[s], thr, 0, room, oi, ov);                  \
            }                                                                               \
            int64_t wrote = got < room ? got : room;                                        \
            for (int64_t j = 0; j < wrote; j++) oi[j] += off[s];                            \
            c += got;                                                                       \
        }                                                                                   \
        if (zero_sent && c <= cap)                                                          \
            for (int64_t j = 0; j < c; j++) x[idx[j]] = 0;                                  \
        return c;                                                                           \
    }
DEF_TOPK_SEGMENTS(float, uint32_t, f32)
DEF_TOPK_SEGMENTS(double, uint64_t, f64)

/* survivors of one DGC round into a growing buffer: (idx, val) of |v| >= thr, *cap grown
 * (realloc) until they fit; returns the count, -1 when memory runs out */
#define DEF_GROW_SELECT(T, SFX)                                                             \
    static int64_t grow_select_##SFX(const T *v, int64_t n, T thr, int64_t **idx, T **val, \
                                     int64_t *cap) {                                        \
        for (;;) {                                                                          \
            int64_t c = select_abs_##SFX(v, n, thr, 1, *cap, *idx, *val);                   \
            if (c <= *cap) return c;                                                        \
            int64_t *ni = realloc(*idx, (size_t)c * sizeof(int64_t));                       \
            if (!ni) return -1;                                                             \
            *idx = ni;                                                                      \
            T *nv = realloc(*val, (size_t)c * sizeof(T));                                   \
            if (!nv) return -1;                                                             \
            *val = nv;                                                                      \
            *cap = c;                                                                       \
        }                                                                                   \
    }
DEF_GROW_SELECT(float, f32)
DEF_GROW_SELECT(double, f64)

/* DGC per segment (dgc.momentum_select_values / dgc_select_values on each tensor alone):
 * for segment s of u, v, g (offset off[s], length len[s]), k[s] entries wanted:
 *   momentum m > 0: the sample |v'| at stride[s] of the corrected v, then the momentum
 *   correction fused with round 1; m == 0 (``plain``): v <- v + g, the sample of |v|.
 *   thr = the ks[s]-th largest of the sample (NaN if it holds one); rounds as dgc._rounds:
 *   survivors |v| >= thr; more than upper k: the k largest |v| among them (ties at the k-th
 *   value: the lowest indices); fewer than lower k: thr <- thr * lower and again, at most
 *   max_rounds. k[s] >= len[s]: every entry, 0 rounds. Then u, v <- 0 at the sent entries.
 * Output: at most cap entries (the caller reserves sum_s min(len, floor(upper k) + 1)),
 * indices relative to the buffer; rounds[s] per segment. Returns the count, -1 on memory
 * exhaustion (u and v may then be partly updated: the caller raises). */
#define DEF_DGC_SEGMENTS(T, U, SFX)                                                         \
    int64_t dgc_segments_##SFX(T *u, T *v, const T *g, int64_t nseg, const int64_t *off,   \
                               const int64_t *len, const int64_t *k, const int64_t *stride, \
                               const int64_t *ks, T mom, int nesterov, int plain,            \
                               int64_t max_rounds, double upper, double lower, int64_t cap, \
                               int64_t *idx, T *val, int64_t *rounds, T *sample, U *work) { \
        int64_t c = 0, tcap = 1024;                                                         \
        int64_t *ti = malloc((size_t)tcap * sizeof(int64_t));                               \
        T *tv = malloc((size_t)tcap * sizeof(T));                                           \
        if (!ti || !tv) { free(ti); free(tv); return -1; }                                  \
        for (int64_t s = 0; s < nseg; s++) {                                                \
            T *us = u + off[s], *vs = v + off[s];                                           \
            const T *gs = g + off[s];                                                       \
            int64_t n = len[s], kk = k[s], nnz = 0, r = 0;                                  \
            if (kk >= n) {                                                                  \
                if (plain) for (int64_t i = 0; i < n; i++) vs[i] = vs[i] + gs[i];           \
                else momentum_##SFX(us, vs, gs, n, mom, nesterov);                          \
                if (c + n > cap) { c = -1; break; }                                         \
                for (int64_t i = 0; i < n; i++) { idx[c + i] = off[s] + i; val[c + i] = vs[i]; } \
                nnz = n;                                                                    \
            } else {                                                                        \
                int64_t st = stride[s], sm = (n + st - 1) / st;                             \
                if (plain) {                                                                \
                    for (int64_t i = 0; i < n; i++) vs[i] = vs[i] + gs[i];                  \
                    for (int64_t j = 0; j < sm; j++) sample[j] = fabs(vs[j * st]);          \
                } else {                                                                    \
                    momentum_sample_##SFX(us, vs, gs, n, st, mom, nesterov, sample);        \
                }                                                                           \
                T thr = sample_kth_##SFX(sample, 1, sm, ks[s], 1, work);                    \
                for (r = 1; r <= max_rounds; r++) {                                         \
                    if (r == 1 && !plain) {                                                 \
                        nnz = momentum_select_##SFX(us, vs, gs, n, mom, nesterov, thr, tcap, ti, tv); \
                        if (nnz > tcap) nnz = grow_select_##SFX(vs, n, thr, &ti, &tv, &tcap); \
                    } else {                                                                \
                        nnz = grow_select_##SFX(vs, n, thr, &ti, &tv, &tcap);               \
                    }                                                                       \
                    if (nnz < 0) break;                                                     \
                    if ((double)nnz > upper * (double)kk) {                                 \
                        /* the k-th largest |val| among the survivors, by bit pattern */    \
                        U *bits = malloc((size_t)nnz * sizeof(U));                          \
                        if (!bits) { nnz = -1; break; }                                     \
                        for (int64_t j = 0; j < nnz; j++) {                                 \
                            T a = fabs(tv[j]);                                              \
                            memcpy(bits + j, &a, sizeof a);                                 \
                        }                                                                   \
                        U kth = kth_bits_##SFX(bits, nnz, kk);                              \
                        int64_t above = 0, kept = 0;                                        \
                        for (int64_t j = 0; j < nnz; j++) {                                 \
                            T a = fabs(tv[j]);                                              \
                            U b;                                                            \
                            memcpy(&b, &a, sizeof b);                                       \
                            above += b > kth;                                               \
                        }                                                                   \
                        int64_t ties = kk - above;                                          \
                        for (int64_t j = 0; j < nnz; j++) {                                 \
                            T a = fabs(tv[j]);                                              \
                            U b;                                                            \
                            memcpy(&b, &a, sizeof b);                                       \
                            if (b > kth || (b == kth && ties-- > 0)) {                      \
                                ti[kept] = ti[j];                                           \
                                tv[kept++] = tv[j];                                         \
                            }                                                               \
                        }                                                                   \
                        free(bits);                                                         \
                        nnz = kept;                                                         \
                        break;                                                              \
                    }                                                                       \
                    if ((double)nnz >= lower * (double)kk || r == max_rounds) break;        \
                    thr = thr * (T)lower; /* torch: a float32 0-d tensor times (float)0.8 */ \
                }                                                                           \
                if (nnz < 0 || c + nnz > cap) { c = -1; break; }                            \
                for (int64_t j = 0; j < nnz; j++) {                                         \
                    idx[c + j] = off[s] + ti[j];                                            \
                    val[c + j] = tv[j];                                                     \
                    vs[ti[j]] = 0;                                                          \
                    us[ti[j]] = 0;                                                          \
                }                                                                           \
            }                                                                               \
            if (kk >= n) {                                                                  \
                for (int64_t i = 0; i < n; i++) { vs[i] = 0; us[i] = 0; }                   \
            }                                                                               \
            rounds[s] = r;                                                                  \
            c += nnz;                                                                       \
        }                                                                                   \
        free(ti);                                                                           \
        free(tv);                                                                           \
        return c;                                                                           \
    }
DEF_DGC_SEGMENTS(float, uint32_t, f32)
DEF_DGC_SEGMENTS(double, uint64_t, f64)
