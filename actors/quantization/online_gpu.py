"""`--quantization fp8` and `--quantization int8` on an unquantized checkpoint, on GPUs: each
projection quantized once at load (vLLM's online dynamic quantization), run by the quantized
checkpoints' Triton/torch GEMMs (checkpoint_gpu.PackedWeightBackend, kernels/quant_triton.py).

- fp8: each logical weight (q, k, v, o, gate, up, down) to float8_e4m3fn with one scale per
  tensor (its absolute maximum over 448), as vLLM's Fp8LinearMethod does for an unquantized
  checkpoint; fused q/k/v and gate/up keep their parts' scales, one per output row. On GPUs with
  FP8 (compute capability 8.9+) and bf16 activations torch._scaled_mm runs it with activations
  quantized to E4M3 per token each step; elsewhere the Triton kernel decodes the E4M3 weights
  (weight-only), which is what the CPU tests run under triton's interpreter.
- int8: each weight per output channel to int8 (as the CPU's W8A8), activations per token to
  int8 each step, the Triton int8 GEMM accumulating in int32.

The float projections are replaced as each is quantized; the LM head and embeddings stay in
the model's dtype."""

from __future__ import annotations

import logging

import torch

from actors.quantization.checkpoint_gpu import Fp8Weight, PackedWeightBackend, W8A8Weight
from kernels.int8_linear import quantize_rows_reference

logger = logging.getLogger(__name__)

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight / scale as float8_e4m3fn, scale float32 []) with scale = max|weight| / 448."""
    scale = (weight.detach().float().abs().amax() / FP8_MAX).clamp_min(1e-12)
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_weight(weight: torch.Tensor, parts: list[int]) -> Fp8Weight:
    """A fused [out, in] weight whose rows are the logical weights of `parts` rows each, each
    part quantized per tensor; the scale is spread over the part's rows."""
    quantized, scales = [], []
    for part in weight.split(parts):
        q, scale = quantize_fp8_per_tensor(part)
        quantized.append(q)
        scales.append(scale.expand(part.shape[0]))
    return Fp8Weight(torch.cat(quantized).contiguous(), torch.cat(scales).contiguous())


def int8_weight(weight: torch.Tensor) -> W8A8Weight:
    """An [out, in] weight to int8 per output row (quantize_rows_reference, as the CPU's W8A8)."""
    qweight, scale = quantize_rows_reference(weight.detach().float())
    return W8A8Weight(qweight.contiguous(), scale.view(-1).contiguous())


def _parts(model, name: str, rows: int) -> list[int]:
    """The logical weights' row counts of a fused projection on this rank."""
    if name == "qkv_proj":
        return [model.q_size, model.kv_size, model.kv_size]
    if name == "gate_up_proj":
        return [rows // 2, rows // 2]
    return [rows]


def use_online_weights(model, backend, method: str) -> PackedWeightBackend:
    """Quantizes model's projections to `method` ("fp8" or "int8") in place and returns the
    backend that runs them (the model's from then on)."""
    assert method in ("fp8", "int8"), method
    float_bytes = model.num_weight_bytes()
    for layer in model.layers:
        for name in PROJECTIONS:
            weight = getattr(layer, name)
            if isinstance(weight, Fp8Weight):  # (W8A8Weight too) weights loaded again: already quantized
                continue
            quantized = fp8_weight(weight, _parts(model, name, weight.shape[0])) if method == "fp8" \
                else int8_weight(weight)
            setattr(layer, name, quantized)
            del weight
    if isinstance(backend, PackedWeightBackend):
        model.backend = backend
        return backend
    model.backend = PackedWeightBackend(backend)
    logger.info("%s weights quantized at load: %.0f MB, were %.0f MB", method, model.num_weight_bytes() / 1e6,
                float_bytes / 1e6)
    return model.backend
