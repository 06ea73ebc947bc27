/* MXFP4 weights (gpt-oss's experts, kernels/mxfp4.py) as float32 on the CPU: E2M1 nibbles looked up in a
 * 16-entry table, each 32-value block's table scaled by its power of two 2^(s - 127). Shared by the
 * dequantization (mxfp4.c) and the fused mixture-of-experts' GEMM tiles (moe.c), which expand each block in
 * registers and never write a dequantized weight to memory.
 *
 * A block is 16 bytes, byte i holding element 2i in its low nibble and 2i + 1 in its high one (the
 * checkpoint's layout, read as it is). A nibble's value is a table lookup: with AVX-512, `vpermps` over
 * the whole table (it reads an index's low 4 bits, so a low nibble needs no mask); with AVX2, whose
 * `vpermps` indexes 8 entries, the three magnitude bits look up the 8 non-negative levels and the fourth
 * bit, the sign, is moved into the float's sign bit. A level times a power of two is exact, so a looked-up
 * weight equals the reference's dequantized one bit for bit.
 *
 * The tiles take each input row with every 32-column block in the order its weights' bytes hold them
 * (`mxfp4_order`: the 16 even columns, then the 16 odd ones): then the low nibbles of a block's 16 bytes
 * are the first 16 columns and the high nibbles the last 16, one vector each with AVX-512, and no weight
 * is shuffled back into column order (a row of x is reordered once per projection; each weight row would
 * be once per row of x). The build's cache key covers this header (kernels/cpu/loader.py). */
#ifndef PAGODA_MXFP4_TILES_H
#define PAGODA_MXFP4_TILES_H
#include <stdint.h>
#include <string.h>

#include "quantized_tiles.h" /* (the vector types: vf, QL_VL, vfma, vhsum; BLOCK, INLINE, min64) */

#define MX_BYTES (BLOCK / 2) /* bytes of one block's 32 nibbles */

/* The E2M1 value of each nibble (sign bit 3, then the level). */
static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 2^(s - 127) from its biased exponent byte, exactly as torch.ldexp scales: s is the float's exponent
 * field, but s = 0 is the subnormal 2^-127 and s = 255 infinity. */
static inline float e8m0_scale(uint8_t s) {
    const uint32_t bits = s ? (uint32_t)s << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* `count` scale bytes as their floats (a loop the compiler vectorizes). */
static inline void mx_scales(const uint8_t *restrict s, int64_t count, float *restrict out) {
    for (int64_t i = 0; i < count; i++) out[i] = e8m0_scale(s[i]);
}

/* A row's `blocks` blocks of 32 values from src (column order) into dst (`mxfp4_order`); dst may be src. */
static inline void mxfp4_order(const float *src, float *dst, int64_t blocks) {
    for (int64_t b = 0; b < blocks; b++) {
        float tmp[BLOCK];
        for (int i = 0; i < BLOCK / 2; i++) tmp[i] = src[b * BLOCK + 2 * i];
        for (int i = 0; i < BLOCK / 2; i++) tmp[BLOCK / 2 + i] = src[b * BLOCK + 2 * i + 1];
        memcpy(dst + b * BLOCK, tmp, sizeof tmp);
    }
}

#if QL_VL == 16
/* The lookup table of a block with scale `scale`: all 16 values. */
INLINE vf mx_table(float scale) { return _mm512_mul_ps(_mm512_loadu_ps(E2M1), _mm512_set1_ps(scale)); }
/* Lanes of nibbles (each lane's low 4 bits; the rest are ignored) -> their values in `table`. */
INLINE vf mx_lookup(__m512i nibbles, vf table) { return _mm512_permutexvar_ps(nibbles, table); }
/* One block's 32 values, in `mxfp4_order`, as two vectors. */
INLINE void mx_expand(const uint8_t *bytes, vf table, vf w[]) {
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    w[0] = mx_lookup(wide, table);                        /* low nibbles: even columns */
    w[1] = mx_lookup(_mm512_srli_epi32(wide, 4), table); /* high nibbles: odd columns */
}
#elif QL_VL == 8
/* The lookup table of a block with scale `scale`: the 8 non-negative levels (mx_lookup sets the sign). */
INLINE vf mx_table(float scale) { return _mm256_mul_ps(_mm256_loadu_ps(E2M1), _mm256_set1_ps(scale)); }
/* Lanes of nibbles (each lane's low 4 bits; the rest must be zero but for bits the lookup ignores: bits 4
 * to 7 of a byte widened whole) -> their values: the magnitude from bits 0-2, bit 3 into the sign bit. */
INLINE vf mx_lookup(__m256i nibbles, vf levels) {
    const __m256 magnitude = _mm256_permutevar8x32_ps(levels, nibbles);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(nibbles, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
}
/* One block's 32 values, in `mxfp4_order`, as four vectors. */
INLINE void mx_expand(const uint8_t *bytes, vf levels, vf w[]) {
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));       /* bytes 0..7 */
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + 8))); /* bytes 8..15 */
    w[0] = mx_lookup(lo, levels), w[1] = mx_lookup(hi, levels); /* low nibbles: even columns */
    w[2] = mx_lookup(_mm256_srli_epi32(lo, 4), levels), w[3] = mx_lookup(_mm256_srli_epi32(hi, 4), levels);
}
#endif

