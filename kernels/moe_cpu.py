"""Fused mixture-of-experts on the CPU: kernels/moe_cpu.cpp through ctypes, and the three
kinds of expert weights it multiplies: float32 (packed in its panels, or rows as they are),
GGUF blocks as the file has them (with gguf_gemm.cpp's int8 tiles per expert where the CPU
has VNNI, as dense GGUF layers), int8 W8A8 packed per expert. Semantics and the oracle:
kernels/fused_moe_ref.py.

A model builds an ExpertWeights once per MoE layer at load (fp32_experts, gguf_experts or
int8_experts) and calls MoeCpuKernels.fused_experts with the router's output each step. The
C++ entry point moe_experts_f32 and its MoeExperts struct are also what a fused C++ step
would call, through the addresses here, as model_step_f32 calls the GGUF linear.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, field

import torch

from actors.config import cache_dir
from kernels._native import load_library

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
FEW_ROWS = 16  # CpuBackend.few_rows' default: float32 rows of up to this many tokens skip sgemm
# GGUF experts on their blocks alone (no int8 tiles: tiles=False, or no VNNI): up to this many
# rows of an expert take the int8 block dot products, past it dequantized tiles and sgemm. A dense layer switches past 8 (kernels/gguf_linear.py), but an
# expert's few rows amortize a tile's dequantization less: one layer of 32 Q4_0 experts
# (1024 x 256, top-8, batch 64: ~16 rows each, one thread) took 12.7 ms at 8, 11.2 at 16,
# 10.0 at 32 and 9.9 at 64 (Q8_0: 13.8, 12.1, 10.9, 10.9); sgemm is kept for prefill chunks
MOE_DEQUANTIZE_ROWS = 32
PACKED_F32 = 2048  # moe_cpu.cpp's kPackedF32: float32 weights in its panels of 16 output columns
_PANEL = 16


class MoeExpertsStruct(ctypes.Structure):
    """moe_cpu.cpp's MoeExperts."""

    _fields_ = [(name, _i64) for name in ("num_experts", "hidden_size", "intermediate_size", "w13_type",
                                          "w2_type")] + [
        (name, _ptr) for name in ("w13", "w2", "few_rows_linear", "sgemm", "quant_linear")] + [
        ("few_rows", _i64), ("dequantize_rows", _i64)]


@dataclass
class ExpertWeights:
    """One MoE layer's experts as moe_cpu.cpp reads them: per-expert pointers to each
    expert's w13 ([2I, H]: gate rows, then up rows) and w2 ([H, I]) weights, of a type each
    (0: float32 rows; PACKED_F32: float32 panels; else the quantized linear's type id: a ggml
    type, or int8's), and the objects that own that memory."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    w13_type: int
    w2_type: int
    w13_pointers: torch.Tensor  # [num_experts] int64: addresses
    w2_pointers: torch.Tensor  # [num_experts] int64
    quant_linear: int | None  # the address of the QuantLinear for types != 0
    dequantize_rows: int = 1 << 62
    owners: tuple = field(default=(), repr=False)  # what the addresses point into: kept alive here

    def num_bytes(self) -> int:
        """The bytes of the experts' weights as the kernel reads them (GGUF: blocks and tiles)."""
        return sum(t.num_bytes() if hasattr(t, "num_bytes") else t.numel() * t.element_size() for t in self.owners)


def _addresses(stacked: torch.Tensor) -> torch.Tensor:
    """Each expert's first byte in a contiguous [num_experts, ...] tensor."""
    assert stacked.is_contiguous() and stacked.device.type == "cpu"
    step = stacked.stride(0) * stacked.element_size()
    return torch.arange(stacked.shape[0], dtype=torch.int64) * step + stacked.data_ptr()


