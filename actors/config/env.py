"""The environment variables the engine reads, read here and nowhere else in actors/: each
is a function, so a variable set after import (a test's monkeypatch, a launcher's child
environment) is seen."""

from __future__ import annotations

import os

# sockets authenticate with it (messages/engine_auth.py)
ENGINE_KEY_VARIABLE = "TROUPE_ENGINE_KEY"


def engine_key() -> str:
    """The passphrase the nodes of a multi-node engine share; ValueError when unset or short."""
    key = os.environ.get(ENGINE_KEY_VARIABLE, "")
    if len(key) < 16:
        raise ValueError(f"nnodes > 1: set {ENGINE_KEY_VARIABLE} to the same secret of 16 characters or more on "
                         f"every node (e.g. {ENGINE_KEY_VARIABLE}=$(python -c 'import secrets; "
                         "print(secrets.token_hex(32))')); the nodes' sockets authenticate with it")
    return key


def cache_dir() -> str:
    """Where converted models are kept (TROUPE_CACHE, else ~/.cache/troupe)."""
    return os.environ.get("TROUPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "troupe")


def runtime_lora_updating_allowed() -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING ("true" or "1"): the server may load and unload
    LoRA adapters on request (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def image_fetch_timeout() -> float:
    """vLLM's VLLM_IMAGE_FETCH_TIMEOUT: seconds an http(s) image_url may take to download (default 5)."""
    return float(os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", "5"))


def media_redirects_allowed() -> bool:
    """vLLM's VLLM_MEDIA_URL_ALLOW_REDIRECTS: an image URL's redirects are followed ("1", the
    default; each hop checked like the URL itself) or refused ("0")."""
    return os.environ.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1").strip().lower() not in ("0", "false")


# OpenAI's bound on a request's n; vLLM's default for VLLM_MAX_N_SEQUENCES is 16384
DEFAULT_MAX_N_SEQUENCES = 128


def max_n_sequences() -> int:
    """vLLM's VLLM_MAX_N_SEQUENCES: the largest n an HTTP request may ask for (default 128)."""
    value = os.environ.get("VLLM_MAX_N_SEQUENCES", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_MAX_N_SEQUENCES


# ---- what benchmarks and tests switch on ----

GPU_IDLE_PROFILE_VARIABLE = "TROUPE_GPU_IDLE_PROFILE"  # a file the worker writes its GPU's idle share to
WORKER_PROFILE_VARIABLE = "TROUPE_WORKER_PROFILE"  # a file the worker writes where its host time went
STAGE_TIMES_DIR_VARIABLE = "TROUPE_STAGE_TIMES_DIR"  # a directory each pipeline stage writes its step times to


def gpu_idle_profile_path() -> str | None:
    return os.environ.get(GPU_IDLE_PROFILE_VARIABLE) or None


def worker_profile_path() -> str | None:
    return os.environ.get(WORKER_PROFILE_VARIABLE) or None


def stage_times_dir() -> str | None:
    return os.environ.get(STAGE_TIMES_DIR_VARIABLE) or None


def triton_interpreter_enabled() -> bool:
    """TRITON_INTERPRET: triton runs its kernels on the CPU, interpreted (the tests' Triton path)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


# ---- Ray (--distributed-executor-backend ray) ----

def ray_placement_timeout() -> float:
    """TROUPE_RAY_PLACEMENT_TIMEOUT_S: seconds Ray may take to place the workers (default 60)."""
    return float(os.environ.get("TROUPE_RAY_PLACEMENT_TIMEOUT_S", "60"))


def ray_address() -> str | None:
    """RAY_ADDRESS: the Ray cluster to join; None: start a local one."""
    return os.environ.get("RAY_ADDRESS") or None


# ---- OpenTelemetry (--otlp-traces-endpoint), the SDK's own variables ----

def otlp_traces_protocol() -> str:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, else "grpc"."""
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))


def otel_service_name(default: str) -> str:
    return os.environ.get("OTEL_SERVICE_NAME", default)


# ---- the HTTP server ----

def server_dev_mode() -> bool:
    """vLLM's VLLM_SERVER_DEV_MODE ("1" or "true"): the development-only routes are served."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "").strip().lower() in ("1", "true")
