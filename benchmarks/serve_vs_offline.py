"""The same requests offline (`LLM.generate` / `LLM.chat` in this process) and through the
HTTP server (`python -m actors.launch`, streamed over HTTP at fixed concurrency), in one
invocation: output tok/s of each and their ratio, with the server's TTFT, TPOT and ITL.

Workload (defaults, as issue 13 and `vllm bench serve --dataset-name random`): 128
requests of 134-250 random input tokens (192 +- 30%), 128 output tokens, ignore_eos,
temperature 1.0 (what the server does when a client sends none, as vllm bench), 64 in
flight; the engine with --max-model-len 1024 --max-num-seqs 64 and no prefix caching.
Completions send the prompts as token ids; chat sends each as one user message, the text
the random ids decode to, and the offline side renders the same messages with LLM.chat.
Offline and served runs alternate (offline completions, served completions, offline
chat, served chat) so that a drift of the machine's speed shows in both.

    python benchmarks/serve_vs_offline.py                         # the embedded SmolLM2
    python benchmarks/serve_vs_offline.py --endpoints completions --num-prompts 32
    python benchmarks/serve_vs_offline.py --server-args "--max-num-batched-tokens 2048"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
if __name__ == "__main__":  # this checkout's troupe, and benchmarks/serve.py beside this file
    sys.path = [_REPO, _HERE] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import httpx  # noqa: E402

from serve import drive, metrics  # noqa: E402


def random_prompts(num: int, input_len: int, range_ratio: float, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low, high = round(input_len * (1 - range_ratio)), round(input_len * (1 + range_ratio))
    return [[rng.randrange(100, vocab_size) for _ in range(rng.randint(low, high))] for _ in range(num)]


def offline(llm, endpoint: str, prompts: list, args: argparse.Namespace) -> dict:
    from actors import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    if endpoint == "chat":
        outputs = llm.chat([[{"role": "user", "content": text}] for text in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    return {"duration": elapsed, "output_tok_s": tokens / elapsed, "tokens": tokens}


class Server:
    """`python -m actors.launch` in a session of its own, stopped with SIGTERM."""

    def __init__(self, engine_flags: list[str], extra: list[str]) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "actors.launch", "--port", str(self.port), "--log-level", "warning",
                   *engine_flags, *extra]
        self.process = subprocess.Popen(command, cwd=_REPO, start_new_session=True,
                                        env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                            filter(None, [_REPO, os.environ.get("PYTHONPATH")]))})

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server was not ready in {timeout:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--endpoints", default="completions,chat")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=192)
    parser.add_argument("--range-ratio", type=float, default=0.3)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="more flags for actors.launch, as one string")
    args = parser.parse_args()

    from actors import LLM

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              enable_prefix_caching=False, seed=args.seed)
    ids = random_prompts(args.num_prompts, args.input_len, args.range_ratio, llm.config.model.vocab_size, args.seed)
    texts = [llm.get_tokenizer().decode(prompt) for prompt in ids]
    engine_flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
                    "--no-enable-prefix-caching", "--seed", str(args.seed)]
    if args.model:
        engine_flags += ["--model", args.model]
    server = Server(engine_flags, shlex.split(args.server_args))
    try:
        server.wait_ready()
        rows = []
        for endpoint in args.endpoints.split(","):
            prompts = texts if endpoint == "chat" else ids
            offline(llm, endpoint, prompts[:2], args)  # warm-up
            off = offline(llm, endpoint, prompts, args)
            results, duration = asyncio.run(drive(server.url, prompts, args.output_len, endpoint=endpoint,
                                                  temperature=args.temperature,
                                                  max_concurrency=args.max_concurrency, seed=args.seed))
            served = metrics(results, duration)
            rows.append((endpoint, off, served))
            print(f"{endpoint}: offline {off['output_tok_s']:.1f} tok/s ({off['duration']:.1f} s), served "
                  f"{served['output_tok_s']:.1f} tok/s ({duration:.1f} s, {served['succeeded']}/{served['requests']} "
                  f"ok): served / offline {served['output_tok_s'] / off['output_tok_s']:.2f}x", flush=True)
    finally:
        server.stop()
        llm.close()
    print(f"\n{args.num_prompts} requests, {args.max_concurrency} in flight, input {args.input_len} +- "
          f"{args.range_ratio:.0%}, output {args.output_len}, temperature {args.temperature}; times in ms")
    print("| endpoint | offline tok/s | served tok/s | served / offline | TTFT p50 / p99 | TPOT p50 / p99 "
          "| ITL p50 / p99 |\n|---|---|---|---|---|---|---|")
    for endpoint, off, served in rows:
        ttft, tpot, itl = served["ttft"], served["tpot"], served["itl"]
        print(f"| {endpoint} | {off['output_tok_s']:.1f} | {served['output_tok_s']:.1f} | "
              f"{served['output_tok_s'] / off['output_tok_s']:.2f}x | {ttft['p50']:.0f} / {ttft['p99']:.0f} | "
              f"{tpot['p50']:.0f} / {tpot['p99']:.0f} | {itl['p50']:.0f} / {itl['p99']:.0f} |")


if __name__ == "__main__":
    main()