def fp32_experts(w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden] float32
                 w2: torch.Tensor,  # [num_experts, hidden, intermediate] float32
                 packed: bool = True,
                 ) -> ExpertWeights:
    """packed: each expert's weights copied at load into moe_cpu.cpp's panels (its fast
    kernel at every batch; the caller may drop w13 and w2); else read in place, as rows (the
    few-rows kernel and sgemm, as a dense layer)."""
    num_experts, two_i, hidden = w13.shape
    assert w13.dtype == w2.dtype == torch.float32 and w2.shape == (num_experts, hidden, two_i // 2)
    w13, w2 = w13.contiguous(), w2.contiguous()
    if packed:
        kernels = moe_cpu_kernels()
        if kernels is None:
            raise RuntimeError("the C++ kernels did not build (no C++ compiler?)")
        w13, w2 = kernels.pack(w13), kernels.pack(w2)
    weight_type = PACKED_F32 if packed else 0
    return ExpertWeights(num_experts, hidden, two_i // 2, weight_type, weight_type, _addresses(w13), _addresses(w2),
                         None, owners=(w13, w2))


def gguf_experts(w13_blocks: torch.Tensor,  # [num_experts, 2 * intermediate, row bytes of hidden] uint8
                 w13_type: int,  # ggml's type id of those blocks
                 w2_blocks: torch.Tensor,  # [num_experts, hidden, row bytes of intermediate] uint8
                 w2_type: int,
                 hidden_size: int, intermediate_size: int,
                 tiles: bool | None = None) -> ExpertWeights:
    """A GGUF file's ffn_gate_exps and ffn_up_exps (each [E, I, row bytes], concatenated per
    expert along the rows, gate first) and ffn_down_exps, multiplied as blocks. tiles (None:
    where the CPU has AVX-512 VNNI): each expert's weights also unpacked into gguf_gemm.cpp's
    int8 tiles (1 byte a weight, d and c per block), which multiply 2 rows and more as a
    dense GGUF layer's batches do; else every row count goes to the file's blocks."""
    from kernels.gguf_gemm import gguf_tiled_kernels
    from kernels.gguf_linear import gguf_kernels

    kernels = gguf_kernels()
    if kernels is None:
        raise RuntimeError("the GGUF kernels did not build (no C++ compiler?)")
    num_experts = w13_blocks.shape[0]
    assert w13_blocks.dtype == w2_blocks.dtype == torch.uint8
    assert w13_blocks.shape == (num_experts, 2 * intermediate_size, kernels.row_bytes(w13_type, hidden_size))
    assert w2_blocks.shape == (num_experts, hidden_size, kernels.row_bytes(w2_type, intermediate_size))
    assert kernels.row_bytes(w13_type, hidden_size) > 0 and kernels.row_bytes(w2_type, intermediate_size) > 0
    w13_blocks, w2_blocks = w13_blocks.contiguous(), w2_blocks.contiguous()
    tiled = gguf_tiled_kernels() if tiles is not False else None
    if tiles and tiled is None:
        raise RuntimeError("the GGUF int8 tiles need AVX-512 VNNI and their kernels built")
    if tiled is None:
        return ExpertWeights(num_experts, hidden_size, intermediate_size, w13_type, w2_type, _addresses(w13_blocks),
                             _addresses(w2_blocks), kernels.linear_address, MOE_DEQUANTIZE_ROWS,
                             owners=(w13_blocks, w2_blocks))
    # descriptors (GGUFTiles), whose QuantLinear takes its type from them; Q6_K has no tiles
    # (scales per 16 weights) and its descriptor sends every row count to the blocks
    w13_tiles = [tiled.tiles(w13_blocks[e], w13_type, hidden_size) for e in range(num_experts)]
    w2_tiles = [tiled.tiles(w2_blocks[e], w2_type, intermediate_size) for e in range(num_experts)]
    pointers = [torch.tensor([t.address for t in group], dtype=torch.int64) for group in (w13_tiles, w2_tiles)]
    return ExpertWeights(num_experts, hidden_size, intermediate_size, w13_type, w2_type, *pointers,
                         tiled.linear_address, MOE_DEQUANTIZE_ROWS, owners=(w13_blocks, w2_blocks, *w13_tiles, *w2_tiles))


def int8_experts(w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden] float
                 w2: torch.Tensor,  # [num_experts, hidden, intermediate] float
                 ) -> ExpertWeights:
    """Each expert's projections quantized per output channel and packed (int8_gemm.cpp's
    layout), as `--quantization int8` packs a dense layer; activations per row at each call."""
    from kernels.int8_gemm import INT8_WEIGHT_TYPE, int8_gemm_kernels

    kernels = int8_gemm_kernels()
    if kernels is None:
        raise RuntimeError("the int8 kernels did not build (no C++ compiler?)")
    num_experts, two_i, hidden = w13.shape
    packed13 = [kernels.pack(w13[e]) for e in range(num_experts)]
    packed2 = [kernels.pack(w2[e]) for e in range(num_experts)]
    pointers = [torch.tensor([p.data_ptr() for p in packed], dtype=torch.int64) for packed in (packed13, packed2)]
    return ExpertWeights(num_experts, hidden, two_i // 2, INT8_WEIGHT_TYPE, INT8_WEIGHT_TYPE, *pointers,
                         kernels.linear_address, owners=(*packed13, *packed2))


