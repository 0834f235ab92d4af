"""Mixture-of-experts decoders: Hugging Face's Qwen3MoeForCausalLM, Qwen2MoeForCausalLM (with
its shared expert and sigmoid gate), MixtralForCausalLM and OlmoeForCausalLM.

Each is the Llama-family decoder (llama.py: attention, norms, rotary, the paged KV cache)
whose sparse layers' MLP is a router and experts: the router's softmax top-k (renormalised
where norm_topk_prob is set; always for Mixtral), then the fused experts
(actors/layers/fused_moe.py). Layers outside ModelConfig.moe.sparse_layers (Qwen's
mlp_only_layers and decoder_sparse_step) keep a dense MLP. OLMoE normalises the whole q and
k projections (not each head) and may clamp q, k and v.

The per-expert checkpoint tensors ("<block>.experts.<e>.<gate|up|down>.weight") are
stacked at load into the kernels' layouts. Tensor parallelism slices every expert as the
dense MLP is sliced; expert parallelism gives each rank whole experts
(actors/layers/tensor_parallel.py reads only this rank's part). Either way each rank's
block output is a part of the sum, which the all-reduce after it completes.

These models run through the Python forward, op by op (actors/models/cpu_step.py's one-call
C++ step has no MoE block yet)."""

from __future__ import annotations

import ctypes

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from actors.config import ModelConfig
from actors.layers.attention import AttentionBackend
from actors.layers.fused_moe import FusedExperts
from actors.layers.tensor_parallel import TensorParallel
from actors.models.llama import DecoderLayerWeights, LlamaModel, _take

if TYPE_CHECKING:
    from actors.lora.batch import LoRABatch

_PREFIX = "model.layers."
_NO_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@dataclass
class SparseMlpWeights:
    router: torch.Tensor  # [num_experts, hidden]
    experts: FusedExperts
    shared_gate_up: torch.Tensor | None = None  # Qwen2-MoE: [2 * shared intermediate (this rank's), hidden]
    shared_down: torch.Tensor | None = None  # [hidden, shared intermediate (this rank's)]
    shared_gate: torch.Tensor | None = None  # [1, hidden]: sigmoid(x @ it.T) scales the shared expert


