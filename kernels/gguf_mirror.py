"""A torch reference that repeats kernels/gguf_linear.cpp's VNNI arithmetic step for step (and,
gguf_gemm_mirror, the many-row tiles' of kernels/gguf_gemm.cpp), so a whole model's logits can
be held to it tightly (tests/actors/test_gguf_quantized.py).

Why a second reference: gguf_linear_reference (float64 sums of the dequantized weights) holds
each linear within 1e-7 relative, but not a whole model. The next linear quantizes its input
to int8 per block, and an activation sitting near a rounding boundary (q + 0.5) lands on the
other int8 value when the sums before it differ in their last bit; that step of dx (1/127 of
the block's max) moves the layer's output by about 1e-3 of its size, and later layers amplify
it: on SmolLM2 the two drift to 6e-4 after 8 layers and 9e-2 after 30. Summing as the kernel
does removes the differences at their source:

- x quantized as the kernel does (quantize_rows_reference is bitwise the same);
- per pair of blocks, 16 lanes of 4 products each (vpdpbusd), exact integers;
- per lane, in float32: scaled = sum * dx, acc = fma(scaled, wd, acc), acc = fma(wc, xo, acc),
  with xo = (dx * the block's sum of q) / 8, even pairs into one accumulator, odd into another;
- the two accumulators added, then GCC's _mm512_reduce_add_ps order (8 + 8, 4 + 4, 2 + 2, 1 + 1);
  plus the bias.

A fused multiply-add is emulated in float64 (the product of two floats is exact there) and
rounded to float32: a double rounding, which differs from a true fma's single one only where
the float64 sum falls exactly halfway between two floats, about once in 2^29 operations.
Types: Q4_0, Q4_1 and Q8_0; and the types gguf_decoded.h decodes (Q5_0, Q5_1, the K-quants,
U8x16), read through the kernel's own decoding (GGUFKernels.decode_rows, itself held to the gguf
package's dequantization by the tests), whose offset term multiplies each lane's own sum:
xo = dx * (the lane's 4 q) instead of the block's sum / 8."""

from __future__ import annotations

import numpy as np
import torch

from kernels.gguf_linear import BLOCK, Q4_0, Q4_1, Q8_0, U8X16, gguf_kernels

_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}


