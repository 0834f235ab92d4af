"""Reads and checks a PEFT LoRA adapter directory against the base model, without torch:
the API process, the input processors and the offline LLM check an adapter before any
request runs with it; the workers load the tensors it names (actors/lora/weights.py).

A PEFT adapter is adapter_config.json (r, lora_alpha, target_modules, use_rslora,
rank_pattern, alpha_pattern, ...) and adapter_model.safetensors, whose tensors are named
base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight, A being
[r, in_features] and B [out_features, r]. The delta of a module is
x·Aᵀ·Bᵀ·scale, scale = alpha / r (alpha / sqrt(r) with rsLoRA)."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

from actors.config import ModelConfig
from messages.lora import LoRAAdapterError, LoRARequest

# the projections an adapter may target, by PEFT's module name, and where they live
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR_NAME = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


def module_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of the base model (whole, unsharded)."""
    hidden, heads = model.hidden_size, model.num_attention_heads * model.head_dim
    kv, inter = model.num_key_value_heads * model.head_dim, model.intermediate_size
    return {"q_proj": (hidden, heads), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (heads, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


@dataclass(frozen=True)
class AdapterModule:
    """One adapted projection of one layer."""

    layer: int
    module: str  # a MODULES key
    rank: int
    scale: float  # alpha / rank, or alpha / sqrt(rank) (rsLoRA)
    a_name: str  # the tensors' names in the safetensors file
    b_name: str


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: what a worker loads."""

    lora: LoRARequest
    weights_file: str
    modules: tuple[AdapterModule, ...]

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)

    @property
    def target_modules(self) -> list[str]:
        return sorted({m.module for m in self.modules}, key=list(MODULES).index)


def read_adapter(lora: LoRARequest, model: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """The adapter's spec, or LoRAAdapterError naming what is wrong with it."""
    where = f"LoRA adapter {lora.lora_name!r} ({lora.lora_path})"
    if not os.path.isdir(lora.lora_path):
        raise LoRAAdapterError(f"{where}: no such directory")
    config = _read_config(os.path.join(lora.lora_path, CONFIG_FILE), where)
    weights_file = os.path.join(lora.lora_path, WEIGHTS_FILE)
    if not os.path.isfile(weights_file):
        other = " (only the safetensors format is read; adapter_model.bin is not)" \
            if os.path.isfile(os.path.join(lora.lora_path, "adapter_model.bin")) else ""
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} is missing{other}")
    tensors = read_safetensors_header(weights_file, where)
    pairs: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    for name, (dtype, shape) in tensors.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise LoRAAdapterError(f"{where}: tensor {name!r} is not a LoRA A/B weight of a decoder layer's "
                                   f"projection ({', '.join(MODULES)}); embeddings, the LM head, biases and DoRA "
                                   "magnitudes are not supported")
        layer, block, module, which = int(match[1]), match[2], match[3], match[4]
        if MODULES.get(module) != block:
            raise LoRAAdapterError(f"{where}: target module {block}.{module} is not one of the base model's "
                                   f"projections this engine adapts ({', '.join(MODULES)})")
        if layer >= model.num_hidden_layers:
            raise LoRAAdapterError(f"{where}: tensor {name!r} is for layer {layer}, and the base model has "
                                   f"{model.num_hidden_layers} layers")
        if dtype not in ("F32", "F16", "BF16"):
            raise LoRAAdapterError(f"{where}: tensor {name!r} has dtype {dtype}; F32, F16 or BF16 expected")
        pairs.setdefault((layer, module), {})[which] = (name, shape)
    if not pairs:
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    shapes = module_shapes(model)
    modules = []
    for (layer, module), both in sorted(pairs.items(), key=lambda item: (item[0][0], list(MODULES).index(item[0][1]))):
        if set(both) != {"A", "B"}:
            missing = "B" if "A" in both else "A"
            raise LoRAAdapterError(f"{where}: layer {layer} {module} has no lora_{missing} weight")
        (a_name, a_shape), (b_name, b_shape) = both["A"], both["B"]
        in_features, out_features = shapes[module]
        rank = a_shape[0] if len(a_shape) == 2 else -1
        if list(a_shape) != [rank, in_features] or list(b_shape) != [out_features, rank]:
            raise LoRAAdapterError(f"{where}: layer {layer} {module} has lora_A {list(a_shape)} and lora_B "
                                   f"{list(b_shape)}; the base model's {module} needs [r, {in_features}] and "
                                   f"[{out_features}, r]")
        if not 1 <= rank <= max_lora_rank:
            raise LoRAAdapterError(f"{where}: layer {layer} {module} has rank {rank}, over the engine's "
                                   f"max_lora_rank of {max_lora_rank} (start it with a larger --max-lora-rank)")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, layer, module, config.get("lora_alpha", 8))
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise LoRAAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules.append(AdapterModule(layer, module, rank, float(scale), a_name, b_name))
    return AdapterSpec(lora, weights_file, tuple(modules))


def _read_config(path: str, where: str) -> dict:
    if not os.path.isfile(path):
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} is missing")
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError) as error:
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} is not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type is {peft_type!r}; only LORA adapters are supported")
    unsupported = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights",
                   "modules_to_save": "modules_to_save (fully trained extra modules)"}
    for key, what in unsupported.items():
        if config.get(key):
            raise LoRAAdapterError(f"{where}: {what} is not supported ({key} in {CONFIG_FILE})")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: LoRA biases are not supported (bias={config['bias']!r} in {CONFIG_FILE})")
    return config


def _pattern_value(patterns: dict, layer: int, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module's full name by
    regular expression, or as its dotted suffix."""
    name = f"model.layers.{layer}.{MODULES[module]}.{module}"
    for key, value in patterns.items():
        if re.fullmatch(key, name) or name.endswith(f".{key}") or re.fullmatch(f".*\\.{key}", name):
            return value
    return default


def read_safetensors_header(path: str, where: str) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of each tensor of a safetensors file, checked against the
    file's size (a truncated file is refused here, not in a worker)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(file.read(length))
    except (OSError, ValueError, struct.error) as error:
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} is not a safetensors file ({error})") from None
    tensors = {}
    data_size = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} has a malformed entry for {name!r}") from None
        if not 0 <= start <= end <= data_size:
            raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} is truncated (tensor {name!r} lies past its end)")
        tensors[name] = (dtype, shape)
    return tensors
