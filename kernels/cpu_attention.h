// The CPU's paged attention kernels (cpu_kernels.cpp includes this file, after
// cpu_vectors.h): paged_decode_f32 and paged_prefill_f32, described in cpu_kernels.cpp's header.
//
// Both take a layer's attention variant (kernels/paged_attention_ref.py's docstring has the
// semantics): a sliding window (0: none), a logit soft cap (0: none) and per-head sink logits
// (null: none). A window's keys start at position p - window + 1 for a query at p; blocks
// wholly before it are never read, nor their block table entries (a KV-cache manager may free
// them), so a windowed decode costs the window whatever the context.

#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "cpu_vectors.h"

namespace {

constexpr int kMaxGroup = 64;  // query heads per kv head

struct CacheView {
    const float* keys;  // this kv head's slot 0 of block 0
    const float* values;
    int64_t block_stride, slot_stride;
    int block_size;
};

struct Variant {
    int window;  // keys a query sees, its own included; 0: all before it
    float soft_cap;  // scores = soft_cap * tanh(scores / soft_cap); 0: none
    const float* sinks;  // [group]: this kv head's query heads' sink logits; null: none
};

// cap * tanh(x / cap), tanh(y) as 1 - 2 / (exp(2y) + 1): exp_clamped's range saturates it at +-1
// (its absolute error, ~1e-7, is torch's fp32 tanh's order)
inline vf soft_capped(vf x, float cap) {
    const vf e = exp_clamped(x * (2.0f / cap));
    return (1.0f - 2.0f / (e + 1.0f)) * cap;
}

// 1 / the softmax's denominator, times what rescales the accumulator: the sink's exp joins
// the sum (at a common max; it adds no value)
inline float normalizer(float running_max, float running_sum, const float* sink) {
    if (sink == nullptr) return 1.0f / running_sum;
    const float max = *sink > running_max ? *sink : running_max;
    const float correction = expf(running_max - max);
    return correction / (running_sum * correction + expf(*sink - max));
}

// One decode, one kv head: the `group` query heads of the head, online softmax over the
// sequence's keys, 16 at a time (a block of fewer slots makes shorter runs).
template <int kVectors>  // head_size / 16
void decode_head(const float* query, int64_t query_head_stride, const CacheView& cache, const int32_t* block_table,
                 int seq_len, int group, float scale, const Variant& variant, float* out, int64_t out_head_stride) {
    vf q[kMaxGroup][kVectors], acc[kMaxGroup][kVectors];
    float running_max[kMaxGroup], running_sum[kMaxGroup];
    for (int g = 0; g < group; g++) {
        for (int c = 0; c < kVectors; c++) {
            q[g][c] = load(query + g * query_head_stride + c * kLanes) * scale;
            acc[g][c] = vf{};
        }
        running_max[g] = -1e30f;  // finite: exp(-1e30 - max) is 0, never NaN
        running_sum[g] = 0.0f;
    }
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const int block_size = cache.block_size;
    const int num_blocks = (seq_len + block_size - 1) / block_size;
    const int64_t block_bytes = (int64_t)block_size * cache.slot_stride * sizeof(float);
    // a window's first key, and its block: the blocks before it are skipped, their table entries unread
    const int first_key = variant.window > 0 && seq_len > variant.window ? seq_len - variant.window : 0;
    for (int j = first_key / block_size; j < num_blocks; j++) {
        const int64_t block = block_table[j];
        const int num_slots = seq_len - j * block_size < block_size ? seq_len - j * block_size : block_size;
        // The next block is elsewhere in memory, where no hardware prefetcher looks: its lines
        // are fetched a few per key of this block, spread over the work (all at once, they
        // fill the line-fill buffers and stall the core until they arrive).
        const char* next_keys = nullptr;
        const char* next_values = nullptr;
        if (j + 1 < num_blocks) {
            next_keys = (const char*)(cache.keys + block_table[j + 1] * cache.block_stride);
            next_values = (const char*)(cache.values + block_table[j + 1] * cache.block_stride);
        }
        const int64_t fetch_per_slot = ((block_bytes + 63) / 64 + num_slots - 1) / num_slots * 64;
        int64_t fetched = 0;
        const int skip = first_key - j * block_size;  // > 0 in the window's first block: slots before it
        // from the run that holds the window's first key: a run with no visible key would make no max
        for (int first = skip > 0 ? skip / kLanes * kLanes : 0; first < num_slots; first += kLanes) {
            const int count = num_slots - first < kLanes ? num_slots - first : kLanes;
            const int lowest = skip > first ? skip - first : 0;  // the run's first visible lane
            const float* keys = cache.keys + block * cache.block_stride + first * cache.slot_stride;
            const float* values = cache.values + block * cache.block_stride + first * cache.slot_stride;
            for (int g = 0; g < group; g++) {
                vf partial[kLanes];
                for (int t = 0; t < kLanes; t++) {
                    partial[t] = vf{};
                    if (t < count) {
                        const float* key = keys + t * cache.slot_stride;
                        for (int c = 0; c < kVectors; c++) partial[t] += q[g][c] * load(key + c * kLanes);
                        if (g == 0 && next_keys != nullptr)
                            for (int64_t end = fetched + fetch_per_slot; fetched < end && fetched < block_bytes;
                                 fetched += 64) {
                                __builtin_prefetch(next_keys + fetched);
                                __builtin_prefetch(next_values + fetched);
                            }
                    }
                }
                vf scores = transpose_sum(partial);
                if (variant.soft_cap > 0.0f) scores = soft_capped(scores, variant.soft_cap);
                scores = (lane < count) & (lane >= lowest) ? scores : splat(-1e30f);
                float new_max = max_of(scores);
                new_max = new_max > running_max[g] ? new_max : running_max[g];
                vf probs = exp_clamped(scores - new_max);
                float correction = exp_clamped(splat(running_max[g] - new_max))[0];
                running_max[g] = new_max;
                running_sum[g] = running_sum[g] * correction + sum_of(probs);
                vf a[kVectors];
                for (int c = 0; c < kVectors; c++) a[c] = acc[g][c] * correction;
                for (int t = lowest; t < count; t++) {
                    const float* value = values + t * cache.slot_stride;
                    vf p = splat(probs[t]);
                    for (int c = 0; c < kVectors; c++) a[c] += p * load(value + c * kLanes);
                }
                for (int c = 0; c < kVectors; c++) acc[g][c] = a[c];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const float inverse = normalizer(running_max[g], running_sum[g], variant.sinks ? variant.sinks + g : nullptr);
        for (int c = 0; c < kVectors; c++) store(out + g * out_head_stride + c * kLanes, acc[g][c] * inverse);
    }
}

typedef void (*DecodeHead)(const float*, int64_t, const CacheView&, const int32_t*, int, int, float, const Variant&,
                           float*, int64_t);

// A kernel template's instance for a head size (head_size / 16 vectors), or null where
// there is none: Kernel<V>::fn is the instance for V vectors.
template <template <int> class Kernel>
auto kernel_for(int head_size) -> decltype(Kernel<1>::fn) {
    switch (head_size / kLanes) {
        case 1: return Kernel<1>::fn;
        case 2: return Kernel<2>::fn;
        case 3: return Kernel<3>::fn;
        case 4: return Kernel<4>::fn;
        case 5: return Kernel<5>::fn;
        case 6: return Kernel<6>::fn;
        case 7: return Kernel<7>::fn;
        case 8: return Kernel<8>::fn;
        case 16: return Kernel<16>::fn;
        default: return nullptr;
    }
}

template <int V>
struct DecodeHeadFor {
    static constexpr DecodeHead fn = decode_head<V>;
};

constexpr int kPrefillRows = 64;  // query rows (tokens x heads of a kv head) a prefill task holds
constexpr int kRowBlock = 4;  // rows whose accumulators sit in registers at once
constexpr int kKeyVectors = 4;  // a prefill tile's keys: kKeyVectors * 16

// A tile of query tokens of one prefill chunk, the `group` query heads of one kv head: each
// row (token, head) against its causal keys (those up to its position) from the cache, 64
// keys at a time. Keys are transposed per tile into dims x keys, so a row's scores are
// vectors of multiply-adds with no horizontal sums; the online softmax then runs on whole
// vectors, and the values are weighted into a few rows' accumulators at a time.
template <int kVectors>  // head_size / 16
void prefill_tile(const float* query, int64_t query_token_stride, int64_t query_head_stride, const CacheView& cache,
                  const int32_t* block_table, int first_position, int num_tokens, int group, float scale,
                  const Variant& variant, float* out, int64_t out_token_stride, int64_t out_head_stride) {
    constexpr int kHead = kVectors * kLanes, kTile = kKeyVectors * kLanes;
    const int rows = num_tokens * group;  // row r: token r / group, head r % group
    alignas(64) float q[kPrefillRows][kHead];
    alignas(64) float acc[kPrefillRows][kHead];
    alignas(64) float probs[kPrefillRows][kTile];
    alignas(64) float keys_t[kHead][kTile];  // the tile's keys, transposed
    float running_max[kPrefillRows], running_sum[kPrefillRows];
    int position[kPrefillRows], lowest[kPrefillRows];  // a row's position, and its first visible key
    for (int r = 0; r < kPrefillRows && (r < rows || r % kRowBlock); r++) {  // the last row block's spare rows: 0
        const float* src = query + (r / group) * query_token_stride + (r % group) * query_head_stride;
        for (int c = 0; c < kVectors; c++) {
            store(q[r] + c * kLanes, r < rows ? load(src + c * kLanes) * scale : vf{});
            store(acc[r] + c * kLanes, vf{});
        }
        running_max[r] = -1e30f;
        running_sum[r] = 0.0f;
        position[r] = first_position + r / group;
        lowest[r] = variant.window > 0 ? position[r] - variant.window + 1 : 0;
    }
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const int num_keys = first_position + num_tokens;  // the last token's keys, and so everyone's
    // the first row's window's first key: the tiles start at its tile, and keys before it (masked)
    // are loaded as that key, so that no block wholly before the window is read
    const int first_key = lowest[0] > 0 ? lowest[0] : 0;
    const float* value_rows[kTile];
    for (int first = first_key / kTile * kTile; first < num_keys; first += kTile) {
        const int count = num_keys - first < kTile ? num_keys - first : kTile;
        for (int t = 0; t < kTile; t++) {
            int key = first + (t < count ? t : 0);
            key = key < first_key ? first_key : key;
            const int64_t offset = block_table[key / cache.block_size] * cache.block_stride
                                   + (key % cache.block_size) * cache.slot_stride;
            const float* k = cache.keys + offset;
            value_rows[t] = cache.values + offset;
            for (int d = 0; d < kHead; d++) keys_t[d][t] = k[d];
        }
        // 1. scores and the online softmax, kRowBlock rows at a time
        for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
            vf s[kRowBlock][kKeyVectors] = {};
            for (int d = 0; d < kHead; d++) {
                vf k[kKeyVectors];
                for (int v = 0; v < kKeyVectors; v++) k[v] = load(keys_t[d] + v * kLanes);
                for (int i = 0; i < kRowBlock; i++) {
                    const vf x = splat(q[r0 + i][d]);
                    for (int v = 0; v < kKeyVectors; v++) s[i][v] += x * k[v];
                }
            }
            for (int i = 0; i < kRowBlock && r0 + i < rows; i++) {
                const int r = r0 + i;
                vf m = splat(-1e30f);
                for (int v = 0; v < kKeyVectors; v++) {
                    const vi key = lane + (first + v * kLanes);
                    if (variant.soft_cap > 0.0f) s[i][v] = soft_capped(s[i][v], variant.soft_cap);
                    s[i][v] = (key < num_keys) & (key <= position[r]) & (key >= lowest[r]) ? s[i][v] : splat(-1e30f);
                    m = s[i][v] > m ? s[i][v] : m;
                }
                float new_max = max_of(m);
                new_max = new_max > running_max[r] ? new_max : running_max[r];
                if (new_max == -1e30f) {  // a window that starts past this tile: nothing seen yet, nothing to add
                    for (int v = 0; v < kKeyVectors; v++) store(probs[r] + v * kLanes, vf{});
                    continue;
                }
                vf sum = vf{};
                for (int v = 0; v < kKeyVectors; v++) {
                    const vf p = exp_clamped(s[i][v] - new_max);
                    store(probs[r] + v * kLanes, p);
                    sum += p;
                }
                const float correction = expf(running_max[r] - new_max);
                running_max[r] = new_max;
                running_sum[r] = running_sum[r] * correction + sum_of(sum);
                if (correction != 1.0f)
                    for (int c = 0; c < kVectors; c++)
                        store(acc[r] + c * kLanes, load(acc[r] + c * kLanes) * correction);
            }
        }
        // 2. values, weighted by the probabilities
        for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
            vf a[kRowBlock][kVectors];
            for (int i = 0; i < kRowBlock; i++)
                for (int c = 0; c < kVectors; c++) a[i][c] = load(acc[r0 + i] + c * kLanes);
            for (int t = 0; t < count; t++) {
                vf v[kVectors];
                for (int c = 0; c < kVectors; c++) v[c] = load(value_rows[t] + c * kLanes);
                for (int i = 0; i < kRowBlock; i++) {
                    const vf p = splat(probs[r0 + i][t]);
                    for (int c = 0; c < kVectors; c++) a[i][c] += p * v[c];
                }
            }
            for (int i = 0; i < kRowBlock; i++)
                for (int c = 0; c < kVectors; c++) store(acc[r0 + i] + c * kLanes, a[i][c]);
        }
    }
    for (int r = 0; r < rows; r++) {
        const float inverse = normalizer(running_max[r], running_sum[r],
                                         variant.sinks ? variant.sinks + r % group : nullptr);
        float* dst = out + (r / group) * out_token_stride + (r % group) * out_head_stride;
        for (int c = 0; c < kVectors; c++) store(dst + c * kLanes, load(acc[r] + c * kLanes) * inverse);
    }
}

typedef void (*PrefillTile)(const float*, int64_t, int64_t, const CacheView&, const int32_t*, int, int, int, float,
                            const Variant&, float*, int64_t, int64_t);

template <int V>
struct PrefillTileFor {
    static constexpr PrefillTile fn = prefill_tile<V>;
};
}  // namespace

