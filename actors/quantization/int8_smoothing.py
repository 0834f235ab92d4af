"""SmoothQuant-style smoothing of a decoder's linears before int8 W8A8 quantization.

A few input channels of each linear carry activations far larger than the rest, so a row
quantized to int8 by its absolute maximum rounds the other channels coarsely. Smoothing divides
input channel j of a linear by s_j and multiplies the weight's column j by s_j (the product is
unchanged), with s_j = max|x_j|**alpha / max|W_j|**(1 - alpha): the activations' outliers move
into the weights, which are quantized per output channel at load time.

The division costs nothing per step: it is folded into whatever produces the linear's input,
each an exact rescaling in float:
- qkv_proj, gate_up_proj: the RMSNorm weight before them (input_norm, post_attention_norm);
- o_proj: v_proj's output rows (attention mixes each value channel linearly; the q heads that
  share a kv head share its factors);
- down_proj: up_proj's output rows (silu(gate) * up is linear in up).
v_proj's and up_proj's rows are quantized per row, so their rescaling changes nothing there.

max|x_j| comes from one forward pass in fp32 over a short calibration text shipped for it
(int8_calibration.txt, written for this, not the benchmark's text): activation outlier
channels are a property of the model, which a few hundred tokens of prose show."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F

from actors.models.llama import DecoderLayerWeights

CALIBRATION_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "int8_calibration.txt")
CALIBRATION_TOKENS = 512  # the first tokens of the calibration text that one forward pass sees
# how much of an outlier moves into the weights (SmoothQuant's default; 0: no smoothing, which
# benchmarks/quality.py's int8:no-smoothing measures)
SMOOTHING_ALPHA = 0.5


def calibration_token_ids(tokenizer_path: str) -> list[int]:
    """The calibration text's first CALIBRATION_TOKENS tokens."""
    from actors.models.loader import load_tokenizer

    with open(CALIBRATION_TEXT, encoding="utf-8") as file:
        text = file.read()
    return load_tokenizer(tokenizer_path)(text, add_special_tokens=False)["input_ids"][:CALIBRATION_TOKENS]


@torch.no_grad()
def activation_maxima(model, token_ids: list[int]) -> list[dict[str, torch.Tensor]]:
    """Per layer, each projection's per-input-channel max |x| over one causal fp32 forward of
    token_ids as one sequence (plain torch attention: no KV cache needed). Under tensor
    parallelism every rank calls it (the row-parallel outputs are all-reduced): each gets its
    own shards' maxima."""
    ops, eps = model.backend, model.config.rms_norm_eps
    ids = torch.tensor(token_ids, dtype=torch.int64)
    positions = torch.arange(len(token_ids))
    hidden = model.embed(ids).float()
    group = model.num_heads // model.num_kv_heads
    maxima = []
    for layer in model.layers:
        seen = {}
        x = ops.rms_norm(hidden.clone(), layer.input_norm, eps)
        seen["qkv_proj"] = x.abs().amax(0)
        qkv = F.linear(x, layer.qkv_proj, layer.qkv_bias)
        q, k, v = qkv.split([model.q_size, model.kv_size, model.kv_size], dim=-1)
        q = q.reshape(-1, model.num_heads, model.head_dim).contiguous()
        k = k.reshape(-1, model.num_kv_heads, model.head_dim).contiguous()
        if layer.q_norm is not None:
            q = ops.rms_norm(q.reshape(-1, model.head_dim), layer.q_norm, eps).view_as(q)
            k = ops.rms_norm(k.reshape(-1, model.head_dim), layer.k_norm, eps).view_as(k)
        q, k = ops.rotary(positions, q, k, model.cos_sin_cache)
        v = v.reshape(-1, model.num_kv_heads, model.head_dim)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
            v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True, scale=model.scale)
        attn = attn.transpose(0, 1).reshape(-1, model.q_size)
        seen["o_proj"] = attn.abs().amax(0)
        hidden = hidden + model.parallel.all_reduce(F.linear(attn, layer.o_proj))
        x = ops.rms_norm(hidden.clone(), layer.post_attention_norm, eps)
        seen["gate_up_proj"] = x.abs().amax(0)
        gate, up = F.linear(x, layer.gate_up_proj).chunk(2, dim=-1)
        x = F.silu(gate) * up
        seen["down_proj"] = x.abs().amax(0)
        hidden = hidden + model.parallel.all_reduce(F.linear(x, layer.down_proj))
        maxima.append(seen)
    return maxima


