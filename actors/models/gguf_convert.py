"""Turn a llama.cpp GGUF file into a Hugging Face directory (config.json, tokenizer files,
float32 safetensors), once, so the rest of the engine only ever loads Hugging Face directories.

Three things llama.cpp changed on the way to GGUF are undone here:
1. tensor names (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
2. quantization: every tensor is dequantized to float32 with the `gguf` package;
3. for the `llama` architecture only, llama.cpp's convert script permutes the rows of q_proj and
   k_proj from Hugging Face's rotary layout (first half of each head, then second half) to
   llama.cpp's (interleaved pairs); we permute them back, as transformers' GGUF loader does.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np

from actors.models import gguf_families, gguf_gpt_oss
from actors.models.gguf_moe import MOE_NORM_TOPK_PROB, MOE_TENSOR_TO_HF, moe_config, \
    reshape_shared_gate, split_experts

# Part of the cache key: bump it when the output of convert_gguf changes, so stale
# conversions in users' caches are not reused.
CONVERTER_VERSION = 1

# Dequantized weights are written in shards of about this many bytes, so converting a large
# model never holds more than one shard in memory.
SHARD_BYTES = 2 * 2**30


@dataclass(frozen=True)
class _GGUFArchitecture:
    hf_architecture: str
    model_type: str
    unpermute_qk: bool  # llama.cpp permuted q/k rows for its rotary layout


_ARCHITECTURES = {
    "llama": _GGUFArchitecture("LlamaForCausalLM", "llama", unpermute_qk=True),
    "qwen2": _GGUFArchitecture("Qwen2ForCausalLM", "qwen2", unpermute_qk=False),
    "qwen3": _GGUFArchitecture("Qwen3ForCausalLM", "qwen3", unpermute_qk=False),
    # issue 39's families: what differs is gguf_families.py's
    "gemma2": _GGUFArchitecture("Gemma2ForCausalLM", "gemma2", unpermute_qk=False),
    "gemma3": _GGUFArchitecture("Gemma3ForCausalLM", "gemma3_text", unpermute_qk=False),
    "phi3": _GGUFArchitecture("Phi3ForCausalLM", "phi3", unpermute_qk=False),
    # mixture-of-experts files (gguf_moe.py: their expert keys and tensors)
    "qwen3moe": _GGUFArchitecture("Qwen3MoeForCausalLM", "qwen3_moe", unpermute_qk=False),
    "qwen2moe": _GGUFArchitecture("Qwen2MoeForCausalLM", "qwen2_moe", unpermute_qk=False),
    "gpt-oss": _GGUFArchitecture("GptOssForCausalLM", "gpt_oss", unpermute_qk=False),  # (gguf_gpt_oss.py)
}

_GLOBAL_TENSOR_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER_TENSOR_TO_HF = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **MOE_TENSOR_TO_HF,
}

_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# llama.cpp stores Llama-3 rope scaling as this tensor of per-frequency divisors, not as metadata.
_ROPE_FREQS_TENSOR = "rope_freqs.weight"


def cached_conversion(gguf_path: str, cache_root: str) -> str:
    """The Hugging Face directory converted from gguf_path, converting it on the first call.

    The directory name hashes the file's path, size and modification time (and the converter
    version), so an edited file is converted again. Conversion writes into a staging directory
    that is renamed into place when complete: a concurrent process either sees the finished
    directory or none, and if two convert at once, the first rename wins."""
    gguf_path = os.path.realpath(gguf_path)
    stat = os.stat(gguf_path)
    cache_key = f"{CONVERTER_VERSION}:{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(cache_key.encode()).hexdigest()[:12]
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    target_dir = os.path.join(cache_root, f"{stem}-{digest}")
    if os.path.isfile(os.path.join(target_dir, "config.json")):
        return target_dir

    os.makedirs(cache_root, exist_ok=True)
    staging_dir = tempfile.mkdtemp(prefix=f".{stem}-{digest}.", dir=cache_root)
    try:
        convert_gguf(gguf_path, staging_dir)
        _publish(staging_dir, target_dir)
    finally:
        # Left over after a failed conversion, or when another process published first.
        shutil.rmtree(staging_dir, ignore_errors=True)
    return target_dir


def _publish(staging_dir: str, target_dir: str) -> None:
    try:
        os.rename(staging_dir, target_dir)
    except OSError:
        if not os.path.isfile(os.path.join(target_dir, "config.json")):
            raise
        # Another process converted the same file first; its directory is as good as ours.


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write config.json, the tokenizer and model(-NNNNN-of-NNNNN).safetensors into out_dir."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    architecture = _field(reader, "general.architecture")
    if architecture not in _ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {architecture!r} is not supported "
            f"(supported: {', '.join(_ARCHITECTURES)})"
        )
    hf_config = _hf_config(reader, tensors, _ARCHITECTURES[architecture], gguf_path)
    with open(os.path.join(out_dir, "config.json"), "w") as config_file:
        json.dump(hf_config, config_file, indent=2)
    _write_weights(tensors, hf_config, _ARCHITECTURES[architecture], out_dir)
    with gguf_gpt_oss.tokenizer_workaround(architecture):
        _write_tokenizer(gguf_path, out_dir)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _float32_value(value: float) -> float:
    # GGUF stores floats as float32: 1e-6 comes back as 9.99999997e-07. The shortest decimal
    # that rounds to the same float32 is the value the model's authors wrote down.
    return float(str(np.float32(value)))


def _hf_config(reader, tensors: dict, spec: _GGUFArchitecture, gguf_path: str) -> dict:
    arch = _field(reader, "general.architecture")

    def required(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{gguf_path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden_size = required("embedding_length")
    num_attention_heads = required("attention.head_count")
    num_key_value_heads = _field(reader, f"{arch}.attention.head_count_kv", num_attention_heads)
    if isinstance(num_key_value_heads, list):  # per-layer counts; one value is all we support
        if len(set(num_key_value_heads)) != 1:
            raise ValueError(f"{gguf_path}: KV head count varies by layer, which is not supported")
        num_key_value_heads = num_key_value_heads[0]
    head_dim = _field(reader, f"{arch}.attention.key_length", hidden_size // num_attention_heads)
    rotary_dim = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"{gguf_path}: partial rotary ({rotary_dim} of {head_dim} dims) is not supported")
    vocab_size = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_theta = _float32_value(_field(reader, f"{arch}.rope.freq_base", 10000.0))

    config = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        # an MoE file may have no dense MLP, so no feed_forward_length
        "intermediate_size": required("feed_forward_length") if arch not in (*MOE_NORM_TOPK_PROB, "gpt-oss")
        else _field(reader, f"{arch}.feed_forward_length") or required("expert_feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_value(required("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(reader, tensors, arch, rope_theta, head_dim, gguf_path),
        "max_position_embeddings": required("context_length"),
        # llama.cpp leaves out output.weight when the head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if spec.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    gguf_families.family_config(lambda key, default=None: _field(reader, key, default), arch, config, tensors,
                                _float32_value)
    if arch in MOE_NORM_TOPK_PROB:
        config.update(moe_config(arch, lambda key: _field(reader, f"{arch}.{key}"), gguf_path))
    if arch == gguf_gpt_oss.ARCH:
        gguf_gpt_oss.gpt_oss_config(lambda key, default=None: _field(reader, f"{arch}.{key}", default), config,
                                    tensors, _float32_value, gguf_path)
    return config


def _rope_scaling(reader, tensors: dict, arch: str, rope_theta: float, head_dim: int, gguf_path: str) -> dict | None:
    if _ROPE_FREQS_TENSOR in tensors:
        import gguf

        tensor = tensors[_ROPE_FREQS_TENSOR]
        rope_factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        return _llama3_rope_scaling(rope_factors, rope_theta, head_dim, gguf_path)
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    # Other scaling types (linear, yarn) are written down faithfully; load_model_config decides
    # whether the engine supports them.
    scaling = {"rope_type": scaling_type, "factor": _float32_value(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    original_context_len = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original_context_len is not None:
        scaling["original_max_position_embeddings"] = original_context_len
    return scaling


def _llama3_rope_scaling(rope_factors: np.ndarray, rope_theta: float, head_dim: int, gguf_path: str) -> dict:
    """The Llama-3 rope_scaling dict behind llama.cpp's rope_freqs tensor.

    The file keeps only the per-frequency divisors, not the parameters they came from. Every
    Llama 3.x model uses low_freq_factor 1, high_freq_factor 4 and an original context of 8192,
    with `factor` the largest divisor: rebuild those and check they reproduce the divisors."""
    scaling = {
        "rope_type": "llama3",
        "factor": _float32_value(rope_factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = llama3_rope_factors(scaling, rope_theta, head_dim)
    if expected.shape != rope_factors.shape or not np.allclose(expected, rope_factors, rtol=1e-4):
        raise ValueError(
            f"{gguf_path}: rope_freqs does not match Llama-3 rope scaling with low_freq_factor 1, "
            "high_freq_factor 4 and original context 8192; other rope scalings are not supported"
        )
    return scaling


def llama3_rope_factors(scaling: dict, rope_theta: float, head_dim: int) -> np.ndarray:
    """What each rotary frequency is divided by under Llama-3 scaling, as llama.cpp computes it."""
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_context_len / low_freq_factor
    high_freq_wavelen = original_context_len / high_freq_factor
    divisors = []
    for dim_index in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope_theta ** (dim_index / head_dim)
        if wavelen < high_freq_wavelen:
            divisors.append(1.0)
        elif wavelen > low_freq_wavelen:
            divisors.append(factor)
        else:
            smooth = (original_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a llama.cpp tensor name; ValueError for one we do not know."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSOR_TO_HF and suffix in ("weight", "bias"):
        return f"{_GLOBAL_TENSOR_TO_HF[base]}.{suffix}"
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    table = {**_LAYER_TENSOR_TO_HF, **gguf_families.LAYER_TENSOR_OVERRIDES.get(arch, {})}
    if match and match.group(2) in table:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{table[kind]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in a Llama-family model")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation, which turned each head's rows from
    [first half of the rotary pairs; second half] into interleaved pairs."""
    rows_per_half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, rows_per_half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantized(tensor, hf_config: dict, spec: _GGUFArchitecture) -> np.ndarray:
    import gguf

    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions fastest-first; numpy and torch want them slowest-first.
    values = np.array(values, dtype=np.float32).reshape([int(dim) for dim in reversed(tensor.shape)])
    if spec.unpermute_qk and ".attn_q." in tensor.name:
        values = unpermute_rotary_rows(values, hf_config["num_attention_heads"])
    elif spec.unpermute_qk and ".attn_k." in tensor.name:
        values = unpermute_rotary_rows(values, hf_config["num_key_value_heads"])
    return gguf_families.restore_values(spec.model_type.removesuffix("_text"), tensor.name, values)


