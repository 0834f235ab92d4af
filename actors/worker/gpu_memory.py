"""Sizing the KV cache from a GPU's memory (--gpu-memory-utilization), as vLLM does: the
engine may use that share of the device's total memory; its weights, the peak activations
of its largest step (one prefill chunk of max_num_batched_tokens, with logits for
max_num_seqs rows) and what it allocates outside torch's allocator after start-up (NCCL's
buffers, cuBLAS's workspaces) come off it, and the KV cache gets the rest.

What other processes hold is not charged to the engine (two engines at 0.45 share a GPU),
but they must leave it its share free at start-up: else the start fails, naming the
numbers, rather than the first large step later."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class MemorySnapshot:
    free: int  # bytes free on the device
    total: int
    reserved: int  # what this process's torch allocator holds
    allocated: int  # of which in live tensors (an in-process engine's process may hold others)

    @staticmethod
    def take(device: torch.device) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(device)
        return MemorySnapshot(free, total, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))

    @property
    def outside_torch(self) -> int:
        """Used on the device, but not by this process's torch allocator."""
        return max(0, self.total - self.free - self.reserved)


def check_free_at_start(start: MemorySnapshot, fraction: float) -> None:
    wanted = start.total * fraction
    free = start.free + start.reserved - start.allocated  # (what torch caches unused here is free for it)
    if free < wanted:
        raise ValueError(f"gpu_memory_utilization={fraction} asks for {wanted / GIB:.2f} GiB of the GPU's "
                         f"{start.total / GIB:.2f} GiB, and only {free / GIB:.2f} GiB is free (other processes "
                         "hold the rest): lower gpu_memory_utilization")


@torch.inference_mode()
def profile_num_kv_blocks(runner, fraction: float, start: MemorySnapshot, block_bytes: int) -> int:
    """The KV blocks that fit in fraction of the device after the runner's weights and its
    largest step's activations (runner: a ModelRunner whose KV cache is not allocated)."""
    from actors.worker.cached_request import CachedRequest
    from messages.common import SamplingParams

    device, scheduler = runner.device, runner.engine.scheduler
    num_tokens = min(scheduler.max_num_batched_tokens, scheduler.max_model_len)
    blocks_needed = -(-num_tokens // runner.block_size)
    runner.allocate_kv_cache(blocks_needed)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    request = CachedRequest("profile", [0] * num_tokens, num_tokens, SamplingParams(max_tokens=1),
                            list(range(blocks_needed)), 0)
    input_ids, positions, attention = runner._prepare_inputs([(request, num_tokens)])
    hidden = runner._forward(input_ids, positions, attention)
    if runner.model is not None:  # an encoder has no logits
        rows = torch.arange(min(scheduler.max_num_seqs, num_tokens), device=device)
        runner.model.compute_logits(hidden[rows])
    torch.cuda.synchronize(device)
    # the weights, the profile's KV blocks, the activations; not what the process held before
    peak = torch.cuda.max_memory_allocated(device) - start.allocated
    runner.kv_caches = []
    del hidden
    torch.cuda.empty_cache()
    outside_increase = max(0, MemorySnapshot.take(device).outside_torch - start.outside_torch)
    budget = int(start.total * fraction) - peak - outside_increase
    if budget < block_bytes:
        raise ValueError(f"no GPU memory left for the KV cache: gpu_memory_utilization={fraction} allows "
                         f"{start.total * fraction / GIB:.2f} GiB of {start.total / GIB:.2f} GiB, and the weights and "
                         f"a step's activations take {peak / GIB:.2f} GiB (and {outside_increase / GIB:.2f} GiB "
                         "outside torch's allocator); raise gpu_memory_utilization or lower max_num_batched_tokens")
    return budget // block_bytes
