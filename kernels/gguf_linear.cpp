// GGUF block-quantized weights multiplied as they are, on the CPU (kernels/gguf_linear.py
// checks the arguments; actors/quantization/gguf.py keeps the weights; model_step_f32 in
// cpu_kernels.cpp calls gguf_linear_f32 through a function pointer for each quantized layer).
//
// y = x @ W^T (+ bias) with W in one of ggml's 32-element block formats, read from the file
// as they are (rows independent; a row is in_features / 32 blocks):
//   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles q;        w = d * (q - 8)
//   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles q; w = d * q + m
//   Q8_0 (34 bytes): fp16 d, 32 int8 q;                     w = d * q
// Element i < 16 of a Q4 block is the low nibble of byte i, element 16 + i its high nibble.
// Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K are decoded a row at a time (gguf_decoded.h).
// As llama.cpp does, each row of x is first quantized to int8 per block of 32 (a scale per
// block, and the block's sum of q for the weight's offset term: its Q8_1), so a block's dot
// product is an int8 one. Every weight type is read as unsigned bytes u with a scale d and
// an offset c per block, w = d * u + c (Q4_0: c = -8d; Q4_1: c = m; Q8_0: u = q + 128,
// c = -128d), so one kernel serves them all:
//   w_block . x_block = d * dx * sum(u * qx) + c * dx * sum(qx)
// sum(u * qx) is unsigned x signed bytes: one AVX-512 VNNI vpdpbusd per two blocks
// (_mm512_dpbusd_epi32). Without VNNI, plain loops over dequantized weights and x.
// Each weight row is multiplied with every row of x, 4 rows of x at once: a decode step
// streams each weight row from memory once for all its rows. Threads split the weight rows
// in chunks of kChunkRows, as linear_few_rows_f32 does. Past a few rows, gguf_gemm.cpp's int8
// tiles take the step where the weight has them; here, tiles of weight rows are dequantized to
// floats and multiplied by sgemm instead (dequantized_sgemm: Q6_K, or a CPU without VNNI).

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <vector>

#include "gguf_rows.h"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GGUF_VNNI 1
#endif

