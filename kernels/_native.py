"""Builds a C++ CPU kernel file (kernels/NAME.cpp) into a shared library on first use and
loads it with ctypes.

A plain C ABI and ctypes, not a torch extension: the source includes no torch header, so
it compiles in about a second where torch/extension.h takes a minute on two cores, and a
machine without a compiler just goes without (the caller falls back to torch).

The library is built for this machine (-march=native) and kept in the caller's build
directory under a name hashed from the source, the flags, the compiler and the CPU's
feature flags, so a home directory shared by different machines serves each its own.

OpenMP: the library needs libgomp.so.1, the soname of the copy torch ships and has already
loaded, so the dynamic loader hands it that copy: the kernels run on torch's own thread
pool rather than a second one that would fight it for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile

logger = logging.getLogger(__name__)

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]
if platform.machine() in ("x86_64", "AMD64"):
    # GCC and clang default to 256-bit vectors even where AVX-512 is there
    _FLAGS.append("-mprefer-vector-width=512")
_COMPILE_TIMEOUT_S = 300


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    return next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


@functools.cache
def load_library(name: str, build_dir: str) -> ctypes.CDLL | None:
    """The library built from kernels/{name}.cpp, or None (logged once) where it cannot be
    built or loaded."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.cpp")
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler (c++, g++ or clang++) on PATH: the CPU runs torch's slower kernels")
        return None
    with open(source, "rb") as file:
        code = file.read()
    for header in re.findall(rb'#include "([^"]+)"', code):  # local headers count in the build's hash
        with open(os.path.join(os.path.dirname(source), header.decode()), "rb") as file:
            code += file.read()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join(part.encode() if isinstance(part, str) else part for part in
                                    (code, " ".join(_FLAGS), version, _cpu_features()))).hexdigest()[:16]
    library = os.path.join(build_dir, f"{name}-{key}.so")
    if not os.path.exists(library):
        os.makedirs(build_dir, exist_ok=True)
        # built beside its final name, then renamed: two processes building at once both succeed
        handle, partial = tempfile.mkstemp(suffix=".so", dir=build_dir)
        os.close(handle)
        try:
            result = subprocess.run([compiler, *_FLAGS, source, "-o", partial], capture_output=True, text=True,
                                    timeout=_COMPILE_TIMEOUT_S)
            if result.returncode != 0:
                logger.warning("building %s failed; the CPU runs torch's slower kernels:\n%s", source,
                               result.stderr[-2000:])
                return None
            os.replace(partial, library)
        except (OSError, subprocess.TimeoutExpired) as error:
            logger.warning("building %s failed (%s); the CPU runs torch's slower kernels", source, error)
            return None
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    try:
        return ctypes.CDLL(library)
    except OSError as error:
        logger.warning("loading %s failed (%s); the CPU runs torch's slower kernels", library, error)
        return None
