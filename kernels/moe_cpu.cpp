// Fused mixture-of-experts on the CPU: out[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),
// e = topk_ids[t, k] (kernels/fused_moe_ref.py is the oracle and says the layouts).
//
// The slots (token, k) are grouped by expert (a counting sort, in slot order within an
// expert), so each active expert runs its gate/up projection, SiLU * up and down projection
// once over all of its tokens: one read of its weights a step, as a dense MLP reads its own,
// whatever the number of tokens routed to it. The projections are the existing linear
// kernels, called through function pointers the caller passes (as model_step_f32 calls
// gguf_linear_f32): for float32 weights cpu_kernels.cpp's linear_few_rows_f32 up to few_rows
// rows (a decode step's expert has one to a few dozen) and torch's sgemm past that; for a
// quantized weight a QuantLinear, gguf_linear.cpp's gguf_linear_f32 (GGUF blocks as the file
// has them: Q4_0, Q4_1, Q8_0, Q5 and K-quants), gguf_gemm.cpp's gguf_gemm_linear_f32 (a
// GGUFTiles descriptor per expert: its int8 tiles from 2 rows, else those blocks) or
// int8_gemm.cpp's int8_linear_f32 (W8A8).
//
// float32 experts are best packed at load (moe_pack_f32, type kPackedF32): each weight as
// panels of 16 output columns, k-major ([N / 16][K][16]), so a tile of up to 6 token rows x
// 64 columns keeps its 24 accumulators in registers and each step of k is 4 weight loads,
// 6 broadcasts and 24 multiply-adds, sgemm's own micro-kernel. An expert at a decode batch of
// 64 has about 16 rows: the few-rows kernel (a dot product and a horizontal sum per output)
// ran at about half of the machine's FMA rate there, and MKL's sgemm no better at that size
// (on the AMD EPYC of benchmarks/RESULTS.md, MKL ran at half this tile's rate even at 512
// rows). Without AVX-512 the tile is 4 rows x 16 columns (tested, not tuned).
//
// Threads: with at least as many active experts as threads (a decode batch routes its
// tokens over most experts), the experts are split over the threads, largest first, each
// expert's projections single-threaded: one parallel region a call instead of three per
// expert, whose start and barrier cost more than an expert's few-row GEMM. With fewer
// active experts (one token, many threads), the experts run one after another and each
// projection splits its weight rows over all threads, as the dense path does.
//
// The combine: each slot's down output lands in its own row of a buffer (expert-sorted),
// and each token then sums its k rows in top-k order, weighted: every output element has one
// writer and one order of additions, so the result does not depend on the threads. Tokens go
// in chunks that keep that buffer under kMaxSlotFloats (a long prefill chunk).
// A plain C ABI, loaded with ctypes (kernels/_native.py via kernels/moe_cpu.py).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

namespace {

typedef void (*Sgemm)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                      const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                      const float* beta, float* c, const int* ldc);
// gguf_linear.cpp's gguf_linear_f32, int8_gemm.cpp's int8_linear_f32
typedef int (*QuantLinear)(int type, const float* x, int64_t x_stride, int64_t rows, const uint8_t* weight,
                           int64_t in_features, int64_t out_features, const float* bias, float* y, int64_t y_stride,
                           int64_t dequantize_rows, Sgemm sgemm, int num_threads);
// cpu_kernels.cpp's linear_few_rows_f32
typedef void (*FewRowsLinear)(const float* x, int64_t x_stride, int64_t num_rows, const float* weight,
                              int64_t weight_stride, const float* bias, float* y, int64_t y_stride,
                              int64_t in_features, int64_t out_features, int num_threads);

constexpr int64_t kMaxSlotFloats = (int64_t)1 << 24;  // the combine buffer of a chunk of tokens: 64 MiB

