"""Stream a chat from a running server with the official `openai` package.

    .venv/bin/python -m actors.launch          # in another terminal: the embedded SmolLM2
    .venv/bin/python examples/openai_chat.py "Why is the sky blue?"

Set OPENAI_BASE_URL (default http://127.0.0.1:8000/v1) and OPENAI_API_KEY (needed only when
the server runs with --api-key) to point it elsewhere.
"""

import os
import sys

from openai import OpenAI


def main() -> None:
    client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                    api_key=os.environ.get("OPENAI_API_KEY", "none"))
    model = client.models.list().data[0].id
    question = " ".join(sys.argv[1:]) or "Write a haiku about the sea."
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=128, temperature=0.7, seed=1,
        stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            print(f"\n[{chunk.usage.prompt_tokens} prompt tokens, {chunk.usage.completion_tokens} generated]")


if __name__ == "__main__":
    main()
