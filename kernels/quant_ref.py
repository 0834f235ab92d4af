"""Plain-torch unpacking and dequantization of the quantized checkpoint layouts
(actors/quantization/checkpoint_config.py): what the CPU loads (weights dequantized to float32
at load time) and the references the Triton kernels (kernels/quant_triton.py) are held to.

Every integer layout stores unsigned fields of `bits` bits in int32 words, the first value
in the lowest bits; the dequantized weight is scale * (q - zero) per group of input channels.
All results are [out_features, in_features] float32: a product of an fp16/bf16 scale and a
small integer is exact in float32."""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ packs output columns 0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..7
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble holding column c % 8


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The unsigned fields of an int32 tensor, spread along dim (int64): each word becomes
    32 // bits consecutive values there; order[i] is the field holding the i-th of them."""
    per_word = 32 // bits
    fields = order if order is not None else tuple(range(per_word))
    shifts = torch.tensor([field * bits for field in fields], dtype=torch.int64, device=packed.device)
    words = packed.to(torch.int64).unsqueeze(-1 if dim in (-1, packed.dim() - 1) else dim + 1)
    shape = [1] * words.dim()
    shape[dim + 1 if dim >= 0 else -1] = per_word
    values = (words >> shifts.view(shape)) & ((1 << bits) - 1)
    new_shape = list(packed.shape)
    new_shape[dim] *= per_word
    return values.reshape(new_shape)


def group_index(in_features: int, group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Each input channel's group: g_idx where the checkpoint has one (act-order), else k // group_size."""
    if g_idx is not None:
        return g_idx.to(torch.int64)
    size = in_features if group_size == -1 else group_size
    return torch.arange(in_features) // size


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int,
                    group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """AutoGPTQ v1: qweight [in * bits / 32, out] packed along inputs, qzeros [groups,
    out * bits / 32] packed along outputs holding zero - 1, scales [groups, out]."""
    q = unpack_int32(qweight, bits, 0)  # [in, out]
    zeros = unpack_int32(qzeros, bits, 1) + 1  # [groups, out]
    groups = group_index(q.shape[0], group_size, g_idx)
    w = scales.float()[groups] * (q - zeros[groups]).float()
    return w.T.contiguous()


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """AWQ (gemm): qweight [in, out / 8] and qzeros [groups, out / 8] packed along outputs in
    AWQ's column order, scales [groups, out]; zeros as they are."""
    q = unpack_int32(qweight, 4, 1, AWQ_NIBBLE_OF_COLUMN)
    zeros = unpack_int32(qzeros, 4, 1, AWQ_NIBBLE_OF_COLUMN)
    groups = group_index(q.shape[0], group_size)
    w = scales.float()[groups] * (q - zeros[groups]).float()
    return w.T.contiguous()


def dequantize_packed(weight_packed: torch.Tensor, weight_scale: torch.Tensor, bits: int, group_size: int,
                      g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """compressed-tensors pack-quantized, symmetric: weight_packed [out, in * bits / 32]
    packed along inputs, signed values stored plus 2**(bits-1); weight_scale [out, groups]."""
    q = unpack_int32(weight_packed, bits, 1) - (1 << (bits - 1))  # [out, in]
    groups = group_index(q.shape[1], group_size, g_idx)
    return (weight_scale.float()[:, groups] * q.float()).contiguous()


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 (or int8) [out, in] times its scale: one number (per tensor) or one per output row."""
    scale = weight_scale.float()
    scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
    return weight.float() * scale
