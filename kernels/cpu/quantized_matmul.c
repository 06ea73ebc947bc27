/* Quantized linear for the CPU on float32 inputs: y = x W^T (+ bias), where W is a kernels/quantized.py
 * PackedWeight: 4-bit (GGUF block order: 16 bytes per 32 columns, byte j = column j in the low nibble,
 * column j + 16 in the high one) or 8-bit (int8 holding q - 128), with one float16 scale and one optional
 * min (float16, or float32 where float16 would round one: mins_f32) per (output row, group of columns):
 * w = scale * q + min = scale * stored + offset, where offset = min for 4 bits and min + 128 * scale for
 * 8 bits (in float32; see offset_of below).
 *
 * Three ways through, each reading the packed weight once per call and never dequantizing all of it
 * (which one runs is chosen by kernels/cpu/__init__.py, by row count and weight layout):
 * - fused (one input row: decode). A tile of NR weight rows is widened block by block into float vectors
 *   in registers (the stored integers, converted exactly) and multiplied into the input row; a group's
 *   sum is scaled once at the group's end, and the mins enter as min[n, g] * sum(x over group g), so they
 *   cost nothing per element. Bound by the widening work (1 or 0.5 byte of weight per multiply-add).
 * - batch (several input rows: batched decode). Register tiles of MR input rows x NR weight rows: each
 *   weight vector is widened and scaled in registers (w = scale * stored + offset, one FMA per vector)
 *   and multiplied into all MR input rows, so its cost is shared by MR rows, and it never goes through
 *   memory (a dequantized copy written out and read back cost as much as the multiply-adds at 8-16
 *   rows). Measured at 65-90 % of the FMA units' peak on SmolLM2's shapes (the rest: widening, scaling).
 * - int8 activations (batches, where the CPU has VNNI): the input rows quantized to int8, integer dot
 *   products (W8A8 / W4A8; see the section further down for its layout and its error).
 * For prefill sizes kernels/cpu/__init__.py also dequantizes tiles with `quantized_dequantize_f32` and
 * multiplies them with oneDNN, whose cache blocking wins there.
 *
 * Intrinsics, AVX-512 or AVX2 + FMA as the build machine has them (the library is built with
 * -march=native), each behind its #if: the int8/int4 -> float widening (vpmovzx/vpmovsx + vcvtdq2ps, the
 * nibbles split by one mask and one shift on 32-bit lanes) is not what GCC makes of the scalar loop or of
 * its generic vector types (it extracts bytes through general registers, several times slower). The
 * scalar code at the end is the portable fallback and the definition of every result. The vector builds
 * read the float16 scales and mins with F16C (vcvtph2ps), which every AVX2 CPU has.
 * Work is split over output rows on torch's own OpenMP pool (libgomp), like the other kernels here.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* QL_VL: floats per vector (16 with AVX-512, 8 with AVX2 + FMA); 0 = the scalar code. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QL_VL 16
typedef __m512 vf;
#define vzero _mm512_setzero_ps
#define vfma _mm512_fmadd_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vhsum _mm512_reduce_add_ps
/* [sum(a), sum(b), sum(c), sum(d)]: four horizontal sums in one transposing pass (13 operations instead
 * of 4 x 8 for four separate reductions: a large share of a tile's work when K is short). */
static inline __m128 vsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    /* 128-bit quarters: a, b, c, d partial sums of 4 lanes each (then the lanes of each quarter) */
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    const __m512 t = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E));
    const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), u));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QL_VL 8
typedef __m256 vf;
#define vzero _mm256_setzero_ps
#define vfma _mm256_fmadd_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
static inline float vhsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline __m128 vsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#else
#define QL_VL 0
#endif

#if QL_VL && !defined(__F16C__)
#error "the AVX2 / AVX-512 paths read float16 scales and mins with F16C (every AVX2 CPU has it): build with -mf16c"
#endif

/* A float16 (its bits) as a float: exact. Without F16C (the scalar build), by its fields. */
static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 */
        const float f = (float)mantissa * 0x1p-24f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exponent == 31 ? 0x7F800000u : (exponent + 112) << 23) | mantissa << 13;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

#if QL_VL
/* Lanes [0, count) of 4 floats: loaded, stored (masked: no scalar stores and vector reloads between,
 * which stall store-to-load forwarding). */
static inline __m128i first_lanes(int count) { return _mm_cmpgt_epi32(_mm_set1_epi32(count), _mm_setr_epi32(0, 1, 2, 3)); }
static inline __m128 load_first(const float *p, int count) {
    return p ? _mm_maskload_ps(p, first_lanes(count)) : _mm_setzero_ps();
}
#endif

#define BLOCK 32
#define FUSED_MR 4 /* fused tiles: up to 4 input rows x 8 weight rows (fused_nr() below) */
#define FUSED_NR 8
#define INLINE static inline __attribute__((always_inline))
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

typedef struct {
    const float *x;             /* [M, Kp] row stride ldx, zero in columns K..Kp */
    const float *xsums;         /* [M, G]: x summed over each group (fused path with mins) */
    const uint8_t *data;        /* [N, Kp/2] (4 bits) or [N, Kp] int8 (8 bits) */
    const uint16_t *scales;     /* float16 [N, G] */
    const void *mins;           /* [N, G], float16 or (mins_f32) float32; NULL: offset zero (symmetric 8-bit) */
    const float *bias;          /* [N] or NULL */
    float *out;                 /* [M, N] row stride ldo */
    int64_t M, N, Kp, G, group, bits, ldx, ldo, mins_f32;
} Problem;

static inline int64_t row_bytes(const Problem *p) { return p->bits == 4 ? p->Kp / 2 : p->Kp; }

static inline int64_t group_end(const Problem *p, int64_t g) {
    const int64_t end = (g + 1) * p->group;
    return end < p->Kp ? end : p->Kp;
}

/* Stored integer of column k of a weight row: q for 4 bits, q - 128 for 8 bits (the scalar definition). */
static inline float stored(const uint8_t *row, int64_t k, int64_t bits) {
    if (bits == 8) return (float)(int8_t)row[k];
    const uint8_t byte = row[(k / BLOCK) * (BLOCK / 2) + k % (BLOCK / 2)];
    return (float)((k % BLOCK) < BLOCK / 2 ? byte & 15 : byte >> 4);
}

