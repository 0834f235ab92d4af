// The int8 W8A8 linear layer of decoders on the CPU (`--quantization int8`), called by the
// fused step (cpu_kernels.cpp's decoder_linear, through DecoderShape::quant_linear, for a
// projection whose weight type is kInt8WeightType) and by Int8CpuBackend.linear
// (actors/quantization/int8_decoder.py) for the op-by-op forward and the LM head.
//
// y = (x_q · W_qᵀ) * x_scale[row] * w_scale[col] (+ bias): W quantized per output channel at
// load time, x per row (token) at each call, symmetric, int32 accumulation.
//
// VNNI's vpdpbusd multiplies unsigned bytes by signed bytes, so the activations go in as
// u8 = q + 128 and each output channel subtracts 128 * sum_k W[n, k], precomputed at load
// (int8_pack_weight's compensation): exact in int32, one subtraction per output, where the
// sign trick (|a| · sign(a)·w) costs two extra instructions per multiply.
//
// Weights are packed at load as blocks of 16 output channels: [N/16][K/4][16][4] bytes, so
// that one 64-byte load is the 4 k-bytes of 16 channels, vpdpbusd's operand as it is. The
// register tile is up to 6 activation rows x 4 channel blocks (64 columns): 24 int32
// accumulators, 4 weight loads and 6 broadcasts per 4 k. A few rows (decode) run the same
// code with a 1-5 row tile: it streams the weights once, the bound at that size. OpenMP
// over the 64-column panels, as the other kernels split output columns.
//
// Without VNNI (compile-time check, as gguf_linear.cpp does) a portable loop over the same
// layout computes the same integers. A plain C ABI, loaded with ctypes (kernels/_native.py).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int8_rows.h"

#include <omp.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define INT8_GEMM_VNNI 1
#else
#define INT8_GEMM_VNNI 0
#endif

namespace {

constexpr int64_t kLanes = 16;  // output channels per packed block
constexpr int kMaxRows = 6, kBlocks = 4;  // the register tile: rows x channel blocks

// A packed weight, as actors/quantization/int8_decoder.py builds it (Int8GemmWeight there);
// the fused step passes its address as the projection's "weight" pointer.
struct Int8Weight {
    const uint8_t* packed;  // [out_padded / 16][in_padded / 4][16][4] int8 (as bytes)
    const float* scale;  // [out_padded]: 0 in the padding
    const int32_t* compensation;  // [out_padded]: 128 * the row's sum
    int64_t in_padded, out_padded;  // in_features rounded up to 4, out_features to 16
};

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Each row of x quantized as kernels/int8_linear.cpp's quantize_rows_f32 (and the torch
// reference) does, stored +128 as u8, the padding to k_padded as 128 (a 0).
void quantize_rows_u8(const float* x, int64_t x_stride, int64_t rows, int64_t cols, int64_t k_padded, uint8_t* q,
                      float* scale, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const float* in = x + r * x_stride;
        uint8_t* out = q + r * k_padded;
        const float s = int8_rows::scale_of(in, cols);
        scale[r] = s;
        for (int64_t c = 0; c < cols; ++c)
            out[c] = static_cast<uint8_t>(static_cast<int32_t>(int8_rows::quantized(in[c], s)) + 128);
        for (int64_t c = cols; c < k_padded; ++c) out[c] = 128;
    }
}

// Where the tile's results go: float outputs with the epilogue, or the raw int32 sums (tests).
struct Output {
    float* y;
    int64_t y_stride;
    const float* x_scale;
    const float* bias;
    int32_t* raw;  // non-null: the int32 accumulators (compensated), [rows, out_features]
    int64_t out_features;
};

inline void store_row(const Output& out, const Int8Weight& w, int64_t row, int64_t col, const int32_t* sums,
                      int64_t count) {
    if (out.raw != nullptr) {
        std::memcpy(out.raw + row * out.out_features + col, sums, count * sizeof(int32_t));
        return;
    }
    float* dst = out.y + row * out.y_stride + col;
    const float rs = out.x_scale[row];
    // as dequantize_reference: acc * row scale * column scale (+ bias)
    for (int64_t c = 0; c < count; ++c) {
        const float v = static_cast<float>(sums[c]) * rs * w.scale[col + c];
        dst[c] = out.bias != nullptr ? v + out.bias[col + c] : v;
    }
}

