"""The CPU's paged attention and KV store, fast paths whose oracle is the reference
(paged_attention_ref, store_kv_ref):

- decodes: paged_attention_cpu.cpp reads each decode's keys and values once, in place
  through its block table, for all query heads of a kv head, with an online softmax.
  Batched torch ops pay either a gather copy of the batch's KV or thousands of tiny
  matmuls: measured at 64 decodes of ~220 tokens, the reference's block-by-block decode
  took 2.5x the kernel's time per layer, the kernel about the time of reading the KV.
  Without a C++ compiler, or for another dtype than fp32, decodes take the reference's way.
- prefill chunks: one scaled_dot_product_attention each. A whole prompt attends over this
  step's own keys and values, which are what the cache holds for it, so nothing is gathered
  from the cache; a chunk after a cached prefix gathers its blocks as the reference does.
- store_kv: one row copy per token and kv head (the C++ file's store_kv_f32).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels._native import load_library
from kernels.paged_attention import (PagedAttentionPlan, PrefillChunk, decode_attention, plan_decodes,
                                     prefill_attention, split_sequences)
from kernels.store_kv import store_kv_ref

_LANES = 16  # floats per vector in the C++ file: head_size must be a multiple
_MAX_GROUP = 64  # query heads per kv head the C++ file holds
_HEAD_SIZES = {16 * n for n in (1, 2, 3, 4, 5, 6, 7, 8, 16)}  # what it has code for

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class NativeKernels:
    """The C++ kernels, called through ctypes; the arguments are checked here."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._decode = library.paged_decode_f32
        self._decode.restype = _i32
        self._decode.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr,
                                 _ptr, _i32, _i32, _i32, _i32, _i32, ctypes.c_float, _ptr, _i64, _i64, _i32]
        self._store_kv = library.store_kv_f32
        self._store_kv.restype = None
        self._store_kv.argtypes = [_ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr,
                                   _i64, _i32, _i32, _i32, _i32]

    @staticmethod
    def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """Whether the kernels take these shapes and dtypes (else the reference does)."""
        return (query.dtype == key_cache.dtype == torch.float32 and query.device.type == "cpu"
                and query.shape[-1] in _HEAD_SIZES and query.shape[-2] // key_cache.shape[1] <= _MAX_GROUP)

    def decode(self, query: torch.Tensor,  # [num_tokens, num_heads, head_size]
               key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
               value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
               block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
               seq_lens: torch.Tensor,  # [num_seqs] int32
               query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
               decode_seqs: torch.Tensor,  # [num_decodes] int32: sequences with one query token
               scale: float,
               out: torch.Tensor) -> None:  # [num_tokens, num_heads, head_size]: the decodes' rows written
        num_heads, head_size = query.shape[1:]
        num_kv_heads, block_size = key_cache.shape[1:3]
        assert self.supports(query, key_cache) and value_cache.dtype == out.dtype == torch.float32
        assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
        assert query.stride(2) == key_cache.stride(3) == out.stride(2) == 1 and num_heads % num_kv_heads == 0
        assert block_tables.dtype == seq_lens.dtype == query_start_loc.dtype == decode_seqs.dtype == torch.int32
        assert block_tables.stride(1) == 1 and seq_lens.is_contiguous() and query_start_loc.is_contiguous()
        assert decode_seqs.is_contiguous()
        status = self._decode(
            query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
            *key_cache.stride()[:3], block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
            query_start_loc.data_ptr(), decode_seqs.data_ptr(), decode_seqs.numel(), num_kv_heads,
            num_heads // num_kv_heads, head_size, block_size, scale, out.data_ptr(), out.stride(0), out.stride(1),
            torch.get_num_threads())
        assert status == 0

    def store_kv(self, key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
                 value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
                 key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], written
                 value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], written
                 slot_mapping: torch.Tensor) -> None:  # [num_tokens] int64
        num_tokens, num_kv_heads, head_size = key.shape
        assert value.shape == key.shape and key.dtype == value.dtype == key_cache.dtype == torch.float32
        assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
        assert key_cache.shape[1] == num_kv_heads and key_cache.shape[3] == head_size
        assert key.stride(2) == value.stride(2) == key_cache.stride(3) == 1
        assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
        assert slot_mapping.is_contiguous()
        self._store_kv(key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), value.stride(0),
                       value.stride(1), key_cache.data_ptr(), value_cache.data_ptr(), *key_cache.stride()[:3],
                       slot_mapping.data_ptr(), num_tokens, num_kv_heads, head_size, key_cache.shape[2],
                       torch.get_num_threads())


def load_native_kernels(build_dir: str) -> NativeKernels | None:
    """The C++ kernels, built into build_dir on first use; None where they cannot be built."""
    library = load_library("paged_attention_cpu", build_dir)
    return NativeKernels(library) if library is not None else None


@dataclass
class CpuAttentionPlan:
    """A step's bookkeeping, shared by all layers."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    decode_seqs: torch.Tensor  # [num_decodes] int32
    decode_starts: list[int]  # query_start_loc on the host
    prefills: list[PrefillChunk]
    block_size: int
    reference: PagedAttentionPlan | None = field(default=None)  # made when a decode takes the reference's way


def plan_paged_attention_cpu(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    block_size: int,
) -> CpuAttentionPlan:
    decode_seqs, starts, prefills = split_sequences(block_tables, seq_lens, query_start_loc, block_size)
    return CpuAttentionPlan(block_tables, seq_lens, query_start_loc, torch.tensor(decode_seqs, dtype=torch.int32),
                            starts, prefills, block_size)


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]: this step's keys, already stored
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]: this step's values, already stored
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    plan: CpuAttentionPlan,
    scale: float,
    native: NativeKernels | None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """paged_attention_ref's result (to fp32 rounding)."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if plan.decode_seqs.numel():
        if native is not None and native.supports(query, key_cache):
            native.decode(query, key_cache, value_cache, plan.block_tables, plan.seq_lens, plan.query_start_loc,
                          plan.decode_seqs, scale, out)
        else:
            reference = _reference_plan(plan, query.dtype)
            out[reference.decode_query_index] = decode_attention(query, key_cache, value_cache, reference, scale)
    for chunk in plan.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        if chunk.query_len == chunk.seq_len:
            out[rows] = _causal_attention(query[rows], key[rows], value[rows], scale)
        else:
            out[rows] = prefill_attention(query[rows], key_cache, value_cache, chunk, scale)
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


def _reference_plan(plan: CpuAttentionPlan, dtype: torch.dtype) -> PagedAttentionPlan:
    if plan.reference is None:
        decodes = plan_decodes(plan.block_tables, plan.seq_lens, plan.decode_seqs.tolist(), plan.decode_starts,
                               plan.block_size, dtype)
        plan.reference = PagedAttentionPlan(prefills=plan.prefills, **decodes)
    return plan.reference
