"""The host KV tier's memory on a worker: a block pool in host memory with the device
pool's per-layer layout, and the copies a StepPlan orders between the two.

The scheduler owns the block ids of both tiers (actors/scheduler/kv_tiers.py, which also
argues why running the copies at the start of the step, swap-outs first, is safe); this
only moves bytes. On CUDA the host blocks are pinned and the copies run on a side stream
that the step's compute stream then waits for; on the CPU the two pools are plain tensors
and the copies index_copy_, so the same bookkeeping is tested without a GPU. With --kv-offload-dir, prefix blocks also
go to files (actors/worker/disk_kv.py) and come back into host blocks."""

from __future__ import annotations

import torch

from actors.config import EngineConfig
from actors.worker.device_config import kv_block_bytes
from actors.worker.disk_kv import DiskKV, fingerprint
from actors.layers.tensor_parallel import TensorParallel
from messages.worker import StepPlan

# Rough speeds for the swap-or-recompute rule: recomputing a token costs 2 FLOPs per
# weight, swapping it copies its KV out and back in.
_FLOPS = {"cpu": 1e11, "cuda": 2e14}  # FLOP/s a step reaches
_COPY_BYTES_PER_S = {"cpu": 1e10, "cuda": 2.5e10}  # host memory, or PCIe from pinned memory


def swap_is_cheaper(engine: EngineConfig, weight_bytes: int, device: torch.device,
                    parallel: TensorParallel = TensorParallel()) -> bool:
    """Whether swapping a preempted request's KV out and back costs less than recomputing
    it: both grow with its tokens, so the answer depends on the model and device only."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    element = torch.empty((), dtype=getattr(torch, engine.dtype)).element_size()
    recompute_s = 2 * weight_bytes / element / _FLOPS[kind]
    copy_s = 2 * kv_block_bytes(engine, parallel) / engine.cache.block_size / _COPY_BYTES_PER_S[kind]
    return copy_s < recompute_s


def host_tier_info(runner) -> dict:
    """The host KV tier's block count, swap-or-recompute rule and the disk tier's blocks, for
    the scheduler."""
    if runner.host_kv is None:
        return {"num_host_kv_blocks": 0, "swap_is_cheaper": False}
    disk = runner.host_kv.disk
    return {"num_host_kv_blocks": runner.host_kv.num_blocks,
            "swap_is_cheaper": swap_is_cheaper(runner.engine, runner.num_weight_bytes(), runner.device, runner.parallel),
            "disk_block_hashes": disk.scan() if disk is not None else None}


class HostKVCache:
    """Host blocks beside a runner's KV cache; apply() runs a plan's copy orders."""

    def __init__(self, runner, num_blocks: int) -> None:  # runner: model_runner.ModelRunner
        self.runner = runner
        self.num_blocks = num_blocks
        model = runner.model
        shape = (num_blocks, model.num_kv_heads, runner.block_size, runner.engine.model.head_dim)
        pinned = runner.device.type == "cuda"
        self.caches = [tuple(torch.zeros(shape, dtype=runner.dtype, pin_memory=pinned) for _ in range(2))
                       for _ in range(runner.engine.model.num_hidden_layers)]
        self.stream = torch.cuda.Stream(runner.device) if pinned else None
        self.disk: DiskKV | None = None  # the disk tier below, with --kv-offload-dir
        if runner.engine.cache.kv_offload_dir is not None:
            self.disk = DiskKV(runner.engine.cache.kv_offload_dir, fingerprint(runner.engine, model.num_kv_heads),
                               (2 * len(self.caches), *shape[1:]), runner.dtype, len(self.caches))

    @classmethod
    def build(cls, runner, parallel: TensorParallel) -> HostKVCache | None:
        """The runner's host tier, sized by engine.cache.host_kv_bytes (None: no tier, or
        an encoder, which keeps no KV)."""
        engine = runner.engine
        if not engine.cache.host_kv_bytes or runner.model is None:
            return None
        num_blocks = engine.cache.host_kv_bytes // kv_block_bytes(engine, parallel)
        if num_blocks < 1:
            raise ValueError(f"the host KV tier ({engine.cache.host_kv_bytes} bytes) holds no KV block of "
                             f"{kv_block_bytes(engine, parallel)} bytes: raise swap_space or kv_offload_size")
        return cls(runner, num_blocks)

    def run(self, plan: StepPlan) -> list[int]:
        """A plan's orders, before its forward: swap-outs, disk saves, disk loads, swap-ins.
        The host blocks whose disk load failed (left unused: the scheduler recomputes)."""
        self.apply(plan.blocks_to_swap_out, [])
        if plan.blocks_to_save:
            self._save(plan.blocks_to_save)
        failed = self._load(plan.blocks_to_load) if plan.blocks_to_load else []
        self.apply([], plan.blocks_to_swap_in)
        return failed

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def _save(self, orders: list[tuple[int, bytes]]) -> None:
        """Copies each block to host memory now (it may be reused after this step), to disk later."""
        for device_block, block_hash in orders:
            block = torch.stack([cache[device_block] for layer in self.runner.kv_caches for cache in layer]).cpu()
            self.disk.save(block_hash, block)

    def _load(self, orders: list[tuple[bytes, int]]) -> list[int]:
        failed = []
        for block_hash, host_block in orders:
            block = self.disk.load(block_hash) if self.disk is not None else None
            if block is None:
                failed.append(host_block)
                continue
            for index, (keys, values) in enumerate(self.caches):
                keys[host_block].copy_(block[2 * index])
                values[host_block].copy_(block[2 * index + 1])
        return failed

    def apply(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copies device -> host blocks, then host -> device blocks, before the step's forward."""
        if not swap_out and not swap_in:
            return
        if self.stream is None:
            self._copy(swap_out, swap_in)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.runner.device))  # earlier steps' writes
        with torch.cuda.stream(self.stream):
            self._copy(swap_out, swap_in)
        torch.cuda.current_stream(self.runner.device).wait_stream(self.stream)  # the forward after them

    def _copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        device = self.runner.device
        if swap_out:
            src = torch.tensor([pair[0] for pair in swap_out], dtype=torch.long, device=device)
            dst = torch.tensor([pair[1] for pair in swap_out], dtype=torch.long)
            for device_layer, host_layer in zip(self.runner.kv_caches, self.caches):
                for device_cache, host_cache in zip(device_layer, host_layer):
                    host_cache.index_copy_(0, dst, device_cache.index_select(0, src).to("cpu"))
        if swap_in:
            src = torch.tensor([pair[0] for pair in swap_in], dtype=torch.long)
            dst = torch.tensor([pair[1] for pair in swap_in], dtype=torch.long, device=device)
            for device_layer, host_layer in zip(self.runner.kv_caches, self.caches):
                for device_cache, host_cache in zip(device_layer, host_layer):
                    rows = host_cache.index_select(0, src)
                    if device.type == "cuda":
                        rows = rows.pin_memory().to(device, non_blocking=True)
                    device_cache.index_copy_(0, dst, rows)
