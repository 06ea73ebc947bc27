/* The int8-activation tiles of the quantized linear (W8A8 / W4A8: integer dot products), shared by the dense
 * linear (quantized_matmul.c) and the fused mixture-of-experts (moe.c). The build's cache key covers this
 * header (kernels/cpu/loader.py).
 *
 * Each input row is quantized to int8 in blocks of 32 columns, one scale per block (dynamic, as
 * llama.cpp's Q8_0: dx = max|x over the block| / 127, xq = round(x / dx)), and the weights stay integers,
 * as unsigned bytes u (the nibble q for 4 bits; q = stored + 128 for 8 bits), so that one VNNI
 * instruction (vpdpbusd: u8 x s8, four products summed into each int32 lane) does 4x the multiply-adds of
 * a float FMA and no weight is widened to a float. With w = s * u + m' per group (m' = min, or -128 * s
 * for symmetric 8 bits):
 *     y[m, n] = sum_b dx[m, b] * s[n, g(b)] * D[m, n, b] + sum_g m'[n, g] * X[m, g] (+ bias)
 * where D is the exact integer sum of u * xq over block b and X[m, g] = sum_{b in g} dx[m, b] * (the sum
 * of xq over b): the result is what the quantized x (not x) gives with the true weights, up to float
 * rounding; the error against x is at most sum_k |w[n, k]| * dx[m, b(k)] / 2. One scale per row instead
 * (fewer float operations) cost SmolLM2 3.4 % of perplexity: a few large channels crushed the rest of
 * their row. A row's result depends on that row alone.
 *
 * Layout. A "unit" is one integer vector of a weight row, read with one load: for 4 bits QI_BYTES / 16
 * consecutive 32-column blocks (16 packed bytes each), for 8 bits QI_BYTES consecutive columns. A 4-bit
 * unit's low nibbles are columns 0..15 of its blocks, its high nibbles columns 16..31, so each quantized
 * row is rearranged to match: per unit, a vector whose 128-bit lane L holds columns 0..15 of the unit's
 * block L, then one with columns 16..31 (zeros past the last block). Either way each block's sums are a
 * fixed set of int32 lanes, converted to floats and multiplied by a vector holding each lane's
 * dx[m, b] * s[n, g(b)] (the unit's activation scales, laid out per lane once per row, times the unit's
 * weight scales: one group's, or, where a unit spans groups, each lane's from a vector of the unit's
 * scales). The mins' terms join the same float accumulators, as vectors of m' times vectors of X, so an
 * output needs one horizontal sum. One group per row is scaled after it.
 * Built only where the CPU has VNNI (AVX-512 VNNI, or AVX-VNNI on 256-bit vectors): elsewhere these
 * functions do not exist (QI_BYTES is 0) and kernels/cpu/quantized_matmul.py and moe.py keep float
 * activations. */
#ifndef PAGODA_QUANTIZED_Q8_TILES_H
#define PAGODA_QUANTIZED_Q8_TILES_H
#include "quantized_tiles.h"

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
/* The first `bytes` bytes (a multiple of 16), zeros after: a row's last unit, never read past its end. */
INLINE vi vi_load_first(const uint8_t *p, int64_t bytes) {
    return _mm512_maskz_loadu_epi8(bytes >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << bytes) - 1), p);
}
/* Lane i of the result: s[index[i]] (index < 4). */
INLINE vf vf_pick(vi index, __m128 s) { return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(s)); }
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
INLINE vi vi_load_first(const uint8_t *p, int64_t bytes) {
    return _mm256_maskload_epi32((const int *)p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(bytes / 4)),
                                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
INLINE vf vf_pick(vi index, __m128 s) { return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), index); }
#else
#define QI_BYTES 0
#endif
#if QI_BYTES
#if QL_VL == 16
#define vmul _mm512_mul_ps
#else
#define vmul _mm256_mul_ps
#endif
#define I32_LANES (QI_BYTES / 4)
#define QI_MR 4       /* register tiles: up to 4 input rows x QI_NR weight rows, or 1 x QI_NR1 */
#define QI_NR 3
#define QI_NR1 8
#define QI_PREFETCH 2 /* one input row: as PREFETCH_TILES, each unit asks for the one this many tiles on */

