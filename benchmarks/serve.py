"""Online serving: drive a running server (`python -m actors.launch`) with a Poisson or
fixed-concurrency load over HTTP, and report request throughput, output tokens/s, time to
first token (TTFT), time per output token (TPOT) and inter-token latency (ITL): mean, p50
and p99.

Workload (the defaults, as benchmarks/offline_throughput.py): 64 prompts of uniform
random length in [64, 256] token ids (seeded), 128 output tokens each, greedy, ignore_eos,
streamed from /v1/completions with usage.

    python -m actors.launch &                                    # the embedded SmolLM2
    python benchmarks/serve.py                                   # every request at once
    python benchmarks/serve.py --request-rate 4                  # Poisson arrivals, 4 req/s
    python benchmarks/serve.py --max-concurrency 8               # 8 requests in flight

TTFT is from sending a request to its first streamed token; ITL is the gap between two
streamed chunks (a chunk may carry several tokens); TPOT is a request's time after its
first token over its other output tokens. Needs only httpx, not torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ttft: float = 0.0
    latency: float = 0.0
    num_output_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)  # seconds between streamed chunks
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else None


def make_workload(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """The offline benchmark's prompts: random token ids, skipping the first (special) ones."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num_prompts)]


async def send(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                now = time.perf_counter()
                if event.get("usage"):
                    result.num_output_tokens = event["usage"]["completion_tokens"]
                elif event["choices"] and event["choices"][0]["text"]:
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.chunk_gaps.append(now - last)
                    last = now
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
    result.latency = time.perf_counter() - start
    return result


async def run(args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=None, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = make_workload(args.num_prompts, args.min_input_len, args.max_input_len, args.vocab_size, args.seed)
        await send(client, model, prompts[0][:8], 4)  # warm-up
        arrivals = random.Random(args.seed + 1)
        limit = asyncio.Semaphore(args.max_concurrency or len(prompts))

        async def one(prompt: list[int]) -> RequestResult:
            async with limit:
                return await send(client, model, prompt, args.output_len)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(arrivals.expovariate(args.request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summary(name: str, values: list[float]) -> str:
    if not values:
        return f"{name:<28} n/a"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return (f"{name:<28} mean {1000 * statistics.fmean(values):8.1f}  p50 {1000 * statistics.median(values):8.1f}"
            f"  p99 {1000 * p99:8.1f}")


def report(args: argparse.Namespace, results: list[RequestResult], duration: float) -> None:
    done = [r for r in results if r.error is None]
    for failed in [r for r in results if r.error is not None][:5]:
        print("failed:", failed.error)
    load = (f"{args.request_rate} req/s (Poisson)" if args.request_rate != float("inf") else "all at once")
    if args.max_concurrency:
        load += f", at most {args.max_concurrency} in flight"
    num_output_tokens = sum(r.num_output_tokens for r in done)
    print(f"load: {load}; {len(done)}/{len(results)} requests succeeded in {duration:.2f} s")
    print(f"request throughput: {len(done) / duration:.2f} req/s; output: {num_output_tokens / duration:.1f} tok/s")
    print("(milliseconds)")
    print(summary("time to first token", [r.ttft for r in done]))
    print(summary("time per output token", [r.tpot for r in done if r.tpot is not None]))
    print(summary("inter-token latency", [gap for r in done for gap in r.chunk_gaps]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key")
    parser.add_argument("--model", help="default: the first model the server lists")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input-len", type=int, default=64)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=49152, help="prompt ids are drawn below it (SmolLM2's)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrivals per second (default: every request at once)")
    parser.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results, duration = asyncio.run(run(args))
    report(args, results, duration)


if __name__ == "__main__":
    main()
