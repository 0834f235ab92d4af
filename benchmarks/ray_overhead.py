"""Ray's per-step cost: one stream (a step a token) on the same engine with its workers as
processes (--distributed-executor-backend mp) and as Ray actors (ray), the two alternated
--rounds times in one invocation; per backend the fastest and the median seconds a step
(a shared machine's load swings: compare the minima). Ray should add nothing per step:
plans and results travel over ZeroMQ as with processes (actors/engine/ray_executor.py).

    python benchmarks/ray_overhead.py                         # SmolLM2-135M, one worker, 3 rounds
    python benchmarks/ray_overhead.py --tensor-parallel-size 2 --rounds 5 --output-len 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

if __name__ == "__main__":
    _here = os.path.dirname(os.path.abspath(__file__))  # as offline_throughput.py: the checkout first
    sys.path = [os.path.dirname(_here)] + [path for path in sys.path
                                           if os.path.abspath(path or os.curdir) != _here]

from benchmarks.offline_throughput import make_workload  # noqa: E402


def ray_cpu_seconds(actor_pids: set[int]) -> float:
    """CPU seconds used so far by Ray's own processes on this machine (raylet, GCS, agents,
    idle workers) and by the Ray threads inside the worker actors (those named otherwise
    than the actor's main thread, whose OpenMP threads share its name)."""
    ticks = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            if int(pid) in actor_pids:
                main = _comm(f"/proc/{pid}/stat")
                for tid in os.listdir(f"/proc/{pid}/task"):
                    stat = f"/proc/{pid}/task/{tid}/stat"
                    if _comm(stat) != main:
                        ticks += _ticks(stat)
            elif b"/ray/" in cmdline or cmdline.startswith(b"ray::"):
                ticks += _ticks(f"/proc/{pid}/stat")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return ticks / os.sysconf("SC_CLK_TCK")


def _comm(stat_path: str) -> str:
    stat = open(stat_path).read()
    return stat[stat.index("(") + 1:stat.rindex(")")]


def _ticks(stat_path: str) -> int:
    fields = open(stat_path).read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def worker_cpu_seconds(worker_pids: set[int]) -> float:
    """CPU seconds the worker processes (or actors) used so far, all their threads."""
    return sum(_ticks(f"/proc/{pid}/stat") for pid in worker_pids) / os.sysconf("SC_CLK_TCK")


async def seconds_a_step(args, prompt: list[int], backend: str) -> tuple[float, float, float]:
    """Seconds a step, the workers' CPU seconds a step, and Ray's CPU seconds a step (0
    with processes). CPU time is steadier than wall time on a loaded machine."""
    from actors import AsyncClient, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    async with AsyncClient(args.model, tensor_parallel_size=args.tensor_parallel_size,
                           kv_cache_memory=args.kv_cache_memory, distributed_executor_backend=backend) as client:
        await client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
        workers = {pid for name, pid in client.actor_pids().items() if name.startswith("worker")}
        ray_cpu = ray_cpu_seconds(workers) if backend == "ray" else 0.0
        worker_cpu = worker_cpu_seconds(workers)
        started = time.perf_counter()
        output = await client.generate(prompt, params)
        seconds = time.perf_counter() - started
        worker_cpu = worker_cpu_seconds(workers) - worker_cpu
        ray_cpu = ray_cpu_seconds(workers) - ray_cpu if backend == "ray" else 0.0
    steps = len(output.outputs[0].token_ids)
    return seconds / steps, worker_cpu / steps, ray_cpu / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    args = parser.parse_args()

    from actors.engine.args import EngineArgs

    vocab_size = EngineArgs(args.model).build().model.vocab_size
    prompt = make_workload(1, args.input_len, args.input_len, vocab_size, seed=0)[0]
    per_step: dict[str, list[float]] = {"mp": [], "ray": []}
    worker_cpu: dict[str, list[float]] = {"mp": [], "ray": []}
    ray_cpu: list[float] = []
    for _ in range(args.rounds):
        for backend in ("mp", "ray"):
            step, cpu, ray_own = asyncio.run(seconds_a_step(args, prompt, backend))
            per_step[backend].append(step)
            worker_cpu[backend].append(cpu)
            if backend == "ray":
                ray_cpu.append(ray_own)
    mp, ray = min(per_step["mp"]), min(per_step["ray"])
    print(json.dumps({backend: [round(s * 1e3, 3) for s in steps] for backend, steps in per_step.items()}))
    print("the workers' CPU a step (ms, medians): " + ", ".join(
        f"{backend} {statistics.median(cpu) * 1e3:.2f}" for backend, cpu in worker_cpu.items())
        + f"; Ray's own processes and threads: {statistics.median(ray_cpu) * 1e3:.3f} ms of CPU a step")
    print(f"TP={args.tensor_parallel_size}, one stream: {mp * 1e3:.2f} ms a step with processes, {ray * 1e3:.2f} ms "
          f"with Ray actors: {ray / mp:.3f}x (fastest of {args.rounds}); medians "
          f"{statistics.median(per_step['ray']) / statistics.median(per_step['mp']):.3f}x")


if __name__ == "__main__":
    main()
