"""`--quantization int8` for decoders on the CPU: W8A8 with dynamic per-token activation scales.

The model loads its checkpoint in fp32 as usual (fp16/bf16 checkpoints converted, a .gguf
model dequantized by gguf_convert.py); then use_int8_weights() quantizes each projection
(q/k/v, o, gate/up, down; the LM head on request) per output channel to int8 and packs them for
kernels/int8_gemm.cpp, which the fused step (cpu_model_step.py: the weight type
INT8_WEIGHT_TYPE through DecoderShape.quant_linear) and the op-by-op forward
(Int8CpuBackend.linear) both run. The embedding table, LM head,
norms and biases stay fp32.

int8_model_reference() is the plain-torch oracle the tests hold the whole model to: the
same quantized weights dequantized, each linear's input quantized per row the same way."""

from __future__ import annotations

import logging

import torch

from actors.quantization.int8_check import Int8Error
from actors.quantization.int8_smoothing import smooth_model
from actors.layers.attention import CpuBackend
from kernels.int8_gemm import Int8GemmKernels, PackedInt8Weight, int8_gemm_kernels

logger = logging.getLogger(__name__)

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The LM head stays fp32 by default: in int8 it moved SmolLM2's perplexity on
# benchmarks/quality.py's text (first 4000 tokens) from +2.58% to +2.98% against fp32, at the
# edge of the 3% target, and it runs only for the rows that sample (int8:int8-head there
# measures it; use_int8_weights(lm_head=True) quantizes it)
QUANTIZE_LM_HEAD = False


class Int8CpuBackend(CpuBackend):
    """The CPU backend, with linear layers that also take packed int8 weights. `kernels` is
    what cpu_model_step.py reads for DecoderShape.quant_linear."""

    def __init__(self, backend: CpuBackend, kernels: Int8GemmKernels) -> None:
        super().__init__(backend.native)
        self.few_rows, self.fused_steps = backend.few_rows, backend.fused_steps
        self.kernels = kernels

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, PackedInt8Weight):
            return self.kernels.linear(x if x.stride(-1) == 1 else x.contiguous(), weight, bias)
        return super().linear(x, weight, bias)


def use_int8_weights(model, backend: CpuBackend, lm_head: bool | None = None,
                     calibration_ids: list[int] | None = None) -> Int8CpuBackend:
    """Quantizes model's projections (and its LM head where lm_head, default QUANTIZE_LM_HEAD)
    to packed int8 and swaps its backend for one that runs them (returned: the model runner's
    backend from then on). calibration_ids: tokens whose fp32 activations smooth the
    projections' inputs first (int8_smoothing.py); None: quantized as they are."""
    kernels = int8_gemm_kernels()
    if kernels is None:
        raise Int8Error("--quantization int8 needs the C++ kernels, which did not build (no C++ compiler?)")
    fp32_bytes = model.num_weight_bytes()
    float_layers = not any(isinstance(getattr(layer, name), PackedInt8Weight)
                           for layer in model.layers for name in PROJECTIONS)
    if calibration_ids and float_layers:
        smooth_model(model, calibration_ids)
    for layer in model.layers:
        for name in PROJECTIONS:
            weight = getattr(layer, name)
            if not isinstance(weight, PackedInt8Weight):
                setattr(layer, name, kernels.pack(weight))
    if (QUANTIZE_LM_HEAD if lm_head is None else lm_head) and model.lm_head is not None and not isinstance(model.lm_head, PackedInt8Weight):
        model.lm_head = kernels.pack(model.lm_head)
    if isinstance(backend, Int8CpuBackend):  # weights loaded again (sleep level 2): the same backend
        model.backend = backend
        return backend
    quantized = Int8CpuBackend(backend, kernels)
    model.backend = quantized
    logger.info("int8 W8A8 weights (VNNI %s): %.0f MB, were %.0f MB in fp32", "yes" if kernels.uses_vnni else "no",
                model.num_weight_bytes() / 1e6, fp32_bytes / 1e6)
    return quantized


def dequantized(weight: PackedInt8Weight) -> torch.Tensor:
    """The float64 weight the int8 one stands for: qweight * its row's scale."""
    return weight.qweight.double() * weight.scale[:weight.shape[0]].double()[:, None]


def int8_linear_reference(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle's linear: x quantized per row as the kernel does (a float weight: x as it
    is), dequantized, in float64; returned in float32."""
    from kernels.int8_linear import quantize_rows_reference

    if not isinstance(weight, PackedInt8Weight):
        out = x.double() @ weight.double().T
    else:
        qx, x_scale = quantize_rows_reference(x.float())
        out = (qx.double() * x_scale.double()) @ dequantized(weight).T
    if bias is not None:
        out = out + bias.double()
    return out.float()
