/* The element-wise math of a decoder layer, float32: RMSNorm (with the residual add before it),
 * SiLU-and-mul, and gpt-oss's clamped SwiGLU. Shared by the fused decode step (decoder.c), the standalone
 * kernels every other step calls through kernels/__init__.py (layer_ops.c) and the fused mixture of
 * experts (moe.c), so that a token's hidden states are computed by the
 * same code whichever path its step takes. A row's result depends on that row alone, in a fixed order;
 * rows are shared out over OpenMP threads. The build's cache key covers this header
 * (kernels/cpu/__init__.py). */
#ifndef PAGODA_LAYER_MATH_H
#define PAGODA_LAYER_MATH_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* Below this many elements a pass runs on one thread: waking the others costs more. */
#define THREADED_ELEMENTS 16384

/* y = x * w / sqrt(mean(x^2) + eps), HF's formula (the sum accumulated in double). */
static inline void rms_norm_row(const float *x, const float *w, float *y, int64_t n, float eps) {
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += (double)x[i] * x[i];
    const float inv = 1.0f / sqrtf((float)(sum / n) + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * inv);
}

/* sum = x + residual (sum = x where residual is NULL: the first layer), y = rms_norm(sum); row by row.
 * `sum` may be `residual` (updated in place) and `y` may be `x`. */
static void add_rms_norm(const float *x_in, const float *residual, float *sum, const float *w, float *y,
                         int64_t rows, int64_t n, float eps, int64_t threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * n >= THREADED_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float *s = sum + r * n;
        const float *x = x_in + r * n;
        if (residual == NULL) {
            memcpy(s, x, sizeof(float) * n);
        } else {
            const float *res = residual + r * n;
            for (int64_t i = 0; i < n; i++) s[i] = x[i] + res[i];
        }
        rms_norm_row(s, w, y + r * n, n, eps);
    }
}

/* RMSNorm of each of `heads` rows of `n` per token (Qwen3's per-head q/k norms; heads = 1 for a plain
 * norm): token t's rows start at x + t * x_stride and at y + t * y_stride, adjacent. y may be x. */
static void rms_norm_rows(const float *x, const float *w, float *y, int64_t tokens, int64_t heads, int64_t n,
                          int64_t x_stride, int64_t y_stride, float eps, int64_t threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && tokens * heads * n >= THREADED_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) rms_norm_row(x + t * x_stride + h * n, w, y + t * y_stride + h * n, n, eps);
}

#if defined(__AVX2__) && defined(__FMA__)
#include "vector_exp.h"

/* e^x for x in [-87, 88] (clamped), within 2 ulp of expf. */
static inline __m256 exp_clamped(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n;
    const __m256 y = exp_mantissa(x, &n);
    /* (n = 128 at x = 88 would overflow the exponent field: 2^n as two factors) */
    const __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1);
    return _mm256_mul_ps(_mm256_mul_ps(y, exp2_integral(half)), exp2_integral(_mm256_sub_epi32(whole, half)));
}
#endif

/* out[r] = silu(gate[r]) * up[r], with gate and up the halves of gu's row r ([rows, 2 n]). */
static void silu_and_mul(const float *gu, float *out, int64_t rows, int64_t n, int64_t threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * n >= THREADED_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gu + r * 2 * n, *up = gate + n;
        float *y = out + r * n;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= n; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 e = exp_clamped(_mm256_sub_ps(_mm256_setzero_ps(), g));
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < n; i++) y[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* Gemma 4's expert activation (kernels/torch_ref/moe.py `GeGLU`) of one row: with gate and up the halves of
 * gu ([2 n]), out = gelu_tanh(gate) * up, where gelu_tanh(g) = g (1 + tanh(u)) / 2 with u = sqrt(2 / pi) (g +
 * 0.044715 g^3), computed as g / (1 + e^(-2u)) (the same value: (1 + tanh(u)) / 2 is sigmoid(2u)). */
static inline void geglu_row(const float *gu, float *y, int64_t n) {
    const float *gate = gu, *up = gu + n;
    const float k = -2.0f * 0.7978845608028654f; /* -2 sqrt(2 / pi) */
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(0.044715f), vk = _mm256_set1_ps(k);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(c, g), _mm256_mul_ps(g, g), g);
        const __m256 e = exp_clamped(_mm256_mul_ps(vk, inner));
        const __m256 gelu = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) {
        const float g = gate[i];
        y[i] = g / (1.0f + expf(k * (g + 0.044715f * g * g * g))) * up[i];
    }
}

/* gpt-oss's expert activation (kernels/torch_ref/moe.py `ClampedSwiGLU`) of one row: with gate and up the
 * halves of gu ([2 n]), gate clamped above at `limit` and up to [-limit, limit], out = (up + 1) * gate *
 * sigmoid(alpha * gate), the sigmoid's product as silu_and_mul computes it, gate / (1 + e^(-alpha gate)).
 * A NaN stays NaN, as torch's clamp keeps it (the clamps compare with the bound first: min and max return
 * their second operand when either is NaN). */
static inline void clamped_swiglu_row(const float *gu, float *y, int64_t n, float alpha, float limit) {
    const float *gate = gu, *up = gu + n;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 high = _mm256_set1_ps(limit), low = _mm256_set1_ps(-limit), one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_min_ps(high, _mm256_loadu_ps(gate + i));
        const __m256 u = _mm256_max_ps(low, _mm256_min_ps(high, _mm256_loadu_ps(up + i)));
        const __m256 e = exp_clamped(_mm256_mul_ps(_mm256_set1_ps(-alpha), g));
        const __m256 glu = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_add_ps(u, one), glu));
    }
#endif
    for (; i < n; i++) {
        const float g = limit < gate[i] ? limit : gate[i];
        const float u = -limit > up[i] ? -limit : limit < up[i] ? limit : up[i];
        y[i] = (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
    }
}
#endif
