"""GGUF quantized weights kept as the file has them (`--quantization gguf`, or `auto` on a
.gguf model): the decoder's projections and its LM head run on their own blocks through
kernels/gguf_linear.cpp, on the CPU, in the fused step (actors/models/cpu_step.py) as
in the op-by-op forward (GGUFCpuBackend.linear).

The model still loads the converted fp32 checkpoint first (the embedding table, norms and
biases stay fp32; an embedding is a row lookup, which no kernel needs); then
use_gguf_weights() swaps each projection's fp32 weight for its blocks read from the .gguf:
q/k/v and gate/up rows concatenated (rows of a block layout are independent), and llama's
q/k rows put back in Hugging Face's order as gguf_convert.py does, a row permutation too."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from actors.layers.attention import CpuBackend
from actors.quantization.gguf_types import (KERNEL_TYPES, GGUFError, has_fused_projections, layer_tensor_names,
                                            lm_head_name)
from kernels.gguf_gemm import GGUFTiledKernels, GGUFTiles, gguf_tiled_kernels
from kernels.gguf_linear import U8X16, GGUFKernels, gguf_kernels

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFWeight:
    """A linear layer's weight as the file's blocks: [out_features, row bytes] uint8."""

    blocks: torch.Tensor
    ggml_type: int
    in_features: int
    tiles: GGUFTiles | None = None  # for steps of many rows (kernels/gguf_gemm.py): the fused step's pointer

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.in_features)

    @property
    def type_name(self) -> str:
        return "U8x16" if self.ggml_type == U8X16 else KERNEL_TYPES[self.ggml_type]

    # what the model's bookkeeping asks of a weight (num_weight_bytes, pointers for the C++ step)
    def numel(self) -> int:
        return self.blocks.numel()

    def element_size(self) -> int:
        return 1

    def quantizes_x(self, rows: int, dequantize_rows: int) -> bool:
        """Whether a linear of `rows` rows multiplies x quantized per block of 32 (the dot
        products, the tiles), or x as it is (dequantized tiles and sgemm)."""
        return rows <= dequantize_rows or (self.tiles is not None and self.tiles.runs_tiles(rows))

    def data_ptr(self) -> int:
        return self.tiles.address if self.tiles is not None else self.blocks.data_ptr()


class GGUFCpuBackend(CpuBackend):
    """The CPU backend, with linear layers that also take GGUF blocks."""

    def __init__(self, backend: CpuBackend, kernels: GGUFKernels) -> None:
        super().__init__(backend.native)
        self.few_rows, self.fused_steps = backend.few_rows, backend.fused_steps
        self.kernels = kernels

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, GGUFWeight) and weight.tiles is not None:
            return self.kernels.tiled_linear(x.contiguous(), weight.tiles, weight.in_features, bias)
        if isinstance(weight, GGUFWeight):
            return self.kernels.linear(x.contiguous(), weight.blocks, weight.ggml_type, weight.in_features, bias)
        return super().linear(x, weight, bias)


def _blocks(tensor, kernels: GGUFKernels, unpermute_heads: int | None = None) -> torch.Tensor:
    out_features, in_features = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists dims fastest-first
    row_bytes = kernels.row_bytes(int(tensor.tensor_type), in_features)
    if row_bytes == 0:
        raise GGUFError(f"tensor {tensor.name!r}: {in_features} inputs, not whole blocks of 32")
    rows = np.asarray(tensor.data).reshape(out_features, row_bytes)
    if unpermute_heads is not None:
        from actors.models.gguf_convert import unpermute_rotary_rows

        rows = unpermute_rotary_rows(rows, unpermute_heads)
    return torch.from_numpy(np.array(rows))  # a copy: the reader's arrays map the file read-only


def use_gguf_weights(model, backend: CpuBackend, gguf_path: str) -> GGUFCpuBackend:
    """Swaps model's projections and LM head for the file's blocks, and its backend for
    one that runs them (returned: the model runner's backend from then on)."""
    import gguf

    kernels = gguf_tiled_kernels() or gguf_kernels()
    if kernels is None:
        raise GGUFError("--quantization gguf needs the C++ kernels, which did not build (no C++ compiler?)")
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    unpermute = architecture == "llama"
    heads = {"attn_q": model.config.num_attention_heads, "attn_k": model.config.num_key_value_heads}
    for index, layer in enumerate(model.layers):
        for attribute, names in layer_tensor_names(index, tensors, has_fused_projections(tensors)).items():
            if attribute.startswith("experts_"):  # an MoE layer's experts: the model's own (below)
                continue
            parts = [_blocks(tensors[name], kernels, heads.get(name.split(".")[2]) if unpermute else None)
                     for name in names]
            types = [int(tensors[name].tensor_type) for name in names]
            in_features = int(tensors[names[0]].shape[0])
            if len(set(types)) > 1:  # e.g. Q4_K_M's Q4_K q/k and Q6_K v: all decoded, without loss
                parts = [kernels.decode_rows(part, t, in_features) for part, t in zip(parts, types)]
                types = [U8X16]
            setattr(layer, attribute, GGUFWeight(torch.cat(parts), types[0], in_features))
    if hasattr(model, "use_gguf_experts"):  # actors/models/moe.py: each expert's blocks, as the file has them
        model.use_gguf_experts(tensors, kernels)
    head = tensors[lm_head_name(tensors)]
    if int(head.tensor_type) in KERNEL_TYPES:
        model.lm_head = GGUFWeight(_blocks(head, kernels), int(head.tensor_type), int(head.shape[0]))
    tile_bytes = with_tiles(model, kernels)
    quantized = GGUFCpuBackend(backend, kernels)
    model.backend = quantized
    logger.info("running %s's weights as the file has them (%s), %.0f MB (and %.0f MB of many-row tiles)",
                gguf_path, ", ".join(sorted({w.type_name for w in _weights(model)})), model.num_weight_bytes() / 1e6,
                tile_bytes / 1e6)
    return quantized


def with_tiles(model, kernels: GGUFKernels) -> int:
    """Gives each GGUF weight its descriptor for gguf_gemm.cpp, which the fused step then calls
    for all of them (GGUFTiledKernels.linear_address), with tiles for steps of many rows where
    the type has them; returns their bytes. Nothing without those kernels (no AVX-512 VNNI)."""
    if not isinstance(kernels, GGUFTiledKernels):
        return 0
    total = 0
    for owner in [*model.layers, model]:
        for name, weight in list(vars(owner).items()):
            if isinstance(weight, GGUFWeight) and weight.tiles is None:
                tiles = kernels.tiles(weight.blocks, weight.ggml_type, weight.in_features)
                setattr(owner, name, replace(weight, tiles=tiles))
                total += tiles.num_bytes()
    return total


def _weights(model) -> list[GGUFWeight]:
    found = [w for layer in model.layers for w in vars(layer).values() if isinstance(w, GGUFWeight)]
    return found + ([model.lm_head] if isinstance(model.lm_head, GGUFWeight) else [])
