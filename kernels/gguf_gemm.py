"""GGUF weights for steps of many rows: gguf_gemm.cpp's int8 register tiles through ctypes,
the weights' blocks unpacked once at load into its layout (u as bytes, d and c per block of
32), and the entry point the fused step calls for every GGUF projection (few rows go on to
gguf_linear.cpp's dot products over the file's blocks)."""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from actors.config import cache_dir
from kernels._native import load_library
from kernels.gguf_linear import BLOCK, Q4_0, Q4_1, Q8_0, U8X16, GGUFKernels, bind_linear, gguf_kernels

LANES = 16  # output channels per packed block (gguf_gemm.cpp's kLanes)
# Steps of this many rows or more run the tiles, fewer the dot products over the file's blocks.
# Measured on SmolLM2 (one thread, the loaded 2-core Xeon, ms a decode step, the dot products
# up to 8 rows against the tiles from 2 on; from 1: all tiles): 2 rows 18.9 -> 13.1, 4 rows
# 21.2 -> 14.9, 8 rows 37.7 -> 18.7; one row 14.4, or 11.2 by the tiles, which read twice the
# bytes (1.25 a weight): a single stream stays on the file's blocks, bound by memory with two
# threads on a quiet machine (9.2 ms, docs/quantization.md)
TILE_ROWS = 2
_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}  # the types read straight from their blocks

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class GGUFTilesStruct(ctypes.Structure):
    """gguf_gemm.cpp's GGUFTiles."""

    _fields_ = [("blocks", _ptr), ("type", _i64), ("few_rows", _ptr), ("packed", _ptr), ("scale", _ptr),
                ("offset", _ptr), ("out_padded", _i64), ("tile_rows", _i64)]


@dataclass(frozen=True)
class BlockParts:
    """A weight as w = d * u + c per block of 32: u [out, in] uint8, d and c [out, in / 32] float32."""

    u: torch.Tensor
    d: torch.Tensor
    c: torch.Tensor


