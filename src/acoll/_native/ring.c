/* acoll's native ring: the whole data path of a ring all-reduce, reduce-scatter or
 * all-gather over two TCP sockets, run by one call from a Python worker thread (ctypes
 * drops the GIL for the call).
 *
 * Contract (see acoll/_native/__init__.py, which compiles and loads this file):
 * - send_fd carries bytes to the next rank only; recv_fd brings bytes from the previous
 *   rank only. Both are connected stream sockets that nothing else reads or writes during
 *   the call; they may be non-blocking (every wait is a poll() of at most SLICE_MS).
 * - The stream of one call: a 32-byte header (the caller's, identical on every rank of a
 *   matching call), then each step's block of the ring in a fixed order that every rank
 *   derives from (mode, count, itemsize, nranks). No framing: a rank that disagrees on
 *   any of those sends a different header, which the receiver refuses before it reads
 *   any data (NR_MISMATCH, the peer's header copied out).
 * - The steps, and the order of every reduction, are those of acoll's Python rings
 *   (acoll/_coll/algorithms.py: RingAllReduce, RingReduceScatter, RingAllGather), so the
 *   results are the same bits. src is only read; all-reduce may run in place (src ==
 *   dst); all-gather copies src into dst's own block first unless it is that block.
 * - Two threads: the caller's receives and reduces; its helper thread (one per calling
 *   thread, kept between calls) sends each step's block as the caller produces it (the
 *   block a rank sends at step t is the one it received at step t-1). A call that sends
 *   at most inline_max bytes in all runs on the caller's thread alone instead (both
 *   sockets non-blocking, one poll() for both): no hand-offs between threads, which
 *   small calls feel. The bytes on the wire are the same either way, so ranks may
 *   choose differently.
 * - It returns when done, on an error of either socket, when *abort becomes non-zero, or
 *   at deadline_ns (CLOCK_MONOTONIC; 0: none). Progress counters and the error's errno go
 *   to *state.
 * - Staged all-reduce (stage != NULL): src/dst are a host copy of device data whose copies
 *   run beside the ring. Both directions go in pieces of stage->piece items within each
 *   segment (the segments as the ring splits count). Downloads land in the order the ring
 *   first reads the segments (r, r-1, ..., r+1), and whoever copies bumps *stage->ready
 *   once per landed piece (a GPU stream: cuStreamWriteValue32); the ring reads no piece of
 *   src before the counter says it landed. The ring bumps *stage->final once per piece of
 *   the result that is final, in the order they become final (segments r+1, r, r-1, ...,
 *   r+2), so that a copier (a GPU stream: cuStreamWaitValue32) uploads each at once. Both
 *   counters count from their base values and compare cyclically (wrap-around is fine).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sched.h>
#include <time.h>

#define ACOLL_NR_VERSION 5
#define HEADER_SIZE 32
#define SLICE_MS 50

enum {
    NR_OK = 0,
    NR_PEER_CLOSED = 1, /* the previous rank closed its end (EOF) */
    NR_SEND_FAILED = 2, /* errno in state->err */
    NR_RECV_FAILED = 3, /* errno in state->err */
    NR_ABORTED = 4,
    NR_DEADLINE = 5,
    NR_MISMATCH = 6, /* the previous rank's header differs: in peer_header */
    NR_BAD_ARGS = 7,
    NR_NO_MEMORY = 8,
};

enum { DT_I8 = 0, DT_U8 = 1, DT_I32 = 2, DT_U32 = 3, DT_I64 = 4, DT_U64 = 5,
       DT_F16 = 6, DT_BF16 = 7, DT_F32 = 8, DT_F64 = 9 };
enum { OP_SUM = 0, OP_PROD = 1, OP_MAX = 2, OP_MIN = 3, OP_AVG = 4 };

typedef struct {
    int64_t sent;       /* bytes written to send_fd (header included) */
    int64_t received;   /* bytes read from recv_fd (header included) */
    int32_t err;        /* errno of a failed socket call */
    volatile int32_t abort;  /* set non-zero (from any thread) to stop the call */
} nr_state;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ------------------------------------------------------------------ reductions */
/* out = a (op) b, matching NumPy's ufuncs bit for bit: integer arithmetic wraps (done
 * unsigned), maximum/minimum propagate NaN and return b on ties (as np.maximum does). */
#define ARITH(NAME, T, U)                                                               \
    static void NAME(T *out, const T *a, const T *b, int64_t n, int op) {               \
        int64_t i;                                                                      \
        switch (op) {                                                                   \
        case OP_SUM: case OP_AVG:                                                       \
            for (i = 0; i < n; i++) out[i] = (T)((U)a[i] + (U)b[i]);                    \
            break;                                                                      \
        case OP_PROD:                                                                   \
            for (i = 0; i < n; i++) out[i] = (T)((U)a[i] * (U)b[i]);                    \
            break;                                                                      \
        case OP_MAX:                                                                    \
            for (i = 0; i < n; i++) out[i] = a[i] > b[i] ? a[i] : b[i];                 \
            break;                                                                      \
        default:                                                                        \
            for (i = 0; i < n; i++) out[i] = a[i] < b[i] ? a[i] : b[i];                 \
        }                                                                               \
    }
ARITH(red_i8, int8_t, uint8_t)
ARITH(red_u8, uint8_t, uint8_t)
ARITH(red_i32, int32_t, uint32_t)
ARITH(red_u32, uint32_t, uint32_t)
ARITH(red_i64, int64_t, uint64_t)
ARITH(red_u64, uint64_t, uint64_t)

#define FLOATS(NAME, T)                                                                 \
    static void NAME(T *out, const T *a, const T *b, int64_t n, int op) {               \
        int64_t i;                                                                      \
        switch (op) {                                                                   \
        case OP_SUM: case OP_AVG:                                                       \
            for (i = 0; i < n; i++) out[i] = a[i] + b[i];                               \
            break;                                                                      \
        case OP_PROD:                                                                   \
            for (i = 0; i < n; i++) out[i] = a[i] * b[i];                               \
            break;                                                                      \
        case OP_MAX:                                                                    \
            for (i = 0; i < n; i++) {                                                   \
                T x = a[i], y = b[i];                                                   \
                out[i] = (x != x) ? x : (y != y) ? y : (x > y ? x : y);                 \
            }                                                                           \
            break;                                                                      \
        default:                                                                        \
            for (i = 0; i < n; i++) {                                                   \
                T x = a[i], y = b[i];                                                   \
                out[i] = (x != x) ? x : (y != y) ? y : (x < y ? x : y);                 \
            }                                                                           \
        }                                                                               \
    }