extern "C" {

// Returns 0, or -1 for a head size it has no code for (the caller checks first).
int paged_decode_f32(
    const float* query, int64_t query_token_stride, int64_t query_head_stride,  // [num_tokens, num_heads, head_size]
    const float* key_cache, const float* value_cache,  // [num_blocks, num_kv_heads, block_size, head_size]
    int64_t cache_block_stride, int64_t cache_head_stride, int64_t cache_slot_stride,
    const int32_t* block_tables, int64_t block_table_stride,  // [num_seqs, max_blocks_per_seq]
    const int32_t* seq_lens,  // [num_seqs]
    const int32_t* query_start_loc,  // [num_seqs + 1]
    const int32_t* decode_seqs, int num_decodes,  // the sequences with one query token
    int num_kv_heads, int group, int head_size, int block_size, float scale,
    int sliding_window, float logits_soft_cap, const float* sinks,  // 0, 0, null: none; sinks [num_heads]
    float* out, int64_t out_token_stride, int64_t out_head_stride,  // [num_tokens, num_heads, head_size]
    int num_threads) {
    DecodeHead run = kernel_for<DecodeHeadFor>(head_size);
    if (run == nullptr || head_size % kLanes || group > kMaxGroup) return -1;
    auto decode = [&](int i, int h) {
        const int seq = decode_seqs[i];
        const int64_t token = query_start_loc[seq];
        const CacheView cache = {key_cache + h * cache_head_stride, value_cache + h * cache_head_stride,
                                 cache_block_stride, cache_slot_stride, block_size};
        const Variant variant = {sliding_window, logits_soft_cap, sinks ? sinks + h * group : nullptr};
        run(query + token * query_token_stride + (int64_t)h * group * query_head_stride, query_head_stride, cache,
            block_tables + (int64_t)seq * block_table_stride, seq_lens[seq], group, scale, variant,
            out + token * out_token_stride + (int64_t)h * group * out_head_stride, out_head_stride);
    };
    if (num_decodes >= 4 * num_threads) {
        // a thread takes all kv heads of a decode in turn: each block's heads are neighbours in memory
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int i = 0; i < num_decodes; i++)
            for (int h = 0; h < num_kv_heads; h++) decode(i, h);
    } else {  // few decodes: their heads spread over the threads too
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
        for (int i = 0; i < num_decodes; i++)
            for (int h = 0; h < num_kv_heads; h++) decode(i, h);
    }
    return 0;
}

