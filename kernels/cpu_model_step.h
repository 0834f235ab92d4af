// The CPU's one-call model step (model_step_f32), included by cpu_kernels.cpp inside its
// extern "C" block after the kernels it calls (cpu_kernels.cpp's header comment lists them).
// A header only to keep each file to one concept: the kernels there, the step that chains
// them here; kernels/_native.py counts it in the build's hash.

#pragma once

// ---- a whole step of a Llama-family model ---------------------------------------------------
//
// The CPU's decode steps spent most of their time outside matmuls and attention in Python
// and torch's dispatch between a layer's dozen small ops (microseconds each, ten times that
// once the matmuls have flushed the caches). Here a step's layers run in one call, with the
// kernels above and MKL's sgemm (torch's own, whose pointer the caller passes), in the same
// order and arithmetic as the model's Python forward.
//
// It mirrors, op for op, LlamaModel.forward (actors/models/llama.py) on the cpu backend
// (CpuBackend in actors/layers/attention.py): CpuBackend.rms_norm (rms_norm_cpu), .linear
// (linear_few_rows_f32 up to few_rows rows, else F.linear), .rotary (rotary_cpu),
// .attention (store_kv_cpu, then paged_attention_cpu: decodes, then prefill chunks) and
// .silu_mul (silu_mul_cpu). A change to one side is a change to the other:
// tests/models/test_cpu_step.py pins this step equal to that forward, bit for bit,
// on tiny models (Llama 3, Qwen2, Qwen3) for decode-only and mixed decode + prefill steps.
// The model runner (ModelRunner._forward, via actors/models/cpu_step.py) picks it.

typedef void (*Sgemm)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                      const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                      const float* beta, float* c, const int* ldc);

struct DecoderLayer {  // one layer's weights (null where the model has none) and KV cache
    const float *input_norm, *qkv_proj, *qkv_bias, *q_norm, *k_norm, *o_proj, *post_attention_norm;
    const float *gate_up_proj, *down_proj;
    float *key_cache, *value_cache;
    // each projection's weight type: 0 float32, else a ggml block type (Q4_0, Q4_1, Q8_0) whose
    // blocks the projection's pointer points at, run by DecoderShape::quant_linear
    int64_t qkv_type, o_type, gate_up_type, down_type;
    // the layer's attention variant (cpu_attention.h): zeros and null for plain causal attention
    const float* sinks;  // [num_heads] or null
    int64_t sliding_window;
    float logits_soft_cap;
    int64_t kv_group;  // its layer group's block tables and slots (StepBatch's group_*; 0 without groups)
    // Gemma's layer (null and 0 for the Llama family's): a norm of the attention output and of
    // the MLP output before each joins the residual (post_attention_norm is then its
    // pre-feedforward norm), the layer's own rotary table (a sliding layer's local base, with
    // the batch's stride) and the MLP's activation (0: SiLU, 1: GELU-tanh)
    const float *attn_out_norm, *mlp_out_norm, *cos_sin_cache;
    int64_t activation;
    // a mixture-of-experts MLP (null experts: the dense one above): the router [num_experts,
    // hidden] of router_type, softmax top-k (renormalised where asked), and moe_cpu.cpp's
    // MoeExperts, run by DecoderShape::moe_experts
    const void* experts;
    const float* router;
    int64_t router_type, num_experts, top_k, renormalize;
};

// kernels/moe_cpu.cpp's moe_experts_f32
typedef int (*MoeExpertsFn)(const void* experts, const float* x, int64_t x_stride, int64_t num_tokens,
                            const int32_t* topk_ids, const float* topk_weights, int64_t top_k, float* out,
                            int64_t out_stride, int num_threads);

// kernels/gguf_linear.cpp's gguf_linear_f32
typedef int (*QuantLinear)(int type, const float* x, int64_t x_stride, int64_t rows, const uint8_t* weight,
                           int64_t in_features, int64_t out_features, const float* bias, float* y, int64_t y_stride,
                           int64_t dequantize_rows, Sgemm sgemm, int num_threads);

struct DecoderShape {
    int64_t num_layers, hidden_size, num_heads, num_kv_heads, head_size, intermediate_size;
    int64_t block_size, cache_block_stride, cache_head_stride, cache_slot_stride;
    int64_t few_rows;  // up to this many rows the linear layers take linear_few_rows_f32, else sgemm
    float eps, scale;
    QuantLinear quant_linear;  // null where no layer is quantized
    int64_t dequantize_rows;  // quant_linear's: past this many rows, dequantized tiles and sgemm
    MoeExpertsFn moe_experts;  // null where no layer has experts
};

