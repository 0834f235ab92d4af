"""The one place the model runner hands a loaded decoder to its --quantization method: the
checkpoint's weight stream for a quantized checkpoint, and afterwards the backend whose
linears run the quantized weights (the float projections swapped for them). Unquantized
models pass through untouched, so nothing here runs per step."""

from __future__ import annotations

from collections.abc import Iterable

from actors.quantization import CHECKPOINT_METHODS


def checkpoint_weight_stream(weights: Iterable[tuple[str, object]], engine) -> Iterable[tuple[str, object]]:
    """A quantized checkpoint's packed tensors gathered per linear and yielded dequantized
    (checkpoint_weights.py); any other checkpoint's weights as they are."""
    if engine.quantization not in CHECKPOINT_METHODS or quantized_at_load(engine):
        return weights
    from actors.quantization.checkpoint_weights import checkpoint_weights

    return checkpoint_weights(weights, engine.model.model_path)


def quantized_backend(model, backend, engine, parallel):
    """The backend that runs the decoder `model` with its weights quantized by
    engine.quantization (None: `backend` itself)."""
    method = engine.quantization
    if model is None or method is None:
        return backend
    if method == "gguf":  # the projections' fp32 weights swapped for the file's blocks
        from actors.quantization.gguf import use_gguf_weights

        return use_gguf_weights(model, backend, engine.gguf_file)
    if quantized_at_load(engine) and (method == "fp8" or model.device.type == "cuda"):
        from actors.quantization.online_gpu import use_online_weights  # fp8, or int8 on CUDA

        return use_online_weights(model, backend, method)
    if method == "int8":  # W8A8 on the CPU (int8_decoder.py), smoothed unless LoRA adds to the linears' inputs
        from actors.quantization.int8_decoder import use_int8_weights
        from actors.quantization.int8_smoothing import calibration_token_ids

        # (the smoothing's calibration pass runs LlamaModel's layer: a model with another
        # layer, Gemma's, is quantized unsmoothed rather than smoothed by wrong activations)
        calibration = None if engine.lora is not None or not (model.fused_cpu_step and model.llama_layer) \
            else calibration_token_ids(engine.tokenizer_path or engine.model.model_path)
        return use_int8_weights(model, backend, calibration_ids=calibration)
    if method in CHECKPOINT_METHODS:  # Triton, or GGUF blocks on the CPU
        from actors.quantization.checkpoint_weights import use_checkpoint_kernels

        return use_checkpoint_kernels(model, backend, engine.model.model_path, parallel)
    return backend


def quantized_at_load(engine) -> bool:
    """Whether engine.quantization quantizes a float checkpoint as it loads (int8, or fp8 where
    config.json has no quantization_config) rather than reading a quantized checkpoint."""
    if engine.quantization == "int8":
        return True
    from actors.config.quantization import read_checkpoint_quant

    return engine.quantization == "fp8" and read_checkpoint_quant(engine.model.model_path) is None
