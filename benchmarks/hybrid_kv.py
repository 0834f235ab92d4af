"""Sliding-window layers at long context (issue 39), on the CPU: a scaled-down Gemma-3-like
model with random fp32 weights (hidden 512, 12 layers: 10 sliding with a 512-token window
and 2 full, in Gemma 3's 5:1 pattern; 8 heads of 64, 4 KV heads; intermediate 1024).

1. Single-stream decode: one decode step at 1k and at 8k cached tokens, through the model
   runner (its per-group block tables), median of --repeats, paired; the sliding layers
   read their window only, so only the two full layers grow with the context. And the
   one-call C++ step (the default) against the same layer op by op, at 1k.
2. Capacity: the most 8k-token sequences (7,680-token prompts growing to 8,192) decoding
   at once in a --kv-budget (2 GiB) pool,
   with a block table per layer group (sliding groups freeing what their window left) and
   with every layer full (--disable-hybrid-kv-cache-manager's layout), from the scheduler
   itself (no model: a worker that only follows the plans).

    python benchmarks/hybrid_kv.py
    python benchmarks/hybrid_kv.py --repeats 40 --kv-budget 4GiB --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

if __name__ == "__main__":
    # run as a script, this folder would come first on sys.path (benchmarks/kernels.py would
    # shadow the kernels package); the checkout's root instead
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import torch

from benchmarks.moe_offline import paired_step_ms, save_model

WINDOW = 512
CONFIG = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, sliding_window=WINDOW, max_position_embeddings=8448,
              rope_local_base_freq=10000.0, rope_theta=1000000.0, query_pre_attn_scalar=64, tie_word_embeddings=True)


def decode_step(llm, context: int):
    """One decode step of one sequence with `context` cached tokens: a callable. Each group
    gets its own blocks (the ids concatenated, as the scheduler sends them)."""
    from actors import SamplingParams
    from actors.worker.model_runner import CachedRequest
    runner = llm.engine.runner
    blocks = -(-(context + 1) // runner.block_size)
    groups = runner.kv_layout.num_groups
    block_ids = list(range(1, 1 + blocks * groups))
    request = CachedRequest("r", [5] * (context + 1), context + 1, SamplingParams(max_tokens=1), block_ids, context)
    input_ids, positions, attention = runner._prepare_inputs([(request, 1)])

    def step() -> None:
        with torch.inference_mode():
            runner._forward(input_ids, positions, attention)
    return step


def peak_decoding(engine_config, num_blocks: int, hybrid: bool, context: int, requests: int,
                  output_len: int = 512) -> int:
    """The most sequences decoding at once, each a prompt of context - output_len tokens
    growing to `context` (decodes long enough that memory, not the prefill rate, bounds
    them), from the scheduler."""
    from actors.config import SchedulerConfig
    from actors.config.kv_groups import kv_cache_layout
    from actors.scheduler.priority import make_scheduler
    from messages.common import SamplingParams
    from tests.scheduler.test_hybrid_kv_cache import GroupedFakeWorker

    model = engine_config.model
    layout = kv_cache_layout(model.sliding_windows, model.num_hidden_layers, hybrid)
    block_size = engine_config.cache.block_size
    scheduler = make_scheduler(SchedulerConfig(max_num_seqs=requests, max_num_batched_tokens=2048,
                                               max_model_len=context),
                               engine_config.cache, num_blocks=num_blocks, eos_token_ids=(2,), kv_layout=layout)
    worker = GroupedFakeWorker(layout, block_size, num_blocks)
    worker.step = _no_checks(worker)
    prompt_len = context - output_len
    for index in range(requests):
        scheduler.add_request(f"r{index}", [3 + index % 100] + [4] * (prompt_len - 1),
                              SamplingParams(max_tokens=output_len, ignore_eos=True))
    peak = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        peak = max(peak, sum(seq.num_computed_tokens >= prompt_len for seq in scheduler.running))
        scheduler.update(plan, worker.step(plan))
    return peak


def _no_checks(worker):
    """The fake worker's sampling without its KV bookkeeping (8k-token sequences by the dozen)."""
    from messages.scheduler import StepResult
    computed: dict[str, list[int]] = {}

    def step(plan):
        for new in plan.new_requests:
            computed[new.request_id] = [new.num_computed_tokens, len(new.token_ids)]
        ids, tokens = [], []
        for seq_id, num_new in plan.num_scheduled_tokens.items():
            state = computed[seq_id]
            state[0] += num_new
            if state[0] == state[1]:
                state[1] += 1
                ids.append(seq_id)
                tokens.append(7)
        return StepResult(plan.step_id, ids, tokens)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--kv-budget", default="2GiB")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    args = parser.parse_args()
    from actors import LLM
    from actors.config import parse_size
    from actors.worker.device_config import kv_block_bytes
    torch.set_num_threads(args.threads)
    short, long = (int(c) for c in args.contexts.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(tmp, "gemma3_text", **CONFIG)
        print(f"model: Gemma-3-like, {CONFIG}")
        for hybrid in (True, False):
            llm = LLM(model_dir, kv_cache_memory="1GiB", max_model_len=long + 64,
                      disable_hybrid_kv_cache_manager=not hybrid)
            long_ms, short_ms, ratio = paired_step_ms(decode_step(llm, long), decode_step(llm, short), args.repeats)
            label = "layer groups" if hybrid else "every layer full"
            if hybrid:  # the one-call C++ step (the default) against the layer op by op
                backend, step = llm.engine.runner.backend, decode_step(llm, short)

                def with_fused(on: bool):
                    def run() -> None:
                        backend.fused_steps = on
                        step()
                    return run
                fused_ms, op_ms, fused_ratio = paired_step_ms(with_fused(True), with_fused(False), args.repeats)
                backend.fused_steps = True
                print(f"decode step at {short} tokens: one C++ call {fused_ms:.2f} ms, op by op {op_ms:.2f} ms, "
                      f"{fused_ratio:.2f}x (median of {args.repeats} pairs)")
            print(f"decode step, {label}: {short} tokens {short_ms:.2f} ms, {long} tokens {long_ms:.2f} ms, "
                  f"{long}/{short} = {ratio:.2f}x (median of {args.repeats} pairs)")
            budget = parse_size(args.kv_budget)
            config = llm.engine.runner.engine  # (resolved: its dtype and device)
            num_blocks = budget // kv_block_bytes(config)
            peak = peak_decoding(config, num_blocks, hybrid, long, requests=128)
            print(f"capacity, {label}: {num_blocks} blocks of {kv_block_bytes(config)} bytes in "
                  f"{args.kv_budget}: {peak} sequences of {long} tokens decoding at once")
            del llm


if __name__ == "__main__":
    main()