constexpr int64_t kPackedF32 = 2048;  // a weight type: float32 packed by moe_pack_f32 (past int8's 1024)
constexpr int kPanel = 16;  // output columns per panel: one 64-byte vector
typedef float vf __attribute__((vector_size(64)));
inline vf load(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
#ifdef __AVX512F__
constexpr int kTileRows = 6, kTilePanels = 4;  // 24 accumulators of AVX-512's 32 registers
#else
constexpr int kTileRows = 4, kTilePanels = 1;  // AVX2: a vector is two of its 16 registers
#endif

// y[MR rows, NB panels' columns from n0] = x[MR rows] @ the panels: one (row, column) sums its
// products in k order whatever the tile, so every row's result is independent of the others
// (software prefetching of the next block, as linear_tile does, measured no faster here)
template <int MR, int NB>
void packed_tile(const float* x, int64_t x_stride, const float* panels, int64_t in_features, float* y,
                 int64_t y_stride, int64_t n0, int64_t out_features) {
    vf acc[MR][NB] = {};
    for (int64_t k = 0; k < in_features; k++) {
        vf w[NB];
        for (int b = 0; b < NB; b++) w[b] = load(panels + (b * in_features + k) * kPanel);
        for (int m = 0; m < MR; m++) {
            const vf xk = x[m * x_stride + k] - vf{};  // a broadcast (x - 0: -0 stays -0)
            for (int b = 0; b < NB; b++) acc[m][b] += xk * w[b];
        }
    }
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++) {
            const int64_t col = n0 + b * kPanel;
            const int64_t count = out_features - col < kPanel ? out_features - col : kPanel;
            memcpy(y + m * y_stride + col, &acc[m][b], count * sizeof(float));
        }
}

typedef void (*PackedTile)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t);

template <int NB>
PackedTile packed_tile_for(int rows) {
    switch (rows) {
        case 1: return packed_tile<1, NB>;
        case 2: return packed_tile<2, NB>;
        case 3: return packed_tile<3, NB>;
#ifdef __AVX512F__
        case 4: return packed_tile<4, NB>;
        case 5: return packed_tile<5, NB>;
        default: return packed_tile<6, NB>;
#else
        default: return packed_tile<4, NB>;
#endif
    }
}

// y[rows, out] = x @ Wᵀ, W packed: threads split blocks of kTilePanels panels, each taken for
// every row tile in turn while it sits in L2. Where that leaves threads idle (an expert's
// 512 gate/up rows are 8 blocks), blocks of single panels: 4x the units, less reuse of x.
void packed_linear(const float* x, int64_t x_stride, int64_t rows, const float* packed, int64_t in_features,
                   int64_t out_features, float* y, int64_t y_stride, int num_threads) {
    const int64_t num_panels = (out_features + kPanel - 1) / kPanel;
    const int64_t width = num_threads > 1 && num_panels < 2 * kTilePanels * num_threads ? 1 : kTilePanels;
    const int64_t num_blocks = (num_panels + width - 1) / width;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && num_blocks > 1)
    for (int64_t block = 0; block < num_blocks; block++) {
        const int64_t first = block * width;
        const int64_t count = num_panels - first < width ? num_panels - first : width;
        for (int64_t r = 0; r < rows; r += kTileRows) {
            const int tile = rows - r < kTileRows ? (int)(rows - r) : kTileRows;
            if (count == kTilePanels) {
                packed_tile_for<kTilePanels>(tile)(x + r * x_stride, x_stride, packed + first * in_features * kPanel,
                                                   in_features, y + r * y_stride, y_stride, first * kPanel,
                                                   out_features);
                continue;
            }
            for (int64_t p = first; p < first + count; p++)
                packed_tile_for<1>(tile)(x + r * x_stride, x_stride, packed + p * in_features * kPanel, in_features,
                                         y + r * y_stride, y_stride, p * kPanel, out_features);
        }
    }
}

}  // namespace

extern "C" {

// An MoE layer's experts (kernels/moe_cpu.py's ExpertWeights fills it).
struct MoeExperts {
    int64_t num_experts, hidden_size, intermediate_size;
    int64_t w13_type, w2_type;  // 0: float32 rows; kPackedF32; else the QuantLinear's (a ggml id, or int8's)
    const void* const* w13;  // [num_experts]: expert e's [2 * intermediate, hidden] (gate rows, then up rows)
    const void* const* w2;  // [num_experts]: expert e's [hidden, intermediate]
    FewRowsLinear few_rows_linear;
    Sgemm sgemm;  // null: float32 projections take few_rows_linear at any size
    QuantLinear quant_linear;  // null where both types are 0
    int64_t few_rows;  // float32: up to this many rows few_rows_linear, past it sgemm
    int64_t dequantize_rows;  // the QuantLinear's: past this many rows dequantized tiles and sgemm (GGUF)
};

}  // extern "C"

