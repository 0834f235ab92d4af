"""The sampler's time per step: logits in, tokens out (processors, choice, bookkeeping),
at SmolLM2's vocabulary (49,152) on the CPU unless told otherwise, for a few mixes of
requests that stay in the batch step after step, as in decoding:
- greedy: temperature 0;
- random: temperature 1.0 (the OpenAI default), nothing else;
- top-k/p: temperature 0.8, top-k 50, top-p 0.95 (common chat settings);
- mixed: a quarter each of greedy, random, top-k/p, and seeded top-p 0.9 with
  repetition/presence/frequency penalties, logit bias and min_tokens.
The logits are noise with a few dozen likelier tokens per row, as a language model's
are (its top-p nucleus fits in random_sampling's 1024 candidates); --flat leaves the
noise alone, the worst case, where top-p rows sort whole rows.
Goal on the CPU: at most 10% of a SmolLM2 decode step at batch 64 (~300-400 ms on a
2-core EPYC), so ~30-40 ms. The machine must be otherwise idle: with two torch threads
on a busy 2-core machine, copies and gathers can take 10x longer.

    python benchmarks/sampler.py                                    # batch 64 and 256, CPU
    python benchmarks/sampler.py --batch-sizes 64 --steps 10 --mixes greedy,mixed
    python benchmarks/sampler.py --device cuda
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from actors.layers.sampler import Sampler
from messages.common import SamplingParams

SMOLLM2_VOCAB = 49152
_PENALIZED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, repetition_penalty=1.1, presence_penalty=0.3,
                            frequency_penalty=0.2, logit_bias={13: 2.0, 42: -5.0}, min_tokens=8, max_tokens=64)
MIXES = {
    "greedy": [SamplingParams(temperature=0.0)],
    "random": [SamplingParams(temperature=1.0)],
    "top-k/p": [SamplingParams(temperature=0.8, top_k=50, top_p=0.95)],
    "mixed": [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.8, top_k=50, top_p=0.95), _PENALIZED],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="64,256", help="comma-separated (default: 64,256)")
    parser.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated, of {', '.join(MIXES)}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration (default: 20)")
    parser.add_argument("--vocab", type=int, default=SMOLLM2_VOCAB)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--flat", action="store_true", help="noise logits, no likelier tokens (worst case)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return parser.parse_args(argv)


def make_logits(batch_size: int, vocab: int, flat: bool, generator: torch.Generator,
                device: torch.device) -> torch.Tensor:  # [batch_size, vocab] fp32
    logits = torch.randn(batch_size, vocab, generator=generator, device=device) * 2
    if not flat:  # 48 likelier tokens a row, from +12 down
        likely = torch.randint(vocab, (batch_size, 48), generator=generator, device=device)
        logits.scatter_add_(1, likely, torch.linspace(12.0, 0.5, 48, device=device).expand(batch_size, -1))
    return logits


def time_steps(batch_size: int, mix: list[SamplingParams], steps: int, vocab: int,
               device: torch.device, flat: bool = False) -> list[float]:
    """Milliseconds of each of `steps` sampler steps (after two warm-up steps)."""
    rng = random.Random(0)
    sampler = Sampler((0,), seed=0)
    keys = list(range(batch_size))
    for key in keys:
        sampler.add_request(key, mix[key % len(mix)], [rng.randrange(vocab) for _ in range(128)], [])
    generator = torch.Generator(device).manual_seed(0)
    times = []
    for step in range(steps + 2):
        logits = make_logits(batch_size, vocab, flat, generator, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        sampler.sample(logits, keys)  # returns host token ids: a device sync
        if step >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"sampler step, vocab {args.vocab}, {device}, torch threads {torch.get_num_threads()}, "
          f"{args.steps} steps, {'flat' if args.flat else 'peaked'} logits (ms)")
    print(f"{'batch':>6} {'mix':>8} {'median':>8} {'min':>8} {'max':>8}")
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        for name in args.mixes.split(","):
            times = time_steps(batch_size, MIXES[name], args.steps, args.vocab, device, args.flat)
            print(f"{batch_size:>6} {name:>8} {statistics.median(times):>8.1f} {min(times):>8.1f} {max(times):>8.1f}")


if __name__ == "__main__":
    main()
