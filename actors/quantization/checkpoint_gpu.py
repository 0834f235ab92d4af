"""A quantized checkpoint's packed weights kept as they are, for the Triton backend (CUDA, or
the CPU under triton's interpreter in tests): after the model loaded its dequantized weights
(checkpoint_weights.py), use_packed_weights() swaps each layer's projections for the
checkpoint's packed tensors, this rank's slice of them, and the backend for one whose linear
runs the GEMMs of kernels/quant_triton.py on them. (The dequantized copy is freed then; peak
memory at load is the float model's, a limitation.)

Fused projections: q/k/v and gate/up are concatenated along the output dimension, which in
every layout is a concatenation of whole packed words (output features come in multiples of
8). Tensor parallelism slices as the float path does (parallel.shard's rows or columns): a
column-parallel slice takes output features (GPTQ/AWQ: qweight, qzeros and scales columns;
compressed-tensors and FP8: rows), a row-parallel slice takes input features (whole packed
words) and g_idx, keeping every group's scales and zeros, since g_idx names the groups."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from actors.config.quantization import CheckpointQuant, QuantConfigError
from actors.models.llama import FUSED_PROJECTIONS
from kernels.int8_linear import quantize_rows_reference
from kernels.quant_ref import group_index
from kernels.quant_triton import fp8_linear, int8_scaled_gemm, int_group_gemm

logger = logging.getLogger(__name__)



@dataclass
class PackedWeight:
    """An integer-quantized linear as the checkpoint packs it (kernels/quant_triton.py's layouts)."""

    layout: str  # "gptq", "awq", "pack"
    bits: int
    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor | None
    g_idx: torch.Tensor  # [in] int32
    out_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.g_idx.shape[0])

    def numel(self) -> int:  # bytes, as GGUFWeight counts them (the model's num_weight_bytes)
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.qzeros, self.g_idx)
                   if t is not None)

    def element_size(self) -> int:
        return 1


@dataclass
class Fp8Weight:
    weight: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [out] float32

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def numel(self) -> int:
        return self.weight.numel() + 4 * self.scale.numel()

    def element_size(self) -> int:
        return 1


class W8A8Weight(Fp8Weight):
    """int8 weights [out, in] with a scale per output row (compressed-tensors int-quantized);
    activations quantized to int8 per token at run time."""


class PackedWeightBackend:
    """The model's backend, with a linear that also takes PackedWeight and Fp8Weight."""

    def __init__(self, backend) -> None:
        self.inner = backend

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, PackedWeight):
            return int_group_gemm(x.contiguous(), weight.layout, weight.bits, weight.qweight, weight.scales,
                                  weight.qzeros, weight.g_idx, weight.out_features, bias)
        if isinstance(weight, W8A8Weight):
            xq, x_scale = quantize_rows_reference(x)
            return int8_scaled_gemm(xq, x_scale, weight.weight, weight.scale, bias, out_dtype=x.dtype)
        if isinstance(weight, Fp8Weight):
            return fp8_linear(x.contiguous(), weight.weight, weight.scale, bias)
        return self.inner.linear(x, weight, bias)


class _Index:
    """What parallel.shard asks of a tensor: the index it takes, returned as it is."""

    def __getitem__(self, index):
        return index


def shard_range(parallel, module_name: str, model_config, features: tuple[int, int]) -> tuple[int, int, int]:
    """(dim, start, stop) of this rank's slice of a linear ([out, in]: dim 0 is output features)."""
    index = parallel.shard(f"{module_name}.weight", _Index(), model_config)
    dim, piece = (1, index[1]) if isinstance(index, tuple) else (0, index)
    start, stop, _ = piece.indices(features[dim])
    return dim, start, stop


def _per_word(quant: CheckpointQuant) -> int:
    return 32 // quant.bits