struct StepBatch {  // the flat batch: each sequence's tokens at query_start_loc
    int64_t num_tokens;
    const int64_t* positions;  // [num_tokens]
    const float* cos_sin_cache;  // [max_position, head_size]
    int64_t cos_sin_stride;
    const int64_t* slot_mapping;  // [num_tokens]
    const int32_t *block_tables, *seq_lens, *query_start_loc;
    const int32_t* decode_seqs;  // the sequences with one query token
    const int32_t* prefill_seqs;  // the sequences with several (prefill chunks)
    int64_t num_decodes, num_prefills, block_table_stride;
    float* hidden;  // [num_tokens, hidden_size]: the embeddings, then scratch
    float* workspace;  // model_step_workspace_floats(shape, num_tokens) floats
    float* out;  // [num_tokens, hidden_size]: the final norm's output
    const struct LoraStep* lora;  // the step's LoRA adapters, or null
    // with layer groups (actors/config/kv_groups.py): every group's block tables [groups, seqs,
    // block_table_stride] and slots [groups, num_tokens], a layer reading its kv_group's; null:
    // block_tables and slot_mapping serve every layer
    const int32_t* group_block_tables;
    const int64_t* group_slot_mappings;
    int64_t group_block_tables_stride, group_slot_mappings_stride;  // elements from one group's to the next
    // the experts' routing: [num_tokens, max num_experts] logits, then [num_tokens, max top_k]
    // weights and as many int32 ids (null where no layer has experts)
    float* moe_scratch;
};

// A step's LoRA adapters (actors/lora/: slots.py's layout, batch.py's segments): per layer and
// group of projections sharing an input (0 q/k/v, 1 o, 2 gate/up, 3 down), each slot's A
// matrices stacked [modules * max_rank, in] and B matrices [group out, max_rank] (scaled).
struct LoraStep {
    int64_t num_slots, max_rank, num_segments;
    const float* const* a;  // [num_layers * 4]: [num_slots, modules * max_rank, in]
    const float* const* b;  // [num_layers * 4]: [num_slots, group out, max_rank]
    const int32_t* rows;  // [num_layers, 4, num_slots]: A rows in use
    const int32_t* col_offset;  // [num_layers, 4, 3, num_slots]: a module's first A row
    const int32_t* rank;  // [num_layers, 4, 3, num_slots]: a module's rank, 0 where not adapted
    const int32_t *seg_start, *seg_len, *seg_slot;  // [num_segments]: runs of rows with one adapter
    float* scratch;  // [num_tokens, 3 * max_rank]
};

// y[rows] (+)= x[rows] · wᵀ with each row summed in one order whatever rows share the call:
// linear_tile's order, which depends on no other row (linear_few_rows_f32, 4 rows at a time).
// A LoRA delta must not depend on the step's batch: sgemm's order does (a single row takes
// another kernel than four), and the next layer's per-block int8 quantization of a GGUF or
// int8 model turns those last-bit differences into different logprobs (0.12 on SmolLM2).
static void rowwise_linear(const float* x, int64_t x_stride, int64_t rows, const float* w, int64_t w_stride,
                           int64_t in_features, int64_t out_features, float* y, int64_t y_stride, bool accumulate,
                           int num_threads) {
    constexpr int64_t kRows = 4;
    const int64_t num_tiles = (rows + kRows - 1) / kRows;
#pragma omp parallel num_threads(num_threads) if (rows * out_features * in_features >= (int64_t)1 << 20)
    {
        std::vector<float> tile(accumulate ? kRows * out_features : 0);  // a tile's products, then added to y
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tiles; t++) {
            const int64_t first = t * kRows, n = rows - first < kRows ? rows - first : kRows;
            float* out = accumulate ? tile.data() : y + first * y_stride;
            const int64_t out_stride = accumulate ? out_features : y_stride;
            linear_few_rows_f32(x + first * x_stride, x_stride, n, w, w_stride, nullptr, out, out_stride, in_features,
                                out_features, 1);
            if (!accumulate) continue;
            for (int64_t r = 0; r < n; r++)
                for (int64_t j = 0; j < out_features; j++) y[(first + r) * y_stride + j] += out[r * out_features + j];
        }
    }
}

