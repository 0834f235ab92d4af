// The CPU's kernels in C++, fp32, called through ctypes (kernels/_native.py builds this
// file; kernels/cpu_kernels.py checks the arguments and calls it):
//
// - paged_decode_f32: a decode reads each of its cached keys and values once, in place
//   through its block table, for all the query heads that share a kv head: the whole step
//   is then about one pass over the batch's KV, where batched torch ops pay a gather copy
//   or thousands of tiny matmuls. The softmax runs online (flash-decoding without splits).
// - paged_prefill_f32: prefill chunks' causal attention over their cached keys and values,
//   tiles of query rows against 64 keys transposed so that scores are plain vector
//   multiply-adds. Both take a layer's attention variant (a sliding window whose earlier
//   blocks they never read, a logit soft cap, sinks; the fused step's from DecoderLayer).
// - store_kv_f32: the new keys and values into their slots.
// - rms_norm_f32, rotary_f32 and silu_mul_f32: one pass over each row where torch makes
//   several, with a parallel region only for batches big enough to pay for one (a decode
//   step's rows take microseconds).
// - linear_few_rows_f32: the linear layers of decode batches of a few rows.
// - model_step_f32: a whole step (decodes, prefill chunks or both) of a Llama-family model
//   with the kernels above and torch's sgemm, in one call from Python (see its section for
//   the Python forward it mirrors).
//
// Vectors are GCC/clang vector extensions of 16 floats: one AVX-512 register, two AVX2
// ones, four SSE ones; the compiler picks (-march=native). They and their shared helpers are
// in cpu_vectors.h; the two attention kernels in cpu_attention.h; the model step in cpu_model_step.h.

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "cpu_vectors.h"
#include "cpu_attention.h"

namespace {

// The linear's register tile: MR rows of x by kWeightRows weight rows of accumulators,
// each a vector of kLinearLanes floats. AVX-512 has 32 registers of 16 floats: 4 x 4
// accumulators fit. AVX2 has 16 registers of 8 floats, where that tile (32 registers'
// worth) spilled to the stack and ran 1.2x-2.9x slower than sgemm at 4 to 16 rows on a
// Zen 3 EPYC (benchmarks/RESULTS.md); there the tile is 4 x 2 accumulators of 8 floats,
// plus 2 weight vectors and 1 of x: 11 registers.
#if defined(__AVX512F__)
constexpr int kWeightRows = 4;  // weight rows a linear tile takes at once
constexpr int kLinearLanes = 16;
typedef vf lvf;
inline float linear_sum(lvf v) { return sum_of(v); }
#else
constexpr int kWeightRows = 2;
constexpr int kLinearLanes = 8;
typedef float lvf __attribute__((vector_size(32)));
inline float linear_sum(lvf v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    return v[0] + v[1];
}
#endif
inline lvf linear_load(const float* p) { lvf v; memcpy(&v, p, sizeof v); return v; }

// Columns [first, first + rows) of y for MR rows of x: MR x kWeightRows accumulators in
// registers, so each load feeds several multiply-adds. next: the weight rows of the
// thread's next tile, fetched into the cache meanwhile (the hardware prefetcher alone
// leaves the multiply-adds waiting on memory), or null.
template <int MR>
inline void linear_tile(const float* x, int64_t x_stride, const float* const* w, int rows, int64_t in_features,
                        const float* bias, int64_t first, float* y, int64_t y_stride, const float* const* next) {
    const int64_t vector_end = in_features - in_features % kLinearLanes;
    lvf acc[MR][kWeightRows] = {};
    for (int64_t k = 0; k < vector_end; k += kLinearLanes) {
        lvf wv[kWeightRows];
        for (int r = 0; r < kWeightRows; r++) wv[r] = linear_load(w[r] + k);
        if (next != nullptr && k % 16 == 0)  // a 64-byte cache line a fetch
            for (int r = 0; r < kWeightRows; r++) __builtin_prefetch(next[r] + k);
        for (int m = 0; m < MR; m++) {
            const lvf xv = linear_load(x + m * x_stride + k);
            for (int r = 0; r < kWeightRows; r++) acc[m][r] += xv * wv[r];
        }
    }
    for (int m = 0; m < MR; m++) {
        const float* xm = x + m * x_stride;
        for (int r = 0; r < rows; r++) {
            float sum = linear_sum(acc[m][r]);
            for (int64_t k = vector_end; k < in_features; k++) sum += xm[k] * w[r][k];
            y[m * y_stride + first + r] = bias != nullptr ? sum + bias[first + r] : sum;
        }
    }
}

}  // namespace

