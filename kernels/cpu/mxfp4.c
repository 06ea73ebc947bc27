/* MXFP4 to float32 on the CPU (gpt-oss's experts, kernels/mxfp4.py): one expert's weights as the mixture of
 * experts' reference multiplies them, read straight from the 4-bit blocks.
 *
 * A group is 16 bytes holding 32 E2M1 values (the even element in each byte's low nibble) and one scale
 * byte s, the group's values times 2^(s - 127). A nibble's value is a 16-entry table lookup: with
 * AVX-512, `vpermps` over the whole table (_mm512_permutexvar_ps, 16 lanes of indices at once); with AVX2,
 * whose `vpermps` indexes 8 entries, the nibble's three magnitude bits look up the 8 non-negative levels
 * and its fourth bit, the sign, is moved into the float's sign bit. Elsewhere a scalar table lookup. The
 * products are exact (a level times a power of two), so every path equals the torch reference bit for bit.
 * Built and loaded at run time by kernels/cpu/__init__.py.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 2^(s - 127), as torch.ldexp scales (s = 0: a subnormal; s = 255: infinity). */
static inline float scale_of(uint8_t s) { return ldexpf(1.0f, (int)s - 127); }

/* One group: 16 bytes of nibbles -> 32 floats. */
static inline void group_scalar(const uint8_t *bytes, float scale, float *out) {
    for (int i = 0; i < 16; i++) {
        out[2 * i] = E2M1[bytes[i] & 0x0F] * scale;
        out[2 * i + 1] = E2M1[bytes[i] >> 4] * scale;
    }
}

#if defined(__AVX512F__)
static inline void group_vector(const uint8_t *bytes, float scale, float *out) {
    const __m512 table = _mm512_loadu_ps(E2M1), s = _mm512_set1_ps(scale);
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    const __m512 low = _mm512_permutexvar_ps(_mm512_and_si512(wide, _mm512_set1_epi32(0x0F)), table);
    const __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), table);
    /* interleave: element 2i is byte i's low nibble, 2i + 1 its high one (indices >= 16 pick from `high`) */
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_permutex2var_ps(low, first, high), s));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_permutex2var_ps(low, second, high), s));
}
#define HAVE_VECTOR_PATH 1
#elif defined(__AVX2__)
/* 8 nibbles (as int32 lanes) -> their values: magnitude from the 8 non-negative levels, then the sign. */
static inline __m256 lookup8(__m256i nibbles, __m256 levels) {
    const __m256 magnitude = _mm256_permutevar8x32_ps(levels, nibbles); /* (uses the low 3 bits) */
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(nibbles, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
}

static inline void group_vector(const uint8_t *bytes, float scale, float *out) {
    const __m256 levels = _mm256_loadu_ps(E2M1), s = _mm256_set1_ps(scale);
    for (int half = 0; half < 2; half++) { /* 8 bytes -> 16 floats */
        const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + 8 * half)));
        const __m256 low = lookup8(_mm256_and_si256(wide, _mm256_set1_epi32(0x0F)), levels);
        const __m256 high = lookup8(_mm256_srli_epi32(wide, 4), levels);
        /* unpack interleaves within 128-bit lanes: [l0 h0 l1 h1 | l4 h4 l5 h5] and [l2 h2 l3 h3 | l6 h6 l7 h7] */
        const __m256 a = _mm256_unpacklo_ps(low, high), b = _mm256_unpackhi_ps(low, high);
        _mm256_storeu_ps(out + 16 * half, _mm256_mul_ps(_mm256_permute2f128_ps(a, b, 0x20), s));
        _mm256_storeu_ps(out + 16 * half + 8, _mm256_mul_ps(_mm256_permute2f128_ps(a, b, 0x31), s));
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
        group_vector(blocks + 16 * g, scale_of(scales[g]), out + 32 * g);
#else
        group_scalar(blocks + 16 * g, scale_of(scales[g]), out + 32 * g);
#endif
    }
}
