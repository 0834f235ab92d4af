"""Engine arguments: what LLM, AsyncClient and the launcher's flags take, checked and
resolved into an EngineConfig. Light to import (no torch): the frontend process needs it."""

from __future__ import annotations

from dataclasses import dataclass

from actors.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, parse_size
from actors.worker.loader import load_model_config, resolve_model
from actors.worker.parallel import check_tensor_parallel_size

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")


@dataclass
class EngineArgs:
    model: str | None = None  # a Hugging Face directory or .gguf file; None: the embedded SmolLM2
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | str = "2GiB"
    num_kv_blocks: int | None = None  # overrides the pool size derived from kv_cache_memory
    gpu_memory_utilization: float | None = None  # CUDA: the KV cache from a share of GPU memory
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    dtype: str = "float32"  # "auto": float32 on the CPU, bfloat16 on CUDA
    device: str = "cpu"  # "auto": CUDA when there is a GPU
    tensor_parallel_size: int = 1
    # several machines (see ParallelConfig): node 0 runs the engine, the others only ranks
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    seed: int = 0
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    load_format: str = "auto"
    async_scheduling: bool = True  # two plans in flight (the actor engine; LLM runs one step at a time)
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for (vLLM's default)

    def build(self) -> EngineConfig:
        """Resolves the model and checks every argument (ValueError naming the field)."""
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got {self.max_logprobs!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        for name, allowed in (("dtype", DTYPES), ("device", DEVICES), ("attention_backend", ATTENTION_BACKENDS),
                              ("load_format", LOAD_FORMATS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        self._check_gpu_memory_utilization()
        model_dir = resolve_model(self.model)
        model_config = load_model_config(model_dir)
        check_tensor_parallel_size(model_config, self.tensor_parallel_size)
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide tensor_parallel_size ({self.tensor_parallel_size})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = model_config.max_position_embeddings
        elif not 1 < max_model_len <= model_config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {model_config.max_position_embeddings}] for this "
                             f"model, got {max_model_len}")
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=parse_size(self.kv_cache_memory),
                              num_kv_blocks=self.num_kv_blocks, enable_prefix_caching=self.enable_prefix_caching,
                              gpu_memory_utilization=self.gpu_memory_utilization),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_model_len=max_model_len, async_scheduling=self.async_scheduling),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size, nnodes=self.nnodes,
                                    node_rank=self.node_rank, master_addr=self.master_addr,
                                    master_port=self.master_port),
            dtype=self.dtype, device=self.device, seed=self.seed, tokenizer_path=model_dir,
            attention_backend=self.attention_backend, load_format=self.load_format, max_logprobs=self.max_logprobs)

    def _check_gpu_memory_utilization(self) -> None:
        fraction = self.gpu_memory_utilization
        if fraction is None:
            return
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {fraction!r}")
        on_cuda = self.device == "cuda"
        if self.device == "auto":
            import torch  # only here: the frontend otherwise never imports torch

            on_cuda = torch.cuda.is_available()
        if not on_cuda:
            raise ValueError("gpu_memory_utilization sizes the KV cache from GPU memory, and the engine runs on "
                             "the CPU: size it with kv_cache_memory (--kv-cache-memory) instead")
