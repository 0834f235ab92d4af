"""AsyncClient over real actor processes and real ZeroMQ sockets: concurrency, streaming,
cancellation, aborts, bad input. The greedy outputs are checked against the in-process
engine (LLM) on the same tiny model."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from actors import LLM, AsyncClient, InvalidRequestError, SamplingParams
from tests.models.test_llm_matches_hf import make_prompts

ENGINE_ARGS = dict(kv_cache_memory="64MiB", max_num_batched_tokens=256, seed=0)


@pytest_asyncio.fixture(scope="module")
async def client(tiny_llama_dir):
    async with asyncio.timeout(120):
        client = AsyncClient(tiny_llama_dir, **ENGINE_ARGS)
        await client.start()
    yield client
    async with asyncio.timeout(30):
        await client.close()


async def collect(stream, timeout: float = 60.0):
    """All deltas of a stream, bounded in time."""
    deltas = []
    async with asyncio.timeout(timeout):
        async for delta in stream:
            deltas.append(delta)
    return deltas


def joined(deltas, index: int = 0) -> tuple[str, list[int]]:
    text, token_ids = "", []
    for delta in deltas:
        for completion in delta.outputs:
            if completion.index == index:
                text += completion.text
                token_ids += completion.token_ids
    return text, token_ids


async def wait_until_idle(client: AsyncClient, timeout: float = 5.0) -> dict:
    """The scheduler's stats once no request holds a KV block."""
    async with asyncio.timeout(timeout):
        while True:
            stats = await client.get_stats()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_held_blocks"] == 0:
                return stats
            await asyncio.sleep(0.05)


async def test_64_concurrent_requests_complete_and_greedy_ones_match_the_core_engine(client, tiny_llama_dir):
    vocab = client.config.model.vocab_size
    prompts = make_prompts(vocab, [3 + (i * 7) % 90 for i in range(64)], seed=21)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    mixed = [greedy if i % 2 == 0 else
             SamplingParams(temperature=0.9, top_p=0.8, top_k=40, seed=i, max_tokens=5 + i % 9, ignore_eos=True,
                            n=1 + i % 3, logprobs=2 if i % 4 == 1 else None)
             for i in range(64)]
    results = await asyncio.gather(*[collect(client.generate(p, sp)) for p, sp in zip(prompts, mixed)])

    for deltas, params in zip(results, mixed):
        assert deltas[-1].finished and sum(d.finished for d in deltas) == 1
        for index in range(params.n):
            _, token_ids = joined(deltas, index)
            assert len(token_ids) == params.max_tokens
    expected = LLM(tiny_llama_dir, **ENGINE_ARGS).generate(prompts[::2], greedy, use_tqdm=False)
    assert [joined(d)[1] for d in results[::2]] == [o.outputs[0].token_ids for o in expected]
    assert (await wait_until_idle(client))["num_held_blocks"] == 0


async def test_streamed_deltas_concatenate_to_the_whole_decode(client):
    tokenizer = await client.get_tokenizer()
    # a random model emits byte tokens of split multi-byte characters, often invalid UTF-8
    prompts = ["小猫在花园里", "🙂 😀 🚀", "こんにちは", "The quick brown fox"]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    results = await asyncio.gather(*[collect(client.generate(p, params)) for p in prompts])
    batch = await client.generate_batch(prompts, params, use_tqdm=False)
    for deltas, whole in zip(results, batch):
        text, token_ids = joined(deltas)
        assert text == tokenizer.decode(token_ids, skip_special_tokens=True)
        assert (text, token_ids) == (whole.outputs[0].text, whole.outputs[0].token_ids)
        assert deltas[0].prompt_token_ids == whole.prompt_token_ids != []


async def test_stop_string_ends_the_request_and_is_never_streamed(client):
    prompt = make_prompts(client.config.model.vocab_size, [20], seed=22)[0]
    free = joined(await collect(client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                                        ignore_eos=True))))[0]
    stop = free[10:13]
    assert len(stop) == 3 and stop not in free[:10]
    deltas = await collect(client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop],
                                                                  ignore_eos=True)))
    assert joined(deltas)[0] == free[:free.index(stop)]
    assert deltas[-1].outputs[-1].finish_reason == "stop" and deltas[-1].outputs[-1].stop_reason == stop


async def test_cancelled_streams_free_their_blocks(client):
    prompts = make_prompts(client.config.model.vocab_size, [30 + i for i in range(10)], seed=23)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def give_up_after_three(prompt):
        seen = 0
        async for _ in client.generate(prompt, params):
            seen += 1
            if seen == 3:
                break

    async with asyncio.timeout(30):
        await asyncio.gather(*[give_up_after_three(p) for p in prompts])
    # cancelling the consumer's task aborts too
    task = asyncio.create_task(collect(client.generate(prompts[0], params)))
    await asyncio.sleep(0.3)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    stats = await wait_until_idle(client)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_abort_ends_the_stream_with_finish_reason_abort(client):
    prompt = make_prompts(client.config.model.vocab_size, [10], seed=24)[0]
    stream = client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                             request_id="to-abort")
    async with asyncio.timeout(30):
        first = await anext(stream)
        await client.abort("to-abort")
        rest = [delta async for delta in stream]
    assert not first.finished and rest[-1].finished
    assert rest[-1].outputs[0].finish_reason == "abort"
    await wait_until_idle(client)


async def test_bad_requests_fail_alone_and_the_engine_keeps_serving(client):
    vocab = client.config.model.vocab_size
    good = make_prompts(vocab, [8], seed=25)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = joined(await collect(client.generate(good, params)))[1]
    too_long = [5] * client.config.scheduler.max_model_len
    with pytest.raises(InvalidRequestError, match="max_model_len") as error:
        await collect(client.generate(too_long, params))
    assert error.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="out of range"):
        await collect(client.generate([vocab + 5], params))
    with pytest.raises(InvalidRequestError):
        await collect(client.chat([{"content": "no role"}], params))
    with pytest.raises(ValueError, match="temperature"):
        client.generate(good, SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidRequestError, match="already in use"):
        await asyncio.gather(collect(client.generate(good, params, request_id="same")),
                             collect(client.generate(good, params, request_id="same")))
    assert joined(await collect(client.generate(good, params)))[1] == expected


async def test_awaiting_a_stream_gives_the_whole_output(client):
    prompt = make_prompts(client.config.model.vocab_size, [12], seed=26)[0]
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, n=2)
    whole = await client.generate(prompt, params)
    deltas = await collect(client.generate(prompt, params))
    assert whole.finished and [c.index for c in whole.outputs] == [0, 1]
    assert [(c.text, c.token_ids) for c in whole.outputs] == [joined(deltas, 0), joined(deltas, 1)]
    chat = await client.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(chat.outputs[0].token_ids) == 3
    assert set(client.actor_pids()) == {"input_processor0", "scheduler", "detokenizer", "worker0"}


async def test_chat_renders_the_template(client):
    messages = [{"role": "user", "content": "Hello world!"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    deltas = await collect(client.chat(messages, params))
    tokenizer = await client.get_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert deltas[0].prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert len(joined(deltas)[1]) == 6
