"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a flat batch
of tokens: no padding, every token of every request in one [num_tokens, hidden] matrix,
attention through the paged KV cache (each layer with its config's sliding window, if any).

Weights are plain tensors, not nn.Modules, so a step pays no module-dispatch overhead.
Q/K/V and gate/up projections are fused into one matmul each."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from actors.config import ModelConfig
from actors.layers.attention import AttentionBackend
from actors.layers.attention_metadata import AttentionMetadata
from actors.layers.tensor_parallel import TensorParallel
from kernels.rotary import build_cos_sin_cache

if TYPE_CHECKING:
    from actors.lora.batch import LoRABatch

# the groups of projections a LoRA batch adds to (actors/lora/slots.py's GROUPS)
_QKV, _O, _GATE_UP, _DOWN = range(4)
# the decoder's fused weights (DecoderLayerWeights' names) and the checkpoint modules in each
FUSED_PROJECTIONS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                     "down_proj": ("mlp.down_proj",)}


@dataclass
class DecoderLayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv_proj: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * num_kv_heads) * head_dim] (Qwen2)
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]
    down_proj: torch.Tensor  # [hidden, intermediate]
    o_bias: torch.Tensor | None = None  # [hidden] (GPT-OSS; added on every rank: a family with it runs on one)
    sinks: torch.Tensor | None = None  # [num_heads] float32: learned per-head logits in the softmax (GPT-OSS)