extern "C" {

// y = x @ weight.T (+ bias) for a few rows of x: each weight row is read from memory once and
// used for every row of x while it sits in L1. MKL's sgemm streams the weights about once per
// handful of rows, so for decode batches of a few sequences it takes up to twice the time of
// one read of the weights. Threads split the weight rows.
void linear_few_rows_f32(const float* x, int64_t x_stride, int64_t num_rows,  // [num_rows, in_features]
                         const float* weight, int64_t weight_stride,  // [out_features, in_features]
                         const float* bias,  // [out_features] or null
                         float* y, int64_t y_stride,  // [num_rows, out_features]
                         int64_t in_features, int64_t out_features, int num_threads) {
    const int64_t num_chunks = (out_features + kWeightRows - 1) / kWeightRows;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_chunks > 8)
    for (int64_t chunk = 0; chunk < num_chunks; chunk++) {
        const int64_t first = chunk * kWeightRows;
        const int rows = (int)(out_features - first < kWeightRows ? out_features - first : kWeightRows);
        const float* w[kWeightRows];
        const float* next[kWeightRows];
        for (int r = 0; r < kWeightRows; r++) {
            w[r] = weight + (first + (r < rows ? r : 0)) * weight_stride;
            const int64_t ahead = first + kWeightRows + r;  // past the end: the last row again
            next[r] = weight + (ahead < out_features ? ahead : out_features - 1) * weight_stride;
        }
        int64_t m = 0;
        for (; m + 4 <= num_rows; m += 4)
            linear_tile<4>(x + m * x_stride, x_stride, w, rows, in_features, bias, first, y + m * y_stride, y_stride,
                           m == 0 ? next : nullptr);
        const float* xm = x + m * x_stride;
        float* ym = y + m * y_stride;
        const float* const* fetch = m == 0 ? next : nullptr;
        switch (num_rows - m) {
            case 3: linear_tile<3>(xm, x_stride, w, rows, in_features, bias, first, ym, y_stride, fetch); break;
            case 2: linear_tile<2>(xm, x_stride, w, rows, in_features, bias, first, ym, y_stride, fetch); break;
            case 1: linear_tile<1>(xm, x_stride, w, rows, in_features, bias, first, ym, y_stride, fetch); break;
            default: break;
        }
    }
}

// Copies each token's key and value rows of all kv heads into its slot; a negative slot is
// padding, skipped.
void store_kv_f32(
    const float* key, const float* value, int64_t key_token_stride, int64_t key_head_stride,
    int64_t value_token_stride, int64_t value_head_stride,  // [num_tokens, num_kv_heads, head_size]
    float* key_cache, float* value_cache,  // [num_blocks, num_kv_heads, block_size, head_size]
    int64_t cache_block_stride, int64_t cache_head_stride, int64_t cache_slot_stride,
    const int64_t* slot_mapping, int64_t num_tokens, int num_kv_heads, int head_size, int block_size,
    int num_threads) {
    const size_t row_bytes = (size_t)head_size * sizeof(float);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens > 256)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const int64_t offset = (slot / block_size) * cache_block_stride + (slot % block_size) * cache_slot_stride;
        for (int h = 0; h < num_kv_heads; h++) {
            memcpy(key_cache + offset + h * cache_head_stride, key + t * key_token_stride + h * key_head_stride, row_bytes);
            memcpy(value_cache + offset + h * cache_head_stride, value + t * value_token_stride + h * value_head_stride,
                   row_bytes);
        }
    }
}

// Rows of at least this many elements in all make a parallel region worth its cost.
constexpr int64_t kParallelElements = 1 << 16;

