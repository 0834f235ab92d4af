"""Engine configuration: a few frozen dataclasses passed down explicitly. Each component
keeps only the fields it uses. Environment variables are read here and nowhere else."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

# a field of EngineConfig, which msgspec decodes in every actor process: imported for real (torch-free)
from actors.multimodal.config import VisionConfig
from actors.pooling.config import PoolerConfig
from actors.spec_decode.config import SpeculativeConfig
from actors.structured_output.limits import DEFAULT_COMPILE_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str, name: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string such as "512MiB", "2GiB", "1.5GB", "1048576"."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"{name} must be bytes or a size like '512MiB', got {value!r}")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face config.json."""

    model_path: str  # a Hugging Face directory (GGUF files are converted to one first)
    architecture: str  # e.g. "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # Hugging Face's rope_scaling dict (Llama-3 "llama3" type), or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    sep_token_id: int | None = None  # an encoder's [SEP] (where a pair's second segment starts)
    vision: VisionConfig | None = None  # a vision-language model's vision side (LLaVA); None: text only

    @property
    def can_generate(self) -> bool:
        """It has a language-model head (a bare ...Model body or a classifier has none)."""
        return self.architecture.endswith("ForCausalLM")

    @property
    def is_encoder(self) -> bool:
        """A BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa): bidirectional attention, whole
        prompts, no KV cache (actors/pooling/encoder.py)."""
        return self.architecture.startswith(("Bert", "Roberta", "XLMRoberta"))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int = 2 * 2**30  # bytes for K and V of all layers (CPU sizing)
    num_kv_blocks: int | None = None  # overrides the size derived from kv_cache_memory
    enable_prefix_caching: bool = True
    # CUDA: size the cache from this share of the GPU's memory (a profiled step decides
    # what the weights and activations leave), instead of kv_cache_memory
    gpu_memory_utilization: float | None = None
    # the host KV tier (actors/scheduler/kv_tiers.py): bytes per rank, 0 for none; and
    # "swap", "recompute" or None (by cost) for a preempted request's KV
    host_kv_bytes: int = 0
    preemption_mode: str | None = None
    kv_offload_dir: str | None = None  # the disk tier below the host tier: a file per prefix block


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running requests at once
    max_num_batched_tokens: int = 2048  # tokens computed in one step
    max_model_len: int = 2048  # prompt + output tokens of one request
    # Build plan N+1 while the worker runs plan N (two plans in flight), so the worker
    # never waits for the scheduler between decode steps.
    async_scheduling: bool = True
    # Split a long prompt over steps; off for encoders, whose tokens attend to the whole prompt
    enable_chunked_prefill: bool = True
    # "fcfs": first come, first served; "priority": by each request's priority (lower first),
    # then arrival, preempting less urgent running requests (actors/scheduler/priority.py)
    scheduling_policy: str = "fcfs"
    # vLLM's: the most image tokens whose vision encoding one step may start (encoder_budget.py); None: no limit
    max_num_encoder_input_tokens: int | None = None


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
    distributed_executor_backend: str = "mp"  # "mp": worker processes; "ray": Ray actors (actors/ray_executor.py)
    data_parallel_size: int = 1  # engine replicas behind one AsyncClient (actors/data_parallel.py); each has the above

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
    """ValueError naming what tp_size does not divide: worker/parallel.py's split needs it
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


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (enable_lora): how many adapters a step may mix and how large."""

    max_loras: int = 1  # adapters resident in a worker's slots at once, so distinct adapters in a step
    max_lora_rank: int = 16  # the largest rank an adapter may have (slots are this wide)
    max_cpu_loras: int = 1  # adapters kept loaded in host memory (least recently used evicted), >= max_loras


