/* The routed experts of a mixture-of-experts layer for the CPU, float32 activations, in one call per layer:
 * gather each expert's tokens, gate/up GEMM, activation, down GEMM, and the weighted sum into the output.
 *
 * Routing and grouping stay in Python (kernels/torch_ref/moe.py `assign`): the call gets the (token, expert)
 * pairs grouped by expert (active experts ascending, tokens ascending within one), each pair's routing weight,
 * and the experts' weights, either float32 in panels (kernels/panels.py `ExpertPanels`: each expert's matrix
 * as the dense panel matmul stores one), quantized (kernels/quantized.py `PackedExperts`: each expert's
 * matrix as a PackedWeight) or MXFP4 (kernels/mxfp4.py `Mxfp4Experts`: gpt-oss's checkpoint blocks and
 * scales as they are). The GEMMs are the dense kernels' own tiles (panel_tiles.h, quantized_tiles.h), so a
 * token's expert output is summed as the dense linear would sum it, and MXFP4's (mxfp4_tiles.h), which look
 * each block's nibbles up in its scaled table in registers: no expert is ever dequantized to memory. MXFP4
 * is read as stored rather than repacked into PackedExperts' layouts: its E2M1 levels are not an affine grid
 * (steps of .5, 1 and 2), which INT4's scale * q + min cannot hold, and INT8 would hold them at twice the
 * bytes, which decode reads for every chosen expert at every token.
 *
 * gpt-oss's experts also take optional per-expert biases, added to each projection's output (gate/up's
 * before the activation, down's before the routing weight, as the reference adds them), and the clamped
 * SwiGLU (layer_math.h) in place of SiLU-and-mul; Gemma 4's take GeGLU.
 *
 * Quantized experts may take int8 activations (where the CPU has VNNI and the caller passes their
 * workspace): each pair's row is quantized per 32 columns, before gate/up and again before down, and the
 * dense linear's integer tiles (quantized_q8_tiles.h) multiply it, as llama.cpp multiplies its experts. A
 * token's row is quantized once per pair, as it is gathered once per pair: the tiles read an expert's rows
 * adjacent, and rounding a row costs about 1/2,000 of the multiply-adds its expert then does with it.
 *
 * Work: the pairs' rows are gathered into one array (an expert's pairs adjacent), then the threads share out
 * items of (block of one expert's rows x 32 output columns), for gate/up and again for down. A block is all
 * of an expert's rows but in a long prefill (then ~1 MiB of them, kept in L2 while the expert's tiles pass
 * over them), so each active expert's weights are read once per block, by one thread, for all its tokens;
 * at one token only the chosen experts' weights are read. Every output is written by one item in a fixed
 * order, and the weighted sum adds each token's experts in ascending expert order (HF's loop, and the
 * reference's), so the result does not depend on the thread count.
 *
 * Built and loaded at run time by kernels/cpu/loader.py; driven by kernels/cpu/moe.py.
 */
#include "layer_math.h"
#include "mxfp4_tiles.h"
#include "panel_tiles.h"
#include "quantized_q8_tiles.h"

#define ITEM_COLS 32 /* output columns per work item: a panel tile (TILE_COLS), a quantized chunk (BATCH_COLS) */
#define SCATTER_COLS 64 /* output columns per thread's share of the weighted sum */
/* Rows of one expert from which a quantized projection takes the batch tiles instead of the fused ones
 * (kernels/cpu/quantized_matmul.py's _BATCH_ROWS, the same crossovers). */
#define QUANTIZED_BATCH_ROWS(bits) ((bits) == 4 ? 3 : 4)

/* One stacked projection of all experts: expert e's [N, K] matrix, in one of three layouts. */
typedef struct {
    const float *panels; /* float32 panels [E, Np / 16, K, 16] (Np: N rounded up to 32), or NULL */
    const uint8_t *data; /* quantized: [E, N, Kp / 2] (4 bits) or [E, N, Kp] (8 bits), or NULL */
    const uint16_t *scales; /* float16 [E, N, G] */
    const void *mins;       /* [E, N, G] float16 or (mins_f32) float32, or NULL */
    const uint8_t *mx_blocks, *mx_scales; /* MXFP4: [E, N, K / 32, 16] and [E, N, K / 32] */
    const float *bias;                    /* [E, N] or NULL */
    int64_t N, K, bits, group, G, Kp, mins_f32;
} Experts;

/* A projection's work in blocks of rows: up to `chunk_rows` consecutive pairs of one expert each. While the
 * threads pass a block's expert's weight tiles over it, its rows of x stay in L2 (panel_linear_f32 chunks x
 * so too): one expert with many rows (a prefill) would otherwise stream all of them from memory per tile. */
