"""Serve requests from your own asyncio program, no HTTP: AsyncClient starts the engine's
actors as child processes and streams each request's output as it is generated.

    .venv/bin/python examples/async_client.py
"""

import asyncio

from actors import AsyncClient, SamplingParams


async def main() -> None:
    # no model: the embedded SmolLM2-135M-Instruct; kv_cache_memory sizes the KV cache
    async with AsyncClient(kv_cache_memory="1GiB") as client:
        # a chat, streamed: each delta holds only the text that is new
        messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
        async for delta in client.chat(messages, SamplingParams(temperature=0.0, max_tokens=48)):
            print(delta.outputs[0].text if delta.outputs else "", end="", flush=True)
        print()

        # several prompts at once: the scheduler batches them together
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        outputs = await client.generate_batch(prompts, SamplingParams(temperature=0.0, max_tokens=24),
                                              use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            print(f"{prompt!r} -> {output.outputs[0].text!r}")
        print("engine stats:", await client.get_stats())


if __name__ == "__main__":
    asyncio.run(main())
