// Quantizing one activation row to int8 with one scale, shared by the encoders' int8 linear
// (int8_linear.cpp) and the decoders' int8 GEMM (int8_gemm.cpp), so both round alike: a
// division by scale = max|x| / 127 (1 for an all-zero row), rounded half to even as
// torch.round, clamped to [-127, 127].
#pragma once
#include <cstdint>
#include <cstring>

namespace int8_rows {

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23

// max|x| over a row: |x| as the bits of a float without its sign; for non-negative floats the
// integer order is the float order, and an integer max reduction vectorizes (a float one does
// not without -ffast-math)
inline float scale_of(const float* in, int64_t cols) {
    uint32_t max_bits = 0;
    for (int64_t c = 0; c < cols; ++c) {
        uint32_t bits;
        std::memcpy(&bits, in + c, sizeof bits);
        bits &= 0x7FFFFFFFu;
        max_bits = bits > max_bits ? bits : max_bits;
    }
    float absmax;
    std::memcpy(&absmax, &max_bits, sizeof absmax);
    return absmax > 0.0f ? absmax / 127.0f : 1.0f;
}

// x / s rounded half to even and clamped: adding and subtracting 1.5 * 2^23 leaves the nearest
// integer in the default rounding mode, and unlike nearbyint it vectorizes
inline float quantized(float x, float s) {
    float v = (x / s + kRoundMagic) - kRoundMagic;
    return v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
}

}  // namespace int8_rows
