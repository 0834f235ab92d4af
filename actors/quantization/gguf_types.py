"""Which GGUF files run quantized, decided at start-up (torch-free: EngineArgs.build calls it in
the launching process). A tensor type without a kernel fails here, naming the tensor and its
type, never at the first request."""

from __future__ import annotations

import os

KERNEL_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K",
                14: "Q6_K"}  # ggml type ids kernels/gguf_linear.cpp multiplies
DECODED_TYPES = {"Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}  # a fused projection may mix these (run as U8x16)
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}  # types the fp32 path runs (dequantized at conversion)
# GPT-OSS's MXFP4 experts: kept MXFP4 by the conversion itself (actors/models/gguf_gpt_oss.py) and
# run by the model (kernels/moe_mxfp4.cpp) on either path, so they are not this path's to check
MXFP4 = 39


class GGUFError(ValueError):
    """A GGUF file or setting the quantized path cannot run."""


def layer_tensor_names(layer: int, file_names=(), fused: bool = False) -> dict[str, list[str]]:
    """A layer's fused projections (DecoderLayerWeights' names) and the file's tensors in each;
    fused: the file keeps q/k/v as one attn_qkv and gate/up as one ffn_up (phi3), in the
    decoder's row order already. A sparse MoE layer (file_names holds its ffn_gate_exps) has its
    experts' instead of an MLP: "experts_w13" (gate and up, concatenated per expert) and
    "experts_w2" (actors/models/moe.py)."""
    prefix = f"blk.{layer}."
    if fused:
        return {"qkv_proj": [f"{prefix}attn_qkv.weight"], "o_proj": [f"{prefix}attn_output.weight"],
                "gate_up_proj": [f"{prefix}ffn_up.weight"], "down_proj": [f"{prefix}ffn_down.weight"]}
    names = {"qkv_proj": [f"{prefix}attn_{p}.weight" for p in "qkv"], "o_proj": [f"{prefix}attn_output.weight"],
             "gate_up_proj": [f"{prefix}ffn_gate.weight", f"{prefix}ffn_up.weight"],
             "down_proj": [f"{prefix}ffn_down.weight"]}
    if f"{prefix}ffn_gate_exps.weight" in file_names:
        del names["gate_up_proj"], names["down_proj"]
        names.update(experts_w13=[f"{prefix}ffn_gate_exps.weight", f"{prefix}ffn_up_exps.weight"],
                     experts_w2=[f"{prefix}ffn_down_exps.weight"])
    return names


def has_fused_projections(tensor_names) -> bool:
    """The file keeps q/k/v and gate/up fused (llama.cpp's phi3)."""
    return "blk.0.attn_qkv.weight" in tensor_names


def lm_head_name(tensor_names) -> str:
    """The LM head's tensor: its own, or the tied embedding table."""
    return "output.weight" if "output.weight" in tensor_names else "token_embd.weight"


def gguf_source(model: str | None) -> str | None:
    """The .gguf file a --model argument names (the embedded default model's included), else None."""
    if model is None or model == "default":
        from actors.models.loader import default_model_path

        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    return path if os.path.isfile(path) and path.endswith(".gguf") else None


def tensor_types(gguf_path: str, num_layers: int) -> dict[str, tuple[str, int]]:
    """The projections' and LM head's tensors: name -> (type name, ggml type id)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    fused = has_fused_projections(tensors)
    names = [name for layer in range(num_layers) for group in layer_tensor_names(layer, tensors, fused).values()
             for name in group] + [lm_head_name(tensors)]
    return {name: (tensors[name].tensor_type.name, int(tensors[name].tensor_type)) for name in names}


def check_gguf_types(gguf_path: str, num_layers: int) -> bool:
    """True where the file's projections are block types with kernels, False where they are all
    float (nothing to run quantized); GGUFError naming the first tensor whose type has no
    kernel, or a fused group (q/k/v, gate/up) mixing types other than DECODED_TYPES."""
    types = {name: kind for name, kind in tensor_types(gguf_path, num_layers).items()  # (an MoE layer's experts too)
             if not (kind[1] == MXFP4 and name.endswith("_exps.weight"))}
    if all(type_id in FLOAT_TYPES for name, (_, type_id) in types.items() if name.startswith("blk.")):
        return False
    for name, (type_name, type_id) in types.items():
        if type_id not in KERNEL_TYPES and type_id not in FLOAT_TYPES:
            raise GGUFError(f"{gguf_path}: tensor {name!r} is {type_name}, which has no CPU kernel (kernels: "
                            f"{', '.join(KERNEL_TYPES.values())}); --quantization none runs it dequantized to "
                            "float32")
    fused = has_fused_projections(types)
    for layer in range(num_layers):
        for group in layer_tensor_names(layer, types, fused).values():
            group = [name for name in group if name in types]  # (less MXFP4 experts, left out above)
            if not group:
                continue
            group_types = {types[name][0] for name in group}
            # an MoE layer's experts: one type for gate and up (moe_cpu.cpp's w13)
            mixable = group_types <= DECODED_TYPES and not group[0].endswith("_exps.weight")
            if (len(group_types) > 1 and not mixable) or group_types & set(FLOAT_TYPES.values()):
                raise GGUFError(f"{gguf_path}: tensors {', '.join(group)} are {', '.join(sorted(group_types))}; "
                                "the quantized path runs projections quantized alike (--quantization none runs "
                                "them dequantized)")
    return True


def resolve_gguf(method: str, model: str | None, num_layers: int, *, generates: bool, device: str, dtype: str,
                 tensor_parallel_size: int, cuda_devices: int) -> tuple[str | None, str | None]:
    """(quantization, gguf file) for `auto` or `gguf`: ("gguf", path) where the file runs
    quantized, (None, None) where `auto` leaves it to the fp32 path (not a GGUF file, a
    float GGUF, a GPU, another dtype, tensor parallelism); GGUFError where `gguf` was asked
    for and cannot run, or a tensor's type has no kernel."""
    path = gguf_source(model)
    on_cpu = device == "cpu" or (device == "auto" and cuda_devices == 0)
    needs = [need for need, failed in (
        ("a .gguf model", path is None), ("a generating model (runner 'generate')", not generates),
        ("the CPU (device 'cpu')", not on_cpu),
        ("dtype 'float32'", dtype not in ("auto", "float32")),
        ("one device (tensor_parallel_size and pipeline_parallel_size 1)", tensor_parallel_size != 1)) if failed]
    if needs:
        if method == "gguf":
            raise GGUFError(f"quantization 'gguf' runs GGUF blocks on the CPU's kernels; it needs {', '.join(needs)}")
        return None, None
    if not check_gguf_types(path, num_layers):
        if method == "gguf":
            raise GGUFError(f"quantization 'gguf': {path} holds float weights, nothing quantized")
        return None, None
    return "gguf", path