#if INT8_GEMM_VNNI
template <int MR, int NB>
void tile(const uint8_t* xq, int64_t k_padded, const Int8Weight& w, int64_t row, int64_t block, const Output& out) {
    __m512i acc[MR][NB];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_si512();
    const int64_t block_bytes = k_padded * kLanes;
    const uint8_t* wp = w.packed + block * block_bytes;
    const uint8_t* xp = xq + row * k_padded;
    for (int64_t k = 0; k < k_padded; k += 4) {
        __m512i wv[NB];
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(wp + b * block_bytes + k * kLanes);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            int32_t four;
            std::memcpy(&four, xp + r * k_padded + k, sizeof four);
            const __m512i xv = _mm512_set1_epi32(four);
#pragma GCC unroll 4
            for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], xv, wv[b]);
        }
    }
    // the epilogue, unrolled as the loop above (a loop with a run-time bound would keep the
    // accumulators in memory all along)
    const int64_t col0 = block * kLanes;
    const bool whole = out.raw == nullptr && col0 + NB * kLanes <= out.out_features;
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
        const int64_t col = col0 + b * kLanes;
        const __m512i comp = _mm512_loadu_si512(w.compensation + col);
        const __m512 ws = _mm512_loadu_ps(w.scale + col);
        const __m512 bias = out.bias != nullptr && whole ? _mm512_loadu_ps(out.bias + col) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m512i sums = _mm512_sub_epi32(acc[r][b], comp);
            if (whole) {  // as dequantize_reference: acc * row scale * column scale (+ bias)
                __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(out.x_scale[row + r])),
                                         ws);
                if (out.bias != nullptr) y = _mm512_add_ps(y, bias);
                _mm512_storeu_ps(out.y + (row + r) * out.y_stride + col, y);
            } else if (col < out.out_features) {  // the int32 sums, or a last block past out_features
                alignas(64) int32_t lanes[kLanes];
                _mm512_store_si512(lanes, sums);
                const int64_t count = out.out_features - col < kLanes ? out.out_features - col : kLanes;
                store_row(out, w, row + r, col, lanes, count);
            }
        }
    }
}

template <int MR>
void tile_rows(const uint8_t* xq, int64_t k_padded, const Int8Weight& w, int64_t row, int64_t block, int nb,
               const Output& out) {
    switch (nb) {
        case 4: tile<MR, 4>(xq, k_padded, w, row, block, out); break;
        case 3: tile<MR, 3>(xq, k_padded, w, row, block, out); break;
        case 2: tile<MR, 2>(xq, k_padded, w, row, block, out); break;
        default: tile<MR, 1>(xq, k_padded, w, row, block, out); break;
    }
}

void run_tile(const uint8_t* xq, int64_t k_padded, const Int8Weight& w, int64_t row, int mr, int64_t block, int nb,
              const Output& out) {
    switch (mr) {
        case 6: tile_rows<6>(xq, k_padded, w, row, block, nb, out); break;
        case 5: tile_rows<5>(xq, k_padded, w, row, block, nb, out); break;
        case 4: tile_rows<4>(xq, k_padded, w, row, block, nb, out); break;
        case 3: tile_rows<3>(xq, k_padded, w, row, block, nb, out); break;
        case 2: tile_rows<2>(xq, k_padded, w, row, block, nb, out); break;
        default: tile_rows<1>(xq, k_padded, w, row, block, nb, out); break;
    }
}
#endif

// The same sums, one at a time, over the same packed layout: the build without VNNI, and the
// tests' check of the layout independent of the vector code.
void run_tile_portable(const uint8_t* xq, int64_t k_padded, const Int8Weight& w, int64_t row, int mr,
                       int64_t block, int nb, const Output& out) {
    const int64_t block_bytes = k_padded * kLanes;
    for (int r = 0; r < mr; ++r) {
        const uint8_t* xp = xq + (row + r) * k_padded;
        for (int b = 0; b < nb; ++b) {
            const int64_t col = (block + b) * kLanes;
            if (col >= out.out_features) break;
            const int8_t* wp = reinterpret_cast<const int8_t*>(w.packed + (block + b) * block_bytes);
            int32_t sums[kLanes];
            for (int64_t lane = 0; lane < kLanes; ++lane) {
                int32_t sum = 0;
                for (int64_t k = 0; k < k_padded; ++k)
                    sum += static_cast<int32_t>(xp[k]) * wp[(k / 4) * kLanes * 4 + lane * 4 + k % 4];
                sums[lane] = sum - w.compensation[col + lane];
            }
            const int64_t count = out.out_features - col < kLanes ? out.out_features - col : kLanes;
            store_row(out, w, row + r, col, sums, count);
        }
    }
}