def slice_module(t: dict[str, torch.Tensor], quant: CheckpointQuant, dim: int, start: int, stop: int,
                 in_features: int):
    """One linear's packed tensors cut to output features [start, stop) (dim 0) or input
    features [start, stop) (dim 1): a PackedWeight or an Fp8Weight."""
    if quant.layout in ("fp8", "int8"):
        kind = W8A8Weight if quant.layout == "int8" else Fp8Weight
        weight, scale = t["weight"], t["weight_scale"].float().reshape(-1)
        scale = scale.expand(weight.shape[0]) if scale.numel() == 1 else scale
        if dim == 0:
            return kind(weight[start:stop].contiguous(), scale[start:stop].contiguous())
        return kind(weight[:, start:stop].contiguous(), scale.contiguous())
    per = _per_word(quant)
    g_idx = t.get("g_idx" if quant.layout == "gptq" else "weight_g_idx") if quant.desc_act else None
    device = next(iter(t.values())).device  # (a group index made here goes where the weights are)
    g_idx = group_index(in_features, quant.group_size, g_idx).to(device=device, dtype=torch.int32)
    packed_inputs = dim == 1 and quant.layout in ("gptq", "pack")  # words hold `per` input features
    packed_outputs = dim == 0 and quant.layout in ("gptq", "awq")  # zeros' words hold 8 (or 4) outputs
    if packed_inputs and (start % per or stop % per) or packed_outputs and (start % 8 or stop % 8):
        raise QuantConfigError(f"a tensor-parallel slice [{start}, {stop}) of a packed weight is not whole words")
    if quant.layout == "gptq":
        qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
        if dim == 0:
            qweight, scales = qweight[:, start:stop], scales[:, start:stop]
            qzeros = qzeros[:, start // per:stop // per]
        else:
            qweight, g_idx = qweight[start // per:stop // per], g_idx[start:stop]
        return PackedWeight("gptq", quant.bits, qweight.contiguous(), scales.contiguous(), qzeros.contiguous(),
                            g_idx.contiguous(), scales.shape[1])
    if quant.layout == "awq":
        qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
        if dim == 0:
            qweight, qzeros, scales = qweight[:, start // 8:stop // 8], qzeros[:, start // 8:stop // 8], \
                scales[:, start:stop]
        else:
            qweight, g_idx = qweight[start:stop], g_idx[start:stop]
        return PackedWeight("awq", 4, qweight.contiguous(), scales.contiguous(), qzeros.contiguous(),
                            g_idx.contiguous(), scales.shape[1])
    packed, scales = t["weight_packed"], t["weight_scale"]
    if dim == 0:
        packed, scales = packed[start:stop], scales[start:stop]
    else:
        packed, g_idx = packed[:, start // per:stop // per], g_idx[start:stop]
    return PackedWeight("pack", quant.bits, packed.contiguous(), scales.contiguous(), None, g_idx.contiguous(),
                        packed.shape[0])


def fuse(parts: list, name: str):
    """q/k/v or gate/up as one weight, concatenated along the output features."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, Fp8Weight):  # (or W8A8Weight)
        return type(first)(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))
    if any(not torch.equal(p.g_idx, first.g_idx) for p in parts):
        raise QuantConfigError(f"{name}: the fused projections have different g_idx (act-order); the Triton "
                               "path runs them fused, --attention-backend torch runs them dequantized")
    out_dim = 0 if first.layout == "pack" else 1
    qzeros = None if first.qzeros is None else torch.cat([p.qzeros for p in parts], dim=1)
    return PackedWeight(first.layout, first.bits, torch.cat([p.qweight for p in parts], dim=out_dim),
                        torch.cat([p.scales for p in parts], dim=out_dim), qzeros, first.g_idx,
                        sum(p.out_features for p in parts))


def use_packed_weights(model, backend, quant: CheckpointQuant, tensors: dict[str, dict[str, torch.Tensor]],
                       parallel) -> PackedWeightBackend:
    """Swaps model's projections for the checkpoint's packed tensors (tensors: each
    projection's, by module name; this rank's slice of them, on the model's device), and
    returns the backend that runs them."""
    config = model.config
    for index, layer in enumerate(model.layers):
        for attribute, modules in FUSED_PROJECTIONS.items():
            parts = []
            for module in modules:
                full = f"model.layers.{index}.{module}"
                t = tensors[full]
                in_features = _in_features(t, quant)
                out_features = _out_features(t, quant)
                dim, start, stop = shard_range(parallel, full, config, (out_features, in_features))
                parts.append(slice_module(t, quant, dim, start, stop, in_features))
            fused = fuse(parts, f"model.layers.{index}.{attribute}")
            setattr(layer, attribute, _to_device(fused, model.device))
    logger.info("running the checkpoint's %s weights through the Triton GEMMs, %.0f MB", quant.method,
                model.num_weight_bytes() / 1e6)
    model.backend = PackedWeightBackend(backend)
    return model.backend


def _in_features(t: dict[str, torch.Tensor], quant: CheckpointQuant) -> int:
    if quant.layout == "gptq":
        return t["qweight"].shape[0] * _per_word(quant)
    if quant.layout == "awq":
        return t["qweight"].shape[0]
    if quant.layout == "pack":
        return int(t["weight_shape"][1])
    return t["weight"].shape[1]


def _out_features(t: dict[str, torch.Tensor], quant: CheckpointQuant) -> int:
    if quant.layout in ("gptq", "awq"):
        return t["scales"].shape[1]
    return t["weight_packed" if quant.layout == "pack" else "weight"].shape[0]


def _to_device(weight, device):
    if isinstance(weight, Fp8Weight):
        return type(weight)(weight.weight.to(device), weight.scale.to(device))
    return PackedWeight(weight.layout, weight.bits, weight.qweight.to(device), weight.scales.to(device),
                        None if weight.qzeros is None else weight.qzeros.to(device), weight.g_idx.to(device),
                        weight.out_features)
