"""The CPU's paged attention and KV store, fast paths whose oracle is the reference
(paged_attention_ref, store_kv_ref):

- decodes: cpu_kernels.cpp reads each decode's keys and values once, in place
  through its block table, for all query heads of a kv head, with an online softmax.
  Batched torch ops pay either a gather copy of the batch's KV or thousands of tiny
  matmuls: measured at 64 decodes of ~220 tokens, the reference's block-by-block decode
  took 2.5x the kernel's time per layer, the kernel about the time of reading the KV.
  Without a C++ compiler, or for another dtype than fp32, decodes take the reference's way.
- prefill chunks: cpu_kernels.cpp's paged_prefill_f32, all chunks of the step in one call,
  reading keys and values in place through the block tables (this step's already stored),
  tiles of query rows against 64 transposed keys at a time: for a step of 13 prompts of
  64-256 tokens 2.1x less time than a scaled_dot_product_attention per prompt, for 1000-2000
  tokens 1.15x (benchmarks/cpu_prefill_attention.py). Without the C++ kernels: one
  scaled_dot_product_attention per whole prompt (over this step's own keys and values,
  which are what the cache holds for it), and a chunk after a cached prefix gathers its
  blocks as the reference does.
- store_kv: one row copy per token and kv head (cpu_kernels.cpp's store_kv_f32).

The attention variants (a sliding window, a logit soft cap, sinks, the scale: see
paged_attention_ref's docstring) are per call, as a model's layers differ: one plan serves
every layer of the step, windowed or not (the reference's decodes, where they run, plan
each window once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.cpu_kernels import NativeKernels
from kernels.paged_attention_ref import (PagedAttentionPlan, PrefillChunk, SequenceSplit, check_variant,
                                         decode_attention, plan_decodes, prefill_attention, prefill_chunks)
from kernels.store_kv import store_kv_ref


@dataclass
class CpuAttentionPlan:
    """A step's bookkeeping, shared by all layers."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    decode_seqs: torch.Tensor  # [num_decodes] int32
    prefill_seqs: torch.Tensor  # [num_prefills] int32: sequences with several query tokens
    host: SequenceSplit  # seq_lens, query_start_loc and the split on the host
    prefills: list[PrefillChunk]
    block_size: int
    # made when a decode takes the reference's way, one per sliding window (None: none)
    reference: dict[int | None, PagedAttentionPlan] = field(default_factory=dict)


def plan_paged_attention_cpu(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    block_size: int,
    host: SequenceSplit | None = None,  # the same on the host, split; else read off the tensors
) -> CpuAttentionPlan:
    if host is None:
        host = SequenceSplit.from_device(seq_lens, query_start_loc)
    return CpuAttentionPlan(block_tables, seq_lens, query_start_loc, torch.tensor(host.decode_seqs, dtype=torch.int32),
                            torch.tensor(host.prefill_seqs, dtype=torch.int32), host,
                            prefill_chunks(block_tables, host, block_size), block_size)


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]: this step's keys, already stored
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]: this step's values, already stored
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    plan: CpuAttentionPlan,
    scale: float | None,  # None: head_size ** -0.5
    native: NativeKernels | None,
    *,
    sliding_window: int | None = None,  # see paged_attention_ref's docstring for these
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] fp32
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """paged_attention_ref's result (to fp32 rounding)."""
    check_variant(query.shape[1], sliding_window, logits_soft_cap, sinks)
    if scale is None:
        scale = query.shape[2] ** -0.5
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    variant = dict(logits_soft_cap=logits_soft_cap, sinks=sinks)
    in_native = native is not None and native.supports_attention(query, key_cache)
    if plan.decode_seqs.numel():
        if in_native:
            native.decode(query, key_cache, value_cache, plan.block_tables, plan.seq_lens, plan.query_start_loc,
                          plan.decode_seqs, scale, out, sliding_window=sliding_window, **variant)
        else:
            reference = _reference_plan(plan, query.dtype, sliding_window)
            out[reference.decode_query_index] = decode_attention(query, key_cache, value_cache, reference, scale,
                                                                 **variant)
    if plan.prefills and in_native:
        native.prefill(query, key_cache, value_cache, plan.block_tables, plan.seq_lens, plan.query_start_loc,
                       plan.prefill_seqs, scale, out, sliding_window=sliding_window, **variant)
        return out
    plain = sliding_window is None and logits_soft_cap is None and sinks is None
    for chunk in plan.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        if chunk.query_len == chunk.seq_len and plain:
            out[rows] = _causal_attention(query[rows], key[rows], value[rows], scale)
        else:
            out[rows] = prefill_attention(query[rows], key_cache, value_cache, chunk, scale,
                                          sliding_window=sliding_window, **variant)
    return out


def store_kv_cpu(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, native: NativeKernels | None) -> None:
    """store_kv_ref's writes."""
    if native is not None and key.dtype == key_cache.dtype == torch.float32:
        native.store_kv(key, value, key_cache, value_cache, slot_mapping)
    else:
        store_kv_ref(key, value, key_cache, value_cache, slot_mapping)


def _causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    # [tokens, heads, head_size] -> [1, heads, tokens, head_size] views and back
    out = F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), key.transpose(0, 1).unsqueeze(0),
                                         value.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def _reference_plan(plan: CpuAttentionPlan, dtype: torch.dtype, sliding_window: int | None) -> PagedAttentionPlan:
    if sliding_window not in plan.reference:
        decodes = plan_decodes(plan.block_tables, plan.seq_lens, plan.host, plan.block_size, dtype, sliding_window)
        plan.reference[sliding_window] = PagedAttentionPlan(prefills=plan.prefills, sliding_window=sliding_window,
                                                            **decodes)
    return plan.reference[sliding_window]
