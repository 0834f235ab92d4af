"""Runs StepPlans: keeps each request's state (tokens, block table) between steps, turns a
plan into flat input tensors, runs the model and the sampler, returns a StepResult.

Tokens are ordered decodes first, then prefill chunks, so the decode queries form one
contiguous run at the start of the batch."""

from __future__ import annotations


import torch

from actors.config import EngineConfig
from actors.lora.batch import LoRABatch
from actors.lora.slots import LoRASlots
from actors.models.vision_runner import VisionRunner
from actors.pooling.classifier import SCORE_WEIGHT, split_score_weight
from actors.models.encoder import BertClassifierHead, EncoderStep, build_encoder
from actors.pooling.runner import PoolingRunner, pooling_runner
from actors.quantization.swap import checkpoint_weight_stream, quantized_backend
from actors.layers.attention import make_backend
from actors.layers.attention_metadata import AttentionMetadata
from actors.worker.cached_request import CachedRequest
from actors.models.cpu_step import CpuModelStep
from actors.worker.cpu_tuning import MAX_FEW_ROWS, tune_allocator, tune_few_rows
from actors.worker.cuda_graphs import DecodeGraphs, StagedStep
from actors.worker.device_config import DTYPES, kv_block_bytes, num_kv_blocks
from actors.spec_decode.draft_model import DraftModel
from actors.worker.gpu_memory import MemorySnapshot, check_free_at_start, profile_num_kv_blocks
from actors.structured_output.grammar_processor import sampling_processors
from actors.worker.host_kv import HostKVCache
from actors.models.llama import LlamaModel
from actors.models.registry import model_class
from actors.layers.tensor_parallel import TensorParallel
from actors.layers.sampler import Sampler
from actors.worker.runner_step import StepExecution
from actors.spec_decode.speculator import Speculator
from actors.config.kv_groups import engine_kv_layout
from actors.worker.step_inputs import BlockTables, Stager, collect
from messages.worker import StepPlan


def build_model_runner(engine: EngineConfig, parallel: TensorParallel = TensorParallel()
                       ) -> tuple[ModelRunner, int]:
    """The model runner of this rank (engine's device resolved) and its KV block count:
    num_kv_blocks or kv_cache_memory, or on CUDA with gpu_memory_utilization a profiled step."""
    fraction = engine.cache.gpu_memory_utilization
    if fraction is None or engine.cache.num_kv_blocks is not None:
        num_blocks = num_kv_blocks(engine, parallel)
        return ModelRunner(engine, num_blocks, engine.attention_backend, engine.load_format, parallel), num_blocks
    if not engine.device.startswith("cuda"):
        raise ValueError("gpu_memory_utilization needs a CUDA device; on the CPU use kv_cache_memory")
    start = MemorySnapshot.take(torch.device(engine.device))  # (before the weights)
    check_free_at_start(start, fraction)
    runner = ModelRunner(engine, None, engine.attention_backend, engine.load_format, parallel)
    num_blocks = profile_num_kv_blocks(runner, fraction, start, kv_block_bytes(engine, parallel))
    runner.allocate_kv_cache(num_blocks)
    runner.graphs.prepare()  # (captured over the KV cache: now that it exists)
    return runner, num_blocks