def _decoded_lanes(blocks: torch.Tensor, ggml_type: int, in_features: int, num_pairs: int):
    """_weight_lanes for the decoded types, from their U8x16 form (16 u, float32 D, float32 C)."""
    if ggml_type != U8X16:
        blocks = gguf_kernels().decode_rows(blocks, ggml_type, in_features)
    raw = blocks.numpy().reshape(blocks.shape[0], in_features // 16, 24)
    u = raw[:, :, :16].astype(np.int64).reshape(blocks.shape[0], in_features // 4, 4)
    d = np.repeat(raw[:, :, 16:20].copy().view(np.float32)[:, :, 0], 4, axis=1)
    c = np.repeat(raw[:, :, 20:24].copy().view(np.float32)[:, :, 0], 4, axis=1)
    pad = 2 * num_pairs * 8 - in_features // 4  # Q5's odd last block pairs with zeros
    return (torch.from_numpy(np.pad(u, ((0, 0), (0, pad), (0, 0)))), torch.from_numpy(np.pad(d, ((0, 0), (0, pad)))),
            torch.from_numpy(np.pad(c, ((0, 0), (0, pad)))))


def _weight_lanes(blocks: torch.Tensor, ggml_type: int, in_features: int, num_pairs: int):
    """u [out, lanes, 4] (the unsigned bytes the kernel multiplies), wd and wc [out, lanes]."""
    if ggml_type not in _BYTES:
        return _decoded_lanes(blocks, ggml_type, in_features, num_pairs)
    out_features, num_blocks = blocks.shape[0], in_features // BLOCK
    raw = blocks.numpy().reshape(out_features, num_blocks, _BYTES[ggml_type])
    d = raw[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if ggml_type == Q8_0:
        u = raw[:, :, 2:34].view(np.int8).astype(np.int64) + 128
        c = d * np.float32(-128.0)
    else:
        nibbles = raw[:, :, 4:20] if ggml_type == Q4_1 else raw[:, :, 2:18]
        u = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2).astype(np.int64)
        c = raw[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32) if ggml_type == Q4_1 else \
            d * np.float32(-8.0)
    pad = 2 * num_pairs - num_blocks  # an odd last block pairs with zeros (the kernel masks its scales)
    u = np.pad(u, ((0, 0), (0, pad), (0, 0)))
    d, c = np.pad(d, ((0, 0), (0, pad))), np.pad(c, ((0, 0), (0, pad)))
    lanes = 2 * num_pairs * 8
    return (torch.from_numpy(u.reshape(out_features, lanes, 4)), torch.from_numpy(np.repeat(d, 8, axis=1)),
            torch.from_numpy(np.repeat(c, 8, axis=1)))


def _activation_lanes(x: torch.Tensor, num_pairs: int, per_lane: bool):
    """q [rows, lanes, 4] int8 values, dx and xo [rows, lanes], as gguf_linear.cpp's quantize_row
    (xo per lane: dx times the lane's sum, for the decoded types; else the block's sum / 8)."""
    rows, in_features = x.shape
    blocks = x.float().reshape(rows, in_features // BLOCK, BLOCK)
    dx = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    scaled = blocks * inverse[..., None]
    q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).to(torch.int64)
    xo = dx * q.sum(dim=-1).float() * 0.125
    pad = 2 * num_pairs - in_features // BLOCK
    q = torch.nn.functional.pad(q, (0, 0, 0, pad))
    dx, xo = torch.nn.functional.pad(dx, (0, pad)), torch.nn.functional.pad(xo, (0, pad))
    lanes = 2 * num_pairs * 8
    q, dx = q.reshape(rows, lanes, 4), dx.repeat_interleave(8, dim=1)
    return q, dx, dx * q.sum(dim=-1).float() if per_lane else xo.repeat_interleave(8, dim=1)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (a.double() * b.double() + c.double()).float()


def gguf_linear_mirror(x: torch.Tensor,  # [rows, in_features] float32
                       blocks: torch.Tensor, ggml_type: int, in_features: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:  # [rows, out_features] float32
    """The VNNI kernel's decode-row result (up to dequantize_rows rows), summed in its order."""
    num_pairs = (in_features // BLOCK + 1) // 2
    u, wd, wc = _weight_lanes(blocks, ggml_type, in_features, num_pairs)
    q, dx, xo = _activation_lanes(x, num_pairs, per_lane=ggml_type not in _BYTES)
    # each lane's 4 products, exact (|sum| < 2^17): [rows, out, lanes]
    sums = torch.einsum("rld,old->rol", q.double(), u.double()).float()
    acc = [torch.zeros(x.shape[0], blocks.shape[0], 16), torch.zeros(x.shape[0], blocks.shape[0], 16)]
    for p in range(num_pairs):
        lanes = slice(16 * p, 16 * p + 16)
        scaled = sums[:, :, lanes] * dx[:, None, lanes]
        partial = _fma(scaled, wd[None, :, lanes], acc[p % 2])
        acc[p % 2] = _fma(wc[None, :, lanes], xo[:, None, lanes], partial)
    total = acc[0] + acc[1]
    eights = total[..., 8:] + total[..., :8]
    fours = eights[..., 4:] + eights[..., :4]
    out = (fours[..., 0] + fours[..., 2]) + (fours[..., 1] + fours[..., 3])
    return out + bias if bias is not None else out


def gguf_gemm_mirror(x: torch.Tensor,  # [rows, in_features] float32
                     parts, bias: torch.Tensor | None = None,  # parts: kernels/gguf_gemm.py's BlockParts
                     ) -> torch.Tensor:  # [rows, out_features] float32
    """The many-row tiles' result (kernels/gguf_gemm.cpp), summed in their order: per block of
    32, the exact int32 sum(u * q), then acc = fma(sum, d * dx, acc), acc = fma(c, dx * sum(q),
    acc), block after block; plus the bias."""
    rows, in_features = x.shape
    num_blocks = in_features // BLOCK
    blocks = x.float().reshape(rows, num_blocks, BLOCK)
    dx = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    scaled = blocks * inverse[..., None]
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    xo = dx * q.sum(dim=-1)
    u = parts.u.reshape(-1, num_blocks, BLOCK).double()
    sums = torch.einsum("rbk,obk->rob", q.double(), u).float()  # exact: |sum| < 2^20
    acc = torch.zeros(rows, u.shape[0])
    for b in range(num_blocks):
        acc = _fma(sums[:, :, b], parts.d[None, :, b] * dx[:, None, b], acc)
        acc = _fma(parts.c[None, :, b], xo[:, None, b], acc)
    return acc + bias if bias is not None else acc