static inline float scale_of(const Problem *p, int64_t n, int64_t g) { return half_to_float(p->scales[n * p->G + g]); }

/* The stored min of group g of weight row n (mins not NULL). */
static inline float min_of(const Problem *p, int64_t n, int64_t g) {
    const int64_t i = n * p->G + g;
    return p->mins_f32 ? ((const float *)p->mins)[i] : half_to_float(((const uint16_t *)p->mins)[i]);
}

/* What group g of weight row n adds to scale * stored: the min for 4 bits; for 8 bits, whose stored
 * integer is q - 128, min + 128 * scale (kernels/quantized.py's `offsets`, to the bit: 128 * scale is
 * exact, the sum rounds once). */
static inline float offset_of(const Problem *p, int64_t n, int64_t g) {
    if (!p->mins) return 0.f;
    const float min = min_of(p, n, g);
    return p->bits == 8 ? min + 128.f * scale_of(p, n, g) : min;
}

/* The fused path's scalar parts of one output: the offsets' term and the bias. */
static inline float finish(const Problem *p, float dot, int64_t m, int64_t n) {
    if (p->mins) {
        const float *xs = p->xsums + m * p->G;
        for (int64_t g = 0; g < p->G; g++) dot += offset_of(p, n, g) * xs[g];
    }
    return p->bias ? dot + p->bias[n] : dot;
}

#if QL_VL
/* Columns 0..31 of one block as BLOCK / QL_VL float vectors of the stored integers (exact). */
INLINE void widen4(const uint8_t *p, vf w[]) {
    /* bytes widened to 32-bit lanes first: there one mask gives the low nibble, one shift the high one */
#if QL_VL == 16
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))); /* columns 0..15 */
    w[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));                    /* 16..31 */
#else
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));       /* bytes 0..7 */
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))); /* bytes 8..15 */
    const __m256i mask = _mm256_set1_epi32(15);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, mask)); /* columns 0..7 */
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask)); /* 8..15 */
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));   /* 16..23 */
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));   /* 24..31 */
#endif
}

INLINE void widen8(const uint8_t *p, vf w[]) {
#if QL_VL == 16
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * i))));
#else
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i))));
#endif
}

INLINE void widen(const uint8_t *row, int64_t block, const int BITS, vf w[]) {
    if (BITS == 4)
        widen4(row + block * (BLOCK / 2), w);
    else
        widen8(row + block * BLOCK, w);
}

/* Fused: out[m0 .. m0+MR, n0 .. n0+NR]. MR, NR and BITS are constants after inlining, so the loops over
 * them unroll and the sums live in registers; each widened block serves all MR input rows. */