FLOATS(red_f32, float)
FLOATS(red_f64, double)

/* sum / nranks in place: float division in the dtype; integers truncated toward zero
 * (C's division, in 64 bits so that nranks never overflows the type; NumPy's
 * floor_divide for unsigned types is the same) */
#define AVERAGE(NAME, T, W)                                                             \
    static void NAME(T *p, int64_t n, int nranks) {                                     \
        for (int64_t i = 0; i < n; i++) p[i] = (T)((W)p[i] / (W)nranks);                \
    }
AVERAGE(avg_i8, int8_t, int64_t)
AVERAGE(avg_u8, uint8_t, uint64_t)
AVERAGE(avg_i32, int32_t, int64_t)
AVERAGE(avg_u32, uint32_t, uint64_t)
AVERAGE(avg_i64, int64_t, int64_t)
AVERAGE(avg_u64, uint64_t, uint64_t)
AVERAGE(avg_f32, float, float)
AVERAGE(avg_f64, double, double)

/* ------------------------------------------------------------------ 16-bit floats */
/* float16 (IEEE binary16) and bfloat16 values combine as NumPy's float16 loops and
 * ml_dtypes' bfloat16 do (and acoll's GPU kernels): both operands widened to float32
 * (exact), one float32 operation, one rounding back to nearest-even. maximum/minimum
 * return an operand's own bits: a NaN operand wins (the first if both are), and on ties
 * (+0 against -0) float16 keeps the first operand and bfloat16 the second, as those
 * libraries do. NaN results: float16 keeps the top of the float32 payload, bfloat16
 * gives the sign and 0x7fc0; two NaN operands give the second's (see nan_pick). Not
 * under -ffast-math: the subnormal rounding below relies on IEEE float32 addition. */
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (e == 0x1fu) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e != 0) {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    } else {  /* zero or subnormal: m units of 2^-24, exact in float32 */
        f = (float)m * 0x1p-24f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f2h(float f) {
    uint32_t x, ax;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) {  /* NaN: the payload's top ten bits, and still a NaN */
        uint16_t r = (uint16_t)(0x7c00u | ((ax & 0x7fffffu) >> 13));
        return (uint16_t)(sign | (r == 0x7c00u ? 0x7c01u : r));
    }
    if (ax >= 0x477ff000u)  /* 65520 and up (the tie above 65504 goes to even): inf */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) {
        /* below 2^-14, a multiple of 2^-24: exactly the unit in the last place of 0.5f,
         * so the float32 sum 0.5f + |f| rounds |f| to it (nearest-even) */
        float a, t;
        uint32_t tb;
        memcpy(&a, &ax, 4);
        t = a + 0.5f;
        memcpy(&tb, &t, 4);
        return (uint16_t)(sign | (tb - 0x3f000000u));
    }
    /* rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest-even;
     * a carry runs into the exponent as it should */
    return (uint16_t)(sign | ((ax + 0xc8000fffu + ((ax >> 13) & 1u)) >> 13));
}

static inline float b2f(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f2b(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)(((x >> 16) & 0x8000u) | 0x7fc0u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* Where both operands of a sum or product are NaNs, the result is the second one's
 * (quieted), whatever order the compiler gives the operands and wherever the element
 * sits in the array (the vector loops and the scalar tails agree): the first operand is
 * replaced by the second before the operation. */
static inline float nan_pick(float x, float y) { return (x != x && y != y) ? y : x; }

#define HALVES(NAME, TOF, FROMF, TIE_FIRST)                                             \
    static void NAME(uint16_t *out, const uint16_t *a, const uint16_t *b, int64_t n,     \
                     int op) {                                                           \
        int64_t i;                                                                      \
        switch (op) {                                                                   \
        case OP_SUM: case OP_AVG:                                                       \
            for (i = 0; i < n; i++) {                                                   \
                float y = TOF(b[i]);                                                    \
                out[i] = FROMF(nan_pick(TOF(a[i]), y) + y);                             \
            }                                                                           \
            break;                                                                      \
        case OP_PROD:                                                                   \
            for (i = 0; i < n; i++) {                                                   \
                float y = TOF(b[i]);                                                    \
                out[i] = FROMF(nan_pick(TOF(a[i]), y) * y);                             \
            }                                                                           \
            break;                                                                      \
        default: {                                                                      \
            int want_max = op == OP_MAX;                                                \
            for (i = 0; i < n; i++) {                                                   \
                uint16_t x = a[i], y = b[i];                                            \
                float fx = TOF(x), fy = TOF(y);                                         \
                out[i] = fx != fx ? x : fy != fy ? y                                    \
                       : fx == fy ? (TIE_FIRST ? x : y)                                 \
                       : ((fx > fy) == want_max) ? x : y;                               \
            }                                                                           \
        }                                                                               \
        }                                                                               \
    }
HALVES(red_f16_plain, h2f, f2h, 1)
HALVES(red_bf16_plain, b2f, f2b, 0)

/* scale: out = a * f (AVG's scaling of an input), one rounding */
#define SCALE16(NAME, TOF, FROMF)                                                       \
    static void NAME(uint16_t *out, const uint16_t *a, int64_t n, float f) {             \
        for (int64_t i = 0; i < n; i++) out[i] = FROMF(TOF(a[i]) * f);                   \
    }
SCALE16(scale_f16_plain, h2f, f2h)
SCALE16(scale_bf16_plain, b2f, f2b)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ACOLL_X86 1
/* The same arithmetic 8 values at a time: F16C's conversions are exact one way and
 * round to nearest-even the other, as f2h does (NaN results of arithmetic are quiet
 * NaNs either way); bfloat16 with AVX2 integer rounding. Only where the CPU has them. */
#define F16C_ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* nan_pick on 8 lanes: x, or y where both are NaNs */
__attribute__((target("avx2")))
static inline __m256 nan_pick8(__m256 x, __m256 y) {
    __m256 both = _mm256_and_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q),
                                _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    return _mm256_blendv_ps(x, y, both);
}

__attribute__((target("avx2,f16c")))
static void arith_f16_x86(uint16_t *out, const uint16_t *a, const uint16_t *b, int64_t n,
                          int mul) {
    int64_t i = 0;
    if (mul) {
        for (; i + 8 <= n; i += 8) {
            __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
            __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
            _mm_storeu_si128((__m128i *)(out + i),
                             _mm256_cvtps_ph(_mm256_mul_ps(nan_pick8(x, y), y), F16C_ROUND));
        }
    } else {
        for (; i + 8 <= n; i += 8) {
            __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
            __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
            _mm_storeu_si128((__m128i *)(out + i),
                             _mm256_cvtps_ph(_mm256_add_ps(nan_pick8(x, y), y), F16C_ROUND));
        }
    }
    red_f16_plain(out + i, a + i, b + i, n - i, mul ? OP_PROD : OP_SUM);
}

__attribute__((target("avx2,f16c")))
static void scale_f16_x86(uint16_t *out, const uint16_t *a, int64_t n, float f) {
    int64_t i = 0;
    __m256 k = _mm256_set1_ps(f);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_mul_ps(x, k), F16C_ROUND));
    }
    scale_f16_plain(out + i, a + i, n - i, f);
}

