"""The engine's cost without the model: host milliseconds per decode step.

The real engine core (scheduler, the model runner's state updates and input preparation,
the sampler and its bookkeeping, the scheduler's update and the detokenizer's output
processing) runs decode steps of B sequences, with the model's forward replaced by a
no-op that returns hidden states and logits of the right shape from preallocated buffers.
The messages the actor engine sends around a step (the StepPlan to the worker, the
StepResult back, the StepOutputs to the detokenizer, the RequestOutputs to the frontend)
are encoded and decoded with the actors' codecs and timed as their own phase.

The model is a tiny random Llama with a byte-level BPE tokenizer of 384 tokens
(tests/conftest.py), so a vocabulary-wide sampling kernel, device work on a GPU, stays
out of the figure; everything per sequence and per token is in it.

    python benchmarks/host_overhead.py                      # batches 1, 64 and 256
    python benchmarks/host_overhead.py --batch-sizes 64 --steps 200 --sampling random
    python benchmarks/host_overhead.py --served             # the server's processes, per token

--served runs the real server (`python -m actors.launch`, every actor its own process) on the
same tiny model, its forward real (it is tiny), and streams `batch` requests at a time at it
(benchmarks/serve.py): the CPU microseconds each process spends per output token, the API's
included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not this folder

import msgspec
import torch

PHASES = ("schedule", "input preparation", "sampling", "output processing", "messages")


class PhaseClock:
    """Accumulates the time spent in wrapped callables, by phase, for the current step."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self._depth = 0

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name, None)
        if inner is None:  # (a checkout without this method: another one holds the phase)
            return

        def timed(*args, **kwargs):
            if self._depth:  # nested inside another timed phase: counted there
                return inner(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.step[phase] += time.perf_counter() - start
                self._depth -= 1

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        step, self.step = dict(self.step), defaultdict(float)
        return step


def stub_model(runner, max_rows: int, max_tokens: int, seed: int = 0) -> None:
    """The model's forward and LM head as no-ops over preallocated buffers: hidden states of
    the step's row count, and logits from one of 16 random buffers in turn (so the sampled
    tokens vary from step to step)."""
    hidden_size = runner.engine.model.hidden_size
    vocab = runner.engine.model.vocab_size
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.zeros(max_tokens, hidden_size, dtype=runner.dtype, device=runner.device)
    logits = [torch.randn(max_rows, vocab, generator=generator).to(runner.device) for _ in range(16)]
    turn = [0]

    def forward(input_ids, positions, attention, lora=None, embeds=None):
        rows = attention.num_tokens if hasattr(attention, "num_tokens") else len(input_ids)
        return hidden[:rows]

    def compute_logits(rows):
        turn[0] = (turn[0] + 1) % len(logits)
        return logits[turn[0]][: rows.shape[0]]

    runner._forward = forward
    runner.model.compute_logits = compute_logits


class Inboxes:
    """The decoders of the actors' inboxes, each built once, as each actor builds its own."""

    def __init__(self) -> None:
        from messages.detokenizer import DetokenizerInbox
        from messages.frontend import FrontendInbox
        from messages.scheduler import SchedulerInbox
        from messages.worker import WorkerInbox

        self.worker = msgspec.msgpack.Decoder(WorkerInbox)
        self.scheduler = msgspec.msgpack.Decoder(SchedulerInbox)
        self.detokenizer = msgspec.msgpack.Decoder(DetokenizerInbox)
        self.frontend = msgspec.msgpack.Decoder(FrontendInbox)


def time_messages(inboxes: Inboxes, plan, result, step_outputs, outputs) -> None:
    """Encodes and decodes what the actor engine sends around one step, as its actors do."""
    from messages.detokenizer import StepOutputs
    from messages.frontend import RequestOutputs
    from messages.transport import encode

    if isinstance(step_outputs, list):  # (checkouts up to 84b5935 give a list of NewTokens: measured the same)
        step_outputs = StepOutputs(step_id=plan.step_id, updates=step_outputs)
    inboxes.worker.decode(encode(plan))
    inboxes.scheduler.decode(encode(result))
    if step_outputs.updates or step_outputs.decode_request_ids:
        inboxes.detokenizer.decode(encode(step_outputs))
    if outputs:
        inboxes.frontend.decode(encode(RequestOutputs(outputs)))


def run(path: str, batch: int, steps: int, sampling: str, prompt_len: int,
        async_scheduling: bool = True) -> dict[str, list[float]]:
    from actors import LLM, SamplingParams
    from messages.worker import StepPlan

    max_tokens = max(2048, batch * prompt_len)
    llm = LLM(path, max_num_seqs=batch, max_num_batched_tokens=max_tokens,
              max_model_len=prompt_len + steps + 64, kv_cache_memory="1GiB", seed=0,
              async_scheduling=async_scheduling)
    engine = llm.engine
    # what the served engine's detokenizer does: a delta a step for every request (the
    # offline engine's own output processor builds each whole output at the end instead)
    engine.outputs.makes_deltas = True
    stub_model(engine.runner, max(batch, 256), max_tokens)
    clock = PhaseClock()
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.runner, "update_states", "input preparation")
    clock.wrap(engine.runner, "_order_batch", "input preparation")
    clock.wrap(engine.runner, "_prepare_inputs", "input preparation")
    clock.wrap(engine.runner, "_logit_rows", "input preparation")
    clock.wrap(engine.runner.sampler, "launch", "sampling")
    clock.wrap(engine.runner.sampler, "finish", "sampling")
    clock.wrap(engine.runner.sampler, "sample", "sampling")  # (checkouts before sampling launched and finished)
    clock.wrap(engine.scheduler, "update", "output processing")
    clock.wrap(engine.outputs, "process", "output processing")
    seen: dict[str, object] = {}
    # a step's result comes from finish() (execute() in checkouts before asynchronous steps)
    finish = "finish" if hasattr(engine.runner, "finish") else "execute"
    for owner, name, key in ((engine.scheduler, "schedule", "schedule"), (engine.runner, finish, "finish"),
                             (engine.scheduler, "update", "update"), (engine.outputs, "process", "process")):
        inner = getattr(owner, name)

        def keep(*args, _inner=inner, _key=key, **kwargs):
            value = _inner(*args, **kwargs)
            seen[_key] = value
            return value

        setattr(owner, name, keep)
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True,
                            **({"temperature": 0.0} if sampling == "greedy" else {"temperature": 1.0, "top_p": 0.9}))
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 300 for j in range(prompt_len)]} for i in range(batch)]
    request_ids = llm._add_requests((None, p["prompt_token_ids"], params, None, None, None) for p in prompts)
    assert len(request_ids) == batch
    figures: dict[str, list[float]] = defaultdict(list)
    inboxes = Inboxes()
    decode_steps = 0
    while engine.has_unfinished() and decode_steps < steps:
        clock.take()
        start = time.perf_counter()
        engine.step()
        total = time.perf_counter() - start
        phases = clock.take()
        plan: StepPlan = seen["schedule"]
        if len(plan.num_scheduled_tokens) != batch or any(n != 1 for n in plan.num_scheduled_tokens.values()):
            continue  # prefill (or a mixed step): not what is measured
        start = time.perf_counter()
        time_messages(inboxes, plan, seen["finish"], seen["update"], seen["process"][0])
        phases["messages"] = time.perf_counter() - start
        decode_steps += 1
        for phase in PHASES:
            figures[phase].append(1e3 * phases.get(phase, 0.0))
        figures["the rest of the step"].append(1e3 * (total - sum(v for k, v in phases.items() if k != "messages")))
        figures["total"].append(1e3 * (total + phases["messages"]))
    for request_id in request_ids:
        engine.abort_request(request_id)
    llm.close()
    return figures