namespace {

using gguf_rows::kBlock;
using gguf_rows::quantize_row;
constexpr int kChunkRows = 8;  // weight rows a thread takes at a time
constexpr int kTileRows = 4;  // rows of x whose accumulators sit in registers at once
enum { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // ggml's type ids

int block_bytes(int type) {
    switch (type) {
        case kQ4_0: return 18;
        case kQ4_1: return 20;
        case kQ8_0: return 34;
        default: return 0;
    }
}

inline float half_to_float(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  // subnormal: mantissa * 2^-24
        float value = (float)mantissa * 5.9604644775390625e-8f;
        memcpy(&bits, &value, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

// x's rows quantized per block of 32 (gguf_rows.h)
struct QuantizedRows {
    int64_t num_blocks, padded;  // blocks per row; bytes per row of q (whole pairs of blocks)
    std::vector<int8_t> q;  // [rows, padded]
    std::vector<float> scale;  // [rows, padded / 32]: dx per block
    std::vector<float> offset;  // [rows, padded / 32]: dx * sum(q) per block (the weight's c multiplies it)
#ifdef GGUF_VNNI
    std::vector<float> scale16;  // [rows, padded / 64, 16]: each pair's two dx, 8 lanes each (vpdpbusd's lanes)
    std::vector<float> offset16;  // [rows, padded / 64, 16]: each pair's two offsets / 8, 8 lanes each
    std::vector<float> lane_offset16;  // [rows, padded / 4]: dx * each lane's sum of 4 q (gguf_decoded.h)
#endif
};

void quantize_rows(const float* x, int64_t x_stride, int64_t rows, int64_t in_features, QuantizedRows& out,
                   int num_threads) {
    out.num_blocks = in_features / kBlock;
    out.padded = (out.num_blocks + 1) / 2 * 2 * kBlock;
    const int64_t blocks = out.padded / kBlock;
    out.q.resize(rows * out.padded);
    out.scale.resize(rows * blocks);
    out.offset.resize(rows * blocks);
#ifdef GGUF_VNNI
    out.scale16.resize(rows * blocks * 8);
    out.offset16.resize(rows * blocks * 8);
    out.lane_offset16.resize(rows * blocks * 8);
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * in_features >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        quantize_row(x + r * x_stride, in_features, out.padded, out.q.data() + r * out.padded,
                     out.scale.data() + r * blocks, out.offset.data() + r * blocks);
#ifdef GGUF_VNNI
        const float* s = out.scale.data() + r * blocks;
        const float* o = out.offset.data() + r * blocks;
        float* s16 = out.scale16.data() + r * blocks * 8;
        float* o16 = out.offset16.data() + r * blocks * 8;
        float* lanes = out.lane_offset16.data() + r * blocks * 8;
        const int8_t* q = out.q.data() + r * out.padded;
        for (int64_t b = 0; b < blocks; b++)
            for (int i = 0; i < 8; i++) {
                s16[b * 8 + i] = s[b];
                o16[b * 8 + i] = o[b] * 0.125f;  // exact: summed over the block's 8 lanes
                const int64_t k = (b * 8 + i) * 4;
                lanes[b * 8 + i] = s[b] * (float)(q[k] + q[k + 1] + q[k + 2] + q[k + 3]);
            }
#endif
    }
}

#include "gguf_decoded.h"

#ifdef GGUF_VNNI
// The same sums straight from the file's blocks, two blocks per vpdpbusd: a Q4 pair's 2 x 16
// bytes of nibbles become [low 0, high 0, low 1, high 1] (elements 0-15, 16-31 of each block),
// a Q8_0 pair's 2 x 32 bytes become unsigned by flipping their sign bits (q + 128). The
// pair's d (and Q4_1's m) are converted together and spread to the 8 lanes of their block.
// Even and odd pairs add into separate accumulators: one chain of adds would wait on the
// previous add's latency at every pair of a single decode row.
template <int Type, int R>
inline void dot_rows_blocks(const uint8_t* row, int64_t num_blocks, const QuantizedRows& x, int64_t first_row,
                            float* out) {
    constexpr int kBytes = Type == kQ4_0 ? 18 : Type == kQ4_1 ? 20 : 34;
    const int64_t blocks = x.padded / kBlock, pairs = blocks / 2;
    const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
    const __m512i d_lanes = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i m_lanes = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[2][R];
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    auto pair = [&](int64_t p, __m512* sums_out) __attribute__((always_inline)) {
        const uint8_t* b0 = row + 2 * p * kBytes;
        const bool second = 2 * p + 1 < num_blocks;  // an odd last block pairs with x's zero block
        const uint8_t* b1 = second ? b0 + kBytes : b0;
        int32_t h0, h1;  // d (and Q4_1's m) of each block, as halves
        memcpy(&h0, b0, 4);
        memcpy(&h1, b1, 4);
        const __m512 halves = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_set_epi32(0, 0, h1, h0)));
        __m512 wd = _mm512_permutexvar_ps(d_lanes, halves);
        __m512 wc = Type == kQ4_1 ? _mm512_permutexvar_ps(m_lanes, halves)
                                  : _mm512_mul_ps(wd, _mm512_set1_ps(Type == kQ4_0 ? -8.0f : -128.0f));
        if (!second) {
            wd = _mm512_maskz_mov_ps(0x00ff, wd);
            wc = _mm512_maskz_mov_ps(0x00ff, wc);
        }
        __m512i w;
        if (Type == kQ8_0) {
            w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b0 + 2))),
                                   _mm256_loadu_si256((const __m256i*)(b1 + 2)), 1);
            w = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
        } else {
            constexpr int kNibbles = Type == kQ4_1 ? 4 : 2;
            const __m256i q = _mm256_set_m128i(_mm_loadu_si128((const __m128i*)(b1 + kNibbles)),
                                               _mm_loadu_si128((const __m128i*)(b0 + kNibbles)));
            const __m256i lo = _mm256_and_si256(q, low_nibbles);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low_nibbles);
            w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // low 0, low 1, high 0, high 1
            w = _mm512_shuffle_i64x2(w, w, _MM_SHUFFLE(3, 1, 2, 0));
        }
        for (int r = 0; r < R; r++) {
            const int64_t lane = ((first_row + r) * blocks + 2 * p) * 8;
            const __m512i sums = _mm512_dpbusd_epi32(
                _mm512_setzero_si512(), w, _mm512_loadu_si512(x.q.data() + (first_row + r) * x.padded + p * 64));
            const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_loadu_ps(x.scale16.data() + lane));
            sums_out[r] = _mm512_fmadd_ps(wc, _mm512_loadu_ps(x.offset16.data() + lane),
                                          _mm512_fmadd_ps(scaled, wd, sums_out[r]));
        }
    };
    int64_t p = 0;
    for (; p + 1 < pairs; p += 2) {
        pair(p, acc[0]);
        pair(p + 1, acc[1]);
    }
    if (p < pairs) pair(p, acc[0]);
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]));
}

typedef void (*DotRows)(const uint8_t*, int64_t, const QuantizedRows&, int64_t, float*);