__attribute__((target("avx2")))
static inline __m256 b8_to_f(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

__attribute__((target("avx2")))
static inline void f_to_b8(uint16_t *p, __m256 v) {
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nan = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(x, 16),
                                                   _mm256_set1_epi32(0x8000)),
                                  _mm256_set1_epi32(0x7fc0));
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    /* eight 32-bit words (each < 2^16) to eight 16-bit ones, in order */
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
}

__attribute__((target("avx2")))
static void arith_bf16_x86(uint16_t *out, const uint16_t *a, const uint16_t *b, int64_t n,
                           int mul) {
    int64_t i = 0;
    if (mul) {
        for (; i + 8 <= n; i += 8) {
            __m256 y = b8_to_f(b + i);
            f_to_b8(out + i, _mm256_mul_ps(nan_pick8(b8_to_f(a + i), y), y));
        }
    } else {
        for (; i + 8 <= n; i += 8) {
            __m256 y = b8_to_f(b + i);
            f_to_b8(out + i, _mm256_add_ps(nan_pick8(b8_to_f(a + i), y), y));
        }
    }
    red_bf16_plain(out + i, a + i, b + i, n - i, mul ? OP_PROD : OP_SUM);
}

__attribute__((target("avx2")))
static void scale_bf16_x86(uint16_t *out, const uint16_t *a, int64_t n, float f) {
    int64_t i = 0;
    __m256 k = _mm256_set1_ps(f);
    for (; i + 8 <= n; i += 8) f_to_b8(out + i, _mm256_mul_ps(b8_to_f(a + i), k));
    scale_bf16_plain(out + i, a + i, n - i, f);
}

/* whether the vector paths run: the CPU has them and acoll_nr_set_simd did not turn
 * them off (-1: not asked yet) */
static int simd_on = -1;

static int simd(void) {
    int on = __atomic_load_n(&simd_on, __ATOMIC_RELAXED);
    if (on < 0) {
        __builtin_cpu_init();
        on = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
        __atomic_store_n(&simd_on, on, __ATOMIC_RELAXED);
    }
    return on;
}
#endif

/* Use the vector paths where the CPU has them (on != 0), or the plain loops (0); returns
 * whether the vector paths now run. The results are the same bits either way. */
int acoll_nr_set_simd(int on) {
#ifdef ACOLL_X86
    __builtin_cpu_init();
    on = on && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    __atomic_store_n(&simd_on, on, __ATOMIC_RELAXED);
    return on;
#else
    (void)on;
    return 0;
#endif
}

static void red_f16(uint16_t *out, const uint16_t *a, const uint16_t *b, int64_t n, int op) {
#ifdef ACOLL_X86
    if ((op == OP_SUM || op == OP_AVG || op == OP_PROD) && simd()) {
        arith_f16_x86(out, a, b, n, op == OP_PROD);
        return;
    }
#endif
    red_f16_plain(out, a, b, n, op);
}

static void red_bf16(uint16_t *out, const uint16_t *a, const uint16_t *b, int64_t n,
                     int op) {
#ifdef ACOLL_X86
    if ((op == OP_SUM || op == OP_AVG || op == OP_PROD) && simd()) {
        arith_bf16_x86(out, a, b, n, op == OP_PROD);
        return;
    }
#endif
    red_bf16_plain(out, a, b, n, op);
}

static void scale_f16(uint16_t *out, const uint16_t *a, int64_t n, float f) {
#ifdef ACOLL_X86
    if (simd()) {
        scale_f16_x86(out, a, n, f);
        return;
    }
#endif
    scale_f16_plain(out, a, n, f);
}

static void scale_bf16(uint16_t *out, const uint16_t *a, int64_t n, float f) {
#ifdef ACOLL_X86
    if (simd()) {
        scale_bf16_x86(out, a, n, f);
        return;
    }
#endif
    scale_bf16_plain(out, a, n, f);
}

/* sum / nranks for 16-bit floats: float32 division, one rounding (integer AVG's
 * finish; floating-point AVG scales its inputs instead) */
static void avg_f16(uint16_t *p, int64_t n, int nranks) {
    for (int64_t i = 0; i < n; i++) p[i] = f2h(h2f(p[i]) / (float)nranks);
}

static void avg_bf16(uint16_t *p, int64_t n, int nranks) {
    for (int64_t i = 0; i < n; i++) p[i] = f2b(b2f(p[i]) / (float)nranks);
}

static int itemsize_of(int dtype) {
    switch (dtype) {
    case DT_I8: case DT_U8: return 1;
    case DT_F16: case DT_BF16: return 2;
    case DT_I32: case DT_U32: case DT_F32: return 4;
    case DT_I64: case DT_U64: case DT_F64: return 8;
    default: return 0;
    }
}

