"""The decode graphs' machinery (actors/worker/cuda_graphs.py) on the CPU, under triton's
interpreter, with each replay standing in as a rerun over the same buffers: persistent
inputs, the padding rows (no KV written, one key read), and decode attention launched
with max_model_len's splits give the eager step's output, and the same KV cache. On CUDA
the real graphs are checked end to end by tests/gpu."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.config import ModelConfig
from actors.layers.attention import TritonBackend
from actors.layers.attention_metadata import AttentionMetadata
from actors.worker.cuda_graphs import CudaGraphs, graph_partition_size
from actors.models.llama import LlamaModel
from actors.worker.step_inputs import BlockTables, StepInputs, build
from tests.kernels.helpers import requires_triton

BLOCK = 16
MAX_MODEL_LEN = 2048  # four splits of 512 keys in the graphs, fewer in the eager steps


def tiny_model(qk_norm: bool = False) -> LlamaModel:
    """A tiny fp32 Llama, or with qk_norm a Qwen3 (its q/k norms run in the fused rotary_store_kv)."""
    config = ModelConfig(model_path="", architecture="Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM",
                         vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096,
                         tie_word_embeddings=False, attention_bias=False, qk_norm=qk_norm, eos_token_ids=(0,))
    model = LlamaModel(config, torch.float32, torch.device("cpu"), TritonBackend())
    model.init_dummy_weights(seed=3)
    return model


def step(model: LlamaModel, seqs: list[tuple[list[int], int, list[int]]]):
    """Flat inputs and attention metadata of one step: (block ids, tokens computed before, new tokens) per sequence."""
    ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
    for blocks, done, new in seqs:
        ids += new
        positions += range(done, done + len(new))
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(done, done + len(new))]
        seq_lens.append(done + len(new))
        starts.append(starts[-1] + len(new))
    width = max(len(blocks) for blocks, _, _ in seqs)
    tables = [blocks + [0] * (width - len(blocks)) for blocks, _, _ in seqs]
    attention = AttentionMetadata.build(seq_lens, starts, tables, slots, BLOCK, torch.device("cpu"))
    model.backend.prepare(attention, torch.float32)
    return torch.tensor(ids), torch.tensor(positions), attention


def step_inputs(seqs: list[tuple[list[int], int, list[int]]]) -> StepInputs:
    """The model runner's host inputs of one step: (block ids, tokens computed before, new tokens) per sequence."""
    tables = BlockTables()
    rows = np.array([tables.add(blocks) for blocks, _, _ in seqs], np.int64)
    computed = np.array([done for _, done, _ in seqs], np.int64)
    counts = np.array([len(new) for _, _, new in seqs], np.int64)
    return build(computed, counts, rows, tables, BLOCK, [new[0] if len(new) == 1 else new for _, _, new in seqs],
                 [], [])