template <int R>
DotRows dot_rows_for(int type) {
    switch (type) {
        case kQ4_0: return dot_rows_blocks<kQ4_0, R>;
        case kQ4_1: return dot_rows_blocks<kQ4_1, R>;
        default: return dot_rows_blocks<kQ8_0, R>;
    }
}
#endif

// One weight row dequantized to floats, d * u + c (for the prefill path's sgemm).
void dequantize_row(int type, const uint8_t* src, int64_t num_blocks, float* out) {
    if (is_decoded_type(type)) return dequantize_decoded_row(type, src, num_blocks * kBlock, out);
    const int bytes = block_bytes(type);
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t* block = src + b * bytes;
        float* dst = out + b * kBlock;
        const float d = half_to_float(block);
#ifdef __AVX512F__
        if (type != kQ8_0) {  // 16 nibbles' low halves, then their high halves, 16 floats at a time
            const __m128i q = _mm_loadu_si128((const __m128i*)(block + (type == kQ4_1 ? 4 : 2)));
            const __m512 scale = _mm512_set1_ps(d);
            const __m512 offset = _mm512_set1_ps(type == kQ4_1 ? half_to_float(block + 2) : -8.0f * d);
            const __m128i mask = _mm_set1_epi8(0x0f);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
            _mm512_storeu_ps(dst, _mm512_fmadd_ps(lo, scale, offset));
            _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(hi, scale, offset));
            continue;
        }
#endif
        if (type == kQ8_0) {
            const int8_t* q = (const int8_t*)(block + 2);
            for (int i = 0; i < kBlock; i++) dst[i] = d * (float)q[i];
        } else {
            const uint8_t* q = block + (type == kQ4_1 ? 4 : 2);
            const float c = type == kQ4_1 ? half_to_float(block + 2) : -8.0f * d;
            for (int i = 0; i < 16; i++) {
                dst[i] = d * (float)(q[i] & 0x0f) + c;
                dst[16 + i] = d * (float)(q[i] >> 4) + c;
            }
        }
    }
}

typedef void (*Sgemm)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                      const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                      const float* beta, float* c, const int* ldc);

constexpr int64_t kDequantizedTileBytes = 512 << 10;  // a tile of fp32 weight rows for sgemm: about L2's

}  // namespace

extern "C" {

// 1 where this build multiplies with AVX-512 VNNI, 0 where it runs the portable loops.
int gguf_linear_uses_vnni() {
#ifdef GGUF_VNNI
    return 1;
#else
    return 0;
#endif
}

// The bytes of one row of `in_features` weights of a ggml type, or 0 for a type without a kernel.
int64_t gguf_row_bytes(int type, int64_t in_features) {
    if (is_decoded_type(type)) return decoded_row_bytes(type, in_features);
    return in_features % kBlock ? 0 : in_features / kBlock * block_bytes(type);
}

// Rows of a decoded type (gguf_decoded.h) as U8x16 blocks, out[rows, in_features / 16 * 24]: 0, else -1.
int gguf_decode_rows(int type, const uint8_t* src, int64_t rows, int64_t in_features, uint8_t* out) {
    const int64_t row_bytes = gguf_row_bytes(type, in_features);
    if (!is_decoded_type(type) || row_bytes == 0) return -1;
    std::vector<uint8_t> u(in_features);
    std::vector<float> d4(in_features / 4), c4(in_features / 4);
    for (int64_t r = 0; r < rows; r++) {
        decode_row(type, src + r * row_bytes, in_features, in_features, u.data(), d4.data(), c4.data());
        for (int64_t g = 0; g < in_features / 16; g++) {  // u, then the D and C of its 4 lanes (all alike)
            uint8_t* block = out + (r * (in_features / 16) + g) * 24;
            memcpy(block, u.data() + 16 * g, 16), memcpy(block + 16, &d4[4 * g], 4), memcpy(block + 20, &c4[4 * g], 4);
        }
    }
    return 0;
}

// y[rows, out_features] = x @ dequantized(W)^T (+ bias) for many rows: tiles of weight rows
// dequantized to floats (threads split the rows), each multiplied by sgemm into its columns
// of y. With hundreds of rows sgemm's fp32 FMAs beat vpdpbusd, which pays a convert, a scale
// and an add per 64 products (kernels/gguf_linear.py: DEQUANTIZE_ROWS).
static void dequantized_sgemm(int type, const float* x, int64_t x_stride, int64_t rows, const uint8_t* weight,
                              int64_t row_bytes, int64_t in_features, int64_t out_features, const float* bias,
                              float* y, int64_t y_stride, int num_threads, Sgemm sgemm) {
    static thread_local std::vector<float> tile;
    int64_t tile_rows = kDequantizedTileBytes / (in_features * (int64_t)sizeof(float));
    tile_rows = tile_rows < 16 ? 16 : tile_rows;
    tile.resize(tile_rows * in_features);
    for (int64_t first = 0; first < out_features; first += tile_rows) {
        const int64_t count = out_features - first < tile_rows ? out_features - first : tile_rows;
        float* w = tile.data();
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t j = 0; j < count; j++)
            dequantize_row(type, weight + (first + j) * row_bytes, in_features / kBlock, w + j * in_features);
        if (bias != nullptr)
            for (int64_t r = 0; r < rows; r++) memcpy(y + r * y_stride + first, bias + first, count * sizeof(float));
        const int m = (int)count, n = (int)rows, k = (int)in_features;
        const int lda = (int)in_features, ldb = (int)x_stride, ldc = (int)y_stride;
        const float alpha = 1.0f, beta = bias != nullptr ? 1.0f : 0.0f;
        sgemm("T", "N", &m, &n, &k, &alpha, w, &lda, x, &ldb, &beta, y + first, &ldc);
    }
}

