"""llama.cpp (llama-cpp-python) as a peer on the same GGUF file: single-stream decode time and
perplexity on the token windows troupe's benchmarks/quality.py scores.

It runs under the Python that has llama_cpp (a separate virtual environment: llama-cpp-python
builds llama.cpp from source and must not land in troupe's), as a subprocess of troupe's
benchmarks, which pass it `--llama-cpp-python PATH` (run_peer below; skipped with a message
where PATH is not there). It imports nothing of troupe's: the benchmarks hand it the file and,
for perplexity, the token ids troupe's tokenizer made, so both score the same tokens.

    python3 -m venv /work/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /work/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36
    python benchmarks/decode_latency.py --batch-sizes 1 --quantization none,gguf \\
        --llama-cpp-python /work/llamacpp-venv/bin/python
    python benchmarks/quality.py --llama-cpp-python /work/llamacpp-venv/bin/python

    # directly: prints one JSON object
    /work/llamacpp-venv/bin/python benchmarks/llama_cpp_peer.py decode --model FILE.gguf
    /work/llamacpp-venv/bin/python benchmarks/llama_cpp_peer.py perplexity --model FILE.gguf --windows W.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

_THIS_FILE = os.path.abspath(__file__)
_TIMEOUT_S = 3600


def run_peer(python: str | None, command: str, model: str, *args: str, windows: list[list[int]] | None = None
             ) -> dict | None:
    """This file's `command` under `python` (llama-cpp-python's interpreter), its JSON answer;
    None, with the reason printed, where python is not given or not there."""
    if not python:
        return None
    if not os.path.exists(python):
        print(f"llama.cpp peer skipped: {python} does not exist (see benchmarks/llama_cpp_peer.py to build it)")
        return None
    with tempfile.TemporaryDirectory() as scratch:
        extra = list(args)
        if windows is not None:
            path = os.path.join(scratch, "windows.json")
            with open(path, "w") as file:
                json.dump(windows, file)
            extra += ["--windows", path]
        result = subprocess.run([python, _THIS_FILE, command, "--model", model, *extra], capture_output=True,
                                text=True, timeout=_TIMEOUT_S)
    if result.returncode != 0:
        print(f"llama.cpp peer failed ({result.returncode}):\n{result.stderr[-2000:]}")
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def _load(model: str, n_ctx: int, threads: int, logits_all: bool):
    from llama_cpp import Llama

    return Llama(model_path=model, n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=threads,
                 n_threads_batch=threads, logits_all=logits_all, verbose=False)


def decode(args: argparse.Namespace) -> dict:
    """Greedy single-stream decode after a prefilled prompt of random token ids (as troupe's
    decode_latency.py): ms a token, the median of the repeats."""
    import numpy as np

    llm = _load(args.model, args.prompt_len + args.output_len + 8, args.threads, logits_all=False)
    rng = random.Random(0)
    times = []
    for _ in range(args.repeats):
        prompt = [rng.randrange(100, 30000) for _ in range(args.prompt_len)]
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(args.output_len):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([token])
        times.append((time.perf_counter() - start) / args.output_len * 1e3)
    return {"ms_per_token": statistics.median(times), "runs_ms": times, "threads": args.threads}


def perplexity(args: argparse.Namespace) -> dict:
    """Every window's tokens after its first scored from the window's tokens before it (no BOS
    added: the windows are troupe's, as its quality.py scores them)."""
    import numpy as np

    with open(args.windows) as file:
        windows = json.load(file)
    llm = _load(args.model, max(len(w) for w in windows), args.threads, logits_all=True)
    logprobs = []
    start = time.perf_counter()
    for window in windows:
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[:len(window) - 1], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        logprobs.extend((logits[np.arange(len(window) - 1), window[1:]] - log_z).tolist())
    return {"perplexity": math.exp(-sum(logprobs) / len(logprobs)), "tokens": len(logprobs),
            "seconds": time.perf_counter() - start, "threads": args.threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("decode", "perplexity"))
    parser.add_argument("--model", required=True, help="the .gguf file")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", help="perplexity: a JSON list of token-id windows")
    args = parser.parse_args()
    import llama_cpp

    result = decode(args) if args.command == "decode" else perplexity(args)
    print(json.dumps({**result, "llama_cpp_python": llama_cpp.__version__}))


if __name__ == "__main__":
    sys.exit(main())
