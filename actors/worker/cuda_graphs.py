"""Decode steps replayed from CUDA graphs: on CUDA, a decode step of a small batch costs
more in kernel launches (a dozen per layer, each a few microseconds of CPU) than the GPU
takes to read the weights, so the model's forward is captured once per batch size and
replayed (vLLM's and SGLang's approach; research/design-review.md: the graph runner is the
model runner's seam, beside the CPU's one-call C++ step).

- Captured at start-up, once per KV-cache layout (the graphs hold the caches' addresses),
  largest batch first into one memory pool, for the sizes of --cuda-graph-sizes.
- A step whose sequences all decode one token, with no LoRA adapter and no image rows,
  takes the graph of the next captured size: its inputs go into persistent buffers in two
  copies from pinned host buffers, the padding rows write no KV (slot -1) and attend to one cached token, and the
  graph's output rows past the step's are ignored. Every kernel works row by row, so a
  padding row never changes a real one.
- Paged decode attention normally sizes its grid by the step's longest sequence (a host
  number); a graph cannot, so it is captured with the splits of max_model_len, and a
  split past a sequence's end returns at once (the kernel already allows that).
Everything else (prefills, mixed steps, larger batches, LoRA, images, speculative
verification) runs eagerly through model.forward."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from actors.worker.attention_metadata import AttentionMetadata
from actors.worker.step_inputs import StepInputs
from kernels.paged_attention import PagedAttentionLaunch
from kernels.paged_attention_ref import SequenceSplit

# a graph's decode attention splits max_model_len into at most this many partitions of at
# least 512 keys: more splits would only add empty programs and partial-result memory
_MAX_SPLITS = 32


def graph_partition_size(max_model_len: int) -> int:
    """Keys per split of a graph's decode attention: 512 (the eager default) unless
    max_model_len needs more than _MAX_SPLITS of them."""
    size = 512
    while size * _MAX_SPLITS < max_model_len:
        size *= 2
    return size


@dataclass(frozen=True)
class StagedDecode:
    """A decode step whose inputs CudaGraphs.stage has put in the graphs' buffers: what the
    model runner passes on to its forward in place of the step's AttentionMetadata."""

    num_decodes: int
    size: int  # the captured size that takes it


