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

/* ---- int8 activations (W8A8 / W4A8): integer dot products, where the CPU has VNNI (the tiles, their
 * layout and their error: quantized_q8_tiles.h) ------------------------------------------------------- */
#include "quantized_q8_tiles.h"
#if QI_BYTES
/* Whether groups of `group` columns (G of them) fit the tiles: each unit inside one group, units spanning
 * whole groups, or one group per row (quantized_q8_tiles.h). */
int64_t quantized_q8_supported(int64_t G, int64_t group, int64_t bits) {
    const int64_t per_group = group / BLOCK, per_unit = blocks_per_unit(bits);
    return group % BLOCK == 0 && (G == 1 || per_group % per_unit == 0 || per_unit % per_group == 0);
}

/* Floats of workspace quantized_linear_q8_f32 needs (q8_layout's arrays for M rows). */
int64_t quantized_q8_workspace(int64_t M, int64_t Kp, int64_t G, int64_t bits) { return q8_floats(M, Kp, G, bits); }

/* y = x W^T (+ bias) through int8 activations (see above); the groups must be quantized_q8_supported.
 * workspace: quantized_q8_workspace() floats. */
void quantized_linear_q8_f32(const float *x, const uint8_t *data, const uint16_t *scales, const void *mins,
                             const float *bias, float *out, float *workspace, int64_t M, int64_t N, int64_t Kp,
                             int64_t G, int64_t group, int64_t bits, int64_t ldx, int64_t ldo, int64_t num_threads,
                             int64_t mins_f32) {
    Q8 q = q8_layout(M, Kp, G, group, bits, workspace);
    for (int64_t m = 0; m < M; m++) q8_quantize_row(&q, x + m * ldx, m);
    q.p = (Problem){x, NULL, data, scales, mins, bias, out, M, N, Kp, G, group, bits, ldx, ldo, mins_f32};
    /* Strips of 48 weight rows, walked one input-row tile at a time: each output row is written in bursts,
     * and the strip's weight rows stay in L1/L2 for all the input rows. */
    const int64_t strip = 48, strips = (N + strip - 1) / strip;
    if (num_threads > strips) num_threads = strips;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t s = 0; s < strips; s++) q8_columns(&q, M, s * strip, min64(s * strip + strip, N));
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
