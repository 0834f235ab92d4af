// The float sides of the int8 (W8A8) linear layer on the CPU, each one pass over memory
// where torch takes five or six: quantizing activation rows to int8 with one scale per row,
// and the epilogue that turns the int32 GEMM result back into floats. The GEMM itself is
// torch._int_mm (oneDNN). The quantized rows and scales equal the torch reference's
// (kernels/int8_linear.py) bit for bit: a division by the scale, rounding half to even
// (in the default rounding mode); the epilogue may differ from it in the last bit
// (the compiler may fuse its multiply and add). A plain C ABI, loaded with ctypes
// (kernels/_native.py).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "int8_rows.h"

extern "C" void quantize_rows_f32(const float* x, int64_t rows, int64_t cols, int64_t row_stride, int8_t* q,
                                  float* scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * row_stride;
    int8_t* out = q + r * cols;
    const float s = int8_rows::scale_of(in, cols);
    scale[r] = s;
    for (int64_t c = 0; c < cols; ++c) out[c] = static_cast<int8_t>(int8_rows::quantized(in[c], s));
  }
}

// out[r, c] = acc[r, c] * row_scale[r] * col_scale[c] (+ bias[c]); bias may be null.
extern "C" void dequantize_int32_f32(const int32_t* acc, int64_t rows, int64_t cols, const float* row_scale,
                                     const float* col_scale, const float* bias, float* out, int64_t out_stride) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* in = acc + r * cols;
    float* dst = out + r * out_stride;
    const float rs = row_scale[r];
    if (bias != nullptr) {
      for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<float>(in[c]) * rs * col_scale[c] + bias[c];
    } else {
      for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<float>(in[c]) * rs * col_scale[c];
    }
  }
}
