"""The decode graphs' machinery (actors/worker/cuda_graphs.py) on the CPU, under triton's
interpreter, with each replay standing in as a rerun over the same buffers: persistent
inputs, the padding rows (no KV written, one key read), and decode attention launched
with max_model_len's splits give the eager step's output, and the same KV cache. On CUDA
the real graphs are checked end to end by tests/gpu."""

from __future__ import annotations

import pytest
import torch

from actors.config import ModelConfig
from actors.worker.attention import TritonBackend
from actors.worker.attention_metadata import AttentionMetadata
from actors.worker.cuda_graphs import CudaGraphs, graph_partition_size
from actors.worker.model import LlamaModel
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


def replayed(graphs: CudaGraphs, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """The decode step of seqs (one new token each) through the graphs: staged, replayed."""
    slots = [blocks[done // BLOCK] * BLOCK + done % BLOCK for blocks, done, _ in seqs]
    staged = graphs.stage([new[0] for _, _, new in seqs], [done for _, done, _ in seqs], slots,
                          [done + 1 for _, done, _ in seqs], [blocks for blocks, _, _ in seqs])
    return graphs.replay(staged)


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
    # a prefill runs eagerly: no graph takes it
    assert graphs.stage(prompts[0], list(range(lengths[0])), [0] * lengths[0], [lengths[0]], [blocks[0]]) is None
