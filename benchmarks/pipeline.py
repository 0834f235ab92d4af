"""Pipeline parallelism on the CPU: the offline workload through the actor engine at
--pipeline-parallel-size 2 (two worker processes, one thread each) against one worker on
two threads, in one invocation, with a bubble estimate.

The bubble estimate: each stage's busy share, the time it spent running steps
(StageRunner.execute, less its waits in them for the previous stage's hidden states or the
last stage's tokens) over the generate call's wall time, from step times the stages write
at shutdown (TROUPE_STAGE_TIMES_DIR). 1 - busy share is the stage's idle time.

Both runs go through AsyncClient.generate_batch (the same scheduler, executor and ZeroMQ
path); one worker runs the CPU's one-call C++ step, a stage runs its layers op by op
(model.run_layers), so the comparison includes that difference.

    python benchmarks/pipeline.py                       # embedded SmolLM2-135M, 32 prompts
    python benchmarks/pipeline.py --model DIR --num-prompts 64 --output-len 128
    python benchmarks/pipeline.py --ray     # also PP=2 on Ray actors, and Ray's per-step cost
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

if __name__ == "__main__":
    _here = os.path.dirname(os.path.abspath(__file__))  # as offline_throughput.py: the checkout first
    sys.path = [os.path.dirname(_here)] + [path for path in sys.path
                                           if os.path.abspath(path or os.curdir) != _here]

from benchmarks.offline_throughput import make_workload  # noqa: E402


async def run(args, prompts, pipeline_parallel_size: int, backend: str = "mp") -> dict:
    from actors import AsyncClient, SamplingParams
    from actors.worker.pipeline import STAGE_TIMES_DIR

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as times_dir:
        os.environ[STAGE_TIMES_DIR] = times_dir
        try:
            async with AsyncClient(args.model, pipeline_parallel_size=pipeline_parallel_size,
                                   max_num_batched_tokens=args.max_num_batched_tokens,
                                   kv_cache_memory=args.kv_cache_memory, distributed_executor_backend=backend,
                                   load_format=args.load_format) as client:
                await client.generate_batch(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4),
                                            use_tqdm=False)  # warm-up
                started = time.perf_counter()  # CLOCK_MONOTONIC: the same clock as the stages'
                outputs = await client.generate_batch(prompts, params, use_tqdm=False)
                finished = time.perf_counter()
                seconds = finished - started
                stats = await client.get_stats()
        finally:
            del os.environ[STAGE_TIMES_DIR]
        stages = [json.load(open(os.path.join(times_dir, name))) for name in sorted(os.listdir(times_dir))]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"pp": pipeline_parallel_size, "backend": backend, "seconds": seconds, "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1), "num_preemptions": stats.get("num_preemptions"),
            "stage_busy_share": [round(busy_seconds(stage["steps"], started, finished) / seconds, 3)
                                 for stage in stages]}


def busy_seconds(steps: list[tuple[float, float, float]], started: float, finished: float) -> float:
    """A stage's time in steps within [started, finished], less its waits for the stage before."""
    return sum(end - start - waited for start, end, waited in steps if start >= started and end <= finished)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-input-len", type=int, default=64)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--ray", action="store_true", help="also PP=2 with distributed_executor_backend='ray'")
    args = parser.parse_args()

    from actors.engine.args import EngineArgs

    vocab_size = EngineArgs(args.model).build().model.vocab_size
    prompts = make_workload(args.num_prompts, args.min_input_len, args.max_input_len, vocab_size, seed=0)
    results = [asyncio.run(run(args, prompts, 1)), asyncio.run(run(args, prompts, 2))]
    if args.ray:
        results.append(asyncio.run(run(args, prompts, 2, "ray")))
    for result in results:
        print(json.dumps(result))
    if args.ray:  # the per-step cost of Ray: one stream (a step a token) on one worker, process vs actor,
        # alternated twice, the faster of each kept (a shared machine's load swings)
        stream_args = argparse.Namespace(**{**vars(args), "output_len": 128})
        per_step = {"mp": [], "ray": []}
        for backend in ("mp", "ray", "mp", "ray"):
            result = asyncio.run(run(stream_args, prompts[:1], 1, backend))
            per_step[backend].append(result["seconds"] / result["tokens"])
        mp, ray = min(per_step["mp"]), min(per_step["ray"])
        print(f"one stream, one worker: {mp * 1e3:.2f} ms a step as a process, {ray * 1e3:.2f} ms as a Ray actor "
              f"({ray / mp:.3f}x; all runs: {json.dumps(per_step)})")
    base = results[0]["seconds"]
    for result in results[1:]:
        print(f"PP={result['pp']} ({result['backend']}): {result['seconds']:.2f} s vs PP=1 {base:.2f} s "
              f"({base / result['seconds']:.2f}x); stage busy shares {result['stage_busy_share']} "
              f"(bubble ~{1 - min(result['stage_busy_share']):.0%} on the least busy stage)")


if __name__ == "__main__":
    main()
