"""Linear layers by quantization method (vLLM's LinearMethodBase): prepare() turns a
checkpoint weight into what the method keeps, apply() computes x @ W^T + bias with it.

Int8 (W8A8, dynamic): each weight row (output channel) is scaled to int8 by its absolute
maximum at load time; each activation row (token) the same way at run time; the int8 GEMM
(torch._int_mm: oneDNN with AVX-512 VNNI on the CPU) accumulates in int32, and the epilogue
multiplies by both scales and adds the bias in float (kernels/int8_linear.py: one C++ pass
each on the CPU). Measured on the 2-core Xeon (AVX-512 VNNI, torch 2.13, 2 threads),
BERT-base shapes: the int8 GEMM of 256 rows x 768 -> 2304 takes 0.78 ms against 3.22 ms in
fp32 (4.1x); on 4096 rows at once the int8 path gained only 1.4-2.2x, as its int32 and float
temporaries of that size leave the cache, so apply() runs row blocks of ROW_BLOCK. A whole
BERT-base forward (12 layers, 32 texts of 16-256 tokens, 4850 tokens): 1.43 s int8 against
3.0-4.5 s fp32, embeddings at cosine >= 0.9996 to fp32's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels.int8_linear import dequantize, load_kernels, quantize_rows, quantize_rows_reference

ROW_BLOCK = 256  # rows quantized, multiplied and scaled at a time (their temporaries stay in cache)


@dataclass(frozen=True)
class Int8Weight:
    """A weight quantized per output channel: weight ≈ qweight * scale[:, None]."""

    qweight: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] float32

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape


class LinearMethod(Protocol):
    name: str | None

    def prepare(self, weight: torch.Tensor) -> torch.Tensor | Int8Weight: ...

    def apply(self, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor: ...


class UnquantizedLinear:
    """The checkpoint's dtype, as it is."""

    name = None

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class Int8Linear:
    """W8A8 with dynamic per-token activation scales."""

    name = "int8"

    def __init__(self) -> None:
        # the C++ kernels are built (once per machine) now, as the engine starts: built by the
        # first request instead, on a loaded machine it waited for the compiler past the
        # client's timeout (test_bert_http[int8] failed so)
        load_kernels()

    def prepare(self, weight: torch.Tensor) -> Int8Weight:
        qweight, scale = quantize_rows_reference(weight)
        return Int8Weight(qweight.contiguous(), scale.view(-1).contiguous())

    def apply(self, x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        out = torch.empty(rows, weight.qweight.shape[0], dtype=x.dtype, device=x.device)
        # the [in, out] view of the [out, in] weight: oneDNN's fast layout (a contiguous
        # [in, out] copy multiplied 2x slower here)
        weight_t = weight.qweight.t()
        for start in range(0, rows, ROW_BLOCK):
            block = x[start:start + ROW_BLOCK]
            qx, x_scale = quantize_rows(block)
            if qx.is_cuda and qx.shape[0] <= 16:  # CUDA's _int_mm needs more than 16 rows
                qx = F.pad(qx, (0, 0, 0, 17 - qx.shape[0]))
            accumulated = torch._int_mm(qx, weight_t)[: block.shape[0]]
            dequantize(accumulated, x_scale, weight.scale, bias, out[start:start + ROW_BLOCK])
        return out


def int8_linear_reference(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The plain-torch oracle: the same per-row quantization of x, dequantized, in float64."""
    qx, x_scale = quantize_rows_reference(x)
    dequantized_x = qx.double() * x_scale.double()
    dequantized_w = weight.qweight.double() * weight.scale.double()[:, None]
    out = dequantized_x @ dequantized_w.T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def linear_method(name: str | None) -> LinearMethod:
    """The LinearMethod of a checked `--quantization` value (actors.quantization.check_quantization)."""
    if name is None:
        return UnquantizedLinear()
    if name == "int8":
        return Int8Linear()
    raise ValueError(f"no linear method for quantization {name!r}")
