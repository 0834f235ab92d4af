"""A quantized checkpoint's weights on the CPU: each quantized linear's packed tensors
(qweight/qzeros/scales/g_idx, weight_packed/weight_scale/weight_shape/weight_g_idx, or an
FP8 weight and its weight_scale) are gathered from the weight stream and dequantized to one
float32 `<module>.weight` at load time (kernels/quant_ref.py), which the model then runs as
any float checkpoint, tensor parallelism included (the dequantized tensor is sliced as a
float one would be). Exact: a product of an fp16/bf16 scale and a small integer is a float32.

Why dequantize rather than run the packed integers on the CPU: a group's zero point makes
GPTQ/AWQ's w = s * (q - z) a Q4_1 block (d = s, m = -s * z) only once m is rounded to fp16,
which moves weights by up to ~1/2000 of a step; the CPU has no FP8 arithmetic. On CUDA the
packed tensors go to the Triton kernels instead (actors/quantization/checkpoint_gpu.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from actors.config.quantization import CheckpointQuant, QuantConfigError, read_checkpoint_quant
from kernels.quant_ref import dequantize_awq, dequantize_fp8, dequantize_gptq, dequantize_packed

# the tensors of one quantized linear, by layout ("weight" of fp8 is recognised by its dtype)
PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "pack": ("weight_packed", "weight_scale", "weight_shape", "weight_g_idx"),
    "fp8": ("weight", "weight_scale", "input_scale"),
    "int8": ("weight", "weight_scale"),
}
FP8_DTYPES = (torch.float8_e4m3fn,)

logger = logging.getLogger(__name__)


def checkpoint_weights(weights: Iterable[tuple[str, object]], model_dir: str) -> Iterator[tuple[str, object]]:
    """The model runner's weight stream of a quantized checkpoint: dequantized (below)."""
    quant = read_checkpoint_quant(model_dir)
    assert quant is not None  # EngineArgs.build resolved the method from this very config
    return dequantized_weights(weights, quant)


def dequantized_weights(weights: Iterable[tuple[str, object]], quant: CheckpointQuant
                        ) -> Iterator[tuple[str, object]]:
    """The weight stream with each quantized linear's tensors replaced by its float32 weight
    (yielded after the float tensors: a module's parts may be spread over shards)."""
    parts = PARTS[quant.layout]
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor_slice in weights:
        module, _, part = name.rpartition(".")
        if part in parts and (part != "weight" or _is_quantized_weight(tensor_slice, quant.layout)):
            modules.setdefault(module, {})[part] = tensor_slice[...]  # (a scale may have no dimensions)
        elif part == "weight" and module in modules:  # cannot be: a module is quantized or not
            raise QuantConfigError(f"{module}: both a float weight and quantized tensors")
        else:
            yield name, tensor_slice
    for module, tensors in modules.items():
        if quant.layout in ("fp8", "int8") and "weight" not in tensors:
            # a weight_scale/input_scale beside a float weight (an ignored layer keeps none)
            raise QuantConfigError(f"{module}: {quant.layout} scales without an {quant.layout} weight")
        yield f"{module}.weight", dequantize_module(module, tensors, quant)


def _is_quantized_weight(tensor_slice, layout: str) -> bool:
    """An FP8 (layout fp8) or int8 (layout int8) `weight`, not a float one an ignored layer keeps."""
    if hasattr(tensor_slice, "get_dtype"):  # a safetensors slice names its dtype: "F8_E4M3", "I8"
        return tensor_slice.get_dtype() == "I8" if layout == "int8" else tensor_slice.get_dtype().startswith("F8_E4M3")
    dtype = getattr(tensor_slice, "dtype", None)
    return dtype == torch.int8 if layout == "int8" else dtype in FP8_DTYPES


def dequantize_module(module: str, t: dict[str, torch.Tensor], quant: CheckpointQuant) -> torch.Tensor:
    """One linear's float32 [out, in] weight from its checkpoint tensors."""
    missing = [part for part in _required(quant) if part not in t]
    if missing:
        raise QuantConfigError(f"{module}: the checkpoint lacks {', '.join(missing)} ({quant.method})")
    if quant.layout == "gptq":
        g_idx = t.get("g_idx") if quant.desc_act else None
        if quant.desc_act and g_idx is None:
            raise QuantConfigError(f"{module}: desc_act=True without g_idx")
        return dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], quant.bits, quant.group_size, g_idx)
    if quant.layout == "awq":
        return dequantize_awq(t["qweight"], t["qzeros"], t["scales"], quant.group_size)
    if quant.layout == "pack":
        g_idx = t.get("weight_g_idx") if quant.desc_act else None
        if quant.desc_act and g_idx is None:
            raise QuantConfigError(f"{module}: actorder 'group' without weight_g_idx")
        weight = dequantize_packed(t["weight_packed"], t["weight_scale"], quant.bits, quant.group_size, g_idx)
        expected = tuple(int(v) for v in t["weight_shape"].tolist())
        if tuple(weight.shape) != expected:
            raise QuantConfigError(f"{module}: weight_shape {expected} but the packed tensor holds {tuple(weight.shape)}")
        return weight
    return dequantize_fp8(t["weight"], t["weight_scale"])  # (int8 weights too: q * per-channel scale)


def _required(quant: CheckpointQuant) -> tuple[str, ...]:
    return {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales"),
            "pack": ("weight_packed", "weight_scale", "weight_shape"), "fp8": ("weight", "weight_scale"),
            "int8": ("weight", "weight_scale")}[quant.layout]


def use_checkpoint_kernels(model, backend, model_dir: str, parallel):
    """After the model loaded the dequantized weights: the backend that runs the checkpoint's
    own integers where a kernel takes them, those swapped in for the float weights. The
    Triton GEMMs on the Triton backend (checkpoint_gpu.py); the CPU's GGUF kernels where the
    integers make exact GGUF blocks (checkpoint_cpu.py); else backend, the float weights."""
    from actors.quantization.checkpoint_cpu import can_use_gguf_blocks, use_gguf_blocks
    from kernels.gguf_linear import gguf_kernels

    quant = read_checkpoint_quant(model_dir)
    on_triton = backend.name == "triton" and not (quant.layout == "int8" and not quant.int8_activations)  # W8A16
    kernels = gguf_kernels() if not on_triton and can_use_gguf_blocks(model, backend, quant) else None
    if not on_triton and kernels is None:
        return backend
    tensors = _projection_tensors(model_dir)
    unquantized = [module for module, t in tensors.items() if any(p not in t for p in _required(quant))
                   or quant.layout in ("fp8", "int8") and not _is_quantized_weight(t["weight"], quant.layout)]
    if unquantized:  # an ignored projection: the kernels run whole fused groups quantized alike
        logger.warning("%s is not quantized in the checkpoint: every projection runs dequantized", unquantized[0])
        return backend
    if on_triton:
        from actors.quantization.checkpoint_gpu import use_packed_weights

        return use_packed_weights(model, backend, quant, tensors, parallel)
    return use_gguf_blocks(model, backend, quant, tensors, kernels)


def _projection_tensors(model_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """The decoder projections' checkpoint tensors: module name -> {part: tensor}."""
    from actors.models.loader import iter_weights

    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_weights(model_dir):
        module, _, part = name.rpartition(".")
        if module.startswith("model.layers.") and module.endswith("_proj"):
            tensors.setdefault(module, {})[part] = tensor
    return tensors
