"""llama.cpp (llama-cpp-python) as a peer on the same GGUF file: single-stream decode time,
perplexity on the token windows troupe's benchmarks/quality.py scores, and an offline workload's
greedy generation (benchmarks/moe_gguf.py): its requests one after another through the
high-level API (which has no batching of requests), or all at once as sequences of one
llama_decode batch (llama.cpp's own batched generation, as its server's parallel slots run).

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
    /work/llamacpp-venv/bin/python benchmarks/llama_cpp_peer.py generate --model FILE.gguf --prompts P.json
    /work/llamacpp-venv/bin/python benchmarks/llama_cpp_peer.py batched --model FILE.gguf --prompts P.json
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


def run_peer(python: str | None, command: str, model: str, *args: str, windows: list[list[int]] | None = None,
             prompts: list[list[int]] | None = None) -> dict | None:
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
        if prompts is not None:
            path = os.path.join(scratch, "prompts.json")
            with open(path, "w") as file:
                json.dump(prompts, file)
            extra += ["--prompts", path]
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
            # (Llama.eval keeps no scores without logits_all: the context's own logits)
            token = int(np.argmax(_last_logits(llm._ctx.ctx, llm.n_vocab())[0]))
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


def _last_logits(ctx, n_vocab: int, rows: int = 1):
    """The logits of the last decode's `rows` output rows (the C array llama.cpp holds)."""
    import llama_cpp
    import numpy as np

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(rows, n_vocab))


def generate(args: argparse.Namespace) -> dict:
    """The prompts' greedy generation one request after another through the high-level API
    (Llama.eval: a prompt in batches of up to 512, then a token a call), --output-len tokens
    each, end-of-sequence ignored (nothing stops early): output tokens and seconds."""
    import numpy as np

    with open(args.prompts) as file:
        prompts = json.load(file)
    llm = _load(args.model, max(map(len, prompts)) + args.output_len + 8, args.threads, logits_all=False)
    n_vocab = llm.n_vocab()
    tokens = 0
    start = time.perf_counter()
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        for step in range(args.output_len):
            token = int(np.argmax(_last_logits(llm._ctx.ctx, n_vocab)[0]))
            tokens += 1
            if step + 1 < args.output_len:
                llm.eval([token])
    return {"seconds": time.perf_counter() - start, "output_tokens": tokens, "threads": args.threads}


def batched(args: argparse.Namespace) -> dict:
    """The prompts' greedy generation all at once through llama.cpp's low-level API: one
    sequence each in one context (a KV stream per sequence, llama.cpp's advice for sequences
    sharing no prefix), prompts packed into llama_decode batches of up to --n-batch tokens,
    then one batch a step of every sequence's next token. Output tokens and seconds."""
    import llama_cpp as L
    import numpy as np

    with open(args.prompts) as file:
        prompts = json.load(file)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(args.model.encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    per_seq = -(-(max(map(len, prompts)) + args.output_len + 8) // 256) * 256
    params.n_seq_max, params.kv_unified = len(prompts), args.kv_unified
    params.n_ctx, params.n_batch, params.n_ubatch = per_seq * len(prompts), args.n_batch, args.n_batch
    params.n_threads = params.n_threads_batch = args.threads
    ctx = L.llama_init_from_model(model, params)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(args.n_batch, len(prompts)), 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode of (token, position, sequence, wants logits) entries: the logits rows."""
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return _last_logits(ctx, n_vocab, sum(e[3] for e in entries))

    start = time.perf_counter()
    flat = [(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
    next_tokens = []
    for i in range(0, len(flat), args.n_batch):
        chunk = flat[i:i + args.n_batch]
        next_tokens += np.argmax(decode(chunk), axis=1).tolist()
    tokens = len(next_tokens)
    for step in range(1, args.output_len):
        entries = [(t, len(p) + step - 1, seq, True) for seq, (t, p) in enumerate(zip(next_tokens, prompts))]
        next_tokens = np.argmax(decode(entries), axis=1).tolist()
        tokens += len(next_tokens)
    seconds = time.perf_counter() - start
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {"seconds": seconds, "output_tokens": tokens, "threads": args.threads, "n_batch": args.n_batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("decode", "perplexity", "generate", "batched"))
    parser.add_argument("--model", required=True, help="the .gguf file")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", help="perplexity: a JSON list of token-id windows")
    parser.add_argument("--prompts", help="generate, batched: a JSON list of prompts' token ids")
    parser.add_argument("--n-batch", type=int, default=512, help="batched: tokens a llama_decode call at most")
    parser.add_argument("--kv-unified", action="store_true", help="batched: one KV buffer for all sequences")
    args = parser.parse_args()
    import llama_cpp

    commands = {"decode": decode, "perplexity": perplexity, "generate": generate, "batched": batched}
    result = commands[args.command](args)
    print(json.dumps({**result, "llama_cpp_python": llama_cpp.__version__}))


if __name__ == "__main__":
    sys.exit(main())
