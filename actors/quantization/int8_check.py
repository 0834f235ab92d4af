"""Start-up checks of `--quantization int8` for decoders (torch-free: the engine config runs
them in any process). What runs is in int8_decoder.py (the CPU) and online_gpu.py (CUDA)."""

from __future__ import annotations


class Int8Error(ValueError):
    """`--quantization int8` asked of a decoder where it cannot run."""


def check_int8_decoder(device: str | None, dtype: str, pipeline_parallel_size: int, cuda_devices: int) -> None:
    """Int8Error at start-up, naming what is missing, where a decoder cannot run int8: on the
    CPU its kernels are kernels/int8_gemm.cpp's, fed fp32 activations, with tensor
    parallelism (each rank quantizes its shards) but one pipeline stage (smoothing runs the
    whole model); on CUDA the Triton int8 GEMM (kernels/quant_triton.py), which needs a GPU."""
    on_cpu = device == "cpu" or (device in (None, "auto") and cuda_devices == 0)
    if not on_cpu:
        if cuda_devices == 0:
            raise Int8Error(f"quantization 'int8' on device {device!r} needs a CUDA device; none is visible")
        return
    needs = [need for need, failed in (
        ("dtype 'float32'", dtype not in ("auto", "float32")),
        ("pipeline_parallel_size 1", pipeline_parallel_size != 1)) if failed]
    if needs:
        raise Int8Error(f"quantization 'int8' runs decoders on the CPU's int8 kernels; it needs {', '.join(needs)}")
