/* Gated DeltaNet (Qwen3.5/3.6, Qwen3-Next) on the CPU, float32: the causal depthwise conv1d over q/k/v's
 * channels and the gated delta rule, over a varlen batch of new tokens whose per-sequence states live in
 * pools, read and updated in place at each sequence's slot; and the layer's gating and gated output norm.
 * Contracts and layouts are the torch reference's (kernels/torch_ref/gated_delta.py).
 *
 * The delta rule runs token by token (the recurrent form) for prefill too: a decode step is the hot path,
 * and with one sequence's 64 KB head state staying in L2 across its tokens, the recurrent form costs two
 * passes over that state per token. Per token and value head, with S [Dk, Dv] row-major (row i = key dim):
 *     S = exp(g) S;  delta = beta (v - S^T k);  S += k delta^T;  o = S^T q
 * computed as one read pass (a = S^T k and b = S^T q of the old state) and one update pass, since
 *     S^T k after the decay = exp(g) a,    o = exp(g) b + (k . q) delta.
 * The inner loops run along Dv, contiguous, which GCC vectorizes at the build's width (-march=native, or
 * whatever the ISA variants allow). Work items are (sequence, value head), spread over the threads.
 * Built and loaded at run time by kernels/cpu/loader.py. */
#include "layer_math.h" /* (rms_norm_row, and exp_clamped where there is AVX2) */

/* y[i] = silu(z[i]) * (scale ? scale[i] : 1); y may be z or scale. */
static void silu_into(const float *z, const float *scale, float *y, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(z + i);
        const __m256 e = exp_clamped(_mm256_sub_ps(_mm256_setzero_ps(), x));
        __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        if (scale) silu = _mm256_mul_ps(silu, _mm256_loadu_ps(scale + i));
        _mm256_storeu_ps(y + i, silu);
    }
#endif
    for (; i < n; i++) y[i] = z[i] / (1.0f + expf(-z[i])) * (scale ? scale[i] : 1.0f);
}

/* x * rsqrt(sum(x^2) + 1e-6) * scale (HF's l2norm, then the query's 1/sqrt(Dk)). */
static void l2_normalized(const float *x, float *out, int64_t n, int normalize, float scale) {
    float factor = scale;
    if (normalize) {
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
        factor = scale / sqrtf(sum + 1e-6f);
    }
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * factor;
}

/* One token of one value head: updates `state` [dk, dv] and writes `out` [dv]. */
static void delta_step(float *restrict state, const float *restrict q, const float *restrict k,
                       const float *restrict v, float g, float beta, float *restrict out, int64_t dk, int64_t dv,
                       float *restrict a, float *restrict b, float *restrict delta) {
    memset(a, 0, dv * sizeof(float));
    memset(b, 0, dv * sizeof(float));
    float kq = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float *row = state + i * dv;
        const float ki = k[i], qi = q[i];
        kq += ki * qi;
        for (int64_t j = 0; j < dv; j++) {
            a[j] += row[j] * ki;
            b[j] += row[j] * qi;
        }
    }
    const float decay = expf(g);
    for (int64_t j = 0; j < dv; j++) {
        delta[j] = beta * (v[j] - decay * a[j]);
        out[j] = decay * b[j] + kq * delta[j];
    }
    for (int64_t i = 0; i < dk; i++) {
        float *row = state + i * dv;
        const float ki = k[i];
        for (int64_t j = 0; j < dv; j++) row[j] = decay * row[j] + ki * delta[j];
    }
}

/* q, k [T, hk, dk] and v [T, hv, dv]: a token's heads adjacent, tokens q_stride/k_stride/v_stride floats
 * apart; g, beta [T, hv] contiguous; states [slots, hv, dk, dv]; out [T, hv, dv] contiguous. Value head h
 * reads key head h / (hv / hk). */
void gated_delta_rule_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                          float *states, const int64_t *cu_seqlens, const int64_t *state_slots, float *out,
                          int64_t batch, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t q_stride,
                          int64_t k_stride, int64_t v_stride, int64_t normalize, int64_t threads) {
    const int64_t group = hv / hk, items = batch * hv;
    const float scale = 1.0f / sqrtf((float)dk);
    if (threads > items) threads = items;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        float qn[dk], kn[dk], a[dv], b[dv], delta[dv]; /* (per thread: small, on its stack) */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t seq = item / hv, h = item % hv, kh = h / group;
            float *state = states + (state_slots[seq] * hv + h) * dk * dv;
            for (int64_t t = cu_seqlens[seq]; t < cu_seqlens[seq + 1]; t++) {
                l2_normalized(q + t * q_stride + kh * dk, qn, dk, (int)normalize, scale);
                l2_normalized(k + t * k_stride + kh * dk, kn, dk, (int)normalize, 1.0f);
                delta_step(state, qn, kn, v + t * v_stride + h * dv, g[t * hv + h], beta[t * hv + h],
                           out + (t * hv + h) * dv, dk, dv, a, b, delta);
            }
        }
    }
}

