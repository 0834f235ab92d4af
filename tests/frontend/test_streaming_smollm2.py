"""Streaming with the embedded SmolLM2-135M-Instruct: outputs full of CJK characters and
emoji whose UTF-8 bytes are split across byte-level BPE tokens."""

from __future__ import annotations

import asyncio

import pytest

from actors import AsyncClient, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "Translate to Chinese: I love my cat and the sunny weather."}],
    [{"role": "user", "content": "写一首关于月亮的短诗。"}],
    [{"role": "user", "content": "Reply with three emoji that describe a happy birthday party."}],
]


@pytest.mark.slow
async def test_smollm2_stream_concatenates_to_the_whole_decode(smollm2_dir):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    async with asyncio.timeout(180):
        async with AsyncClient(smollm2_dir, kv_cache_memory="128MiB") as client:
            tokenizer = await client.get_tokenizer()

            async def stream(messages):
                pieces, token_ids = [], []
                async for delta in client.chat(messages, params):
                    pieces.append(delta.outputs[0].text)
                    token_ids += delta.outputs[0].token_ids
                return pieces, token_ids

            results = await asyncio.gather(*[stream(c) for c in CONVERSATIONS])
    non_ascii = 0
    for pieces, token_ids in results:
        text = "".join(pieces)
        assert text == tokenizer.decode(token_ids, skip_special_tokens=True)
        non_ascii += sum(ord(ch) > 127 for ch in text)
    assert non_ascii > 5  # the outputs really hold multi-byte characters