typedef struct {
    int64_t *expert, *start, *count; /* [blocks]: the expert (local id), its first pair, its pairs */
    int64_t blocks;
} Blocks;

/* x's row stride for a projection: quantized tiles read whole 32-column blocks (zeros past K; an MXFP4
 * matrix's K is a multiple of 32). */
static int64_t row_stride(const Experts *w) { return w->data != NULL ? w->Kp : w->K; }

/* Expert e's bias row (NULL: none). */
static const float *bias_of(const Experts *w, int64_t e) { return w->bias != NULL ? w->bias + e * w->N : NULL; }

#define X_CHUNK_BYTES (1 << 20) /* rows of x per block: ~1 MiB, as panel_linear_f32 keeps in L2 */

/* The blocks of w's projection of the experts' pairs (`counts` of each of `active` experts, in order); 0
 * where there is no memory for them (free_blocks frees them). */
static int make_blocks(const Experts *w, const int64_t *experts, const int64_t *counts, int64_t active, Blocks *b) {
    int64_t chunk = X_CHUNK_BYTES / (row_stride(w) * (int64_t)sizeof(float)) / ROWS * ROWS;
    if (chunk < ROWS) chunk = ROWS;
    b->blocks = 0;
    for (int64_t a = 0; a < active; a++) b->blocks += (counts[a] + chunk - 1) / chunk;
    b->expert = malloc(sizeof(int64_t) * 3 * (b->blocks > 0 ? b->blocks : 1));
    if (b->expert == NULL) return 0;
    b->start = b->expert + b->blocks, b->count = b->start + b->blocks;
    for (int64_t a = 0, i = 0, start = 0; a < active; start += counts[a], a++)
        for (int64_t row = 0; row < counts[a]; row += chunk, i++) {
            b->expert[i] = experts[a], b->start[i] = start + row;
            b->count[i] = counts[a] - row < chunk ? counts[a] - row : chunk;
        }
    return 1;
}

/* The item's rows times columns [n0, n0 + width) of expert e's float32 panels. */
static void panel_item(const Experts *w, int64_t e, const float *x, int64_t count, float *y, int64_t ldy, int64_t n0,
                       int64_t width) {
    const int64_t K = w->K, Np = (w->N + TILE_COLS - 1) / TILE_COLS * TILE_COLS;
    const float *wp = w->panels + e * Np * K + n0 * K, *bias = bias_of(w, e);
    for (int64_t m = 0; m < count; m += ROWS) {
        const int64_t rows = count - m < ROWS ? count - m : ROWS;
        run_tile(rows, x + m * K, K, wp, bias != NULL ? bias + n0 : NULL, y + m * ldy + n0, ldy, width, NULL);
    }
}

/* The item's rows times weight rows [n0, n0 + width) of expert e's quantized matrix. `xsums`: the rows' sums
 * of x over each group; `buffer`: the thread's batch-tile scratch. */
static void quantized_item(const Experts *w, int64_t e, const float *x, const float *xsums, int64_t count, float *y,
                           int64_t ldy, int64_t n0, int64_t width, float *buffer) {
    const int64_t per_row = w->bits == 4 ? w->Kp / 2 : w->Kp, groups = w->N * w->G;
    const void *mins = w->mins == NULL ? NULL : (const char *)w->mins + e * groups * (w->mins_f32 ? 4 : 2);
    const Problem p = {x,     xsums, w->data + e * w->N * per_row, w->scales + e * groups, mins, bias_of(w, e), y,
                       count, w->N,  w->Kp, w->G, w->group, w->bits, w->Kp, ldy, w->mins_f32};
    if (count >= QUANTIZED_BATCH_ROWS(w->bits)) {
        batch_chunk(&p, n0, width, buffer, buffer + count * BATCH_COLS);
        return;
    }
    /* (fused tiles, shaped as quantized_linear_f32 shapes them) */
    const int64_t mr = count < FUSED_MR ? count : FUSED_MR, nr = mr == 1 ? 8 : mr == 2 ? 4 : 3;
    for (int64_t n = n0; n < n0 + width; n += nr)
        for (int64_t m0 = 0; m0 < count; m0 += mr)
            fused(&p, m0, n, (int)min64(count - m0, mr), (int)min64(n0 + width - n, nr));
}