static void reduce_into(void *out, const void *a, const void *b, int64_t n, int dtype,
                        int op) {
    switch (dtype) {
    case DT_I8: red_i8(out, a, b, n, op); break;
    case DT_U8: red_u8(out, a, b, n, op); break;
    case DT_I32: red_i32(out, a, b, n, op); break;
    case DT_U32: red_u32(out, a, b, n, op); break;
    case DT_I64: red_i64(out, a, b, n, op); break;
    case DT_U64: red_u64(out, a, b, n, op); break;
    case DT_F16: red_f16(out, a, b, n, op); break;
    case DT_BF16: red_bf16(out, a, b, n, op); break;
    case DT_F32: red_f32(out, a, b, n, op); break;
    default: red_f64(out, a, b, n, op);
    }
}

static void average(void *p, int64_t n, int dtype, int nranks) {
    switch (dtype) {
    case DT_I8: avg_i8(p, n, nranks); break;
    case DT_U8: avg_u8(p, n, nranks); break;
    case DT_I32: avg_i32(p, n, nranks); break;
    case DT_U32: avg_u32(p, n, nranks); break;
    case DT_I64: avg_i64(p, n, nranks); break;
    case DT_U64: avg_u64(p, n, nranks); break;
    case DT_F16: avg_f16(p, n, nranks); break;
    case DT_BF16: avg_bf16(p, n, nranks); break;
    case DT_F32: avg_f32(p, n, nranks); break;
    default: avg_f64(p, n, nranks);
    }
}

/* ------------------------------------------------------------------ the schedule */
enum { MODE_ALL_REDUCE = 0, MODE_REDUCE_SCATTER = 1, MODE_ALL_GATHER = 2 };

/* One step: the sender sends `send_len` items from `send` (at step t >= 1 the block it
 * received at step t-1); the receiver receives `len` items into `recv`, or (local !=
 * NULL) into a piece of scratch and reduces recv = local (op) received, dividing by
 * nranks afterwards when `avg`. */
typedef struct {
    int64_t send_len, len;
    const char *send;
    char *recv;
    const char *local;
    int avg;
    int seg; /* all-reduce: the segment received (for staged copies) */
} step;

static int mod(int a, int n) { return ((a % n) + n) % n; }

/* The steps of a call (2(n-1) for all-reduce, n-1 otherwise); returns how many. */
static int make_steps(step *st, int mode, int n, int r, int64_t count, int itemsize,
                      int op, const char *src, char *dst, char *scratch) {
    int k = 0;
    if (mode == MODE_ALL_REDUCE) { /* segments of count split as evenly as possible */
        int64_t base = count / n, extra = count % n;
#define SEG_AT(q) (((int64_t)(q) * base + ((q) < extra ? (q) : extra)) * itemsize)
#define SEG_LEN(q) (base + ((q) < extra ? 1 : 0))
        for (int t = 0; t < n - 1; t++, k++) { /* reduce-scatter into dst */
            int out = mod(r - t, n), in = mod(r - t - 1, n);
            st[k].send_len = SEG_LEN(out);
            st[k].len = SEG_LEN(in);
            st[k].send = (t == 0 ? src : dst) + SEG_AT(out);
            st[k].recv = dst + SEG_AT(in);
            st[k].local = src + SEG_AT(in);
            st[k].avg = t == n - 2 && op == OP_AVG;
            st[k].seg = in;
        }
        for (int u = 0; u < n - 1; u++, k++) { /* all-gather, straight into dst */
            int out = mod(r + 1 - u, n), in = mod(r - u, n);
            st[k].send_len = SEG_LEN(out);
            st[k].len = SEG_LEN(in);
            st[k].send = dst + SEG_AT(out);
            st[k].recv = dst + SEG_AT(in);
            st[k].local = NULL;
            st[k].avg = 0;
            st[k].seg = in;
        }
#undef SEG_AT
#undef SEG_LEN
    } else if (mode == MODE_REDUCE_SCATTER) { /* src: n blocks of count; dst: one */
        int64_t b = count * itemsize;
        for (int t = 0; t < n - 1; t++, k++) {
            st[k].send_len = st[k].len = count;
            st[k].send = t == 0 ? src + mod(r - 1, n) * b : scratch + (int64_t)(t - 1) * b;
            st[k].recv = t < n - 2 ? scratch + (int64_t)t * b : dst;
            st[k].local = src + mod(r - t - 2, n) * b;
            st[k].avg = t == n - 2 && op == OP_AVG;
        }
    } else { /* all-gather: src one block of count; dst: n */
        int64_t b = count * itemsize;
        for (int t = 0; t < n - 1; t++, k++) {
            st[k].send_len = st[k].len = count;
            st[k].send = dst + mod(r - t, n) * b;
            st[k].recv = dst + mod(r - t - 1, n) * b;
            st[k].local = NULL;
            st[k].avg = 0;
        }
    }
    return k;
}

/* ------------------------------------------------------------------ socket I/O */
typedef struct {
    nr_state *st;
    int64_t deadline;
    int *stop; /* the other side's failure (an NR_ code), read atomically */
} waiter;

/* 0: the fd is ready; else an NR_ code */
static int wait_fd(const waiter *w, int fd, short events) {
    for (;;) {
        if (w->st->abort) return NR_ABORTED;
        int stop = __atomic_load_n(w->stop, __ATOMIC_ACQUIRE);
        if (stop) return stop;
        int ms = SLICE_MS;
        if (w->deadline) {
            int64_t left = w->deadline - now_ns();
            if (left <= 0) return NR_DEADLINE;
            if (left / 1000000 < ms) ms = (int)(left / 1000000) + 1;
        }
        struct pollfd pfd = {fd, events, 0};
        int r = poll(&pfd, 1, ms);
        if (r > 0) return 0; /* (errors and hang-ups show in the call that follows) */
        if (r < 0 && errno != EINTR) {
            w->st->err = errno;
            return events == POLLIN ? NR_RECV_FAILED : NR_SEND_FAILED;
        }
    }
}