// Output panels of kBlocks channel blocks split over the threads; in each, every row tile.
void gemm(const uint8_t* xq, int64_t rows, const Int8Weight& w, const Output& out, bool portable, int num_threads) {
    const int64_t blocks = round_up(out.out_features, kLanes) / kLanes;
    const int64_t panels = (blocks + kBlocks - 1) / kBlocks;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; ++p) {
        const int64_t block = p * kBlocks;
        const int nb = static_cast<int>(blocks - block < kBlocks ? blocks - block : kBlocks);
        for (int64_t row = 0; row < rows; row += kMaxRows) {
            const int mr = static_cast<int>(rows - row < kMaxRows ? rows - row : kMaxRows);
#if INT8_GEMM_VNNI
            if (!portable) {
                run_tile(xq, w.in_padded, w, row, mr, block, nb, out);
                continue;
            }
#endif
            run_tile_portable(xq, w.in_padded, w, row, mr, block, nb, out);
        }
    }
}

thread_local std::vector<uint8_t> quantized_rows;  // reused between calls: a step's largest
thread_local std::vector<float> row_scales;

}  // namespace

extern "C" {

int int8_gemm_uses_vnni() { return INT8_GEMM_VNNI; }

// q [out, in] int8 row-major -> packed (Int8Weight's layout, zeros in the padding) and
// compensation [out_padded] (128 * each row's sum).
void int8_pack_weight(const int8_t* q, int64_t out_features, int64_t in_features, uint8_t* packed,
                      int32_t* compensation) {
    const int64_t in_padded = round_up(in_features, 4), out_padded = round_up(out_features, kLanes);
    std::memset(packed, 0, out_padded * in_padded);
    for (int64_t n = 0; n < out_padded; ++n) {
        int32_t sum = 0;
        if (n < out_features) {
            const int8_t* row = q + n * in_features;
            uint8_t* dst = packed + (n / kLanes) * in_padded * kLanes + (n % kLanes) * 4;
            for (int64_t k = 0; k < in_features; ++k) {
                dst[(k / 4) * kLanes * 4 + k % 4] = static_cast<uint8_t>(row[k]);
                sum += row[k];
            }
        }
        compensation[n] = 128 * sum;
    }
}

// The fused step's QuantLinear (cpu_kernels.cpp): weight is an Int8Weight*. y = x @ Wᵀ (+ bias)
// with x quantized per row; type, dequantize_rows and sgemm are the GGUF kernel's and unused.
int int8_linear_f32(int type, const float* x, int64_t x_stride, int64_t rows, const uint8_t* weight,
                    int64_t in_features, int64_t out_features, const float* bias, float* y, int64_t y_stride,
                    int64_t dequantize_rows, void* sgemm, int num_threads) {
    (void)type, (void)dequantize_rows, (void)sgemm;
    const Int8Weight& w = *reinterpret_cast<const Int8Weight*>(weight);
    if (w.in_padded != round_up(in_features, 4) || w.out_padded != round_up(out_features, kLanes)) return -1;
    if (rows == 0) return 0;
    if (static_cast<int64_t>(quantized_rows.size()) < rows * w.in_padded) quantized_rows.resize(rows * w.in_padded);
    if (static_cast<int64_t>(row_scales.size()) < rows) row_scales.resize(rows);
    quantize_rows_u8(x, x_stride, rows, in_features, w.in_padded, quantized_rows.data(), row_scales.data(),
                     num_threads);
    const Output out{y, y_stride, row_scales.data(), bias, nullptr, out_features};
    gemm(quantized_rows.data(), rows, w, out, false, num_threads);
    return 0;
}

// The int32 sums x_q · W_qᵀ of already quantized rows (xq [rows, in] int8): the tests' check
// against torch's integer matmul; portable != 0 runs the fallback loop instead of VNNI.
int int8_gemm_int32(const int8_t* xq, int64_t rows, int64_t in_features, const uint8_t* weight, int64_t out_features,
                    int32_t* out, int portable, int num_threads) {
    const Int8Weight& w = *reinterpret_cast<const Int8Weight*>(weight);
    if (w.in_padded != round_up(in_features, 4) || w.out_padded != round_up(out_features, kLanes)) return -1;
    std::vector<uint8_t> shifted(rows * w.in_padded, 128);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < in_features; ++k)
            shifted[r * w.in_padded + k] = static_cast<uint8_t>(static_cast<int32_t>(xq[r * in_features + k]) + 128);
    const Output sums{nullptr, 0, nullptr, nullptr, out, out_features};
    gemm(shifted.data(), rows, w, sums, portable != 0, num_threads);
    return 0;
}

}  // extern "C"
