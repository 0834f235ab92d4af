"""GPT-OSS's MXFP4 experts on the CPU: kernels/moe_mxfp4.cpp through ctypes. The weights
stay the checkpoint's bytes (Mxfp4Experts: blocks and scales as uint8, biases float32);
semantics, layouts and the oracle: kernels/mxfp4_ref.py."""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch

from actors.config import cache_dir
from kernels._native import load_library

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_MAX_SLOT_FLOATS = 1 << 24  # the kernel's combine buffer per call: tokens go in chunks under it (64 MiB)


@dataclass
class Mxfp4Experts:
    """One MoE layer's experts as the checkpoint has them (kernels/mxfp4_ref.py's layouts)."""

    w13_blocks: torch.Tensor  # [E, 2I, H / 32, 16] uint8: gate_up_proj_blocks, gate/up rows interleaved
    w13_scales: torch.Tensor  # [E, 2I, H / 32] uint8
    w13_bias: torch.Tensor  # [E, 2I] float32
    w2_blocks: torch.Tensor  # [E, H, I / 32, 16] uint8: down_proj_blocks
    w2_scales: torch.Tensor  # [E, H, I / 32] uint8
    w2_bias: torch.Tensor  # [E, H] float32

    def __post_init__(self) -> None:
        num_experts, two_i, blocks_h, _ = self.w13_blocks.shape
        hidden = self.w2_blocks.shape[1]
        assert self.w13_blocks.dtype == self.w2_blocks.dtype == torch.uint8, "MXFP4 blocks are uint8"
        assert self.w13_scales.shape == (num_experts, two_i, blocks_h) and blocks_h * 32 == hidden
        assert self.w2_blocks.shape == (num_experts, hidden, two_i // 64, 16)
        assert self.w2_scales.shape == self.w2_blocks.shape[:-1]
        assert self.w13_bias.shape == (num_experts, two_i) and self.w2_bias.shape == (num_experts, hidden)

    @property
    def shape(self) -> tuple[int, int, int]:  # (num_experts, hidden, intermediate)
        return self.w13_blocks.shape[0], self.w2_blocks.shape[1], self.w13_blocks.shape[1] // 2

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w13_blocks, self.w13_scales, self.w13_bias, self.w2_blocks, self.w2_scales, self.w2_bias)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device) -> Mxfp4Experts:
        """On device, contiguous; the biases in float32, the bytes as they are."""
        blocks = [t.to(device).contiguous() for t in (self.w13_blocks, self.w13_scales, self.w2_blocks,
                                                        self.w2_scales)]
        biases = [t.to(device=device, dtype=torch.float32).contiguous() for t in (self.w13_bias, self.w2_bias)]
        return Mxfp4Experts(blocks[0], blocks[1], biases[0], blocks[2], blocks[3], biases[1])


class Mxfp4Kernels:
    """moe_mxfp4.cpp's entry point, arguments checked here."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._experts = library.moe_mxfp4_f32
        self._experts.restype = _i32
        self._experts.argtypes = [_i64, _i64, _i64, *[_ptr] * 6, _f32, _f32, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr,
                                  _i64, _i32]

    def fused_experts(self, x: torch.Tensor,  # [num_tokens, hidden] float32
                      experts: Mxfp4Experts,
                      topk_weights: torch.Tensor,  # [num_tokens, top_k]
                      topk_ids: torch.Tensor,  # [num_tokens, top_k]; -1: an expert held elsewhere
                      alpha: float, limit: float) -> torch.Tensor:  # [num_tokens, hidden] float32
        """gpt_oss_experts_ref's result on the blocks as they are."""
        num_experts, hidden, intermediate = experts.shape
        num_tokens, top_k = topk_ids.shape
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.shape == (num_tokens, hidden)
        assert all(t.is_contiguous() and t.device.type == "cpu" for t in experts.tensors())
        assert experts.w13_bias.dtype == experts.w2_bias.dtype == torch.float32
        x = x.contiguous()
        ids = topk_ids.to(torch.int32).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        out = torch.empty(num_tokens, hidden, dtype=torch.float32)
        chunk = max(1, _MAX_SLOT_FLOATS // max(1, top_k * hidden))
        for first in range(0, num_tokens, chunk):
            rows = min(chunk, num_tokens - first)
            status = self._experts(
                num_experts, hidden, intermediate, *(t.data_ptr() for t in experts.tensors()), alpha, limit,
                x[first].data_ptr(), hidden, rows, ids[first].data_ptr(), weights[first].data_ptr(), top_k,
                out[first].data_ptr(), hidden, torch.get_num_threads())
            if status == -2:
                raise ValueError(f"an expert id outside [-1, {num_experts})")
            assert status == 0, f"moe_mxfp4_f32 returned {status}"
        return out


@functools.cache
def moe_mxfp4_kernels() -> Mxfp4Kernels | None:
    """The kernel, built on first use into the cache directory; None without a C++ compiler."""
    library = load_library("moe_mxfp4", os.path.join(cache_dir(), "kernels"))
    return None if library is None else Mxfp4Kernels(library)