class ModelRunner(StepExecution):
    def __init__(self, engine: EngineConfig, num_blocks: int | None, attention_backend: str = "auto",
                 load_format: str = "auto", parallel: TensorParallel = TensorParallel()) -> None:
        if engine.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {engine.dtype!r}")
        tune_allocator()
        self.device = torch.device(engine.device)
        self.dtype = DTYPES[engine.dtype]
        self.block_size = engine.cache.block_size
        self.backend = make_backend(attention_backend, self.device)
        self.parallel = parallel
        self.engine = engine
        self.load_format = load_format
        # a decoder (LlamaModel), or an encoder (BERT) that runs whole prompts through its own
        # forward and keeps no KV cache
        self.model: LlamaModel | None = None
        self.encoder: EncoderStep | None = None
        self.vision: VisionRunner | None = None  # a vision-language model's vision tower and encoder cache
        head_weights: dict[str, object] = {}  # a classifier's score weight, split off the decoder's
        self.load_weights(head_weights)
        # BERT's classification head: its pooler and classifier, not a score weight
        encoder_head = BertClassifierHead(self.encoder.model.pooler, self.encoder.model.classifier) \
            if self.encoder is not None and self.encoder.model.classifier is not None else None
        self.pooling: PoolingRunner | None = None if engine.pooler is None else pooling_runner(
            engine.pooler, engine.model.hidden_size, head_weights.get(SCORE_WEIGHT), load_format == "dummy",
            self.dtype, self.device, engine.seed, self.model.lm_head if self.model is not None else None,
            engine.tokenizer_path, head=encoder_head)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # the persistent batch: each request's block table in a row; a step's inputs staged in bulk
        # with layer groups (actors/config/kv_groups.py), a table per group in each row, and
        # the layers' KV in the groups' shared tensors
        self.kv_layout = engine_kv_layout(engine)
        self.layer_groups = self.kv_layout.layer_groups(engine.model.num_hidden_layers) \
            if self.kv_layout.num_groups > 1 else None
        self.block_tables = BlockTables(rows=max(16, engine.scheduler.max_num_seqs),
                                        width=-(-engine.scheduler.max_model_len // self.block_size),
                                        groups=self.kv_layout.num_groups)
        self.stager = Stager(self.device)
        self._dropped: list[CachedRequest] = []  # dropped while the last launched step samples them
        self.sampler = Sampler(engine.model.eos_token_ids, engine.seed, sampling_processors(engine, parallel))
        self.requests: dict[str, CachedRequest] = {}
        # speculative decoding: drafts for decodes, verified in the same step (speculator.py)
        self.speculator = Speculator(engine.speculative, self.block_size, engine.scheduler.max_model_len,
                                     DraftModel.build(engine, self.dtype, self.device, self.backend)) \
            if engine.speculative is not None and self.model is not None else None
        # the adapters' slots (engine.lora): allocated before the KV cache, so a GPU's
        # profile counts them
        self.lora_slots = LoRASlots(engine.lora, engine.model, self.dtype, self.device, parallel) \
            if engine.lora is not None else None
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)
        self.host_kv = HostKVCache.build(self, parallel)  # the host KV tier, or None
        self.graphs = DecodeGraphs(self)  # CUDA: small decode steps replayed from graphs

    def load_weights(self, head_weights: dict[str, object] | None = None) -> None:
        """Builds the model from its checkpoint (or dummy weights), and its fast step paths;
        head_weights collects a classifier's score weight split off a decoder's."""
        engine, parallel = self.engine, self.parallel
        head_weights = {} if head_weights is None else head_weights
        if engine.model.is_encoder:
            classify = engine.pooler is not None and engine.pooler.task == "classify"
            self.encoder = build_encoder(engine.model, self.dtype, self.device, self.load_format == "dummy",
                                         engine.seed, classify, engine.quantization)
        else:
            # (the registry's: actors/models/registry.py; or the Transformers fallback)
            decoder = model_class(engine.model.architecture, engine.model.model_impl)
            self.model = decoder(engine.model, self.dtype, self.device, self.backend, parallel)
            self.vision = VisionRunner.build(engine.model.vision, self.dtype, self.device) \
                if engine.model.vision else None
            if self.load_format == "dummy":
                self.model.init_dummy_weights(engine.seed)
            else:
                from actors.models.loader import iter_weight_slices

                weights = VisionRunner.split(self.vision, iter_weight_slices(engine.model.model_path))
                weights = checkpoint_weight_stream(weights, engine)  # (a quantized checkpoint's, dequantized)
                self.model.load_weights((name, parallel.shard(name, weight_slice, engine.model))
                                        for name, weight_slice in split_score_weight(weights, head_weights))
            if self.vision is not None:
                self.vision.load(self.load_format == "dummy", engine.model.hidden_size, engine.seed)
        # (the Transformers fallback's modules run op by op: no C++ linear, no one-call step)
        fallback = engine.model.model_impl == "transformers"
        if self.encoder is None and self.backend.name == "cpu" and self.backend.native is not None \
                and self.dtype == torch.float32 and not fallback:
            # past this many rows sgemm beats the C++ linear, which depends on the CPU's vectors
            self.backend.few_rows = tune_few_rows(self.backend.native, self.model.layers, MAX_FEW_ROWS)
        self.backend = quantized_backend(self.model, self.backend, engine, parallel)  # (--quantization)
        # the CPU's whole-step fast path (one C++ call) where there is one; else model.forward
        self.model_step = CpuModelStep.build(self.model, self.backend) if self.encoder is None and not fallback \
            else None

    def drop_weights(self) -> None:
        """Lets the model's weights go (sleep level 2); load_weights() brings them back."""
        self.model_step = None
        if self.encoder is not None:
            self.encoder.model = None  # (the step object stays: it marks the runner as an encoder's)
        else:
            self.model = type(self.model)(self.engine.model, self.dtype, self.device, self.backend, self.parallel)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.engine.model
        self.kv_caches = []  # the old cache goes before the new one is made
        if self.encoder is not None:
            return  # its blocks are the scheduler's bookkeeping only
        shape = (num_blocks, self.model.num_kv_heads, self.block_size, m.head_dim)
        # zeros, not empty: masked slots are multiplied by 0, and 0 * NaN garbage is NaN
        # a layer's KV lives in its group's slot: layers of different groups share the tensors,
        # each group's blocks being its own (kv_groups.py); one group: a tensor pair a layer
        slots = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                  torch.zeros(shape, dtype=self.dtype, device=self.device))
                 for _ in range(self.kv_layout.layers_per_group)]
        self.kv_caches = [slots[slot] for slot in self.kv_layout.layer_slots(m.num_hidden_layers)]
        if self.speculator is not None:
            self.speculator.allocate_kv_cache(num_blocks)  # a draft model's, with the same block ids

    def num_weight_bytes(self) -> int:
        """Bytes of weights this rank holds: the decoder's, or the encoder's."""
        return self.encoder.model.num_weight_bytes() if self.encoder is not None else self.model.num_weight_bytes()

    def release_dropped(self) -> None:
        """Lets go of the requests a plan dropped while the step before it still sampled them."""
        for request in self._dropped:
            self._release(request.request_id, request)
        self._dropped = []

    def _release(self, request_id: str, request: CachedRequest | None) -> None:
        if request is not None:
            self.block_tables.remove(request.row)
        if self.vision is not None:
            self.vision.remove_request(request_id)
        if self.speculator is not None:
            self.speculator.remove_request(request_id, request.token_ids if request is not None else None)
        if request is not None and request.pooling is not None:
            self.pooling.remove_request(request_id)
        else:
            self.sampler.remove_request(request_id)

    def update_states(self, plan: StepPlan) -> None:
        for request_id in plan.finished_request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None and request.sampled_row is not None:
                # the step launched before this one samples it still: let it go once that step is finished
                self._dropped.append(request)
                continue
            self._release(request_id, request)
        for new in plan.new_requests:
            self.requests[new.request_id] = CachedRequest(
                new.request_id, list(new.token_ids), new.num_prompt_tokens, new.params,
                list(new.block_ids), new.num_computed_tokens, new.lora_request, new.pooling_params, new.mm_inputs,
                row=self.block_tables.add(new.block_ids))
            if new.pooling_params is not None:
                self._pooling_runner().add_request(new.request_id, new.pooling_params)
            else:
                self.sampler.add_request(new.request_id, new.params, new.token_ids[: new.num_prompt_tokens],
                                         new.token_ids[new.num_prompt_tokens:])
        for continuing in plan.continuing_requests:
            request = self.requests[continuing.request_id]
            if continuing.new_block_ids:
                request.block_ids.extend(continuing.new_block_ids)
                self.block_tables.extend(request.row, continuing.new_block_ids)
            # the worker is authoritative: with accepted drafts it runs ahead of the scheduler,
            # which learns of them from the result (actors/scheduler/speculation.py)
            assert continuing.num_computed_tokens <= request.num_computed_tokens, \
                f"{continuing.request_id}: the scheduler counts {continuing.num_computed_tokens} computed tokens, " \
                f"the worker {request.num_computed_tokens}"

    def _pooling_runner(self) -> PoolingRunner:
        if self.pooling is None:
            raise ValueError("a pooling request reached a model that generates (runner 'generate')")
        return self.pooling

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionMetadata,
                 lora: LoRABatch | None = None, embeds: torch.Tensor | None = None) -> torch.Tensor:
        # -> [num_tokens, hidden]; embeds: the input embeddings, when images replaced some rows
        if self.encoder is not None:  # whole prompts: the step's query offsets are its sequences
            return self.encoder(input_ids, attention.host.query_start_loc)
        if (hidden := self.graphs.forward(attention)) is not None:  # (a step staged for a CUDA graph)
            return hidden
        if self.model_step is not None and self.model_step.takes(attention):
            return self.model_step(self.model.embed(input_ids) if embeds is None else embeds, positions,
                                   self.kv_caches, attention, lora)
        return self.model.forward(input_ids, positions, self.kv_caches, attention, lora, embeds)

    def _prepare_inputs(self, batch: list[tuple[CachedRequest, int]], lora: LoRABatch | None = None,
                        previous_sampled: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None, AttentionMetadata | StagedStep]:
        """Flat inputs, and the step's attention metadata (built once, with the backend's
        plan; every layer reads it); or, for a CUDA graph's decode step, the inputs staged
        in its buffers. The batch is ordered decodes first. previous_sampled: the previous
        step's sampled tokens on the device, where a request's last token is still there."""
        temporary = [request for request, _ in batch if request.row < 0]  # (a test's stand-alone requests)
        for request in temporary:
            request.row = self.block_tables.add(request.block_ids)
        try:
            step = collect(batch, self.block_tables, self.block_size)
        finally:
            for request in temporary:
                self.block_tables.remove(request.row)
                request.row = -1
        if self.graphs.enabled and (staged := self.graphs.stage(step, lora, previous_sampled)):
            return None, None, staged
        staged = self.stager.stage(step, previous_sampled)
        attention = AttentionMetadata.staged(step, staged, self.block_size, self.layer_groups)
        for group in attention.kv_groups:
            self.backend.prepare(group, self.dtype)
        return staged.input_ids, staged.positions, attention