class MoeModel(LlamaModel):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, parallel: TensorParallel = TensorParallel()) -> None:
        if config.moe is None:
            raise ValueError(f"{config.architecture}: the config has no experts (ModelConfig.moe)")
        super().__init__(config, dtype, device, backend, parallel)
        self.moe = config.moe
        self.sparse: dict[int, SparseMlpWeights] = {}  # layer index -> its router and experts
        # OLMoE: layer index -> (q_norm [this rank's q_size], k_norm [this rank's kv_size])
        self.whole_qk_norms: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # layer index -> (its experts' weights, the MoeExperts struct the one-call step reads)
        self._fused_experts: dict[int, tuple] = {}
        if self.moe.whole_qk_norm and parallel.enabled and config.num_key_value_heads < parallel.size:
            raise ValueError(f"{config.architecture}: the k norm over the whole projection needs the KV heads "
                             f"split over the ranks ({config.num_key_value_heads} KV heads, tensor_parallel_size "
                             f"{parallel.size})")

    # -- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The decoder's tensors to llama.py; the sparse layers' routers and experts, and
        OLMoE's q/k norms, kept aside and packed here."""
        moe = self.moe
        block = f"{moe.block}."
        sparse: dict[int, dict[str, torch.Tensor]] = {index: {} for index in moe.sparse_layers}
        qk_norms: dict[int, dict[str, torch.Tensor]] = {}

        def decoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(_PREFIX):
                    index, rest = name[len(_PREFIX):].split(".", 1)
                    if int(index) in sparse and rest.startswith(block):
                        sparse[int(index)][rest[len(block):]] = tensor
                        continue
                    if moe.whole_qk_norm and rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                        qk_norms.setdefault(int(index), {})[rest] = tensor
                        continue
                yield name, tensor

        super().load_weights(decoder_weights())
        self.sparse = {index: self._pack_sparse(tensors) for index, tensors in sparse.items()}
        if moe.whole_qk_norm:
            self.whole_qk_norms = {index: self._whole_qk_norms(norms) for index, norms in qk_norms.items()}

    def _pack_layer(self, t: dict[str, torch.Tensor]) -> DecoderLayerWeights:
        if _NO_DENSE_MLP[0] in t:
            return super()._pack_layer(t)
        # a sparse layer: its MLP is in self.sparse, so llama.py packs no dense one
        layer = super()._pack_layer({**t, **{name: torch.empty(0) for name in _NO_DENSE_MLP}})
        layer.gate_up_proj = layer.down_proj = None
        return layer

    def _pack_sparse(self, t: dict[str, torch.Tensor]) -> SparseMlpWeights:
        moe = self.moe
        gate, up, down = moe.projections
        first, count = self.parallel.expert_range(moe.num_experts)
        experts = range(first, first + count)
        w13 = torch.stack([torch.cat([_take(t, f"experts.{e}.{gate}.weight"), _take(t, f"experts.{e}.{up}.weight")])
                           for e in experts]).to(device=self.device, dtype=self.dtype)
        w2 = torch.stack([_take(t, f"experts.{e}.{down}.weight") for e in experts]).to(self.device, self.dtype)
        weights = SparseMlpWeights(router=self._place(_take(t, "gate.weight")),
                                   experts=FusedExperts.build(w13, w2, moe.num_experts, first))
        if moe.shared_expert_intermediate_size:
            weights.shared_gate_up = self._place(torch.cat([_take(t, "shared_expert.gate_proj.weight"),
                                                            _take(t, "shared_expert.up_proj.weight")]))
            weights.shared_down = self._place(_take(t, "shared_expert.down_proj.weight"))
            weights.shared_gate = self._place(_take(t, "shared_expert_gate.weight"))
        return weights

    # -- the CPU's one-call step (cpu_step.py) ----------------------------------------------

    def takes_fused_cpu_step(self) -> bool:
        """model_step_f32 runs a sparse layer as mlp() does where its experts are moe_cpu.cpp's,
        all on this rank, with no shared expert (Qwen2-MoE's) and Llama's q/k (not OLMoE's
        whole-projection norms)."""
        from kernels.moe_cpu import moe_cpu_kernels

        return (not self.moe.whole_qk_norm and moe_cpu_kernels() is not None
                and all(s.experts.cpu is not None and s.experts.num_local_experts == s.experts.num_experts
                        and s.shared_gate_up is None for s in self.sparse.values()))

    def fused_layer_fields(self, index: int) -> dict:
        sparse = self.sparse.get(index)
        if sparse is None:
            return super().fused_layer_fields(index)
        from kernels.moe_cpu import moe_cpu_kernels

        kernels = moe_cpu_kernels()
        # (the struct points into the experts' weights; the model keeps it as long as them, and
        # describes them again once they are reloaded)
        struct = self._fused_experts.get(index)
        if struct is None or struct[0] is not sparse.experts.cpu:
            struct = self._fused_experts[index] = (sparse.experts.cpu, kernels.describe(sparse.experts.cpu))
        router = sparse.router
        return dict(experts=ctypes.addressof(struct[1]), router=router,
                    router_type=getattr(router, "weight_type", getattr(router, "ggml_type", 0)),
                    num_experts=self.moe.num_experts, top_k=self.moe.top_k, renormalize=int(self.moe.norm_topk_prob),
                    moe_experts=kernels.experts_address)

    def _whole_qk_norms(self, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMoE's norm weights over the whole projections, cut to this rank's heads."""
        q_start = self.parallel.rank * self.q_size if self.parallel.enabled else 0
        kv_start = self.parallel.kv_head_start(self.config) * self.head_dim
        q_norm = _take(t, "self_attn.q_norm.weight")[q_start:q_start + self.q_size]
        k_norm = _take(t, "self_attn.k_norm.weight")[kv_start:kv_start + self.kv_size]
        return self._place(q_norm), self._place(k_norm)

    def num_weight_bytes(self) -> int:
        total = super().num_weight_bytes() + sum(sum(t.numel() * t.element_size() for t in n)
                                                 for n in self.whole_qk_norms.values())
        for sparse in self.sparse.values():
            tensors = (sparse.router, sparse.shared_gate_up, sparse.shared_down, sparse.shared_gate)
            total += sparse.experts.num_bytes() + sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return total

    def use_gguf_experts(self, tensors: dict, kernels) -> None:
        """The sparse layers' experts as a GGUF file's blocks (ffn_gate_exps and ffn_up_exps
        concatenated per expert, gate first; ffn_down_exps), in place of the fp32 ones the
        converted checkpoint gave (actors/quantization/gguf.py calls it): moe_cpu.cpp
        multiplies the blocks, never dequantized. The router and Qwen2-MoE's shared expert stay fp32."""
        import numpy as np

        def blocks(name: str) -> tuple[torch.Tensor, int]:
            tensor = tensors[name]
            in_features, out_features, num_experts = (int(d) for d in tensor.shape)  # fastest-first
            ggml_type = int(tensor.tensor_type)
            rows = np.asarray(tensor.data).reshape(num_experts, out_features, kernels.row_bytes(ggml_type, in_features))
            return torch.from_numpy(np.array(rows)), ggml_type  # a copy: the reader maps the file read-only

        for index, sparse in self.sparse.items():
            prefix = f"blk.{index}."
            (gate, w13_type), (up, _) = blocks(f"{prefix}ffn_gate_exps.weight"), blocks(f"{prefix}ffn_up_exps.weight")
            w2, w2_type = blocks(f"{prefix}ffn_down_exps.weight")
            sparse.experts = FusedExperts.from_gguf(torch.cat([gate, up], dim=1), w13_type, w2, w2_type,
                                                    self.config.hidden_size, self.moe.intermediate_size)

    def init_dummy_weights(self, seed: int = 0) -> None:
        raise ValueError(f"load_format='dummy' is not supported for {self.config.architecture} (a mixture-of-"
                         "experts model): save random weights as a checkpoint instead (benchmarks/moe_offline.py)")

    # -- forward ---------------------------------------------------------------------------

    def split_qkv(self, index: int, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().split_qkv(index, qkv)
        if self.moe.whole_qk_norm:
            q_norm, k_norm = self.whole_qk_norms[index]
            q, k = self._whole_norm(q, q_norm, self.q_size), self._whole_norm(k, k_norm, self.kv_size)
        if self.moe.clip_qkv is not None:
            clip = self.moe.clip_qkv
            q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
        return q, k, v

    def _whole_norm(self, x: torch.Tensor, weight: torch.Tensor, local_size: int) -> torch.Tensor:
        """RMSNorm over the whole projection, which tensor parallelism splits over the ranks:
        each rank's sum of squares, summed across them."""
        squares = x.float().pow(2).sum(-1, keepdim=True)
        if self.parallel.enabled:
            squares = self.parallel.all_reduce(squares)
        variance = squares / (local_size * (self.parallel.size if self.parallel.enabled else 1))
        return (x.float() * torch.rsqrt(variance + self.config.rms_norm_eps)).to(x.dtype) * weight

    def mlp(self, index: int, layer: DecoderLayerWeights, x: torch.Tensor,
            lora: LoRABatch | None = None) -> torch.Tensor:
        sparse = self.sparse.get(index)
        if sparse is None:
            return super().mlp(index, layer, x, lora)
        ops = self.backend
        router_logits = ops.linear(x, sparse.router)
        out = sparse.experts(x, router_logits, self.moe.top_k, self.moe.norm_topk_prob)
        if sparse.shared_gate_up is not None:
            # linear in the shared expert's output: each rank's partial sum scaled by the same gate
            shared = ops.linear(ops.silu_mul(ops.linear(x, sparse.shared_gate_up)), sparse.shared_down)
            out = out + torch.sigmoid(ops.linear(x, sparse.shared_gate)) * shared
        return self.parallel.all_reduce(out)