// y[segment rows, group columns] += x·Aᵀ·Bᵀ of each segment's adapter: kernels/lora_ref.py's shrink
// (one product for the group's modules together) and expand (one per adapted module), as the
// Python forward runs them (LoRABatch.add), each row in an order of its own (rowwise_linear).
static void lora_add(const LoraStep* lora, int64_t layer, int group, int num_modules, const int64_t* out_offsets,
                     const int64_t* out_sizes, const float* x, int64_t x_stride, int64_t in_features, float* y,
                     int64_t y_stride, int64_t group_out, int num_threads) {
    if (lora == nullptr) return;
    const int64_t num_slots = lora->num_slots, max_rank = lora->max_rank, g = layer * 4 + group;
    for (int64_t i = 0; i < lora->num_segments; i++) {
        const int64_t slot = lora->seg_slot[i], start = lora->seg_start[i];
        const int64_t rows = lora->rows[g * num_slots + slot], n = lora->seg_len[i];
        if (rows == 0 || n == 0) continue;
        const float* a = lora->a[g] + slot * num_modules * max_rank * in_features;
        rowwise_linear(x + start * x_stride, x_stride, n, a, in_features, in_features, rows, lora->scratch, rows, false,
                       num_threads);
        for (int m = 0; m < num_modules; m++) {
            const int64_t meta = (g * 3 + m) * num_slots + slot;
            const int64_t rank = lora->rank[meta];
            if (rank == 0) continue;
            const float* b = lora->b[g] + (slot * group_out + out_offsets[m]) * max_rank;
            rowwise_linear(lora->scratch + lora->col_offset[meta], rows, n, b, max_rank, rank, out_sizes[m],
                           y + start * y_stride + out_offsets[m], y_stride, true, num_threads);
        }
    }
}

static void decoder_linear(const DecoderShape& shape, Sgemm sgemm, const float* x, int64_t x_stride, int64_t rows,
                           const float* weight, int64_t weight_type, int64_t in_features, int64_t out_features,
                           const float* bias, float* y, int num_threads) {
    if (weight_type != 0) {  // GGUF blocks (the caller checked the type has a kernel)
        shape.quant_linear((int)weight_type, x, x_stride, rows, (const uint8_t*)weight, in_features, out_features,
                           bias, y, out_features, shape.dequantize_rows, sgemm, num_threads);
        return;
    }
    // as CpuBackend.linear: a few rows by linear_few_rows_f32, else as F.linear (addmm: the bias
    // copied into the output, then sgemm adds the product to it)
    if (rows <= shape.few_rows) {
        linear_few_rows_f32(x, x_stride, rows, weight, in_features, bias, y, out_features, in_features, out_features,
                            num_threads);
        return;
    }
    if (bias != nullptr)
        for (int64_t r = 0; r < rows; r++) memcpy(y + r * out_features, bias, out_features * sizeof(float));
    const int m = (int)out_features, n = (int)rows, k = (int)in_features;
    const int lda = (int)in_features, ldb = (int)x_stride, ldc = (int)out_features;
    const float alpha = 1.0f, beta = bias != nullptr ? 1.0f : 0.0f;
    sgemm("T", "N", &m, &n, &k, &alpha, weight, &lda, x, &ldb, &beta, y, &ldc);
}

// A mixture-of-experts MLP (actors/models/moe.py's, kernels/fused_moe_ref.py's route): the
// router's logits, a softmax over the experts in float, the top_k largest (the first of equal
// ones), renormalised to sum to 1 where asked; then the experts' combined output into out.
static int moe_block(const DecoderShape& shape, Sgemm sgemm, const DecoderLayer& layer, const float* x,
                     int64_t tokens, float* scratch, float* out, int num_threads) {
    const int64_t experts = layer.num_experts, top_k = layer.top_k;
    float* logits = scratch;
    float* weights = logits + tokens * experts;
    int32_t* ids = (int32_t*)(weights + tokens * top_k);
    decoder_linear(shape, sgemm, x, shape.hidden_size, tokens, layer.router, layer.router_type, shape.hidden_size,
                   experts, nullptr, logits, num_threads);
    for (int64_t t = 0; t < tokens; t++) {
        float* row = logits + t * experts;
        float largest = row[0];
        for (int64_t e = 1; e < experts; e++) largest = row[e] > largest ? row[e] : largest;
        float sum = 0.0f;
        for (int64_t e = 0; e < experts; e++) sum += (row[e] = expf(row[e] - largest));
        float chosen = 0.0f;
        for (int64_t k = 0; k < top_k; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < experts; e++)
                if (row[e] >= 0.0f && (best < 0 || row[e] > row[best])) best = e;
            ids[t * top_k + k] = (int32_t)best;
            weights[t * top_k + k] = row[best] / sum;
            chosen += weights[t * top_k + k];
            row[best] = -1.0f;  // taken (probabilities are never negative)
        }
        if (layer.renormalize)
            for (int64_t k = 0; k < top_k; k++) weights[t * top_k + k] /= chosen;
    }
    return shape.moe_experts(layer.experts, x, shape.hidden_size, tokens, ids, weights, top_k, out,
                             shape.hidden_size, num_threads);
}

