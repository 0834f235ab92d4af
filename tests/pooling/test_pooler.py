"""The Pooler across chunked prefill, and the finishing steps (Matryoshka truncation,
normalisation, activations), against direct torch computations."""

from __future__ import annotations

import pytest
import torch

from actors.config.pooler import PoolerConfig, check_dimensions
from actors.pooling.pooler import Pooler, PoolingSpan, finish_embedding, finish_logits

HIDDEN = 8
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")


def expected_output(prompt_hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"LAST": prompt_hidden[-1], "CLS": prompt_hidden[0], "MEAN": prompt_hidden.float().mean(0),
            "ALL": prompt_hidden}[pooling_type].float()


def run_in_chunks(pooler: Pooler, prompts: dict[str, torch.Tensor], pooling_types: dict[str, str],
                  num_chunks: int) -> dict[str, torch.Tensor]:
    """Feeds each prompt's rows in num_chunks steps; every step's flat batch starts with one
    unrelated decode row and puts the requests back to back after it."""
    outputs: dict[str, torch.Tensor] = {}
    chunk_bounds = {rid: torch.linspace(0, len(h), num_chunks + 1).round().long().tolist()
                    for rid, h in prompts.items()}
    for step in range(num_chunks):
        rows = [torch.randn(1, HIDDEN, dtype=next(iter(prompts.values())).dtype)]  # a decode token
        spans = []
        for rid, prompt_hidden in prompts.items():
            start, end = chunk_bounds[rid][step], chunk_bounds[rid][step + 1]
            if start == end:
                continue  # a prompt shorter than num_chunks skips some steps
            spans.append(PoolingSpan(rid, sum(len(r) for r in rows), end - start, pooling_types[rid],
                                     is_first=start == 0, is_last=end == len(prompt_hidden)))
            rows.append(prompt_hidden[start:end])
        step_outputs = pooler.pool(torch.cat(rows), spans)
        assert set(step_outputs) == {span.request_id for span in spans if span.is_last}
        outputs.update(step_outputs)
    return outputs


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_chunked_pooling_equals_pooling_whole_prompts(num_chunks: int) -> None:
    torch.manual_seed(0)
    # two requests of every type, of 10 and 3 tokens: a 3-token prompt in 3 chunks is a row each
    prompts, pooling_types = {}, {}
    for pooling_type in POOLING_TYPES:
        for prompt_len in (10, 3):
            rid = f"{pooling_type}-{prompt_len}"
            prompts[rid], pooling_types[rid] = torch.randn(prompt_len, HIDDEN), pooling_type
    pooler = Pooler()
    outputs = run_in_chunks(pooler, prompts, pooling_types, num_chunks)
    assert set(outputs) == set(prompts)
    for rid, prompt_hidden in prompts.items():
        expected = expected_output(prompt_hidden, pooling_types[rid])
        assert outputs[rid].dtype == torch.float32 and outputs[rid].shape == expected.shape, rid
        torch.testing.assert_close(outputs[rid], expected, rtol=1e-6, atol=1e-6)
    assert pooler.states == {}  # nothing kept once every prompt ended


def test_mean_of_bf16_rows_sums_in_fp32_across_chunks() -> None:
    torch.manual_seed(1)
    prompt_hidden = torch.randn(300, HIDDEN).to(torch.bfloat16) + 100  # bf16 sums would lose the noise
    outputs = run_in_chunks(Pooler(), {"r": prompt_hidden}, {"r": "MEAN"}, num_chunks=3)
    torch.testing.assert_close(outputs["r"], prompt_hidden.float().mean(0), rtol=1e-6, atol=1e-5)


def test_mean_over_a_batch_the_spans_tile_equals_per_request_means() -> None:
    torch.manual_seed(2)
    # all-MEAN step with no other rows: the path that sums without gathering
    lens = [4, 1, 7]
    hidden = torch.randn(sum(lens), HIDDEN)
    starts = [0, 4, 5]
    spans = [PoolingSpan(f"r{i}", s, n, "MEAN", True, True) for i, (s, n) in enumerate(zip(starts, lens))]
    outputs = Pooler().pool(hidden, spans)
    for span in spans:
        torch.testing.assert_close(outputs[span.request_id],
                                   hidden[span.start_row:span.start_row + span.num_rows].mean(0))


