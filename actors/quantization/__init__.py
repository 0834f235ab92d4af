"""Quantized weights: the `--quantization` methods and the linear layers that run them.

A model keeps each linear layer's weight as the method prepared it (actors/layers/quant_linear.py:
LinearMethod.prepare) and calls the method to apply it; `None` (the default) runs the
checkpoint's own dtype. Torch-free here, so the config can check the flag in any process."""

from __future__ import annotations

# vLLM's `--quantization` values that troupe runs, and where:
#   int8: weights quantized at load time to int8 per output channel, activations per
#         token at run time (W8A8, dynamic); BERT-family encoders (CPU, CUDA), decoders on
#         the CPU in fp32 (int8_decoder.py, kernels/int8_gemm.cpp)
#   gguf: a .gguf model's block-quantized weights (Q4_0, Q4_1, Q8_0) as the file has them,
#         int8 block dot products on the CPU (gguf.py, kernels/gguf_linear.cpp)
#   auto: gguf where a .gguf model can run so (the CPU, float32, one device), else none
#   gptq, awq, compressed-tensors, fp8: a checkpoint's quantization_config (actors/config/quantization.py)
QUANTIZATION_METHODS = ("auto", "gguf", "int8", "gptq", "awq", "compressed-tensors", "fp8")
CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")  # read from config.json's quantization_config
GGUF_METHODS = ("auto", "gguf")  # resolved against the model file at start-up (gguf_types.resolve_gguf)


def check_quantization(method: str | None) -> str | None:
    """The method, normalised (None and "none" mean unquantized); ValueError naming the flag
    for a method troupe does not run (what each method needs of the model is checked where it
    resolves: resolve.py)."""
    if method is None or method == "none":
        return None
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {method!r} is not supported; choose from "
                         f"{', '.join(('none',) + QUANTIZATION_METHODS)}")
    return method