typedef struct {
    Problem p;
    int8_t *xq;          /* [M, row]: the quantized rows (4 bits: rearranged per unit, see above) */
    float *lanes;        /* [M, units * I32_LANES]: each unit's int32 lanes' dx */
    float *xsums;        /* [M, GP]: X (zeros past G) */
    float *dx;           /* [M, Kp / 32]: each block's dx */
    int8_t *natural;     /* [M, Kp]: the quantized rows in column order */
    int64_t row, GP;     /* bytes per row of xq; G rounded up to whole float vectors */
    int64_t units, tail_bytes; /* units per weight row; bytes of its last unit */
    int64_t spanning;    /* units span several groups (else each unit lies in one group) */
    int64_t groups_per_unit, units_per_group;
    int32_t index[I32_LANES]; /* units spanning groups: lane i's group, counted from the unit's first */
} Q8;

/* Blocks of 32 columns per unit. */
static inline int64_t blocks_per_unit(int64_t bits) { return QI_BYTES / (bits == 4 ? 16 : 32); }

static int64_t units_of(int64_t Kp, int64_t bits) {
    const int64_t per_unit = blocks_per_unit(bits);
    return (Kp / BLOCK + per_unit - 1) / per_unit;
}

static int64_t xq_row_bytes(int64_t Kp, int64_t bits) { return units_of(Kp, bits) * QI_BYTES * (bits == 4 ? 2 : 1); }

static inline int64_t float_vectors(int64_t G) { return (G + QL_VL - 1) / QL_VL * QL_VL; }

/* m' of w = s * u + m' for the unsigned integers u: the stored min; without one, zero for 4 bits and
 * -128 * s for (symmetric) 8 bits. */
static inline float unsigned_min(const Problem *p, int64_t n, int64_t g) {
    if (p->mins) return min_of(p, n, g);
    return p->bits == 4 ? 0.f : -128.f * scale_of(p, n, g);
}

/* m'[n, c .. c + QL_VL) as a vector, zeros past G (never read past the row's groups). */
INLINE vf unsigned_mins(const Problem *p, int64_t n, int64_t c) {
    const int64_t at = n * p->G + c;
#if QL_VL == 16
    const __mmask16 in = p->G - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (p->G - c)) - 1);
    if (!p->mins) return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, p->scales + at)), vset1(-128.f));
    if (p->mins_f32) return _mm512_maskz_loadu_ps(in, (const float *)p->mins + at);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, (const uint16_t *)p->mins + at));
#else
    if (c + QL_VL <= p->G) {
        if (p->mins) return p->mins_f32 ? vload((const float *)p->mins + at) : vload_halves((const uint16_t *)p->mins + at);
        return vfma(vload_halves(p->scales + at), vset1(-128.f), vzero());
    }
    float tail[QL_VL] = {0.f};
    for (int64_t g = c; g < p->G; g++) tail[g - c] = unsigned_min(p, n, g);
    return vload(tail);
#endif
}

/* The weight scales of unit u of row n, one per int32 lane: its group's, or (units spanning groups) each
 * lane's group's. */
INLINE vf unit_scales(const Q8 *q, int64_t n, int64_t u, vi index, const int SPANNING) {
    const Problem *p = &q->p;
    if (!SPANNING) return vset1(scale_of(p, n, u / q->units_per_group));
    const int64_t g0 = u * q->groups_per_unit, count = min64(q->groups_per_unit, p->G - g0);
    const uint16_t *row = p->scales + n * p->G + g0;
    __m128 s;
    if (count == 4) {
        s = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)row));
    } else if (count == 2) {
        int32_t two;
        memcpy(&two, row, sizeof two);
        s = _mm_cvtph_ps(_mm_cvtsi32_si128(two));
    } else { /* (a row's last unit) */
        float f[4] = {0.f, 0.f, 0.f, 0.f};
        for (int64_t i = 0; i < count; i++) f[i] = half_to_float(row[i]);
        s = _mm_loadu_ps(f);
    }
    return vf_pick(index, s);
}