/* The item's rows (each block in `mxfp4_order`) times weight rows [n0, n0 + width) of expert e's MXFP4 matrix. */
static void mxfp4_item(const Experts *w, int64_t e, const float *x, int64_t count, float *y, int64_t ldy, int64_t n0,
                       int64_t width) {
    const int64_t blocks = w->K / BLOCK;
    const Mxfp4Problem p = {x, w->mx_blocks + e * w->N * blocks * MX_BYTES, w->mx_scales + e * w->N * blocks,
                            bias_of(w, e), y, count, w->N, w->K, w->K, ldy};
    mxfp4_chunk(&p, n0, width);
}

#if QI_BYTES
/* The item's rows (from pair `start` of `all`, the pairs' int8 rows) times weight rows [n0, n0 + width) of
 * expert e's quantized matrix, through int8 activations. */
static void q8_item(const Experts *w, int64_t e, const Q8 *all, int64_t start, int64_t count, float *y, int64_t ldy,
                    int64_t n0, int64_t width) {
    const int64_t per_row = w->bits == 4 ? w->Kp / 2 : w->Kp, groups = w->N * w->G;
    Q8 q = q8_rows_from(all, start);
    q.p.data = w->data + e * w->N * per_row, q.p.scales = w->scales + e * groups;
    q.p.mins = w->mins == NULL ? NULL : (const char *)w->mins + e * groups * (w->mins_f32 ? 4 : 2);
    q.p.bias = bias_of(w, e), q.p.out = y, q.p.ldo = ldy, q.p.M = count, q.p.N = w->N, q.p.mins_f32 = w->mins_f32;
    q8_columns(&q, count, n0, n0 + width);
}
#endif

/* y[pairs, N] (row stride ldy) = each pair's row of x (row stride row_stride(w)) times its expert's matrix,
 * shared out over the threads of the enclosing parallel region by (block, column tile). `q8`: the pairs'
 * int8 rows (quantized experts through int8 activations), or NULL. */
static void project(const Experts *w, const Blocks *b, const float *x, const float *xsums, const void *q8, float *y,
                    int64_t ldy, float *buffers, int64_t per_thread) {
    const int64_t tiles = (w->N + ITEM_COLS - 1) / ITEM_COLS, ldx = row_stride(w);
    float *buffer = buffers + (int64_t)omp_get_thread_num() * per_thread;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < b->blocks * tiles; item++) {
        const int64_t i = item / tiles, n0 = item % tiles * ITEM_COLS, start = b->start[i], count = b->count[i];
        const int64_t width = w->N - n0 < ITEM_COLS ? w->N - n0 : ITEM_COLS;
        if (w->panels != NULL)
            panel_item(w, b->expert[i], x + start * ldx, count, y + start * ldy, ldy, n0, width);
        else if (w->mx_blocks != NULL)
            mxfp4_item(w, b->expert[i], x + start * ldx, count, y + start * ldy, ldy, n0, width);
#if QI_BYTES
        else if (q8 != NULL)
            q8_item(w, b->expert[i], q8, start, count, y + start * ldy, ldy, n0, width);
#endif
        else
            quantized_item(w, b->expert[i], x + start * ldx, xsums + start * w->G, count, y + start * ldy, ldy, n0,
                           width, buffer);
    }
}

/* A row of x (n floats) into dst (it may be the row itself) as w's tiles read it: zeros up to the row stride,
 * and its sums over each group of w (quantized weights with mins); for MXFP4 each block in `mxfp4_order`. */
static void put_row(const Experts *w, const float *row, int64_t n, float *dst, float *xsums) {
    const int64_t stride = row_stride(w);
    if (w->mx_blocks != NULL) {
        mxfp4_order(row, dst, n / BLOCK);
        return;
    }
    if (dst != row) memcpy(dst, row, sizeof(float) * n);
    for (int64_t k = n; k < stride; k++) dst[k] = 0.f;
    if (w->data != NULL && w->mins != NULL)
        for (int64_t g = 0; g < w->G; g++) {
            float s = 0.f; /* (summed as quantized_linear_f32 sums them) */
            for (int64_t k = g * w->group; k < min64((g + 1) * w->group, w->Kp); k++) s += dst[k];
            xsums[g] = s;
        }
}

/* Floats of workspace `moe_f32` / `moe_quantized_f32` / `moe_mxfp4_f32` need for `pairs` pairs, at most `most`
 * of one expert (w13: gate and up rows [2I, H]; w2: [H, I]; G13, G2: their groups, 0 for float32 and MXFP4
 * weights). */
int64_t moe_workspace(int64_t pairs, int64_t most, int64_t H, int64_t I, int64_t Kp13, int64_t Kp2, int64_t G13,
                      int64_t G2, int64_t threads) {
    const int64_t G = G13 > G2 ? G13 : G2;
    return pairs * (Kp13 + 2 * I + Kp2 + H + G13 + G2) + threads * (most * BATCH_COLS + 2 * BATCH_COLS * G);
}

