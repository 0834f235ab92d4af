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


async def send(client: httpx.AsyncClient, model: str, prompt: list[int] | str, output_len: int,
               endpoint: str = "completions", temperature: float | None = 0.0) -> RequestResult:
    """One streamed request to /v1/completions (a prompt of token ids or text) or
    /v1/chat/completions (the prompt as one user message). temperature None leaves it to
    the server (1.0, as `vllm bench serve` does)."""
    body = {"model": model, "max_tokens": output_len, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if temperature is not None:
        body["temperature"] = temperature
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}",
                                 json=body) as response:
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
                elif event["choices"] and _chunk_text(event["choices"][0]):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.chunk_gaps.append(now - last)
                    last = now
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
    result.latency = time.perf_counter() - start
    return result


def _chunk_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def drive(url: str, prompts: list, output_len: int, *, endpoint: str = "completions",
                temperature: float | None = 0.0, max_concurrency: int | None = None,
                request_rate: float = float("inf"), seed: int = 0, api_key: str | None = None,
                model: str | None = None) -> tuple[list[RequestResult], float]:
    """Sends every prompt (Poisson arrivals at request_rate, at most max_concurrency in
    flight) after one warm-up request; the results and the seconds from the first send to
    the last answer."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:
        model = model or (await client.get("/v1/models")).json()["data"][0]["id"]
        await send(client, model, prompts[0][:8], 4, endpoint, temperature)  # warm-up
        arrivals = random.Random(seed + 1)
        limit = asyncio.Semaphore(max_concurrency or len(prompts))

        async def one(prompt) -> RequestResult:
            async with limit:
                return await send(client, model, prompt, output_len, endpoint, temperature)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(arrivals.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float]:
    """mean, p50 and p99 in milliseconds (empty: zeros)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": 1000 * statistics.fmean(values), "p50": 1000 * statistics.median(values), "p99": 1000 * p99}


def metrics(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.error is None]
    return {"succeeded": len(done), "requests": len(results), "duration": duration,
            "output_tok_s": sum(r.num_output_tokens for r in done) / duration,
            "ttft": percentiles([r.ttft for r in done]),
            "tpot": percentiles([r.tpot for r in done if r.tpot is not None]),
            "itl": percentiles([gap for r in done for gap in r.chunk_gaps])}


def report(load: str, results: list[RequestResult], duration: float) -> None:
    for failed in [r for r in results if r.error is not None][:5]:
        print("failed:", failed.error)
    m = metrics(results, duration)
    print(f"load: {load}; {m['succeeded']}/{m['requests']} requests succeeded in {duration:.2f} s")
    print(f"request throughput: {m['succeeded'] / duration:.2f} req/s; output: {m['output_tok_s']:.1f} tok/s")
    print("(milliseconds)")
    for name, key in (("time to first token", "ttft"), ("time per output token", "tpot"),
                      ("inter-token latency", "itl")):
        p = m[key]
        print(f"{name:<28} mean {p['mean']:8.1f}  p50 {p['p50']:8.1f}  p99 {p['p99']:8.1f}")


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
    prompts = make_workload(args.num_prompts, args.min_input_len, args.max_input_len, args.vocab_size, args.seed)
    results, duration = asyncio.run(drive(args.url, prompts, args.output_len, max_concurrency=args.max_concurrency,
                                          request_rate=args.request_rate, seed=args.seed, api_key=args.api_key,
                                          model=args.model))
    load = f"{args.request_rate} req/s (Poisson)" if args.request_rate != float("inf") else "all at once"
    if args.max_concurrency:
        load += f", at most {args.max_concurrency} in flight"
    report(load, results, duration)


if __name__ == "__main__":
    main()