class LlamaModel:
    holds_embedding = True  # False on a pipeline stage after the first
    holds_head = True  # False on a pipeline stage before the last
    # the CPU's one-call step (cpu_step.py) runs its layer (with fused_layer_fields' additions:
    # gemma.py's); a family it cannot run (gpt_oss.py: sinks, experts) sets False, op by op
    fused_cpu_step = True
    # its layer is Llama's (the int8 smoothing's calibration pass runs that layer: int8_smoothing.py)
    llama_layer = True

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, parallel: TensorParallel = TensorParallel()) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.backend = backend
        self.parallel = parallel  # this rank's heads, features and vocabulary slice
        self.num_heads = parallel.num_heads(config)
        self.num_kv_heads = parallel.num_kv_heads(config)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        # each layer's sliding window (None: full attention), from the config (hybrid_config.py)
        self.sliding_windows: list[int | None] = [
            window or None for window in config.sliding_windows] or [None] * config.num_hidden_layers
        self.cos_sin_cache = build_cos_sin_cache(
            self.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        ).to(device)
        self.embed_tokens: torch.Tensor | None = None
        self.final_norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        self.layers: list[DecoderLayerWeights] = []

    # -- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes Hugging Face-named tensors and packs them into fused weights."""
        config = self.config
        by_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(config.num_hidden_layers)]
        top: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            tensor = tensor.to(self.dtype)
            if name.startswith("model.layers."):
                index, rest = name[len("model.layers."):].split(".", 1)
                by_layer[int(index)][rest] = tensor
            else:
                top[name] = tensor
        # a pipeline stage (actors/worker/pipeline.py) holds the embedding only when first,
        # the final norm and LM head only when last (a tied head: the embedding's rows)
        tied = config.tie_word_embeddings or "lm_head.weight" not in top
        if self.holds_embedding or (self.holds_head and tied):
            self.embed_tokens = self._place(_take(top, "model.embed_tokens.weight"))
        if self.holds_head:
            self.final_norm = self._place(_take(top, "model.norm.weight"))
            self.lm_head = self.embed_tokens if tied else self._place(top["lm_head.weight"])
        self.layers = [self._pack_layer(tensors) for tensors in by_layer]

    def _pack_layer(self, t: dict[str, torch.Tensor]) -> DecoderLayerWeights:
        attn, mlp = "self_attn.", "mlp."
        qkv = torch.cat([_take(t, f"{attn}{p}_proj.weight") for p in "qkv"])
        bias = None
        if self.config.attention_bias:
            bias = torch.cat([_take(t, f"{attn}{p}_proj.bias") for p in "qkv"])
        qk_norm = self.config.qk_norm
        return DecoderLayerWeights(
            input_norm=self._place(_take(t, "input_layernorm.weight")),
            qkv_proj=self._place(qkv),
            qkv_bias=self._place(bias) if bias is not None else None,
            q_norm=self._place(_take(t, f"{attn}q_norm.weight")) if qk_norm else None,
            k_norm=self._place(_take(t, f"{attn}k_norm.weight")) if qk_norm else None,
            o_proj=self._place(_take(t, f"{attn}o_proj.weight")),
            post_attention_norm=self._place(_take(t, "post_attention_layernorm.weight")),
            gate_up_proj=self._place(torch.cat([_take(t, f"{mlp}gate_proj.weight"),
                                                _take(t, f"{mlp}up_proj.weight")])),
            down_proj=self._place(_take(t, f"{mlp}down_proj.weight")),
        )

    def num_weight_bytes(self) -> int:
        """Bytes of weights this rank holds (a tied LM head counted once)."""
        tensors = {id(t): t for t in (self.embed_tokens, self.final_norm, self.lm_head) if t is not None}
        for layer in self.layers:
            tensors.update((id(t), t) for t in vars(layer).values() if t is not None)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of the right shapes, for benchmarks."""
        c = self.config
        # on a GPU drawn there, in the model's dtype: an 8B model's 32 GB of fp32 draws take
        # the CPU half a minute (the CPU's draws stay as they were: tests compare with them)
        on_gpu = self.device.type == "cuda"
        generator = torch.Generator(self.device if on_gpu else "cpu").manual_seed(seed)

        def rand(*shape: int) -> torch.Tensor:
            if on_gpu:
                return torch.randn(*shape, generator=generator, device=self.device, dtype=self.dtype) * 0.02
            return torch.randn(*shape, generator=generator) * 0.02

        weights = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size),
                   "model.norm.weight": torch.ones(c.hidden_size)}
        if not c.tie_word_embeddings:
            weights["lm_head.weight"] = rand(c.vocab_size, c.hidden_size)
        shapes = {"self_attn.q_proj": (self.q_size, c.hidden_size),
                  "self_attn.k_proj": (self.kv_size, c.hidden_size),
                  "self_attn.v_proj": (self.kv_size, c.hidden_size),
                  "self_attn.o_proj": (c.hidden_size, self.q_size),
                  "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
                  "mlp.up_proj": (c.intermediate_size, c.hidden_size),
                  "mlp.down_proj": (c.hidden_size, c.intermediate_size)}
        for layer in range(c.num_hidden_layers):
            prefix = f"model.layers.{layer}."
            for name, shape in shapes.items():
                weights[f"{prefix}{name}.weight"] = rand(*shape)
                if c.attention_bias and name[-6:] in ("q_proj", "k_proj", "v_proj"):
                    weights[f"{prefix}{name}.bias"] = rand(shape[0])
            for norm in ("input_layernorm", "post_attention_layernorm"):
                weights[f"{prefix}{norm}.weight"] = torch.ones(c.hidden_size)
            if c.qk_norm:
                for norm in ("self_attn.q_norm", "self_attn.k_norm"):
                    weights[f"{prefix}{norm}.weight"] = torch.ones(self.head_dim)
        self.load_weights((name, self.parallel.shard(name, tensor, c)) for name, tensor in weights.items())

    # -- forward ---------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] int64 -> [num_tokens, hidden]
        return self.parallel.embed(input_ids, self.embed_tokens, self.config.vocab_size)

    def forward(self, input_ids: torch.Tensor,  # [num_tokens] int64
                positions: torch.Tensor,  # [num_tokens] int64
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (key, value)
                attention: AttentionMetadata,
                lora: LoRABatch | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:  # [num_tokens, hidden]
        """The step op by op through the backend's kernels (the model runner may run it
        another way: actors/models/cpu_step.py mirrors this function). lora: the
        step's adapters, whose deltas each projection's output gets (before the all-reduce
        of a row-parallel one: the partial deltas sum as the partial outputs do)."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # (images' rows replaced)
        hidden, residual = self.run_layers(hidden, None, positions, kv_caches, attention, lora)
        return self.final_norm_of(hidden, residual)

    def run_layers(self, hidden: torch.Tensor,  # [num_tokens, hidden]
                   residual: torch.Tensor | None,  # [num_tokens, hidden], None before the first layer
                   positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   attention: AttentionMetadata, lora: LoRABatch | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This model's layers (a pipeline stage's share): the hidden states and residual
        after them, not yet added together."""
        ops = self.backend
        eps = self.config.rms_norm_eps
        for index, (layer, (key_cache, value_cache)) in enumerate(zip(self.layers, kv_caches)):
            # 1. attention block: norm (fused with the residual add), then attention_block
            x, residual = self.input_norm(hidden, residual, layer.input_norm)
            hidden = self.attention_block(index, layer, x, positions, self.cos_sin_cache, key_cache, value_cache,
                                          attention, lora)
            # 2. MLP block
            x, residual = ops.rms_norm(hidden, layer.post_attention_norm, eps, residual)
            hidden = self.mlp(index, layer, x, lora)
        return hidden, residual

    def takes_fused_cpu_step(self) -> bool:
        """Whether the CPU's one-call step can run this model's layers (moe.py: its experts)."""
        return True

    def fused_layer_fields(self, index: int) -> dict:
        """What the CPU's one-call step (cpu_step.py) takes of layer `index` beyond the Llama
        layer's weights: nothing here; a family whose layer adds to it (gemma.py) says what."""
        return {}

    def input_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's input norm, fused with the residual add (the first layer's residual is its input)."""
        if residual is None:
            return self.backend.rms_norm(hidden, weight, self.config.rms_norm_eps), hidden
        return self.backend.rms_norm(hidden, weight, self.config.rms_norm_eps, residual)

    def attention_block(self, index: int, layer: DecoderLayerWeights, x: torch.Tensor,  # [num_tokens, hidden], normed
                        positions: torch.Tensor, cos_sin_cache: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, attention: AttentionMetadata, lora: LoRABatch | None,
                        logits_soft_cap: float | None = None) -> torch.Tensor:  # [num_tokens, hidden]
        """One layer's attention: qkv, q/k norms (Qwen3) with rotary and the KV store (one
        kernel on the Triton backend), paged attention with the layer's window, o_proj (all-reduced)."""
        ops = self.backend
        attention = attention.for_layer(index)  # its layer group's block tables and slots
        num_tokens = x.shape[0]
        qkv = ops.linear(x, layer.qkv_proj, layer.qkv_bias)
        if lora is not None:
            lora.add(index, _QKV, x, qkv)
        q, k, v = self.split_qkv(index, qkv)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = ops.rotary_store_kv(positions, q, k, v, cos_sin_cache, key_cache, value_cache,
                                   attention.slot_mapping, layer.q_norm, layer.k_norm, self.config.rms_norm_eps)
        attn = ops.attention(q, k, v, key_cache, value_cache, attention, self.scale,
                             sliding_window=self.sliding_windows[index], logits_soft_cap=logits_soft_cap,
                             sinks=layer.sinks)
        attn = attn.view(num_tokens, self.q_size)
        hidden = ops.linear(attn, layer.o_proj, layer.o_bias)
        if lora is not None:
            lora.add(index, _O, attn, hidden)
        return self.parallel.all_reduce(hidden)

    def split_qkv(self, index: int, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of layer index's fused projection output (a family with norms over the
        whole projections overrides it: actors/models/moe.py's OLMoE)."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def mlp(self, index: int, layer: DecoderLayerWeights, x: torch.Tensor,
            lora: LoRABatch | None = None) -> torch.Tensor:
        """The MLP block of one layer over its normed input, reduced across ranks (a
        mixture-of-experts model overrides it for its sparse layers: actors/models/moe.py)."""
        ops = self.backend
        gate_up = ops.linear(x, layer.gate_up_proj)
        if lora is not None:
            lora.add(index, _GATE_UP, x, gate_up)
        x = ops.silu_mul(gate_up)
        hidden = ops.linear(x, layer.down_proj)
        if lora is not None:
            lora.add(index, _DOWN, x, hidden)
        return self.parallel.all_reduce(hidden)

    def final_norm_of(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if residual is None:
            return self.backend.rms_norm(hidden, self.final_norm, eps)
        return self.backend.rms_norm(hidden, self.final_norm, eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [n, hidden] -> [n, vocab] fp32
        """The logits on rank 0 (None on the other ranks of a tensor-parallel group)."""
        return self.parallel.gather_logits(self.backend.linear(hidden, self.lm_head).float(), self.config.vocab_size)


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"checkpoint is missing weight {name!r}")
    return tensors[name]