int64_t model_step_workspace_floats(const DecoderShape* shape, int64_t num_tokens) {
    const int64_t qkv = (shape->num_heads + 2 * shape->num_kv_heads) * shape->head_size;
    return num_tokens * (2 * shape->hidden_size + qkv + shape->num_heads * shape->head_size
                         + 2 * shape->intermediate_size);
}

// The model's forward for a step: returns 0, or -1 where the attention kernels have no code for
// the head size (the caller checks first).
int model_step_f32(const DecoderShape* shape_, const DecoderLayer* layers, const StepBatch* batch_, Sgemm sgemm,
                    const float* final_norm, int num_threads) {
    const DecoderShape& shape = *shape_;
    const StepBatch& batch = *batch_;
    const int64_t tokens = batch.num_tokens, hidden_size = shape.hidden_size, head_size = shape.head_size;
    const int64_t q_size = shape.num_heads * head_size, kv_size = shape.num_kv_heads * head_size;
    const int64_t qkv_size = q_size + 2 * kv_size, intermediate = shape.intermediate_size;
    // Two hidden-sized buffers take turns as in the Python forward: `hidden` gets each down
    // projection, `projection` each o projection; each norm adds the other into its input,
    // which then is the residual (the embeddings are layer 0's residual as they are).
    float* hidden = batch.hidden;
    float* projection = batch.workspace;
    float* x = projection + tokens * hidden_size;  // normed input of a projection
    float* qkv = x + tokens * hidden_size;
    float* attn = qkv + tokens * qkv_size;
    float* gate_up = attn + tokens * q_size;
    // each LoRA group's modules' columns of its output
    const int64_t qkv_offsets[] = {0, q_size, q_size + kv_size}, qkv_sizes[] = {q_size, kv_size, kv_size};
    const int64_t gate_up_offsets[] = {0, intermediate}, gate_up_sizes[] = {intermediate, intermediate};
    const int64_t whole[] = {0};
    for (int64_t l = 0; l < shape.num_layers; l++) {
        const DecoderLayer& layer = layers[l];
        const bool grouped = batch.group_block_tables != nullptr;
        const int32_t* block_tables = grouped ? batch.group_block_tables
            + layer.kv_group * batch.group_block_tables_stride : batch.block_tables;
        const int64_t* slot_mapping = grouped ? batch.group_slot_mappings
            + layer.kv_group * batch.group_slot_mappings_stride : batch.slot_mapping;
        // 1. attention block
        rms_norm_f32(hidden, hidden_size, l == 0 ? nullptr : projection, hidden_size, layer.input_norm, x,
                     hidden_size, tokens, (int)hidden_size, shape.eps, num_threads);
        decoder_linear(shape, sgemm, x, hidden_size, tokens, layer.qkv_proj, layer.qkv_type, hidden_size, qkv_size,
                       layer.qkv_bias, qkv, num_threads);
        lora_add(batch.lora, l, 0, 3, qkv_offsets, qkv_sizes, x, hidden_size, hidden_size, qkv, qkv_size, qkv_size,
                 num_threads);
        if (layer.q_norm != nullptr)  // Qwen3: each head normed as a row
            for (int64_t t = 0; t < tokens; t++) {
                float* row = qkv + t * qkv_size;
                rms_norm_f32(row, head_size, nullptr, 0, layer.q_norm, row, head_size, shape.num_heads,
                             (int)head_size, shape.eps, 1);
                rms_norm_f32(row + q_size, head_size, nullptr, 0, layer.k_norm, row + q_size, head_size,
                             shape.num_kv_heads, (int)head_size, shape.eps, 1);
            }
        // q and k heads are neighbours in a qkv row: they rotate as one run of heads
        rotary_f32(batch.positions, qkv, qkv_size, head_size, tokens, (int)(shape.num_heads + shape.num_kv_heads),
                   (int)head_size, layer.cos_sin_cache ? layer.cos_sin_cache : batch.cos_sin_cache,
                   batch.cos_sin_stride, num_threads);
        store_kv_f32(qkv + q_size, qkv + q_size + kv_size, qkv_size, head_size, qkv_size, head_size, layer.key_cache,
                     layer.value_cache, shape.cache_block_stride, shape.cache_head_stride, shape.cache_slot_stride,
                     slot_mapping, tokens, (int)shape.num_kv_heads, (int)head_size, (int)shape.block_size,
                     num_threads);
        // decodes, then prefill chunks, as CpuBackend.attention runs them
        const struct { decltype(&paged_decode_f32) attend; const int32_t* seqs; int64_t count; } kinds[] = {
            {paged_decode_f32, batch.decode_seqs, batch.num_decodes},
            {paged_prefill_f32, batch.prefill_seqs, batch.num_prefills}};
        for (const auto& [attend, seqs, count] : kinds) {
            if (count == 0) continue;
            const int status = attend(
                qkv, qkv_size, head_size, layer.key_cache, layer.value_cache, shape.cache_block_stride,
                shape.cache_head_stride, shape.cache_slot_stride, block_tables, batch.block_table_stride,
                batch.seq_lens, batch.query_start_loc, seqs, (int)count, (int)shape.num_kv_heads,
                (int)(shape.num_heads / shape.num_kv_heads), (int)head_size, (int)shape.block_size, shape.scale,
                (int)layer.sliding_window, layer.logits_soft_cap, layer.sinks, attn, q_size, head_size, num_threads);
            if (status != 0) return status;
        }
        decoder_linear(shape, sgemm, attn, q_size, tokens, layer.o_proj, layer.o_type, q_size, hidden_size, nullptr,
                       projection, num_threads);
        lora_add(batch.lora, l, 1, 1, whole, &hidden_size, attn, q_size, q_size, projection, hidden_size, hidden_size,
                 num_threads);
        if (layer.attn_out_norm != nullptr)  // Gemma: the attention output normed before the residual add
            rms_norm_f32(projection, hidden_size, nullptr, 0, layer.attn_out_norm, projection, hidden_size, tokens,
                         (int)hidden_size, shape.eps, num_threads);
        // 2. MLP block
        rms_norm_f32(projection, hidden_size, hidden, hidden_size, layer.post_attention_norm, x, hidden_size, tokens,
                     (int)hidden_size, shape.eps, num_threads);
        if (layer.experts != nullptr) {  // the experts' combined output, where the dense MLP's down projection goes
            const int status = moe_block(shape, sgemm, layer, x, tokens, batch.moe_scratch, hidden, num_threads);
            if (status != 0) return status;
        } else {
            decoder_linear(shape, sgemm, x, hidden_size, tokens, layer.gate_up_proj, layer.gate_up_type, hidden_size,
                           2 * intermediate, nullptr, gate_up, num_threads);
            lora_add(batch.lora, l, 2, 2, gate_up_offsets, gate_up_sizes, x, hidden_size, hidden_size, gate_up,
                     2 * intermediate, 2 * intermediate, num_threads);
            if (layer.activation == 1)
                gelu_tanh_mul_f32(gate_up, 2 * intermediate, tokens, intermediate, num_threads);
            else
                silu_mul_f32(gate_up, 2 * intermediate, tokens, intermediate, num_threads);
            decoder_linear(shape, sgemm, gate_up, 2 * intermediate, tokens, layer.down_proj, layer.down_type, intermediate,
                           hidden_size, nullptr, hidden, num_threads);
            lora_add(batch.lora, l, 3, 1, whole, &hidden_size, gate_up, 2 * intermediate, intermediate, hidden,
                     hidden_size, hidden_size, num_threads);
        }
        if (layer.mlp_out_norm != nullptr)  // Gemma: the MLP output normed before the next layer's residual add
            rms_norm_f32(hidden, hidden_size, nullptr, 0, layer.mlp_out_norm, hidden, hidden_size, tokens,
                         (int)hidden_size, shape.eps, num_threads);
    }
    rms_norm_f32(hidden, hidden_size, projection, hidden_size, final_norm, batch.out, hidden_size, tokens,
                 (int)hidden_size, shape.eps, num_threads);
    return 0;
}