// out = weight * (x / rms(x)), over x + residual when a residual is given (the sum is written
// back into x, the next residual). Sums of squares in double: no worse than torch's fp32 sum.
void rms_norm_f32(float* x, int64_t x_stride, const float* residual, int64_t residual_stride, const float* weight,
                  float* out, int64_t out_stride, int64_t num_tokens, int hidden_size, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens * hidden_size >= kParallelElements)
    for (int64_t t = 0; t < num_tokens; t++) {
        float* row = x + t * x_stride;
        double sum_of_squares = 0.0;
        if (residual != nullptr) {
            const float* add = residual + t * residual_stride;
#pragma omp simd reduction(+ : sum_of_squares)
            for (int i = 0; i < hidden_size; i++) {
                row[i] += add[i];
                sum_of_squares += (double)row[i] * row[i];
            }
        } else {
#pragma omp simd reduction(+ : sum_of_squares)
            for (int i = 0; i < hidden_size; i++) sum_of_squares += (double)row[i] * row[i];
        }
        const float inverse_rms = 1.0f / sqrtf((float)(sum_of_squares / hidden_size) + eps);
        float* dst = out + t * out_stride;
        for (int i = 0; i < hidden_size; i++) dst[i] = weight[i] * (row[i] * inverse_rms);
    }
}

// Rotates the two halves of each head of x (query and key heads alike) by its token's
// position: x1 * cos - x2 * sin, x2 * cos + x1 * sin, in place. Each product rounds before
// the sum, as in torch's ops (no fused multiply-add), so the results are bit for bit its own.
__attribute__((optimize("fp-contract=off")))  // GCC; clang reads the pragma below
void rotary_f32(const int64_t* positions, float* x, int64_t x_token_stride, int64_t x_head_stride,
                int64_t num_tokens, int num_heads, int head_size, const float* cos_sin_cache, int64_t cache_stride,
                int num_threads) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    const int half = head_size / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_tokens * num_heads * head_size >= kParallelElements)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float* cos = cos_sin_cache + positions[t] * cache_stride;
        const float* sin = cos + half;
        for (int h = 0; h < num_heads; h++) {
            float* x1 = x + t * x_token_stride + h * x_head_stride;
            float* x2 = x1 + half;
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * cos[i] - b * sin[i];
                x2[i] = b * cos[i] + a * sin[i];
            }
        }
    }
}

// x[:, :intermediate] = silu(gate) * up, gate and up the two halves of each row, in place:
// gate / (1 + exp(-gate)) * up in torch's order of operations (its exp rounds differently).
void silu_mul_f32(float* x, int64_t x_stride, int64_t num_tokens, int64_t intermediate, int num_threads) {
    const int64_t vector_end = intermediate - intermediate % kLanes;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_tokens * intermediate >= kParallelElements)
    for (int64_t t = 0; t < num_tokens; t++) {
        float* gate = x + t * x_stride;
        const float* up = gate + intermediate;
        for (int64_t i = 0; i < vector_end; i += kLanes) {
            const vf g = load(gate + i);
            store(gate + i, g / (1.0f + exp_clamped(-g)) * load(up + i));
        }
        for (int64_t i = vector_end; i < intermediate; i++) {
            const float g = gate[i];
            gate[i] = g / (1.0f + expf(-g)) * up[i];
        }
    }
}

// x[:, :intermediate] = gelu_tanh(gate) * up (Gemma's MLP), in place, in torch's order of
// operations for F.gelu(approximate="tanh"): 0.5 * g * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 * g^3))).
void gelu_tanh_mul_f32(float* x, int64_t x_stride, int64_t num_tokens, int64_t intermediate, int num_threads) {
    const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_tokens * intermediate >= kParallelElements)
    for (int64_t t = 0; t < num_tokens; t++) {
        float* gate = x + t * x_stride;
        const float* up = gate + intermediate;
        for (int64_t i = 0; i < intermediate; i++) {
            const float g = gate[i];
            const float inner = beta * (g + kappa * (g * g * g));
            gate[i] = 0.5f * g * (1.0f + tanhf(inner)) * up[i];
        }
    }
}

#include "cpu_model_step.h"  // model_step_f32: a whole step of a Llama-family model

}  // extern "C"
