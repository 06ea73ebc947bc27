/* Element-wise CPU kernels: rotary embedding (in place) and the KV-cache write.
 *
 * Built WITHOUT fast-math and with FMA contraction off, so each result is the same IEEE operation
 * sequence as the torch reference (x1*cos - x2*sin rounds the two products, then the difference):
 * bit-identical outputs, which keeps greedy tokens identical to Hugging Face's. A float16 cache gets
 * each value rounded to nearest-even, as torch's conversion does.
 */
#include <stdint.h>
#include <string.h>

/* q: [T, num_q_heads, D] with token stride q_stride (elements); k likewise. cos_sin: [max_pos, rot]
 * with cos in the first rot/2 columns and sin in the rest. Rotates the first `rot` dims in place. */
void rotary_embedding_f32(const int64_t *positions, float *q, float *k, const float *cos_sin,
                          int64_t num_tokens, int64_t num_q_heads, int64_t num_k_heads, int64_t head_dim,
                          int64_t rot, int64_t q_stride, int64_t k_stride, int64_t is_neox) {
    const int64_t half = rot / 2;
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *cos = cos_sin + positions[t] * rot, *sin = cos + half;
        for (int64_t h = 0; h < num_q_heads + num_k_heads; h++) {
            float *x = h < num_q_heads ? q + t * q_stride + h * head_dim
                                       : k + t * k_stride + (h - num_q_heads) * head_dim;
            if (is_neox) {
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = x[i], x2 = x[i + half];
                    x[i] = x1 * cos[i] - x2 * sin[i];
                    x[i + half] = x2 * cos[i] + x1 * sin[i];
                }
            } else {
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = x[2 * i], x2 = x[2 * i + 1];
                    x[2 * i] = x1 * cos[i] - x2 * sin[i];
                    x[2 * i + 1] = x2 * cos[i] + x1 * sin[i];
                }
            }
        }
    }
}

/* key/value: [T, Hkv, D] with token strides; caches: [num_slots, Hkv, D] contiguous. Slots < 0 skipped. */
void reshape_and_cache_f32(const float *key, const float *value, float *key_cache, float *value_cache,
                           const int64_t *slot_mapping, int64_t num_tokens, int64_t row, int64_t key_stride,
                           int64_t value_stride) {
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy(key_cache + slot * row, key + t * key_stride, sizeof(float) * row);
        memcpy(value_cache + slot * row, value + t * value_stride, sizeof(float) * row);
    }
}

#ifdef __FLT16_MAX__ /* (compilers with _Float16; elsewhere the torch reference writes such a cache) */
/* The same into a float16 cache (--kv-cache-dtype float16). */
void reshape_and_cache_f16kv(const float *key, const float *value, _Float16 *key_cache, _Float16 *value_cache,
                             const int64_t *slot_mapping, int64_t num_tokens, int64_t row, int64_t key_stride,
                             int64_t value_stride) {
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        for (int64_t i = 0; i < row; i++) key_cache[slot * row + i] = (_Float16)key[t * key_stride + i];
        for (int64_t i = 0; i < row; i++) value_cache[slot * row + i] = (_Float16)value[t * value_stride + i];
    }
}
#endif
