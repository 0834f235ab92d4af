"""One request at a time through the actor engine (AsyncClient: input processor,
scheduler, worker, detokenizer as processes), the time between streamed tokens: what the
actors and the hops between them add to the model's own decode step.

    python benchmarks/stream_latency.py
    python benchmarks/stream_latency.py --temperature 1.0 --output-len 128 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not this folder

from actors import AsyncClient, SamplingParams


async def measure(model: str | None, output_len: int, repeats: int, temperature: float) -> list[float]:
    """Seconds between consecutive streamed outputs, over every request's decode."""
    gaps: list[float] = []
    async with AsyncClient(model, kv_cache_memory="256MiB") as client:
        await client.generate("Warm the engine up.", SamplingParams(max_tokens=8, ignore_eos=True))
        for repeat in range(repeats):
            params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=repeat)
            last = None
            async for _ in client.generate(f"Tell me a long story, number {repeat}.", params):
                now = time.perf_counter()
                if last is not None:  # the first output's wait is the prefill's
                    gaps.append(now - last)
                last = now
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    gaps = asyncio.run(measure(args.model, args.output_len, args.repeats, args.temperature))
    print(f"temperature {args.temperature}: {len(gaps)} gaps, median {statistics.median(gaps) * 1e3:.2f} ms, "
          f"mean {statistics.mean(gaps) * 1e3:.2f} ms, p90 {statistics.quantiles(gaps, n=10)[-1] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
