/* Weight-only quantized linear for the CPU, float32 activations: y = x W^T (+ bias), where W is a
 * kernels/quantized.py PackedWeight: 4-bit (GGUF block order: 16 bytes per 32 columns, byte j = column j
 * in the low nibble, column j + 16 in the high one) or 8-bit (int8 holding q - 128), with one float scale
 * and one optional float min per (output row, group of columns): w = scale * stored + min.
 *
 * Two ways through, both reading the packed weight once per call and never dequantizing all of it:
 * - fused (one input row: decode). A tile of NR weight rows is widened block by block into float vectors
 *   in registers (the stored integers, converted exactly) and multiplied into the input row; a group's
 *   sum is scaled once at the group's end, and the mins enter as min[n, g] * sum(x over group g), so they
 *   cost nothing per element. Bound by the widening work (1 or 0.5 byte of weight per multiply-add).
 * - strips (several input rows). Each thread dequantizes a strip of weight rows (scale and min applied)
 *   into its own workspace, which stays in L2, and runs a plain float32 register tile (MR input rows x NR
 *   weight rows of dot products) over it for every input row: the widening is paid once per strip, not
 *   once per input row, and the group bookkeeping leaves the inner loop.
 * For many rows (prefill) kernels/cpu/__init__.py dequantizes tiles with `quantized_dequantize_f32` and
 * multiplies them with BLAS, whose cache blocking wins there.
 *
 * Intrinsics, AVX-512 or AVX2 + FMA as the build machine has them (the library is built with
 * -march=native), each behind its #if: the int8/int4 -> float widening (vpmovzx/vpmovsx + vcvtdq2ps, the
 * nibbles split by one mask and one shift on 32-bit lanes) is not what GCC makes of the scalar loop or of
 * its generic vector types (it extracts bytes through general registers, several times slower). The
 * scalar code at the end is the portable fallback and the definition of every result.
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
#else
#define QL_VL 0
#endif

#define BLOCK 32
#define FUSED_MR 4 /* fused tiles: up to 4 input rows x 8 weight rows (fused_nr() below) */
#define FUSED_NR 8
#define MR_MAX 4   /* register tile of the strip path: up to 4 input rows x 3 weight rows */
#define NR_MAX 3
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const float *x;             /* [M, Kp] row stride ldx, zero in columns K..Kp */
    const float *xsums;         /* [M, G]: x summed over each group (fused path with mins) */
    const uint8_t *data;        /* [N, Kp/2] (4 bits) or [N, Kp] int8 (8 bits) */
    const float *scales, *mins; /* [N, G]; mins NULL = zero */
    const float *bias;          /* [N] or NULL */
    float *out;                 /* [M, N] row stride ldo */
    int64_t M, N, Kp, G, group, bits, ldx, ldo;
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

/* The fused path's scalar parts of one output: the mins term and the bias. */
static inline float finish(const Problem *p, float dot, int64_t m, int64_t n) {
    if (p->mins) {
        const float *mins = p->mins + n * p->G, *xs = p->xsums + m * p->G;
        for (int64_t g = 0; g < p->G; g++) dot += mins[g] * xs[g];
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
            const vf s = vset1(p->scales[(n0 + n) * p->G + g]);
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

/* Weight rows [n0, n0 + rows) as floats, scale and min applied, into w [rows, Kp] (row stride Kp). */
static void dequantize_rows(const Problem *p, int64_t n0, int64_t rows, float *w) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = n0 + r;
        const uint8_t *row = p->data + n * row_bytes(p);
        float *dst = w + r * p->Kp;
        for (int64_t g = 0; g < p->G; g++) {
            const vf s = vset1(p->scales[n * p->G + g]), mn = vset1(p->mins ? p->mins[n * p->G + g] : 0.f);
            for (int64_t b = g * p->group / BLOCK; b < group_end(p, g) / BLOCK; b++) {
                vf v[BLOCK / QL_VL];
                if (p->bits == 4)
                    widen(row, b, 4, v);
                else
                    widen(row, b, 8, v);
                for (int i = 0; i < BLOCK / QL_VL; i++) vstore(dst + b * BLOCK + QL_VL * i, vfma(v[i], s, mn));
            }
        }
    }
}