def served(path: str, batch: int, output_len: int) -> dict[str, float]:
    """CPU µs per output token of each of the server's processes, streaming `batch` requests
    at a time (4 * batch requests in all)."""
    import asyncio

    sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # (serve_vs_offline imports serve as a script)
    from benchmarks.process_cpu import busy_by_name, cpu_seconds
    from benchmarks.serve import drive, make_workload
    from benchmarks.serve_vs_offline import Server

    server = Server(["--model", path, "--max-model-len", "1024", "--kv-cache-memory", "1GiB",
                     "--max-num-seqs", str(max(batch, 1))], [])
    try:
        server.wait_ready()
        prompts = make_workload(4 * batch, 16, 64, 380, seed=0)
        before = cpu_seconds(server.process.pid)
        results, _ = asyncio.run(drive(server.url, prompts, output_len, max_concurrency=batch))
        busy = busy_by_name(before, cpu_seconds(server.process.pid))
    finally:
        server.stop()
    tokens = sum(r.num_output_tokens for r in results if r.error is None)
    return {name: 1e6 * seconds / tokens for name, seconds in busy.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--steps", type=int, default=100, help="decode steps measured per batch size")
    parser.add_argument("--sampling", choices=("greedy", "random"), default="greedy")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--served", action="store_true", help="the server's processes instead (see above)")
    parser.add_argument("--output-len", type=int, default=128, help="--served: tokens a request")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="finish each step before the next (default: the next launched first)")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    from tests.conftest import build_tiny_model

    print("the engine's cost without the model: host ms per decode step (medians over "
          f"{args.steps} decode steps; {args.sampling} sampling; no-op forward; "
          f"{'asynchronous' if args.async_scheduling else 'synchronous'} steps)", flush=True)
    if args.served:
        with tempfile.TemporaryDirectory() as root:
            path = build_tiny_model(root, "llama", max_position_embeddings=2048)
            rows = [(int(b), served(path, int(b), args.output_len)) for b in args.batch_sizes.split(",")]
        names = sorted({name for _, figures in rows for name in figures})
        print("the server's processes: CPU µs per output token (the worker's include the tiny model's forward)")
        print("| batch | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        for batch, figures in rows:
            print(f"| {batch} | " + " | ".join(f"{figures.get(name, 0.0):.1f}" for name in names) + " |")
        return
    with tempfile.TemporaryDirectory() as root:
        path = build_tiny_model(root, "llama")
        rows = []
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            figures = run(path, batch, args.steps, args.sampling, args.prompt_len, args.async_scheduling)
            rows.append((batch, {name: statistics.median(values) for name, values in figures.items()}))
    names = [*PHASES, "the rest of the step", "total"]
    print("| batch | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for batch, medians in rows:
        print(f"| {batch} | " + " | ".join(f"{medians.get(name, 0.0):.3f}" for name in names) + " |")


if __name__ == "__main__":
    main()
