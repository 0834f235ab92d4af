// GPT-OSS's experts on the CPU with MXFP4 weights as the checkpoint stores them:
// out[t] = sum_k w[t, k] * (act(x[t] @ W13[e]ᵀ + b13[e]) @ W2[e]ᵀ + b2[e]), e = topk_ids[t, k],
// act the clamped SwiGLU over W13's interleaved gate/up rows. kernels/mxfp4_ref.py is the
// oracle and says the layouts: blocks [rows, in / 32, 16] (two E2M1 values a byte, low nibble
// first) and E8M0 scales [rows, in / 32].
//
// The weights are never dequantized to memory: each block of 32 is decoded into registers (a
// 16-entry table, two permutes on AVX-512, and a power-of-two scale) and multiplied against a
// tile of up to kTileRows of the expert's tokens, so a decode step reads half a byte a weight,
// and a prefill chunk's expert decodes each block once per tile of tokens rather than once per
// token. The low nibbles are a block's even values and the high nibbles its odd ones, so the
// activations are reordered once (evens, then odds, per block) rather than the decoded weights
// interleaved each time.
//
// The grouping, threads and combine are moe_cpu.cpp's: slots sorted by expert (counting sort,
// slot order within an expert); experts split over the threads when there are at least as
// many active as threads (each expert single-threaded), else each projection's output rows
// split over all threads; each slot's output in its own buffer row, then every token sums its
// k rows in top-k order, so the result does not depend on the threads.
// A plain C ABI, loaded with ctypes (kernels/_native.py via kernels/moe_mxfp4.py).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;  // values per E8M0 scale
alignas(64) constexpr float kFp4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
typedef float vf __attribute__((vector_size(64)));  // 16 floats: half a block
inline vf load(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
#ifdef __AVX512F__
constexpr int kTileRows = 8;  // token rows a decoded block is multiplied against: 16 accumulators
#else
constexpr int kTileRows = 4;  // (a vf is two of AVX2's 16 registers)
#endif

// 2 ** (e8m0 - 127) from its bits: the exponent field itself, or the subnormal 2 ** -127 for 0
inline float scale_of(uint8_t e8m0) {
    const uint32_t bits = e8m0 == 0 ? 0x00400000u : (uint32_t)e8m0 << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return scale;
}

// A block's 16 bytes as its even values (low nibbles) and odd values (high nibbles), unscaled:
// on AVX-512 one widening load and two 16-entry table permutes
inline void decode_block(const uint8_t* bytes, vf* even, vf* odd) {
#ifdef __AVX512F__
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)bytes));
    const __m512 lut = _mm512_load_ps(kFp4);
    const __m512 low = _mm512_permutexvar_ps(_mm512_and_si512(codes, _mm512_set1_epi32(15)), lut);
    const __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut);
    memcpy(even, &low, sizeof low);
    memcpy(odd, &high, sizeof high);
#else
    for (int i = 0; i < kBlock / 2; i++) {
        (*even)[i] = kFp4[bytes[i] & 0x0F];
        (*odd)[i] = kFp4[bytes[i] >> 4];
    }
#endif
}

// Each block of 32 of a row as its 16 even values, then its 16 odd ones: the order a decoded
// block's halves multiply (done once per row and projection, not per weight row)
void split_pairs(const float* src, int64_t rows, int64_t src_stride, int64_t features, float* dst) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < features; b += kBlock)
            for (int i = 0; i < kBlock / 2; i++) {
                dst[r * features + b + i] = src[r * src_stride + b + 2 * i];
                dst[r * features + b + kBlock / 2 + i] = src[r * src_stride + b + 2 * i + 1];
            }
}

