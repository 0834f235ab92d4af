"""Generate from the embedded default model (SmolLM2-135M-Instruct), offline.

    python examples/generate.py
"""

from actors import LLM, SamplingParams


def main() -> None:
    llm = LLM()  # no model: the embedded SmolLM2-135M-Instruct
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    for output in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32)):
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    chat = llm.chat([{"role": "user", "content": "Write a haiku about the sea."}],
                    SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, seed=1))
    print("chat:", chat[0].outputs[0].text)


if __name__ == "__main__":
    main()
