"""Input processing: chat template, tokenization and validation of a request before it
reaches the scheduler.

InputProcessor is the plain logic (the offline LLM calls it in-process); the actor
receives AddRequest from the frontend and sends TokenizedRequest to the scheduler, or
RequestRejected back to the frontend. It owns a tokenizer and nothing else, so several
can run side by side (the frontend picks one per request, actors/frontend/input_routing.py, which
knows what each holds: the actor acknowledges each request it passes on)."""

from __future__ import annotations



from actors.input_processor.chat_template import render_chat_text
from actors.config import DEFAULT_CHAT_TEMPLATE_TIMEOUT_S
from actors.layers.custom_registry import check_allowed
from actors.lora.checker import LoRAChecker
from actors.multimodal.inputs import ImageInputs, images_of, split_image_parts
from actors.config.pooler import PoolerConfig, check_dimensions
from actors.structured_output import check_constraint
from actors.config.structured_output import DEFAULT_MAX_GRAMMAR_BYTES, check_grammar_size
from actors.structured_output.reasoning import reasoning_marker_ids
from messages.common import MAX_LOGPROBS, InvalidRequestError, SamplingParams
from messages.input_processor import ChatOptions
from messages.lora import LoRARequest
from messages.multimodal import MultiModalInput
from messages.pooling import PoolingParams

# the PoolingParams.task values a model of each pooling task serves (score: an embedding
# model's scores are cosines of embeddings, a classifier's its one-label output)
POOLING_TASKS_OF = {"embed": ("embed", "encode", "score", "token_embed"),
                    "classify": ("classify", "encode", "score", "token_classify", "reward")}

Prompt = str | list[int]