namespace {

// y[rows, out] (row stride y_stride) = x @ Wᵀ for one expert's weight of either kind
int expert_linear(const MoeExperts& m, int64_t type, const void* weight, const float* x, int64_t x_stride,
                  int64_t rows, int64_t in_features, int64_t out_features, float* y, int64_t y_stride,
                  int num_threads) {
    if (type == kPackedF32) {
        packed_linear(x, x_stride, rows, (const float*)weight, in_features, out_features, y, y_stride, num_threads);
        return 0;
    }
    if (type != 0)
        return m.quant_linear((int)type, x, x_stride, rows, (const uint8_t*)weight, in_features, out_features,
                              nullptr, y, y_stride, m.dequantize_rows, m.sgemm, num_threads);
    if (rows <= m.few_rows || m.sgemm == nullptr) {
        m.few_rows_linear(x, x_stride, rows, (const float*)weight, in_features, nullptr, y, y_stride, in_features,
                          out_features, num_threads);
        return 0;
    }
    const int mm = (int)out_features, n = (int)rows, k = (int)in_features;
    const int lda = (int)in_features, ldb = (int)x_stride, ldc = (int)y_stride;
    const float alpha = 1.0f, beta = 0.0f;
    m.sgemm("T", "N", &mm, &n, &k, &alpha, (const float*)weight, &lda, x, &ldb, &beta, y, &ldc);
    return 0;
}

// h[:, :intermediate] = silu(gate) * up in place, gate and up the halves of each row: in
// torch's order of operations (gate / (1 + exp(-gate)) * up); expf rounds unlike torch's exp
void silu_mul_rows(float* h, int64_t rows, int64_t intermediate) {
    for (int64_t r = 0; r < rows; r++) {
        float* gate = h + r * 2 * intermediate;
        const float* up = gate + intermediate;
        for (int64_t i = 0; i < intermediate; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

// One expert over its rows: x's tokens gathered, gate/up, SiLU * up, down into y[rows, hidden].
int run_expert(const MoeExperts& m, int64_t expert, const float* x, int64_t x_stride, const int64_t* tokens,
               int64_t rows, float* y, int num_threads) {
    const int64_t hidden = m.hidden_size, intermediate = m.intermediate_size;
    // the caller's thread (or the pool's) keeps its buffers from call to call
    static thread_local std::vector<float> gathered, gate_up;
    gathered.resize(rows * hidden);
    gate_up.resize(rows * 2 * intermediate);
    for (int64_t r = 0; r < rows; r++)
        memcpy(gathered.data() + r * hidden, x + tokens[r] * x_stride, hidden * sizeof(float));
    int status = expert_linear(m, m.w13_type, m.w13[expert], gathered.data(), hidden, rows, hidden, 2 * intermediate,
                               gate_up.data(), 2 * intermediate, num_threads);
    if (status != 0) return status;
    silu_mul_rows(gate_up.data(), rows, intermediate);
    return expert_linear(m, m.w2_type, m.w2[expert], gate_up.data(), 2 * intermediate, rows, intermediate, hidden, y,
                         hidden, num_threads);
}

// Tokens [0, num_tokens) of a chunk: group, run the experts, combine into out.
int experts_chunk(const MoeExperts& m, const float* x, int64_t x_stride, int64_t num_tokens, const int32_t* topk_ids,
                  const float* topk_weights, int64_t top_k, float* out, int64_t out_stride, int num_threads) {
    const int64_t num_slots = num_tokens * top_k, hidden = m.hidden_size;
    // 1. counting sort of the slots by expert: row_of_slot (-1: an expert on another rank), and
    // each expert's tokens in row order
    std::vector<int64_t> first_row(m.num_experts + 1, 0), row_of_slot(num_slots, -1), token_of_row(num_slots);
    for (int64_t s = 0; s < num_slots; s++)
        if (topk_ids[s] >= 0) first_row[topk_ids[s] + 1]++;
    for (int64_t e = 0; e < m.num_experts; e++) first_row[e + 1] += first_row[e];
    std::vector<int64_t> next_row(first_row.begin(), first_row.end() - 1);
    for (int64_t s = 0; s < num_slots; s++) {
        if (topk_ids[s] < 0) continue;
        const int64_t row = next_row[topk_ids[s]]++;
        row_of_slot[s] = row;
        token_of_row[row] = s / top_k;
    }
    std::vector<int64_t> active;
    for (int64_t e = 0; e < m.num_experts; e++)
        if (first_row[e + 1] > first_row[e]) active.push_back(e);
    // largest first, so that no thread starts a big expert last (ties by expert id: same order every call)
    std::stable_sort(active.begin(), active.end(), [&](int64_t a, int64_t b) {
        return first_row[a + 1] - first_row[a] > first_row[b + 1] - first_row[b];
    });
    // 2. the experts, into the slots' rows of the buffer
    static thread_local std::vector<float> slot_out;
    slot_out.resize(num_slots * hidden);
    float* slot_rows = slot_out.data();  // (inside the parallel loop slot_out would name each thread's own)
    const int64_t num_active = (int64_t)active.size();
    const bool over_experts = num_threads > 1 && num_active >= num_threads;
    auto run = [&](int64_t i, int threads) {
        const int64_t e = active[i], row = first_row[e];
        return run_expert(m, e, x, x_stride, token_of_row.data() + row, first_row[e + 1] - row,
                          slot_rows + row * hidden, threads);
    };
    int status = 0;
    if (over_experts) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : status)
        for (int64_t i = 0; i < num_active; i++) status |= run(i, 1);
    } else {
        // not inside an `if (false)` parallel region: libgomp would start the projections'
        // regions as nested teams, new threads each time (measured 4x slower at 64 rows)
        for (int64_t i = 0; i < num_active && status == 0; i++) status = run(i, num_threads);
    }
    if (status != 0) return status;
    // 3. each token's k rows, weighted, summed in top-k order (zeros where every one is elsewhere)
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_slots * hidden >= (1 << 16))
    for (int64_t t = 0; t < num_tokens; t++) {
        float* dst = out + t * out_stride;
        bool first = true;
        for (int64_t k = 0; k < top_k; k++) {
            const int64_t row = row_of_slot[t * top_k + k];
            if (row < 0) continue;
            const float w = topk_weights[t * top_k + k];
            const float* src = slot_rows + row * hidden;
            if (first) {
                for (int64_t j = 0; j < hidden; j++) dst[j] = w * src[j];
            } else {
                for (int64_t j = 0; j < hidden; j++) dst[j] += w * src[j];
            }
            first = false;
        }
        if (first) memset(dst, 0, hidden * sizeof(float));
    }
    return 0;
}

}  // namespace