/* xq = round(x / dx) per 32-column block, dx = max|x over the block| / 127 (into dx[Kp / 32]). */
static void quantize_row(const float *x, int64_t Kp, int8_t *xq, float *dx) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t b = 0; b < Kp / BLOCK; b++) {
        const float *xb = x + b * BLOCK;
        __m256 top = _mm256_setzero_ps();
        for (int k = 0; k < BLOCK; k += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + k)));
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        const float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
        /* (a block below 127 / FLT_MAX would overflow 127 / amax: it rounds to zeros, off by less than 1e-36) */
        const __m256 inv = _mm256_set1_ps(amax >= 0x1p-120f ? 127.f / amax : 0.f);
        for (int k = 0; k < BLOCK; k += 8) {
            const __m256i i32 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + k), inv)); /* to nearest */
            const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
            _mm_storel_epi64((__m128i *)(xq + b * BLOCK + k), _mm_packs_epi16(i16, i16));
        }
        dx[b] = amax >= 0x1p-120f ? amax / 127.f : 0.f;
    }
}

/* One quantized row of Kp columns (natural order in `in`) as the 4-bit units read it (see above). */
static void arrange_row(const int8_t *in, int64_t Kp, int8_t *out) {
    const int64_t blocks = Kp / BLOCK, per_unit = blocks_per_unit(4), units = units_of(Kp, 4);
    for (int64_t u = 0; u < units; u++)
        for (int64_t lane = 0; lane < per_unit; lane++) {
            int8_t *low = out + u * 2 * QI_BYTES + lane * 16, *high = low + QI_BYTES;
            const int64_t b = u * per_unit + lane;
            if (b < blocks) {
                memcpy(low, in + b * BLOCK, 16);
                memcpy(high, in + b * BLOCK + 16, 16);
            } else {
                memset(low, 0, 16);
                memset(high, 0, 16);
            }
        }
}

/* Unit u of the tile's weight rows times its input rows, scaled, into total (ONE: one group per row,
 * scaled later). MR, NR, BITS, SPANNING, ONE and LAST are constants after inlining: the loops over them
 * unroll and the sums stay in registers. */
INLINE void q8_unit(const Q8 *q, int64_t m0, int64_t n0, int64_t u, const int8_t *xs, const uint8_t *const *rows,
                    vi index, vf total[QI_MR][QI_NR1], const int MR, const int NR, const int BITS,
                    const int SPANNING, const int ONE, const int LAST) {
    const int64_t stride = BITS == 4 ? q->p.Kp / 2 : q->p.Kp, xstep = BITS == 4 ? 2 * QI_BYTES : QI_BYTES;
    const int64_t lanes_row = q->units * I32_LANES;
    vi xl[QI_MR], xh[QI_MR];
    vf dx[QI_MR];
    for (int m = 0; m < MR; m++) {
        xl[m] = vi_load(xs + m * q->row + u * xstep);
        xh[m] = BITS == 4 ? vi_load(xs + m * q->row + u * xstep + QI_BYTES) : xl[m];
        dx[m] = vload(q->lanes + (m0 + m) * lanes_row + u * I32_LANES);
    }
    for (int n = 0; n < NR; n++) {
        const uint8_t *at = rows[n] + u * QI_BYTES;
        __builtin_prefetch(at + QI_PREFETCH * NR * stride);
        const vi w = LAST ? vi_load_first(at, q->tail_bytes) : vi_load(at);
        const vi low = BITS == 4 ? vi_nibbles(w) : vi_flip(w), high = BITS == 4 ? vi_nibbles(vi_high(w)) : w;
        const vf s = ONE ? vzero() : unit_scales(q, n0 + n, u, index, SPANNING);
        for (int m = 0; m < MR; m++) {
            vi dot = vi_dot(vi_zero(), low, xl[m]);
            if (BITS == 4) dot = vi_dot(dot, high, xh[m]);
            total[m][n] = vfma(vi_float(dot), ONE ? dx[m] : vmul(s, dx[m]), total[m][n]);
        }
    }
}

