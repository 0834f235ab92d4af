"""Attention of a flat batch of prefill chunks and decodes over the paged KV cache, in
Triton (the GPU's path): the launcher, which checks the inputs, sizes the grids and
launches the kernels of kernels/paged_attention_triton.py. Same inputs and result as
paged_attention_ref (kernels/paged_attention_ref.py), which is its oracle and the CPU's
torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import cdiv, dot_in_fp32, next_power_of_2
from kernels.paged_attention_ref import SequenceSplit, check_variant
from kernels.paged_attention_triton import _paged_decode_kernel, _paged_decode_reduce_kernel, _paged_prefill_kernel


@dataclass(frozen=True)
class PagedAttentionLaunch:
    """What a step's launches need besides the attention inputs, computed once per step
    (paged_attention_launch) and shared by all layers: the grid sizes, which are host
    numbers, and which sequences each kernel takes."""

    decode_seqs: torch.Tensor  # [num_decodes] int32: sequences with one query token
    prefill_seqs: torch.Tensor  # [num_prefills] int32: sequences with more
    max_query_len: int  # longest prefill chunk (0: none)
    max_decode_seq_len: int  # longest sequence among the decodes (0: none)
    decode_partition_size: int = 512  # keys per split of a decode: a power of two >= 16


_DECODE_BLOCK_N = 64  # keys per iteration of the decode kernel (fewer if the partition is smaller)
_PREFILL_BLOCK_M = 64  # queries per prefill program
_PREFILL_BLOCK_N = 64  # keys per iteration of the prefill kernel
_LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); the kernels take scale * log2(e)


def paged_attention_launch(
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    decode_partition_size: int = 512,
    host: SequenceSplit | None = None,  # the same on the host, split; else read off the device (a sync)
    decode_seqs: torch.Tensor | None = None,  # host.decode_seqs already on the device; else copied here
    prefill_seqs: torch.Tensor | None = None,  # host.prefill_seqs likewise
) -> PagedAttentionLaunch:
    assert decode_partition_size >= 16 and decode_partition_size & (decode_partition_size - 1) == 0
    if host is None:
        host = SequenceSplit.from_device(seq_lens, query_start_loc)
    starts = host.query_start_loc

    def on_device(seqs: list[int]) -> torch.Tensor:
        return torch.tensor(seqs, dtype=torch.int32).to(seq_lens.device, non_blocking=True)

    return PagedAttentionLaunch(
        decode_seqs=on_device(host.decode_seqs) if decode_seqs is None else decode_seqs,
        prefill_seqs=on_device(host.prefill_seqs) if prefill_seqs is None else prefill_seqs,
        max_query_len=max((starts[seq + 1] - starts[seq] for seq in host.prefill_seqs), default=0),
        max_decode_seq_len=max((host.seq_lens[seq] for seq in host.decode_seqs), default=0),
        decode_partition_size=decode_partition_size)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: tokens in the cache, this step's included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: cumulative query lengths
    scale: float | None = None,  # None: head_size ** -0.5
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size]
    launch: PagedAttentionLaunch | None = None,  # from paged_attention_launch; else made here
    *,
    sliding_window: int | None = None,  # see paged_attention_ref's docstring for these
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] fp32
) -> torch.Tensor:
    """paged_attention_ref's result, from the Triton kernels. One launch (per step) serves
    every layer, windowed or not: a window sizes the decodes' grid itself."""
    num_tokens, num_heads, head_size = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], key_cache.shape[1]
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape and key_cache.shape[3] == head_size
    assert key_cache.dtype == value_cache.dtype == query.dtype
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
    assert seq_lens.dtype == query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,)
    assert block_tables.stride(1) == 1 and seq_lens.is_contiguous() and query_start_loc.is_contiguous()
    # the last dimension of each is contiguous; the others may be strided
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and key_cache.stride() == value_cache.stride()
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1
    check_variant(num_heads, sliding_window, logits_soft_cap, sinks)
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.device == query.device
    if num_tokens == 0:
        return out
    if launch is None:
        launch = paged_attention_launch(seq_lens, query_start_loc)
    tables = (block_tables, seq_lens, query_start_loc)
    variant = _Variant(sinks if sinks is not None else out, scale if scale is not None else head_size**-0.5,
                       logits_soft_cap, sliding_window, sinks is not None)
    if launch.max_decode_seq_len:
        _launch_decodes(query, key_cache, value_cache, tables, out, variant, launch)
    if launch.max_query_len:
        grid = (cdiv(launch.max_query_len, _PREFILL_BLOCK_M), launch.prefill_seqs.numel(), num_heads)
        _paged_prefill_kernel[grid](
            query, key_cache, value_cache, *tables, launch.prefill_seqs, out, *variant.arguments(),
            *_strides(query, key_cache, block_tables, out), head_size,
            BLOCK_M=_PREFILL_BLOCK_M, BLOCK_N=_PREFILL_BLOCK_N, **_shape_constants(query, key_cache),
            **variant.constants(),
            # fp32 K/V tiles are twice as big: three stages of them may not fit in shared memory
            num_stages=2 if query.element_size() == 4 else 3)
    return out