static int send_all(const waiter *w, int fd, const char *p, int64_t len) {
    while (len > 0) {
        ssize_t k = send(fd, p, (size_t)(len > (1 << 30) ? (1 << 30) : len),
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            len -= k;
            __atomic_fetch_add(&w->st->sent, (int64_t)k, __ATOMIC_RELAXED);
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int r = wait_fd(w, fd, POLLOUT);
            if (r) return r;
            continue;
        }
        w->st->err = k < 0 ? errno : EPIPE;
        return NR_SEND_FAILED;
    }
    return 0;
}

static int recv_all(const waiter *w, int fd, char *p, int64_t len) {
    while (len > 0) {
        ssize_t k = recv(fd, p, (size_t)(len > (1 << 30) ? (1 << 30) : len), MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            len -= k;
            __atomic_fetch_add(&w->st->received, (int64_t)k, __ATOMIC_RELAXED);
            continue;
        }
        if (k == 0) return NR_PEER_CLOSED;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int r = wait_fd(w, fd, POLLIN);
            if (r) return r;
            continue;
        }
        w->st->err = errno;
        return NR_RECV_FAILED;
    }
    return 0;
}

/* ------------------------------------------------------------------ staged copies */
/* A staged all-reduce's copy counters (see the contract at the top). */
typedef struct {
    const volatile uint32_t *ready; /* bumped by the copier per landed download piece */
    volatile uint32_t *final;       /* bumped here per final piece of the result */
    uint32_t ready_base, final_base;
    int64_t piece;                  /* items per copy piece, within a segment */
} nr_stage;

typedef struct {
    const nr_stage *st;
    int n, r;
    int64_t base, extra;   /* segment q has base items, one more when q < extra */
    int64_t *dl_before;    /* download pieces before the j-th segment downloaded */
    int64_t *ul_before;    /* upload pieces before the j-th segment made final */
} stager;

static int64_t seg_len(const stager *g, int q) { return g->base + (q < g->extra ? 1 : 0); }

static int64_t pieces_of(const stager *g, int64_t items) {
    return (items + g->st->piece - 1) / g->st->piece;
}

static int stager_init(stager *g, const nr_stage *st, int n, int r, int64_t count) {
    g->st = st;
    g->n = n;
    g->r = r;
    g->base = count / n;
    g->extra = count % n;
    g->dl_before = malloc(sizeof(int64_t) * (size_t)(2 * n));
    if (!g->dl_before) return -1;
    g->ul_before = g->dl_before + n;
    int64_t down = 0, up = 0;
    for (int j = 0; j < n; j++) {
        g->dl_before[j] = down;
        down += pieces_of(g, seg_len(g, mod(r - j, n)));
        g->ul_before[j] = up;
        up += pieces_of(g, seg_len(g, mod(r + 1 - j, n)));
    }
    return 0;
}

/* items of segment q whose download has landed (a prefix of it) */
static int64_t landed(const stager *g, int q) {
    uint32_t c = __atomic_load_n((const uint32_t *)g->st->ready, __ATOMIC_ACQUIRE);
    int64_t k = (int64_t)(int32_t)(c - g->st->ready_base) - g->dl_before[mod(g->r - q, g->n)];
    int64_t len = seg_len(g, q);
    if (k <= 0) return 0;
    return k >= pieces_of(g, len) ? len : k * g->st->piece;
}

/* wait until items [0, upto) of segment q have landed: 0 or an NR_ code. Yields the CPU
 * for the first 200 us, then sleeps in short slices (a piece lands in microseconds). */
