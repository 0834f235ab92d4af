"""Time to first token of a long prompt asked again after its prefix was evicted from the
device KV pool: loaded back from the host tier (--kv-offload-size) against recomputed (no
host tier). The embedded SmolLM2 through LLM, one engine per case; the device pool holds a
little more than one prompt, so the other prompts in between evict the first one's blocks.
Then the disk tier (--kv-offload-dir): the prompt asked of a new engine after the one that
computed it was closed.

    python benchmarks/kv_offload.py
    python benchmarks/kv_offload.py --prefix-tokens 1000 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not this folder

from actors import LLM, SamplingParams

FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
BLOCK_SIZE = 16


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int, list[int]]:
    """(seconds to the first token, prompt tokens served from a cache, the token)."""
    start = time.perf_counter()
    output = llm.generate([{"prompt_token_ids": prompt}], FIRST_TOKEN, use_tqdm=False)[0]
    return time.perf_counter() - start, output.num_cached_tokens, list(output.outputs[0].token_ids)


def measure(host_tier: str | None, args: argparse.Namespace) -> list[tuple[float, int, list[int]]]:
    """Per repeat: a fresh prompt, two others of the same length (they evict it), then the
    first again; its TTFT, cached tokens and token."""
    num_blocks = -(-args.prefix_tokens // BLOCK_SIZE) + 8  # one prompt and a little room
    llm = LLM(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, max_num_batched_tokens=args.prefix_tokens,
              max_model_len=args.prefix_tokens + 16, kv_offload_size=host_tier)
    rng = random.Random(0)
    vocab = llm.config.model.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(args.prefix_tokens)]

    ttft(llm, prompt())  # warm-up
    results = []
    for _ in range(args.repeats):
        first = prompt()
        ttft(llm, first)
        for _ in range(2):
            ttft(llm, prompt())
        results.append(ttft(llm, first))
    if host_tier is not None:
        stats = llm.scheduler.stats()
        print(f"  host tier: {stats['num_spilled_blocks']} blocks spilled, {stats['num_blocks_swapped_in']} loaded "
              f"back, {stats['num_external_prefix_hit_tokens']} tokens hit", flush=True)
    return results


def measure_restart(args: argparse.Namespace) -> list[tuple[float, int, list[int]]]:
    """Per repeat: a fresh prompt computed by one engine, which is closed, then asked of a
    new engine on the same disk tier; its TTFT, cached tokens and token."""
    engine_args = dict(block_size=BLOCK_SIZE, num_kv_blocks=-(-args.prefix_tokens // BLOCK_SIZE) + 8,
                       max_num_batched_tokens=args.prefix_tokens, max_model_len=args.prefix_tokens + 16,
                       kv_offload_size=args.host_tier)
    rng = random.Random(1)
    results = []
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(args.repeats):
            with LLM(**engine_args, kv_offload_dir=directory) as llm:
                vocab = llm.config.model.vocab_size
                prompt = [rng.randrange(100, vocab) for _ in range(args.prefix_tokens)]
                ttft(llm, prompt)
            with LLM(**engine_args, kv_offload_dir=directory) as llm:
                ttft(llm, [rng.randrange(100, vocab) for _ in range(64)])  # warm-up, another prefix
                results.append(ttft(llm, prompt))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--host-tier", default="2GiB", help="--kv-offload-size of the host-tier case")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    recomputed = measure(None, args)
    loaded = measure(args.host_tier, args)
    restarted = measure_restart(args)
    for name, results in (("recomputed", recomputed), ("host tier", loaded), ("disk tier", restarted)):
        print(f"{name:10s}: TTFT median {statistics.median(r[0] for r in results) * 1e3:8.1f} ms "
              f"({', '.join(f'{r[0] * 1e3:.0f}' for r in results)}), cached tokens "
              f"{[r[1] for r in results]}", flush=True)
    ratio = statistics.median(r[0] for r in loaded) / statistics.median(r[0] for r in recomputed)
    same = [r[2] for r in loaded] == [r[2] for r in recomputed]
    print(f"host tier / recomputed: {ratio:.3f} (goal <= 0.4); same first tokens: {same}")
    ratio = statistics.median(r[0] for r in restarted) / statistics.median(r[0] for r in recomputed)
    print(f"disk tier after a restart / recomputed: {ratio:.3f} (goal <= 0.4)")


if __name__ == "__main__":
    main()