/* A projection of rows of x by MXFP4 weight rows: out[m, n] = x[m] . W[n] (+ bias[n]). */
typedef struct {
    const float *x;        /* [M, K] row stride ldx, each block in `mxfp4_order` */
    const uint8_t *blocks; /* [N, K / 32, 16] */
    const uint8_t *scales; /* [N, K / 32] */
    const float *bias;     /* [N] or NULL */
    float *out;            /* [M, N] row stride ldo */
    int64_t M, N, K, ldx, ldo;
} Mxfp4Problem;

/* A tile is up to MX_MR rows of x by mx_nr(mr) weight rows: one vector of sums per (row, weight row), each
 * block's weights expanded once for all the tile's rows of x and each vector of x loaded once for all its
 * weight rows. With AVX-512's 32 registers: 1 x 8 (8 sums, 16 weight vectors) and 2-4 x 4 (up to 16 sums,
 * 8 weight vectors); with AVX2's 16, whose block is four vectors: 1-2 x 2 and 3-4 x 1. */
#define MX_MR 4
#define MX_NR_MAX 8
static inline int mx_nr(int mr) {
#if QL_VL == 16
    return mr == 1 ? 8 : 4;
#elif QL_VL == 8
    return mr <= 2 ? 2 : 1;
#else
    return 4;
#endif
}

#if QL_VL
INLINE void mx_tile(const Mxfp4Problem *p, int64_t m0, int64_t n0, const int MR, const int NR) {
    const int64_t blocks = p->K / BLOCK, ldx = p->ldx;
    const uint8_t *bytes[MX_NR_MAX];
    for (int n = 0; n < NR; n++) bytes[n] = p->blocks + (n0 + n) * blocks * MX_BYTES;
    /* The NR rows' scales as floats first, in one vectorizable pass (NR rows are adjacent): converted one
     * at a time in the block loop, their integer work and moves into vector registers were a good share of
     * the loop's (measured: 7.5 -> 6.9 ms for gpt-oss-20b's four experts at one token, one thread). */
    float scale[MX_NR_MAX * blocks];
    mx_scales(p->scales + n0 * blocks, NR * blocks, scale);
    const float *restrict x = p->x + m0 * ldx;
    vf acc[MX_MR][MX_NR_MAX];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) acc[m][n] = vzero();
    for (int64_t b = 0; b < blocks; b++) {
        vf w[MX_NR_MAX][BLOCK / QL_VL];
        for (int n = 0; n < NR; n++) mx_expand(bytes[n] + b * MX_BYTES, mx_table(scale[n * blocks + b]), w[n]);
        for (int m = 0; m < MR; m++)
            for (int i = 0; i < BLOCK / QL_VL; i++) {
                vf xv = vload(x + m * ldx + b * BLOCK + QL_VL * i);
                __asm__("" : "+v"(xv)); /* (one load for the NR weight rows, not one folded into each FMA) */
                for (int n = 0; n < NR; n++) acc[m][n] = vfma(w[n][i], xv, acc[m][n]);
            }
    }
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) {
            const float sum = vhsum(acc[m][n]);
            p->out[(m0 + m) * p->ldo + n0 + n] = p->bias != NULL ? sum + p->bias[n0 + n] : sum;
        }
}

