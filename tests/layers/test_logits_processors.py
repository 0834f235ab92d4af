"""Logits processors: vLLM V0's per-request callables (SamplingParams.logits_processors and
LLM.generate(..., logits_processors=...)), greedy requests included; their trip to a
worker process (by qualified name, from the engine's allow-list; a typed error for what
cannot make it; never pickled); and the batch-level seam a new processor (a grammar's
bitmask) plugs into."""

from __future__ import annotations

import asyncio
import sys

import msgspec
import numpy as np
import pytest
import torch

from actors import LLM, AsyncClient
from actors.layers.logits_processors import RequestProcessor
from actors.layers.sampler import default_processors
from actors.layers.sampler import Sampler
from messages.common import InvalidRequestError, SamplingParams
from messages.worker import NewRequest
from tests.models.test_llm_matches_hf import PROMPT_LENGTHS, make_prompts

FORCED = 17


def force_token(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Only FORCED may follow."""
    forced = torch.full_like(logits, float("-inf"))
    forced[FORCED] = 0.0
    return forced


def count_up_from_the_prompt(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The three-argument form: the last prompt token plus the output length, then +1 each step."""
    logits[:] = float("-inf")
    logits[(prompt_ids[-1] + len(output_ids) + 1) % logits.shape[0]] = 0.0
    return logits


class Ban:
    """A class names a processor too: the worker makes one per request."""

    def __init__(self, token_id: int = 3) -> None:
        self.token_id = token_id

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[self.token_id] = float("-inf")
        return logits


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, kv_cache_memory="64MiB", max_num_batched_tokens=256)


def test_a_greedy_request_goes_through_its_processors(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    plain, forced, counted = llm.generate(
        [[5, 6, 7]] * 3, [params, msgspec.structs.replace(params, logits_processors=[force_token]),
                          msgspec.structs.replace(params, logits_processors=[count_up_from_the_prompt])],
        use_tqdm=False)
    assert forced.outputs[0].token_ids == [FORCED] * 5 != plain.outputs[0].token_ids
    assert counted.outputs[0].token_ids == [8, 9, 10, 11, 12]


def test_generate_s_logits_processors_apply_to_every_prompt_after_their_own(llm):
    sampled = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, logits_processors=[Ban(FORCED)])
    outputs = llm.generate([[5, 6, 7], [9, 10]], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                                  sampled], use_tqdm=False, logits_processors=[force_token])
    assert outputs[0].outputs[0].token_ids == [FORCED] * 4
    # its own ban ran first, so the forced token's row is all -inf but FORCED: still FORCED
    assert outputs[1].outputs[0].token_ids == [FORCED] * 4
    again = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert again[0].outputs[0].token_ids != [FORCED] * 4, "a call's processors must not outlive it"


NAMES = ("tests.layers.test_logits_processors:force_token", "tests.layers.test_logits_processors:Ban",
         "tests.layers.test_logits_processors:count_up_from_the_prompt")


def test_processors_travel_by_name_to_a_worker_and_run_there():
    params = SamplingParams(temperature=0.0, logits_processors=[force_token, Ban]).with_named_processors()
    assert params.logits_processors == list(NAMES[:2])
    wire = msgspec.msgpack.encode(NewRequest("r", [5, 6], 2, params, [0], 0))
    arrived = msgspec.msgpack.decode(wire, type=NewRequest).params
    sampler = Sampler((0,), 0, default_processors([0], NAMES))
    sampler.add_request("r", arrived, [5, 6], [])
    assert sampler.sample(torch.randn(1, 50), ["r"])[0] == [FORCED]


def test_a_worker_runs_no_name_outside_its_allow_list():
    sampler = Sampler((0,), 0, default_processors([0], NAMES[1:]))  # force_token not allowed
    params = SamplingParams(temperature=0.0, logits_processors=[NAMES[0]])
    sampler.add_request("r", params, [5, 6], [])
    logits = torch.zeros(1, 50)
    logits[0, 4] = 1.0
    assert sampler.sample(logits, ["r"])[0] == [4]


