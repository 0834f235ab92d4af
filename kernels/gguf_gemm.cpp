// GGUF weights for steps of many rows (prefill chunks, large decode batches) on the CPU: int8
// register tiles over the weight's blocks repacked at load, AVX-512 VNNI (kernels/gguf_gemm.py
// packs them and checks the arguments; actors/quantization/gguf.py keeps them beside the
// file's blocks).
//
// Each GGUF weight block of 32 is w = d * u + c with u unsigned bytes (gguf_linear.cpp's
// header says per type), and each row of x is quantized per block of 32 (gguf_rows.h: q, dx,
// and dx * sum(q)), so a block's share of an output is
//   d * dx * sum(u * q) + c * dx * sum(q)
// The packing gives vpdpbusd its weight operand as it is: u of 16 output channels x 4 inputs
// per 64 bytes, [out_padded / 16][in_features / 4][16][4] (int8_gemm.cpp's layout), with d
// and c as [out_padded / 16][in_features / 32][16] floats. A tile of up to kMaxRows rows of x
// x kMaxBlocks x 16 channels sums a block in int32 (8 vpdpbusd a row and channel block, x's
// 4 bytes broadcast), then adds it in float, once per block:
//   acc = fma(float(sum), d * dx, acc); acc = fma(c, dx * sum(q), acc)
// (kernels/gguf_mirror.py's gguf_gemm_mirror repeats this order). The file's 4-bit weights
// take a byte each here: per block 8 vpdpbusd to 4 float operations, where the decode rows'
// kernel pays 4 for each one, and the tiles are read from cache once per kMaxRows rows.
//
// gguf_gemm_linear_f32 is what the fused step calls for every GGUF projection (through
// DecoderShape::quant_linear): its weight is a GGUFTiles descriptor, and below its tile_rows
// rows (or without tiles) it hands the file's blocks to the decode-row kernel (gguf_linear.cpp's
// gguf_linear_f32, whose address the descriptor holds; kernels/gguf_gemm.py: TILE_ROWS).
#include <stdint.h>
#include <string.h>

#include <vector>

#include "gguf_rows.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GGUF_GEMM_VNNI 1
#else
#define GGUF_GEMM_VNNI 0
#endif

