"""Pipeline parallelism: a rank's stage, and the model runner of a stage.

The model's layers are split into pipeline_parallel_size stages of contiguous layers
(actors/config/parallel_flags.py's stage_layers); each stage has tensor_parallel_size ranks, and
global rank = stage * tensor_parallel_size + tensor-parallel rank. A stage loads only its
layers' weights (the embedding on the first, the final norm and LM head on the last) and
allocates KV cache for its layers only: its runner sees a model config of its own layer
count, with the layers renumbered from 0.

Every stage receives every plan (the executor sends it to every rank) and runs the plans
in order. Within a step the hidden states and the residual go from each rank to the same
tensor-parallel rank of the next stage (torch.distributed point-to-point: gloo on the CPU,
NCCL on CUDA); the last stage samples and its tensor-parallel rank 0 answers the scheduler.
The last stage also sends each step's sampled tokens back to the earlier stages (stage_link.py):
the first stage needs them as the next decode's input, and the others keep the same
per-request state. A stage waits for those tokens only when a plan needs them, so plans
whose requests are disjoint (the scheduler skips a request while its sample is in flight,
scheduler.py's skip_sampling_in_flight) run on different stages at the same time."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from actors.config import EngineConfig
from actors.config.parallel_flags import stage_layers
from actors.layers.attention_metadata import AttentionMetadata
from actors.worker.model_runner import ModelRunner
from actors.layers.tensor_parallel import TensorParallel
from actors.worker.stage_link import StageLink
from messages.scheduler import StepResult
from messages.worker import StepPlan
from actors.config.env import STAGE_TIMES_DIR_VARIABLE, stage_times_dir

# When set, each stage writes its step times to $TROUPE_STAGE_TIMES_DIR/stage{rank}.json at
# shutdown (benchmarks/pipeline.py's bubble estimate).
STAGE_TIMES_DIR = STAGE_TIMES_DIR_VARIABLE


@dataclass(frozen=True)
class PipelineStage:
    """One rank's stage: which stage, how many, and its layers of the checkpoint."""

    index: int
    size: int
    layers: range
    tp_size: int
    tp_rank: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def global_rank(self, stage: int) -> int:
        """This rank's peer (the same tensor-parallel rank) in another stage."""
        return stage * self.tp_size + self.tp_rank


def stage_of(engine: EngineConfig, rank: int) -> PipelineStage:
    parallel = engine.parallel
    index, tp_rank = divmod(rank, parallel.tensor_parallel_size)
    return PipelineStage(index, parallel.pipeline_parallel_size,
                         stage_layers(engine.model.num_hidden_layers, parallel.pipeline_parallel_size, index),
                         parallel.tensor_parallel_size, tp_rank)


def join_stage_groups(stage: PipelineStage) -> TensorParallel:
    """After the world's init_process_group: one process group per stage's tensor-parallel
    ranks (every rank creates every group, in the same order, as torch.distributed asks);
    this rank's TensorParallel over its own."""
    mine = None
    for index in range(stage.size):
        ranks = [index * stage.tp_size + tp_rank for tp_rank in range(stage.tp_size)]
        group = torch.distributed.new_group(ranks) if stage.tp_size > 1 else None
        if index == stage.index:
            mine = group
    return TensorParallel(stage.tp_rank, stage.tp_size, group=mine, root=stage.index * stage.tp_size)


def stage_engine(engine: EngineConfig, stage: PipelineStage) -> EngineConfig:
    """The engine config a stage's runner is built with: its layer count, so the KV cache
    and its block count cover its layers only."""
    windows = engine.model.sliding_windows[stage.layers.start:stage.layers.stop]  # (its layers' own)
    model = dataclasses.replace(engine.model, num_hidden_layers=len(stage.layers), sliding_windows=windows)
    return dataclasses.replace(engine, model=model)


def stage_weights(weights: Iterator[tuple[str, object]], stage: PipelineStage,
                  tied: bool) -> Iterator[tuple[str, object]]:
    """The checkpoint's weights this stage holds, its layers renumbered from 0; the others
    are skipped before they are read (a lazy slice is read only when indexed)."""
    first, end = stage.layers.start, stage.layers.stop
    for name, weight in weights:
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if first <= int(index) < end:
                yield f"model.layers.{int(index) - first}.{rest}", weight
        elif name == "model.embed_tokens.weight":
            if stage.is_first or (stage.is_last and tied):
                yield name, weight
        elif stage.is_last:  # the final norm, the LM head
            yield name, weight


