"""Adapters the engine refuses (before any request runs with them, the engine unharmed),
LoRARequest as vLLM's, and the scheduler's max_loras rule."""

from __future__ import annotations

import json
import os
import shutil

import msgspec
import pytest

from actors import LLM, LoRAAdapterError, LoRARequest, SamplingParams
from actors.config import CacheConfig, EngineConfig, SchedulerConfig
from actors.lora.adapter_files import WEIGHTS_FILE
from actors.scheduler import Scheduler
from api.metrics import ServerMetrics
from messages.scheduler import TokenizedRequest
from tests.scheduler.scheduler_harness import FakeWorker, make_params
from tests.lora_adapters import build_lora_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LLM_CONFIG = EngineConfig(model=None, cache=CacheConfig(), scheduler=SchedulerConfig())


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def good_adapter(tiny_llama_dir, tmp_path_factory) -> str:
    return build_lora_adapter(tiny_llama_dir, str(tmp_path_factory.mktemp("good")), rank=8)


def broken_copy(good: str, tmp_path, change) -> str:
    target = str(tmp_path / "broken")
    shutil.copytree(good, target)
    change(target)
    return target


def truncate_weights(path: str) -> None:
    weights = os.path.join(path, WEIGHTS_FILE)
    with open(weights, "r+b") as file:
        file.truncate(os.path.getsize(weights) - 64)


def edit_config(**fields):
    def change(path: str) -> None:
        config_path = os.path.join(path, "adapter_config.json")
        with open(config_path) as file:
            config = json.load(file)
        config.update(fields)
        with open(config_path, "w") as file:
            json.dump(config, file)
    return change


@pytest.mark.parametrize("change, message", [
    (lambda p: shutil.rmtree(p), "no such directory"),
    (lambda p: os.remove(os.path.join(p, "adapter_config.json")), "adapter_config.json is missing"),
    (lambda p: os.rename(os.path.join(p, WEIGHTS_FILE), os.path.join(p, "adapter_model.bin")),
     "only the safetensors format"),
    (truncate_weights, "truncated"),
    (edit_config(use_dora=True), "DoRA is not supported"),
    (edit_config(peft_type="PREFIX_TUNING"), "only LORA adapters"),
    (lambda p: open(os.path.join(p, "adapter_config.json"), "w").write("{not json"), "not readable JSON"),
])
def test_broken_adapter_files_are_refused_before_running(llm, good_adapter, tmp_path, change, message):
    lora = LoRARequest("broken", 50, broken_copy(good_adapter, tmp_path, change))
    with pytest.raises(LoRAAdapterError, match=message) as error:
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=lora)
    assert error.value.param == "lora_request" and "'broken'" in str(error.value)
    assert not llm.engine.has_unfinished()
    # the engine is unharmed: the good adapter and the base model still run
    assert len(llm.generate([[5, 6, 7]] * 2, GREEDY, use_tqdm=False,
                            lora_request=[LoRARequest("good", 1, good_adapter), None])) == 2


@pytest.mark.parametrize("make, message", [
    (lambda model, out: build_lora_adapter(model, out, rank=32), "rank 32, over the engine's max_lora_rank of 16"),
    (lambda model, out: build_lora_adapter(model, out, target_modules=["embed_tokens"]), "not a LoRA A/B weight"),
    (lambda model, out: build_lora_adapter(model, out, target_modules=["lm_head"]), "not a LoRA A/B weight"),
])
def test_adapters_the_engine_cannot_run_are_refused(llm, tiny_llama_dir, tmp_path, make, message):
    lora = LoRARequest("bad", 51, make(tiny_llama_dir, str(tmp_path / "bad")))
    with pytest.raises(LoRAAdapterError, match=message):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=lora)


def test_an_adapter_of_another_model_shape_is_refused(llm, make_tiny_model, tmp_path):
    other = make_tiny_model("llama", hidden_size=96, intermediate_size=160)
    lora = LoRARequest("other", 52, build_lora_adapter(other, str(tmp_path / "other"), rank=8))
    with pytest.raises(LoRAAdapterError, match=r"q_proj has lora_A \[8, 96\] .* needs \[r, 64\]"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=lora)