INLINE void fused_tile(const Problem *p, int64_t m0, int64_t n0, const int MR, const int NR, const int BITS) {
    const uint8_t *rows[FUSED_NR];
    for (int n = 0; n < NR; n++) rows[n] = p->data + (n0 + n) * row_bytes(p);
    vf total[FUSED_MR][FUSED_NR];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) total[m][n] = vzero();
    for (int64_t g = 0; g < p->G; g++) {
        vf acc[FUSED_MR][FUSED_NR];
        for (int m = 0; m < MR; m++)
            for (int n = 0; n < NR; n++) acc[m][n] = vzero();
        for (int64_t b = g * p->group / BLOCK; b < group_end(p, g) / BLOCK; b++) {
            for (int n = 0; n < NR; n++) {
                vf w[BLOCK / QL_VL];
                widen(rows[n], b, BITS, w);
                for (int m = 0; m < MR; m++) {
                    const float *x = p->x + (m0 + m) * p->ldx + b * BLOCK;
                    for (int i = 0; i < BLOCK / QL_VL; i++) acc[m][n] = vfma(w[i], vload(x + QL_VL * i), acc[m][n]);
                }
            }
        }
        for (int n = 0; n < NR; n++) {
            const vf s = vset1(scale_of(p, n0 + n, g));
            for (int m = 0; m < MR; m++) total[m][n] = vfma(acc[m][n], s, total[m][n]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) p->out[(m0 + m) * p->ldo + n0 + n] = finish(p, vhsum(total[m][n]), m0 + m, n0 + n);
}

/* One function per tile shape: (1 input row, up to 8 weight rows), (2, up to 4), (3 or 4, up to 3). */
#define FUSED_FN(MR, NR, BITS) \
    static void fused_##MR##_##NR##_##BITS(const Problem *p, int64_t m0, int64_t n0) { fused_tile(p, m0, n0, MR, NR, BITS); }
#define FUSED_FNS(BITS)                                                                                      \
    FUSED_FN(1, 1, BITS) FUSED_FN(1, 2, BITS) FUSED_FN(1, 3, BITS) FUSED_FN(1, 4, BITS) FUSED_FN(1, 5, BITS)  \
    FUSED_FN(1, 6, BITS) FUSED_FN(1, 7, BITS) FUSED_FN(1, 8, BITS) FUSED_FN(2, 1, BITS) FUSED_FN(2, 2, BITS)  \
    FUSED_FN(2, 3, BITS) FUSED_FN(2, 4, BITS) FUSED_FN(3, 1, BITS) FUSED_FN(3, 2, BITS) FUSED_FN(3, 3, BITS)  \
    FUSED_FN(4, 1, BITS) FUSED_FN(4, 2, BITS) FUSED_FN(4, 3, BITS)
FUSED_FNS(4)
FUSED_FNS(8)
typedef void (*FusedFn)(const Problem *, int64_t, int64_t);
#define FUSED_TABLE(BITS)                                                                                   \
    {{fused_1_1_##BITS, fused_1_2_##BITS, fused_1_3_##BITS, fused_1_4_##BITS, fused_1_5_##BITS,             \
      fused_1_6_##BITS, fused_1_7_##BITS, fused_1_8_##BITS},                                                \
     {fused_2_1_##BITS, fused_2_2_##BITS, fused_2_3_##BITS, fused_2_4_##BITS},                              \
     {fused_3_1_##BITS, fused_3_2_##BITS, fused_3_3_##BITS},                                                \
     {fused_4_1_##BITS, fused_4_2_##BITS, fused_4_3_##BITS}}
static const FusedFn FUSED4[FUSED_MR][FUSED_NR] = FUSED_TABLE(4);
static const FusedFn FUSED8[FUSED_MR][FUSED_NR] = FUSED_TABLE(8);

static void fused(const Problem *p, int64_t m0, int64_t n0, int mr, int nr) {
    (p->bits == 4 ? FUSED4 : FUSED8)[mr - 1][nr - 1](p, m0, n0);
}

/* Weight rows [n0, n0 + rows) as floats, scale and min applied, into w [rows, Kp] (row stride Kp).
 * Everything the loops use is read into locals first: through `p`, the compiler reloads the fields after
 * every store into w (it cannot rule out that they alias), which doubled the cost of this loop. */
INLINE void dequantize_rows_bits(const Problem *p, int64_t n0, int64_t rows, float *restrict w, const int BITS) {
    const int64_t Kp = p->Kp, G = p->G, blocks = Kp / BLOCK, per_group = p->group / BLOCK;
    const int64_t stride = BITS == 4 ? Kp / 2 : Kp;
    float scale[G], offset[G]; /* one row's, as floats: converted in one vectorizable pass */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = n0 + r;
        const uint8_t *restrict row = p->data + n * stride;
        float *restrict dst = w + r * Kp;
        for (int64_t g = 0; g < G; g++) scale[g] = scale_of(p, n, g);
        for (int64_t g = 0; g < G; g++) offset[g] = offset_of(p, n, g);
        for (int64_t g = 0, b = 0; g < G; g++) {
            const vf s = vset1(scale[g]), mn = vset1(offset[g]);
            const int64_t last = b + per_group < blocks ? b + per_group : blocks;
            for (; b < last; b++) {
                vf v[BLOCK / QL_VL];
                widen(row, b, BITS, v);
                for (int i = 0; i < BLOCK / QL_VL; i++) vstore(dst + b * BLOCK + QL_VL * i, vfma(v[i], s, mn));
            }
        }
    }
}

static void dequantize_rows(const Problem *p, int64_t n0, int64_t rows, float *w) {
    if (p->bits == 4)
        dequantize_rows_bits(p, n0, rows, w, 4);
    else
        dequantize_rows_bits(p, n0, rows, w, 8);
}

/* Batched rows: out[m, n] for weight rows [n0, n0 + NR) and input rows [m0, m0 + MR), into buf (row
 * stride ldb). Each weight vector is widened and scaled in registers (w = scale * stored + offset: one
 * FMA per 16 weights, shared by the MR input rows) and multiplied into MR input rows; each input vector
 * is loaded once for the NR weight rows. scale, offset: [NR][G] floats of these weight rows.
 * MR x NR = 6 x 3 with AVX-512 (18 sums, 6 weight vectors, 6 scale/offset vectors and one input vector in
 * the 32 registers), measured the fastest of 4-12 x 2-4 on SmolLM2's shapes; 4 x 1 with AVX2's 16. */
#define BATCH_MR (QL_VL == 16 ? 6 : 4)
#define BATCH_NR (QL_VL == 16 ? 3 : 1)
#define BATCH_MR_MAX 6 /* the tile functions generated below: 1..6 x 1..3 */
#define BATCH_NR_MAX 3
#define BATCH_COLS 32 /* weight rows per chunk: one thread's unit of work, its outputs buffered */

INLINE void batch_tile(const Problem *p, const float *restrict scale, const float *restrict offset, int64_t m0,
                       int64_t n0, float *restrict buf, int64_t ldb, const int MR, const int NR, const int BITS,
                       const int PER_ROW) {
    const int64_t Kp = p->Kp, G = p->G, blocks = Kp / BLOCK, per_group = p->group / BLOCK, ldx = p->ldx;
    const int64_t stride = BITS == 4 ? Kp / 2 : Kp;
    const uint8_t *rows[BATCH_NR_MAX];
    for (int n = 0; n < NR; n++) rows[n] = p->data + (n0 + n) * stride;
    const float *restrict x = p->x + m0 * ldx;
    vf acc[BATCH_MR_MAX][BATCH_NR_MAX];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) acc[m][n] = vzero();
    /* 4 bits with AVX-512: the 16 values a nibble can stand for in a group, scale * q + offset, are one
     * vector (a table, one FMA per group); vpermps looks each nibble up in it (it reads an index's low 4
     * bits, so the low nibbles need no mask). This replaces a conversion and an FMA per 16 weights
     * with one permute, which runs beside the FMAs: the same values, rounded once, as fma(q, s, o). */
    const int TABLE = BITS == 4 && QL_VL == 16 && !PER_ROW;
    for (int64_t g = 0, b = 0; g < G; g++) {
        vf s[BATCH_NR_MAX], mn[BATCH_NR_MAX];
        for (int n = 0; n < NR; n++) s[n] = vset1(scale[n * G + g]), mn[n] = vset1(offset[n * G + g]);
#if QL_VL == 16
        if (TABLE) {
            const vf iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (int n = 0; n < NR; n++) s[n] = vfma(iota, s[n], mn[n]); /* s[n] is now row n's table */
        }
#endif
        const int64_t last = min64(b + per_group, blocks);
        for (; b < last; b++) {
            vf w[BATCH_NR_MAX][BLOCK / QL_VL];
            for (int n = 0; n < NR; n++) {
#if QL_VL == 16
                if (TABLE) {
                    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rows[n] + b * (BLOCK / 2))));
                    w[n][0] = _mm512_permutexvar_ps(bytes, s[n]);                        /* columns 0..15 */
                    w[n][1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), s[n]);  /* 16..31 */
                    continue;
                }
#endif
                widen(rows[n], b, BITS, w[n]);
                if (!PER_ROW)
                    for (int i = 0; i < BLOCK / QL_VL; i++) w[n][i] = vfma(w[n][i], s[n], mn[n]);
            }
            for (int m = 0; m < MR; m++)
                for (int i = 0; i < BLOCK / QL_VL; i++) {
                    vf xv = vload(x + m * ldx + b * BLOCK + QL_VL * i);
                    /* Kept in a register: GCC would otherwise fold this load into each of the NR FMAs,
                     * and the loads, not the FMAs, would bound the loop (1.5x slower, measured). */
                    __asm__("" : "+v"(xv));
                    for (int n = 0; n < NR; n++) acc[m][n] = vfma(w[n][i], xv, acc[m][n]);
                }
        }
    }
    /* PER_ROW (one group per row): the stored integers' sums, scaled once here, and the offsets' term
     * offset * sum(x) from the rows' sums of x (p->xsums), as the fused path does. */
    const __m128 sv = PER_ROW ? load_first(scale, NR) : _mm_setzero_ps();
    const __m128 ov = PER_ROW && p->mins ? load_first(offset, NR) : _mm_setzero_ps();
    for (int m = 0; m < MR; m++) {
        const vf z = vzero();
        __m128 sums = vsum4(acc[m][0], NR > 1 ? acc[m][1] : z, NR > 2 ? acc[m][2] : z, z);
        if (PER_ROW)
            sums = _mm_fmadd_ps(sums, sv, p->mins ? _mm_mul_ps(ov, _mm_set1_ps(p->xsums[m0 + m])) : _mm_setzero_ps());
        _mm_maskstore_ps(buf + m * ldb, first_lanes(NR), sums);
    }
}

