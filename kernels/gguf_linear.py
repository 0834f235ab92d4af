"""GGUF block-quantized linear layers on the CPU: gguf_linear.cpp through ctypes, and the
plain-torch reference the tests hold it to (the gguf package's dequantization of the same
blocks, x quantized per block of 32 as the kernel quantizes it)."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from actors.config import cache_dir
from kernels._native import load_library

BLOCK = 32  # elements per block, in every type here
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml's type ids (gguf.GGMLQuantizationType): actors/quantization/gguf_types.py
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = 6, 7, 12, 13, 14  # decoded a row at a time (kernels/gguf_decoded.h)
U8X16 = 200  # troupe's own: those decoded, 16 bytes u + float32 D and C per 16 weights (gguf_decoded.h)
# Past this many rows a linear dequantizes tiles of its weights and calls sgemm: measured on
# SmolLM2's Q4_1 projections (one thread, best of 5; the 2-core Xeon, AVX-512 VNNI), the dot
# products took 21 ms for 4 rows (fp32 35), even with the tiles at 8 rows, and at 64 rows
# 259 ms against 145 (fp32 148): vpdpbusd pays a convert, a scale and an add per 64 products
# where sgemm's fp32 FMAs pay nothing, and dequantizing a tile costs little against its sgemm
DEQUANTIZE_ROWS = 8

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def bind_linear(function) -> tuple[object, int]:
    """A C linear of gguf_linear.cpp's signature (gguf_gemm.cpp's has the same), typed, and its address."""
    function.restype = _i32
    function.argtypes = [_i32, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i32]
    return function, ctypes.cast(function, ctypes.c_void_p).value


class GGUFKernels:
    """gguf_linear.cpp's entry points, arguments checked here."""

    def __init__(self, library: ctypes.CDLL, sgemm: int | None) -> None:
        self.sgemm = sgemm  # torch's sgemm (kernels.cpu_kernels.torch_sgemm), or None: dot products only
        self.dequantize_rows = DEQUANTIZE_ROWS
        # the function, and its address, which model_step_f32 calls (DecoderShape.quant_linear)
        self._linear, self.linear_address = bind_linear(library.gguf_linear_f32)
        self._row_bytes = library.gguf_row_bytes
        self._row_bytes.restype = _i64
        self._row_bytes.argtypes = [_i32, _i64]
        self._decode_rows = library.gguf_decode_rows
        self._decode_rows.restype = _i32
        self._decode_rows.argtypes = [_i32, _ptr, _i64, _i64, _ptr]
        library.gguf_linear_uses_vnni.restype = _i32
        self.uses_vnni = bool(library.gguf_linear_uses_vnni())

    def row_bytes(self, ggml_type: int, in_features: int) -> int:
        """Bytes of a weight row; 0 where there is no kernel for the type (or in_features % 32)."""
        return self._row_bytes(ggml_type, in_features)

    def decode_rows(self, blocks: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
        """Q5_0/Q5_1/K-quant blocks [out, row bytes] as U8X16 blocks, without loss."""
        assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
        out = torch.empty(blocks.shape[0], in_features // 16 * 24, dtype=torch.uint8)
        status = self._decode_rows(ggml_type, blocks.data_ptr(), blocks.shape[0], in_features, out.data_ptr())
        assert status == 0, f"type {ggml_type} has no decoding to U8X16"
        return out

    def linear(self, x: torch.Tensor,  # [rows, in_features] float32
               blocks: torch.Tensor,  # [out_features, row bytes] uint8: the file's blocks
               ggml_type: int, in_features: int,
               bias: torch.Tensor | None = None,  # [out_features]
               dequantize_rows: int | None = None,
               ) -> torch.Tensor:  # [rows, out_features]
        """x @ W^T (+ bias): int8 block dot products up to dequantize_rows rows, past that
        tiles of W dequantized and torch's sgemm."""
        rows = x.shape[0]
        out_features = blocks.shape[0]
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1
        assert x.shape[1] == in_features and blocks.dtype == torch.uint8 and blocks.is_contiguous()
        assert blocks.shape[1] == self.row_bytes(ggml_type, in_features) > 0
        if bias is not None:
            assert bias.shape == (out_features,) and bias.dtype == torch.float32 and bias.is_contiguous()
        y = torch.empty(rows, out_features)
        status = self._linear(ggml_type, x.data_ptr(), x.stride(0), rows, blocks.data_ptr(), in_features,
                              out_features, bias.data_ptr() if bias is not None else None, y.data_ptr(),
                              y.stride(0), self.dequantize_rows if dequantize_rows is None else dequantize_rows, self.sgemm, torch.get_num_threads())
        assert status == 0
        return y


@functools.cache
def gguf_kernels() -> GGUFKernels | None:
    """The kernels, built on first use into the cache directory; None without a C++ compiler."""
    from kernels.cpu_kernels import torch_sgemm

    library = load_library("gguf_linear", os.path.join(cache_dir(), "kernels"))
    return GGUFKernels(library, torch_sgemm()) if library is not None else None


def quantize_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """x after a round trip through int8 blocks of 32 (dx = max|x| / 127, q = x / dx rounded
    half away from zero), in float32: what the kernel multiplies the weights with."""
    rows, in_features = x.shape
    blocks = x.float().reshape(rows, in_features // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    scaled = blocks * inverse
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (q * scale).reshape(rows, in_features)


def dequantize_reference(blocks: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    """The gguf package's dequantization of a [out, row bytes] block matrix: [out, in] float32."""
    import gguf

    if ggml_type == U8X16:  # w = D * u + C per 16 weights
        raw = blocks.numpy().reshape(blocks.shape[0], in_features // 16, 24)
        scale, offset = raw[:, :, 16:20].copy().view("float32"), raw[:, :, 20:24].copy().view("float32")
        values = raw[:, :, :16].astype("float32") * scale + offset
        return torch.from_numpy(values.reshape(blocks.shape[0], in_features))
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(ggml_type))
    return torch.from_numpy(values.reshape(blocks.shape[0], in_features).astype("float32"))


def gguf_linear_reference(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, in_features: int,
                          bias: torch.Tensor | None = None, quantize_x: bool = True) -> torch.Tensor:
    """The oracle: dequantized weights against block-quantized x (or x as it is, as the
    dequantized-sgemm path of many rows multiplies it), in float64."""
    x = quantize_rows_reference(x) if quantize_x else x
    out = x.double() @ dequantize_reference(blocks, ggml_type, in_features).double().T
    if bias is not None:
        out = out + bias.double()
    return out.float()
