"""Which kernels a model step runs, and the per-step attention metadata they share.

The torch backend (the CPU path) runs each kernel's plain-torch reference; the paged
attention bookkeeping is planned once per step and reused by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention import PagedAttentionPlan, paged_attention_planned, plan_paged_attention
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import rotary_ref
from kernels.silu_mul import silu_mul_ref
from kernels.store_kv import store_kv_ref


@dataclass
class StepAttention:
    """Attention inputs of one step, in the flat token order of the batch."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens in the cache after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    plan: PagedAttentionPlan | None = None  # the torch backend's precomputed bookkeeping


class TorchBackend:
    """Plain-torch kernels: the CPU path and the oracle of the Triton kernels."""

    name = "torch"
    rms_norm = staticmethod(rms_norm_ref)
    rotary = staticmethod(rotary_ref)
    silu_mul = staticmethod(silu_mul_ref)
    store_kv = staticmethod(store_kv_ref)

    def prepare(self, attention: StepAttention, block_size: int, dtype: torch.dtype) -> None:
        attention.plan = plan_paged_attention(attention.block_tables, attention.seq_lens,
                                              attention.query_start_loc, block_size, dtype)

    def attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  step: StepAttention, scale: float) -> torch.Tensor:
        return paged_attention_planned(query, key_cache, value_cache, step.plan, scale)


AttentionBackend = TorchBackend


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks Triton on CUDA and torch on the CPU."""
    if name in ("auto", "torch"):
        return TorchBackend()
    raise ValueError(f"attention_backend must be 'auto' or 'torch', got {name!r}")