def smoothing_factors(activation_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's s_j = max|x_j|**alpha / max|W_j|**(1 - alpha) per input channel j, where
    both maxima are positive (else 1)."""
    usable = (activation_max > 0) & (weight_max > 0)
    factors = activation_max.clamp_min(1e-5).pow(alpha) / weight_max.clamp_min(1e-5).pow(1 - alpha)
    return torch.where(usable, factors, torch.ones_like(factors))


def column_maxima(weight: torch.Tensor, parallel=None) -> torch.Tensor:
    """max|W_j| over the output rows of a column-parallel weight [out, in]; with tensor
    parallelism over every rank's rows, so each rank smooths as one device does."""
    maxima = weight.abs().amax(0)
    if parallel is not None and parallel.enabled:
        torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX, group=parallel.group)
    return maxima


def smoothed_layer(layer: DecoderLayerWeights, maxima: dict[str, torch.Tensor], num_heads: int,
                   num_kv_heads: int, head_dim: int, alpha: float = SMOOTHING_ALPHA,
                   parallel=None) -> DecoderLayerWeights:
    """The layer's fp32 weights with each projection's inputs smoothed, the division folded
    into what produces them (the module docstring); the same function in float arithmetic.
    parallel: the rank's TensorParallel where the weights are its shards."""
    changes = {}
    s = smoothing_factors(maxima["qkv_proj"], column_maxima(layer.qkv_proj, parallel), alpha)
    changes["input_norm"], changes["qkv_proj"] = layer.input_norm / s, layer.qkv_proj * s
    s = smoothing_factors(maxima["gate_up_proj"], column_maxima(layer.gate_up_proj, parallel), alpha)
    changes["post_attention_norm"], gate_up = layer.post_attention_norm / s, layer.gate_up_proj * s
    # o_proj: one factor per kv-head channel, from the maxima over the q heads sharing it
    group = num_heads // num_kv_heads
    o_max = maxima["o_proj"].view(num_kv_heads, group, head_dim).amax(1)
    o_weight_max = layer.o_proj.abs().amax(0).view(num_kv_heads, group, head_dim).amax(1)
    s_v = smoothing_factors(o_max.flatten(), o_weight_max.flatten(), alpha)
    changes["o_proj"] = layer.o_proj * s_v.view(num_kv_heads, 1, head_dim).expand(-1, group, -1).flatten()
    v_rows = slice(layer.qkv_proj.shape[0] - num_kv_heads * head_dim, None)
    qkv = changes["qkv_proj"].clone()
    qkv[v_rows] /= s_v[:, None]
    changes["qkv_proj"] = qkv
    if layer.qkv_bias is not None:
        bias = layer.qkv_bias.clone()
        bias[v_rows] /= s_v
        changes["qkv_bias"] = bias
    # down_proj: folded into up_proj's rows (the second half of gate_up_proj)
    s = smoothing_factors(maxima["down_proj"], layer.down_proj.abs().amax(0), alpha)
    changes["down_proj"] = layer.down_proj * s
    gate_up[gate_up.shape[0] // 2:] /= s[:, None]
    changes["gate_up_proj"] = gate_up
    return dataclasses.replace(layer, **{name: t.contiguous() for name, t in changes.items()})


def smooth_model(model, token_ids: list[int], alpha: float | None = None) -> None:
    """Replaces model.layers with smoothed fp32 layers (before their projections are packed).
    Token ids past the model's vocabulary (a test model's tokenizer may be larger) are dropped."""
    alpha = SMOOTHING_ALPHA if alpha is None else alpha
    token_ids = [token for token in token_ids if token < model.config.vocab_size]
    if not token_ids or alpha == 0:
        return
    maxima = activation_maxima(model, token_ids)
    model.layers = [smoothed_layer(layer, seen, model.num_heads, model.num_kv_heads, model.head_dim, alpha,
                                   model.parallel) for layer, seen in zip(model.layers, maxima, strict=True)]