#define BATCH_FN(MR, NR, BITS)                                                                           \
    static void batch_##MR##_##NR##_##BITS(const Problem *p, const float *s, const float *o, int64_t m0,  \
                                           int64_t n0, float *buf, int64_t ldb) {                       \
        if (p->G == 1)                                                                                   \
            batch_tile(p, s, o, m0, n0, buf, ldb, MR, NR, BITS, 1);                                      \
        else                                                                                             \
            batch_tile(p, s, o, m0, n0, buf, ldb, MR, NR, BITS, 0);                                      \
    }
#define BATCH_FNS(MR, BITS) BATCH_FN(MR, 1, BITS) BATCH_FN(MR, 2, BITS) BATCH_FN(MR, 3, BITS)
#define BATCH_ALL(BITS) \
    BATCH_FNS(1, BITS) BATCH_FNS(2, BITS) BATCH_FNS(3, BITS) BATCH_FNS(4, BITS) BATCH_FNS(5, BITS) BATCH_FNS(6, BITS)
BATCH_ALL(4)
BATCH_ALL(8)
typedef void (*BatchFn)(const Problem *, const float *, const float *, int64_t, int64_t, float *, int64_t);
#define BATCH_ROW(MR, BITS) {batch_##MR##_1_##BITS, batch_##MR##_2_##BITS, batch_##MR##_3_##BITS}
#define BATCH_TABLE(BITS) \
    {BATCH_ROW(1, BITS), BATCH_ROW(2, BITS), BATCH_ROW(3, BITS), BATCH_ROW(4, BITS), BATCH_ROW(5, BITS), BATCH_ROW(6, BITS)}
static const BatchFn BATCH4[BATCH_MR_MAX][BATCH_NR_MAX] = BATCH_TABLE(4); /* [MR - 1][NR - 1] */
static const BatchFn BATCH8[BATCH_MR_MAX][BATCH_NR_MAX] = BATCH_TABLE(8);

/* Weight rows [c0, c0 + cols) (cols <= BATCH_COLS) for all M input rows, into out (+ bias). The tiles
 * write into buf [M, BATCH_COLS], copied into out a row at a time: written directly, each tile would
 * touch M cache lines a few floats at a time, and with N * 4 bytes a multiple of 64 KiB (the
 * 49152-row LM head) all M rows of out fall into one cache set and evict each other. so: 2 * cols * G
 * floats for the chunk's scales and offsets as floats. */
static void batch_chunk(const Problem *p, int64_t c0, int64_t cols, float *restrict buf, float *restrict so) {
    const int64_t G = p->G, M = p->M;
    float *scale = so, *offset = so + cols * G;
    for (int64_t r = 0; r < cols; r++)
        for (int64_t g = 0; g < G; g++) scale[r * G + g] = scale_of(p, c0 + r, g);
    for (int64_t r = 0; r < cols; r++)
        for (int64_t g = 0; g < G; g++) offset[r * G + g] = offset_of(p, c0 + r, g);
    const BatchFn(*table)[BATCH_NR_MAX] = p->bits == 4 ? BATCH4 : BATCH8;
    /* The input rows in tiles of near-equal sizes (8 rows: 4 + 4, not 6 + 2: a thin tile does few
     * multiply-adds per weight widened) */
    const int64_t tiles = (M + BATCH_MR - 1) / BATCH_MR;
    for (int64_t t = 0, m0 = 0; t < tiles; t++) {
        const int mr = (int)(M / tiles + (t < M % tiles));
        for (int64_t r = 0; r < cols; r += BATCH_NR)
            table[mr - 1][min64(cols - r, BATCH_NR) - 1](p, scale + r * G, offset + r * G, m0, c0 + r,
                                                          buf + m0 * BATCH_COLS + r, BATCH_COLS);
        m0 += mr;
    }
    for (int64_t m = 0; m < M; m++) {
        float *restrict dst = p->out + m * p->ldo + c0;
        const float *restrict src = buf + m * BATCH_COLS;
        for (int64_t r = 0; r < cols; r++) dst[r] = p->bias ? src[r] + p->bias[c0 + r] : src[r];
    }
}
#else
/* Portable code: the same sums, one output at a time. */
static void fused(const Problem *p, int64_t m0, int64_t n0, int mr, int nr) {
  for (int64_t m = m0; m < m0 + mr; m++) {
    const float *x = p->x + m * p->ldx;
    for (int64_t n = n0; n < n0 + nr; n++) {
        const uint8_t *row = p->data + n * row_bytes(p);
        float total = 0.f;
        for (int64_t g = 0; g < p->G; g++) {
            float acc = 0.f;
            for (int64_t k = g * p->group; k < group_end(p, g); k++) acc += stored(row, k, p->bits) * x[k];
            total += acc * scale_of(p, n, g);
        }
        p->out[m * p->ldo + n] = finish(p, total, m, n);
    }
  }
}