def replayed(graphs: CudaGraphs, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """The decode step of seqs (one new token each) through the graphs: staged, replayed."""
    return graphs.replay(graphs.stage(step_inputs(seqs), None))


@requires_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's stand-in; tests/gpu replays the real graphs")
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
@torch.inference_mode()  # (as the model runner's steps run)
def test_replayed_decodes_equal_eager_ones_with_padding_and_long_sequences(qk_norm):
    torch.manual_seed(0)
    model = tiny_model(qk_norm)
    caches = [(torch.zeros(120, 2, BLOCK, 16), torch.zeros(120, 2, BLOCK, 16)) for _ in range(2)]
    lengths = [5, 600, 40, 20]  # 600: two splits eagerly, four in the graphs
    blocks, first = [], 0
    for length in lengths:
        count = -(-(length + 1) // BLOCK)
        blocks.append(list(range(first + 1, first + 1 + count)))  # (block 0 is where padding rows read)
        first += count
    prompts = [torch.randint(3, 300, (length,)).tolist() for length in lengths]
    ids, positions, attention = step(model, [(b, 0, p) for b, p in zip(blocks, prompts)])
    model.forward(ids, positions, caches, attention)  # the prompts' keys and values
    graphs = CudaGraphs(model, caches, (1, 2, 4), MAX_MODEL_LEN, BLOCK)
    assert graph_partition_size(MAX_MODEL_LEN) == 512 and graph_partition_size(131072) == 4096
    decode = [(b, length, [7 + i]) for i, (b, length) in enumerate(zip(blocks, lengths))]
    before = [(k.clone(), v.clone()) for k, v in caches]

    def restore() -> None:
        for (k, v), (k0, v0) in zip(caches, before):
            k.copy_(k0)
            v.copy_(v0)

    full = step(model, decode)  # four decodes: the graph of four, no padding (its buffers now hold them)
    torch.testing.assert_close(replayed(graphs, decode), model.forward(*full[:2], caches, full[2]), rtol=1e-4,
                               atol=1e-5)
    restore()
    ids, positions, attention = step(model, decode[:3])
    eager = model.forward(ids, positions, caches, attention)
    eager_caches = [(k.clone(), v.clone()) for k, v in caches]
    restore()
    three = replayed(graphs, decode[:3])  # three decodes in the graph of four
    assert three.shape == eager.shape
    # (the graph's linears run four rows, the eager step's three: a BLAS may round a row
    # differently at another row count, as MKL does on AVX2 CPUs)
    torch.testing.assert_close(three, eager, rtol=1e-4, atol=1e-5)
    written = torch.zeros(caches[0][0].shape[0] * BLOCK, dtype=torch.bool)  # the three decodes' slots
    for blocks_of, done, _ in decode[:3]:
        written[blocks_of[done // BLOCK] * BLOCK + done % BLOCK] = True
    for (k, v), (k1, v1), (k0, v0) in zip(caches, eager_caches, before):
        for cache, eager_cache, old in ((k, k1, k0), (v, v1, v0)):
            slots, eager_slots, old_slots = (c.transpose(1, 2).reshape(-1, c.shape[1], c.shape[3])
                                             for c in (cache, eager_cache, old))
            torch.testing.assert_close(slots[written], eager_slots[written], rtol=1e-4, atol=1e-5)
            # the padding row wrote nothing (its stale slot neither): every other slot as before
            assert torch.equal(slots[~written], old_slots[~written])
    # a batch of one takes the graph of one, over the same buffers
    torch.testing.assert_close(replayed(graphs, decode[1:2]), eager[1:2], rtol=1e-4, atol=1e-5)
    # sequences of at most 512 keys take the graph of one split (no reduction)
    short = [decode[0], decode[2]]
    restore()
    ids, positions, attention = step(model, short)
    eager_short = model.forward(ids, positions, caches, attention)
    restore()
    staged = graphs.stage(step_inputs(short), None)
    assert staged.key == ("decode-short", 2)
    torch.testing.assert_close(graphs.replay(staged), eager_short, rtol=1e-4, atol=1e-5)
    # a prefill runs eagerly: no graph takes it
    assert graphs.stage(step_inputs([(blocks[0], 0, prompts[0])]), None) is None


@requires_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's stand-in; tests/gpu replays the real graphs")
@pytest.mark.parametrize("max_num_seqs", [6, 5], ids=["room-to-spare", "a-full-batch"])
@torch.inference_mode()
def test_a_mixed_step_of_prefill_chunks_and_decodes_replays_as_it_runs_eagerly(max_num_seqs):
    """A mixed graph: decodes and prefill chunks (one fresh, one after cached tokens) padded to
    the graph's token count, its decode and prefill lists padded with the dummy sequence; with
    max_num_seqs sequences too, where the last one's query end shares its place in the offsets
    with the dummy's start (on an H100 that end was overwritten with the dummy's 0, and a full
    batch's last prefill chunk came out wrong)."""
    torch.manual_seed(1)
    model = tiny_model()
    caches = [(torch.zeros(120, 2, BLOCK, 16), torch.zeros(120, 2, BLOCK, 16)) for _ in range(2)]
    cached = [5, 600, 40, 0, 20]  # three decodes, then a fresh prompt and a chunk after 20 cached tokens
    new = [1, 1, 1, 11, 7]
    blocks, first = [], 0
    for done, count in zip(cached, new):
        num_blocks = -(-(done + count) // BLOCK)
        blocks.append(list(range(first + 1, first + 1 + num_blocks)))
        first += num_blocks
    histories = [torch.randint(3, 300, (done,)).tolist() for done in cached]
    ids, positions, attention = step(model, [(b, 0, h) for b, h in zip(blocks, histories) if h])
    model.forward(ids, positions, caches, attention)  # the cached tokens' keys and values
    graphs = CudaGraphs(model, caches, (1, 2, 4), MAX_MODEL_LEN, BLOCK, mixed_sizes=(32, 64),
                         max_num_seqs=max_num_seqs)
    seqs = [(b, done, torch.randint(3, 300, (count,)).tolist()) for b, done, count in zip(blocks, cached, new)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    eager = model.forward(*step(model, seqs)[:2], caches, step(model, seqs)[2])
    eager_caches = [(k.clone(), v.clone()) for k, v in caches]
    for (k, v), (k0, v0) in zip(caches, before):
        k.copy_(k0)
        v.copy_(v0)
    inputs = step_inputs(seqs)
    staged = graphs.stage(inputs, None)
    assert staged.key == ("mixed", 32) and staged.num_tokens == 21
    torch.testing.assert_close(graphs.replay(staged), eager, rtol=1e-4, atol=1e-5)
    for (k, v), (k1, v1) in zip(caches, eager_caches):  # the padding rows wrote nothing
        torch.testing.assert_close(k, k1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, v1, rtol=1e-4, atol=1e-5)
    # a step too large for the largest mixed graph, or with more prefill chunks than a graph takes, runs eagerly
    assert graphs.stage(step_inputs([(list(range(1, 6)), 0, list(range(3, 73)))]), None) is None
    many = [(list(range(1 + 2 * i, 3 + 2 * i)), 0, [5, 6]) for i in range(9)]
    assert graphs.stage(step_inputs(many), None) is None


def grouped_step_inputs(seqs: list[tuple[list[list[int]], int, list[int]]]) -> StepInputs:
    """step_inputs with a block table per layer group: (each group's block ids, tokens
    computed before, new tokens) per sequence."""
    tables = BlockTables(groups=len(seqs[0][0]))
    rows = np.array([tables.add([b for group in blocks for b in group]) for blocks, _, _ in seqs], np.int64)
    computed = np.array([done for _, done, _ in seqs], np.int64)
    counts = np.array([len(new) for _, _, new in seqs], np.int64)
    return build(computed, counts, rows, tables, BLOCK, [new[0] if len(new) == 1 else new for _, _, new in seqs],
                 [], [])


@requires_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's stand-in; tests/gpu replays the real graphs")
@torch.inference_mode()
def test_graphs_of_a_model_with_layer_groups_read_each_groups_tables():
    """A windowed layer and a full one, in two KV groups sharing one cache tensor
    (actors/config/kv_groups.py) with blocks of their own: decode and mixed graphs stage every
    group's slots and tables and replay the eager step (which reads them per group)."""
    from actors.worker.step_inputs import Stager

    torch.manual_seed(2)
    model = tiny_model()
    model.sliding_windows = [24, None]  # layer 0 sliding (group 1), layer 1 full (group 0)
    layer_groups = [1, 0]
    shared = (torch.zeros(200, 2, BLOCK, 16), torch.zeros(200, 2, BLOCK, 16))
    caches = [shared, shared]  # one tensor pair: each group's blocks are its own
    cached, new = [5, 300, 40, 0, 20], [1, 1, 1, 11, 7]
    blocks, first = [], 1
    for done, count in zip(cached, new):
        num_blocks = -(-(done + count) // BLOCK)
        blocks.append([list(range(first, first + num_blocks)), list(range(first + 100, first + 100 + num_blocks))])
        first += num_blocks
    stager = Stager(torch.device("cpu"))

    def eager(seqs) -> torch.Tensor:
        step = grouped_step_inputs(seqs)
        staged = stager.stage(step, None)
        attention = AttentionMetadata.staged(step, staged, BLOCK, layer_groups)
        for group in attention.kv_groups:
            model.backend.prepare(group, torch.float32)
        return model.forward(staged.input_ids, staged.positions, caches, attention)

    histories = [torch.randint(3, 300, (done,)).tolist() for done in cached]
    eager([(b, 0, h) for b, h in zip(blocks, histories) if h])  # the cached tokens' keys and values
    graphs = CudaGraphs(model, caches, (1, 2, 4), MAX_MODEL_LEN, BLOCK, mixed_sizes=(32,), max_num_seqs=6,
                        layer_groups=layer_groups)
    assert len(graphs._metadata(("mixed", 32)).groups) == 2
    before = [t.clone() for t in shared]

    def restore() -> None:
        for t, t0 in zip(shared, before):
            t.copy_(t0)

    for seqs in ([(b, done, [7 + i]) for i, (b, done) in enumerate(zip(blocks[:3], cached[:3]))],  # decodes
                 [(b, done, torch.randint(3, 300, (count,)).tolist()) for b, done, count in zip(blocks, cached, new)]):
        expected = eager(seqs)
        expected_cache = [t.clone() for t in shared]
        restore()
        staged = graphs.stage(grouped_step_inputs(seqs), None)
        assert staged is not None
        torch.testing.assert_close(graphs.replay(staged), expected, rtol=1e-4, atol=1e-5)
        for t, t1 in zip(shared, expected_cache):  # each group's new keys in its own blocks
            torch.testing.assert_close(t, t1, rtol=1e-4, atol=1e-5)
        restore()
    # group 1's tables matter: the same step with group 1 pointing at group 0's blocks differs
    swapped = [([b[0], b[0]], done, [7]) for b, done in zip(blocks[:3], cached[:3])]
    restore()
    assert not torch.allclose(graphs.replay(graphs.stage(grouped_step_inputs(swapped), None)),
                              eager([(b, done, [7]) for b, done in zip(blocks[:3], cached[:3])]), atol=1e-3)
