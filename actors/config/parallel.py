"""How an engine is spread over devices and machines (ParallelConfig), and the tensor-parallel
size checked against the model. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from actors.config.model import ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # worker processes, one per device, each with a slice of the model
    # torch.distributed rendezvous of the workers, e.g. "tcp://127.0.0.1:29500"; chosen by
    # the launcher (a free port) when None
    distributed_init_method: str | None = None
    # Several machines: node 0 runs every actor and the first ranks; node i > 0 runs ranks
    # [i * size / nnodes, (i + 1) * size / nnodes) only. They meet at master_addr: the
    # workers' rendezvous at master_port, ZeroMQ (tcp) on the ports just above it.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # pipeline parallelism (actors/worker/pipeline.py): stages of contiguous layers, each with
    # tensor_parallel_size ranks; rank = stage * tensor_parallel_size + tensor-parallel rank
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # "mp": worker processes; "ray": Ray actors (actors/engine/ray_executor.py)
    enable_expert_parallel: bool = False  # MoE: whole experts per tensor-parallel rank (actors/layers/tensor_parallel.py)
    data_parallel_size: int = 1  # engine replicas behind one AsyncClient (actors/frontend/data_parallel.py); each has the above

    @property
    def world_size(self) -> int:
        """Worker ranks of one engine: every stage's tensor-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)


def check_tensor_parallel_size(model: ModelConfig, tp_size: int) -> None:
    """ValueError naming what tp_size does not divide: actors/layers/tensor_parallel.py's split needs it
    to divide the heads and the intermediate size. Here, torch-free, because the frontend
    checks it before any worker starts."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    if heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {heads} attention heads")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(f"tensor_parallel_size {tp_size} and the model's {kv_heads} KV heads must divide one "
                         "another")
    if model.intermediate_size % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's intermediate size "
                         f"{model.intermediate_size}")
