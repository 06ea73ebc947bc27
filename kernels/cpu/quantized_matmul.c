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
#include "quantized_tiles.h"

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