@dataclass(frozen=True)
class _Variant:
    """A call's attention variant as the kernels take it: runtime values, constexpr switches."""

    sinks: torch.Tensor  # [num_heads] fp32 (any tensor where there are none: never read)
    scale: float
    logits_soft_cap: float | None
    sliding_window: int | None
    has_sinks: bool

    def arguments(self) -> tuple:  # sinks_ptr, scale_log2, soft_cap_log2, sliding_window
        return (self.sinks, self.scale * _LOG2_E, (self.logits_soft_cap or 1.0) * _LOG2_E, self.sliding_window or 0)

    def constants(self) -> dict:
        return dict(SLIDING=self.sliding_window is not None, SOFT_CAP=self.logits_soft_cap is not None,
                    HAS_SINKS=self.has_sinks)


def _strides(query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
             out: torch.Tensor) -> tuple[int, ...]:
    return (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0))


def _shape_constants(query: torch.Tensor, key_cache: torch.Tensor) -> dict:
    return dict(GROUP=query.shape[1] // key_cache.shape[1], BLOCK_D=max(16, next_power_of_2(query.shape[2])),
                BLOCK_SIZE=key_cache.shape[2], DOT_IN_FP32=dot_in_fp32(query.dtype, query.device),
                INPUT_PRECISION="ieee" if query.dtype == torch.float32 else None)


def _launch_decodes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    tables: tuple[torch.Tensor, ...], out: torch.Tensor, variant: _Variant,
                    launch: PagedAttentionLaunch) -> None:
    num_decodes, (_, num_heads, head_size) = launch.decode_seqs.numel(), query.shape
    num_kv_heads, partition = key_cache.shape[1], launch.decode_partition_size
    # a window's splits cover its keys only: the grid is the window's however long the context
    num_keys = min(launch.max_decode_seq_len, variant.sliding_window or launch.max_decode_seq_len)
    num_splits = cdiv(num_keys, partition)
    if num_splits == 1:  # the decode kernel writes out itself; no partial buffers
        partial_out = partial_max = partial_sum = out
    else:
        partial_out = torch.empty(num_decodes, num_heads, num_splits, head_size, dtype=torch.float32,
                                  device=query.device)
        partial_max = torch.empty(num_decodes, num_heads, num_splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    constants = _shape_constants(query, key_cache)
    _paged_decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        query, key_cache, value_cache, *tables, launch.decode_seqs, out, partial_out, partial_max, partial_sum,
        *variant.arguments(), *_strides(query, key_cache, tables[0], out), num_heads, head_size,
        BLOCK_G=max(16, next_power_of_2(constants["GROUP"])), BLOCK_N=min(_DECODE_BLOCK_N, partition),
        PARTITION_SIZE=partition, NUM_SPLITS=num_splits, **constants, **variant.constants())
    if num_splits > 1:
        _paged_decode_reduce_kernel[(num_decodes, num_heads)](
            out, partial_out, partial_max, partial_sum, *tables[1:], launch.decode_seqs, variant.sinks,
            variant.sliding_window or 0, out.stride(0), out.stride(1), num_heads, head_size,
            PARTITION_SIZE=partition, NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits),
            BLOCK_D=constants["BLOCK_D"], SLIDING=variant.sliding_window is not None, HAS_SINKS=variant.has_sinks)
