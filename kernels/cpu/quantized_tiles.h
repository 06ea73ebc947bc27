/* The float tiles of the quantized linear (kernels/quantized.py's PackedWeight times float32 rows): the
 * `Problem` a call describes, the fused tiles (`fused`: a few input rows, each weight block widened once per
 * tile) and the batch tiles (`batch_chunk`: many input rows, weights widened and scaled in registers).
 * Shared by the dense linear (quantized_matmul.c, whose top comment describes the paths) and the fused
 * mixture-of-experts (moe.c). The build's cache key covers this header (kernels/cpu/loader.py). */
#ifndef PAGODA_QUANTIZED_TILES_H
#define PAGODA_QUANTIZED_TILES_H
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

#if QL_VL
/* QL_VL float16 values (their bits) as floats. */
static inline vf vload_halves(const uint16_t *h) {
#if QL_VL == 16
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#else
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#endif
}

/* sum_g offset_of(p, n, g) * xs[g], QL_VL groups at a time: as a scalar loop (two float16 conversions per
 * group and output) it was a third of a one-row 4-bit decode's time on K = 576 (groups of 32). */
static inline float offsets_dot(const Problem *p, int64_t n, const float *xs) {
    const int64_t G = p->G, at = n * G;
    vf acc = vzero();
    int64_t g = 0;
    for (; g + QL_VL <= G; g += QL_VL) {
        vf offset = p->mins_f32 ? vload((const float *)p->mins + at + g) : vload_halves((const uint16_t *)p->mins + at + g);
        if (p->bits == 8) offset = vfma(vload_halves(p->scales + at + g), vset1(128.f), offset);
        acc = vfma(offset, vload(xs + g), acc);
    }
    float dot = vhsum(acc);
    for (; g < G; g++) dot += offset_of(p, n, g) * xs[g];
    return dot;
}
#else
static inline float offsets_dot(const Problem *p, int64_t n, const float *xs) {
    float dot = 0.f;
    for (int64_t g = 0; g < p->G; g++) dot += offset_of(p, n, g) * xs[g];
    return dot;
}
#endif

/* The fused path's scalar parts of one output: the offsets' term and the bias. */
static inline float finish(const Problem *p, float dot, int64_t m, int64_t n) {
    if (p->mins) dot += offsets_dot(p, n, p->xsums + m * p->G);
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

/* With one input row the fused tiles stream their weights, NR short rows at a time, and the hardware
 * prefetcher alone left them at 10-11 GB/s of the ~26 a sequential read gets (2-core AMD EPYC): each block
 * also asks for the same block PREFETCH_TILES tiles further on (SmolLM2's linears at one row, 2 threads:
 * 1.2-1.3x faster; one tile ahead gained less, four lost some of it). A prefetch past the weights' end
 * is harmless: prefetches never fault. */
#define PREFETCH_TILES 2

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
                if (MR == 1) /* (one input row: see PREFETCH_TILES) */
                    __builtin_prefetch(rows[n] + PREFETCH_TILES * NR * row_bytes(p) + b * (BITS == 4 ? BLOCK / 2 : BLOCK));
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

#endif