// Prefill chunks: each of its query tokens attends to the sequence's keys up to its own
// position, from the cache (this step's keys already stored). Tasks of up to kPrefillRows
// query rows of one kv head spread over the threads. Returns 0, or -1 for a head size it has
// no code for (the caller checks first).
int paged_prefill_f32(
    const float* query, int64_t query_token_stride, int64_t query_head_stride,  // [num_tokens, num_heads, head_size]
    const float* key_cache, const float* value_cache,  // [num_blocks, num_kv_heads, block_size, head_size]
    int64_t cache_block_stride, int64_t cache_head_stride, int64_t cache_slot_stride,
    const int32_t* block_tables, int64_t block_table_stride,  // [num_seqs, max_blocks_per_seq]
    const int32_t* seq_lens,  // [num_seqs]
    const int32_t* query_start_loc,  // [num_seqs + 1]
    const int32_t* prefill_seqs, int num_prefills,  // the sequences with more than one query token
    int num_kv_heads, int group, int head_size, int block_size, float scale,
    int sliding_window, float logits_soft_cap, const float* sinks,  // 0, 0, null: none; sinks [num_heads]
    float* out, int64_t out_token_stride, int64_t out_head_stride,  // [num_tokens, num_heads, head_size]
    int num_threads) {
    PrefillTile run = kernel_for<PrefillTileFor>(head_size);
    if (run == nullptr || head_size % kLanes || group > kPrefillRows) return -1;
    const int tokens_per_tile = kPrefillRows / group;
    struct Task { int seq, head, first, count; };
    std::vector<Task> tasks;
    for (int i = 0; i < num_prefills; i++) {
        const int seq = prefill_seqs[i];
        const int query_len = query_start_loc[seq + 1] - query_start_loc[seq];
        for (int h = 0; h < num_kv_heads; h++)
            for (int first = 0; first < query_len; first += tokens_per_tile)
                tasks.push_back({seq, h, first, query_len - first < tokens_per_tile ? query_len - first : tokens_per_tile});
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (tasks.size() > 1)
    for (size_t i = 0; i < tasks.size(); i++) {
        const Task& task = tasks[i];
        const int query_len = query_start_loc[task.seq + 1] - query_start_loc[task.seq];
        const int64_t token = query_start_loc[task.seq] + task.first;
        const CacheView cache = {key_cache + task.head * cache_head_stride, value_cache + task.head * cache_head_stride,
                                 cache_block_stride, cache_slot_stride, block_size};
        const Variant variant = {sliding_window, logits_soft_cap, sinks ? sinks + task.head * group : nullptr};
        run(query + token * query_token_stride + (int64_t)task.head * group * query_head_stride, query_token_stride,
            query_head_stride, cache, block_tables + (int64_t)task.seq * block_table_stride,
            seq_lens[task.seq] - query_len + task.first, task.count, group, scale, variant,
            out + token * out_token_stride + (int64_t)task.head * group * out_head_stride, out_token_stride,
            out_head_stride);
    }
    return 0;
}
}  // extern "C"
