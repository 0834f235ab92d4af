"""Steps replayed from CUDA graphs: on CUDA a step of a small model, or of a small batch,
costs more in kernel launches (nine or ten per layer, 20 to 60 µs of Python each) than the GPU
takes to compute it, so the model's forward is captured once per shape and replayed
(vLLM's FULL cudagraph mode; research/design-review.md: the graph runner is the model
runner's seam, beside the CPU's one-call C++ step).

- Captured at start-up, once per KV-cache layout (the graphs hold the caches' addresses),
  the largest first into one memory pool: decode graphs for the batch sizes of
  --cuda-graph-sizes, and mixed graphs (prefill chunks and decodes) for token counts every
  32 up to max_cudagraph_capture_size (--compilation-config; FULL_DECODE_ONLY: none).
- A step of one token per sequence takes the decode graph of the next captured batch size
  (of one split of attention where every sequence has at most 512 keys: no reduction);
  another step, of up to graph_inputs.MAX_PREFILLS prefill chunks, the mixed graph of the
  next captured token count. Its inputs go into persistent buffers (graph_inputs.py); the
  padding rows write no KV (slot -1) and their outputs are ignored; every kernel works row by
  row, so a padding row never changes a real one.
- Attention normally sizes its grids by the step's lengths (host numbers); a graph cannot:
  decode attention is captured with the splits of max_model_len (a split past a sequence's
  end returns at once), and a mixed graph's prefill attention with tiles for all its tokens
  and MAX_PREFILLS chunks (programs past a chunk's end, or of the dummy sequence, return).
Everything else (larger steps, LoRA, images, tensor and pipeline parallelism) runs eagerly
through model.forward."""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace

import torch

from actors.layers.attention_metadata import AttentionMetadata
from actors.worker.graph_inputs import MAX_PREFILLS, GraphInputs
from actors.worker.step_inputs import StepInputs
from kernels.paged_attention import PagedAttentionLaunch
from kernels.paged_attention_ref import SequenceSplit

# a graph's decode attention splits max_model_len into at most this many partitions of at
# least 512 keys: more splits would only add empty programs and partial-result memory
_MAX_SPLITS = 32
# decode steps whose longest sequence has at most this many keys replay graphs of one split
SHORT_CONTEXT = 512


def graph_partition_size(max_model_len: int) -> int:
    """Keys per split of a graph's decode attention: 512 (the eager default) unless
    max_model_len needs more than _MAX_SPLITS of them."""
    size = 512
    while size * _MAX_SPLITS < max_model_len:
        size *= 2
    return size


@dataclass(frozen=True)
class StagedStep:
    """A step whose inputs CudaGraphs.stage has put in the graphs' buffers: what the model
    runner passes on to its forward in place of the step's AttentionMetadata."""

    num_tokens: int
    key: tuple[str, int]  # the graph that takes it: ("decode", batch size) or ("mixed", tokens)