static void dequantize_rows(const Problem *p, int64_t n0, int64_t rows, float *w) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = n0 + r;
        const uint8_t *row = p->data + n * row_bytes(p);
        for (int64_t g = 0; g < p->G; g++) {
            const float s = scale_of(p, n, g), mn = offset_of(p, n, g);
            for (int64_t k = g * p->group; k < group_end(p, g); k++) w[r * p->Kp + k] = s * stored(row, k, p->bits) + mn;
        }
    }
}

#define BATCH_COLS 32
static void batch_chunk(const Problem *p, int64_t c0, int64_t cols, float *buf, float *so) {
    (void)buf, (void)so;
    for (int64_t m = 0; m < p->M; m++) {
        const float *x = p->x + m * p->ldx;
        for (int64_t n = c0; n < c0 + cols; n++) {
            const uint8_t *row = p->data + n * row_bytes(p);
            float y = 0.f;
            for (int64_t g = 0; g < p->G; g++) {
                const float s = scale_of(p, n, g), mn = offset_of(p, n, g);
                for (int64_t k = g * p->group; k < group_end(p, g); k++) y += (s * stored(row, k, p->bits) + mn) * x[k];
            }
            p->out[m * p->ldo + n] = p->bias ? y + p->bias[n] : y;
        }
    }
}
#endif

/* Floats of workspace the batch path needs (see quantized_linear_f32). */
int64_t quantized_batch_workspace(int64_t M, int64_t G, int64_t num_threads) {
    return M + num_threads * (M * BATCH_COLS + 2 * BATCH_COLS * G);
}

/* y = x W^T (+ bias). x: [M, Kp] (row stride ldx, zeros past K); out: [M, N] (row stride ldo).
 * batched = 0: the fused path, workspace holds M * G floats (the group sums of x).
 * batched = 1: the batch path, workspace holds quantized_batch_workspace(M, G, num_threads) floats. */
void quantized_linear_f32(const float *x, const uint8_t *data, const uint16_t *scales, const void *mins,
                          const float *bias, float *out, float *workspace, int64_t M, int64_t N, int64_t Kp,
                          int64_t G, int64_t group, int64_t bits, int64_t ldx, int64_t ldo, int64_t batched,
                          int64_t num_threads, int64_t mins_f32) {
    Problem p = {x, workspace, data, scales, mins, bias, out, M, N, Kp, G, group, bits, ldx, ldo, mins_f32};
    if (batched) {
        /* workspace: the rows' sums of x (for one group per row with mins), then each thread's own */
        const int64_t chunks = (N + BATCH_COLS - 1) / BATCH_COLS, mine = quantized_batch_workspace(M, G, 1) - M;
        if (G == 1 && mins)
            for (int64_t m = 0; m < M; m++) {
                float sum = 0.f;
                for (int64_t k = 0; k < Kp; k++) sum += x[m * ldx + k];
                workspace[m] = sum;
            }
        if (num_threads > chunks) num_threads = chunks;
        if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            float *own = workspace + M + (int64_t)omp_get_thread_num() * mine;
            batch_chunk(&p, c * BATCH_COLS, min64(N - c * BATCH_COLS, BATCH_COLS), own, own + M * BATCH_COLS);
        }
        return;
    }
    if (mins) {
        for (int64_t m = 0; m < M; m++)
            for (int64_t g = 0; g < G; g++) {
                float s = 0.f;
                for (int64_t k = g * group; k < group_end(&p, g); k++) s += x[m * ldx + k];
                workspace[m * G + g] = s;
            }
    }
    /* Weight rows per tile: 8 for one input row (enough independent sums to hide the FMA latency and 8
     * rows streaming at once), fewer as more input rows share each widened block. */
    const int64_t mr = M < FUSED_MR ? M : FUSED_MR, nr = mr == 1 ? 8 : mr == 2 ? 4 : 3;
    const int64_t tiles = (N + nr - 1) / nr;
    if (num_threads > tiles) num_threads = tiles;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t m0 = 0; m0 < M; m0 += mr)
            fused(&p, m0, t * nr, (int)min64(M - m0, mr), (int)min64(N - t * nr, nr));
}