def test_spans_out_of_row_order_pool_their_own_rows() -> None:
    hidden = torch.arange(6 * HIDDEN, dtype=torch.float32).view(6, HIDDEN)
    spans = [PoolingSpan("b", 3, 3, "MEAN", True, True), PoolingSpan("a", 0, 2, "MEAN", True, True)]
    outputs = Pooler().pool(hidden, spans)
    torch.testing.assert_close(outputs["a"], hidden[0:2].mean(0))
    torch.testing.assert_close(outputs["b"], hidden[3:6].mean(0))


def test_a_first_chunk_restarts_a_preempted_request() -> None:
    pooler = Pooler()
    stale = torch.full((2, HIDDEN), 100.0)
    pooler.pool(stale, [PoolingSpan("r", 0, 2, "MEAN", is_first=True, is_last=False)])
    assert "r" in pooler.states
    # preempted and recomputed from token 0: the stale rows must not count
    fresh = torch.ones(3, HIDDEN)
    outputs = pooler.pool(fresh, [PoolingSpan("r", 0, 3, "MEAN", is_first=True, is_last=True)])
    torch.testing.assert_close(outputs["r"], torch.ones(HIDDEN))


def test_discard_forgets_a_request_and_kept_rows_survive_buffer_reuse() -> None:
    pooler = Pooler()
    buffer = torch.ones(2, HIDDEN)
    pooler.pool(buffer, [PoolingSpan("all", 0, 1, "ALL", True, False), PoolingSpan("gone", 1, 1, "CLS", True, False)])
    buffer.fill_(7.0)  # the runner reuses its hidden buffer for the next step
    pooler.discard("gone")
    assert set(pooler.states) == {"all"}
    outputs = pooler.pool(buffer[:1], [PoolingSpan("all", 0, 1, "ALL", False, True)])
    torch.testing.assert_close(outputs["all"], torch.tensor([[1.0] * HIDDEN, [7.0] * HIDDEN]))


def test_matryoshka_truncates_then_normalises() -> None:
    vector = torch.tensor([3.0, 4.0, 12.0])
    torch.testing.assert_close(finish_embedding(vector, normalize=True, dimensions=2), torch.tensor([0.6, 0.8]))
    torch.testing.assert_close(finish_embedding(vector, normalize=True), vector / 13)
    torch.testing.assert_close(finish_embedding(vector, normalize=False, dimensions=1), torch.tensor([3.0]))
    # an ALL output: every token row a unit vector
    rows = finish_embedding(torch.randn(5, HIDDEN), normalize=True)
    torch.testing.assert_close(rows.norm(dim=-1), torch.ones(5))


def test_activations_turn_logits_into_scores() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, -3.0, 4.0]])
    torch.testing.assert_close(finish_logits(logits, "softmax"), torch.softmax(logits, -1))
    torch.testing.assert_close(finish_logits(logits, "sigmoid"), torch.sigmoid(logits))
    torch.testing.assert_close(finish_logits(logits.bfloat16(), None), logits)


def make_embed_config(is_matryoshka: bool, matryoshka_dimensions: tuple[int, ...] | None) -> PoolerConfig:
    return PoolerConfig(task="embed", pooling_type="MEAN", normalize=True, activation=None, num_labels=None,
                        is_matryoshka=is_matryoshka, matryoshka_dimensions=matryoshka_dimensions)


def test_dimensions_on_a_model_without_matryoshka_is_refused() -> None:
    with pytest.raises(ValueError, match="dimensions"):
        check_dimensions(make_embed_config(False, None), 16)
    check_dimensions(make_embed_config(False, None), None)  # no dimensions asked: fine


def test_dimensions_must_be_one_the_model_was_trained_for() -> None:
    config = make_embed_config(True, (16, 32))
    check_dimensions(config, 16, hidden_size=32)
    for bad in (8, 0):
        with pytest.raises(ValueError, match="dimensions"):
            check_dimensions(config, bad, hidden_size=32)
    any_size = make_embed_config(True, None)
    check_dimensions(any_size, 5, hidden_size=32)
    with pytest.raises(ValueError, match="dimensions must be at most"):
        check_dimensions(any_size, 33, hidden_size=32)