static int wait_landed(const stager *g, const waiter *w, int q, int64_t upto) {
    int64_t t0 = 0;
    for (;;) {
        if (landed(g, q) >= upto) return 0;
        if (w->st->abort) return NR_ABORTED;
        int stop = __atomic_load_n(w->stop, __ATOMIC_ACQUIRE);
        if (stop) return stop;
        int64_t now = now_ns();
        if (w->deadline && now >= w->deadline) return NR_DEADLINE;
        if (!t0) t0 = now;
        if (now - t0 < 200000) {
            sched_yield();
        } else {
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
    }
}

/* items [0, upto) of segment q are final: publish the pieces they complete (the counter
 * only ever moves forward, even past a value the caller stored to release its copier) */
static void publish(const stager *g, int q, int64_t upto) {
    int64_t len = seg_len(g, q);
    int64_t k = upto >= len ? pieces_of(g, len) : upto / g->st->piece;
    uint32_t v = g->st->final_base + (uint32_t)(g->ul_before[mod(g->r + 1 - q, g->n)] + k);
    uint32_t *p = (uint32_t *)g->st->final;
    uint32_t cur = __atomic_load_n(p, __ATOMIC_RELAXED);
    while ((int32_t)(v - cur) > 0 &&
           !__atomic_compare_exchange_n(p, &cur, v, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
    }
}

/* ------------------------------------------------------------------ the call */
/* The receiving side (the caller's thread) works in pieces of at most PIECE bytes, so a
 * piece is reduced while it is still in cache, and publishes its progress in items of the
 * whole receive stream (the steps one after another). The sending side sends each step's
 * segment as its items become ready (the segment it sends at step t is the one received
 * at step t-1), in calls of at most send_items. No framing: the byte stream of a call is
 * the header, then every step's segment in order, whatever the pieces were. */
#define PIECE (256 << 10)

typedef struct {
    waiter w;
    int fd, itemsize, nsteps;
    int64_t send_items;
    const step *steps;
    const unsigned char *header;
    const int64_t *base; /* items received before step t (nsteps + 1 entries) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int64_t done;  /* items received and processed, over the whole stream (under mu) */
    int waiting;   /* the sender sleeps on cv (under mu) */
    int failed;    /* an NR_ code once either side stopped (written under mu) */
    int failed_by; /* 1: the receiving side, 2: the sending side */
    const stager *stage; /* a staged all-reduce's copies (NULL: none) */
} ring_call;

static void set_failed(ring_call *s, int code, int side) {
    pthread_mutex_lock(&s->mu);
    if (!s->failed) {
        __atomic_store_n(&s->failed, code, __ATOMIC_RELEASE);
        s->failed_by = side;
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* wait until at least `need` items of the stream are processed; 0 or an NR_ code */
static int wait_done(ring_call *s, int64_t need) {
    int stop = 0;
    pthread_mutex_lock(&s->mu);
    while (s->done < need && !s->failed && !s->w.st->abort) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts); /* (the condition variable's clock) */
        ts.tv_nsec += SLICE_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        s->waiting = 1;
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        s->waiting = 0;
    }
    stop = s->failed ? s->failed : (s->done < need ? NR_ABORTED : 0);
    pthread_mutex_unlock(&s->mu);
    return stop;
}

static void *send_main(void *arg) {
    ring_call *s = arg;
    int r = send_all(&s->w, s->fd, (const char *)s->header, HEADER_SIZE);
    for (int t = 0; !r && t < s->nsteps; t++) {
        const step *st = &s->steps[t];
        int64_t len = st->send_len, pos = 0;
        while (!r && pos < len) {
            int64_t upto = len;
            if (t > 0) { /* what the caller has received (and reduced) of it at step t-1 */
                pthread_mutex_lock(&s->mu);
                int64_t ready = s->done - s->base[t - 1];
                pthread_mutex_unlock(&s->mu);
                if (ready <= pos) {
                    r = wait_done(s, s->base[t - 1] + pos + 1);
                    continue;
                }
                upto = ready < len ? ready : len;
            } else if (s->stage) { /* step 0 reads this rank's own segment of src */
                int64_t have = landed(s->stage, s->stage->r);
                if (have <= pos) {
                    r = wait_landed(s->stage, &s->w, s->stage->r, pos + 1);
                    continue;
                }
                upto = have < len ? have : len;
            }
            if (s->w.st->abort) {
                r = NR_ABORTED;
                break;
            }
            int64_t k = upto - pos < s->send_items ? upto - pos : s->send_items;
            r = send_all(&s->w, s->fd, st->send + pos * s->itemsize, k * s->itemsize);
            pos += k;
        }
    }
    if (r) set_failed(s, r, 2);
    return NULL;
}

/* Each calling thread keeps a helper: the buffer its receives go through and, from its
 * first call that is not inline, a sender thread that waits for its next call's send side
 * (a thread made per call cost 20 us or more, which small calls felt). The helper ends
 * when its calling thread does (the thread-specific key's destructor). */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ring_call *job; /* posted by the caller; NULL when idle */
    int finished;   /* the posted job's send side returned */
    int quit;       /* the calling thread exited */
    int started;    /* the sender thread runs (only the calling thread writes it) */
    char *tmp;      /* PIECE bytes for the caller's receives */
} helper;

static pthread_key_t helper_key;
static pthread_once_t helper_once = PTHREAD_ONCE_INIT;

static void free_helper(helper *h) {
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h->tmp);
    free(h);
}

static void *helper_main(void *arg) {
    helper *h = arg;
    /* a name that top, gdb and /proc/<pid>/task/<tid>/comm show (at most 15 characters) */
    pthread_setname_np(pthread_self(), "acoll-send");
    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (!h->job && !h->quit) pthread_cond_wait(&h->cv, &h->mu);
        if (!h->job) break; /* (quit while idle) */
        ring_call *job = h->job;
        pthread_mutex_unlock(&h->mu);
        send_main(job);
        pthread_mutex_lock(&h->mu);
        h->job = NULL;
        h->finished = 1;
        pthread_cond_broadcast(&h->cv);
    }
    pthread_mutex_unlock(&h->mu);
    free_helper(h);
    return NULL;
}