/* ---- int8 activations (W8A8 / W4A8): integer dot products --------------------------------------------
 *
 * For batches, where the float path is bound by its multiply-adds: each input row is quantized to int8
 * with one scale per row (dynamic, per token: sx = max|x| / 127, xq = round(x / sx)), and weights stay
 * integers, as unsigned bytes u (the nibble q for 4 bits; q = stored + 128 for 8 bits), so that one
 * VNNI instruction (vpdpbusd: u8 x s8, four products summed into each int32 lane) does 4x the
 * multiply-adds of a float FMA. With w = s * u + m' per group (m' = min, or min - 128 * s for 8 bits):
 *     y[m, n] = sx[m] * sum_g s[n, g] * D[m, n, g] + sum_g m'[n, g] * Xs[m, g] (+ bias)
 * where D is the exact integer sum of u * xq over group g and Xs[m, g] = sx[m] * sum_g xq: the result is
 * exactly what the quantized x (not x) gives with the true weights, up to float rounding; the error
 * against x is at most sum_k |w[n, k]| * sx[m] / 2.
 *
 * Each group's integer sum must be turned into a float and scaled (2 float operations per group, input
 * row and weight row), which for 64-column groups would cost as much as the dot products. So for 4 bits
 * the 128-bit lanes of a vector hold different groups: lane L of "super-unit" (q, j) holds block j of
 * virtual group 4q + L (a virtual group: VB consecutive blocks of one group, VB <= 4 dividing the
 * group's blocks), its low nibbles in the first vector and its high nibbles in the second; xq is
 * rearranged the same way. A quad of virtual groups then needs one conversion and one multiply by a
 * vector of four scales, after 2 * VB dot products. 8-bit weights (usually one group per row) keep the
 * plain column order, in groups of whole vectors.
 * Built only where the CPU has VNNI (AVX-512 VNNI, or AVX-VNNI on 256-bit vectors): elsewhere these
 * functions do not exist and kernels/cpu/__init__.py keeps float activations. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define QI_BYTES 64
typedef __m512i vi;
#define vi_zero _mm512_setzero_si512
#define vi_dot _mm512_dpbusd_epi32
#define vi_load(p) _mm512_loadu_si512((const void *)(p))
#define vi_flip(v) _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80))
#define vi_float _mm512_cvtepi32_ps
#define vi_nibbles(v) _mm512_and_si512(v, _mm512_set1_epi8(15))
#define vi_high(v) _mm512_srli_epi16(v, 4)
/* Four 16-byte blocks, one per 128-bit lane. */
INLINE vi load_lanes(const uint8_t *row, const int64_t at[4]) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(row + at[0])));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(row + at[1])), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(row + at[2])), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(row + at[3])), 3);
}
/* [s0 x4, s1 x4, s2 x4, s3 x4]: one scale per lane. */
INLINE vf lane_scales(__m128 s) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(s));
}
#elif defined(__AVXVNNI__) && QL_VL == 8 /* (the float vectors must be as wide as the integer ones) */
#define QI_BYTES 32
typedef __m256i vi;
#define vi_zero _mm256_setzero_si256
#define vi_dot _mm256_dpbusd_avx_epi32
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_flip(v) _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80))
#define vi_float _mm256_cvtepi32_ps
#define vi_nibbles(v) _mm256_and_si256(v, _mm256_set1_epi8(15))
#define vi_high(v) _mm256_srli_epi16(v, 4)
INLINE vi load_lanes(const uint8_t *row, const int64_t at[2]) {
    return _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(row + at[1])), _mm_loadu_si128((const __m128i *)(row + at[0])));
}
INLINE vf lane_scales(__m128 s) {
    return _mm256_set_m128(_mm_permute_ps(s, 0x55), _mm_permute_ps(s, 0x00));
}
#else
#define QI_BYTES 0
#endif
#if QI_BYTES
#define LANES (QI_BYTES / 16)
#define QI_MR 4 /* register tiles: up to 4 input rows x 3 weight rows (8 bits) or 2 (4 bits: fewer registers */
#define QI_NR 3 /* left by the wider per-tile state) */
#define QI_NR4 2

typedef struct {
    Problem p;
    const int8_t *xq;  /* [M, row]: 8 bits: x's columns in order; 4 bits: in super-units (see above) */
    const float *sx;   /* [M] */
    const float *xs_t; /* [G, M]: sx * the sum of xq over each group */
    int64_t row;          /* bytes per row of xq */
    int64_t vb, quads;    /* 4 bits: blocks per virtual group, quads of virtual groups */
    const int32_t *owner; /* 4 bits: [quads * LANES] the group of each virtual group, -1 past the end */
    const int32_t *lanes_used; /* 4 bits: [quads] lanes holding a virtual group */
    int whole;                 /* 4 bits: virtual groups are whole groups */
} Q8;

/* Blocks per virtual group: the largest divisor of the group's blocks that is at most 4. */
static int64_t virtual_blocks(int64_t group) {
    const int64_t blocks = group / BLOCK;
    for (int64_t vb = 4; vb > 1; vb--)
        if (blocks % vb == 0) return vb;
    return 1;
}

static int64_t xq_row_bytes(int64_t Kp, int64_t group, int64_t bits) {
    if (bits == 8) return Kp;
    const int64_t vb = virtual_blocks(group), virtual_groups = (Kp / BLOCK + vb - 1) / vb;
    return (virtual_groups + LANES - 1) / LANES * vb * 2 * QI_BYTES;
}

/* m' = the min of w = s * u + m' for the unsigned integers u (see above): the stored min itself;
 * without one, zero for 4 bits and -128 * s for (symmetric) 8 bits. */
static inline float unsigned_min(const Problem *p, int64_t n, int64_t g) {
    if (p->mins) return min_of(p, n, g);
    return p->bits == 4 ? 0.f : -128.f * scale_of(p, n, g);
}

/* LANES adjacent float16 scales as floats (lanes past LANES zero). */
INLINE __m128 lane_halves(const uint16_t *row) {
#if LANES == 4
    return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)row));
#else
    int32_t two;
    memcpy(&two, row, sizeof two);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(two));
#endif
}

/* xq = round(x / sx) with sx = max|x| / 127 (returned); Kp is a multiple of 8. */
static float quantize_row(const float *x, int64_t Kp, int8_t *xq) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 top = _mm256_setzero_ps();
    for (int64_t k = 0; k < Kp; k += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    float lanes[8], amax = 0.f;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    for (int64_t k = 0; k < Kp; k += 8) {
        const __m256i i32 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), inv)); /* to nearest */
        const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64((__m128i *)(xq + k), _mm_packs_epi16(i16, i16));
    }
    return amax / 127.f;
}

/* The 4-bit layout of one row of xq (natural order in `in`): for each super-unit (q, j) the low-nibble
 * vector's bytes then the high-nibble vector's, lane L holding columns 0..15 / 16..31 of block
 * (4q + L) * VB + j, or zeros past the last block. */
static void arrange_row(const int8_t *in, int64_t Kp, int64_t vb, int64_t quads, int8_t *out) {
    const int64_t blocks = Kp / BLOCK;
    for (int64_t q = 0; q < quads; q++)
        for (int64_t j = 0; j < vb; j++) {
            int8_t *unit = out + (q * vb + j) * 2 * QI_BYTES;
            for (int64_t lane = 0; lane < LANES; lane++) {
                const int64_t b = (q * LANES + lane) * vb + j;
                if (b < blocks) {
                    memcpy(unit + lane * 16, in + b * BLOCK, 16);
                    memcpy(unit + QI_BYTES + lane * 16, in + b * BLOCK + 16, 16);
                } else {
                    memset(unit + lane * 16, 0, 16);
                    memset(unit + QI_BYTES + lane * 16, 0, 16);
                }
            }
        }
}

/* The tile's outputs: y = sx * dot + sum_g m'[n, g] * Xs[m, g] (+ bias), four weight rows per vector.
 * total[m][n]: the scaled integer sums, lanes still to be added up. The mins' terms are summed over the
 * groups for four input rows at a time (Xs transposed: [G, M], rows m0.. adjacent), then transposed. */