// y[rows, out] (row stride y_stride) = x @ Wᵀ + bias, W MXFP4 [out, in], x [rows, in] in
// split_pairs' order; output rows split over num_threads. Each (token, output) sums 16 lanes
// of partial products in block order, then the lanes: the same order whatever the tile or
// the threads.
void mxfp4_linear(const float* x, int64_t rows, const uint8_t* blocks, const uint8_t* scales, const float* bias,
                  int64_t in_features, int64_t out_features, float* y, int64_t y_stride, int num_threads) {
    const int64_t num_blocks = in_features / kBlock;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && out_features > 1)
    for (int64_t n = 0; n < out_features; n++) {
        const uint8_t* row_blocks = blocks + n * num_blocks * (kBlock / 2);
        const uint8_t* row_scales = scales + n * num_blocks;
        for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
            const int tile = rows - r0 < kTileRows ? (int)(rows - r0) : kTileRows;
            vf acc[kTileRows][2] = {};
            for (int64_t b = 0; b < num_blocks; b++) {
                vf even, odd;
                decode_block(row_blocks + b * (kBlock / 2), &even, &odd);
                const float scale = scale_of(row_scales[b]);
                even *= scale;
                odd *= scale;
                for (int m = 0; m < tile; m++) {
                    const float* xm = x + (r0 + m) * in_features + b * kBlock;
                    acc[m][0] += even * load(xm);
                    acc[m][1] += odd * load(xm + 16);
                }
            }
            for (int m = 0; m < tile; m++) {
                const vf lanes = acc[m][0] + acc[m][1];
                float sum = 0.0f;
                for (int i = 0; i < 16; i++) sum += lanes[i];
                y[(r0 + m) * y_stride + n] = sum + (bias != nullptr ? bias[n] : 0.0f);
            }
        }
    }
}

struct Experts {
    int64_t num_experts, hidden_size, intermediate_size;
    const uint8_t *w13_blocks, *w13_scales, *w2_blocks, *w2_scales;
    const float *w13_bias, *w2_bias;
    float alpha, limit;
};

// act[r, j] from gate_up[r, 2j] (gate) and gate_up[r, 2j + 1] (up), in torch's order of
// operations (Hugging Face's GptOssExperts._apply_gate); expf rounds unlike torch's exp
void clamped_swiglu(const float* gate_up, int64_t rows, int64_t intermediate, float alpha, float limit, float* act) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < intermediate; j++) {
            float gate = gate_up[r * 2 * intermediate + 2 * j], up = gate_up[r * 2 * intermediate + 2 * j + 1];
            gate = gate > limit ? limit : gate;
            up = up > limit ? limit : (up < -limit ? -limit : up);
            act[r * intermediate + j] = (up + 1.0f) * (gate * (1.0f / (1.0f + expf(-(gate * alpha)))));
        }
}

// One expert over its rows: tokens gathered (in split_pairs' order), gate/up, clamped SwiGLU,
// down into y[rows, hidden]
void run_expert(const Experts& m, int64_t e, const float* x, int64_t x_stride, const int64_t* tokens, int64_t rows,
                float* y, int num_threads) {
    const int64_t hidden = m.hidden_size, inter = m.intermediate_size;
    static thread_local std::vector<float> gathered, gate_up, act, split;
    gathered.resize(rows * hidden);
    gate_up.resize(rows * 2 * inter);
    act.resize(rows * inter);
    split.resize(rows * inter);
    for (int64_t r = 0; r < rows; r++)
        split_pairs(x + tokens[r] * x_stride, 1, x_stride, hidden, gathered.data() + r * hidden);
    mxfp4_linear(gathered.data(), rows, m.w13_blocks + e * 2 * inter * hidden / 2,
                 m.w13_scales + e * 2 * inter * (hidden / kBlock), m.w13_bias + e * 2 * inter, hidden, 2 * inter,
                 gate_up.data(), 2 * inter, num_threads);
    clamped_swiglu(gate_up.data(), rows, inter, m.alpha, m.limit, act.data());
    split_pairs(act.data(), rows, inter, inter, split.data());
    mxfp4_linear(split.data(), rows, m.w2_blocks + e * hidden * inter / 2, m.w2_scales + e * hidden * (inter / kBlock),
                 m.w2_bias + e * hidden, inter, hidden, y, hidden, num_threads);
}

}  // namespace