#define MX_FN(MR, NR) \
    static void mx_##MR##_##NR(const Mxfp4Problem *p, int64_t m0, int64_t n0) { mx_tile(p, m0, n0, MR, NR); }
#define MX_FNS(MR) \
    MX_FN(MR, 1) MX_FN(MR, 2) MX_FN(MR, 3) MX_FN(MR, 4) MX_FN(MR, 5) MX_FN(MR, 6) MX_FN(MR, 7) MX_FN(MR, 8)
MX_FNS(1)
MX_FNS(2)
MX_FNS(3)
MX_FNS(4)
typedef void (*MxFn)(const Mxfp4Problem *, int64_t, int64_t);
#define MX_ROW(MR) \
    {mx_##MR##_1, mx_##MR##_2, mx_##MR##_3, mx_##MR##_4, mx_##MR##_5, mx_##MR##_6, mx_##MR##_7, mx_##MR##_8}
static const MxFn MX_TILES[MX_MR][MX_NR_MAX] = {MX_ROW(1), MX_ROW(2), MX_ROW(3), MX_ROW(4)}; /* [MR - 1][NR - 1] */

static void mx_run(const Mxfp4Problem *p, int64_t m0, int64_t n0, int mr, int nr) {
    MX_TILES[mr - 1][nr - 1](p, m0, n0);
}
#else
/* Portable code: the same sums, one output at a time. */
static void mx_run(const Mxfp4Problem *p, int64_t m0, int64_t n0, int mr, int nr) {
    const int64_t blocks = p->K / BLOCK;
    for (int64_t m = m0; m < m0 + mr; m++)
        for (int64_t n = n0; n < n0 + nr; n++) {
            const uint8_t *bytes = p->blocks + n * blocks * MX_BYTES;
            const float *x = p->x + m * p->ldx;
            float sum = 0.f;
            for (int64_t b = 0; b < blocks; b++) {
                const float scale = e8m0_scale(p->scales[n * blocks + b]);
                for (int i = 0; i < MX_BYTES; i++) {
                    const uint8_t byte = bytes[b * MX_BYTES + i];
                    sum += E2M1[byte & 15] * scale * x[b * BLOCK + i];
                    sum += E2M1[byte >> 4] * scale * x[b * BLOCK + MX_BYTES + i];
                }
            }
            p->out[m * p->ldo + n] = p->bias != NULL ? sum + p->bias[n] : sum;
        }
}
#endif

/* Weight rows [n0, n0 + cols) for all M rows of x: the rows in tiles of near-equal sizes (5 rows: 3 + 2,
 * not 4 + 1: a thin tile does few multiply-adds per weight expanded). */
static void mxfp4_chunk(const Mxfp4Problem *p, int64_t n0, int64_t cols) {
    const int64_t tiles = (p->M + MX_MR - 1) / MX_MR;
    for (int64_t t = 0, m0 = 0; t < tiles; t++) {
        const int mr = (int)(p->M / tiles + (t < p->M % tiles)), nr = mx_nr(mr);
        for (int64_t n = n0; n < n0 + cols; n += nr) mx_run(p, m0, n, mr, (int)min64(n0 + cols - n, nr));
        m0 += mr;
    }
}

#endif