/* out [T, c] (contiguous) = act(bias + sum_j weight[:, j] * window[t + j]) where a sequence's window is its
 * state [width - 1, c] followed by its tokens of x [T, c] (rows x_stride floats apart); the state then holds
 * the window's last width - 1 rows. weight [c, width]; bias [c] or NULL; silu: 1 for SiLU, 0 for none.
 * Work items are (sequence, block of channels): each reads and then rewrites its own channels' state. */
void causal_conv1d_f32(const float *x, const float *weight, const float *bias, float *states,
                       const int64_t *cu_seqlens, const int64_t *state_slots, float *out, int64_t batch, int64_t c,
                       int64_t width, int64_t x_stride, int64_t silu, int64_t threads) {
    enum { BLOCK = 256 };
    const int64_t blocks = (c + BLOCK - 1) / BLOCK, items = batch * blocks, history = width - 1;
    if (threads > items) threads = items;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t seq = item / blocks, first = item % blocks * BLOCK;
        const int64_t count = first + BLOCK <= c ? BLOCK : c - first;
        const int64_t start = cu_seqlens[seq], length = cu_seqlens[seq + 1] - start;
        float *state = states + state_slots[seq] * history * c + first;
        const float *xs = x + start * x_stride + first;
        for (int64_t t = 0; t < length; t++) {
            float *o = out + (start + t) * c + first;
            for (int64_t ch = 0; ch < count; ch++) o[ch] = bias ? bias[first + ch] : 0.0f;
            for (int64_t j = 0; j < width; j++) {
                const int64_t r = t + j; /* row of the window */
                const float *row = r < history ? state + r * c : xs + (r - history) * x_stride;
                const float *w = weight + first * width + j;
                for (int64_t ch = 0; ch < count; ch++) o[ch] += w[ch * width] * row[ch];
            }
            if (silu) silu_into(o, NULL, o, count);
        }
        /* The new state: the window's rows length .. length + history - 1, in ascending order (a row read from
         * the old state lies after the one written, so it is read before being overwritten). */
        for (int64_t r = 0; r < history && length > 0; r++) {
            const int64_t source = r + length;
            const float *row = source < history ? state + source * c : xs + (source - history) * x_stride;
            memmove(state + r * c, row, count * sizeof(float));
        }
    }
}

/* The layer's gating: g [T, h] = -exp(a_log) * softplus(a + dt_bias) (torch's softplus: linear above 20) and
 * beta [T, h] = sigmoid(b), from a, b [T, h] whose rows are a_stride, b_stride floats apart. */
void gdn_gating_f32(const float *a, const float *b, const float *a_log, const float *dt_bias, float *g, float *beta,
                    int64_t tokens, int64_t heads, int64_t a_stride, int64_t b_stride) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const float x = a[t * a_stride + h] + dt_bias[h];
            const float softplus = x > 20.0f ? x : log1pf(expf(x));
            g[t * heads + h] = -expf(a_log[h]) * softplus;
            beta[t * heads + h] = 1.0f / (1.0f + expf(-b[t * b_stride + h]));
        }
}

/* out [tokens, heads, n] (contiguous) = weight * x / sqrt(mean(x^2) + eps) * silu(gate) over each row of n (the
 * norm as the decoder's own, layer_math.h): the output norm gated by z. x and gate [tokens, heads, n] with a
 * token's heads adjacent and tokens x_stride, gate_stride floats apart (z may be a view of a fused projection). */
void rms_norm_gated_f32(const float *x, const float *gate, const float *weight, float *out, int64_t tokens,
                        int64_t heads, int64_t n, int64_t x_stride, int64_t gate_stride, float eps, int64_t threads) {
    const int64_t rows = tokens * heads;
    if (threads > rows) threads = rows;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r / heads, h = r % heads;
        rms_norm_row(x + t * x_stride + h * n, weight, out + r * n, n, eps);
        silu_into(gate + t * gate_stride + h * n, out + r * n, out + r * n, n);
    }
}