/* out[m0 .. m0+MR, n0 .. n0+NR] from dequantized weight rows w (row n0 first, row stride Kp). */
INLINE void dense_tile(const Problem *p, const float *w, int64_t m0, int64_t n0, const int MR, const int NR) {
    vf acc[MR_MAX][NR_MAX];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) acc[m][n] = vzero();
    for (int64_t k = 0; k < p->Kp; k += QL_VL) {
        vf wv[NR_MAX];
        for (int n = 0; n < NR; n++) wv[n] = vload(w + n * p->Kp + k);
        for (int m = 0; m < MR; m++) {
            const vf xv = vload(p->x + (m0 + m) * p->ldx + k);
            for (int n = 0; n < NR; n++) acc[m][n] = vfma(wv[n], xv, acc[m][n]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) {
            const float y = vhsum(acc[m][n]);
            p->out[(m0 + m) * p->ldo + n0 + n] = p->bias ? y + p->bias[n0 + n] : y;
        }
}

#define DENSE_FN(MR, NR) \
    static void dense_##MR##_##NR(const Problem *p, const float *w, int64_t m0, int64_t n0) { dense_tile(p, w, m0, n0, MR, NR); }
#define DENSE_FNS(MR) DENSE_FN(MR, 1) DENSE_FN(MR, 2) DENSE_FN(MR, 3)
DENSE_FNS(1)
DENSE_FNS(2)
DENSE_FNS(3)
DENSE_FNS(4)
typedef void (*DenseFn)(const Problem *, const float *, int64_t, int64_t);
static const DenseFn DENSE[MR_MAX][NR_MAX] = {{dense_1_1, dense_1_2, dense_1_3},
                                              {dense_2_1, dense_2_2, dense_2_3},
                                              {dense_3_1, dense_3_2, dense_3_3},
                                              {dense_4_1, dense_4_2, dense_4_3}};

static void dense(const Problem *p, const float *w, int64_t m0, int64_t n0, int mr, int nr) {
    DENSE[mr - 1][nr - 1](p, w, m0, n0);
}
#else
/* Portable code: the same sums in the same grouping, one output at a time. */
static void fused(const Problem *p, int64_t m0, int64_t n0, int mr, int nr) {
  for (int64_t m = m0; m < m0 + mr; m++) {
    const float *x = p->x + m * p->ldx;
    for (int64_t n = n0; n < n0 + nr; n++) {
        const uint8_t *row = p->data + n * row_bytes(p);
        float total = 0.f;
        for (int64_t g = 0; g < p->G; g++) {
            float acc = 0.f;
            for (int64_t k = g * p->group; k < group_end(p, g); k++) acc += stored(row, k, p->bits) * x[k];
            total += acc * p->scales[n * p->G + g];
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
            const float s = p->scales[n * p->G + g], mn = p->mins ? p->mins[n * p->G + g] : 0.f;
            for (int64_t k = g * p->group; k < group_end(p, g); k++) w[r * p->Kp + k] = s * stored(row, k, p->bits) + mn;
        }
    }
}

static void dense(const Problem *p, const float *w, int64_t m0, int64_t n0, int mr, int nr) {
    for (int64_t m = m0; m < m0 + mr; m++)
        for (int64_t n = n0; n < n0 + nr; n++) {
            const float *x = p->x + m * p->ldx, *wr = w + (n - n0) * p->Kp;
            float y = 0.f;
            for (int64_t k = 0; k < p->Kp; k++) y += wr[k] * x[k];
            p->out[m * p->ldo + n] = p->bias ? y + p->bias[n] : y;
        }
}
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* y = x W^T (+ bias). x: [M, Kp] (row stride ldx, zeros past K); out: [M, N] (row stride ldo).
 * strip_rows = 0: the fused path, workspace holds M * G floats (the group sums of x).
 * strip_rows > 0 (a multiple of NR_MAX): the strip path, workspace holds num_threads * strip_rows * Kp
 * floats (each thread's dequantized strip). */
void quantized_linear_f32(const float *x, const uint8_t *data, const float *scales, const float *mins,
                          const float *bias, float *out, float *workspace, int64_t M, int64_t N, int64_t Kp,
                          int64_t G, int64_t group, int64_t bits, int64_t ldx, int64_t ldo, int64_t strip_rows,
                          int64_t num_threads) {
    Problem p = {x, workspace, data, scales, mins, bias, out, M, N, Kp, G, group, bits, ldx, ldo};
    if (strip_rows == 0) {
        if (mins) {
            for (int64_t m = 0; m < M; m++)
                for (int64_t g = 0; g < G; g++) {
                    float s = 0.f;
                    for (int64_t k = g * group; k < group_end(&p, g); k++) s += x[m * ldx + k];
                    workspace[m * G + g] = s;
                }
        }
        /* Weight rows per tile: 8 for one input row (enough independent sums to hide the FMA latency
         * and 8 rows streaming at once), fewer as more input rows share each widened block. */
        const int64_t mr = M < FUSED_MR ? M : FUSED_MR, nr = mr == 1 ? 8 : mr == 2 ? 4 : 3;
        const int64_t tiles = (N + nr - 1) / nr;
        if (num_threads > tiles) num_threads = tiles;
        if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t m0 = 0; m0 < M; m0 += mr)
                fused(&p, m0, t * nr, (int)min64(M - m0, mr), (int)min64(N - t * nr, nr));
        return;
    }
    /* Each strip is dequantized once; then one register tile of input rows at a time crosses all of it,
     * so each output row is written in one burst: walking down the columns instead, the M rows of `out`
     * would be M cache lines written a few floats at a time, and with N * 4 bytes a multiple of 64 KiB
     * (a 49152-row LM head) they all fall into one cache set and evict each other. */
    const int64_t strips = (N + strip_rows - 1) / strip_rows;
    if (num_threads > strips) num_threads = strips;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t s = 0; s < strips; s++) {
        float *w = workspace + (int64_t)omp_get_thread_num() * strip_rows * Kp;
        const int64_t first = s * strip_rows, rows = min64(N - first, strip_rows);
        dequantize_rows(&p, first, rows, w);
        for (int64_t m0 = 0; m0 < M; m0 += MR_MAX)
            for (int64_t r = 0; r < rows; r += NR_MAX)
                dense(&p, w + r * Kp, m0, first + r, (int)min64(M - m0, MR_MAX), (int)min64(rows - r, NR_MAX));
    }
}

/* Weight rows [n0, n1) as floats (scale and min applied) into out [n1 - n0, Kp] (row stride Kp), for the
 * BLAS path; the padding columns hold min (x is zero there). */
void quantized_dequantize_f32(const uint8_t *data, const float *scales, const float *mins, float *out, int64_t N,
                              int64_t Kp, int64_t G, int64_t group, int64_t bits, int64_t n0, int64_t n1,
                              int64_t num_threads) {
    const Problem p = {NULL, NULL, data, scales, mins, NULL, NULL, 0, N, Kp, G, group, bits, 0, 0};
    const int64_t chunk = 16, chunks = (n1 - n0 + chunk - 1) / chunk;
    if (num_threads > chunks) num_threads = chunks;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t first = n0 + c * chunk;
        dequantize_rows(&p, first, min64(n1 - first, chunk), out + (first - n0) * Kp);
    }
}
