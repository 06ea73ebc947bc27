/* MXFP4 to float32 on the CPU (gpt-oss's experts, kernels/mxfp4.py): one expert's weights as the mixture of
 * experts' reference multiplies them, read straight from the 4-bit blocks.
 *
 * A group is 16 bytes holding 32 E2M1 values (the even element in each byte's low nibble) and one scale
 * byte s, the group's values times 2^(s - 127). The lookup is mxfp4_tiles.h's, the one the fused MoE's
 * tiles (moe.c) use: a 16-entry table scaled by the group's power of two (vpermps with AVX-512; the 8
 * non-negative levels and the sign bit with AVX2; elsewhere a scalar table lookup), whose even and odd
 * columns are then interleaved back into column order. The products are exact (a level times a power of
 * two), so every path equals the torch reference bit for bit. Built and loaded at run time by
 * kernels/cpu/__init__.py.
 */
#include <omp.h>
#include <stdint.h>

#include "mxfp4_tiles.h"

/* One group: 16 bytes of nibbles -> 32 floats. */
static inline void group_scalar(const uint8_t *bytes, float scale, float *out) {
    for (int i = 0; i < 16; i++) {
        out[2 * i] = E2M1[bytes[i] & 0x0F] * scale;
        out[2 * i + 1] = E2M1[bytes[i] >> 4] * scale;
    }
}

#if QL_VL == 16
static inline void group_vector(const uint8_t *bytes, float scale, float *out) {
    vf w[2]; /* the even columns, the odd ones */
    mx_expand(bytes, mx_table(scale), w);
    /* interleave: element 2i is w[0]'s lane i, 2i + 1 w[1]'s (indices >= 16 pick from the second) */
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    _mm512_storeu_ps(out, _mm512_permutex2var_ps(w[0], first, w[1]));
    _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(w[0], second, w[1]));
}
#define HAVE_VECTOR_PATH 1
#elif QL_VL == 8
static inline void group_vector(const uint8_t *bytes, float scale, float *out) {
    vf w[4]; /* even columns 0..14, 16..30; odd columns 1..15, 17..31 */
    mx_expand(bytes, mx_table(scale), w);
    for (int half = 0; half < 2; half++) { /* 16 columns from 8 even and 8 odd */
        /* unpack interleaves within 128-bit lanes: [e0 o0 e1 o1 | e4 o4 e5 o5] and [e2 o2 e3 o3 | e6 o6 e7 o7] */
        const __m256 a = _mm256_unpacklo_ps(w[half], w[2 + half]), b = _mm256_unpackhi_ps(w[half], w[2 + half]);
        _mm256_storeu_ps(out + 16 * half, _mm256_permute2f128_ps(a, b, 0x20));
        _mm256_storeu_ps(out + 16 * half + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
}
#define HAVE_VECTOR_PATH 1
#endif

/* `groups` groups: blocks [groups, 16] bytes, scales [groups] -> out [groups, 32] floats. */
void mxfp4_dequantize_f32(const uint8_t *blocks, const uint8_t *scales, float *out, int64_t groups,
                          int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
#ifdef HAVE_VECTOR_PATH
        group_vector(blocks + 16 * g, e8m0_scale(scales[g]), out + 32 * g);
#else
        group_scalar(blocks + 16 * g, e8m0_scale(scales[g]), out + 32 * g);
#endif
    }
}
