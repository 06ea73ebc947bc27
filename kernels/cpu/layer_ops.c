/* A decoder layer's norms and activation as standalone CPU kernels, float32: what prefill and mixed
 * steps (and every model the fused decode step does not run) call through kernels/__init__.py. The math
 * is layer_math.h's, the fused decode step's own: one pass over each row, where torch's add + norm and
 * silu * up make and read back whole intermediate tensors (benchmarks/kernel_ops.py, 1,024 rows of
 * SmolLM2: 2.1x torch's rms_norm, 2.5x the add + norm, 1.7x silu_and_mul; docs/decode-speed.md).
 * Built and loaded at run time by kernels/cpu/__init__.py. */
#include "layer_math.h"

/* y[t, h] = rms_norm(x[t, h]) for `heads` rows of n per token (see rms_norm_rows). */
void rms_norm_f32(const float *x, const float *w, float *y, int64_t tokens, int64_t heads, int64_t n,
                  int64_t x_stride, int64_t y_stride, float eps, int64_t threads) {
    rms_norm_rows(x, w, y, tokens, heads, n, x_stride, y_stride, eps, threads);
}

/* sum = x + residual, y = rms_norm(sum); all [rows, n] contiguous. */
void add_rms_norm_f32(const float *x, const float *residual, float *sum, const float *w, float *y, int64_t rows,
                      int64_t n, float eps, int64_t threads) {
    add_rms_norm(x, residual, sum, w, y, rows, n, eps, threads);
}

/* out [rows, n] = silu(gate) * up, gu [rows, 2 n] contiguous. */
void silu_and_mul_f32(const float *gu, float *out, int64_t rows, int64_t n, int64_t threads) {
    silu_and_mul(gu, out, rows, n, threads);
}