def _write_weights(tensors: dict, hf_config: dict, spec: _GGUFArchitecture, out_dir: str) -> None:
    import torch
    from safetensors.torch import save_file

    weight_tensors = [tensor for name, tensor in tensors.items()
                      if name != _ROPE_FREQS_TENSOR and name not in gguf_families.ROPE_FACTOR_TENSORS]
    arch = spec.model_type.removesuffix("_text")  # (gemma3_text's GGUF name is gemma3)
    gguf_arch = next(name for name, known in _ARCHITECTURES.items() if known == spec)
    pending: dict = {}  # gpt-oss: an expert tensor's half waiting for the other (gguf_gpt_oss.py)
    shards = _plan_shards(weight_tensors)
    weight_map = {}
    for shard_index, shard in enumerate(shards):
        file_name = (
            "model.safetensors" if len(shards) == 1
            else f"model-{shard_index + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        shard_weights = {}
        for tensor in shard:
            if gguf_gpt_oss.is_gpt_oss_tensor(gguf_arch, tensor.name):
                named = gguf_gpt_oss.convert_tensor(tensor, pending, lambda t: _dequantized(t, hf_config, spec))
            else:
                values = reshape_shared_gate(tensor.name, _dequantized(tensor, hf_config, spec))
                # an MoE file's [num_experts, ...] tensors, split per expert
                named = split_experts(tensor.name, values) or {hf_tensor_name(tensor.name, arch): values}
            for name, array in named.items():
                shard_weights[name] = torch.from_numpy(array)
        save_file(shard_weights, os.path.join(out_dir, file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard_weights, file_name))
    if len(shards) > 1:
        total_size = sum(int(tensor.n_elements) * 4 for tensor in weight_tensors)
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as index_file:
            json.dump(index, index_file, indent=2)


def _plan_shards(tensors: list) -> list[list]:
    shards: list[list] = [[]]
    shard_bytes = 0
    for tensor in tensors:
        tensor_bytes = int(tensor.n_elements) * 4  # float32 once dequantized
        if shards[-1] and shard_bytes + tensor_bytes > SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(tensor)
        shard_bytes += tensor_bytes
    return shards


def _write_tokenizer(gguf_path: str, out_dir: str) -> None:
    # transformers rebuilds a fast tokenizer from the GGUF vocabulary, merges, special token
    # ids and chat template; saving it gives the usual tokenizer.json / tokenizer_config.json.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    tokenizer.save_pretrained(out_dir)