def build_stage_runner(engine: EngineConfig, rank: int) -> tuple[StageRunner, int, int]:
    """After the world's init_process_group: this rank's stage runner, its KV block count
    (from its own layers' share of kv_cache_memory or num_kv_blocks), and the global rank
    that answers the scheduler (the last stage's tensor-parallel rank 0)."""
    from actors.worker.device_config import num_kv_blocks

    stage = stage_of(engine, rank)
    parallel = join_stage_groups(stage)
    num_blocks = num_kv_blocks(stage_engine(engine, stage), parallel)
    output_rank = (stage.size - 1) * stage.tp_size
    return StageRunner(engine, num_blocks, stage, parallel), num_blocks, output_rank


class StageRunner(ModelRunner):
    """The model runner of one pipeline stage (see the module docstring). The last stage
    runs ModelRunner.execute with its forward starting from the received hidden states; the
    others run their layers, pass the hidden states on and return an empty result."""

    can_run_ahead = False  # (a stage's step waits on its neighbours' hidden states and tokens)

    def __init__(self, engine: EngineConfig, num_blocks: int, stage: PipelineStage,
                 parallel: TensorParallel) -> None:
        self.stage = stage
        self.link = StageLink(stage, torch.device(engine.device))
        # (start, end, seconds waiting for the previous stage) of each step, kept only for
        # the benchmark's bubble estimate
        self.step_times: list[tuple[float, float, float]] | None = [] if stage_times_dir() else None
        super().__init__(stage_engine(engine, stage), num_blocks, engine.attention_backend, engine.load_format,
                         parallel)

    def load_weights(self, head_weights: dict[str, object] | None = None) -> None:
        from actors.models.registry import model_class

        engine, parallel, stage = self.engine, self.parallel, self.stage
        self.model = model_class(engine.model.architecture)(engine.model, self.dtype, self.device, self.backend, parallel)
        self.model.holds_embedding = stage.is_first
        self.model.holds_head = stage.is_last
        if self.load_format == "dummy":
            self.model.init_dummy_weights(engine.seed)
        else:
            from actors.models.loader import iter_weight_slices

            tied = engine.model.tie_word_embeddings
            self.model.load_weights((name, parallel.shard(name, weight_slice, engine.model)) for name, weight_slice
                                    in stage_weights(iter_weight_slices(engine.model.model_path), stage, tied))
        self.model_step = None  # the CPU's one-call step runs a whole model, not a stage

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        if self.step_times is None:
            return self._execute(plan)
        started, waited_before = time.perf_counter(), self.link.waited_s
        result = self._execute(plan)
        self.step_times.append((started, time.perf_counter(), self.link.waited_s - waited_before))
        return result

    def _execute(self, plan: StepPlan) -> StepResult:
        if self.stage.is_last:
            result = super().execute(plan)
            self.link.send_tokens(result.sampled_token_ids)
            return result
        self.link.apply_arrived_tokens()
        self.update_states(plan)
        if not plan.num_scheduled_tokens:
            return StepResult(step_id=plan.step_id, request_ids=[], sampled_token_ids=[])
        scheduled = [(self.requests[request_id], num_tokens)
                     for request_id, num_tokens in plan.num_scheduled_tokens.items()]
        self.link.wait_for_tokens(scheduled)
        batch, _ = self._order_batch(scheduled)
        input_ids, positions, attention = self._prepare_inputs(batch)
        _, samplers, _ = self._logit_rows(batch)
        self._forward(input_ids, positions, attention)
        for request, num_tokens in batch:
            request.num_computed_tokens += num_tokens
        self.link.expect_tokens(samplers)
        return StepResult(step_id=plan.step_id, request_ids=[], sampled_token_ids=[])

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionMetadata,
                 lora=None, embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        # (lora and embeds stay None: pipeline parallelism refuses LoRA and vision models at start-up)
        model = self.model
        if self.stage.is_first:
            hidden, residual = model.embed(input_ids), None
        else:
            hidden, residual = self.link.receive_hidden(positions.shape[0], self.engine.model.hidden_size,
                                                        self.dtype, self.device)
        hidden, residual = model.run_layers(hidden, residual, positions, self.kv_caches, attention)
        if self.stage.is_last:
            return model.final_norm_of(hidden, residual)
        self.link.send_hidden(hidden, residual)
        return None

    def close(self) -> None:
        """Writes the stage's step times where the benchmark asked for them."""
        if self.step_times:
            rank = self.stage.global_rank(self.stage.index)
            with open(os.path.join(stage_times_dir(), f"stage{rank}.json"), "w") as times_file:
                json.dump({"stage": self.stage.index, "rank": rank, "steps": self.step_times}, times_file)
