// Activations quantized per block of 32 as llama.cpp's Q8_1 does, shared by the decode-row
// dot products (gguf_linear.cpp) and the many-row tiles (gguf_gemm.cpp), so both multiply the
// very same int8 values: q = round(x / dx), dx = max|x| / 127 (0 for an all-zero block),
// rounding half away from zero as llama.cpp's roundf; and dx * sum(q) per block, which the
// weight's offset term multiplies.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

namespace gguf_rows {

constexpr int kBlock = 32;

// One row of in_features (whole blocks) into q[padded] (zeros past in_features), scale and
// offset [padded / 32].
inline void quantize_row(const float* x, int64_t in_features, int64_t padded, int8_t* q, float* scale,
                         float* offset) {
    const int64_t num_blocks = in_features / kBlock;
    for (int64_t b = 0; b < num_blocks; b++) {
        const float* v = x + b * kBlock;
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