/* out[m0 .. m0 + MR, n0 .. n0 + NR]. */
INLINE void q8_tile(const Q8 *q, int64_t m0, int64_t n0, const int MR, const int NR, const int BITS,
                    const int SPANNING, const int ONE) {
    const Problem *p = &q->p;
    const int64_t stride = BITS == 4 ? p->Kp / 2 : p->Kp, units = q->units;
    const uint8_t *rows[QI_NR1];
    for (int n = 0; n < NR; n++) rows[n] = p->data + (n0 + n) * stride;
    const int8_t *xs = q->xq + m0 * q->row;
    const vi index = SPANNING ? vi_load(q->index) : vi_zero();
    vf total[QI_MR][QI_NR1];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) total[m][n] = vzero();
    for (int64_t u = 0; u + 1 < units; u++) q8_unit(q, m0, n0, u, xs, rows, index, total, MR, NR, BITS, SPANNING, ONE, 0);
    q8_unit(q, m0, n0, units - 1, xs, rows, index, total, MR, NR, BITS, SPANNING, ONE, 1); /* (the row's last) */
    if ((p->mins || BITS == 8) && !ONE) /* the mins' terms, m' . X */
        for (int n = 0; n < NR; n++)
            for (int64_t c = 0; c < q->GP; c += QL_VL) {
                const vf mins = unsigned_mins(p, n0 + n, c);
                for (int m = 0; m < MR; m++) total[m][n] = vfma(mins, vload(q->xsums + (m0 + m) * q->GP + c), total[m][n]);
            }
    __m128 scale[(QI_NR1 + 3) / 4], mins[(QI_NR1 + 3) / 4]; /* one group per row: 4 weight rows' s and m' */
    if (ONE)
        for (int n = 0; n < NR; n += 4) {
#define ROW_(f, i) (n + (i) < NR ? f(p, n0 + n + (i), 0) : 0.f)
            scale[n / 4] = _mm_setr_ps(ROW_(scale_of, 0), ROW_(scale_of, 1), ROW_(scale_of, 2), ROW_(scale_of, 3));
            mins[n / 4] = _mm_setr_ps(ROW_(unsigned_min, 0), ROW_(unsigned_min, 1), ROW_(unsigned_min, 2), ROW_(unsigned_min, 3));
#undef ROW_
        }
    for (int m = 0; m < MR; m++) {
        const vf z = vzero();
        for (int n = 0; n < NR; n += 4) {
            const int here = NR - n < 4 ? NR - n : 4;
            __m128 y = vsum4(total[m][n], here > 1 ? total[m][n + 1] : z, here > 2 ? total[m][n + 2] : z,
                             here > 3 ? total[m][n + 3] : z);
            if (ONE) y = _mm_fmadd_ps(y, scale[n / 4], _mm_mul_ps(mins[n / 4], _mm_set1_ps(q->xsums[(m0 + m) * q->GP])));
            y = _mm_add_ps(y, load_first(p->bias ? p->bias + n0 + n : NULL, here));
            _mm_maskstore_ps(p->out + (m0 + m) * p->ldo + n0 + n, first_lanes(here), y);
        }
    }
}

/* One function per (tile shape, bits, kind of groups): 1 x 1..8, 2..4 x 1..3; kinds: 0 each unit in one
 * of several groups, 1 units spanning groups, 2 one group per row. */
