"""What every endpoint shares: the server's settings and engine handle (ServingContext),
reading a JSON body under a size limit, giving up on work when the client disconnects,
and Server-Sent Events.

Disconnects: a non-streaming request, or a streaming one before its headers are sent,
races its work against the client's http.disconnect; once streaming, Starlette's
StreamingResponse cancels the body when the client goes. Either way the cancellation
reaches EngineRequests, which aborts the engine requests (and frees their KV blocks)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from actors.detokenizer.output_processor import merge_delta
from actors.errors import EngineDeadError
from actors.frontend.client import AsyncClient
from actors.input_processor.processor import InputProcessor
from actors.config.pooler import class_labels
from actors.tracing.spans import RequestTracer, trace_headers_of
from api.engine_requests import EngineRequests, RequestGate
from api import structured_fields
from api.fields import check_extra_fields
from api.lora_models import ServedModels
from api.errors import APIError, bad_request, engine_unavailable, from_decode_error, from_exception
from api.metrics import ServerMetrics
from api.response_store import DEFAULT_STORE_BYTES, ResponseStore
from api.responses import PromptTokensDetails, Usage
from messages.common import RequestOutput, SamplingParams
from messages.lora import LoRARequest

T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_WAITING_REQUESTS = 1024
# HTTP header limits, vLLM's flags: the header block's bytes (h11 refuses past it; vLLM's
# default is 4 MiB, troupe's 64 KiB, four times h11's own) and the number of headers (vLLM's 256)
DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE = 64 * 2**10
DEFAULT_MAX_HEADER_COUNT = 256


@dataclass
class ServerSettings:
    served_model_names: list[str]  # the first is the name responses carry
    api_key: str | None = None  # when set, every route but /health and /ping needs "Authorization: Bearer <api_key>"
    allow_unauthenticated_metrics: bool = False  # with api_key: /metrics answers without it too
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS  # past max_num_seqs running, then 503
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    max_header_count: int = DEFAULT_MAX_HEADER_COUNT  # requests with more headers get 431
    max_header_bytes: int = DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE  # and with more bytes of them
    root_path: str = ""  # --root-path: routes answer with and without it in front
    chat_template: str | None = None  # --chat-template: used when a chat request sends none
    trust_request_chat_template: bool = False  # a request's own chat_template is rendered (else a 400)
    response_role: str = "assistant"  # --response-role: the role of generated chat messages
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: the default of the field
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    # tool calling: tool_choice "auto" needs both of the first two (vLLM's flags)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # api/tool_parsers/: how calls are read from the output
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": tools not rendered into the prompt
    # vLLM's server options (its flag names)
    log_requests: bool = True  # one log line per request (--disable-log-requests turns it off)
    enable_request_id_headers: bool = False  # every response carries X-Request-Id
    enable_server_load_tracking: bool = False  # GET /load counts the generation requests in flight
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info exists
    # CORS (Starlette's CORSMiddleware); "*" allows any
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist (the engine needs enable_lora)
    allow_runtime_lora_updating: bool = False
    responses_store_bytes: int = DEFAULT_STORE_BYTES  # /v1/responses kept for previous_response_id, by JSON size


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class ServingContext:
    """The engine and the server-wide state every endpoint uses."""

    def __init__(self, client: AsyncClient, settings: ServerSettings, models: ServedModels | None = None) -> None:
        """models: the served names and LoRA adapters already loaded (the launcher's
        --lora-modules); by default the served names alone."""
        assert client.config is not None, "start the AsyncClient before serving it"
        self.client = client
        self.settings = settings
        self.model_name = settings.served_model_names[0]
        self.models = models or ServedModels(settings.served_model_names, client)  # base names, then adapters
        self.max_model_len = client.config.scheduler.max_model_len
        self.metrics = ServerMetrics(self.model_name, client.config)
        self.gate = RequestGate(client.config.scheduler.max_num_seqs, settings.max_waiting_requests)
        # the input processor's own checks, for prompts of token ids (text needs the tokenizer,
        # so the input processor checks that): a bad id never reaches the engine
        self._token_checker = InputProcessor(None, client.config.model.vocab_size, self.max_model_len,
                                             client.config.max_logprobs)
        pooler = client.config.pooler
        # a classifier's label names by class index, for /classify; config.json read once, here
        self.class_labels = (class_labels(client.config.model.model_path, pooler.num_labels)
                             if pooler is not None and pooler.task == "classify" else [])
        structured_fields.warm_up()
        self.open_requests: set[EngineRequests] = set()  # what abort_all() ends
        # a span per engine request (--otlp-traces-endpoint), recorded here (with the served name
        # and the HTTP request's trace context) rather than by the client
        self.tracer = RequestTracer(client.config.otlp_traces_endpoint,
                                    client.config.collect_detailed_traces is not None) \
            if client.config.otlp_traces_endpoint else None
        client.records_spans = False
        # generation requests in flight, for GET /load; counted only with enable_server_load_tracking
        self.server_load = 0
        self.responses = ResponseStore(settings.responses_store_bytes)  # for previous_response_id

    def resolve_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """The model name a response carries and the LoRA adapter the request runs with
        (None: the base model); 404 for a model this server neither serves nor has loaded."""
        return self.models.resolve(name)

    def require_generation(self, route: str) -> None:
        """400 naming the route for a model without a language-model head (a pooling-only
        checkpoint): the engine would refuse the request too, but only after reading it."""
        if not self.client.config.model.can_generate:
            raise bad_request(f"this model does not support {route}: it is a pooling model and cannot generate "
                              "text; use /v1/embeddings, /pooling, /classify, /score or /rerank", param="model")

    def request_ids(self, request: Request, body_request_id: str | None, prefix: str,
                    num_requests: int) -> tuple[str, list[str]]:
        """The response's id ("<prefix>-<id>"; the id from the X-Request-Id header, else the
        body's request_id, else a new one, as vLLM) and one engine request id per prompt,
        unique even when a client reuses its id."""
        base = request.headers.get("x-request-id") or body_request_id
        response_id = f"{prefix}-{base or uuid.uuid4().hex}"
        suffix = f"-{uuid.uuid4().hex[:8]}" if base else ""
        return response_id, [f"{response_id}-{index}{suffix}" for index in range(num_requests)]

    def check_chat_template(self, chat_template: str | None) -> None:
        """400 naming chat_template for a request that sends its own template to a server
        without --trust-request-chat-template (vLLM's flag): a template is code the input
        processor runs for every request, and Jinja's sandbox bounds what it touches, not
        what it costs."""
        if chat_template is not None and not self.settings.trust_request_chat_template:
            raise bad_request("chat_template: this server renders only its own chat template; a request's own needs "
                              "the server started with --trust-request-chat-template", param="chat_template")

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """Whether logprobs name tokens as "token_id:<id>": the request's choice, else the server's."""
        return self.settings.return_tokens_as_token_ids if requested is None else requested

    @staticmethod
    def engine_prompt(prompt: str | list[int], cache_salt: str | None) -> str | list[int] | dict:
        if cache_salt is None:
            return prompt
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        return {key: prompt, "cache_salt": cache_salt}

    def usage(self, requests: EngineRequests) -> Usage:
        """The usage of an HTTP request's engine requests, with the cached prompt tokens
        when --enable-prompt-tokens-details is on."""
        usage = requests.usage
        if self.settings.enable_prompt_tokens_details:
            usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=requests.num_cached_tokens)
        return usage

    def check_prompt_tokens(self, prompts: list[str | list[int]]) -> None:
        """400 for a prompt of token ids that is empty, too long or out of the vocabulary."""
        for prompt in prompts:
            if isinstance(prompt, list):
                self._token_checker.check_prompt_tokens(prompt)

    def check_health(self) -> None:
        try:
            self.client.check_health()
        except EngineDeadError as error:
            raise engine_unavailable(error) from error

    def open(self, request_ids: list[str], start: Callable[[str, int], AsyncIterator[RequestOutput]],
             params: SamplingParams, headers: Mapping[str, str] | None = None) -> EngineRequests:
        """Admits one engine request per id (503 past the waiting limit) and starts them:
        start(request_id, index) returns the request's AsyncClient stream. headers: the HTTP
        request's, where a traceparent makes the requests' spans children of the caller's."""
        self.check_health()
        num_sequences = self.admit(len(request_ids), params.n)
        try:
            streams = [start(request_id, index) for index, request_id in enumerate(request_ids)]
        except BaseException:
            self.gate.release(num_sequences)
            raise
        tracing = None if self.tracer is None else (
            self.tracer, self.model_name, params, trace_headers_of(headers) if headers is not None else None)
        requests = EngineRequests(request_ids, streams, max_model_len=self.max_model_len,
                                  max_tokens=params.max_tokens, metrics=self.metrics, on_close=self._closed,
                                  n=params.n, tracing=tracing)
        self.open_requests.add(requests)
        return requests

    def admit(self, num_requests: int, n: int) -> int:
        """Admits num_requests engine requests of n sequences each through the back-pressure
        gate, counting sequences (what the engine runs: n multiplies every cost); returns the
        count to release. 503 past the waiting limit; 400 naming n (or the prompts) for a
        request larger than the whole limit, which waiting could never admit."""
        num_sequences = num_requests * n
        if num_sequences > self.gate.limit:
            param = "n" if n > 1 else "prompt"
            raise bad_request(f"this request asks for {num_sequences} sequences ({num_requests} prompts x n={n}); "
                              f"this server runs at most {self.gate.limit} at once (max_num_seqs + "
                              "max_waiting_requests)", param=param)
        self.gate.admit(num_sequences)
        return num_sequences

    def _closed(self, requests: EngineRequests) -> None:
        self.open_requests.discard(requests)
        self.gate.release(requests.num_requests * requests.n)

    async def abort_all(self) -> None:
        """Ends every running request with finish_reason "abort" (the server is stopping):
        each client still gets a complete response."""
        for requests in list(self.open_requests):
            for request_id in requests.request_ids:
                await self.client.abort(request_id)


async def read_json(request: Request, body_type: type[T], max_bytes: int) -> T:
    """The request body decoded as body_type: 413 past max_bytes, 400 for anything
    that is not JSON of the right shape."""
    return decode_json(await read_body(request, max_bytes), body_type)


def decode_json(body: bytes, body_type: type[T], check_extra: bool = True) -> T:
    """body decoded as body_type; 400 for anything that is not JSON of the right shape.
    check_extra: refuse the fields troupe does not implement, log unknown ones (fields.py)."""
    try:
        decoded = msgspec.json.decode(body, type=body_type)
    except msgspec.DecodeError as error:
        raise from_decode_error(error) from error
    if check_extra:
        check_extra_fields(body, body_type)
    return decoded


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body's bytes; 413 past max_bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:  # a chunked body declares no length
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect as error:
        raise ClientGone() from error
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {max_bytes} bytes",
                    code="request_too_large")


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """work's result; if the client disconnects first, cancels work and raises ClientGone."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((work_task, watch_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        # also when this task itself is cancelled (the server shutting down)
        for task in (work_task, watch_task):
            task.cancel()
    if not work_task.cancelled() and work_task.done():
        return work_task.result()
    await asyncio.gather(work_task, return_exceptions=True)
    raise ClientGone()


async def _wait_for_disconnect(request: Request) -> None:
    # the body is already read, so the only message left is http.disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


_DONE = b"data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that closes its engine requests however it ends: also when
    the client leaves before the body is first iterated (its generator then never runs,
    so its own clean-up would not either)."""

    def __init__(self, body: AsyncIterator[bytes], requests: EngineRequests) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.requests = requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.requests.close()