// y[rows, out_features] (row stride y_stride) = x @ W^T (+ bias): up to dequantize_rows rows
// by int8 block dot products, more by dequantized tiles and sgemm (where sgemm is given).
// Returns 0, or -1 for a type without a kernel or in_features not a multiple of 32 (the
// caller checks at load time).
int gguf_linear_f32(int type, const float* x, int64_t x_stride, int64_t rows, const uint8_t* weight,
                    int64_t in_features, int64_t out_features, const float* bias, float* y, int64_t y_stride,
                    int64_t dequantize_rows, Sgemm sgemm, int num_threads) {
    const int64_t row_bytes = gguf_row_bytes(type, in_features);
    if (row_bytes == 0) return -1;
    if (rows > dequantize_rows && sgemm != nullptr) {
        dequantized_sgemm(type, x, x_stride, rows, weight, row_bytes, in_features, out_features, bias, y, y_stride,
                          num_threads, sgemm);
        return 0;
    }
    static thread_local QuantizedRows quantized;  // the caller's thread: reused from step to step
    quantize_rows(x, x_stride, rows, in_features, quantized, num_threads);
    const QuantizedRows& qx = quantized;
    const int64_t num_blocks = qx.num_blocks, num_chunks = (out_features + kChunkRows - 1) / kChunkRows;
#ifdef GGUF_VNNI
    if (is_decoded_type(type)) {
        decoded_linear_vnni(type, qx, rows, weight, row_bytes, in_features, out_features, bias, y, y_stride,
                            num_threads);
        return 0;
    }
    const DotRows dot_tile = dot_rows_for<kTileRows>(type), dot_one = dot_rows_for<1>(type);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_chunks > 8)
    for (int64_t chunk = 0; chunk < num_chunks; chunk++) {
        const int64_t first = chunk * kChunkRows;
        const int count = (int)(out_features - first < kChunkRows ? out_features - first : kChunkRows);
        float out[kTileRows];
        for (int64_t r = 0; r < rows; r += kTileRows) {
            const int tile = rows - r < kTileRows ? (int)(rows - r) : kTileRows;
            for (int j = 0; j < count; j++) {
                const uint8_t* w = weight + (first + j) * row_bytes;
                if (tile == kTileRows) {
                    dot_tile(w, num_blocks, qx, r, out);
                } else {
                    for (int i = 0; i < tile; i++) dot_one(w, num_blocks, qx, r + i, out + i);
                }
                for (int i = 0; i < tile; i++)
                    y[(r + i) * y_stride + first + j] = out[i] + (bias != nullptr ? bias[first + j] : 0.0f);
            }
        }
    }
#else
    // the portable loops: each weight row dequantized, against x's rows dequantized from their blocks
    static thread_local std::vector<float> xf;
    xf.resize(rows * in_features);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < in_features; i++)
            xf[r * in_features + i] = (float)qx.q[r * qx.padded + i] * qx.scale[r * (qx.padded / kBlock) + i / kBlock];
    const float* xs = xf.data();
#pragma omp parallel num_threads(num_threads) if (num_chunks > 8)
    {
        std::vector<float> w(in_features);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < out_features; j++) {
            dequantize_row(type, weight + j * row_bytes, num_blocks, w.data());
            for (int64_t r = 0; r < rows; r++) {
                float sum = 0.0f;
                for (int64_t i = 0; i < in_features; i++) sum += w[i] * xs[r * in_features + i];
                y[r * y_stride + j] = sum + (bias != nullptr ? bias[j] : 0.0f);
            }
        }
    }
#endif
    return 0;
}

}  // extern "C"
