"""Phi-3 / Phi-4-mini decoders (Phi3ForCausalLM): a Llama layer whose checkpoint fuses
q/k/v (self_attn.qkv_proj, rows q then k then v) and gate/up (mlp.gate_up_proj, gate then
up), split at load into LlamaModel's names; RoPE default or LongRoPE; every layer windowed
when the config sets sliding_window (hybrid_config.py). Its layer is LlamaModel's, so the
CPU's one-call step (cpu_step.py) runs it.

LongRoPE (Hugging Face's _compute_longrope_parameters): inverse frequencies divided by a
per-frequency factor (short_factor within original_max_position_embeddings, long_factor
past it), cos and sin scaled by attention_factor (by default sqrt(1 + ln(factor) /
ln(original_max)), factor = max_position_embeddings / original_max). Hugging Face picks
the factors per forward, by the longest position in it (a prompt past original_max rotates
all its keys with the long factors); here each position has its own (the short factors
below original_max, the long ones from it), so a cached key never needs rotating again.
The two agree on every sequence within original_max_position_embeddings."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from actors.config import ModelConfig
from actors.layers.attention import AttentionBackend
from actors.layers.tensor_parallel import TensorParallel
from actors.models.llama import LlamaModel


def longrope_cos_sin_cache(head_dim: int, max_position: int, theta: float, longrope: dict | None) -> torch.Tensor:
    """[max_position, head_dim]: cos then sin of each position (llama.py's layout), in
    Hugging Face's fp32 arithmetic."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    positions = torch.arange(max_position, dtype=torch.float32)
    if longrope is None:
        freqs = positions[:, None] * (1.0 / (theta**exponents))[None, :]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    original = longrope["original_max_position_embeddings"]
    factor = longrope["factor"] or max_position / original
    attention_factor = longrope["attention_factor"]
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    tables = []
    for name in ("short_factor", "long_factor"):
        ext_factors = torch.tensor(longrope[name], dtype=torch.float32)
        if ext_factors.numel() != head_dim // 2:
            raise ValueError(f"longrope {name} has {ext_factors.numel()} factors, expected {head_dim // 2}")
        freqs = positions[:, None] * (1.0 / (ext_factors * theta**exponents))[None, :]
        tables.append(torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1))
    short, long = tables
    return torch.where((positions < original)[:, None], short, long)


class Phi3Model(LlamaModel):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, parallel: TensorParallel = TensorParallel()) -> None:
        if parallel.enabled:  # (the shards are cut by Hugging Face name, before the fused weights are split)
            raise ValueError(f"{config.model_path}: Phi3ForCausalLM does not run tensor-parallel yet")
        super().__init__(config, dtype, device, backend, parallel)
        family = config.family or {"rope_theta": config.rope_theta, "longrope": None}
        self.cos_sin_cache = longrope_cos_sin_cache(self.head_dim, config.max_position_embeddings,
                                                    family["rope_theta"], family["longrope"]).to(device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim

        def split(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                prefix, _, rest = name.rpartition(".qkv_proj.")
                if prefix:
                    for part, rows in zip("qkv", tensor.split([q_size, kv_size, kv_size])):
                        yield f"{prefix}.{part}_proj.{rest}", rows
                    continue
                prefix, _, rest = name.rpartition(".gate_up_proj.")
                if prefix:
                    gate, up = tensor.chunk(2)
                    yield f"{prefix}.gate_proj.{rest}", gate
                    yield f"{prefix}.up_proj.{rest}", up
                    continue
                yield name, tensor

        super().load_weights(split(weights))