def block_parts(blocks: torch.Tensor, ggml_type: int, in_features: int,
                kernels: GGUFKernels) -> BlockParts | None:
    """The parts of a [out, row bytes] block matrix, as the decode-row kernel reads them; None
    for a type whose scales change within a block of 32 (Q6_K's 16, U8x16 from it)."""
    out_features, num_blocks = blocks.shape[0], in_features // BLOCK
    if ggml_type in _BYTES:
        raw = blocks.numpy().reshape(out_features, num_blocks, _BYTES[ggml_type])
        d = raw[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        if ggml_type == Q8_0:  # u = q + 128, c = -128 d
            u = (raw[:, :, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            c = d * np.float32(-128.0)
        else:  # element i < 16: byte i's low nibble, 16 + i: its high one
            nibbles = raw[:, :, 4:20] if ggml_type == Q4_1 else raw[:, :, 2:18]
            u = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)
            c = raw[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32) if ggml_type == Q4_1 else \
                d * np.float32(-8.0)
    else:  # the decoded types, through their U8x16 form: 16 u, float32 D and C per 16 weights
        if ggml_type != U8X16:
            blocks = kernels.decode_rows(blocks, ggml_type, in_features)
        raw = blocks.numpy().reshape(out_features, num_blocks, 2, 24)
        scales = raw[:, :, :, 16:24].copy().view(np.uint32)  # D and C of both halves, as bits
        if not np.array_equal(scales[:, :, 0], scales[:, :, 1]):
            return None
        u = raw[:, :, :, :16].reshape(out_features, num_blocks, BLOCK)
        d, c = (raw[:, :, 0, at:at + 4].copy().view(np.float32)[:, :, 0] for at in (16, 20))
    return BlockParts(torch.from_numpy(np.ascontiguousarray(u).reshape(out_features, in_features)),
                      torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(c)))


class GGUFTiles:
    """A GGUF weight's descriptor for gguf_gemm.cpp: its file blocks (for a few rows) and, where
    its type allows, the packed tiles; address is what the fused step's weight pointer holds."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, parts: BlockParts | None, few_rows: int,
                 tile_rows: int = TILE_ROWS) -> None:
        self.blocks, self.tile_rows = blocks, tile_rows
        self.packed = self.scale = self.offset = None
        out_padded = -(-blocks.shape[0] // LANES) * LANES
        if parts is not None:
            out_features, in_features = parts.u.shape
            pad = out_padded - out_features
            u = torch.nn.functional.pad(parts.u, (0, 0, 0, pad))
            self.packed = u.view(out_padded // LANES, LANES, in_features // 4, 4).permute(0, 2, 1, 3).contiguous()
            self.scale, self.offset = (torch.nn.functional.pad(t, (0, 0, 0, pad)).view(
                out_padded // LANES, LANES, -1).permute(0, 2, 1).contiguous() for t in (parts.d, parts.c))
        pointers = [t.data_ptr() if t is not None else None for t in (self.packed, self.scale, self.offset)]
        self.descriptor = GGUFTilesStruct(blocks.data_ptr(), ggml_type, few_rows, *pointers, out_padded, tile_rows)

    def runs_tiles(self, rows: int) -> bool:
        return self.packed is not None and rows >= self.tile_rows

    @property
    def address(self) -> int:
        return ctypes.addressof(self.descriptor)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.offset) if t is not None)


class GGUFTiledKernels(GGUFKernels):
    """gguf_linear.cpp's kernels, with gguf_gemm.cpp's entry point as the fused step's
    linear_address (its weights are then GGUFTiles descriptors: actors/quantization/gguf.py)."""

    def __init__(self, library: ctypes.CDLL, sgemm: int | None, gemm_library: ctypes.CDLL) -> None:
        super().__init__(library, sgemm)
        self.few_rows_address = self.linear_address
        self._tiled, self.linear_address = bind_linear(gemm_library.gguf_gemm_linear_f32)
        self._block_sums = gemm_library.gguf_gemm_block_sums
        self._block_sums.restype = _i32
        self._block_sums.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i32]

    def tiles(self, blocks: torch.Tensor, ggml_type: int, in_features: int, tile_rows: int = TILE_ROWS) -> GGUFTiles:
        parts = block_parts(blocks, ggml_type, in_features, self)
        return GGUFTiles(blocks, ggml_type, parts, self.few_rows_address, tile_rows)

    def tiled_linear(self, x: torch.Tensor,  # [rows, in_features] float32
                     tiles: GGUFTiles, in_features: int,
                     bias: torch.Tensor | None = None,  # [out_features]
                     dequantize_rows: int | None = None,
                     ) -> torch.Tensor:  # [rows, out_features]
        """x @ W^T (+ bias): from tiles.tile_rows rows on by the tiles (where the weight has
        them), else by the block dot products (past dequantize_rows: dequantized sgemm) over the
        file's blocks."""
        rows, out_features = x.shape[0], tiles.blocks.shape[0]
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1
        assert x.shape[1] == in_features and in_features % BLOCK == 0
        if bias is not None:
            assert bias.shape == (out_features,) and bias.dtype == torch.float32 and bias.is_contiguous()
        y = torch.empty(rows, out_features)
        status = self._tiled(0, x.data_ptr(), x.stride(0), rows, tiles.address, in_features, out_features,
                             bias.data_ptr() if bias is not None else None, y.data_ptr(), y.stride(0),
                             self.dequantize_rows if dequantize_rows is None else dequantize_rows, self.sgemm,
                             torch.get_num_threads())
        assert status == 0
        return y

    def block_sums(self, xq: torch.Tensor, tiles: GGUFTiles, in_features: int) -> torch.Tensor:
        """Each block's int32 sum(u * q) of int8 rows xq [rows, in]: [rows, out, in / 32]."""
        assert xq.dtype == torch.int8 and xq.is_contiguous() and xq.shape[1] == in_features
        out = torch.zeros(xq.shape[0], tiles.blocks.shape[0], in_features // BLOCK, dtype=torch.int32)
        status = self._block_sums(xq.data_ptr(), xq.shape[0], in_features, tiles.address, tiles.blocks.shape[0],
                                  out.data_ptr(), torch.get_num_threads())
        assert status == 0, "no tiles (a type without them, or no AVX-512 VNNI)"
        return out


@functools.cache
def gguf_tiled_kernels() -> GGUFTiledKernels | None:
    """The kernels with the many-row tiles, where this CPU has AVX-512 VNNI; else None (the
    file's blocks then run as gguf_kernels() has them)."""
    base = gguf_kernels()
    if base is None or (library := load_library("gguf_gemm", os.path.join(cache_dir(), "kernels"))) is None:
        return None
    library.gguf_gemm_uses_vnni.restype = _i32
    if not library.gguf_gemm_uses_vnni():
        return None
    # load_library is cached: gguf_kernels()'s own library
    return GGUFTiledKernels(load_library("gguf_linear", os.path.join(cache_dir(), "kernels")), base.sgemm, library)
