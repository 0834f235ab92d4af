"""Engine arguments, written once. EngineArgs's fields are the keyword arguments of LLM and
AsyncClient and the engine flags of the launcher: add_cli_args() generates each flag from
its field's metadata (help, metavar, choices, parser, hidden spellings), so a name, a type
and a default are spelled here and nowhere else.

One default per field. Two fields default to None because the server and the Python API
want different values, and what None means is decided in _resolve_unset(), and only there:
- device: the Python API (LLM, AsyncClient) runs on the CPU unless told otherwise; the
  server takes a GPU when there is one ("auto");
- max_num_batched_tokens: 2048 tokens a step in the Python API (offline throughput); the
  server 512 on the CPU, 2048 on CUDA (SERVER_BATCHED_TOKENS).

Light to import: no torch (the API server process never loads it) and no transformers."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from actors.config.cli_flags import CLI_GROUPS, add_flag, check_int, parse_size_flag
from actors.config.cli_flags import cli_arg as _arg  # short: every field below is one
from actors.config import (CacheConfig, EngineConfig, LoRAConfig, ParallelConfig, SchedulerConfig,
                           check_tensor_parallel_size, parse_size)
from actors.config.cuda_flags import (DEFAULT_GPU_MEMORY_UTILIZATION, check_gpu_memory_utilization, cuda_graph_sizes,
                               on_cuda, parse_capture_sizes_flag)
from actors.layers.custom_registry import allow_list
from actors.config.kv_groups import hybrid_kv_cache
from actors.config.kv_offload_flags import check_kv_offload_dir, host_kv_bytes
from actors.config.parallel_flags import EXECUTOR_BACKENDS, check_distributed, check_distributed_flags
from actors.config.parallel_flags import ROUTING_LOGICS
from actors.pooling.engine import (CONVERTS, RUNNERS, TASKS, check_pooling_args, override_architecture,
                                  parse_hf_overrides, pooler_for)
from actors.quantization import QUANTIZATION_METHODS
from actors.quantization.resolve import resolve_quantization
from actors.config.input_flags import InputArgs
from actors.config.vision import check_vision_engine
from actors.config.moe import check_moe_engine
from actors.config.speculative import check_engine_fit, parse_speculative_config
from actors.spec_decode.draft_config import load_draft_model_config
from actors.config.structured_output import DEFAULT_COMPILE_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES
from actors.tracing.spans import DETAILED_TRACES, check_tracing_available
from actors.models.loader import load_model_config, resolve_model
from actors.models.transformers_config import MODEL_IMPLS, check_fallback_engine

from actors.config.engine_choices import (ATTENTION_BACKENDS, DEVICES, DTYPES, LOAD_FORMATS, LORA_RANKS,
                                          MAY_BE_NONE as _MAY_BE_NONE, PREEMPTION_MODES, PYTHON_BATCHED_TOKENS,
                                          PYTHON_DEVICE, REASONING_PARSERS, SCHEDULING_POLICIES,
                                          SERVER_BATCHED_TOKENS, SERVER_DEVICE, STRUCTURED_OUTPUTS_BACKENDS)

@dataclass
class EngineArgs(InputArgs):
    """What an engine is started with; build() checks it and makes the EngineConfig. The
    input processor's fields (images, chat templates) come from InputArgs."""

    model: str | None = _arg(
        None, "a local Hugging Face model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
        group="model", metavar="PATH")
    dtype: str = _arg("auto", "weights and activations; 'auto': float32 on the CPU, bfloat16 on CUDA",
                      group="model", choices=DTYPES)
    max_model_len: int | None = _arg(None, "the longest prompt plus output (default: the model's own limit)",
                                     group="model", metavar="TOKENS", parse=int)
    load_format: str = _arg("auto", "'dummy' runs random weights, for benchmarks", group="model",
                            choices=LOAD_FORMATS)
    quantization: str | None = _arg(
        None, "'gguf': a .gguf model's Q4_0/Q4_1/Q8_0 weights run as they are on the CPU (docs/quantization.md); "
              "'auto': gguf where it can run, else none; 'int8': weights quantized to int8 at load time, "
              "activations per token as they come (W8A8; encoders, decoders); 'fp8': a float checkpoint's weights "
              "quantized at load on CUDA 8.9+; 'gptq', 'awq', 'compressed-tensors', 'fp8': a quantized checkpoint's "
              "quantization_config, which unset follows; 'none': the checkpoint's dtype (a .gguf dequantized); unset: "
              "'auto' on a .gguf model (the embedded default's), else its quantization_config or none",
        group="model",
        choices=("none",) + QUANTIZATION_METHODS)
    model_impl: str = _arg("auto", "which code runs the model: 'troupe' its own, 'transformers' Hugging Face's "
                                   "modeling code over troupe's paged KV cache (any causal LM transformers "
                                   "implements), 'auto' troupe's where it has one", group="model", choices=MODEL_IMPLS)
    seed: int = _arg(0, "the engine's random seed", group="model")
    max_logprobs: int = _arg(20, "the most logprobs / prompt_logprobs a request may ask for", group="model",
                             metavar="N")  # vLLM's default

    max_num_seqs: int = _arg(256, "requests running at once", metavar="N")
    max_num_batched_tokens: int | None = _arg(
        None, "tokens computed in one step (default: the server %d on the CPU and %d on CUDA, LLM and AsyncClient "
              "%d; a step's time grows with its tokens, and every running request waits for it)"
              % (SERVER_BATCHED_TOKENS["cpu"], SERVER_BATCHED_TOKENS["cuda"], PYTHON_BATCHED_TOKENS),
        metavar="TOKENS", parse=int)
    block_size: int = _arg(16, "tokens per KV-cache block", metavar="TOKENS")
    kv_cache_memory: int | str | None = _arg(
        None, "memory for the KV cache, e.g. 512MiB or 4GiB (default: 2GiB on the CPU; on CUDA "
              "--gpu-memory-utilization %s instead)" % DEFAULT_GPU_MEMORY_UTILIZATION, metavar="SIZE",
        parse=parse_size_flag)
    num_kv_blocks: int | None = _arg(None, "KV-cache blocks; overrides the pool size derived from --kv-cache-memory",
                                     metavar="N", parse=int)
    gpu_memory_utilization: float | None = _arg(
        None, "on CUDA, size the KV cache from this share of the GPU's memory (e.g. 0.9): what the weights and a "
              "profiled step leave of it; replaces --kv-cache-memory", metavar="FRACTION", parse=float)
    swap_space: float = _arg(0, "GiB of host memory per device for a second KV tier (swapped and evicted blocks; "
                                "0: none)", metavar="GIB", parse=float)
    kv_offload_size: int | str | None = _arg(None, "the host KV tier's size as bytes or e.g. 4GiB (instead of "
                                             "--swap-space)", metavar="SIZE", parse=parse_size_flag)
    preemption_mode: str | None = _arg(None, "a preempted request's KV: 'swap' to the host tier, 'recompute' "
                                       "(default: swap when cheaper and the host tier has room)",
                                       choices=PREEMPTION_MODES)
    kv_offload_dir: str | None = _arg(None, "a directory for a third KV tier: prefix blocks as files, found "
                                      "again by a restarted engine (needs the host tier)", metavar="DIR")
    enable_prefix_caching: bool = _arg(True, "reuse the KV cache of shared prompt prefixes",
                                       hidden_negations=("--no-prefix-caching",))  # troupe's first spelling
    disable_hybrid_kv_cache_manager: bool = _arg(
        False, "keep every layer's KV for every token, also on models with sliding-window layers (default: a "
               "block table per group of layers, the windows' out-of-view blocks freed)")
    attention_backend: str = _arg(
        "auto", "'auto': Triton kernels on CUDA, the C++ kernels ('cpu') on the CPU; 'torch': the plain torch "
                "references", choices=ATTENTION_BACKENDS)
    device: str | None = _arg(
        None, "'auto': CUDA when there is a GPU, else the CPU (default: the server %s, LLM and AsyncClient %s)"
              % (SERVER_DEVICE, PYTHON_DEVICE), choices=DEVICES)
    tensor_parallel_size: int = _arg(1, "worker processes, one per device, each holding a slice of the model",
                                     metavar="N")
    pipeline_parallel_size: int = _arg(1, "pipeline stages, each a contiguous range of layers on its own "
                                          "tensor_parallel_size workers (docs/distributed.md)", metavar="N")
    enable_expert_parallel: bool = _arg(False, "a mixture-of-experts model's whole experts spread over the "
                                               "tensor-parallel ranks, instead of a slice of every expert on each")
    data_parallel_size: int = _arg(1, "engine replicas behind one frontend, each with its own scheduler and workers",
                                   metavar="N")
    distributed_executor_backend: str = _arg("mp", "'mp': a process per worker; 'ray': Ray actors in a placement "
                                                   "group (needs troupe[ray])", choices=EXECUTOR_BACKENDS)
    routing_logic: str = _arg("leastloaded", "how data-parallel replicas share requests: the least loaded, or "
                                             "'prefixaware': where the prompt's prefix went before",
                              choices=ROUTING_LOGICS)
    enforce_eager: bool = _arg(False, "on CUDA, run every step eagerly: no CUDA graphs")
    cuda_graph_sizes: str | list | None = _arg(
        None, "on CUDA, the decode batch sizes replayed from CUDA graphs, e.g. 1,2,4,8 (default: 1, 2, 4 and every "
              "multiple of 8 up to max_num_seqs, at most 512)", metavar="N,N,...", parse=parse_capture_sizes_flag)
    compilation_config: str | dict | None = _arg(None, "vLLM's JSON: cudagraph_mode (FULL_AND_PIECEWISE, FULL: mixed "
                                                 "steps too; FULL_DECODE_ONLY; NONE), max_cudagraph_capture_size")
    async_scheduling: bool = _arg(True, "plan and launch each step while the one before it runs")
    scheduling_policy: str = _arg(
        "fcfs", "'fcfs': first come, first served; 'priority': by each request's priority (lower first), then "
                "arrival, preempting less urgent requests", choices=SCHEDULING_POLICIES)
    structured_outputs_backend: str = _arg(
        "auto", "the grammar library of structured outputs; 'auto': xgrammar", choices=STRUCTURED_OUTPUTS_BACKENDS)
    grammar_compile_timeout: float = _arg(
        DEFAULT_COMPILE_TIMEOUT_S, "seconds a request's grammar may take to compile (on the worker, before the "
                                   "request is scheduled); past it the request is refused (400)", metavar="SECONDS")
    max_grammar_bytes: int = _arg(DEFAULT_MAX_GRAMMAR_BYTES, "the largest JSON schema, regex, grammar or choice list "
                                                             "a request may carry, in bytes (400 past it)", metavar="N")
    speculative_config: str | dict | None = _arg(
        None, "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 5}' "
              "(method ngram or suffix; prompt_lookup_min/max, suffix_decoding_*, disable_by_batch_size)",
        metavar="JSON")
    max_num_encoder_input_tokens: int | None = _arg(
        None, "a vision model: the most image tokens whose encoding one step may start (default: no limit)",
        metavar="TOKENS", parse=int)
    logits_processors: list | None = _arg(None, "custom logits processors a request may name (package.module:function, "
                                                "or a class: one per request); workers import these, no others",
                                          metavar="NAME", nargs="+")
    reasoning_parser: str | None = _arg(
        None, "the model thinks between <think> and </think> first: the API splits that into reasoning_content, "
              "and a request's structured output constrains only what follows", choices=REASONING_PARSERS)

    otlp_traces_endpoint: str | None = _arg(
        None, "export a span per request to this OpenTelemetry collector (OTLP over gRPC, or HTTP/protobuf by "
              "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL); needs troupe[tracing]", metavar="URL")
    collect_detailed_traces: str | None = _arg(
        None, "with --otlp-traces-endpoint: each span also gets the request's prefill and decode times",
        choices=DETAILED_TRACES)

    enable_lora: bool = _arg(False, "serve LoRA adapters", group="lora")
    max_loras: int = _arg(1, "adapters a step may mix (each worker holds this many in its slots)", group="lora",
                          metavar="N")
    max_lora_rank: int = _arg(16, "the largest adapter rank (slots are this wide)", group="lora",
                              choices=LORA_RANKS, parse=int)
    max_cpu_loras: int | None = _arg(None, "adapters kept loaded in host memory, least recently used evicted "
                                           "(default: --max-loras)", group="lora", metavar="N", parse=int)

    runner: str = _arg("auto", "'pooling' runs embedding/classification requests, 'generate' text; 'auto': "
                               "by the architecture (...ForSequenceClassification and bare ...Model bodies pool)",
                       group="pooling", choices=RUNNERS)
    convert: str = _arg("auto", "turn the model into a pooling one: 'embed' or 'classify'", group="pooling",
                        choices=CONVERTS)
    task: str = _arg("auto", "vLLM's older selector: 'embed', 'classify' or 'score' mean --runner pooling with that "
                             "conversion", group="pooling", choices=TASKS)
    pooler_config: str | dict | None = _arg(
        None, "JSON overriding the model's pooler, e.g. '{\"pooling_type\": \"MEAN\", \"normalize\": false}' "
              "(pooling_type LAST, MEAN, CLS or ALL; normalize; activation; is_matryoshka; matryoshka_dimensions)",
        group="pooling", metavar="JSON")
    hf_overrides: str | dict | None = _arg(
        None, "JSON over the model's config, as vLLM's: 'architectures' and 'classifier_from_token' (with 'method': "
              "'from_2_way_softmax' or 'is_original_qwen3_reranker': true) serve a causal LM as a classifier from its "
              "LM head's rows of those tokens, e.g. Qwen3-Reranker", group="pooling", metavar="JSON")

    # several machines (see ParallelConfig): node 0 runs the engine, the others only ranks
    nnodes: int = _arg(1, "machines", group="nodes", metavar="N")
    node_rank: int = _arg(0, "this machine", group="nodes", metavar="I")
    master_addr: str = _arg("127.0.0.1", "node 0's address, reachable from every node", group="nodes",
                            metavar="HOST")
    master_port: int = _arg(29500, "the first of tensor-parallel-size + 2 free ports on node 0", group="nodes",
                            metavar="PORT")

    # ---- the keyword arguments of LLM and AsyncClient ----

    @classmethod
    def from_keywords(cls, caller: str, model: str | None, keywords: dict[str, Any]) -> EngineArgs:
        """The engine arguments of caller(model, **keywords); a keyword that is no field is
        a TypeError naming it, as Python's own."""
        for name in set(keywords) - _FIELD_NAMES:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
        return cls(model=model, **keywords)

    # ---- the command line ----

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
        """Adds a flag per field, in the CLI_GROUPS sections; returns them by group name."""
        groups = {name: parser.add_argument_group(title, description)
                  for name, (title, description) in CLI_GROUPS.items()}
        for spec in dataclasses.fields(EngineArgs):
            add_flag(groups[spec.metadata["cli"].group], spec)
        return groups

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{name: getattr(args, name) for name in _FIELD_NAMES})

    # ---- checks and the config ----

    def for_server(self) -> EngineArgs:
        """These arguments with the server's meaning of the fields left None."""
        return self._resolve_unset("server")

    def check(self) -> None:
        """The checks that need neither the model nor the device (ValueError naming the field):
        the launcher runs them on its flags before it starts anything."""
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size", "nnodes", "pipeline_parallel_size",
                     "data_parallel_size"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("max_num_batched_tokens", "num_kv_blocks", "max_cpu_loras"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        check_int("max_logprobs", self.max_logprobs, minimum=0)
        check_int("max_grammar_bytes", self.max_grammar_bytes, minimum=1)
        if not isinstance(self.grammar_compile_timeout, (int, float)) or not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be positive seconds, got {self.grammar_compile_timeout!r}")
        check_int("max_loras", self.max_loras, minimum=1)
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))}, got "
                             f"{self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        for name, allowed in (("dtype", DTYPES), ("model_impl", MODEL_IMPLS), ("device", DEVICES),
                              ("attention_backend", ATTENTION_BACKENDS),
                              ("scheduling_policy", SCHEDULING_POLICIES), ("load_format", LOAD_FORMATS),
                              ("preemption_mode", PREEMPTION_MODES),
                              ("structured_outputs_backend", STRUCTURED_OUTPUTS_BACKENDS),
                              ("reasoning_parser", REASONING_PARSERS), ("quantization", ("none",) + QUANTIZATION_METHODS),
                              ("collect_detailed_traces", DETAILED_TRACES)):
            value = getattr(self, name)  # (None: unset, where the field allows it)
            if value not in allowed and not (name in _MAY_BE_NONE and value is None):
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        fraction = self.gpu_memory_utilization
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= 1):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {fraction!r}")
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        cuda_graph_sizes(self)
        check_kv_offload_dir(self.kv_offload_dir, host_kv_bytes(self.swap_space, self.kv_offload_size,
                                                                self.preemption_mode),
                             self.enable_prefix_caching, self.tensor_parallel_size)
        if (world_size := self.tensor_parallel_size * self.pipeline_parallel_size) % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide tensor_parallel_size ({self.tensor_parallel_size})"
                             + (f" x pipeline_parallel_size ({world_size})" if self.pipeline_parallel_size > 1 else ""))
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        check_pooling_args(self.runner, self.convert, self.task, self.pooler_config)
        if self.otlp_traces_endpoint:
            check_tracing_available()  # the packages are an extra: say so before anything starts
        parse_hf_overrides(self.hf_overrides)
        parse_speculative_config(self.speculative_config)
        check_distributed_flags(self)
        self.check_inputs()
        if self.max_num_encoder_input_tokens is not None:
            check_int("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, minimum=1)

    def build(self) -> EngineConfig:
        """Resolves the model and checks every argument (ValueError naming the field). The
        fields left None take the Python API's meaning (for_server() sets the server's first)."""
        args = self._resolve_unset("python")
        args.check()
        check_gpu_memory_utilization(args.device, args.gpu_memory_utilization)
        model_dir = resolve_model(args.model)
        model_config = load_model_config(model_dir, args.model_impl)
        if model_config.model_impl == "transformers":  # (its steps run eagerly: no CUDA graph holds HF's modules)
            args = dataclasses.replace(args, enforce_eager=True)
        hf_overrides = parse_hf_overrides(args.hf_overrides)
        if "architectures" in hf_overrides:
            model_config = override_architecture(model_config, hf_overrides["architectures"][0])
        check_tensor_parallel_size(model_config, args.tensor_parallel_size)
        check_moe_engine(model_config.moe, model_config.architecture, tensor_parallel_size=args.tensor_parallel_size,
                         enable_expert_parallel=args.enable_expert_parallel, enable_lora=args.enable_lora,
                         pipeline_parallel_size=args.pipeline_parallel_size, quantization=args.quantization)
        max_model_len = args.max_model_len
        if max_model_len is None:
            max_model_len = model_config.max_position_embeddings
        elif not 1 < max_model_len <= model_config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {model_config.max_position_embeddings}] for this "
                             f"model, got {max_model_len}")
        pooler = pooler_for(model_config, args.runner, args.convert, args.task, args.pooler_config, hf_overrides)
        if pooler is not None and pooler.classifier_from_token and args.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: a classifier made from the LM head's rows runs on one device")
        quantization, gguf_file = resolve_quantization(args, model_config, generates=pooler is None)
        if model_config.is_encoder:  # whole prompts, one step each; attention both ways shares no prefix
            if args.tensor_parallel_size != 1:
                raise ValueError("tensor_parallel_size: an encoder model runs on one device")
            args = dataclasses.replace(args, enable_prefix_caching=False, max_num_batched_tokens=max(
                args.max_num_batched_tokens, max_model_len))
        speculative = parse_speculative_config(args.speculative_config)
        check_vision_engine(model_config.vision, tensor_parallel_size=args.tensor_parallel_size,
                            speculative=speculative is not None, enable_lora=args.enable_lora,
                            pooling=pooler is not None, pipeline_parallel_size=args.pipeline_parallel_size,
                            data_parallel_size=args.data_parallel_size)
        if speculative is not None:
            check_engine_fit(speculative, pooling=pooler is not None or not model_config.can_generate,
                             max_num_batched_tokens=args.max_num_batched_tokens)
        draft_model = load_draft_model_config(
            speculative.model, model_config, max_model_len=max_model_len,
            tensor_parallel_size=args.tensor_parallel_size, tokenizer_path=model_dir,
        ) if speculative is not None and speculative.method == "draft_model" else None
        check_distributed(args, model_config, pooler)
        check_fallback_engine(model_config, tensor_parallel_size=args.tensor_parallel_size,
                              pipeline_parallel_size=args.pipeline_parallel_size, enable_lora=args.enable_lora,
                              quantization=quantization, pooling=pooler is not None,
                              draft_model=draft_model is not None)
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(block_size=args.block_size, kv_cache_memory=parse_size(args.kv_cache_memory),
                              num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching,
                              gpu_memory_utilization=args.gpu_memory_utilization, preemption_mode=args.preemption_mode,
                              host_kv_bytes=host_kv_bytes(args.swap_space, args.kv_offload_size, args.preemption_mode),
                              kv_offload_dir=args.kv_offload_dir,
                              hybrid_kv_cache=hybrid_kv_cache(
                                  model_config, disabled=args.disable_hybrid_kv_cache_manager,
                                  pipeline_parallel=args.pipeline_parallel_size > 1, speculative=speculative is not None,
                                  kv_tiers=host_kv_bytes(args.swap_space, args.kv_offload_size, args.preemption_mode) > 0)),
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_num_batched_tokens,
                                      max_model_len=max_model_len, async_scheduling=args.async_scheduling,
                                      scheduling_policy=args.scheduling_policy,
                                      enable_chunked_prefill=not model_config.is_encoder,
                                      max_num_encoder_input_tokens=args.max_num_encoder_input_tokens),
            parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
                                    node_rank=args.node_rank, master_addr=args.master_addr,
                                    master_port=args.master_port, pipeline_parallel_size=args.pipeline_parallel_size,
                                    distributed_executor_backend=args.distributed_executor_backend,
                                    data_parallel_size=args.data_parallel_size,
                                    enable_expert_parallel=args.enable_expert_parallel),
            dtype=args.dtype, device=args.device, seed=args.seed, tokenizer_path=model_dir,
            attention_backend=args.attention_backend, load_format=args.load_format, quantization=quantization,
            max_logprobs=args.max_logprobs,
            structured_outputs_backend=args.structured_outputs_backend, reasoning_parser=args.reasoning_parser,
            otlp_traces_endpoint=args.otlp_traces_endpoint or None, collect_detailed_traces=args.collect_detailed_traces,
            lora=args._lora_config(),
            pooler=pooler, speculative=speculative, draft_model=draft_model, gguf_file=gguf_file,
            inputs=args.input_config(), **cuda_graph_sizes(args),
            logits_processors=allow_list(args.logits_processors),
            grammar_compile_timeout=float(args.grammar_compile_timeout), max_grammar_bytes=args.max_grammar_bytes)

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras or self.max_loras)

    def _resolve_unset(self, entry_point: Literal["server", "python"]) -> EngineArgs:
        """The one place where a field left None gets its value (see the module docstring)."""
        device = self.device
        if device is None:
            device = SERVER_DEVICE if entry_point == "server" else PYTHON_DEVICE
        batched_tokens = self.max_num_batched_tokens
        if batched_tokens is None:
            batched_tokens = SERVER_BATCHED_TOKENS["cuda" if on_cuda(device) else "cpu"] if entry_point == "server" \
                else PYTHON_BATCHED_TOKENS
        kv_memory, fraction = self.kv_cache_memory, self.gpu_memory_utilization
        if kv_memory is None:  # on CUDA the GPU's share, unless the pool is sized otherwise
            kv_memory = "2GiB"
            if fraction is None and self.num_kv_blocks is None and on_cuda(device):
                fraction = DEFAULT_GPU_MEMORY_UTILIZATION
        return dataclasses.replace(self, device=device, max_num_batched_tokens=batched_tokens,
                                   kv_cache_memory=kv_memory, gpu_memory_utilization=fraction)


_FIELD_NAMES = frozenset(spec.name for spec in dataclasses.fields(EngineArgs))
