"""vLLM's load client, `vllm bench serve --backend openai` and `--backend openai-chat`, against
the shared server. vllm is far too large to install for a test, so this is a small faithful
client: the same request bodies (vllm/benchmarks/lib/endpoint_request_func.py, and the older
benchmarks/backend_request_func.py), the same headers, and the same parsing of the stream —
raw network chunks stripped of whitespace, buffered into `data: ...` messages, the text read
from choices[0]["text"] or choices[0]["delta"]["content"], the token counts from the chunk
with no choices that carries usage, and `data: [DONE]` skipped. A request that counts as
failed in vllm bench fails here."""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from dataclasses import dataclass, field

import httpx
import pytest

from tests.api.conftest import API_KEY, AUTH, MODEL_NAME

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
           "Once upon a time there was a little robot", "def add(a, b):\n    return a + b",
           "小猫在花园里玩。", "Hello world! How are you today?", "🙂 😀 🚀 emoji are fun",
           "1 2 3 4 5 6 7 8 9 10."]
OUTPUT_LENS = [8, 12, 5, 16, 9, 3, 10, 7]
MAX_CONCURRENCY = 4  # --max-concurrency
TIMEOUT_S = 120.0


class SSEBuffer:
    """vllm bench's reassembly of SSE messages from network chunks: bytes decoded incrementally
    (a chunk may end inside a character), split on blank lines; a trailing `data: ...` that is
    already complete JSON (or [DONE]) is a message too."""

    def __init__(self) -> None:
        self.buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def add(self, chunk: bytes) -> list[str]:
        self.buffer += self._decoder.decode(chunk)
        messages = []
        while "\n\n" in self.buffer:
            message, self.buffer = self.buffer.split("\n\n", 1)
            if message.strip():
                messages.append(message.strip())
        if self.buffer.startswith("data: "):
            rest = self.buffer.removeprefix("data: ").strip()
            if rest == "[DONE]" or _is_json(rest):
                messages.append(self.buffer.strip())
                self.buffer = ""
        return messages


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@dataclass
class BenchOutput:
    """What vllm bench keeps of one request (its RequestFuncOutput)."""

    success: bool = False
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # seconds between chunks that carry choices
    output_tokens: int | None = None  # from the usage chunk
    prompt_len: int = 0  # the dataset's, replaced by the usage chunk's prompt_tokens
    error: str = ""


async def bench_request(http: httpx.AsyncClient, path: str, payload: dict, prompt_len: int,
                        request_id: str) -> BenchOutput:
    """One streamed request, read as vllm bench reads it."""
    headers = {"Authorization": f"Bearer {API_KEY}", "x-request-id": request_id}  # OPENAI_API_KEY; request ids
    chat = path.endswith("chat/completions")
    output = BenchOutput(prompt_len=prompt_len)
    start = last = time.perf_counter()
    async with http.stream("POST", path, json=payload, headers=headers) as response:
        if response.status_code != 200:
            output.error = f"{response.status_code} {(await response.aread()).decode()}"
            return output
        buffer = SSEBuffer()
        async for raw in response.aiter_raw():
            chunk = raw.strip()
            if not chunk:
                continue
            for message in buffer.add(chunk):
                if message.startswith(":"):  # an SSE comment (a ping)
                    continue
                data = message.removeprefix("data: ")
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                if choices := event.get("choices"):
                    now = time.perf_counter()
                    if output.success:
                        output.itl.append(now - last)
                    else:
                        output.success, output.ttft = True, now - start  # the first token
                    last = now
                    text = choices[0]["delta"].get("content") if chat else choices[0].get("text")
                    output.generated_text += text or ""
                elif usage := event.get("usage"):
                    output.output_tokens = usage.get("completion_tokens")
                    if usage.get("prompt_tokens") is not None:
                        output.prompt_len = usage["prompt_tokens"]
    if not output.success:
        output.error = "never received a chunk with choices"
    return output


def completions_payload(prompt: str | list[int], output_len: int, style: str) -> dict:
    """`--backend openai`: today's body (extra_body holds --temperature 0, and ignore_eos,
    which the random dataset turns on), or the older benchmark_serving.py's."""
    if style == "current":
        return {"model": MODEL_NAME, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": output_len,
                "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                "temperature": 0.0}
    return {"model": MODEL_NAME, "prompt": prompt, "temperature": 0.0, "best_of": 1, "max_tokens": output_len,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def chat_payload(prompt: str, output_len: int) -> dict:
    """`--backend openai-chat`: the prompt as one text content part of a user message."""
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
            "max_completion_tokens": output_len, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0.0}


async def run_benchmark(server_url: str, path: str, payloads: list[dict],
                        prompt_lens: list[int]) -> list[BenchOutput]:
    """All requests at once (--request-rate inf), at most MAX_CONCURRENCY in flight."""
    semaphore = asyncio.Semaphore(MAX_CONCURRENCY)
    prefix = f"bench-{uuid.uuid4().hex[:8]}-"

    async def limited(index: int) -> BenchOutput:
        async with semaphore:
            return await bench_request(http, path, payloads[index], prompt_lens[index], f"{prefix}{index}")

    async with httpx.AsyncClient(base_url=server_url, timeout=TIMEOUT_S) as http:
        return await asyncio.wait_for(asyncio.gather(*(limited(i) for i in range(len(payloads)))), TIMEOUT_S)


@pytest.fixture(scope="module")
def prompt_token_ids(server) -> list[list[int]]:
    """The prompts through /tokenize as vllm bench aligns its random prompts: the served
    model's name, no special tokens. vLLM leaves /tokenize open; troupe's needs the key, as
    every route that runs the model's tokenizer does (docs/security.md)."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30.0) as http:
        return [http.post("/tokenize", json={"model": MODEL_NAME, "prompt": prompt, "add_special_tokens": False})
                .json()["tokens"] for prompt in PROMPTS]


def greedy_texts(http: httpx.Client, path: str, bodies: list[dict]) -> list[str]:
    """The same requests, whole (not streamed): what the benchmark's streams must concatenate to."""
    texts = []
    for body in bodies:
        whole = {**body, "stream": False}
        whole.pop("stream_options")
        choice = http.post(path, json=whole).json()["choices"][0]
        texts.append(choice["message"]["content"] if "message" in choice else choice["text"])
    return texts


def test_model_discovery_reads_id_and_root(http):
    # without --model, vllm bench takes data[0]["id"] as the model name, data[0]["root"] as the tokenizer
    first = http.get("/v1/models").json()["data"][0]
    assert first["id"] == MODEL_NAME and first["root"]


def test_prompt_alignment_round_trips_through_tokenize_and_detokenize(server, prompt_token_ids):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30.0) as http:
        for prompt, tokens in zip(PROMPTS, prompt_token_ids):
            # vllm bench cuts a prompt that tokenizes too long and sends the detokenized cut
            cut = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens[:3]}).json()["prompt"]
            assert isinstance(cut, str)
            whole = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens}).json()["prompt"]
            assert whole == prompt


