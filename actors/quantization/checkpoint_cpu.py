"""Integer checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) run on the CPU's GGUF
kernels (kernels/gguf_linear.cpp, AVX-512 VNNI) with their integers as they are, repacked at
load into GGUF blocks of 32 input features that EXACTLY hold the same weights:

- Q4_0 (w = d * (u - 8), 18 bytes a block) where the zero point is 8: symmetric 4-bit GPTQ
  and compressed-tensors int4 (stored as signed + 8). d = the group's fp16 scale, as it is.
- Q8_0 (w = d * q, q int8, 34 bytes a block) otherwise: q = u - zero fits int8 for 4-bit
  asymmetric layouts (AWQ, GPTQ sym=False: -15..15) and for symmetric 8-bit (-128..127).
  Q4_1 (w = d * u + m) would keep 4 bits, but m = -scale * zero must be rounded to fp16,
  which moves a weight by up to 15 * 2^-11 ~ 0.7% of a quantization step: not exact, so
  asymmetric 4-bit weights take Q8_0's bytes instead (still 3.8x fewer than float32).

A block shares one scale and zero, so this runs where groups are whole blocks: group_size a
multiple of 32 (or per channel), input features a multiple of 32, and no act-order (a g_idx
that is not k // group_size: a block's features would belong to several groups). Elsewhere
(act-order, 8-bit asymmetric GPTQ, FP8, another dtype, tensor parallelism, no C++ kernels)
the weights stay dequantized to float32 (checkpoint_weights.py). As with GGUF files, decode
rows quantize the activations per block of 32 to int8 (llama.cpp's way); steps past 8 rows
dequantize tiles and multiply float activations (kernels/gguf_linear.py)."""

from __future__ import annotations

import logging

import numpy as np
import torch

from actors.config.quantization import CheckpointQuant
from actors.models.llama import FUSED_PROJECTIONS
from actors.quantization.gguf import GGUFCpuBackend, GGUFWeight
from kernels.gguf_linear import BLOCK, Q4_0, Q8_0
from kernels.quant_ref import AWQ_NIBBLE_OF_COLUMN, group_index, unpack_int32

logger = logging.getLogger(__name__)



def block_type(quant: CheckpointQuant) -> int | None:
    """The GGUF type that holds quant's weights exactly (Q4_0 or Q8_0), or None."""
    if quant.layout not in ("gptq", "awq", "pack") or quant.desc_act:
        return None
    if quant.group_size != -1 and quant.group_size % BLOCK:
        return None
    if quant.bits == 4:
        return Q4_0 if quant.sym and quant.layout != "awq" else Q8_0
    return Q8_0 if quant.sym else None  # 8-bit asymmetric: q - zero spans -255..255


def integers(t: dict[str, torch.Tensor], quant: CheckpointQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """(q - zero [out, in] int64, scale [out, in / 32] float16 or bfloat16): the checkpoint's
    integers with their zero points taken off, and each block's scale."""
    if quant.layout == "pack":
        values = unpack_int32(t["weight_packed"], quant.bits, 1) - (1 << (quant.bits - 1))
        scales = t["weight_scale"]  # [out, groups]
    else:
        order = AWQ_NIBBLE_OF_COLUMN if quant.layout == "awq" else None
        q = unpack_int32(t["qweight"], quant.bits, 1 if quant.layout == "awq" else 0, order)  # [in, out]
        zeros = unpack_int32(t["qzeros"], quant.bits, 1, order) + (1 if quant.layout == "gptq" else 0)
        groups = group_index(q.shape[0], quant.group_size)
        values = (q - zeros[groups]).T
        scales = t["scales"].T  # [out, groups]
    in_features = values.shape[1]
    blocks = torch.arange(0, in_features, BLOCK)
    return values, scales[:, group_index(in_features, quant.group_size)[blocks]]


def to_blocks(values: torch.Tensor, scales: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """GGUF Q4_0 or Q8_0 blocks [out, row bytes] uint8 of w = scale * values, exactly."""
    out_features, in_features = values.shape
    d = scales.to(torch.float16)
    if not torch.equal(d.float(), scales.float()):
        raise ValueError("a scale is not an fp16 number; its blocks would not be exact")
    d_bytes = d.contiguous().view(torch.uint8).reshape(out_features, -1, 2).numpy()
    v = values.reshape(out_features, in_features // BLOCK, BLOCK).numpy()
    low, high = (-8, 7) if ggml_type == Q4_0 else (-128, 127)
    if values.min() < low or values.max() > high:
        raise ValueError(f"integers outside {low}..{high}; the blocks would not be exact")
    if ggml_type == Q4_0:  # byte j: element j in the low nibble, element j + 16 in the high one
        u = (v + 8).astype(np.uint8)
        data = u[..., :16] | (u[..., 16:] << 4)
    else:
        data = v.astype(np.int8).view(np.uint8)
    return torch.from_numpy(np.concatenate([d_bytes, data], axis=-1).reshape(out_features, -1).copy())


def use_gguf_blocks(model, backend, quant: CheckpointQuant, tensors: dict[str, dict[str, torch.Tensor]], kernels):
    """Swaps model's projections for GGUF blocks of the checkpoint's integers (tensors: each
    projection's checkpoint tensors, by module name); the backend
    that runs them is returned (the model runner's from then on), or backend as it was where
    some block would not be exact (a scale that is no fp16 number, a zero point off 8 for Q4_0)."""
    ggml_type = block_type(quant)
    swaps = []  # all built before any is swapped in: a block that would not be exact leaves the model as it was
    for index, layer in enumerate(model.layers):
        for attribute, modules in FUSED_PROJECTIONS.items():
            blocks, in_features = [], 0
            for module in modules:
                values, scales = integers(tensors[f"model.layers.{index}.{module}"], quant)
                try:
                    blocks.append(to_blocks(values, scales, ggml_type))
                except ValueError as error:
                    logger.warning("model.layers.%d.%s: %s; running the weights dequantized to float32",
                                   index, module, error)
                    return backend
                in_features = values.shape[1]
            swaps.append((layer, attribute, GGUFWeight(torch.cat(blocks), ggml_type, in_features)))
    for layer, attribute, weight in swaps:
        setattr(layer, attribute, weight)
    quantized = GGUFCpuBackend(backend, kernels)
    model.backend = quantized
    logger.info("running the checkpoint's %s integers as GGUF %s blocks, %.0f MB", quant.method,
                "Q4_0" if ggml_type == Q4_0 else "Q8_0", model.num_weight_bytes() / 1e6)
    return quantized


def can_use_gguf_blocks(model, backend, quant: CheckpointQuant) -> bool:
    from actors.layers.attention import CpuBackend

    return (block_type(quant) is not None and isinstance(backend, CpuBackend) and backend.native is not None
            and model.dtype == torch.float32 and model.device.type == "cpu" and not model.parallel.enabled
            and model.config.hidden_size % BLOCK == 0 and model.config.intermediate_size % BLOCK == 0)
