/* The vector e^x core shared by the C kernels (AVX2 + FMA): Cody-Waite range reduction and the Cephes
 * degree-5 polynomial, within 2 ulp of expf. Included by the kernels that need it; the build's cache key
 * covers this header too (kernels/cpu/__init__.py). */
#ifndef PAGODA_VECTOR_EXP_H
#define PAGODA_VECTOR_EXP_H
#include <immintrin.h>

/* e^x = result * 2^n, with *n = round(x / ln 2) and result the polynomial at the reduced argument (x in
 * float range: callers clamp it). */
static inline __m256 exp_mantissa(__m256 x, __m256 *n) {
    *n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(*n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(*n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    return _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
}

/* 2^n for integral n in [-126, 127], as a float. */
static inline __m256 exp2_integral(__m256i n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
#endif