class MoeCpuKernels:
    """moe_cpu.cpp's entry point, arguments checked here."""

    def __init__(self, library: ctypes.CDLL, few_rows_linear: int, sgemm: int | None) -> None:
        self._experts = library.moe_experts_f32
        self._experts.restype = _i32
        self._experts.argtypes = [ctypes.POINTER(MoeExpertsStruct), _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64,
                                  _i32]
        self._pack = library.moe_pack_f32
        self._pack.restype = None
        self._pack.argtypes = [_ptr, _i64, _i64, _ptr]
        self.address = ctypes.cast(self._experts, ctypes.c_void_p).value  # for a fused C++ step
        self.few_rows_linear = few_rows_linear  # cpu_kernels.cpp's linear_few_rows_f32
        self.sgemm = sgemm

    def pack(self, weights: torch.Tensor) -> torch.Tensor:  # [num_experts, out, in] float32
        """Each expert's [out, in] as moe_cpu.cpp's panels: [num_experts, ceil(out / 16), in, 16]."""
        num_experts, out_features, in_features = weights.shape
        num_panels = -(-out_features // _PANEL)
        packed = torch.empty(num_experts, num_panels, in_features, _PANEL, dtype=torch.float32)
        for e in range(num_experts):
            self._pack(weights[e].data_ptr(), out_features, in_features, packed[e].data_ptr())
        return packed

    @property
    def experts_address(self) -> int:
        """moe_experts_f32's address, for a fused C++ step (cpu_model_step.h's MoeExpertsFn)."""
        return ctypes.cast(self._experts, ctypes.c_void_p).value

    def describe(self, experts: ExpertWeights, few_rows: int = FEW_ROWS,
                 dequantize_rows: int | None = None) -> MoeExpertsStruct:
        """The struct the C++ reads; it points into experts, which must outlive it."""
        return MoeExpertsStruct(
            experts.num_experts, experts.hidden_size, experts.intermediate_size, experts.w13_type, experts.w2_type,
            experts.w13_pointers.data_ptr(), experts.w2_pointers.data_ptr(), self.few_rows_linear, self.sgemm,
            experts.quant_linear, few_rows, experts.dequantize_rows if dequantize_rows is None else dequantize_rows)

    def fused_experts(self, x: torch.Tensor,  # [num_tokens, hidden] float32
                      experts: ExpertWeights,
                      topk_weights: torch.Tensor,  # [num_tokens, top_k]
                      topk_ids: torch.Tensor,  # [num_tokens, top_k] int32 or int64; -1: on another rank
                      few_rows: int = FEW_ROWS,
                      dequantize_rows: int | None = None,  # GGUF: past this many rows per expert, sgemm
                      out: torch.Tensor | None = None,  # [num_tokens, hidden] float32, rows may be strided
                      ) -> torch.Tensor:
        """fused_experts_ref's result (quantized weights: with the activations quantized as
        the quantized linear quantizes them)."""
        num_tokens, hidden = x.shape
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
        assert hidden == experts.hidden_size and topk_ids.shape == topk_weights.shape
        assert topk_ids.shape[0] == num_tokens
        ids = topk_ids.to(torch.int32).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        if out is None:
            out = torch.empty(num_tokens, hidden, dtype=torch.float32)
        assert out.shape == (num_tokens, hidden) and out.dtype == torch.float32 and out.stride(1) == 1
        if num_tokens == 0:
            return out
        struct = self.describe(experts, few_rows, dequantize_rows)
        status = self._experts(ctypes.byref(struct), x.data_ptr(), x.stride(0), num_tokens, ids.data_ptr(),
                               weights.data_ptr(), ids.shape[1], out.data_ptr(), out.stride(0),
                               torch.get_num_threads())
        if status == -2:
            raise ValueError(f"an expert id outside [-1, {experts.num_experts})")
        assert status == 0, f"moe_experts_f32 returned {status}"
        return out


@functools.cache
def moe_cpu_kernels() -> MoeCpuKernels | None:
    """The kernels, built on first use into the cache directory (with cpu_kernels.cpp, whose
    few-rows linear they call); None without a C++ compiler."""
    from kernels.cpu_kernels import torch_sgemm

    build_dir = os.path.join(cache_dir(), "kernels")
    library, cpu = load_library("moe_cpu", build_dir), load_library("cpu_kernels", build_dir)
    if library is None or cpu is None:
        return None
    few_rows_linear = ctypes.cast(cpu.linear_few_rows_f32, ctypes.c_void_p).value
    return MoeCpuKernels(library, few_rows_linear, torch_sgemm())