namespace {

using gguf_rows::kBlock;
constexpr int64_t kLanes = 16;  // output channels per packed block
// the register tile: rows x channel blocks, 12 int32 and 12 float accumulators; 4x3, 3x4 and
// 4x2 measured within 5% of it on SmolLM2's linears (one thread, 64 and 512 rows), 8x1 15% slower
constexpr int kMaxRows = 6, kMaxBlocks = 2;

typedef int (*Linear)(int type, const float* x, int64_t x_stride, int64_t rows, const uint8_t* weight,
                      int64_t in_features, int64_t out_features, const float* bias, float* y, int64_t y_stride,
                      int64_t dequantize_rows, void* sgemm, int num_threads);

// kernels/gguf_gemm.py's GGUFTilesStruct
struct GGUFTiles {
    const uint8_t* blocks;  // the file's blocks [out_features, row bytes], for a few rows
    int64_t type;  // their ggml type
    Linear few_rows;  // gguf_linear_f32
    const uint8_t* packed;  // [out_padded / 16][in_features / 4][16][4] u, or null: no tiles
    const float* scale;  // [out_padded / 16][in_features / 32][16] d (0 in the padding)
    const float* offset;  // the same for c
    int64_t out_padded;
    int64_t tile_rows;  // steps of this many rows or more run the tiles
};

// x quantized: q [rows, in_features], dx and dx * sum(q) [rows, in_features / 32]
struct Rows {
    const int8_t* q;
    const float* dx;
    const float* xo;
    int64_t in_features, num_blocks;
};

// Where a tile's results go: y (+ bias), or each block's int32 sums (the tests' check)
struct Output {
    float* y;
    int64_t y_stride;
    const float* bias;
    int32_t* raw;  // non-null: [rows, out_features, num_blocks]
    int64_t out_features;
};

#if GGUF_GEMM_VNNI
template <int MR, int NB>
void tile(const Rows& x, const GGUFTiles& w, int64_t row, int64_t block, const Output& out) {
    const int64_t panel_bytes = x.in_features * kLanes, panel_scales = x.num_blocks * kLanes;
    __m512 acc[MR][NB];
    for (int r = 0; r < MR; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < x.num_blocks; kb++) {
        __m512i sums[MR][NB];
        for (int r = 0; r < MR; r++)
            for (int b = 0; b < NB; b++) sums[r][b] = _mm512_setzero_si512();
        const uint8_t* wp = w.packed + block * panel_bytes + kb * kBlock * kLanes;
        const int8_t* xp = x.q + row * x.in_features + kb * kBlock;
#pragma GCC unroll 8
        for (int k = 0; k < kBlock; k += 4) {
            __m512i wv[NB];
            for (int b = 0; b < NB; b++) wv[b] = _mm512_loadu_si512(wp + b * panel_bytes + k * kLanes);
            for (int r = 0; r < MR; r++) {
                int32_t four;
                memcpy(&four, xp + r * x.in_features + k, 4);
                const __m512i xv = _mm512_set1_epi32(four);
                for (int b = 0; b < NB; b++) sums[r][b] = _mm512_dpbusd_epi32(sums[r][b], wv[b], xv);
            }
        }
        if (out.raw != nullptr) {  // the tests' int32 sums
            for (int r = 0; r < MR; r++)
                for (int b = 0; b < NB; b++) {
                    alignas(64) int32_t lanes[kLanes];
                    _mm512_store_si512(lanes, sums[r][b]);
                    for (int64_t c = 0; c < kLanes && (block + b) * kLanes + c < out.out_features; c++)
                        out.raw[((row + r) * out.out_features + (block + b) * kLanes + c) * x.num_blocks + kb] =
                            lanes[c];
                }
            continue;
        }
        for (int b = 0; b < NB; b++) {
            const __m512 wd = _mm512_loadu_ps(w.scale + (block + b) * panel_scales + kb * kLanes);
            const __m512 wc = _mm512_loadu_ps(w.offset + (block + b) * panel_scales + kb * kLanes);
            for (int r = 0; r < MR; r++) {
                const int64_t at = (row + r) * x.num_blocks + kb;
                const __m512 scale = _mm512_mul_ps(wd, _mm512_set1_ps(x.dx[at]));
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][b]), scale, acc[r][b]);
                acc[r][b] = _mm512_fmadd_ps(wc, _mm512_set1_ps(x.xo[at]), acc[r][b]);
            }
        }
    }
    if (out.raw != nullptr) return;
    for (int b = 0; b < NB; b++) {
        const int64_t col = (block + b) * kLanes;
        if (col >= out.out_features) break;
        const int64_t count = out.out_features - col < kLanes ? out.out_features - col : kLanes;
        const __mmask16 mask = (__mmask16)((1u << count) - 1);
        const __m512 bias = out.bias != nullptr ? _mm512_maskz_loadu_ps(mask, out.bias + col) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++)
            _mm512_mask_storeu_ps(out.y + (row + r) * out.y_stride + col, mask, _mm512_add_ps(acc[r][b], bias));
    }
}

template <int MR>
void tile_rows(const Rows& x, const GGUFTiles& w, int64_t row, int64_t block, int nb, const Output& out) {
    if (nb == 2) {
        tile<MR, 2>(x, w, row, block, out);
    } else {
        tile<MR, 1>(x, w, row, block, out);
    }
}

void run_tile(const Rows& x, const GGUFTiles& w, int64_t row, int mr, int64_t block, int nb, const Output& out) {
    switch (mr) {
        case 6: tile_rows<6>(x, w, row, block, nb, out); break;
        case 5: tile_rows<5>(x, w, row, block, nb, out); break;
        case 4: tile_rows<4>(x, w, row, block, nb, out); break;
        case 3: tile_rows<3>(x, w, row, block, nb, out); break;
        case 2: tile_rows<2>(x, w, row, block, nb, out); break;
        default: tile_rows<1>(x, w, row, block, nb, out); break;
    }
}

