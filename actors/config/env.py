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
