"""Start-up checks of quantizing an unquantized checkpoint at load time on GPUs (torch-free:
the engine config runs them in any process). What runs is in online_gpu.py."""

from __future__ import annotations

import ctypes

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 matrix multiplies
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 75, 76


class OnlineQuantError(ValueError):
    """`--quantization fp8` asked where quantizing at load time cannot run."""


def cuda_capability(index: int = 0) -> tuple[int, int] | None:
    """The compute capability of CUDA device `index` (of those CUDA_VISIBLE_DEVICES shows),
    asked of the NVIDIA driver without importing torch; None without a driver or device."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(device), index) != 0:
        return None
    for value, attribute in ((major, _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                             (minor, _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)):
        if driver.cuDeviceGetAttribute(ctypes.byref(value), attribute, device) != 0:
            return None
    return major.value, minor.value


def check_online_fp8(device: str | None, cuda_devices: int, capability: tuple[int, int] | None) -> None:
    """OnlineQuantError naming `quantization` where FP8 cannot run: the CPU, or a GPU before
    compute capability 8.9."""
    on_cpu = device == "cpu" or (device in (None, "auto") and cuda_devices == 0)
    need = "quantization 'fp8' quantizes the weights to FP8 at load time, which needs a CUDA device with " \
           f"compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}"
    if on_cpu:
        raise OnlineQuantError(f"{need}; the device is the CPU (for the CPU: --quantization int8)")
    if capability is not None and capability < FP8_MIN_CAPABILITY:
        raise OnlineQuantError(f"{need}; this GPU has {capability[0]}.{capability[1]}")