extern "C" {

// out[num_tokens, hidden] (row stride out_stride) = the experts' combined output for x's rows
// (row stride x_stride). topk_ids, topk_weights: [num_tokens, top_k], contiguous; an id of -1
// adds nothing (an expert held elsewhere). Weights: w13 blocks [E, 2I, H / 32, 16], scales
// [E, 2I, H / 32], bias [E, 2I] float32; w2 blocks [E, H, I / 32, 16], scales [E, H, I / 32],
// bias [E, H]. Returns 0; -2 for an id outside [-1, num_experts); -3 for H or I not a
// multiple of 32 (nothing written).
int moe_mxfp4_f32(int64_t num_experts, int64_t hidden_size, int64_t intermediate_size, const uint8_t* w13_blocks,
                  const uint8_t* w13_scales, const float* w13_bias, const uint8_t* w2_blocks, const uint8_t* w2_scales,
                  const float* w2_bias, float alpha, float limit, const float* x, int64_t x_stride, int64_t num_tokens,
                  const int32_t* topk_ids, const float* topk_weights, int64_t top_k, float* out, int64_t out_stride,
                  int num_threads) {
    if (hidden_size % kBlock || intermediate_size % kBlock) return -3;
    const int64_t num_slots = num_tokens * top_k, hidden = hidden_size;
    for (int64_t s = 0; s < num_slots; s++)
        if (topk_ids[s] < -1 || topk_ids[s] >= num_experts) return -2;
    const Experts m{num_experts, hidden_size, intermediate_size, w13_blocks, w13_scales, w2_blocks, w2_scales,
                    w13_bias, w2_bias, alpha, limit};
    // 1. counting sort of the slots by expert
    std::vector<int64_t> first_row(num_experts + 1, 0), row_of_slot(num_slots, -1), token_of_row(num_slots);
    for (int64_t s = 0; s < num_slots; s++)
        if (topk_ids[s] >= 0) first_row[topk_ids[s] + 1]++;
    for (int64_t e = 0; e < num_experts; e++) first_row[e + 1] += first_row[e];
    std::vector<int64_t> next_row(first_row.begin(), first_row.end() - 1), active;
    for (int64_t s = 0; s < num_slots; s++) {
        if (topk_ids[s] < 0) continue;
        const int64_t row = next_row[topk_ids[s]]++;
        row_of_slot[s] = row;
        token_of_row[row] = s / top_k;
    }
    for (int64_t e = 0; e < num_experts; e++)
        if (first_row[e + 1] > first_row[e]) active.push_back(e);
    std::stable_sort(active.begin(), active.end(), [&](int64_t a, int64_t b) {  // largest first
        return first_row[a + 1] - first_row[a] > first_row[b + 1] - first_row[b];
    });
    // 2. the experts, into their slots' rows
    std::vector<float> slot_out(num_slots * hidden);
    float* slot_rows = slot_out.data();
    const int64_t num_active = (int64_t)active.size();
    auto run = [&](int64_t i, int threads) {
        const int64_t e = active[i], row = first_row[e];
        run_expert(m, e, x, x_stride, token_of_row.data() + row, first_row[e + 1] - row, slot_rows + row * hidden,
                   threads);
    };
    if (num_threads > 1 && num_active >= num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t i = 0; i < num_active; i++) run(i, 1);
    } else {
        for (int64_t i = 0; i < num_active; i++) run(i, num_threads);
    }
    // 3. each token's k rows, weighted, in top-k order (zeros where every one is elsewhere)
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_slots * hidden >= (1 << 16))
    for (int64_t t = 0; t < num_tokens; t++) {
        float* dst = out + t * out_stride;
        memset(dst, 0, hidden * sizeof(float));
        for (int64_t k = 0; k < top_k; k++) {
            const int64_t row = row_of_slot[t * top_k + k];
            if (row < 0) continue;
            const float w = topk_weights[t * top_k + k];
            const float* src = slot_rows + row * hidden;
            for (int64_t j = 0; j < hidden; j++) dst[j] += w * src[j];
        }
    }
    return 0;
}

}  // extern "C"
