"""Quantized checkpoints (`quantization_config` in config.json, vLLM's names): which of them
troupe runs, decided at start-up. Torch-free: the loader and EngineArgs.build call it in the
launching process, so an unsupported variant fails there, naming the field and its value,
never at the first request.

Formats (docs/quantization.md has their on-disk layouts):
  gptq: 4- or 8-bit integers packed into int32 along the input dimension, group scales and
        zero points (AutoGPTQ's v1 layout: zeros stored minus one), g_idx for act-order
  awq: 4-bit, packed along the output dimension in AWQ's column order, group scales, zeros
  compressed-tensors: `pack-quantized` (int4/int8 packed along the input dimension,
        symmetric, group or channel scales), `int-quantized` (int8 per channel, W8A16 or
        W8A8 with dynamic per-token activations) and `float-quantized` (FP8 E4M3 weights)
  fp8: FP8 E4M3 weights with a per-tensor or per-channel weight_scale (vLLM's and HF's
        checkpoints), activations scaled dynamically."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
FOLLOW_CHECKPOINT = (None, "none", "auto")  # flag values that take the checkpoint's own method


class QuantConfigError(ValueError):
    """A quantization_config (or --quantization against it) troupe cannot run."""


@dataclass(frozen=True)
class CheckpointQuant:
    """What the loader and the kernels need of a checkpoint's quantization_config."""

    method: str  # one of CHECKPOINT_METHODS
    layout: str  # "gptq", "awq", "pack" (compressed-tensors pack-quantized), "fp8"
    bits: int  # 4 or 8 (integer layouts); 8 for fp8
    group_size: int  # input channels sharing a scale; -1: one group (per output channel); 0: fp8
    sym: bool = True
    desc_act: bool = False  # act-order: g_idx maps each input channel to its group
    ignore: tuple[str, ...] = ()  # modules left unquantized (names as the checkpoint lists them)
    int8_activations: bool = False  # W8A8 (compressed-tensors int-quantized): activations int8 per token


def _field(config: dict, names: tuple[str, ...], default=None):
    for name in names:
        if name in config:
            return config[name]
    return default


def _refuse(config_path: str, field: str, value, what: str) -> QuantConfigError:
    return QuantConfigError(f"{config_path}: quantization_config {field}={value!r} is not supported ({what})")


def parse_quantization_config(config: dict, config_path: str) -> CheckpointQuant:
    """The CheckpointQuant of a config.json's quantization_config; QuantConfigError naming
    the first field whose value troupe does not run."""
    method = config.get("quant_method")
    parse = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "fp8": _fp8}.get(method)
    if parse is not None:
        return parse(config, f"{config_path} ({method} checkpoint)")
    raise _refuse(config_path, "quant_method", method, f"troupe reads {', '.join(CHECKPOINT_METHODS)}")


def _gptq(config: dict, path: str) -> CheckpointQuant:
    bits, group_size = config.get("bits"), config.get("group_size", 128)
    if bits not in (4, 8):
        raise _refuse(path, "bits", bits, "GPTQ runs 4 and 8 bits")
    _check_group_size(path, "group_size", group_size)
    checkpoint_format = config.get("checkpoint_format", "gptq")
    if checkpoint_format != "gptq":
        raise _refuse(path, "checkpoint_format", checkpoint_format, "only AutoGPTQ's v1 layout, 'gptq'")
    if config.get("lm_head"):
        raise _refuse(path, "lm_head", True, "a quantized LM head")
    if config.get("dynamic"):
        raise _refuse(path, "dynamic", "...", "per-module GPTQ settings")
    return CheckpointQuant("gptq", "gptq", bits, group_size, bool(config.get("sym", True)),
                           bool(config.get("desc_act", False)))


