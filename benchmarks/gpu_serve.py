"""The serving benchmark against the server on a GPU, with the GPU's idle share: the
server runs Qwen3-0.6B's shapes with dummy weights (benchmarks/gpu_engine.py builds the
directory), benchmarks/serve.py drives it at a fixed concurrency, and the worker profiles a
window of steps in the middle of the run (actors/worker/gpu_idle.py) for the share of the
time no kernel ran.

    python benchmarks/gpu_serve.py                       # 64 in flight, 512 requests
    python benchmarks/gpu_serve.py --max-concurrency 32 --enforce-eager
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
    sys.path[0] = _REPO  # the checkout, not this folder
    sys.path.insert(1, os.path.join(_REPO, "benchmarks"))  # (serve_vs_offline imports serve as a script does)

from actors.worker.gpu_idle import ENV
from actors.worker.host_profile import ENV as HOST_PROFILE_ENV
from benchmarks.gpu_engine import CONFIGS, model_dir
from benchmarks.process_cpu import busy_by_name, cpu_seconds
from benchmarks.serve_vs_offline import Server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(CONFIGS))
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--host-profile", help="the worker's host profile to this file (TROUPE_WORKER_PROFILE)")
    parser.add_argument("--server-flags", default="", help="more flags for the server, space-separated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        path = model_dir(args.model, root)
        idle_path = os.environ[ENV] = os.path.join(root, "idle.json")  # (the server's worker writes it)
        if args.host_profile:
            os.environ[HOST_PROFILE_ENV] = args.host_profile
        server = Server(["--model", path, "--load-format", "dummy", "--device", "cuda", "--max-model-len", "2048",
                         "--gpu-memory-utilization", "0.5"],
                        (["--enforce-eager"] if args.enforce_eager else []) + args.server_flags.split())
        try:
            server.wait_ready()
            root = server.process.pid
            before, clock, children = cpu_seconds(root), time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([sys.executable, os.path.join(_REPO, "benchmarks", "serve.py"), "--url", server.url,
                            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
                            "--output-len", str(args.output_len), "--vocab-size", "30000"], check=True)
            wall, after = time.monotonic() - clock, cpu_seconds(root)
            client = resource.getrusage(resource.RUSAGE_CHILDREN)
            busy = busy_by_name(before, after)
            busy["the benchmark's client"] = (client.ru_utime + client.ru_stime
                                              - children.ru_utime - children.ru_stime)
            print("CPU busy over the load, by process: " + ", ".join(
                f"{name} {seconds / wall:.0%}" for name, seconds in sorted(busy.items(), key=lambda i: -i[1])))
        finally:
            server.stop()
        if os.path.exists(idle_path):
            idle = json.load(open(idle_path))
            print(f"GPU idle share over {idle['steps']} steps in the middle of the run: {idle['idle_share']:.1%} "
                  f"({idle['busy_ms']:.0f} ms of kernels in {idle['span_ms']:.0f} ms, "
                  f"{idle['ms_per_step']:.2f} ms a step)")
        else:
            print("no idle profile: the run had fewer steps than the profile's window")


if __name__ == "__main__":
    main()