#define Q8_FN(MR, NR, BITS, KIND)                                                          \
    static void q8_##MR##_##NR##_##BITS##_##KIND(const Q8 *q, int64_t m0, int64_t n0) { \
        q8_tile(q, m0, n0, MR, NR, BITS, KIND == 1, KIND == 2);                          \
    }
#define Q8_FNS(BITS, K)                                                                                \
    Q8_FN(1, 1, BITS, K) Q8_FN(1, 2, BITS, K) Q8_FN(1, 3, BITS, K) Q8_FN(1, 4, BITS, K) Q8_FN(1, 5, BITS, K)  \
    Q8_FN(1, 6, BITS, K) Q8_FN(1, 7, BITS, K) Q8_FN(1, 8, BITS, K) Q8_FN(2, 1, BITS, K) Q8_FN(2, 2, BITS, K)  \
    Q8_FN(2, 3, BITS, K) Q8_FN(3, 1, BITS, K) Q8_FN(3, 2, BITS, K) Q8_FN(3, 3, BITS, K) Q8_FN(4, 1, BITS, K)  \
    Q8_FN(4, 2, BITS, K) Q8_FN(4, 3, BITS, K)
Q8_FNS(4, 0) Q8_FNS(4, 1) Q8_FNS(4, 2) Q8_FNS(8, 0) Q8_FNS(8, 1) Q8_FNS(8, 2)
typedef void (*Q8Fn)(const Q8 *, int64_t, int64_t);
#define Q8_TABLE(BITS, K)                                                                                  \
    {{q8_1_1_##BITS##_##K, q8_1_2_##BITS##_##K, q8_1_3_##BITS##_##K, q8_1_4_##BITS##_##K, q8_1_5_##BITS##_##K, \
      q8_1_6_##BITS##_##K, q8_1_7_##BITS##_##K, q8_1_8_##BITS##_##K},                                      \
     {q8_2_1_##BITS##_##K, q8_2_2_##BITS##_##K, q8_2_3_##BITS##_##K},                                      \
     {q8_3_1_##BITS##_##K, q8_3_2_##BITS##_##K, q8_3_3_##BITS##_##K},                                      \
     {q8_4_1_##BITS##_##K, q8_4_2_##BITS##_##K, q8_4_3_##BITS##_##K}}
static const Q8Fn Q8_TILES[2][3][QI_MR][QI_NR1] = {{Q8_TABLE(4, 0), Q8_TABLE(4, 1), Q8_TABLE(4, 2)},
                                                   {Q8_TABLE(8, 0), Q8_TABLE(8, 1), Q8_TABLE(8, 2)}};

/* Floats of workspace for M rows of Kp columns against weights of G groups (q8_layout's). */
static int64_t q8_floats(int64_t M, int64_t Kp, int64_t G, int64_t bits) {
    const int64_t bytes = M * (Kp + xq_row_bytes(Kp, bits));
    return M * units_of(Kp, bits) * I32_LANES + M * float_vectors(G) + M * (Kp / BLOCK) + (bytes + 3) / 4;
}

/* A Q8 for M input rows against weights of this layout (groups quantized_q8_supported), its rows' arrays in
 * `workspace` (q8_floats floats): the lanes' dx, X, the blocks' dx, then the int8 rows (natural, then as
 * read). The caller fills p's weights, bias, out and ldo, and each row with q8_quantize_row. */
static Q8 q8_layout(int64_t M, int64_t Kp, int64_t G, int64_t group, int64_t bits, float *workspace) {
    const int64_t blocks = Kp / BLOCK, per_unit = blocks_per_unit(bits), per_group = G == 1 ? blocks : group / BLOCK;
    const int64_t units = units_of(Kp, bits), GP = float_vectors(G);
    const int spanning = G > 1 && per_group % per_unit != 0;
    Q8 q;
    memset(&q, 0, sizeof q);
    q.p.M = M, q.p.Kp = Kp, q.p.G = G, q.p.group = group, q.p.bits = bits;
    q.lanes = workspace, q.xsums = q.lanes + M * units * I32_LANES, q.dx = q.xsums + M * GP;
    q.natural = (int8_t *)(q.dx + M * blocks), q.xq = q.natural + M * Kp;
    q.row = xq_row_bytes(Kp, bits), q.GP = GP, q.units = units;
    q.tail_bytes = (blocks - (units - 1) * per_unit) * (bits == 4 ? 16 : 32);
    q.spanning = spanning, q.groups_per_unit = spanning ? per_unit / per_group : 1;
    q.units_per_group = spanning ? 1 : per_group / per_unit;
    if (spanning)
        for (int i = 0; i < I32_LANES; i++) q.index[i] = (int32_t)(i / (I32_LANES / per_unit) / per_group);
    return q;
}

/* Input row m (x: Kp floats, zeros past K) quantized into q's arrays: its blocks' int8 values and dx, X, its
 * lanes' dx, and its int8 values as the units read them. Rows are independent (threads may share them out). */
static void q8_quantize_row(const Q8 *q, const float *x, int64_t m) {
    const int64_t Kp = q->p.Kp, G = q->p.G, blocks = Kp / BLOCK, per_unit = blocks_per_unit(q->p.bits);
    const int64_t per_group = G == 1 ? blocks : q->p.group / BLOCK;
    int8_t *own = q->natural + m * Kp;
    float *dxm = q->dx + m * blocks, *lanes = q->lanes + m * q->units * I32_LANES;
    quantize_row(x, Kp, own, dxm);
    for (int64_t g = 0; g < q->GP; g++) {
        float sum = 0.f; /* X[m, g]: each block's exact integer sum, scaled */
        for (int64_t b = g * per_group; g < G && b < min64((g + 1) * per_group, blocks); b++) {
            int32_t block = 0;
            for (int64_t k = b * BLOCK; k < (b + 1) * BLOCK; k++) block += own[k];
            sum += dxm[b] * (float)block;
        }
        q->xsums[m * q->GP + g] = sum;
    }
    for (int64_t i = 0; i < q->units * I32_LANES; i++) { /* lane i of unit u: block u * per_unit + its place */
        const int64_t b = i / I32_LANES * per_unit + i % I32_LANES / (I32_LANES / per_unit);
        lanes[i] = b < blocks ? dxm[b] : 0.f;
    }
    if (q->p.bits == 4) {
        arrange_row(own, Kp, q->xq + m * q->row);
    } else {
        memcpy(q->xq + m * q->row, own, Kp);
        memset(q->xq + m * q->row + Kp, 0, q->row - Kp);
    }
}

/* q's rows from `start` on, as rows 0.. of the result (the weights, out and bias stay the caller's). */
static Q8 q8_rows_from(const Q8 *q, int64_t start) {
    Q8 s = *q;
    s.xq += start * q->row, s.natural += start * q->p.Kp;
    s.lanes += start * q->units * I32_LANES, s.xsums += start * q->GP, s.dx += start * (q->p.Kp / BLOCK);
    return s;
}

/* out[0 .. M, first .. last) of q's rows times its weight rows, one register tile after another. */
static void q8_columns(const Q8 *q, int64_t M, int64_t first, int64_t last) {
    const Q8Fn(*tiles)[QI_NR1] = Q8_TILES[q->p.bits == 8][q->p.G == 1 ? 2 : q->spanning];
    const int64_t nr = M == 1 ? QI_NR1 : QI_NR;
    for (int64_t m0 = 0; m0 < M; m0 += QI_MR)
        for (int64_t n0 = first; n0 < last; n0 += nr)
            tiles[min64(M - m0, QI_MR) - 1][min64(last - n0, nr) - 1](q, m0, n0);
}
#endif /* QI_BYTES */
#endif /* PAGODA_QUANTIZED_Q8_TILES_H */
