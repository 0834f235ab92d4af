"""Quantized checkpoints written by the tests: a tiny random Llama's projections quantized by
a plain torch quantizer into each format's on-disk layout (docs/quantization.md), and beside
it the same model with the DEQUANTIZED weights as a float checkpoint (the reference).

The dequantized weights come from the quantizer's own integers, scales and zeros, before any
packing; the packers are written here as the formats' own tools write them (AutoGPTQ's
shift loops, AWQ's column order map, compressed-tensors' offset), not with kernels/quant_ref.py."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER_MAP = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's packer: nibble i holds column order_map[i]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_gptq_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ: [in, out] values into [in * bits / 32, out] words, input rows j..j+7 of a word
    shifted by bits * (j - first)."""
    per_word = 32 // bits
    q = q.to(torch.int64)
    words = torch.zeros(q.shape[0] // per_word, q.shape[1], dtype=torch.int64)
    for row in range(words.shape[0]):
        for j in range(per_word):
            words[row] |= q[row * per_word + j] << (bits * j)
    return _to_int32(words)


def pack_columns(q: torch.Tensor, bits: int, order_map: tuple[int, ...] | None = None) -> torch.Tensor:
    """[rows, cols] values into [rows, cols * bits / 32] words, along columns; with an order
    map (AWQ), nibble i of a word holds column order_map[i] of its eight."""
    per_word = 32 // bits
    order_map = order_map or tuple(range(per_word))
    q = q.to(torch.int64)
    words = torch.zeros(q.shape[0], q.shape[1] // per_word, dtype=torch.int64)
    for col in range(words.shape[1]):
        for i in range(per_word):
            words[:, col] |= q[:, col * per_word + order_map[i]] << (i * bits)
    return _to_int32(words)


def _group_of(in_features: int, group_size: int, act_order: bool, generator: torch.Generator) -> torch.Tensor:
    size = in_features if group_size == -1 else group_size
    if not act_order:
        return torch.arange(in_features) // size
    order = torch.randperm(in_features, generator=generator)  # the order GPTQ visits the columns in
    g_idx = torch.empty(in_features, dtype=torch.int64)
    g_idx[order] = torch.arange(in_features) // size
    return g_idx


def quantize_int(w: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx: torch.Tensor,
                 scale_dtype=torch.float16):
    """Per (output row, group) min/max quantization: (q unsigned [out, in], zeros [out, groups],
    scales [out, groups] in scale_dtype, the dequantized float32 weight)."""
    maxq = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            scale = torch.maximum(lo.abs(), hi) * 2 / maxq
            zeros[:, g] = (maxq + 1) // 2
        else:
            scale = (hi - lo) / maxq
        scales[:, g] = scale.clamp(min=1e-5).to(scale_dtype).float()
        if not sym:
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(0, maxq).long()
    s, z = scales[:, g_idx], zeros[:, g_idx]
    q = (torch.round(w / s) + z).clamp(0, maxq).long()
    return q, zeros, scales.to(scale_dtype), (s * (q - z).float())


def quantize_fp8(w: torch.Tensor, per_channel: bool):
    """(E4M3 weight, float32 scale: [] or [out, 1], the dequantized float32 weight)."""
    absmax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max()
    scale = (absmax / 448.0).float()
    weight = (w / scale).to(torch.float8_e4m3fn)
    return weight, scale, weight.float() * scale


def write_quantized_checkpoint(src_dir: str, out_dir: str, fmt: str, *, bits: int = 4, group_size: int = 32,
                               sym: bool = True, desc_act: bool = False, per_channel: bool = False,
                               seed: int = 0, keep_float: tuple[str, ...] = ()) -> str:
    """src_dir's model with its projections in fmt ("gptq", "awq", "compressed-tensors",
    "compressed-tensors-fp8", "compressed-tensors-int8", "fp8") at out_dir/quantized, and their dequantization as float32
    at out_dir/reference; returns out_dir. keep_float: modules left float (AWQ's
    modules_to_not_convert)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(os.path.join(src_dir, "model.safetensors"))
    quantized, reference = {}, {}
    for name, tensor in tensors.items():
        module, _, part = name.rpartition(".")
        if part != "weight" or module.rpartition(".")[2] not in PROJECTIONS or module in keep_float:
            quantized[name] = reference[name] = tensor
            continue
        parts, dequantized = _quantize_module(tensor.float(), fmt, bits, group_size, sym, desc_act, per_channel,
                                              generator)
        quantized.update({f"{module}.{key}": value for key, value in parts.items()})
        reference[name] = dequantized
    for kind, weights in (("quantized", quantized), ("reference", reference)):
        directory = os.path.join(out_dir, kind)
        shutil.copytree(src_dir, directory, ignore=shutil.ignore_patterns("model.safetensors"), dirs_exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(directory, "model.safetensors"))
    config_path = os.path.join(out_dir, "quantized", "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(fmt, bits, group_size, sym, desc_act, per_channel)
    if keep_float:
        config["quantization_config"]["modules_to_not_convert"] = list(keep_float)
    with open(config_path, "w") as f:
        json.dump(config, f)
    return out_dir


def _quantize_module(w, fmt, bits, group_size, sym, desc_act, per_channel, generator):
    if fmt == "compressed-tensors-int8":  # int-quantized: int8 per output channel
        scale = w.abs().amax(dim=1, keepdim=True) / 127.0
        weight = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return {"weight": weight, "weight_scale": scale}, weight.float() * scale
    if fmt in ("fp8", "compressed-tensors-fp8"):
        weight, scale, dequantized = quantize_fp8(w, per_channel)
        if fmt == "compressed-tensors-fp8" and not per_channel:
            scale = scale.reshape(1)
        return {"weight": weight, "weight_scale": scale}, dequantized
    in_features = w.shape[1]
    g_idx = _group_of(in_features, group_size, desc_act, generator)
    q, zeros, scales, dequantized = quantize_int(w, bits, group_size, sym, g_idx)
    if fmt == "gptq":
        return {"qweight": pack_gptq_rows(q.T, bits), "qzeros": pack_columns((zeros - 1).T, bits),
                "scales": scales.T.contiguous(), "g_idx": g_idx.to(torch.int32)}, dequantized
    if fmt == "awq":
        return {"qweight": pack_columns(q.T, 4, AWQ_ORDER_MAP), "qzeros": pack_columns(zeros.T, 4, AWQ_ORDER_MAP),
                "scales": scales.T.contiguous()}, dequantized
    assert fmt == "compressed-tensors" and sym
    signed = q - zeros[:, g_idx]  # symmetric: zero is 2**(bits-1)
    parts = {"weight_packed": pack_columns(signed + (1 << (bits - 1)), bits), "weight_scale": scales,
             "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if desc_act:
        parts["weight_g_idx"] = g_idx.to(torch.int32)
    return parts, dequantized


def quantization_config(fmt, bits, group_size, sym, desc_act, per_channel) -> dict:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if fmt == "compressed-tensors-fp8":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel" if per_channel else "tensor",
                   "symmetric": True, "dynamic": False}
        activations = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": activations}}}
    if fmt == "compressed-tensors-int8":  # W8A8 with per_channel=True (dynamic per-token activations), else W8A16
        weights = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}
        activations = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
        return {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": activations if per_channel else None}}}
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False,
               "strategy": "group" if group_size > 0 else "channel",
               "group_size": group_size if group_size > 0 else None, "actorder": "group" if desc_act else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


def assert_matches_reference(outputs, expected_tokens, expected_logprobs) -> None:
    """The engine's greedy outputs against hf_greedy's: the same tokens, and each returned
    logprob within 1e-3 relative of Hugging Face's log-softmax."""
    assert [o.outputs[0].token_ids for o in outputs] == expected_tokens
    for output, steps in zip(outputs, expected_logprobs):
        for token_logprobs, hf_step in zip(output.outputs[0].logprobs, steps):
            for token_id, logprob in token_logprobs.items():
                assert abs(logprob.logprob - hf_step[token_id].item()) <= 1e-3 * abs(hf_step[token_id].item()) + 1e-4
