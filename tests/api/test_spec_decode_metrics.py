"""Speculative decoding's counters on /metrics under vLLM's names, from the scheduler's
stats (no server: ServerMetrics renders what GetStats would answer)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from actors.engine.args import EngineArgs
from api.metrics import ServerMetrics


def test_spec_decode_counters_and_accepted_tokens_per_position(tiny_llama_dir):
    config = EngineArgs(tiny_llama_dir, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}').build()
    metrics = ServerMetrics("tiny", config)
    stats = {"spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 8, "spec_decode_num_accepted_tokens": 5,
             "spec_decode_num_accepted_tokens_pos_0": 3, "spec_decode_num_accepted_tokens_pos_1": 2}
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(stats).decode())}
    values = {name: families[name].samples[0].value for name in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")}
    assert values == {"vllm:spec_decode_num_drafts": 4, "vllm:spec_decode_num_draft_tokens": 8,
                      "vllm:spec_decode_num_accepted_tokens": 5}
    per_position = families["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_position.type == "counter"
    assert {s.labels["position"]: s.value for s in per_position.samples if s.name.endswith("_total")} == \
        {"0": 3, "1": 2}
    assert all(s.labels["model_name"] == "tiny" and s.labels["engine"] == "0" for s in per_position.samples)
    # without speculation there is nothing to report
    assert "vllm:spec_decode_num_drafts" not in metrics.render({"num_running": 0}).decode()