INLINE void q8_store(const Q8 *q, int64_t m0, int64_t n0, const int MR, const int NR, vf total[QI_MR][QI_NR]) {
    const Problem *p = &q->p;
    __m128 off[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t g = 0; g < p->G; g++) {
        const __m128 xv = load_first(q->xs_t + g * p->M + m0, MR);
        for (int n = 0; n < NR; n++) off[n] = _mm_fmadd_ps(_mm_set1_ps(unsigned_min(p, n0 + n, g)), xv, off[n]);
    }
    _MM_TRANSPOSE4_PS(off[0], off[1], off[2], off[3]); /* now off[m] holds the weight rows n0.. */
    const __m128 b = load_first(p->bias ? p->bias + n0 : NULL, NR);
    for (int m = 0; m < MR; m++) {
        const vf z = vzero();
        const __m128 dots = vsum4(total[m][0], NR > 1 ? total[m][1] : z, NR > 2 ? total[m][2] : z, z);
        const __m128 y = _mm_fmadd_ps(dots, _mm_set1_ps(q->sx[m0 + m]), _mm_add_ps(off[m], b));
        _mm_maskstore_ps(p->out + (m0 + m) * p->ldo + n0, first_lanes(NR), y);
    }
}

/* 8-bit weights, columns in order: groups of whole vectors. */
INLINE void q8_tile8(const Q8 *q, int64_t m0, int64_t n0, const int MR, const int NR) {
    const Problem *p = &q->p;
    const int64_t units = p->Kp / QI_BYTES, per_group = p->group / QI_BYTES;
    vf total[QI_MR][QI_NR];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) total[m][n] = vzero();
    for (int64_t g = 0; g < p->G; g++) {
        vi acc[QI_MR][QI_NR];
        for (int m = 0; m < MR; m++)
            for (int n = 0; n < NR; n++) acc[m][n] = vi_zero();
        const int64_t last = min64((g + 1) * per_group, units);
        for (int64_t u = g * per_group; u < last; u++)
            for (int n = 0; n < NR; n++) {
                const vi w = vi_flip(vi_load(p->data + (n0 + n) * p->Kp + u * QI_BYTES));
                for (int m = 0; m < MR; m++)
                    acc[m][n] = vi_dot(acc[m][n], w, vi_load(q->xq + (m0 + m) * q->row + u * QI_BYTES));
            }
        for (int n = 0; n < NR; n++) {
            const vf s = vset1(scale_of(p, n0 + n, g));
            for (int m = 0; m < MR; m++) total[m][n] = vfma(vi_float(acc[m][n]), s, total[m][n]);
        }
    }
    q8_store(q, m0, n0, MR, NR, total);
}

/* 4-bit weights: quads of virtual groups, one per lane (see above). */
INLINE void q8_tile4(const Q8 *q, int64_t m0, int64_t n0, const int MR, const int NR) {
    const Problem *p = &q->p;
    const int64_t blocks = p->Kp / BLOCK, vb = q->vb;
    vf total[QI_MR][QI_NR];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) total[m][n] = vzero();
    for (int64_t quad = 0; quad < q->quads; quad++) {
        vi acc[QI_MR][QI_NR];
        for (int m = 0; m < MR; m++)
            for (int n = 0; n < NR; n++) acc[m][n] = vi_zero();
        for (int64_t j = 0; j < vb; j++) {
            const int8_t *x = q->xq + (quad * vb + j) * 2 * QI_BYTES;
            int64_t at[LANES]; /* byte offsets of the lanes' blocks; past the end (x is zero there): block 0 */
            for (int lane = 0; lane < LANES; lane++) {
                const int64_t b = (quad * LANES + lane) * vb + j;
                at[lane] = (b < blocks ? b : 0) * (BLOCK / 2);
            }
            for (int n = 0; n < NR; n++) {
                const vi bytes = load_lanes(p->data + (n0 + n) * (p->Kp / 2), at), low = vi_nibbles(bytes), high = vi_nibbles(vi_high(bytes));
                for (int m = 0; m < MR; m++) {
                    const int8_t *xm = x + (m0 + m) * q->row;
                    acc[m][n] = vi_dot(vi_dot(acc[m][n], low, vi_load(xm)), high, vi_load(xm + QI_BYTES));
                }
            }
        }
        /* The lanes' scales, built in registers (through memory, the store-to-load forwarding stalls):
         * where every lane holds a whole group, LANES adjacent float16 scales converted at once. */
        const int32_t *owner = q->owner + quad * LANES;
        const int adjacent = q->whole && q->lanes_used[quad] == LANES;
        for (int n = 0; n < NR; n++) {
            const uint16_t *row = p->scales + (n0 + n) * p->G;
            const __m128 s = adjacent ? lane_halves(row + quad * LANES)
                                      : _mm_setr_ps(owner[0] < 0 ? 0.f : half_to_float(row[owner[0]]),
                                                    owner[1] < 0 ? 0.f : half_to_float(row[owner[1]]),
                                                    LANES > 2 && owner[2] >= 0 ? half_to_float(row[owner[2]]) : 0.f,
                                                    LANES > 3 && owner[3] >= 0 ? half_to_float(row[owner[3]]) : 0.f);
            const vf sv = lane_scales(s);
            for (int m = 0; m < MR; m++) total[m][n] = vfma(vi_float(acc[m][n]), sv, total[m][n]);
        }
    }
    q8_store(q, m0, n0, MR, NR, total);
}

#define Q8_FN4(MR, NR) \
    static void q8_##MR##_##NR##_4(const Q8 *q, int64_t m0, int64_t n0) { q8_tile4(q, m0, n0, MR, NR); }
#define Q8_FN8(MR, NR) \
    static void q8_##MR##_##NR##_8(const Q8 *q, int64_t m0, int64_t n0) { q8_tile8(q, m0, n0, MR, NR); }