@pytest.mark.parametrize("style", ["current", "legacy"])
async def test_completions_backend_measures_every_request(server, http, prompt_token_ids, style):
    payloads = [completions_payload(prompt, n, style) for prompt, n in zip(PROMPTS, OUTPUT_LENS)]
    # the dataset's prompt lengths (0 here) give way to the usage chunk's
    outputs = await run_benchmark(server.url, "/v1/completions", payloads, [0] * len(PROMPTS))
    assert [o.error for o in outputs] == [""] * len(PROMPTS)
    assert all(o.success and o.ttft > 0 for o in outputs)
    assert sum(len(o.itl) for o in outputs) > 0  # tokens stream in several chunks: inter-token latency is measured
    # usage is what the benchmark counts throughput with: exact lengths, thanks to ignore_eos
    assert [o.output_tokens for o in outputs] == OUTPUT_LENS
    assert [o.prompt_len for o in outputs] == [len(tokens) for tokens in prompt_token_ids]
    assert [o.generated_text for o in outputs] == greedy_texts(http, "/v1/completions", payloads)


async def test_completions_backend_with_token_id_prompts(server, http, prompt_token_ids):
    # the timed_trace dataset sends pre-tokenized prompts
    payloads = [completions_payload(tokens, n, "current") for tokens, n in zip(prompt_token_ids, OUTPUT_LENS)]
    outputs = await run_benchmark(server.url, "/v1/completions", payloads, [0] * len(PROMPTS))
    assert all(o.success for o in outputs), [o.error for o in outputs]
    assert [o.output_tokens for o in outputs] == OUTPUT_LENS
    assert [o.prompt_len for o in outputs] == [len(tokens) for tokens in prompt_token_ids]
    assert [o.generated_text for o in outputs] == greedy_texts(http, "/v1/completions", payloads)


async def test_completions_backend_with_logprobs(server, http):
    # --logprobs 2: each chunk also carries logprobs, which the benchmark ignores
    payloads = [{**completions_payload(prompt, 6, "current"), "logprobs": 2} for prompt in PROMPTS[:4]]
    outputs = await run_benchmark(server.url, "/v1/completions", payloads, [0] * 4)
    assert all(o.success for o in outputs) and [o.output_tokens for o in outputs] == [6] * 4
    assert [o.generated_text for o in outputs] == greedy_texts(http, "/v1/completions", payloads)


async def test_chat_backend_measures_every_request(server, http):
    payloads = [chat_payload(prompt, n) for prompt, n in zip(PROMPTS, OUTPUT_LENS)]
    outputs = await run_benchmark(server.url, "/v1/chat/completions", payloads, [0] * len(PROMPTS))
    assert [o.error for o in outputs] == [""] * len(PROMPTS)
    assert [o.output_tokens for o in outputs] == OUTPUT_LENS
    # the content part is the same prompt as a plain string content
    as_strings = [{**p, "messages": [{"role": "user", "content": prompt}]} for p, prompt in zip(payloads, PROMPTS)]
    assert [o.generated_text for o in outputs] == greedy_texts(http, "/v1/chat/completions", as_strings)
    prompt_lens = [http.post("/tokenize", json={"messages": [{"role": "user", "content": prompt}]}).json()["count"]
                   for prompt in PROMPTS]
    assert [o.prompt_len for o in outputs] == prompt_lens


def test_sse_buffer_reassembles_split_and_merged_chunks():
    # the parser above must be vllm bench's, or the end-to-end tests prove nothing
    buffer = SSEBuffer()
    assert buffer.add(b'data: {"a": 1}') == ['data: {"a": 1}']
    assert buffer.add(b'data: {"b":') == [] and buffer.add(b' 2}') == ['data: {"b": 2}']
    assert buffer.add(b'data: {"c": 3}\n\ndata: [DONE]') == ['data: {"c": 3}', "data: [DONE]"]
    cat = 'data: {"text": "猫"}'.encode()
    assert buffer.add(cat[:-4]) == [] and buffer.add(cat[-4:]) == ['data: {"text": "猫"}']