# What a request's images and chat template may cost the input processor (InputConfig)
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # one image: 48 MiB decoded as RGB
DEFAULT_MAX_TOTAL_IMAGE_PIXELS = 2 * DEFAULT_MAX_IMAGE_PIXELS  # all of one request's images
DEFAULT_CHAT_TEMPLATE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class InputConfig:
    """What the input processor takes from a request (actors/input_args.py makes it)."""

    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)  # modality -> most items a prompt carries
    allowed_local_media_path: str | None = None  # image file:// URLs only under this directory; None: refused
    allowed_media_domains: tuple[str, ...] | None = None  # http(s) image URLs only from these hosts; None: any
    allow_private_media_addresses: bool = False  # image URLs may reach loopback, link-local and private addresses
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # one image's width x height, read from its header
    max_total_image_pixels: int = DEFAULT_MAX_TOTAL_IMAGE_PIXELS  # the sum over one request's images
    mm_processor_cache_gb: float | None = None  # each input processor's processed-image cache; None: 64 MiB
    chat_template_timeout: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT_S  # seconds a chat template may take to render


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
    otlp_traces_endpoint: str | None = None  # OTLP collector of request spans (actors/tracing.py); None: off
    collect_detailed_traces: str | None = None  # "model" | "worker" | "all": prefill and decode times too
    inputs: InputConfig = field(default_factory=InputConfig)  # what requests' images and templates may cost
    extra: dict = field(default_factory=dict)
    # speculative method draft_model: the draft's config, resolved and checked at start-up (spec_decode/draft_config.py)
    draft_model: ModelConfig | None = None
    gguf_file: str | None = None  # quantization "gguf": the .gguf whose blocks the worker runs (actors/quantization)
    cuda_graph_sizes: tuple[int, ...] = ()  # on CUDA, decode batch sizes replayed from CUDA graphs; (): eager
    cuda_graph_mixed_sizes: tuple[int, ...] = ()  # on CUDA, token counts of mixed steps (prefill chunks too)
    # replayed from CUDA graphs; (): mixed steps run eagerly
    # custom logits processors a request may name ("module:function"; actors/custom_processors.py)
    logits_processors: tuple[str, ...] = ()
    # a request's grammar: the most seconds its compile may take, and the most bytes its
    # constraint may have (actors/structured_output/limits.py)
    grammar_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES


# every node of a --nnodes engine is started with the same TROUPE_ENGINE_KEY: its ZeroMQ tcp
# sockets authenticate with it (messages/engine_auth.py)
ENGINE_KEY_VARIABLE = "TROUPE_ENGINE_KEY"


def engine_key() -> str:
    """The passphrase the nodes of a multi-node engine share; ValueError when unset or short."""
    key = os.environ.get(ENGINE_KEY_VARIABLE, "")
    if len(key) < 16:
        raise ValueError(f"nnodes > 1: set {ENGINE_KEY_VARIABLE} to the same secret of 16 characters or more on "
                         f"every node (e.g. {ENGINE_KEY_VARIABLE}=$(python -c 'import secrets; "
                         "print(secrets.token_hex(32))')); the nodes' sockets authenticate with it")
    return key


def cache_dir() -> str:
    """Where converted models are kept (TROUPE_CACHE, else ~/.cache/troupe)."""
    return os.environ.get("TROUPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "troupe")


def runtime_lora_updating_allowed() -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING ("true" or "1"): the server may load and unload
    LoRA adapters on request (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def image_fetch_timeout() -> float:
    """vLLM's VLLM_IMAGE_FETCH_TIMEOUT: seconds an http(s) image_url may take to download (default 5)."""
    return float(os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", "5"))


def media_redirects_allowed() -> bool:
    """vLLM's VLLM_MEDIA_URL_ALLOW_REDIRECTS: an image URL's redirects are followed ("1", the
    default; each hop checked like the URL itself) or refused ("0")."""
    return os.environ.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1").strip().lower() not in ("0", "false")


# OpenAI's bound on a request's n; vLLM's default for VLLM_MAX_N_SEQUENCES is 16384
DEFAULT_MAX_N_SEQUENCES = 128


def max_n_sequences() -> int:
    """vLLM's VLLM_MAX_N_SEQUENCES: the largest n an HTTP request may ask for (default 128)."""
    value = os.environ.get("VLLM_MAX_N_SEQUENCES", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_MAX_N_SEQUENCES
