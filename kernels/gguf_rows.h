// Activations quantized per block of 32 as llama.cpp's Q8_1 does, shared by the decode-row
// dot products (gguf_linear.cpp) and the many-row tiles (gguf_gemm.cpp), so both multiply the
// very same int8 values: q = round(x / dx), dx = max|x| / 127 (0 for an all-zero block),
// rounding half away from zero as llama.cpp's roundf; and dx * sum(q) per block, which the
// weight's offset term multiplies.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace gguf_rows {

constexpr int kBlock = 32;

#ifdef __AVX512F__
// One block in two vectors, each step the scalar loop's own IEEE operation (a max, a product,
// a sum and a floor round alike in any lane), so the results are the same bits; a prefill
// chunk quantizes hundreds of thousands of values, which the scalar max's chain made slow.
inline void quantize_block(const float* v, int8_t* q, float* scale, float* offset) {
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512 scale_by = _mm512_set1_ps(inverse), half = _mm512_set1_ps(0.5f), zero = _mm512_setzero_ps();
    __m512i values[2];
    for (int h = 0; h < 2; h++) {
        const __m512 scaled = _mm512_mul_ps(h ? v1 : v0, scale_by);
        const __m512 magnitude = _mm512_roundscale_ps(_mm512_add_ps(_mm512_abs_ps(scaled), half),
                                                      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const __m512i m = _mm512_cvttps_epi32(magnitude);
        const __mmask16 negative = _mm512_cmp_ps_mask(scaled, zero, _CMP_LT_OQ);
        values[h] = _mm512_mask_sub_epi32(m, negative, _mm512_setzero_si512(), m);
        _mm_storeu_si128((__m128i*)(q + 16 * h), _mm512_cvtepi32_epi8(values[h]));
    }
    *scale = d;
    *offset = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(values[0], values[1]));
}
#endif

// One row of in_features (whole blocks) into q[padded] (zeros past in_features), scale and
// offset [padded / 32].
inline void quantize_row(const float* x, int64_t in_features, int64_t padded, int8_t* q, float* scale,
                         float* offset) {
    const int64_t num_blocks = in_features / kBlock;
    for (int64_t b = 0; b < num_blocks; b++) {
        const float* v = x + b * kBlock;
#ifdef __AVX512F__
        quantize_block(v, q + b * kBlock, scale + b, offset + b);
        continue;
#endif
        float amax = 0.0f;
        for (int i = 0; i < kBlock; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < kBlock; i++) {
            const float scaled = v[i] * inverse;
            const int magnitude = (int)floorf(fabsf(scaled) + 0.5f);
            const int value = scaled < 0.0f ? -magnitude : magnitude;
            q[b * kBlock + i] = (int8_t)value;
            sum += value;
        }
        scale[b] = d;
        offset[b] = d * (float)sum;
    }
    for (int64_t b = num_blocks; b < padded / kBlock; b++) {
        memset(q + b * kBlock, 0, kBlock);
        scale[b] = offset[b] = 0.0f;
    }
}

}  // namespace gguf_rows