def _awq(config: dict, path: str) -> CheckpointQuant:
    bits = _field(config, ("bits", "w_bit"))
    group_size = _field(config, ("group_size", "q_group_size"), 128)
    if bits != 4:
        raise _refuse(path, "bits", bits, "AWQ runs 4 bits")
    _check_group_size(path, "group_size", group_size)
    if not config.get("zero_point", True):
        raise _refuse(path, "zero_point", False, "AWQ without zero points")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(path, "version", config.get("version"), "only the 'gemm' packing")
    ignore = tuple(config.get("modules_to_not_convert") or ())
    return CheckpointQuant("awq", "awq", 4, group_size, sym=False, ignore=ignore)


def _fp8(config: dict, path: str) -> CheckpointQuant:
    if config.get("weight_block_size"):
        raise _refuse(path, "weight_block_size", config["weight_block_size"], "block-wise FP8 scales")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse(path, "activation_scheme", scheme, "only dynamic activation scales")
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(path, "fmt", fmt, "only E4M3 weights")
    ignore = tuple(_field(config, ("ignored_layers", "modules_to_not_convert"), None) or ())
    return CheckpointQuant("fp8", "fp8", 8, 0, ignore=ignore)


def _compressed_tensors(config: dict, path: str) -> CheckpointQuant:
    for field, fine in (("quantization_status", config.get("quantization_status", "compressed") == "compressed"),
                        ("kv_cache_scheme", not config.get("kv_cache_scheme")),
                        ("sparsity_config", not (config.get("sparsity_config") or {}).get("format", "dense")
                         not in ("dense", None))):
        if not fine:
            raise _refuse(path, field, config.get(field), "compressed, dense weights without a KV cache scheme")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(path, "config_groups", sorted(groups), "exactly one scheme for every quantized Linear")
    (name, group), = groups.items()
    field = f"config_groups.{name}"
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise _refuse(path, f"{field}.targets", targets, "only ['Linear']")
    weights = group.get("weights") or {}
    fmt = group.get("format") or config.get("format")
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    activations = group.get("input_activations")
    ignore = tuple(config.get("ignore") or ())
    if group.get("output_activations"):
        raise _refuse(path, f"{field}.output_activations", "...", "quantized outputs")
    if kind == "float":
        if fmt != "float-quantized" or bits != 8:
            raise _refuse(path, "format", fmt, "FP8 weights come as 'float-quantized' with num_bits 8")
        if strategy not in ("tensor", "channel"):
            raise _refuse(path, f"{field}.weights.strategy", strategy, "FP8 runs 'tensor' or 'channel' scales")
        if activations and not activations.get("dynamic"):
            raise _refuse(path, f"{field}.input_activations.dynamic", activations.get("dynamic"),
                          "only dynamic activation scales")
        return CheckpointQuant("compressed-tensors", "fp8", 8, 0, ignore=ignore)
    if kind != "int":
        raise _refuse(path, f"{field}.weights.type", kind, "'int' or 'float'")
    if fmt == "int-quantized":
        return _int8_channel(weights, activations, field, path, ignore)
    if fmt != "pack-quantized":
        raise _refuse(path, "format", fmt, "integer weights run as 'pack-quantized' or 'int-quantized'")
    if bits not in (4, 8):
        raise _refuse(path, f"{field}.weights.num_bits", bits, "4 or 8")
    if not weights.get("symmetric", True):
        raise _refuse(path, f"{field}.weights.symmetric", False, "zero points of pack-quantized weights")
    if activations:
        raise _refuse(path, f"{field}.input_activations", "...", "pack-quantized runs weight-only")
    if strategy == "group":
        group_size = weights.get("group_size")
        _check_group_size(path, f"{field}.weights.group_size", group_size)
    elif strategy == "channel":
        group_size = -1
    else:
        raise _refuse(path, f"{field}.weights.strategy", strategy, "'group' or 'channel'")
    actorder = weights.get("actorder")
    if actorder not in (None, False, "group", "weight"):
        raise _refuse(path, f"{field}.weights.actorder", actorder, "None, 'group' or 'weight'")
    return CheckpointQuant("compressed-tensors", "pack", bits, group_size, desc_act=actorder == "group",
                           ignore=ignore)