static void helper_quit(void *arg) {
    helper *h = arg;
    if (!h->started) { /* (no sender thread: nothing else holds it) */
        free_helper(h);
        return;
    }
    pthread_mutex_lock(&h->mu);
    h->quit = 1;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

static void make_helper_key(void) { pthread_key_create(&helper_key, helper_quit); }

static helper *get_helper(void) {
    pthread_once(&helper_once, make_helper_key);
    helper *h = pthread_getspecific(helper_key);
    if (h) return h;
    h = calloc(1, sizeof *h);
    if (!h) return NULL;
    if (posix_memalign((void **)&h->tmp, 64, PIECE)) {
        free(h);
        return NULL;
    }
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    pthread_setspecific(helper_key, h);
    return h;
}

/* the helper's sender thread, started on first need; 0, or -1 when it cannot start */
static int start_helper(helper *h) {
    if (h->started) return 0;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t thread;
    int bad = pthread_create(&thread, &attr, helper_main, h);
    pthread_attr_destroy(&attr);
    if (bad) return -1;
    h->started = 1;
    return 0;
}

/* The whole call on the caller's thread: sends and receives interleaved, neither ever
 * blocking, one poll() for both sockets when neither can move. The sender's rule is the
 * helper's (a step's block goes as its items are ready, in calls of at most send_items);
 * the receiver's the caller's (pieces of at most PIECE bytes, reduced when complete). */
static int run_inline(ring_call *s, int recv_fd, char *tmp, int dtype, int op, int nranks,
                      unsigned char *peer_header, int *which) {
    const step *steps = s->steps;
    nr_state *state = s->w.st;
    int itemsize = s->itemsize, nsteps = s->nsteps;
    int64_t piece = PIECE / itemsize;
    /* send cursor: header bytes out, then step ts at item ps (plus a partial item's bytes) */
    int64_t hdr_out = 0, ps = 0, ps_bytes = 0;
    int ts = 0;
    /* receive cursor: header bytes in, then step tr, piece at item pr, bytes of it in */
    int64_t hdr_in = 0, pr = 0, got = 0;
    int tr = 0;
    const stager *g = s->stage;
    while (tr < nsteps && steps[tr].len == 0) tr++;
    while (ts < nsteps && steps[ts].send_len == 0) ts++;
    for (int q = 0; g && q < nranks; q++) { /* (small calls: the whole input first) */
        int r = wait_landed(g, &s->w, q, seg_len(g, q));
        if (r) {
            *which = 1;
            return r;
        }
    }
    for (;;) {
        int moved = 0;
        /* ---- send what is ready */
        while (hdr_out < HEADER_SIZE || ts < nsteps) {
            const char *p;
            int64_t len;
            if (hdr_out < HEADER_SIZE) {
                p = (const char *)s->header + hdr_out;
                len = HEADER_SIZE - hdr_out;
            } else {
                const step *st = &steps[ts];
                int64_t upto = st->send_len;
                if (ts > 0) {
                    int64_t ready = s->done - s->base[ts - 1];
                    if (ready < upto) upto = ready;
                }
                if (upto <= ps) break; /* (waits for the receiver) */
                int64_t k = upto - ps < s->send_items ? upto - ps : s->send_items;
                p = st->send + ps * itemsize + ps_bytes;
                len = k * itemsize - ps_bytes;
            }
            ssize_t k = send(s->fd, p, (size_t)(len > (1 << 30) ? (1 << 30) : len),
                             MSG_NOSIGNAL | MSG_DONTWAIT);
            if (k < 0 && errno == EINTR) continue;
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
            if (k <= 0) {
                state->err = k < 0 ? errno : EPIPE;
                *which = 2;
                return NR_SEND_FAILED;
            }
            moved = 1;
            __atomic_fetch_add(&state->sent, (int64_t)k, __ATOMIC_RELAXED);
            if (hdr_out < HEADER_SIZE) {
                hdr_out += k;
                continue;
            }
            ps_bytes += k;
            ps += ps_bytes / itemsize;
            ps_bytes %= itemsize;
            if (ps == steps[ts].send_len) {
                ps = 0;
                do ts++; while (ts < nsteps && steps[ts].send_len == 0);
            }
        }
        /* ---- receive what has come */
        while (hdr_in < HEADER_SIZE || tr < nsteps) {
            char *p;
            int64_t len;
            const step *st = &steps[tr < nsteps ? tr : 0];
            int64_t k_items = 0;
            if (hdr_in < HEADER_SIZE) {
                p = (char *)peer_header + hdr_in;
                len = HEADER_SIZE - hdr_in;
            } else {
                k_items = st->len - pr < piece ? st->len - pr : piece;
                p = (st->local ? tmp : st->recv + pr * itemsize) + got;
                len = k_items * itemsize - got;
            }
            ssize_t k = recv(recv_fd, p, (size_t)(len > (1 << 30) ? (1 << 30) : len),
                             MSG_DONTWAIT);
            if (k < 0 && errno == EINTR) continue;
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
            if (k <= 0) {
                *which = 1;
                if (k == 0) return NR_PEER_CLOSED;
                state->err = errno;
                return NR_RECV_FAILED;
            }
            moved = 1;
            __atomic_fetch_add(&state->received, (int64_t)k, __ATOMIC_RELAXED);
            if (hdr_in < HEADER_SIZE) {
                hdr_in += k;
                if (hdr_in == HEADER_SIZE && memcmp(peer_header, s->header, HEADER_SIZE)) {
                    *which = 1;
                    return NR_MISMATCH;
                }
                continue;
            }
            got += k;
            if (got < k_items * itemsize) continue;
            if (st->local) {
                int64_t at = pr * itemsize;
                reduce_into(st->recv + at, st->local + at, tmp, k_items, dtype, op);
                if (st->avg) average(st->recv + at, k_items, dtype, nranks);
            }
            if (g && tr >= nranks - 2) publish(g, st->seg, pr + k_items);
            got = 0;
            pr += k_items;
            s->done += k_items;
            if (pr == st->len) {
                pr = 0;
                do tr++; while (tr < nsteps && steps[tr].len == 0);
            }
        }
        int sending = hdr_out < HEADER_SIZE || ts < nsteps;
        int receiving = hdr_in < HEADER_SIZE || tr < nsteps;
        if (!sending && !receiving) return NR_OK;
        if (state->abort) {
            *which = 1;
            return NR_ABORTED;
        }
        if (moved) continue;
        /* ---- neither could move: sleep on both (at most a slice) */
        int ms = SLICE_MS;
        if (s->w.deadline) {
            int64_t left = s->w.deadline - now_ns();
            if (left <= 0) {
                *which = 1;
                return NR_DEADLINE;
            }
            if (left / 1000000 < ms) ms = (int)(left / 1000000) + 1;
        }
        struct pollfd pfd[2];
        int nfd = 0;
        if (receiving) pfd[nfd++] = (struct pollfd){recv_fd, POLLIN, 0};
        if (sending) { /* (only when it has something ready: else the receive is awaited) */
            int ready = hdr_out < HEADER_SIZE || ts == 0 ||
                        s->done - s->base[ts - 1] > ps;
            if (ready) pfd[nfd++] = (struct pollfd){s->fd, POLLOUT, 0};
        }
        int r = poll(pfd, (nfds_t)nfd, ms);
        if (r < 0 && errno != EINTR) {
            state->err = errno;
            *which = receiving ? 1 : 2;
            return receiving ? NR_RECV_FAILED : NR_SEND_FAILED;
        }
    }
}

/* Returns an NR_ code. mode: 0 all-reduce (src, dst: count items each), 1 reduce-scatter
 * (src: nranks blocks of count, dst: count; scratch: (nranks - 2) * count items), 2
 * all-gather (src: count, dst: nranks blocks of count). header: this rank's 32 bytes;
 * peer_header: the previous rank's, copied out (valid when the result is NR_OK or
 * NR_MISMATCH). *which is set to 1 when the error came from the receiving side first, 2
 * from the sending side. send_items: the most items one send call takes (the sender
 * sends what is ready, up to that). inline_max: a call sending at most this many bytes
 * (the header aside) runs on the calling thread alone (see run_inline). stage: a staged
 * all-reduce's copy counters (see the contract at the top), or NULL. */
int acoll_nr_run(int mode, int send_fd, int recv_fd, const void *src, void *dst,
                 void *scratch, int64_t count, int dtype, int op, int rank, int nranks,
                 int64_t send_items, int64_t inline_max, int64_t deadline_ns,
                 nr_state *state, const unsigned char *header, unsigned char *peer_header,
                 int *which, const nr_stage *stage) {
    int itemsize = itemsize_of(dtype);
    *which = 0;
    if (!itemsize || nranks < 2 || rank < 0 || rank >= nranks || count < 0 ||
        send_items < 1 || op < OP_SUM || op > OP_AVG || mode < MODE_ALL_REDUCE ||
        mode > MODE_ALL_GATHER || (mode == MODE_REDUCE_SCATTER && nranks > 2 && !scratch) ||
        (stage && (mode != MODE_ALL_REDUCE || stage->piece < 1 || !stage->ready ||
                   !stage->final)))
        return NR_BAD_ARGS;
    ring_call s;
    memset(&s, 0, sizeof s);
    s.w.st = state;
    s.w.deadline = deadline_ns;
    s.w.stop = &s.failed;
    s.fd = send_fd;
    s.itemsize = itemsize;
    s.send_items = send_items;
    s.header = header;
    helper *h = get_helper();
    step *steps = malloc(sizeof(step) * (size_t)(2 * nranks));
    int64_t *base = malloc(sizeof(int64_t) * (size_t)(2 * nranks + 1));
    stager g = {0};
    if (!h || !steps || !base || (stage && stager_init(&g, stage, nranks, rank, count))) {
        free(steps);
        free(base);
        return NR_NO_MEMORY;
    }
    s.stage = stage ? &g : NULL;
    char *tmp = h->tmp;
    if (mode == MODE_ALL_GATHER) { /* this rank's own block, unless src is it already */
        char *own = (char *)dst + (int64_t)rank * count * itemsize;
        if ((const char *)src != own) memmove(own, src, (size_t)(count * itemsize));
    }
    int nsteps = make_steps(steps, mode, nranks, rank, count, itemsize, op, src, dst,
                            scratch);
    base[0] = 0;
    for (int t = 0; t < nsteps; t++) base[t + 1] = base[t] + steps[t].len;
    s.steps = steps;
    s.nsteps = nsteps;
    s.base = base;
    int64_t to_send = 0;
    for (int t = 0; t < nsteps; t++) to_send += steps[t].send_len * itemsize;
    if (to_send <= inline_max || start_helper(h)) {
        /* (inline also when no sender thread can start: slower for large calls, never
         * wrong) */
        int r = run_inline(&s, recv_fd, tmp, dtype, op, nranks, peer_header, which);
        free(g.dl_before);
        free(base);
        free(steps);
        return r;
    }
    pthread_mutex_init(&s.mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s.cv, &ca);
    pthread_condattr_destroy(&ca);
    int64_t piece = PIECE / itemsize;
    pthread_mutex_lock(&h->mu);
    h->finished = 0;
    h->job = &s;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    int r = recv_all(&s.w, recv_fd, (char *)peer_header, HEADER_SIZE);
    if (!r && memcmp(peer_header, header, HEADER_SIZE)) r = NR_MISMATCH;
    for (int t = 0; !r && t < nsteps; t++) {
        const step *st = &steps[t];
        for (int64_t pos = 0; !r && pos < st->len; pos += piece) {
            if (state->abort) {
                r = NR_ABORTED;
                break;
            }
            int64_t k = st->len - pos < piece ? st->len - pos : piece;
            int64_t at = pos * itemsize;
            if (st->local) { /* recv = local (op) received */
                r = recv_all(&s.w, recv_fd, tmp, k * itemsize);
                if (r) break;
                if (s.stage && (r = wait_landed(s.stage, &s.w, st->seg, pos + k))) break;
                reduce_into(st->recv + at, st->local + at, tmp, k, dtype, op);
                if (st->avg) average(st->recv + at, k, dtype, nranks);
            } else { /* straight into place */
                r = recv_all(&s.w, recv_fd, st->recv + at, k * itemsize);
                if (r) break;
            }
            if (s.stage && t >= nranks - 2) publish(s.stage, st->seg, pos + k);
            pthread_mutex_lock(&s.mu);
            s.done += k;
            if (s.waiting) pthread_cond_broadcast(&s.cv);
            pthread_mutex_unlock(&s.mu);
        }
    }
    if (r) set_failed(&s, r, 1); /* (no-op when the sender failed first) */
    pthread_mutex_lock(&h->mu);
    while (!h->finished) pthread_cond_wait(&h->cv, &h->mu);
    pthread_mutex_unlock(&h->mu);
    free(g.dl_before);
    free(base);
    free(steps);
    pthread_mutex_destroy(&s.mu);
    pthread_cond_destroy(&s.cv);
    if (s.failed) {
        *which = s.failed_by;
        return s.failed;
    }
    return NR_OK;
}

int acoll_nr_version(void) { return ACOLL_NR_VERSION; }

/* out = a (op) b over n items of dtype, as the ring combines them (out may be a or b,
 * or lie apart from both). Returns NR_OK, or NR_BAD_ARGS for an unknown dtype or op. */
int acoll_nr_reduce(void *out, const void *a, const void *b, int64_t n, int dtype, int op) {
    if (itemsize_of(dtype) == 0 || op < OP_SUM || op > OP_AVG || n < 0)
        return NR_BAD_ARGS;
    reduce_into(out, a, b, n, dtype, op);
    return NR_OK;
}

/* p[i] = p[i] / nranks over n items of dtype, as the ring finishes an AVG it was given
 * unscaled (integers truncate toward zero; 16-bit floats divide in float32 and round
 * once). Returns NR_OK, or NR_BAD_ARGS. */
int acoll_nr_average(void *p, int64_t n, int dtype, int nranks) {
    if (itemsize_of(dtype) == 0 || nranks < 1 || n < 0)
        return NR_BAD_ARGS;
    average(p, n, dtype, nranks);
    return NR_OK;
}

/* out = a * factor over n 16-bit floats (AVG's scaling: factor is the dtype's rounded
 * 1/nranks, widened), one rounding each; out may be a. NR_BAD_ARGS for other dtypes. */
int acoll_nr_scale(void *out, const void *a, int64_t n, int dtype, float factor) {
    if (n < 0)
        return NR_BAD_ARGS;
    if (dtype == DT_F16)
        scale_f16(out, a, n, factor);
    else if (dtype == DT_BF16)
        scale_bf16(out, a, n, factor);
    else
        return NR_BAD_ARGS;
    return NR_OK;
}