// Panels of kMaxBlocks channel blocks split over the threads; in each, every row tile (the
// panel's packed weights stay in cache while x's rows stream past).
void gemm(const Rows& x, int64_t rows, const GGUFTiles& w, const Output& out, int num_threads) {
    const int64_t blocks = w.out_padded / kLanes, panels = (blocks + kMaxBlocks - 1) / kMaxBlocks;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t block = p * kMaxBlocks;
        const int nb = (int)(blocks - block < kMaxBlocks ? blocks - block : kMaxBlocks);
        for (int64_t row = 0; row < rows; row += kMaxRows)
            run_tile(x, w, row, (int)(rows - row < kMaxRows ? rows - row : kMaxRows), block, nb, out);
    }
}
#endif

thread_local std::vector<int8_t> quantized;  // reused between calls: a step's largest
thread_local std::vector<float> scales, offsets;

Rows quantize(const float* x, int64_t x_stride, int64_t rows, int64_t in_features, int num_threads) {
    const int64_t num_blocks = in_features / kBlock;
    if ((int64_t)quantized.size() < rows * in_features) quantized.resize(rows * in_features);
    if ((int64_t)scales.size() < rows * num_blocks) scales.resize(rows * num_blocks), offsets.resize(rows * num_blocks);
    // the caller's buffers (inside the loop, a name of a thread_local would be each thread's own)
    int8_t* q = quantized.data();
    float *dx = scales.data(), *xo = offsets.data();
    // threads only for a prompt chunk's rows: a decode batch's take microseconds, less than a
    // parallel region's barrier (as gguf_linear.cpp's quantize_rows)
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * in_features >= (1 << 16))
    for (int64_t r = 0; r < rows; r++)
        gguf_rows::quantize_row(x + r * x_stride, in_features, in_features, q + r * in_features, dx + r * num_blocks,
                                xo + r * num_blocks);
    return Rows{q, dx, xo, in_features, num_blocks};
}

}  // namespace

extern "C" {

int gguf_gemm_uses_vnni() { return GGUF_GEMM_VNNI; }

// The fused step's QuantLinear for GGUF weights (cpu_kernels.cpp): weight is a GGUFTiles*,
// type unused (the descriptor's). y = x @ W^T (+ bias): from the descriptor's tile_rows rows on
// by the tiles, fewer (or a weight without tiles) by gguf_linear_f32 on the file's blocks, which
// takes dequantize_rows and sgemm. 0, or -1.
int gguf_gemm_linear_f32(int type, const float* x, int64_t x_stride, int64_t rows, const uint8_t* weight,
                         int64_t in_features, int64_t out_features, const float* bias, float* y, int64_t y_stride,
                         int64_t dequantize_rows, void* sgemm, int num_threads) {
    (void)type;
    const GGUFTiles& w = *reinterpret_cast<const GGUFTiles*>(weight);
    if (rows < w.tile_rows || w.packed == nullptr || !GGUF_GEMM_VNNI)
        return w.few_rows((int)w.type, x, x_stride, rows, w.blocks, in_features, out_features, bias, y, y_stride,
                          dequantize_rows, sgemm, num_threads);
    if (in_features % kBlock != 0 || w.out_padded < out_features) return -1;
#if GGUF_GEMM_VNNI
    const Rows qx = quantize(x, x_stride, rows, in_features, num_threads);
    gemm(qx, rows, w, Output{y, y_stride, bias, nullptr, out_features}, num_threads);
#endif
    return 0;
}

// Each block's int32 sum(u * q) of already quantized rows (xq [rows, in_features] int8) into
// out [rows, out_features, in_features / 32]: the tests' check of the packing and the tiles. 0,
// or -1 without VNNI or tiles.
int gguf_gemm_block_sums(const int8_t* xq, int64_t rows, int64_t in_features, const uint8_t* weight,
                         int64_t out_features, int32_t* out, int num_threads) {
    const GGUFTiles& w = *reinterpret_cast<const GGUFTiles*>(weight);
    if (!GGUF_GEMM_VNNI || w.packed == nullptr || in_features % kBlock != 0) return -1;
#if GGUF_GEMM_VNNI
    const Rows qx{xq, nullptr, nullptr, in_features, in_features / kBlock};
    gemm(qx, rows, w, Output{nullptr, 0, nullptr, out, out_features}, num_threads);
#endif
    return 0;
}

}  // extern "C"