def sse_response(events: AsyncIterator[Any], requests: EngineRequests) -> StreamingResponse:
    """Streams each event as `data: {json}\n\n`, then `data: [DONE]\n\n`. An error
    after the headers are sent becomes an error event. The response owns requests:
    it closes them when the stream ends, fails or is cancelled by a disconnect."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield b"data: " + msgspec.json.encode(event) + b"\n\n"
        except Exception as error:  # noqa: BLE001 - the status is sent; the client still deserves the reason
            yield b"data: " + msgspec.json.encode(from_exception(error).body) + b"\n\n"
        requests.close()  # before [DONE]: a client may send its next request the moment it sees it
        yield _DONE

    return _SSEResponse(body(), requests)


async def respond(request: Request, requests: EngineRequests, stream: bool,
                  events: Callable[[], AsyncIterator[Any]],
                  whole_response: Callable[[list[RequestOutput]], Any]) -> Response:
    """The response of a generation endpoint: SSE of events() when streaming, else
    whole_response(the whole outputs, in prompt order) as JSON. Both start only once every
    engine request has produced its first delta, so engine errors get their status."""
    request.state.usage = requests.usage  # for the request's log line
    try:
        await until_disconnected(request, requests.start())
        if stream:
            return sse_response(events(), requests)
        outputs = await until_disconnected(request, collect_outputs(requests))
    except BaseException:
        requests.close()
        raise
    requests.close()
    return json_response(whole_response(outputs))


async def collect_outputs(requests: EngineRequests) -> list[RequestOutput]:
    """Each engine request's whole output, in prompt order."""
    outputs: list[RequestOutput | None] = [None] * requests.num_requests
    async for index, delta in requests.deltas():
        outputs[index] = merge_delta(outputs[index], delta)
    assert all(output is not None for output in outputs), "an engine request ended without any output"
    return outputs  # type: ignore[return-value]