def _int8_channel(weights: dict, activations: dict | None, field: str, path: str,
                  ignore: tuple[str, ...]) -> CheckpointQuant:
    """int-quantized: int8 weights [out, in] with a scale per output channel (W8A16), and
    optionally int8 activations scaled per token at run time (W8A8, dynamic)."""
    if weights.get("num_bits") != 8 or weights.get("strategy") != "channel" or not weights.get("symmetric", True):
        raise _refuse(path, f"{field}.weights", {k: weights.get(k) for k in ("num_bits", "strategy", "symmetric")},
                      "int-quantized runs 8 bits, 'channel', symmetric")
    if activations:
        wanted = {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
        if any(activations.get(key) != value for key, value in wanted.items()):
            raise _refuse(path, f"{field}.input_activations", {k: activations.get(k) for k in wanted},
                          "int8 activations per token, dynamic and symmetric")
    return CheckpointQuant("compressed-tensors", "int8", 8, -1, ignore=ignore, int8_activations=bool(activations))


def _check_group_size(path: str, field: str, group_size) -> None:
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0 and group_size % 8 == 0):
        raise _refuse(path, field, group_size, "-1 or a positive multiple of 8")


def read_checkpoint_quant(model_dir: str) -> CheckpointQuant | None:
    """The checkpoint's quantization, or None where its config.json has no quantization_config."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path) as config_file:
        config = json.load(config_file).get("quantization_config")
    return parse_quantization_config(config, config_path) if config and not native_mxfp4(config) else None


def native_mxfp4(config: dict | None) -> bool:
    """A quantization_config of {"quant_method": "mxfp4"}: GPT-OSS's experts as MXFP4 blocks,
    which its model reads as they are (actors/models/gpt_oss.py); no linear layer is
    quantized, so no --quantization method runs it (the loader refuses it for other models)."""
    return bool(config) and config.get("quant_method") == "mxfp4"


def resolve_checkpoint_quantization(flag: str | None, model, tensor_parallel_size: int) -> str | None:
    """`--quantization` against the checkpoint (vLLM's rule): unset, none or auto take the
    checkpoint's method; a method the checkpoint is not in is refused, naming both. Returns the
    checkpoint method, or the flag as it was where the checkpoint is not quantized. Group sizes
    must divide each tensor-parallel shard of a row-parallel layer's inputs. model: the ModelConfig."""
    model_dir, is_encoder = model.model_path, model.is_encoder
    hidden_size, intermediate_size = model.hidden_size, model.intermediate_size
    attention_width = model.num_attention_heads * model.head_dim
    quant = read_checkpoint_quant(model_dir)
    if quant is None:
        if flag in CHECKPOINT_METHODS and flag != "fp8":  # fp8: quantized at load (online_gpu.py)
            raise QuantConfigError(f"quantization {flag!r} needs a checkpoint quantized so ({model_dir}/config.json "
                                   "has no quantization_config; only int8 and fp8 quantize at load time)")
        return flag
    if flag not in FOLLOW_CHECKPOINT and flag != quant.method:
        raise QuantConfigError(f"quantization {flag!r} does not match the checkpoint's quantization_config "
                               f"quant_method {quant.method!r}; pass --quantization {quant.method} or leave it unset")
    if is_encoder:
        raise QuantConfigError(f"quantization_config quant_method {quant.method!r}: quantized checkpoints run "
                               "decoder models only")
    if quant.group_size > 0:
        for layer, inputs in (("o_proj", attention_width), ("down_proj", intermediate_size),
                              ("q/k/v/gate/up", hidden_size)):
            shard = inputs // tensor_parallel_size if layer in ("o_proj", "down_proj") else inputs
            if shard % quant.group_size:
                raise QuantConfigError(
                    f"quantization_config group_size={quant.group_size} does not divide {layer}'s "
                    f"{shard} input features{' per rank' if shard != inputs else ''} "
                    f"(tensor_parallel_size={tensor_parallel_size})")
    return quant.method
