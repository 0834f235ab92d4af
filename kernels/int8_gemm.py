"""The decoders' int8 W8A8 GEMM on the CPU (int8_gemm.cpp) through ctypes: weights packed
once at load into the kernel's layout, and the linear layer the fused step and the
op-by-op forward call."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from actors.config import cache_dir
from kernels._native import load_library

# DecoderLayer's weight type for a packed int8 weight (cpu_kernels.cpp dispatches every
# non-zero type to DecoderShape::quant_linear); far above ggml's type ids (< 64)
INT8_WEIGHT_TYPE = 1024
_LANES = 16

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class Int8GemmWeightStruct(ctypes.Structure):
    """int8_gemm.cpp's Int8Weight."""

    _fields_ = [("packed", _ptr), ("scale", _ptr), ("compensation", _ptr), ("in_padded", _i64),
                ("out_padded", _i64)]


class PackedInt8Weight:
    """A linear layer's weight quantized per output channel (weight ≈ qweight * scale[:, None])
    and packed for the kernel; data_ptr() is the address of the descriptor the C++ reads."""

    weight_type = INT8_WEIGHT_TYPE

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, packed: torch.Tensor,
                 compensation: torch.Tensor) -> None:
        self.qweight = qweight  # [out, in] int8: the references' (tests, the op-by-op fallback)
        self.scale = scale  # [out_padded] float32, zeros in the padding
        self.packed, self.compensation = packed, compensation
        self.in_features = qweight.shape[1]
        self.descriptor = Int8GemmWeightStruct(packed.data_ptr(), scale.data_ptr(), compensation.data_ptr(),
                                               packed.shape[1] // _LANES, packed.shape[0] * _LANES)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    # what the model's bookkeeping asks of a weight (num_weight_bytes, pointers for the C++ step)
    def numel(self) -> int:
        return self.packed.numel() + 4 * (self.scale.numel() + self.compensation.numel())

    def element_size(self) -> int:
        return 1

    def data_ptr(self) -> int:
        return ctypes.addressof(self.descriptor)


class Int8GemmKernels:
    """int8_gemm.cpp's entry points, arguments checked here."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._pack = library.int8_pack_weight
        self._pack.restype = None
        self._pack.argtypes = [_ptr, _i64, _i64, _ptr, _ptr]
        self._linear = library.int8_linear_f32
        self._linear.restype = _i32
        self._linear.argtypes = [_i32, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i32]
        # the same function, as an address model_step_f32 calls (DecoderShape.quant_linear)
        self.linear_address = ctypes.cast(library.int8_linear_f32, ctypes.c_void_p).value
        self.dequantize_rows = 1 << 62  # (the GGUF kernel's argument, unused here)
        self._gemm_int32 = library.int8_gemm_int32
        self._gemm_int32.restype = _i32
        self._gemm_int32.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i32, _i32]
        library.int8_gemm_uses_vnni.restype = _i32
        self.uses_vnni = bool(library.int8_gemm_uses_vnni())

    def pack(self, weight: torch.Tensor) -> PackedInt8Weight:
        """A float [out, in] weight quantized per output channel (as the encoders' Int8Linear
        and the torch reference do) and packed."""
        from kernels.int8_linear import quantize_rows_reference

        qweight, scale = quantize_rows_reference(weight.detach().float().cpu())
        qweight = qweight.contiguous()
        out_features, in_features = qweight.shape
        out_padded, in_padded = -(-out_features // _LANES) * _LANES, -(-in_features // 4) * 4
        packed = torch.empty(out_padded // _LANES, in_padded * _LANES, dtype=torch.uint8)
        compensation = torch.empty(out_padded, dtype=torch.int32)
        self._pack(qweight.data_ptr(), out_features, in_features, packed.data_ptr(), compensation.data_ptr())
        padded_scale = torch.zeros(out_padded)
        padded_scale[:out_features] = scale.view(-1)
        return PackedInt8Weight(qweight, padded_scale, packed, compensation)

    def linear(self, x: torch.Tensor,  # [rows, in_features] float32
               weight: PackedInt8Weight,
               bias: torch.Tensor | None = None,  # [out_features] float32
               ) -> torch.Tensor:  # [rows, out_features] float32
        """x @ Wᵀ (+ bias), x quantized per row to int8."""
        rows, in_features = x.shape
        out_features = weight.shape[0]
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
        assert in_features == weight.in_features
        if bias is not None:
            assert bias.shape == (out_features,) and bias.dtype == torch.float32 and bias.is_contiguous()
        y = torch.empty(rows, out_features)
        status = self._linear(INT8_WEIGHT_TYPE, x.data_ptr(), x.stride(0), rows, weight.data_ptr(), in_features,
                              out_features, bias.data_ptr() if bias is not None else None, y.data_ptr(),
                              y.stride(0), 0, None, torch.get_num_threads())
        assert status == 0
        return y

    def gemm_int32(self, xq: torch.Tensor, weight: PackedInt8Weight, portable: bool = False) -> torch.Tensor:
        """The int32 sums xq @ qweightᵀ of int8 rows [rows, in] (the tests' check); portable:
        the fallback loop built where VNNI is absent."""
        assert xq.dtype == torch.int8 and xq.is_contiguous() and xq.shape[1] == weight.in_features
        out = torch.empty(xq.shape[0], weight.shape[0], dtype=torch.int32)
        status = self._gemm_int32(xq.data_ptr(), xq.shape[0], xq.shape[1], weight.data_ptr(), weight.shape[0],
                                  out.data_ptr(), int(portable), torch.get_num_threads())
        assert status == 0
        return out


@functools.cache
def int8_gemm_kernels() -> Int8GemmKernels | None:
    """The kernels, built on first use into the cache directory; None without a C++ compiler."""
    library = load_library("int8_gemm", os.path.join(cache_dir(), "kernels"))
    return Int8GemmKernels(library) if library is not None else None