Q8_FN4(1, 1) Q8_FN4(1, 2) Q8_FN4(2, 1) Q8_FN4(2, 2) Q8_FN4(3, 1) Q8_FN4(3, 2) Q8_FN4(4, 1) Q8_FN4(4, 2)
Q8_FN8(1, 1) Q8_FN8(1, 2) Q8_FN8(1, 3) Q8_FN8(2, 1) Q8_FN8(2, 2) Q8_FN8(2, 3)
Q8_FN8(3, 1) Q8_FN8(3, 2) Q8_FN8(3, 3) Q8_FN8(4, 1) Q8_FN8(4, 2) Q8_FN8(4, 3)
typedef void (*Q8Fn)(const Q8 *, int64_t, int64_t);
static const Q8Fn Q8_4[QI_MR][QI_NR] = {{q8_1_1_4, q8_1_2_4}, {q8_2_1_4, q8_2_2_4}, {q8_3_1_4, q8_3_2_4}, {q8_4_1_4, q8_4_2_4}};
static const Q8Fn Q8_8[QI_MR][QI_NR] = {{q8_1_1_8, q8_1_2_8, q8_1_3_8}, {q8_2_1_8, q8_2_2_8, q8_2_3_8},
                                        {q8_3_1_8, q8_3_2_8, q8_3_3_8}, {q8_4_1_8, q8_4_2_8, q8_4_3_8}};

static void q8(const Q8 *q, int64_t m0, int64_t n0, int mr, int nr) {
    (q->p.bits == 4 ? Q8_4 : Q8_8)[mr - 1][nr - 1](q, m0, n0);
}

/* Bytes per integer vector: for 8 bits, group sizes and Kp must be multiples of it. */
int64_t quantized_q8_unit(void) { return QI_BYTES; }

/* Floats of workspace quantized_linear_q8_f32 needs: sx, Xs (transposed), the owners table, then the
 * int8 rows. */
int64_t quantized_q8_workspace(int64_t M, int64_t Kp, int64_t G, int64_t group, int64_t bits) {
    const int64_t bytes = bits == 4 ? M * (Kp + xq_row_bytes(Kp, group, bits)) : M * Kp;
    return M + M * G + 2 * (Kp / BLOCK + LANES) + (bytes + 3) / 4;
}

/* y = x W^T (+ bias) through int8 activations (see above). workspace: quantized_q8_workspace() floats. */
void quantized_linear_q8_f32(const float *x, const uint8_t *data, const uint16_t *scales, const void *mins,
                             const float *bias, float *out, float *workspace, int64_t M, int64_t N, int64_t Kp,
                             int64_t G, int64_t group, int64_t bits, int64_t ldx, int64_t ldo, int64_t num_threads,
                             int64_t mins_f32) {
    float *sx = workspace, *xs_t = workspace + M;
    int32_t *owner = (int32_t *)(workspace + M + M * G);
    int32_t *lanes_used = owner + Kp / BLOCK + LANES;
    int8_t *natural = (int8_t *)(workspace + M + M * G + 2 * (Kp / BLOCK + LANES)), *xq = natural;
    const int64_t row = xq_row_bytes(Kp, group, bits), vb = bits == 4 ? virtual_blocks(group) : 1;
    const int64_t virtual_groups = (Kp / BLOCK + vb - 1) / vb, quads = (virtual_groups + LANES - 1) / LANES;
    if (bits == 4) {
        xq = natural + M * Kp; /* the rearranged rows follow the natural ones */
        for (int64_t v = 0; v < quads * LANES; v++) owner[v] = v < virtual_groups ? (int32_t)(v * vb * BLOCK / group) : -1;
        for (int64_t quad = 0; quad < quads; quad++) lanes_used[quad] = (int32_t)min64(LANES, virtual_groups - quad * LANES);
    }
    for (int64_t m = 0; m < M; m++) {
        sx[m] = quantize_row(x + m * ldx, Kp, natural + m * Kp);
        for (int64_t g = 0; g < G; g++) {
            int32_t sum = 0;
            for (int64_t k = g * group; k < min64((g + 1) * group, Kp); k++) sum += natural[m * Kp + k];
            xs_t[g * M + m] = sx[m] * (float)sum;
        }
        if (bits == 4) arrange_row(natural + m * Kp, Kp, vb, quads, xq + m * row);
    }
    const Q8 q = {{x, NULL, data, scales, mins, bias, out, M, N, Kp, G, group, bits, ldx, ldo, mins_f32}, xq, sx, xs_t, row,
                  vb, quads, owner, lanes_used, vb * BLOCK == group};
    /* Strips of 16 tiles, walked one input-row tile at a time: each output row is written in bursts
     * (see quantized_linear_f32), and the strip's weight rows stay in L1/L2 for all the input rows. */
    const int64_t nr = bits == 4 ? QI_NR4 : QI_NR, strip = 48, strips = (N + strip - 1) / strip;
    if (num_threads > strips) num_threads = strips;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t s = 0; s < strips; s++) {
        const int64_t first = s * strip, last = min64(first + strip, N);
        for (int64_t m0 = 0; m0 < M; m0 += QI_MR)
            for (int64_t n0 = first; n0 < last; n0 += nr)
                q8(&q, m0, n0, (int)min64(M - m0, QI_MR), (int)min64(last - n0, nr));
    }
}
#endif /* QI_BYTES */

/* Weight rows [n0, n1) as floats (scale and min applied) into out [n1 - n0, Kp] (row stride Kp), for the
 * BLAS path; the padding columns hold min (x is zero there). */
void quantized_dequantize_f32(const uint8_t *data, const uint16_t *scales, const void *mins, float *out, int64_t N,
                              int64_t Kp, int64_t G, int64_t group, int64_t bits, int64_t n0, int64_t n1,
                              int64_t num_threads, int64_t mins_f32) {
    const Problem p = {NULL, NULL, data, scales, mins, NULL, NULL, 0, N, Kp, G, group, bits, 0, 0, mins_f32};
    const int64_t chunk = 16, chunks = (n1 - n0 + chunk - 1) / chunk;
    if (num_threads > chunks) num_threads = chunks;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t first = n0 + c * chunk;
        dequantize_rows(&p, first, min64(n1 - first, chunk), out + (first - n0) * Kp);
    }
}