class Explodes:
    """What a pickled processor could run on the worker: here, a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickled_processor_is_refused_at_decode_never_run(tmp_path):
    import pickle

    marker = tmp_path / "ran"
    # a plan as an old (or forged) sender writes it: SamplingParams with the pickled bytes
    fields = msgspec.to_builtins(SamplingParams(temperature=0.0))
    fields["logits_processors"] = [pickle.dumps(Explodes(str(marker)))]
    wire = msgspec.msgpack.encode([["r", [5, 6], 2, fields, [0], 0]])
    with pytest.raises(msgspec.ValidationError, match="logits_processors"):
        msgspec.msgpack.decode(wire, type=list[NewRequest])
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(logits_processors=[pickle.dumps(force_token)])
    assert raised.value.param == "logits_processors"
    assert not marker.exists()


def local_function():
    def keep(output_ids, logits):
        return logits
    return keep


@pytest.mark.parametrize("function", [lambda output, row: row, local_function(), Ban(3)])
def test_what_cannot_reach_a_worker_process_is_a_typed_error(function):
    params = SamplingParams(logits_processors=[function])  # fine in this process
    with pytest.raises(InvalidRequestError) as raised:
        params.with_named_processors()
    assert raised.value.param == "logits_processors"


def test_a_function_of_the_main_script_is_refused_for_a_worker_process(monkeypatch):
    def in_main(output_ids, logits):
        return logits

    in_main.__module__, in_main.__qualname__ = "__main__", "in_main"
    monkeypatch.setattr(sys.modules["__main__"], "in_main", in_main, raising=False)
    with pytest.raises(InvalidRequestError, match="__main__"):
        SamplingParams(logits_processors=[in_main]).with_named_processors()


@pytest.mark.parametrize("entry", [42, "no_module", "os:path:join"])
def test_a_processor_that_is_neither_callable_nor_a_name_is_refused(entry):
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(logits_processors=[entry])
    assert raised.value.param == "logits_processors"


class EvenTokensOnly(RequestProcessor):
    """A batch-level processor in a few lines (as a grammar's bitmask will be): the
    requests with seed 2 may only sample even token ids."""

    def needs(self, params: SamplingParams) -> bool:
        return params.seed == 2

    def apply(self, logits: torch.Tensor, rows) -> None:
        concerned = torch.tensor(rows.where(self.flags), dtype=torch.long, device=logits.device)
        logits[concerned.unsqueeze(1), torch.arange(1, logits.shape[1], 2, device=logits.device)] = float("-inf")


def test_a_new_batch_processor_plugs_into_the_sampler():
    sampler = Sampler((0,), seed=0)
    sampler.processors.append(EvenTokensOnly())
    for key, seed in enumerate([2, None, 2, 5]):
        sampler.add_request(key, SamplingParams(temperature=1.0, seed=seed), [1], [])
    logits = torch.zeros(4, 40)
    logits[:, 1::2] = 5.0  # odd tokens are far likelier
    draws = np.array([sampler.sample(logits, [0, 1, 2, 3])[0] for _ in range(30)])
    assert (draws[:, [0, 2]] % 2 == 0).all() and (draws[:, [1, 3]] % 2 == 1).mean() > 0.9
    sampler.remove_request(0)
    sampler.remove_request(2)
    assert not sampler.processors[-1].wants(sampler.batch.rows([1, 3], logits.device))


def test_processor_state_survives_preemption_in_the_engine(tiny_llama_dir):
    """Penalties, min_tokens, bad words, seeds and a custom processor read each request's
    own output: recomputed after preemption (the request leaves the sampler and joins
    again with its output), they give the tokens of a run with room for everything."""
    roomy = LLM(tiny_llama_dir, kv_cache_memory="64MiB")
    prompts = make_prompts(roomy.config.model.vocab_size, PROMPT_LENGTHS, seed=3)
    kinds = [SamplingParams(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.8, frequency_penalty=0.5),
             SamplingParams(temperature=1.0, seed=5, frequency_penalty=1.0, min_tokens=10),
             SamplingParams(temperature=0.8, seed=6, top_p=0.9, bad_words_token_ids=[[7], [8, 9]]),
             SamplingParams(temperature=0.0, logits_processors=[count_up_from_the_prompt])]
    params = [msgspec.structs.replace(kinds[i % len(kinds)], max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_llama_dir, max_num_batched_tokens=16, block_size=4, num_kv_blocks=40)
    outputs = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.scheduler.stats()["num_preemptions"] > 0
    assert outputs == expected


def test_processors_reach_the_workers_of_a_tensor_parallel_engine(tiny_llama_dir):
    with LLM(tiny_llama_dir, kv_cache_memory="64MiB", tensor_parallel_size=2,
             logits_processors=[Ban, "tests.layers.test_logits_processors.count_up_from_the_prompt"]) as llm:
        greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        forced, counted = llm.generate([[5, 6, 7], [9, 10]], [msgspec.structs.replace(greedy, logits_processors=[Ban]),
                                                              greedy], use_tqdm=False,
                                       logits_processors=[count_up_from_the_prompt])
        assert forced.outputs[0].token_ids == [8, 9, 10, 11] and counted.outputs[0].token_ids == [11, 12, 13, 14]
        with pytest.raises(InvalidRequestError, match="logits_processors"):
            llm.generate([[5, 6]], greedy, use_tqdm=False, logits_processors=[lambda output, row: row])
        with pytest.raises(InvalidRequestError, match="not allowed"):  # importable, but not on the allow-list
            llm.generate([[5, 6]], greedy, use_tqdm=False, logits_processors=[force_token])


@pytest.mark.asyncio
async def test_async_client_sends_processors_to_its_worker_process(tiny_llama_dir):
    async with AsyncClient(tiny_llama_dir, kv_cache_memory="64MiB", logits_processors=[force_token]) as client:
        greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        output = await asyncio.wait_for(
            client.generate([5, 6, 7], msgspec.structs.replace(greedy, logits_processors=[force_token])), 60)
        assert output.outputs[0].token_ids == [FORCED] * 3
        by_name = await asyncio.wait_for(client.generate([5, 6, 7], msgspec.structs.replace(
            greedy, logits_processors=["tests.layers.test_logits_processors.force_token"])), 60)
        assert by_name.outputs[0].token_ids == [FORCED] * 3
        for refused in ([lambda output, row: row], ["os:system"], [Ban]):
            with pytest.raises(InvalidRequestError, match="logits_processors"):
                await client.generate([5, 6], msgspec.structs.replace(greedy, logits_processors=refused))
        assert client.num_unfinished_requests == 0


def test_the_allow_list_is_checked_at_start_up():
    from actors.layers.custom_registry import allow_list

    assert allow_list(["tests.layers.test_logits_processors.Ban", force_token]) == NAMES[1::-1]
    for bad in (["tests.layers.test_logits_processors:missing"], ["no.such.module:f"], [lambda o, r: r]):
        with pytest.raises(ValueError, match="logits_processors"):
            allow_list(bad)