class InputProcessor:
    """Renders, tokenizes and checks requests. process() is the one place every request
    passes (the actor's, and the offline LLM's): whatever a worker reads of a request is
    checked here against the model (vocabulary, context length, max_logprobs)."""

    # the custom logits processors a request may name (the engine's --logits-processors)
    allowed_processors: tuple[str, ...] = ()
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES  # a constraint's text, at most (--max-grammar-bytes)

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_logprobs: int = MAX_LOGPROBS,
                 structured_outputs_backend: str = "auto", lora: LoRAChecker | None = None,
                 pooler: PoolerConfig | None = None, hidden_size: int | None = None, generates: bool = True,
                 priority_scheduling: bool = False, images: ImageInputs | None = None,
                 chat_template_timeout: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.chat_template_timeout = chat_template_timeout  # seconds a template may take to render
        self.images = images  # a vision model's image processing; None: a text-only model
        self.pooler = pooler  # a pooling model's pooler: it takes pooling requests only
        self.hidden_size = hidden_size
        self.generates = generates  # the model has a language-model head (else: pooling requests only)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.structured_outputs_backend = structured_outputs_backend
        self.lora = lora  # None: the engine runs no adapters
        self.priority_scheduling = priority_scheduling  # requests may carry a priority other than 0

    def process(self, prompt: Prompt | None, params: SamplingParams, *, messages: list[dict] | None = None,
                chat: ChatOptions | None = None, add_special_tokens: bool | None = None, priority: int = 0,
                cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                pooling_params: PoolingParams | None = None) -> tuple[str | None, list[int]]:
        """process_media() for entry points that carry no images (InvalidRequestError if the
        messages hold some)."""
        text, token_ids, mm_inputs = self.process_media(
            prompt, params, messages=messages, chat=chat, add_special_tokens=add_special_tokens, priority=priority,
            cache_salt=cache_salt, lora_request=lora_request, pooling_params=pooling_params)
        if mm_inputs:
            raise InvalidRequestError("this entry point does not take images", param="messages")
        return text, token_ids

    def process_media(self, prompt: Prompt | None, params: SamplingParams, *, messages: list[dict] | None = None,
                      chat: ChatOptions | None = None, add_special_tokens: bool | None = None, priority: int = 0,
                      cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                      pooling_params: PoolingParams | None = None, multi_modal_data: dict | None = None
                      ) -> tuple[str | None, list[int], list[MultiModalInput]]:
        """(text, token ids, images) of a request whose images come in multi_modal_data or
        as the messages' image_url parts: each image's placeholder expanded to its features
        (actors/multimodal/inputs.py)."""
        images = images_of(multi_modal_data)
        param = "messages" if messages is not None else "multi_modal_data"
        if messages is not None:
            messages, chat_images = split_image_parts(messages, self.images.placeholder if self.images else None)
            images += chat_images
        if images and self.images is None:
            raise InvalidRequestError("this model is text-only: it does not accept images", param=param)
        if images and (params.truncate_prompt_tokens is not None or pooling_params is not None):
            raise InvalidRequestError("truncate_prompt_tokens and pooling do not take images yet", param=param)
        if self.images is not None:
            self.images.check_count(len(images), param)  # before anything is decoded
        text, token_ids = self._process_text(prompt, params, messages=messages, chat=chat,
                                             add_special_tokens=add_special_tokens, priority=priority,
                                             cache_salt=cache_salt, lora_request=lora_request,
                                             pooling_params=pooling_params)
        if self.images is None:
            return text, token_ids, []
        token_ids, mm_inputs = self.images.expand(token_ids, images, param)
        self.check_prompt_tokens(token_ids)
        return text, token_ids, mm_inputs

    def _process_text(self, prompt: Prompt | None, params: SamplingParams, *, messages: list[dict] | None = None,
                      chat: ChatOptions | None = None, add_special_tokens: bool | None = None, priority: int = 0,
                      cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                      pooling_params: PoolingParams | None = None) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids) after validating both and the
        parameters (and the LoRA adapter: LoRAAdapterError); fills in
        params.bad_words_token_ids. A pooling request (pooling_params) has no output, so its
        prompt may fill max_model_len. Raises InvalidRequestError."""
        params.validate()
        self.check_params(params)
        self.check_pooling(pooling_params)
        check_request_options(priority, cache_salt, self.priority_scheduling)
        self.check_lora(lora_request)
        if messages is not None:
            text = None
            token_ids = self.render_chat(messages, chat or ChatOptions(), bool(add_special_tokens))
        elif isinstance(prompt, str) and pooling_params is not None and self.pooler.text_as_chat:
            text = prompt  # as sentence-transformers embeds it: a one-message chat, no generation prompt
            token_ids = self.render_chat([{"role": "user", "content": prompt}],
                                         ChatOptions(add_generation_prompt=False))
        elif isinstance(prompt, str):
            text = prompt
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        room, truncate = (1, params.truncate_prompt_tokens) if pooling_params is None \
            else (0, pooling_params.truncate_prompt_tokens)  # room: the tokens left for output
        token_ids = self._truncate(token_ids, truncate, room)
        self.check_prompt_tokens(token_ids, room)
        return text, token_ids

    def check_pooling(self, pooling_params: PoolingParams | None) -> None:
        """Pooling requests need a pooler, generation requests a language-model head (a
        causal LM run as a pooling model takes both); the request's task and dimensions
        must suit the model."""
        pooler = self.pooler
        if pooling_params is None:
            if not self.generates:
                raise InvalidRequestError(f"this is a pooling model ({pooler.task if pooler else 'no head'}): it "
                                          "does not generate text", param="model")
            return
        if pooler is None:
            raise InvalidRequestError("this model generates text; pooling requests need a pooling model "
                                      "(runner 'pooling', convert 'embed' or 'classify')", param="model")
        pooling_params.validate()
        task = pooling_params.task
        if task is not None and task not in POOLING_TASKS_OF[pooler.task]:
            raise InvalidRequestError(f"task {task!r} is not supported by this {pooler.task} model (it supports "
                                      f"{', '.join(POOLING_TASKS_OF[pooler.task])})", param="task")
        try:
            check_dimensions(pooler, pooling_params.dimensions, self.hidden_size)
        except ValueError as error:
            raise InvalidRequestError(str(error), param="dimensions") from None
        truncate = pooling_params.truncate_prompt_tokens
        if truncate is not None and truncate > self.max_model_len:
            raise InvalidRequestError(f"truncate_prompt_tokens ({truncate}) must be at most max_model_len "
                                      f"({self.max_model_len})", param="truncate_prompt_tokens")

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        if lora_request is not None:
            (self.lora or LoRAChecker(None, None)).check(lora_request)  # without one: "LoRA is off"

    def check_params(self, params: SamplingParams) -> None:
        """The checks that need the model: token ids in the vocabulary, logprobs within
        max_logprobs, truncation within the context; bad_words become token ids."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidRequestError(f"{name} must be at most {self.max_logprobs} (the server's max_logprobs), "
                                          f"got {value}", param=name)
        for name, token_ids in (("logit_bias", params.logit_bias or {}),
                                ("allowed_token_ids", params.allowed_token_ids or ()),
                                ("stop_token_ids", params.stop_token_ids or ())):
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} token id {bad[0]} is out of range [0, {self.vocab_size})",
                                          param=name)
        check_allowed(params, self.allowed_processors)
        if params.structured_outputs is not None:  # a bad schema, regex or grammar is refused before queueing
            check_grammar_size(params.structured_outputs, self.max_grammar_bytes)
            check_constraint(params.structured_outputs, self.structured_outputs_backend)
        truncate = params.truncate_prompt_tokens
        if truncate is not None and truncate > self.max_model_len:
            raise InvalidRequestError(f"truncate_prompt_tokens ({truncate}) must be at most max_model_len "
                                      f"({self.max_model_len})", param="truncate_prompt_tokens")
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        elif params.bad_words_token_ids:
            bad = [t for word in params.bad_words_token_ids for t in word if not 0 <= t < self.vocab_size]
            if bad or not all(params.bad_words_token_ids):
                raise InvalidRequestError("bad_words_token_ids must be non-empty lists of token ids in the "
                                          "vocabulary", param="bad_words")

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens at the start of a text and after a space: byte-level BPE
        spells " dog" as one token where "dog" is two. The spaced spelling is left out
        when it is only the plain one behind a token of its own for the space (then
        banning the plain one covers it)."""
        sequences: list[list[int]] = []
        for word in words:
            word = word.lstrip()
            alone = self.tokenizer.encode(word, add_special_tokens=False)
            sequences.append(alone)
            spaced = self.tokenizer.encode(" " + word, add_special_tokens=False)
            if alone and spaced and spaced[-len(alone):] != alone:
                sequences.append(spaced)
        bad = [t for sequence in sequences for t in sequence if not 0 <= t < self.vocab_size]
        if bad or not all(sequences):
            raise InvalidRequestError("bad_words must tokenize to token ids in the model's vocabulary",
                                      param="bad_words")
        return sequences

    def _truncate(self, token_ids: list[int], truncate: int | None, room: int = 1) -> list[int]:
        if truncate is None:
            return token_ids
        keep = self.max_model_len - room if truncate == -1 else truncate  # -1: as much as leaves room for output
        return token_ids[-keep:]

    def render_chat(self, messages: list[dict], options: ChatOptions, add_special_tokens: bool = False) -> list[int]:
        """The conversation rendered with the chat template (the request's own, else the
        tokenizer's) and tokenized; add_special_tokens adds BOS on top of the template's."""
        text = render_chat_text(self.tokenizer, messages, options, self.chat_template_timeout)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat_prompt(self, messages: list[dict], options: ChatOptions) -> list[int] | dict:
        """render_chat()'s token ids; with images in the messages, a prompt dict carrying them
        as multi_modal_data (each image_url part rendered as the model's image token)."""
        messages, images = split_image_parts(messages, self.images.placeholder if self.images else None)
        token_ids = self.render_chat(messages, options)
        return {"prompt_token_ids": token_ids, "multi_modal_data": {"image": images}} if images else token_ids

    def check_prompt_tokens(self, token_ids: list[int], room: int = 1) -> None:
        """room: the tokens the prompt must leave for output (0 for a pooling request)."""
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})",
                                      param="prompt")
        if len(token_ids) > self.max_model_len - room:
            left = " and at least one token must be left for the output" if room else ""
            raise InvalidRequestError(
                f"prompt is {len(token_ids)} tokens long; this model's maximum context length "
                f"(max_model_len) is {self.max_model_len} tokens{left}",
                param="prompt")


