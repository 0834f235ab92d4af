"""EngineConfig: the whole engine's configuration, one frozen dataclass of the domains'
(model, cache, scheduler, parallel, LoRA, pooler, speculative, inputs), passed down
explicitly; each component keeps only the fields it uses. Torch-free: msgspec decodes it in
every actor process."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.config.cache import CacheConfig
from actors.config.inputs import InputConfig
from actors.config.lora import LoRAConfig
from actors.config.model import ModelConfig
from actors.config.parallel import ParallelConfig
from actors.config.pooler import PoolerConfig
from actors.config.scheduler import SchedulerConfig
from actors.config.speculative import SpeculativeConfig
from actors.config.structured_output import DEFAULT_COMPILE_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: str = "float32"  # or "auto": float32 on the CPU, bfloat16 on CUDA
    device: str = "cpu"  # "cpu", "cuda", or "auto" (CUDA when available)
    seed: int = 0
    tokenizer_path: str = ""  # directory holding the tokenizer files; defaults to model_path
    attention_backend: str = "auto"  # "auto" (Triton on CUDA, torch on CPU) | "triton" | "torch"
    load_format: str = "auto"  # "auto" (the checkpoint) | "dummy" (random weights, benchmarks)
    quantization: str | None = None  # how linear layers run (actors/quantization): None, "int8", "gguf"
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for (vLLM's default)
    structured_outputs_backend: str = "auto"  # "auto" (xgrammar) | "xgrammar" | "guidance"
    reasoning_parser: str | None = None  # "deepseek_r1" | "qwen3": output starts with <think>...</think>
    lora: LoRAConfig | None = None  # None: LoRA adapters off (enable_lora=False)
    pooler: PoolerConfig | None = None  # a pooling model (runner "pooling"): how it pools; None: it generates
    speculative: SpeculativeConfig | None = None  # speculative decoding (--speculative-config); None: off
    otlp_traces_endpoint: str | None = None  # OTLP collector of request spans (actors/tracing/spans.py); None: off
    collect_detailed_traces: str | None = None  # "model" | "worker" | "all": prefill and decode times too
    inputs: InputConfig = field(default_factory=InputConfig)  # what requests' images and templates may cost
    extra: dict = field(default_factory=dict)
    # speculative method draft_model: the draft's config, resolved and checked at start-up (spec_decode/draft_config.py)
    draft_model: ModelConfig | None = None
    gguf_file: str | None = None  # quantization "gguf": the .gguf whose blocks the worker runs (actors/quantization)
    cuda_graph_sizes: tuple[int, ...] = ()  # on CUDA, decode batch sizes replayed from CUDA graphs; (): eager
    cuda_graph_mixed_sizes: tuple[int, ...] = ()  # on CUDA, token counts of mixed steps (prefill chunks too)
    # replayed from CUDA graphs; (): mixed steps run eagerly
    # custom logits processors a request may name ("module:function"; actors/layers/custom_registry.py)
    logits_processors: tuple[str, ...] = ()
    # a request's grammar: the most seconds its compile may take, and the most bytes its
    # constraint may have (actors/config/structured_output.py)
    grammar_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
