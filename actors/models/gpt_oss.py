"""GPT-OSS (Hugging Face's GptOssForCausalLM, modeling_gpt_oss.py): LlamaModel's decoder and
paged KV cache, with
- attention: biases on q, k, v and o; a learned logit per head (`sinks`) that joins each
  softmax's denominator (the backends' sinks variant); layer_types alternating sliding
  windows and full attention (hybrid_config.py); RoPE default or YaRN (its attention factor
  scales cos and sin);
- every layer's MLP a mixture of experts: the router a linear with a bias, softmax over the
  top-k logits; experts with biases whose fused gate_up_proj interleaves gate and up
  columns, and a clamped SwiGLU (actors/layers/gpt_oss_experts.py).

The experts load as the checkpoint has them: float gate_up_proj [E, H, 2I] and down_proj
[E, I, H] (transposed here to the rows [E, 2I, H] and [E, H, I]), or, in a checkpoint whose
quantization_config is {"quant_method": "mxfp4"}, the *_blocks and *_scales bytes, kept as
uint8 and multiplied by kernels/moe_mxfp4.cpp without ever being dequantized to memory.

One device, op by op (fused_cpu_step False: model_step_f32 has neither sinks nor experts);
no tensor parallelism yet (the o_proj and expert biases would be added once per rank)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from actors.config import ModelConfig
from actors.layers.attention import AttentionBackend
from actors.layers.gpt_oss_experts import GptOssExperts
from actors.layers.tensor_parallel import TensorParallel
from actors.models.llama import DecoderLayerWeights, LlamaModel, _take
from kernels.moe_mxfp4 import Mxfp4Experts
from kernels.mxfp4_ref import route_gpt_oss

if TYPE_CHECKING:
    from actors.lora.batch import LoRABatch

_PREFIX = "model.layers."
_NO_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def yarn_cos_sin_cache(head_dim: int, max_position: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """[max_position, head_dim]: cos then sin (llama.py's layout), in Hugging Face's float32
    arithmetic (_compute_yarn_parameters): each frequency blended between the original and
    the interpolated (divided by factor) along a linear ramp over the dimensions whose
    rotations within original_max_position_embeddings fall between beta_fast and beta_slow;
    cos and sin times attention_factor (default 0.1 ln(factor) + 1)."""
    positions = torch.arange(max_position, dtype=torch.float32)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    if yarn is None:
        freqs = positions[:, None] * (1.0 / pos_freqs)[None, :]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    attention_factor = yarn["attention_factor"]
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn["beta_fast"]), correction_dim(yarn["beta_slow"])
    if yarn["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (Hugging Face's guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


class GptOssModel(LlamaModel):
    fused_cpu_step = False  # (no sinks nor experts in model_step_f32)

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, parallel: TensorParallel = TensorParallel()) -> None:
        if parallel.enabled:
            raise ValueError(f"{config.model_path}: GptOssForCausalLM does not run tensor-parallel yet")
        if config.moe is None or config.family is None:
            raise ValueError(f"{config.model_path}: a GPT-OSS config was not read as GPT-OSS's "
                             "(actors/models/moe_config.py, hybrid_config.py)")
        super().__init__(config, dtype, device, backend, parallel)
        family = config.family
        self.moe = config.moe
        self.alpha, self.limit = family["swiglu_alpha"], family["swiglu_limit"]
        self.cos_sin_cache = yarn_cos_sin_cache(self.head_dim, config.max_position_embeddings, family["rope_theta"],
                                                family["yarn"]).to(device)
        self.routers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (weight [E, H], bias [E])
        self.experts: dict[int, GptOssExperts] = {}

    # -- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Attention, norms, embedding and head through llama.py; each layer's router and
        experts (the MXFP4 bytes as they are) kept aside and packed here."""
        mlp: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(self.config.num_hidden_layers)}

        def decoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(_PREFIX):
                    index, rest = name[len(_PREFIX):].split(".", 1)
                    if rest.startswith("mlp."):
                        mlp[int(index)][rest[len("mlp."):]] = tensor
                        continue
                yield name, tensor

        super().load_weights(decoder_weights())
        for index, tensors in mlp.items():
            self.routers[index] = (self._place(_take(tensors, "router.weight")),
                                   self._place(_take(tensors, "router.bias")))
            self.experts[index] = self._pack_experts(tensors)

    @property
    def _triton(self) -> bool:
        """Its experts run the Triton fused-MoE kernels: its attention does (CUDA, or tests'
        interpreter)."""
        return self.backend.name == "triton"

    def _pack_experts(self, t: dict[str, torch.Tensor]) -> GptOssExperts:
        biases = _take(t, "experts.gate_up_proj_bias"), _take(t, "experts.down_proj_bias")
        if "experts.gate_up_proj_blocks" in t:
            num_experts, two_i = biases[0].shape
            hidden = biases[1].shape[1]
            # (a checkpoint may store the blocks flat: [E, rows, in / 2])
            blocks = [_take(t, f"experts.{p}_blocks").reshape(num_experts, rows, -1, 16)
                      for p, rows in (("gate_up_proj", two_i), ("down_proj", hidden))]
            experts = Mxfp4Experts(blocks[0], _take(t, "experts.gate_up_proj_scales"), biases[0], blocks[1],
                                   _take(t, "experts.down_proj_scales"), biases[1])
            return GptOssExperts(self.alpha, self.limit, mxfp4=experts.to(self.device), triton=self._triton)
        # Hugging Face's float parameters are [E, in, out]: the kernels' rows are [E, out, in]
        w13, w2 = (self._place(_take(t, f"experts.{p}").transpose(1, 2)) for p in ("gate_up_proj", "down_proj"))
        return GptOssExperts(self.alpha, self.limit, w13=w13, b13=self._place(biases[0]), w2=w2,
                             b2=self._place(biases[1]), triton=self._triton)

    def _pack_layer(self, t: dict[str, torch.Tensor]) -> DecoderLayerWeights:
        # no dense MLP: its experts are in self.experts
        layer = super()._pack_layer({**t, **{name: torch.empty(0) for name in _NO_DENSE_MLP}})
        layer.gate_up_proj = layer.down_proj = None
        layer.o_bias = self._place(_take(t, "self_attn.o_proj.bias"))
        # float32 whatever the model's dtype: the attention kernels read the sinks so
        layer.sinks = _take(t, "self_attn.sinks").to(device=self.device, dtype=torch.float32).contiguous()
        return layer

    def num_weight_bytes(self) -> int:
        routers = sum(t.numel() * t.element_size() for pair in self.routers.values() for t in pair)
        return super().num_weight_bytes() + routers + sum(e.num_bytes() for e in self.experts.values())

    def init_dummy_weights(self, seed: int = 0) -> None:
        raise ValueError("load_format='dummy' is not supported for GptOssForCausalLM (a mixture-of-experts model): "
                         "save random weights as a checkpoint instead")

    # -- forward ---------------------------------------------------------------------------

    def mlp(self, index: int, layer: DecoderLayerWeights, x: torch.Tensor,
            lora: LoRABatch | None = None) -> torch.Tensor:
        weight, bias = self.routers[index]
        topk_weights, topk_ids = route_gpt_oss(self.backend.linear(x, weight, bias), self.moe.top_k)
        return self.experts[index](x, topk_weights, topk_ids)