/* The activation of one row of gate/up outputs (one row, this thread: layer_math.h's math): SiLU-and-mul where
 * `activation` is NULL, else by its kind activation[0]: 1, gpt-oss's clamped SwiGLU with {alpha, limit} =
 * activation[1..2]; 2, Gemma 4's GeGLU. */
static void activate(const float *gate_up, float *out, int64_t I, const float *activation) {
    if (activation == NULL)
        silu_and_mul(gate_up, out, 1, I, 1);
    else if (activation[0] == 1.0f)
        clamped_swiglu_row(gate_up, out, I, activation[1], activation[2]);
    else
        geglu_row(gate_up, out, I);
}

/* Pair p's row (as put_row left it) into the pairs' int8 rows `q8` (a Q8; NULL: float activations). */
static void quantize_pair(const void *q8, const float *row, int64_t p) {
#if QI_BYTES
    if (q8 != NULL) q8_quantize_row(q8, row, p);
#else
    (void)q8, (void)row, (void)p;
#endif
}

/* 0 where there is no memory for the blocks (nothing computed). `q8_workspace`: quantized experts' int8
 * activations (moe_q8_workspace floats), or NULL for float activations. */
static int run(const float *hidden, const int64_t *tokens, const float *weights, const int64_t *experts,
               const int64_t *counts, int64_t active, const Experts *w13, const Experts *w2, const float *activation,
               float *out, float *workspace, float *q8_workspace, int64_t H, int64_t I, int64_t threads) {
    int64_t pairs = 0, most = 0;
    for (int64_t a = 0; a < active; a++) pairs += counts[a], most = counts[a] > most ? counts[a] : most;
    Blocks b13, b2;
    if (!make_blocks(w13, experts, counts, active, &b13)) return 0;
    if (!make_blocks(w2, experts, counts, active, &b2)) return free(b13.expert), 0;
    const int64_t ld1 = row_stride(w13), ld2 = row_stride(w2), G13 = w13->data ? w13->G : 0;
    const int64_t G2 = w2->data ? w2->G : 0, G = G13 > G2 ? G13 : G2;
    float *x = workspace, *gate_up = x + pairs * ld1, *act = gate_up + pairs * 2 * I, *y = act + pairs * ld2;
    float *sums13 = y + pairs * H, *sums2 = sums13 + pairs * G13, *buffers = sums2 + pairs * G2;
    const int64_t per_thread = most * BATCH_COLS + 2 * BATCH_COLS * G;
    const void *q8_13 = NULL, *q8_2 = NULL; /* (the pairs' int8 rows for each projection) */
#if QI_BYTES
    Q8 q13, q2;
    if (q8_workspace != NULL) {
        q13 = q8_layout(pairs, ld1, w13->G, w13->group, w13->bits, q8_workspace);
        q2 = q8_layout(pairs, ld2, w2->G, w2->group, w2->bits, q8_workspace + q8_floats(pairs, ld1, w13->G, w13->bits));
        q8_13 = &q13, q8_2 = &q2;
    }
#endif
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            put_row(w13, hidden + tokens[p] * H, H, x + p * ld1, sums13 + p * G13);
            quantize_pair(q8_13, x + p * ld1, p);
        }
        project(w13, &b13, x, sums13, q8_13, gate_up, 2 * I, buffers, per_thread);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            float *row = act + p * ld2;
            activate(gate_up + p * 2 * I, row, I, activation);
            put_row(w2, row, I, row, sums2 + p * G2);
            quantize_pair(q8_2, row, p);
        }
        project(w2, &b2, act, sums2, q8_2, y, H, buffers, per_thread);
        /* The weighted sum, a share of the columns per thread, each token's pairs in ascending expert order. */
#pragma omp for schedule(static)
        for (int64_t c0 = 0; c0 < H; c0 += SCATTER_COLS) {
            const int64_t c1 = c0 + SCATTER_COLS < H ? c0 + SCATTER_COLS : H;
            for (int64_t p = 0; p < pairs; p++) {
                float *o = out + tokens[p] * H;
                const float *src = y + p * H, w = weights[p];
                for (int64_t c = c0; c < c1; c++) o[c] += src[c] * w;
            }
        }
    }
    free(b13.expert), free(b2.expert);
    return 1;
}

