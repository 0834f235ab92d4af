"""Mixture-of-experts: the router's top-k and the experts' combined output, in plain torch.
The oracle of the fused kernels (kernels/fused_moe_triton.py for CUDA, kernels/moe_cpu.py on
the CPU) and the semantics of Hugging Face's sparse MoE blocks.

Layouts (what a loader stacks an MoE layer's per-expert checkpoint tensors into):
- w13 [num_experts, 2 * intermediate, hidden]: expert e's gate_proj.weight [I, H] in rows
  [0, I), its up_proj.weight [I, H] in rows [I, 2I) (torch.cat((gate, up), 0) per expert,
  then torch.stack over experts); GGUF's ffn_gate_exps / ffn_up_exps, row for row.
- w2 [num_experts, hidden, intermediate]: expert e's down_proj.weight (ffn_down_exps).
- topk_ids [num_tokens, top_k] (int32 or int64), topk_weights [num_tokens, top_k] (float32):
  each token's experts and their weights, in the router's order (highest weight first). An
  id of -1 is an expert held elsewhere (expert parallelism: local_expert_ids maps the global
  ids to this rank's): it adds nothing here, and the ranks' outputs sum to the whole.
- w13_bias [num_experts, 2 * intermediate], w2_bias [num_experts, hidden] (optional, float):
  added to each GEMM's output before the activation, and before the top-k weight (GPT-OSS).

Activations:
- "silu" (every family of issue 38): silu(gate) * up, w13's gate rows before its up rows.
- "swigluoai" (GPT-OSS, vLLM's name for it; Hugging Face's GptOssExperts._apply_gate): w13's
  rows interleaved as the checkpoint stores them (row 2i gate i, row 2i + 1 up i), then
  gate = min(gate, 7), up = clamp(up, -7, 7), (up + 1) * gate * sigmoid(1.702 * gate).

Routers of the families in issue 38 (all softmax in float32 over every expert, then top-k):
- Qwen3-MoE (norm_topk_prob defaults to True), OLMoE and Qwen2-MoE (False by default): the
  top-k probabilities, renormalised to sum to 1 where norm_topk_prob is set.
- Mixtral: softmax over the k largest logits. Softmax is monotone, so its top-k experts are
  those of the logits, and softmax over k logits is the renormalised top-k of the softmax
  over all of them: route(..., renormalize=True).
Qwen2-MoE's shared expert (a dense MLP with a sigmoid gate, added to every token) is the
model's, not the router's: it is not an expert here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor,  # [num_tokens, num_experts]
          top_k: int,
          renormalize: bool,  # Qwen3-MoE's norm_topk_prob; True for Mixtral
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int32):
    softmax over the experts in float32, the top_k largest (ties: torch.topk's order),
    renormalised to sum to 1 if asked. Hugging Face then casts the weights to the model's
    dtype before it multiplies; the kernels take them in float32."""
    probabilities = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


def route_mixtral(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's convention spelled as Mixtral writes it (softmax over the top-k logits): equal
    to route(router_logits, top_k, renormalize=True) to fp32 rounding (the tests check it)."""
    top_logits, topk_ids = torch.topk(router_logits.float(), top_k, dim=-1)
    return torch.softmax(top_logits, dim=-1), topk_ids.to(torch.int32)


def local_expert_ids(topk_ids: torch.Tensor,  # [num_tokens, top_k]: global expert ids
                     first_expert: int, num_local_experts: int) -> torch.Tensor:
    """A rank's view of the routing when it holds experts [first_expert, first_expert +
    num_local_experts) (stacked from 0 in its w13 and w2): their local ids, -1 elsewhere."""
    local = topk_ids - first_expert
    return torch.where((local >= 0) & (local < num_local_experts), local, -1).to(topk_ids.dtype)


SWIGLUOAI_ALPHA = 1.702  # GPT-OSS's config.swiglu_alpha (Hugging Face hard-codes it too)
SWIGLUOAI_LIMIT = 7.0  # its swiglu_limit


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [rows, 2I] -> [rows, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(gate_up: torch.Tensor,  # [rows, 2I]: gate and up interleaved
                   alpha: float = SWIGLUOAI_ALPHA, limit: float = SWIGLUOAI_LIMIT) -> torch.Tensor:  # [rows, I]
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _swigluoai_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [rows, 2I] interleaved -> [rows, I]
    return clamped_swiglu(gate_up)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": _silu_and_mul, "swigluoai": _swigluoai_and_mul}


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:  # GeLU experts would come here
        raise ValueError(f"activation {name!r}: one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def fused_experts_ref(x: torch.Tensor,  # [num_tokens, hidden]
                      w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: rows in the activation's order
                      w2: torch.Tensor,  # [num_experts, hidden, intermediate]
                      topk_weights: torch.Tensor,  # [num_tokens, top_k]
                      topk_ids: torch.Tensor,  # [num_tokens, top_k]
                      activation: str = "silu",
                      *,
                      quantize_activations: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate]
                      w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
                      ) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """out[t] = sum over k of topk_weights[t, k] * down_e(act(gate_up_e(x[t]))), e =
    topk_ids[t, k], each projection with its bias if given. In float32, with the activation's
    output rounded to x's dtype (what the kernels and Hugging Face's bf16 modules feed the
    down projection); each token's k terms summed in top-k order. quantize_activations: what
    a quantized kernel does to each GEMM's input rows (x, then the activation's output) before
    it multiplies them, for the oracle of W8A8 and GGUF."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, two_i // 2)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    act = _activation(activation)
    prepare = quantize_activations if quantize_activations is not None else (lambda rows: rows)
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).float()
    token_of_slot = torch.arange(num_tokens * top_k, device=x.device) // top_k
    per_slot = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    for expert in flat_ids.unique().tolist():
        if expert < 0:  # held by another rank
            continue
        slots = (flat_ids == expert).nonzero().squeeze(1)
        rows = prepare(x[token_of_slot[slots]].float())
        gate_up = rows @ w13[expert].float().T
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert].float()
        h = act(gate_up).to(x.dtype).float()
        down = prepare(h) @ w2[expert].float().T
        if w2_bias is not None:
            down = down + w2_bias[expert].float()
        per_slot[slots] = down * weights[slots, None]
    return per_slot.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def dense_mlp_ref(x: torch.Tensor,  # [num_tokens, hidden]
                  w13: torch.Tensor,  # [2 * intermediate, hidden]
                  w2: torch.Tensor,  # [hidden, intermediate]
                  ) -> torch.Tensor:
    """One expert applied to every token with weight 1 (a dense SwiGLU MLP): the benchmark's
    baseline, and a check that an MoE of one expert and top-1 is that MLP."""
    ids = torch.zeros(x.shape[0], 1, dtype=torch.int32, device=x.device)
    ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
    return fused_experts_ref(x, w13[None], w2[None], ones, ids)
