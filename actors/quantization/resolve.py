"""--quantization resolved at start-up against the model (torch-free): the flag checked for
this kind of model, int8 decoders' limits, a .gguf file's own types (auto/gguf), and a
quantized checkpoint's quantization_config. Every refusal is a ValueError naming the field.
Unset on a .gguf model (the embedded default's included) it is `auto`, which falls back to
float32 where a tensor's type has no kernel rather than refusing the file."""

from __future__ import annotations

import logging

from actors.config.cli_flags import cuda_device_count
from actors.quantization import GGUF_METHODS, check_quantization
from actors.config.quantization import read_checkpoint_quant, resolve_checkpoint_quantization
from actors.quantization.gguf_types import GGUFError, gguf_source, resolve_gguf
from actors.quantization.int8_check import check_int8_decoder
from actors.quantization.online_check import check_online_fp8, cuda_capability
from kernels._native import _compiler

logger = logging.getLogger(__name__)


def resolve_quantization(args, model_config, generates: bool) -> tuple[str | None, str | None]:
    """(the method the workers run, the .gguf file whose blocks they read or None) for the
    EngineArgs `args` and the model's config."""
    quantization, gguf_file = check_quantization(args.quantization), None
    unset = args.quantization is None  # a .gguf model's default is `auto` (docs/quantization.md: the default)
    if unset and gguf_source(args.model) is not None and _compiler() is not None:  # the kernels build
        quantization = "auto"
    devices = args.tensor_parallel_size * args.pipeline_parallel_size  # one device: pipeline stages count too
    if quantization == "int8" and not model_config.is_encoder:
        check_int8_decoder(args.device, args.dtype, args.pipeline_parallel_size, cuda_device_count())
    if quantization == "fp8" and read_checkpoint_quant(model_config.model_path) is None:  # quantized at load
        check_online_fp8(args.device, cuda_device_count(), cuda_capability())
    if quantization in GGUF_METHODS:
        try:
            quantization, gguf_file = resolve_gguf(
                quantization, args.model, model_config.num_hidden_layers, generates=generates,
                device=args.device, dtype=args.dtype, tensor_parallel_size=devices, cuda_devices=cuda_device_count())
        except GGUFError as error:
            if not unset:  # asked for by name: refused, naming the tensor
                raise
            logger.warning("%s: running the file dequantized to float32 (--quantization none)", error)
            quantization = None
    if gguf_file is None:  # a quantized checkpoint's own method, checked against the flag
        quantization = resolve_checkpoint_quantization(quantization, model_config, args.tensor_parallel_size)
    return quantization, gguf_file
