"""Gemma 2 and Gemma 3 (text) decoders: LlamaModel's weights and flat batch, with Gemma's
layer (Hugging Face's modeling_gemma2.py / modeling_gemma3.py):
- RMSNorm scales by (1 + w): the 1 is added to every norm weight at load, so the backends'
  plain rms_norm computes it (in fp32, the same numbers as Hugging Face's);
- four norms a layer: the attention's output and the MLP's output are normed before they
  join the residual (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by
  pre_feedforward_layernorm;
- the embedding is scaled by sqrt(hidden_size); the MLP is GELU (tanh) of gate times up;
- attention scores are scaled by query_pre_attn_scalar ** -0.5, soft-capped where the config
  sets attn_logit_softcapping (Gemma 2), and the logits by final_logit_softcapping;
- each layer's sliding window from the config (Gemma 2 alternates; Gemma 3 runs five local
  layers to one global), and Gemma 3's local layers rotate with their own RoPE base
  (rope_local_base_freq) and q/k norms before rotary.

The CPU's one-call step (cpu_step.py) runs this layer too: fused_layer_fields gives it the
two extra norms, the layer's rotary table, the GELU-tanh and the soft cap.""" 

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from actors.config import ModelConfig
from actors.layers.attention import AttentionBackend
from actors.layers.attention_metadata import AttentionMetadata
from actors.layers.tensor_parallel import TensorParallel
from actors.models.llama import DecoderLayerWeights, LlamaModel, _take

if TYPE_CHECKING:
    from actors.lora.batch import LoRABatch

_GATE_UP, _DOWN = 2, 3  # (llama.py's LoRA groups)
_FEEDFORWARD_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass
class GemmaLayerWeights(DecoderLayerWeights):
    # (post_attention_norm, inherited, norms the attention's output here, not the MLP's input)
    pre_feedforward_norm: torch.Tensor | None = None  # [hidden]
    post_feedforward_norm: torch.Tensor | None = None  # [hidden]


def gemma_cos_sin_cache(head_dim: int, max_position: int, rope: dict) -> torch.Tensor:
    """[max_position, head_dim]: cos then sin, Hugging Face's default RoPE in fp32 with its
    "linear" scaling (the inverse frequencies divided by factor: Gemma 3's global layers)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope["rope_theta"] ** exponents)
    if rope["factor"] != 1.0:
        inv_freq = inv_freq / rope["factor"]
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class GemmaModel(LlamaModel):
    fused_cpu_step = True  # (model_step_f32 runs its layer from fused_layer_fields)
    llama_layer = False

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, parallel: TensorParallel = TensorParallel()) -> None:
        super().__init__(config, dtype, device, backend, parallel)
        family = config.family
        if family is None:
            raise ValueError(f"{config.model_path}: a Gemma model's config was not read as Gemma's "
                             "(actors/models/hybrid_config.py)")
        self.scale = family["query_pre_attn_scalar"] ** -0.5
        self.attn_soft_cap: float | None = family["attn_logit_softcapping"]
        self.final_soft_cap: float | None = family["final_logit_softcapping"]
        global_cache = gemma_cos_sin_cache(self.head_dim, config.max_position_embeddings, family["global_rope"])
        local_cache = global_cache if family["local_rope"] == family["global_rope"] else \
            gemma_cos_sin_cache(self.head_dim, config.max_position_embeddings, family["local_rope"])
        self.cos_sin_cache = global_cache.to(device)
        local_cache = self.cos_sin_cache if local_cache is global_cache else local_cache.to(device)
        # each layer's rotary table: a sliding (local) layer's base, or the global one
        self.layer_cos_sin = [local_cache if window else self.cos_sin_cache for window in self.sliding_windows]
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype)  # (Hugging Face's, in the model dtype)
        self._dummy = False

    # -- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def plus_one(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                # Gemma's (1 + w) norms, the 1 added in fp32 (as Hugging Face computes it)
                yield name, (tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
            if self._dummy:  # LlamaModel's dummy weights have no feed-forward norms
                for layer in range(self.config.num_hidden_layers):
                    for norm in _FEEDFORWARD_NORMS:
                        yield f"model.layers.{layer}.{norm}.weight", torch.ones(self.config.hidden_size)

        super().load_weights(plus_one(weights))

    def init_dummy_weights(self, seed: int = 0) -> None:
        self._dummy = True
        try:
            super().init_dummy_weights(seed)
        finally:
            self._dummy = False

    def _pack_layer(self, t: dict[str, torch.Tensor]) -> GemmaLayerWeights:
        base = super()._pack_layer(t)
        return GemmaLayerWeights(**vars(base),
                                 pre_feedforward_norm=self._place(_take(t, "pre_feedforward_layernorm.weight")),
                                 post_feedforward_norm=self._place(_take(t, "post_feedforward_layernorm.weight")))

    # -- forward ---------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale.to(self.device)

    def run_layers(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attention: AttentionMetadata,
                   lora: LoRABatch | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """LlamaModel.run_layers' contract (hidden and residual, not yet added); the residual
        adds are rms_norm's fused ones: the normed attention output joins the residual as the
        MLP's pre-norm runs, the normed MLP output as the next layer's input norm runs."""
        ops = self.backend
        eps = self.config.rms_norm_eps
        for index, (layer, (key_cache, value_cache)) in enumerate(zip(self.layers, kv_caches)):
            x, residual = self.input_norm(hidden, residual, layer.input_norm)
            hidden = self.attention_block(index, layer, x, positions, self.layer_cos_sin[index], key_cache,
                                          value_cache, attention, lora, self.attn_soft_cap)
            hidden = ops.rms_norm(hidden, layer.post_attention_norm, eps)
            x, residual = ops.rms_norm(hidden, layer.pre_feedforward_norm, eps, residual)
            gate_up = ops.linear(x, layer.gate_up_proj)
            if lora is not None:
                lora.add(index, _GATE_UP, x, gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            x = F.gelu(gate, approximate="tanh") * up
            hidden = ops.linear(x, layer.down_proj)
            if lora is not None:
                lora.add(index, _DOWN, x, hidden)
            hidden = self.parallel.all_reduce(hidden)
            hidden = ops.rms_norm(hidden, layer.post_feedforward_norm, eps)
        return hidden, residual

    def fused_layer_fields(self, index: int) -> dict:
        """cpu_model_step.h's DecoderLayer fields of Gemma's layer: its pre-feedforward norm
        where Llama's layer has its post-attention one (the norm that adds the residual), the
        attention and MLP outputs' norms, its rotary table, GELU-tanh, the score soft cap."""
        layer, cos_sin = self.layers[index], self.layer_cos_sin[index]
        assert cos_sin.stride() == self.cos_sin_cache.stride()
        return dict(post_attention_norm=layer.pre_feedforward_norm, attn_out_norm=layer.post_attention_norm,
                    mlp_out_norm=layer.post_feedforward_norm, cos_sin_cache=cos_sin, activation=1,
                    logits_soft_cap=self.attn_soft_cap or 0.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        if logits is not None and self.final_soft_cap is not None:
            # Hugging Face's order of operations: divide, tanh, multiply
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits
