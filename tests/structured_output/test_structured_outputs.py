"""Structured outputs in the engine: every output under a JSON schema validates, regex,
choice and grammar outputs match, greedy constrained output equals Hugging Face's with
xgrammar's own logits processor on the same weights, and constraints survive seeds,
n > 1, mixed batches and preemption. Random weights are the hard case: the grammar alone
carries validity."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams

SCHEMA = {  # nested objects, arrays, enums, required fields, numbers with ranges, $ref
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "home": {"$ref": "#/$defs/place"},
    },
    "required": ["name", "age", "kind", "home"],
    "additionalProperties": False,
    "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                        "zip": {"type": "integer", "minimum": 1000, "maximum": 9999}},
                        "required": ["city"], "additionalProperties": False}},
}
# for the comparison with Hugging Face: no string length bounds (troupe spells those as a
# pattern, xgrammar_backend._bounded_strings_as_patterns)
ORACLE_SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 500},
    "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "where": {"type": "object", "properties": {"x": {"type": "number"}, "label": {"enum": ["a", "b"]}},
              "required": ["x", "label"]}},
    "required": ["ok", "n", "colors", "where"]}
PROMPTS = ["Describe an animal:", "A person as JSON", "x", "Tell me about the weather in a city far away"]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, max_model_len=512, kv_cache_memory="32MiB", max_num_seqs=8)


def _json_params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True), **kwargs)


def _texts(outputs) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for o in outputs for c in o.outputs]


def test_every_output_under_a_json_schema_validates(llm):
    params = [_json_params(temperature=0.0), _json_params(temperature=1.0, seed=7, n=3)]
    for sampling in params:
        for text, finish in _texts(llm.generate(PROMPTS, sampling)):
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("constraint, check", [
    (StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{3}"), lambda t: re.fullmatch(r"[a-z]{2,5}-\d{3}", t)),
    (StructuredOutputsParams(choice=["yes", "no", "not sure"]), lambda t: t in ("yes", "no", "not sure")),
    (StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
     lambda t: re.fullmatch(r"\(\d+(\+\d+)*\)", t)),
    (StructuredOutputsParams(grammar='start: "<" WORD (" " WORD)? ">"\nWORD: /[a-c]{1,3}/'),
     lambda t: re.fullmatch(r"<[a-c]{1,3}( [a-c]{1,3})?>", t)),
])
def test_regex_choice_grammar_and_json_object_outputs_match(llm, constraint, check):
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=MAX_TOKENS,
                                                   structured_outputs=constraint))
    for text, finish in _texts(outputs):
        assert finish == "stop" and check(text), text


def test_json_object_output_is_an_object(llm):
    # random weights rarely close an open-ended string: check what finished, and how the rest starts
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   structured_outputs=StructuredOutputsParams(json_object=True)))
    for text, finish in _texts(outputs):
        assert text.lstrip().startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)


def test_seeded_constrained_sampling_repeats_and_mixes_with_free_requests(llm):
    constrained = _json_params(temperature=1.0, seed=11)
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=20)
    alone = _texts(llm.generate(PROMPTS[:2], constrained))
    mixed = llm.generate(PROMPTS[:2] * 2, [constrained, constrained, free, free])
    assert _texts(mixed[:2]) == alone
    assert _texts(mixed[2:]) == _texts(llm.generate(PROMPTS[:2], free))


def test_greedy_constrained_output_equals_hugging_face_with_xgrammars_processor(llm, tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=eos)
    # the same grammar (its whitespace runs bounded, specs.py) through xgrammar's own processor
    from actors.structured_output.xgrammar_backend import _grammar

    compiled = xgr.GrammarCompiler(info).compile_grammar(_grammar(StructuredOutputsParams(json=ORACLE_SCHEMA)))
    ours = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                structured_outputs=StructuredOutputsParams(json=ORACLE_SCHEMA)))
    for prompt, output in zip(PROMPTS, ours):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            hf = model.generate(ids, do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0,
                                logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
        assert output.outputs[0].token_ids == hf[0, ids.shape[1]:].tolist()
        if output.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(output.outputs[0].text), ORACLE_SCHEMA)


def test_preempted_requests_replay_their_output_into_a_fresh_matcher(tiny_llama_dir, llm):
    # a KV cache of a few blocks forces preemption and recompute mid-generation
    small = LLM(tiny_llama_dir, max_model_len=512, num_kv_blocks=24, block_size=16, max_num_seqs=8)
    params = _json_params(temperature=1.0, seed=3)
    prompts = [p * 3 for p in PROMPTS]
    assert _texts(small.generate(prompts, params)) == _texts(llm.generate(prompts, params))


@pytest.mark.parametrize("constraint, param", [
    (StructuredOutputsParams(json={"type": "objecct"}), "structured_outputs.json"),
    (StructuredOutputsParams(regex="(["), "structured_outputs.regex"),
    # accepted by xgrammar but not enforced: refused rather than quietly weakened
    (StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     "structured_outputs.json"),
    (StructuredOutputsParams(json={"allOf": [{"type": "object"}, {"required": ["a"]}]}), "structured_outputs.json"),
    (StructuredOutputsParams(grammar="root ::= ("), "structured_outputs.grammar"),
    (StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?"), "structured_outputs.whitespace_pattern"),
])
def test_an_invalid_constraint_is_refused_before_it_is_queued(llm, constraint, param):
    with pytest.raises(InvalidRequestError) as raised:
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=constraint))
    assert raised.value.param == param
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3))[0].outputs[0].text is not None


def test_constructing_params_checks_their_form():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_outputs={"choice": []})
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"


def test_the_guidance_backend_serves_the_same_constraints(tiny_llama_dir):
    guided = LLM(tiny_llama_dir, max_model_len=512, kv_cache_memory="32MiB", structured_outputs_backend="guidance")
    params = SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=MAX_TOKENS, structured_outputs=
                            StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?"))
    for text, finish in _texts(guided.generate(PROMPTS, params)):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module")
def thinking_model_dir(make_tiny_model, tmp_path_factory) -> str:
    """A tiny Llama whose vocabulary ends with <think> and </think> (ids 384, 385)."""
    import shutil

    source = make_tiny_model("llama", vocab_size=386)
    target = str(tmp_path_factory.mktemp("thinking"))
    shutil.copytree(source, target, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [384, 385]
    tokenizer.save_pretrained(target)
    return target


def _end_thinking_after_three(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Forces </think> as the fourth output token (runs before the grammar's mask)."""
    if len(output_ids) == 3:
        logits[385] = 1e4
    return logits


def test_under_a_reasoning_parser_only_what_follows_the_reasoning_is_constrained(thinking_model_dir):
    llm = LLM(thinking_model_dir, max_model_len=256, kv_cache_memory="16MiB", reasoning_parser="deepseek_r1")
    constraint = StructuredOutputsParams(regex=r"[0-9]{2,4}")
    params = SamplingParams(temperature=1.0, seed=0, n=3, max_tokens=40, structured_outputs=constraint,
                            logits_processors=[_end_thinking_after_three], skip_special_tokens=False)
    for completion in llm.generate(["Think first:"], params)[0].outputs:
        assert completion.token_ids[3] == 385 and completion.finish_reason == "stop"
        assert re.fullmatch(r"[0-9]{2,4}", completion.text.split("</think>")[1]), completion.text
    # a prompt that closed its reasoning (thinking turned off) is constrained from the start
    closed = llm.generate([{"prompt_token_ids": [5, 6, 384, 385]}], SamplingParams(
        temperature=1.0, seed=1, max_tokens=10, structured_outputs=constraint))[0].outputs[0]
    assert re.fullmatch(r"[0-9]{2,4}", closed.text), closed.text


def test_a_reasoning_parser_needs_its_markers_in_the_vocabulary(tiny_llama_dir):
    with pytest.raises(ValueError, match="<think>"):
        LLM(tiny_llama_dir, kv_cache_memory="16MiB", reasoning_parser="qwen3")


def test_both_structural_tag_forms_are_accepted_and_a_malformed_one_refused():
    from actors.structured_output import check_constraint

    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    first_form = {"type": "structural_tag", "triggers": ["<function="],
                  "structures": [{"begin": "<function=weather>", "schema": schema, "end": "</function>"}]}
    current = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [
        {"begin": "<function=weather>", "content": {"type": "json_schema", "json_schema": schema},
         "end": "</function>"}]}}
    for tag in (first_form, current):
        check_constraint(StructuredOutputsParams(structural_tag=json.dumps(tag)))
    with pytest.raises(InvalidRequestError) as raised:
        check_constraint(StructuredOutputsParams(structural_tag='{"type": "structural_tag"}'))
    assert raised.value.param == "structured_outputs.structural_tag"


def _byte_token_ids(tokenizer) -> dict[int, int]:
    """The byte-level BPE's single-byte tokens: byte -> id (GPT-2's printable mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    vocab = tokenizer.get_vocab()
    return {b: vocab[chars[b]] for b in range(256)}


@pytest.mark.parametrize("inside, accepted", [
    ("ab€🙂é".encode(), True),  # 1-, 2-, 3- and 4-byte characters: 5 of at most 6
    ("abcdefg".encode(), False),  # 7 characters
    ("🙂🙂🙂🙂🙂🙂🙂".encode(), False),  # 7 characters, 28 bytes
    (b"a\xed\xa0\x80", False),  # a UTF-16 surrogate's bytes: not UTF-8
    (b"a\xe0\x80\x80", False),  # an overlong form
    (b"a\xf0\x80\x80\x80", False),
    (b"a\xf4\x90\x80\x80", False),  # past U+10FFFF
    (b"a\x01", False),  # a control character
])
def test_a_bounded_string_takes_only_utf8_characters_up_to_its_length(inside, accepted):
    """A bounded string's characters are whole UTF-8 characters: a byte sequence that decodes to
    U+FFFD (found on CUDA, where sampling reached one) would break maxLength once decoded."""
    from actors.structured_output.xgrammar_backend import XGrammarBackend
    from tests.conftest import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    backend = XGrammarBackend(tokenizer, len(tokenizer), [0])
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
    byte_ids = _byte_token_ids(tokenizer)
    text = b'{"city": "' + inside + b'"}'
    assert all(matcher.accept(byte_ids[b]) for b in text) == accepted


PRETTY = {"a": [1, {"b": "x y"}], "c": {"d": None, "e": [True]}}
WHITESPACE_SCHEMA = {"type": "object", "properties": {
    "a": {"type": "array"}, "c": {"type": "object"}}, "required": ["a", "c"]}


@pytest.mark.parametrize("backend_name", ["xgrammar", "guidance"])
@pytest.mark.parametrize("constraint", [StructuredOutputsParams(json_object=True),
                                        StructuredOutputsParams(json=WHITESPACE_SCHEMA)])
@pytest.mark.parametrize("document, accepted", [
    (json.dumps(PRETTY), True),  # json.dumps' ", " and ": "
    (json.dumps(PRETTY, separators=(",", ":")), True),  # compact
    (json.dumps(PRETTY, indent=2), True),
    (json.dumps(PRETTY, indent=4).replace("\n", "\r\n"), True),
    (json.dumps(PRETTY, indent="\t"), True),
    ('{"a": [1],\n\n"c": {}}', False),  # a second line break in one run
    ('{"a": [1],' + "\n" * 50 + '"c": {}}', False),  # a weak model's flood
    ('{"a":' + " " * 200 + '[1], "c": {}}', False),  # spaces past the cap
    ('{"a": [1],\n' + " " * 129 + '"c": {}}', False),  # indentation past the cap
])
def test_free_json_whitespace_comes_in_bounded_runs(backend_name, constraint, document, accepted):
    """The default JSON grammars take compact, json.dumps and pretty-printed JSON, and no run
    of whitespace past one line break plus indentation (actors/structured_output/specs.py):
    a weak model wrote newlines until max_tokens under xgrammar's and llguidance's any-run rule."""
    from actors.structured_output import make_backend
    from tests.conftest import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    backend = make_backend(backend_name, tokenizer, len(tokenizer), [0])
    matcher = backend.matcher(backend.compile(constraint))
    byte_ids = _byte_token_ids(tokenizer)
    assert all(matcher.accept(byte_ids[b]) for b in document.encode()) == accepted
    if accepted:
        assert matcher.accept(0) and matcher.is_terminated()  # the document is whole: the stop token ends it


def test_the_workers_compiled_grammars_are_bounded_by_bytes(tiny_llama_dir, monkeypatch):
    from actors.structured_output import grammar_processor
    from actors.structured_output.grammar_processor import GrammarConfig, StructuredOutputs

    processor = StructuredOutputs(GrammarConfig("xgrammar", tiny_llama_dir, 384, (0,)))
    constraints = [StructuredOutputsParams(json={"type": "object", "properties": {f"p{i}_{j}": {"type": "string"}
                                                                                   for j in range(20)}})
                   for i in range(4)]
    sizes = [processor.precompile(constraint).result(timeout=60).memory_size_bytes for constraint in constraints]
    assert len(processor._compiled) == 4  # under the default bound, every one is kept
    # room for two of them: adding another drops the least recently used first
    monkeypatch.setattr(grammar_processor, "MAX_CACHED_GRAMMAR_BYTES", sizes[2] + sizes[3] + sizes[0] // 2)
    processor.precompile(constraints[0])  # used again: the newest
    processor.precompile(StructuredOutputsParams(regex="a+")).result(timeout=60)
    processor.precompile(StructuredOutputsParams(regex="b+")).result(timeout=60)
    kept = [key[1] for key in processor._compiled]
    assert constraints[1].key()[1] not in kept and constraints[0].key()[1] in kept
    total = sum(future.result().memory_size_bytes for future in processor._compiled.values())
    assert total <= grammar_processor.MAX_CACHED_GRAMMAR_BYTES + sizes[0]  # (checked as each one is added)