class CudaGraphs:
    """The captured decode graphs of one model and one KV cache."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sizes: tuple[int, ...],
                 max_model_len: int, block_size: int) -> None:
        device = model.device
        self.model, self.kv_caches, self.sizes = model, kv_caches, sizes
        self.max_model_len, self.block_size = max_model_len, block_size
        largest = sizes[-1]
        self.max_blocks = max_blocks = -(-max_model_len // block_size)
        # The persistent inputs, sliced per size, are views of two buffers, so that a step
        # fills a host copy of each (pinned on CUDA) and sends them in two copies: token ids,
        # positions and KV slots (int64); sequence lengths, then the block table (int32).
        # rows 3 and 4: a step's pending tokens (where they go, where the last step sampled them)
        self.longs = torch.zeros(5, largest, dtype=torch.long, device=device)
        self.ints = torch.zeros(largest * (1 + max_blocks), dtype=torch.int32, device=device)
        # two host halves, alternating: a step is staged while the one before it may still run
        pinned = device.type == "cuda"
        self.host = [(torch.zeros(5, largest, dtype=torch.long, pin_memory=pinned),
                      torch.zeros(largest * (1 + max_blocks), dtype=torch.int32, pin_memory=pinned), None)
                     for _ in range(2)]
        self._turn = 0
        self.input_ids, self.positions, self.slot_mapping = self.longs[:3]
        self.seq_lens, self.block_tables = self.ints[:largest], self.ints[largest:].view(largest, max_blocks)
        self.slot_mapping.fill_(-1)  # (the captures write no KV)
        self.seq_lens.fill_(1)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)  # one token each
        self.decode_seqs = torch.arange(largest, dtype=torch.int32, device=device)
        self.no_prefills = torch.zeros(0, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def valid_for(self, model, kv_caches: list) -> bool:
        """Whether these graphs were captured over this model's weights and this KV cache."""
        return model is self.model and kv_caches is self.kv_caches

    def _metadata(self, size: int) -> AttentionMetadata:
        host = SequenceSplit([1] * size, list(range(size + 1)), list(range(size)), [])  # (not read on CUDA)
        launch = PagedAttentionLaunch(decode_seqs=self.decode_seqs[:size], prefill_seqs=self.no_prefills,
                                      max_query_len=0, max_decode_seq_len=self.max_model_len,
                                      decode_partition_size=graph_partition_size(self.max_model_len))
        return AttentionMetadata(num_decodes=size, num_prefills=0, num_decode_tokens=size, max_query_len=1,
                                 max_seq_len=self.max_model_len, block_size=self.block_size, host=host,
                                 slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
                                 seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[: size + 1],
                                 plan=launch)

    def _forward(self, size: int, attention: AttentionMetadata) -> torch.Tensor:
        return self.model.forward(self.input_ids[:size], self.positions[:size], self.kv_caches, attention)

    @torch.inference_mode()
    def _capture(self) -> None:
        if self.model.device.type != "cuda":  # (tests: Triton's interpreter on the CPU)
            for size in self.sizes:
                self.graphs[size] = _RerunAsReplay(self, size)
            return
        pool = torch.cuda.graph_pool_handle()
        # The garbage collector must not run during a capture: it would destroy graphs that
        # earlier engines of this process left in reference cycles, and a graph's destruction
        # is a CUDA call a capture forbids (it invalidates the capture). Collect first, then hold it.
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for size in reversed(self.sizes):  # the largest first: the smaller ones reuse its pool
                attention = self._metadata(size)
                self._forward(size, attention)  # compiles this size's kernels outside the capture
                torch.cuda.synchronize(self.model.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size, attention)
                self.graphs[size] = graph
        finally:
            if was_enabled:
                gc.enable()
        torch.cuda.synchronize(self.model.device)

    def stage(self, step: StepInputs, previous_sampled: torch.Tensor | None) -> StagedDecode | None:
        """Puts a step's inputs in the buffers (one token per sequence), or None where no
        graph takes the step: not all decodes, or too many. A pending token (asynchronous
        steps) is copied into the input ids on the device from the previous step's samples."""
        count = step.num_seqs
        if step.num_tokens != count or count > self.sizes[-1]:
            return None
        size = next(size for size in self.sizes if size >= count)
        host_longs, host_ints, event = self.host[self._turn]
        if event is not None:
            event.synchronize()  # (this half's copies, two steps ago, are done)
        longs, ints = host_longs.numpy(), host_ints.numpy()
        longs[0, :count], longs[1, :count], longs[2, :count] = step.input_ids, step.positions, step.slot_mapping
        longs[2, count:size] = -1  # padding rows: no KV written, one cached token read
        num_pending = len(step.pending_dst)
        longs[3, :num_pending], longs[4, :num_pending] = step.pending_dst, step.pending_src
        largest = self.sizes[-1]
        ints[:count], ints[count:size] = step.seq_lens, 1
        tables = ints[largest:].reshape(largest, self.max_blocks)
        tables[:count, : step.block_tables.shape[1]] = step.block_tables
        # (whole buffers, contiguous: a strided copy would go through pageable memory)
        self.longs.copy_(host_longs, non_blocking=True)
        end = largest + size * self.max_blocks
        self.ints[:end].copy_(host_ints[:end], non_blocking=True)
        if self.longs.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.host[self._turn] = (host_longs, host_ints, event)
        self._turn ^= 1
        if num_pending:
            if previous_sampled is None:
                raise RuntimeError("a step takes tokens the step before it sampled, and that step is gone")
            self.input_ids.index_copy_(0, self.longs[3, :num_pending],
                                       previous_sampled.index_select(0, self.longs[4, :num_pending]))
        return StagedDecode(count, size)

    def replay(self, step: StagedDecode) -> torch.Tensor:
        """The staged step's hidden states [num_decodes, hidden]."""
        self.graphs[step.size].replay()
        return self.outputs[step.size][: step.num_decodes]


class _RerunAsReplay:
    """A graph's stand-in off CUDA, so the CPU's tests check everything around the capture
    (the persistent buffers, the padding, the launch with max_model_len's splits): a replay
    runs the same forward over the same buffers into the same output tensor."""

    def __init__(self, graphs: CudaGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size
        self.attention = graphs._metadata(size)
        graphs.outputs[size] = graphs._forward(size, self.attention)

    def replay(self) -> None:
        self.graphs.outputs[self.size].copy_(self.graphs._forward(self.size, self.attention))


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
        self.captured: CudaGraphs | None = None
        self.prepare()

    def prepare(self) -> None:
        """Captures the graphs now (start-up), if they apply and the KV cache exists."""
        runner = self.runner
        if self.sizes and runner.kv_caches and not (self.captured and self.captured.valid_for(runner.model,
                                                                                              runner.kv_caches)):
            self.captured = None  # (its pool and buffers go before the new ones are made)
            self.captured = CudaGraphs(runner.model, runner.kv_caches, self.sizes,
                                       runner.engine.scheduler.max_model_len, runner.block_size)

    def drop(self) -> None:
        """Lets the graphs, their memory and their hold on the KV cache go (sleep)."""
        self.captured = None

    def stage(self, step: StepInputs, lora, previous_sampled: torch.Tensor | None) -> StagedDecode | None:
        """A graph's step with these inputs staged, or None: the step runs eagerly (lora:
        the step's adapters, which no graph runs)."""
        if not self.sizes or lora is not None or step.num_tokens != step.num_seqs:
            return None
        self.prepare()
        return None if self.captured is None else self.captured.stage(step, previous_sampled)

    def forward(self, attention: AttentionMetadata | StagedDecode) -> torch.Tensor | None:
        """A staged step's hidden states from its graph, or None: the step runs eagerly."""
        return self.captured.replay(attention) if isinstance(attention, StagedDecode) else None