def check_request_options(priority: int, cache_salt: str | None, priority_scheduling: bool = False) -> None:
    """priority and cache_salt, the request's options beside its sampling parameters
    (priority_scheduling: the engine's scheduling_policy is 'priority')."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}", param="priority")
    if priority != 0 and not priority_scheduling:
        # as vLLM with its default policy: a priority that would be silently ignored is refused
        raise InvalidRequestError(f"priority {priority} needs --scheduling-policy priority, and this engine serves "
                                  "first come, first served; send priority 0 or none", param="priority")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")


def image_inputs(engine, tokenizer) -> ImageInputs | None:
    """A vision model's image processing (its image processor loaded from the model's
    directory): LLaVA's, or Qwen2-VL's (actors/multimodal/qwen2_vl_inputs.py); None for a
    text-only model."""
    vision = engine.model.vision
    if vision is None:
        return None
    if vision.qwen2_vl is not None:
        from actors.multimodal.qwen2_vl_inputs import Qwen2VLImageInputs

        return Qwen2VLImageInputs(engine.model.model_path, vision, tokenizer, engine.inputs)
    return ImageInputs(engine.model.model_path, vision, tokenizer, engine.inputs)


def check_reasoning_markers(tokenizer, reasoning_parser: str | None) -> None:
    """A reasoning parser needs its markers as tokens of the vocabulary (ValueError at start-up)."""
    if reasoning_parser is not None:
        reasoning_marker_ids(tokenizer, reasoning_parser)