extern "C" {

// out[num_tokens, hidden] (row stride out_stride) = the experts' combined output for x's rows.
// topk_ids, topk_weights: [num_tokens, top_k], contiguous; an id of -1 is an expert on another
// rank (expert parallelism), which adds nothing. Returns 0; -2 for an id past num_experts or
// below -1 (nothing written); or a QuantLinear's error (-1).
int moe_experts_f32(const MoeExperts* experts, const float* x, int64_t x_stride, int64_t num_tokens,
                    const int32_t* topk_ids, const float* topk_weights, int64_t top_k, float* out, int64_t out_stride,
                    int num_threads) {
    const MoeExperts& m = *experts;
    for (int64_t s = 0; s < num_tokens * top_k; s++)
        if (topk_ids[s] < -1 || topk_ids[s] >= m.num_experts) return -2;
    const int64_t per_token = top_k * m.hidden_size > 0 ? top_k * m.hidden_size : 1;
    const int64_t chunk = std::max<int64_t>(1, kMaxSlotFloats / per_token);
    for (int64_t first = 0; first < num_tokens; first += chunk) {
        const int64_t count = std::min(chunk, num_tokens - first);
        const int status = experts_chunk(m, x + first * x_stride, x_stride, count, topk_ids + first * top_k,
                                         topk_weights + first * top_k, top_k, out + first * out_stride, out_stride,
                                         num_threads);
        if (status != 0) return status;
    }
    return 0;
}

// w [out_features, in_features] -> packed [ceil(out / 16)][in_features][16], zeros past out_features.
void moe_pack_f32(const float* w, int64_t out_features, int64_t in_features, float* packed) {
    const int64_t num_panels = (out_features + kPanel - 1) / kPanel;
    for (int64_t p = 0; p < num_panels; p++)
        for (int64_t k = 0; k < in_features; k++)
            for (int j = 0; j < kPanel; j++) {
                const int64_t n = p * kPanel + j;
                packed[(p * in_features + k) * kPanel + j] = n < out_features ? w[n * in_features + k] : 0.0f;
            }
}

}  // extern "C"
