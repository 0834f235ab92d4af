"""The float sides of the int8 (W8A8) linear layer: per-row symmetric quantization of
activations, and the epilogue that scales the int32 GEMM result back to floats (the GEMM is
torch._int_mm). On the CPU a C++ loop each (int8_linear.cpp, built on first use): torch's
own ops take five passes over the rows to quantize them and three for the epilogue, which
on BERT-base cost a third as much as the int8 GEMMs. Elsewhere, and as the oracle, torch."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from actors.config import cache_dir
from kernels._native import load_library

INT8_MAX = 127.0


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (q [rows, cols] int8, scale [rows, 1] float32), x ≈ q * scale.
    An all-zero row gets scale 1 (and zeros), never a division by zero."""
    absmax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    return torch.round(x.float() / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_reference(accumulated: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                         bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = accumulated * row_scale * col_scale (+ bias), in out's dtype."""
    torch.mul(accumulated, row_scale, out=out)
    out.mul_(col_scale)
    if bias is not None:
        out.add_(bias)


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = load_library("int8_linear", os.path.join(cache_dir(), "kernels"))
    if library is not None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        library.quantize_rows_f32.restype = None
        library.quantize_rows_f32.argtypes = [pointer, size, size, size, pointer, pointer]
        library.dequantize_int32_f32.restype = None
        library.dequantize_int32_f32.argtypes = [pointer, size, size, pointer, pointer, pointer, pointer, size]
    return library


def load_kernels() -> bool:
    """Builds (once per machine) and loads the C++ library now; whether it is there."""
    return _library() is not None


def _native(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The C++ library when every tensor is a float32 (or int32) CPU tensor it can read."""
    if any(t.device.type != "cpu" for t in tensors):
        return None
    return _library()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_reference's result, in one pass on the CPU."""
    library = _native(x)
    if library is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        return quantize_rows_reference(x)
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, 1, dtype=torch.float32)
    library.quantize_rows_f32(x.data_ptr(), rows, cols, x.stride(0), q.data_ptr(), scale.data_ptr())
    return q, scale


def dequantize(accumulated: torch.Tensor,  # [rows, cols] int32, contiguous
               row_scale: torch.Tensor,  # [rows, 1] float32
               col_scale: torch.Tensor,  # [cols] float32
               bias: torch.Tensor | None,  # [cols]
               out: torch.Tensor,  # [rows, cols], rows may be strided
               ) -> None:
    """dequantize_reference, in one pass on the CPU."""
    library = _native(accumulated, out)
    if (library is None or out.dtype != torch.float32 or out.stride(1) != 1 or not accumulated.is_contiguous()
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        dequantize_reference(accumulated, row_scale, col_scale, bias, out)
        return
    rows, cols = accumulated.shape
    library.dequantize_int32_f32(accumulated.data_ptr(), rows, cols, row_scale.contiguous().data_ptr(),
                                 col_scale.contiguous().data_ptr(), 0 if bias is None else bias.data_ptr(),
                                 out.data_ptr(), out.stride(0))
