"""The engine flags' machinery: how an EngineArgs field becomes a command-line flag
(CliFlag in its metadata, add_flag), the --help sections, and the small checks the
fields share. Light to import, like engine_args: no torch."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.config.cache import parse_size

# The --help sections of the engine flags: group name -> (title, description)
CLI_GROUPS = {
    "model": ("model", None),
    "engine": ("engine", None),
    "lora": ("LoRA adapters", "Serve fine-tunes of the model (PEFT adapters) beside it: a request names one "
                              "(the API's model field, LLM.generate's lora_request)."),
    "inputs": ("images and chat templates", "What the input processor takes from a request's images and chat "
                                            "template before it refuses them (docs/security.md)."),
    "pooling": ("pooling models", "Run the model for embeddings or classification scores (LLM.embed, "
                                  "LLM.classify, LLM.score, /v1/embeddings...) instead of generating text."),
    "nodes": ("several machines",
              "Node 0 serves HTTP and runs the first tensor-parallel ranks; every other node runs its share of the "
              "ranks only, started with the same flags and its own --node-rank. They meet at --master-addr: "
              "torch.distributed on --master-port, ZeroMQ over tcp on the ports just above it."),
}


@dataclass(frozen=True)
class CliFlag:
    """How a field appears on the command line: --field-name, or --[no-]field-name for a bool."""

    help: str  # " (default: ...)" is appended unless the text has one
    group: str = "engine"  # a CLI_GROUPS key
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # str -> value; None: the type of the default (str if None)
    hidden_negations: tuple[str, ...] = ()  # older spellings of --no-field-name, kept working, not shown
    nargs: str | None = None  # "+": one or more values, as a list


def cli_arg(default: Any, help: str, **flag: Any) -> Any:
    """A dataclass field that is also a command-line flag (CliFlag's fields as keywords)."""
    return field(default=default, metadata={"cli": CliFlag(help, **flag)})


def parse_size_flag(text: str) -> int:
    """parse_size for argparse: a usage error (exit 2) for a value that is no size."""
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes or a size like 512MiB or 2GiB, got {text!r}") from None


def check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "a non-negative integer"
        raise ValueError(f"{name} must be {kind}, got {value!r}")


def add_flag(group: argparse._ArgumentGroup, spec: dataclasses.Field) -> None:
    flag: CliFlag = spec.metadata["cli"]
    name = "--" + spec.name.replace("_", "-")
    if isinstance(spec.default, bool):
        help_text = f"{flag.help} (default: {'on' if spec.default else 'off'})"
        group.add_argument(name, action=argparse.BooleanOptionalAction, default=spec.default, help=help_text)
        for negation in flag.hidden_negations:
            group.add_argument(negation, dest=spec.name, action="store_false", help=argparse.SUPPRESS)
        return
    help_text = flag.help
    if spec.default is not None and "(default:" not in help_text:
        help_text += " (default: %(default)s)"
    parse = flag.parse or (str if spec.default is None else type(spec.default))
    group.add_argument(name, default=spec.default, type=parse, choices=flag.choices, metavar=flag.metavar,
                       help=help_text, nargs=flag.nargs)


def cuda_device_count() -> int:
    """The CUDA devices this process may use (CUDA_VISIBLE_DEVICES applies), asked of the
    NVIDIA driver without importing torch; 0 without a driver. The worker decides the
    device itself (torch.cuda); this only picks defaults and checks arguments early."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value