def test_an_engine_without_lora_refuses_adapters(tiny_llama_dir, good_adapter):
    plain = LLM(tiny_llama_dir, kv_cache_memory="16MiB")
    with pytest.raises(LoRAAdapterError, match="enable_lora"):
        plain.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("good", 1, good_adapter))
    assert plain.engine.runner.lora_slots is None


def test_lora_request_is_vllms():
    positional, keywords = LoRARequest("a", 3, "/x"), LoRARequest(lora_name="a", lora_int_id=3, lora_path="/x")
    assert positional == keywords and (keywords.name, keywords.adapter_id, keywords.path) == ("a", 3, "/x")
    encoded = msgspec.msgpack.encode(TokenizedRequest(request_id="r", prompt_token_ids=[1], params=make_params(),
                                                      lora_request=keywords))
    assert msgspec.msgpack.decode(encoded, type=TokenizedRequest).lora_request == keywords
    for bad in (dict(lora_name="", lora_int_id=1, lora_path="/x"), dict(lora_name="a", lora_int_id=0, lora_path="/x"),
                dict(lora_name="a", lora_int_id=True, lora_path="/x"), dict(lora_name="a", lora_int_id=1)):
        with pytest.raises(LoRAAdapterError):
            LoRARequest(**bad)


def lora(index: int) -> LoRARequest:
    return LoRARequest(f"adapter{index}", index, f"/adapters/{index}")


def admitted_loras(plan) -> list[int | None]:
    return [new.lora_request.lora_int_id if new.lora_request else None for new in plan.new_requests]


def test_scheduler_mixes_at_most_max_loras_adapters_in_a_step():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, async_scheduling=False),
                          CacheConfig(block_size=4), num_blocks=256, eos_token_ids=(2,), max_loras=2)
    for index, adapter in enumerate([1, 2, 3, None, 1, 3, 2]):
        scheduler.add_request(f"r{index}", [5, 6, 7], make_params(max_tokens=3),
                              lora_request=lora(adapter) if adapter else None)
    plan = scheduler.schedule()
    assert admitted_loras(plan) == [1, 2, None, 1, 2]  # 3 waits: two adapters are running
    stats = scheduler.stats()
    assert (stats["max_lora"], stats["running_lora_adapters"], stats["waiting_lora_adapters"]) == \
        (2, "adapter1,adapter2", "adapter3")
    metrics = ServerMetrics("tiny", LLM_CONFIG).render(stats).decode()
    assert ('vllm:lora_requests_info{max_lora="2",running_lora_adapters="adapter1,adapter2",'
            'waiting_lora_adapters="adapter3"}') in metrics
    worker = FakeWorker(4, 256)
    seen = []
    while scheduler.has_unfinished():
        running = {seq.lora_request.lora_int_id for seq in scheduler.running if seq.lora_request}
        assert len(running) <= 2
        seen += admitted_loras(plan)
        scheduler.update(plan, worker.step(plan))
        plan = scheduler.schedule()
    assert sorted(seen, key=str) == sorted([1, 2, None, 1, 2, 3, 3], key=str)


def test_a_request_held_back_for_a_slot_is_overtaken_at_most_max_num_seqs_times():
    # one slot; adapter 1's requests keep coming: the one for adapter 2 must still run
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=256, async_scheduling=False),
                          CacheConfig(block_size=4), num_blocks=256, eos_token_ids=(2,), max_loras=1)
    worker = FakeWorker(4, 256)
    scheduler.add_request("first", [5, 6, 7], make_params(max_tokens=2), lora_request=lora(1))
    scheduler.add_request("other", [5, 6, 7], make_params(max_tokens=2), lora_request=lora(2))
    admitted, step = [], 0
    while scheduler.has_request("other"):
        scheduler.add_request(f"more{step}", [5, 6, 7], make_params(max_tokens=2), lora_request=lora(1))
        plan = scheduler.schedule()
        admitted += [new.request_id for new in plan.new_requests]
        scheduler.update(plan, worker.step(plan))
        step += 1
        assert step < 50, "the request for adapter 2 starved"
    assert admitted.index("other") <= 1 + 3  # after at most max_num_seqs overtakers