class CudaGraphs:
    """The captured graphs of one model and one KV cache."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sizes: tuple[int, ...],
                 max_model_len: int, block_size: int, mixed_sizes: tuple[int, ...] = (),
                 max_num_seqs: int = 0, layer_groups: list[int] | None = None) -> None:
        self.model, self.kv_caches, self.sizes, self.mixed_sizes = model, kv_caches, sizes, mixed_sizes
        self.layer_groups = layer_groups  # each layer's KV group (actors/config/kv_groups.py); None: one
        self.max_model_len, self.block_size = max_model_len, block_size
        # decode steps whose sequences all fit one split of attention get graphs of their own:
        # one program a (sequence, kv head), no reduction launched
        self.short_context = max_model_len > SHORT_CONTEXT
        max_seqs = max(sizes[-1] if sizes else 1, max_num_seqs)
        self.inputs = GraphInputs(model.device, max((sizes or (1,))[-1], (mixed_sizes or (1,))[-1]), max_seqs,
                                  -(-max_model_len // block_size), 1 + max(layer_groups or [0]))
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self._capture()

    def valid_for(self, model, kv_caches: list) -> bool:
        """Whether these graphs were captured over this model's weights and this KV cache."""
        return model is self.model and kv_caches is self.kv_caches

    def stage(self, step: StepInputs, previous_sampled: torch.Tensor | None) -> StagedStep | None:
        """Puts a step's inputs in the buffers of the graph that takes it, or None where none
        does (too many tokens, sequences or prefill chunks). A pending token (asynchronous
        steps) is copied into the input ids on the device from the previous step's samples."""
        inputs = self.inputs
        if step.num_tokens == step.num_seqs and self.sizes and step.num_seqs <= self.sizes[-1]:
            size = next(size for size in self.sizes if size >= step.num_seqs)
            inputs.stage_decode(step, size, previous_sampled)
            short = self.short_context and int(step.seq_lens.max()) <= SHORT_CONTEXT
            return StagedStep(step.num_tokens, ("decode-short" if short else "decode", size))
        if (not self.mixed_sizes or step.num_tokens > self.mixed_sizes[-1] or step.num_seqs > inputs.max_seqs
                or int((step.query_lens > 1).sum()) > MAX_PREFILLS):
            return None
        size = next(size for size in self.mixed_sizes if size >= step.num_tokens)
        inputs.stage_mixed(step, size, previous_sampled)
        return StagedStep(step.num_tokens, ("mixed", size))

    def replay(self, step: StagedStep) -> torch.Tensor:
        """The staged step's hidden states [num_tokens, hidden]."""
        self.graphs[step.key].replay()
        return self.outputs[step.key][: step.num_tokens]

    def _metadata(self, key: tuple[str, int]) -> AttentionMetadata:
        metadata = self._group_metadata(key)
        if self.layer_groups is not None:  # each group reads its own slots and tables
            size, inputs = key[1], self.inputs
            seqs = size if key[0] != "mixed" else inputs.max_seqs + 1
            metadata.groups = [metadata] + [
                replace(metadata, slot_mapping=slots[:size], block_tables=tables[:seqs], window_plans={})
                for slots, tables in zip(inputs.group_slot_mappings[1:], inputs.group_block_tables[1:])]
            metadata.layer_groups = self.layer_groups
        return metadata

    def _group_metadata(self, key: tuple[str, int]) -> AttentionMetadata:
        kind, size = key
        inputs, partition = self.inputs, graph_partition_size(self.max_model_len)
        host = SequenceSplit([1] * size, list(range(size + 1)), list(range(size)), [])  # (not read on CUDA)
        if kind in ("decode", "decode-short"):
            longest = SHORT_CONTEXT if kind == "decode-short" else self.max_model_len
            launch = PagedAttentionLaunch(decode_seqs=inputs.one_token_seqs[:size], prefill_seqs=inputs.prefill_seqs[:0],
                                          max_query_len=0, max_decode_seq_len=longest,
                                          decode_partition_size=SHORT_CONTEXT if kind == "decode-short" else partition)
            return AttentionMetadata(num_decodes=size, num_prefills=0, num_decode_tokens=size, max_query_len=1,
                                     max_seq_len=self.max_model_len, block_size=self.block_size, host=host,
                                     slot_mapping=inputs.slot_mapping[:size], block_tables=inputs.block_tables[:size],
                                     seq_lens=inputs.seq_lens[:size],
                                     query_start_loc=inputs.one_token_offsets[: size + 1], plan=launch)
        # mixed: every sequence slot (the dummy's last), decodes and prefill chunks from the step's lists
        decodes = min(size, inputs.max_seqs)
        launch = PagedAttentionLaunch(decode_seqs=inputs.decode_seqs[:decodes], prefill_seqs=inputs.prefill_seqs,
                                      max_query_len=size, max_decode_seq_len=self.max_model_len,
                                      decode_partition_size=partition)
        return AttentionMetadata(num_decodes=decodes, num_prefills=MAX_PREFILLS, num_decode_tokens=0,
                                 max_query_len=size, max_seq_len=self.max_model_len, block_size=self.block_size,
                                 host=host, slot_mapping=inputs.slot_mapping[:size], block_tables=inputs.block_tables,
                                 seq_lens=inputs.seq_lens, query_start_loc=inputs.query_start_loc, plan=launch)

    def _forward(self, key: tuple[str, int], attention: AttentionMetadata) -> torch.Tensor:
        size = key[1]
        return self.model.forward(self.inputs.input_ids[:size], self.inputs.positions[:size], self.kv_caches,
                                  attention)

    @torch.inference_mode()
    def _capture(self) -> None:
        # the largest first (by tokens): the smaller ones reuse its memory
        decode_kinds = ("decode", "decode-short") if self.short_context else ("decode",)
        keys = sorted([(kind, size) for size in self.sizes for kind in decode_kinds]
                      + [("mixed", size) for size in self.mixed_sizes], key=lambda key: (key[1], key[0]), reverse=True)
        if self.model.device.type != "cuda":  # (tests: Triton's interpreter on the CPU)
            for key in keys:
                self.graphs[key] = _RerunAsReplay(self, key)
            return
        pool = torch.cuda.graph_pool_handle()
        # The garbage collector must not run during a capture: it would destroy graphs that
        # earlier engines of this process left in reference cycles, and a graph's destruction
        # is a CUDA call a capture forbids (it invalidates the capture). Collect first, then hold it.
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for key in keys:
                attention = self._metadata(key)
                self._forward(key, attention)  # compiles this shape's kernels outside the capture
                torch.cuda.synchronize(self.model.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[key] = self._forward(key, attention)
                self.graphs[key] = graph
        finally:
            if was_enabled:
                gc.enable()
        torch.cuda.synchronize(self.model.device)


class _RerunAsReplay:
    """A graph's stand-in off CUDA, so the CPU's tests check everything around the capture
    (the persistent buffers, the padding, the launches with the graphs' fixed grids): a
    replay runs the same forward over the same buffers into the same output tensor."""

    def __init__(self, graphs: CudaGraphs, key: tuple[str, int]) -> None:
        self.graphs, self.key = graphs, key
        self.attention = graphs._metadata(key)
        graphs.outputs[key] = graphs._forward(key, self.attention)

    def replay(self) -> None:
        self.graphs.outputs[self.key].copy_(self.graphs._forward(self.key, self.attention))


class DecodeGraphs:
    """The model runner's side of the graphs: which steps take them, and capturing them
    again when the runner's model or KV cache is no longer what they were captured over
    (a KV cache reallocated, weights reloaded after sleep)."""

    def __init__(self, runner) -> None:  # runner: model_runner.ModelRunner
        self.runner = runner
        engine = runner.engine
        parallel = engine.parallel
        applies = (runner.device.type == "cuda" and runner.model is not None and runner.vision is None
                   and runner.backend.name == "triton"
                   and parallel.tensor_parallel_size == parallel.pipeline_parallel_size == 1)
        self.sizes: tuple[int, ...] = engine.cuda_graph_sizes if applies else ()
        self.mixed_sizes: tuple[int, ...] = engine.cuda_graph_mixed_sizes if applies else ()
        self.captured: CudaGraphs | None = None
        self.prepare()

    def prepare(self) -> None:
        """Captures the graphs now (start-up), if they apply and the KV cache exists."""
        runner = self.runner
        if (self.sizes or self.mixed_sizes) and runner.kv_caches and not (
                self.captured and self.captured.valid_for(runner.model, runner.kv_caches)):
            self.captured = None  # (its pool and buffers go before the new ones are made)
            engine = runner.engine
            self.captured = CudaGraphs(runner.model, runner.kv_caches, self.sizes, engine.scheduler.max_model_len,
                                       runner.block_size, self.mixed_sizes, engine.scheduler.max_num_seqs,
                                       runner.layer_groups)

    def drop(self) -> None:
        """Lets the graphs, their memory and their hold on the KV cache go (sleep)."""
        self.captured = None

    @property
    def enabled(self) -> bool:
        return bool(self.sizes or self.mixed_sizes)

    def stage(self, step: StepInputs, lora, previous_sampled: torch.Tensor | None) -> StagedStep | None:
        """A graph's step with these inputs staged, or None: the step runs eagerly (lora:
        the step's adapters, which no graph runs)."""
        if not self.enabled or lora is not None:
            return None
        self.prepare()
        return None if self.captured is None else self.captured.stage(step, previous_sampled)

    def forward(self, attention: AttentionMetadata | StagedStep) -> torch.Tensor | None:
        """A staged step's hidden states from its graph, or None: the step runs eagerly."""
        return self.captured.replay(attention) if isinstance(attention, StagedStep) else None