/* out [T, H] (zeroed by the caller) += the routed experts' weighted sum for hidden [T, H]. The pairs:
 * tokens [P] and their routing weights [P], grouped by expert: experts [active] (local ids, ascending),
 * counts [active]. w13: panels of every expert's gate then up rows [2I, H] ([E, pad32(2I) / 16, H, 16]);
 * w2: panels of every expert's down projection [H, I] ([E, pad32(H) / 16, I, 16]). gpt-oss's options:
 * bias13 [E, 2I] and bias2 [E, H] (each NULL: none); activation: NULL for SiLU-and-mul, else {kind, ...}
 * (`activate`). workspace: moe_workspace(P, max(counts), H, I, H, I, 0, 0, threads) floats.
 * Returns 0 where there is no memory for its bookkeeping (nothing computed), else 1. */
int moe_f32(const float *hidden, const int64_t *tokens, const float *weights, const int64_t *experts,
            const int64_t *counts, int64_t active, const float *w13, const float *w2, const float *bias13,
            const float *bias2, const float *activation, float *out, float *workspace, int64_t H, int64_t I,
            int64_t threads) {
    const Experts up = {.panels = w13, .bias = bias13, .N = 2 * I, .K = H, .Kp = H};
    const Experts down = {.panels = w2, .bias = bias2, .N = H, .K = I, .Kp = I};
    return run(hidden, tokens, weights, experts, counts, active, &up, &down, activation, out, workspace, NULL, H, I,
               threads);
}

#if QI_BYTES
/* Floats of q8_workspace moe_quantized_f32 needs for int8 activations over `pairs` pairs (the layouts' Kp,
 * G and bits; both stacks' groups quantized_q8_supported). */
int64_t moe_q8_workspace(int64_t pairs, int64_t Kp13, int64_t G13, int64_t bits13, int64_t Kp2, int64_t G2,
                         int64_t bits2) {
    return q8_floats(pairs, Kp13, G13, bits13) + q8_floats(pairs, Kp2, G2, bits2);
}
#endif

/* moe_f32 with quantized experts: each of w13 and w2 as data, float16 scales, mins (NULL, float16, or
 * float32 where layout says so) and layout = {bits, group size, groups G, padded columns Kp, mins_f32}.
 * workspace: moe_workspace(P, max(counts), H, I, Kp13, Kp2, G13, G2, threads) floats. q8_workspace:
 * moe_q8_workspace floats for int8 activations (where the library has moe_q8_workspace), or NULL. */
int moe_quantized_f32(const float *hidden, const int64_t *tokens, const float *weights, const int64_t *experts,
                      const int64_t *counts, int64_t active, const uint8_t *data13, const uint16_t *scales13,
                      const void *mins13, const int64_t *layout13, const uint8_t *data2, const uint16_t *scales2,
                      const void *mins2, const int64_t *layout2, const float *bias13, const float *bias2,
                      const float *activation, float *out, float *workspace, float *q8_workspace, int64_t H, int64_t I,
                      int64_t threads) {
    const Experts up = {.data = data13, .scales = scales13, .mins = mins13, .bias = bias13, .N = 2 * I, .K = H,
                        .bits = layout13[0], .group = layout13[1], .G = layout13[2], .Kp = layout13[3],
                        .mins_f32 = layout13[4]};
    const Experts down = {.data = data2, .scales = scales2, .mins = mins2, .bias = bias2, .N = H, .K = I,
                          .bits = layout2[0], .group = layout2[1], .G = layout2[2], .Kp = layout2[3],
                          .mins_f32 = layout2[4]};
    return run(hidden, tokens, weights, experts, counts, active, &up, &down, activation, out, workspace, q8_workspace, H,
               I, threads);
}

/* moe_f32 with MXFP4 experts (gpt-oss's): w13's blocks [E, 2I, H / 32, 16] and scales [E, 2I, H / 32], w2's
 * [E, H, I / 32, 16] and [E, H, I / 32] (H and I multiples of 32). workspace: moe_workspace(P, max(counts),
 * H, I, H, I, 0, 0, threads) floats. */
int moe_mxfp4_f32(const float *hidden, const int64_t *tokens, const float *weights, const int64_t *experts,
                  const int64_t *counts, int64_t active, const uint8_t *blocks13, const uint8_t *scales13,
                  const uint8_t *blocks2, const uint8_t *scales2, const float *bias13, const float *bias2,
                  const float *activation, float *out, float *workspace, int64_t H, int64_t I, int64_t threads) {
    const Experts up = {.mx_blocks = blocks13, .mx_scales = scales13, .bias = bias13, .N = 2 * I, .K = H, .Kp = H};
    const Experts down = {.mx_blocks = blocks2, .mx_scales = scales2, .bias = bias2, .N = H, .K = I, .Kp = I};
    return run(hidden, tokens, weights, experts, counts, active, &up, &down, activation, out, workspace, NULL, H, I,
               threads);
}
