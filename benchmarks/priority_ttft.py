"""Time to first token of urgent requests on a saturated engine, by scheduling policy: the
embedded SmolLM2 behind AsyncClient (real actor processes), max_num_seqs requests running
and as many again waiting, all with long outputs, then a burst of short urgent requests
(priority -1 under the priority policy; the same requests under FCFS, where priority
cannot be given). Compared with the same burst on the idle engine.

    python benchmarks/priority_ttft.py
    python benchmarks/priority_ttft.py --max-num-seqs 4 --burst 2 --background-tokens 128
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

URGENT_PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


async def first_token(client: AsyncClient, prompt: str, priority: int) -> float:
    start = time.perf_counter()
    async for _ in client.generate(prompt, URGENT_PARAMS, priority=priority):
        return time.perf_counter() - start
    raise RuntimeError("no output")


async def burst(client: AsyncClient, size: int, priority: int) -> list[float]:
    return list(await asyncio.gather(*(first_token(client, f"Urgent question {i}: what is {i} + {i}?", priority)
                                       for i in range(size))))


async def measure(policy: str, args: argparse.Namespace) -> tuple[list[float], list[float], float]:
    """(idle burst TTFTs, saturated burst TTFTs, seconds until the background finished)."""
    async with AsyncClient(kv_cache_memory="512MiB", max_num_seqs=args.max_num_seqs,
                           scheduling_policy=policy) as client:
        await burst(client, args.burst, 0)  # warm-up
        idle = await burst(client, args.burst, 0)
        background_params = SamplingParams(temperature=0.0, max_tokens=args.background_tokens, ignore_eos=True)
        background_priority = 1 if policy == "priority" else 0

        async def background(i: int) -> None:
            async for _ in client.generate(f"Write a long essay about topic number {i}.", background_params,
                                           priority=background_priority):
                pass

        start = time.perf_counter()
        tasks = [asyncio.ensure_future(background(i)) for i in range(2 * args.max_num_seqs)]
        while (await client.get_stats())["num_running"] < args.max_num_seqs:
            await asyncio.sleep(0.01)
        await asyncio.sleep(args.settle)  # the running ones decoding, the rest waiting
        saturated = await burst(client, args.burst, -1 if policy == "priority" else 0)
        await asyncio.gather(*tasks)
        return idle, saturated, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--burst", type=int, default=4, help="urgent requests sent at once")
    parser.add_argument("--background-tokens", type=int, default=256, help="output tokens of each background request")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds of saturation before the burst")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    for repeat in range(args.repeats):
        for policy in ("fcfs", "priority"):
            idle, saturated, total = asyncio.run(measure(policy, args))
            print(f"run {repeat} {policy:8s}: idle TTFT median {statistics.median(idle) * 1e3:7.1f} ms, "
                  f"saturated median {statistics.median(saturated) * 1e3:8.1f} ms (max {max(saturated) * 1e3:8.1f}), "
                  f"ratio {statistics.median(saturated) / statistics.median(idle):5.2f}; "
                  f"background done in {total:.1f} s", flush=True)


if __name__ == "__main__":
    main()
