"""What gguf_convert.py does for llama.cpp's `gpt-oss` files: the config.json keys of
GptOssForCausalLM from the metadata, and the tensors in Hugging Face's GPT-OSS names.

llama.cpp splits the fused, interleaved gate_up_proj into ffn_gate_exps and ffn_up_exps
([E, I, H] each, with biases); they are interleaved back here (row 2j gate j, 2j+1 up j).
Experts stored as MXFP4 stay MXFP4: ggml's block (one E8M0 byte, then 16 bytes whose low
nibbles are values 0-15 and high nibbles values 16-31, the E2M1 codes llama.cpp doubles
alongside a halved scale: the same numbers) is repacked, byte for byte and without loss,
into GPT-OSS's checkpoint layout (*_blocks: two consecutive values a byte, low nibble first;
*_scales: the E8M0 bytes), and the directory gets quantization_config {"quant_method":
"mxfp4"}: actors/models/gpt_oss.py then runs the blocks as they are. Experts of any other
type are dequantized to float32 as every other tensor is.

llama.cpp fixes GPT-OSS's layer pattern in its code (even layers sliding), and its YaRN's
beta_fast / beta_slow (32 / 1) unless the file says otherwise; Hugging Face's GPT-OSS config
keeps truncate false."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import numpy as np

ARCH = "gpt-oss"
MXFP4_TYPE = 39  # ggml's GGML_TYPE_MXFP4
_BLOCK_BYTES = 17  # ggml's block_mxfp4: e, qs[16]
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# llama.cpp's names -> Hugging Face's, where not the Llama table's
LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router",
               "attn_sinks": "self_attn.sinks"}


def gpt_oss_config(field: Callable, config: dict, tensors: dict, as_float: Callable, gguf_path: str) -> None:
    """Adds GptOssForCausalLM's keys to config (field(key, default) reads `gpt-oss.{key}`)."""
    num_experts, top_k = field("expert_count"), field("expert_used_count")
    if not num_experts or not top_k:
        raise ValueError(f"{gguf_path}: a {ARCH} file needs {ARCH}.expert_count and expert_used_count")
    config.update(num_local_experts=num_experts, num_experts_per_tok=top_k, attention_bias=True,
                  swiglu_alpha=1.702, swiglu_limit=7.0)
    window = field("attention.sliding_window")
    if window:
        config["sliding_window"] = window
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(config["num_hidden_layers"])]
    scaling = config.pop("rope_scaling", None)
    rope = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    if scaling is not None:
        if scaling["rope_type"] != "yarn":
            raise ValueError(f"{gguf_path}: {ARCH} rope scaling {scaling['rope_type']!r} is not supported (yarn)")
        rope.update(scaling, beta_fast=as_float(field("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=as_float(field("rope.scaling.yarn_beta_slow", 1.0)), truncate=False)
    config["rope_parameters"] = rope
    gate = tensors.get("blk.0.ffn_gate_exps.weight")
    if gate is not None and int(gate.tensor_type) == MXFP4_TYPE:
        config["quantization_config"] = {"quant_method": "mxfp4"}


def is_gpt_oss_tensor(arch: str, gguf_name: str) -> bool:
    """A tensor convert_tensor names (the layers' own; the global ones are Llama's)."""
    match = _LAYER.fullmatch(gguf_name)
    return arch == ARCH and match is not None and match.group(2) in (*_EXPERTS, *LAYER_NAMES)


def _hf_layout(tensor) -> tuple[np.ndarray, np.ndarray]:
    """An MXFP4 tensor's (blocks [..., rows, in / 32, 16], scales [..., rows, in / 32]) in
    GPT-OSS's layout, from ggml's blocks."""
    shape = [int(d) for d in reversed(tensor.shape)]  # slowest-first: [..., rows, in]
    raw = np.asarray(tensor.data).reshape(*shape[:-1], shape[-1] // 32, _BLOCK_BYTES)
    scales, qs = raw[..., 0], raw[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # values 0-31 of each block, in order
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)), np.ascontiguousarray(scales)


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[E, I, ...] each -> [E, 2I, ...], gate rows even, up rows odd."""
    return np.stack([gate, up], axis=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])


def convert_tensor(tensor, pending: dict, dequantize: Callable) -> dict[str, np.ndarray]:
    """A gpt-oss layer tensor as Hugging Face's GPT-OSS tensors (empty while an expert's gate or
    up waits in pending for its other half); dequantize(tensor) -> float32 values."""
    layer, kind, suffix = _LAYER.fullmatch(tensor.name).groups()
    prefix = f"model.layers.{layer}."
    if kind in LAYER_NAMES:
        values = dequantize(tensor)
        name = f"{prefix}{LAYER_NAMES[kind]}" + ("" if kind == "attn_sinks" else f".{suffix}")
        return {name: values}
    experts = f"{prefix}mlp.experts."
    mxfp4 = suffix == "weight" and int(tensor.tensor_type) == MXFP4_TYPE
    value = _hf_layout(tensor) if mxfp4 else dequantize(tensor)
    if kind == "ffn_down_exps":
        return _named(f"{experts}down_proj", suffix, value, mxfp4)
    halves = pending.setdefault((layer, suffix), {})
    halves[kind] = value
    if len(halves) < 2:
        return {}
    del pending[(layer, suffix)]
    gate, up = halves["ffn_gate_exps"], halves["ffn_up_exps"]
    if mxfp4:
        return _named(f"{experts}gate_up_proj", suffix, (_interleave(gate[0], up[0]), _interleave(gate[1], up[1])),
                      True)
    return _named(f"{experts}gate_up_proj", suffix, _interleave(gate, up), False)


def _named(base: str, suffix: str, value, mxfp4: bool) -> dict[str, np.ndarray]:
    if suffix == "bias":
        return {f"{base}_bias": value}
    if mxfp4:
        return {f"{base}_blocks": value[0], f"{base}_scales": value[1]}
    # float experts in Hugging Face's parameter layout: [E, in, out]
    return {base: np.ascontiguousarray(value.transpose(0, 2, 1))}


@contextlib.contextmanager
def tokenizer_workaround(arch: str) -> Iterator[None]:
    """While transformers reads a gpt-oss file's tokenizer: transformers 5.24's GGUF loader
    reads each gpt-oss.rope.scaling.* value as the field's parts[0] (the key's length, not its
    value) and raises TypeError on the first float. The tokenizer needs none of them, so the
    reader it opens (gguf.GGUFReader, imported at its call) leaves them out."""
    if arch != ARCH:
        yield
        return
    import gguf

    original = gguf.GGUFReader

    class Reader(original):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            for key in [key for key in self.fields if key.startswith(f"{ARCH}.rope.scaling.")]:
                del self.fields[key]

    gguf.GGUFReader = Reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
