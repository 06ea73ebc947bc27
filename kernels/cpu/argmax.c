/* Greedy sampling's pick on the CPU: the index of each row's largest float32, with torch.argmax's rule
 * (the first index of the largest value; a NaN counts as largest, so a row with one answers its first
 * NaN). One pass over the row: each of LANES lanes keeps its own largest value and where it first saw it
 * (a strictly greater value replaces it, so a lane keeps its first occurrence), and the lanes' winners
 * are merged at the end (the largest value, at the smallest index among lanes holding it). Written so
 * that each step is a few vector instructions (GCC's vector extensions: 16 lanes, two registers with AVX2).
 * 64 rows of SmolLM2's 49,152 logits on two threads: see kernels/cpu/__init__.py's argmax_rows.
 * Built and loaded at run time by kernels/cpu/__init__.py. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));

static int64_t argmax_row(const float *x, int64_t n) {
    vf best;
    vi at = {0}, index = {0}, nan = {0};
    for (int l = 0; l < LANES; l++) best[l] = x[0], index[l] = l;
    const int64_t full = n / LANES * LANES;
    for (int64_t i = 0; i < full; i += LANES) {
        vf v;
        memcpy(&v, x + i, sizeof(v)); /* (an unaligned vector load) */
        const vi greater = v > best;  /* (all ones where true) */
        best = (vf)(((vi)v & greater) | ((vi)best & ~greater));
        at = (index & greater) | (at & ~greater);
        nan |= v != v;
        index += LANES;
    }
    float top = best[0];
    int64_t first = at[0];
    int any_nan = nan[0] != 0;
    for (int l = 1; l < LANES; l++) {
        any_nan |= nan[l] != 0;
        if (best[l] > top || (best[l] == top && at[l] < first)) top = best[l], first = at[l];
    }
    for (int64_t i = full; i < n; i++) {
        any_nan |= x[i] != x[i];
        if (x[i] > top) top = x[i], first = i;
    }
    if (any_nan || x[0] != x[0])
        for (int64_t i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    return first;
}

/* out[r] = argmax of row r of x [rows, n] (rows `stride` floats apart); n < 2^31. */
void argmax_rows_f32(const float *x, int64_t *out, int64_t rows, int64_t n, int64_t stride, int64_t threads) {
    if (threads > rows) threads = rows;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, n);
}
