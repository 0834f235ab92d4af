"""Detokenization logic without processes: exact incremental decoding for byte-level BPE
and SentencePiece-style (Metaspace + byte fallback) tokenizers, and stop strings held
back while streaming."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from actors.detokenizer.byte_level_decode import ByteLevelDecoder, TokenBytes, is_byte_level
from actors.detokenizer.output_processor import OutputProcessor, merge_delta
from actors.detokenizer.incremental_decode import IncrementalDecoder, TokenPieces, decoder_factory
from messages.common import SamplingParams
from messages.detokenizer import NewTokens, StepOutputs
from messages.scheduler import TokenLogprobs
from tests.conftest import build_tiny_tokenizer


def one_step(*updates: NewTokens) -> StepOutputs:
    return StepOutputs(0, list(updates))


def sentencepiece_style_tokenizer() -> Tokenizer:
    """Llama-2 style: "▁" for spaces, <0xNN> byte-fallback tokens, and a decoder that strips
    the first leading space of whatever it decodes."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁the", "▁cat", "▁sat", "the", "a", "b", ".", "猫", "▁猫", "é"]
    tokenizer = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                                     byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return tokenizer


def byte_level_tokenizer_with_added_tokens() -> Tokenizer:
    """The tiny byte-level BPE with added tokens: special and not, one whose characters are
    all in the byte table (decoded through it) and ones with characters outside it (their
    own UTF-8 bytes)."""
    tokenizer = build_tiny_tokenizer().backend_tokenizer
    tokenizer.add_tokens([AddedToken("猫cat", special=False), AddedToken(" hello", special=False),
                          AddedToken("Ġx", special=False)])
    tokenizer.add_special_tokens(["<sp é>"])
    return tokenizer


@pytest.mark.parametrize("make_tokenizer", [byte_level_tokenizer_with_added_tokens, sentencepiece_style_tokenizer],
                         ids=["byte-level-bpe", "sentencepiece"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("decoders_made_by", ["IncrementalDecoder", "decoder_factory"])
def test_incremental_text_is_always_a_prefix_and_ends_as_the_whole_decode(make_tokenizer, skip_special_tokens,
                                                                          decoders_made_by):
    # decoder_factory's decoders (ByteLevelDecoder, or IncrementalDecoder with TokenPieces)
    # also take single tokens without decoding (add_token): fed token by token or in chunks,
    # the text shown only grows and ends as the whole decode, ids the vocabulary lacks included
    tokenizer = make_tokenizer()
    make_decoder = decoder_factory(tokenizer, skip_special_tokens) if decoders_made_by == "decoder_factory" \
        else lambda: IncrementalDecoder(tokenizer, skip_special_tokens)
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.get_vocab_size() + 2) for _ in range(rng.randint(1, 50))]
        decoder = make_decoder()
        shown, position = "", 0
        while position < len(ids):
            step = rng.randint(1, 3)
            added = decoder.add_token(ids[position]) if step == 1 else None
            if added is None:
                decoder.add(ids[position:position + step])
            else:
                assert decoder.stable_text == shown + added
            position += step
            assert decoder.stable_text.startswith(shown)
            shown = decoder.stable_text
        assert decoder.text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_only_a_byte_level_decoder_alone_is_decoded_byte_by_byte():
    assert is_byte_level(build_tiny_tokenizer().backend_tokenizer)
    assert not is_byte_level(sentencepiece_style_tokenizer())
    assert isinstance(decoder_factory(build_tiny_tokenizer().backend_tokenizer, True)(), ByteLevelDecoder)
    tokenizer = byte_level_tokenizer_with_added_tokens()
    token_bytes = TokenBytes(tokenizer, skip_special_tokens=True)
    assert token_bytes(tokenizer.token_to_id("Ġx")) == b" x"  # through the byte table
    assert token_bytes(tokenizer.token_to_id(" hello")) == b" hello"  # its own bytes
    assert token_bytes(tokenizer.token_to_id("<sp é>")) == b""  # skipped


def test_token_pieces_take_no_byte_fallback_token_and_no_decoder_that_looks_across_tokens():
    tokenizer = sentencepiece_style_tokenizer()
    pieces = TokenPieces(tokenizer, skip_special_tokens=True)
    assert pieces(tokenizer.token_to_id("▁cat")) == " cat"
    assert pieces(tokenizer.token_to_id("猫")) == "猫"
    assert pieces(tokenizer.token_to_id("<0x41>")) is None  # its text depends on the bytes around it
    decoder = IncrementalDecoder(tokenizer, True, pieces)
    assert decoder.add_token(tokenizer.token_to_id("▁cat")) is None  # the first token: its space is stripped
    decoder.add([tokenizer.token_to_id("▁cat")])
    assert decoder.add_token(tokenizer.token_to_id("▁sat")) == " sat" and decoder.text == "cat sat"
    tokenizer.decoder = decoders.WordPiece()
    assert TokenPieces(tokenizer, skip_special_tokens=True)(tokenizer.token_to_id("▁cat")) is None


def test_a_plain_decode_gives_the_same_deltas_as_a_new_tokens_update():
    # a step's plain decodes come as columns (StepOutputs.decode_*): a request with one
    # completion, no stop strings and no logprobs gets their delta the short way, any
    # other the general way; both give the deltas a NewTokens each would
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.encode("The dog sleeps in the sun. 猫 é") + [0, 300, 1]
    for params in (SamplingParams(max_tokens=50), SamplingParams(max_tokens=50, stop=["\u2603"]),
                   SamplingParams(max_tokens=50, n=2)):
        as_columns, as_updates = OutputProcessor(tokenizer), OutputProcessor(tokenizer)
        for processor in (as_columns, as_updates):
            processor.add_request("r", None, [1], params)
            processor.process(one_step(NewTokens("r", 0, [ids[0]], num_cached_tokens=4, first_scheduled_time=1.0)))
        for token_id in ids[1:]:
            columns = as_columns.process(StepOutputs(0, [], ["r"], [0], [token_id]))
            assert columns == as_updates.process(one_step(NewTokens("r", 0, [token_id])))
        last = one_step(NewTokens("r", 0, [5], finish_reason="length"))
        assert as_columns.process(last) == as_updates.process(last)


def test_a_run_of_byte_fallback_tokens_is_held_back_until_it_ends():
    tokenizer = sentencepiece_style_tokenizer()
    byte_ids = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in "猫".encode()]
    decoder = IncrementalDecoder(tokenizer)
    decoder.add([tokenizer.token_to_id("▁the")])
    assert decoder.stable_text == "the"
    decoder.add(byte_ids[:2])
    assert decoder.stable_text == "the"
    decoder.add(byte_ids[2:])
    # complete, but one more invalid byte would turn the whole run into U+FFFDs
    assert decoder.stable_text == "the"
    decoder.add([tokenizer.token_to_id("▁cat")])
    assert decoder.stable_text == "the猫 cat"


def stream_text(processor: OutputProcessor, token_ids: list[int], finish_at_end: bool = True) -> list[str]:
    pieces = []
    for i, token_id in enumerate(token_ids):
        last = finish_at_end and i == len(token_ids) - 1
        update = NewTokens("r", 0, [token_id], finish_reason="length" if last else None)
        deltas, stops = processor.process(one_step(update))
        for delta in deltas:
            pieces.append(delta.outputs[0].text)
        if stops:
            break
    return pieces


def test_text_that_may_start_a_stop_string_is_held_back_then_released():
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.encode("The dog sleeps in the sun.")
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(stop=["sleepy"], max_tokens=50))
    assert [tokenizer.decode([i]) for i in ids] == ["The", " dog", " s", "le", "eps", " ", "in", " the", " s",
                                                    "un", "."]
    # " s", "le" could still grow into "sleepy": shown only once "eps" rules it out
    assert stream_text(processor, ids) == ["The", " dog", " ", "", "sleep", "s ", "in", " the", " ", "sun", "."]


def test_a_stop_string_cuts_the_text_and_is_reported():
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.encode("The dog sleeps in the sun.")
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(stop=["in the"], max_tokens=50))
    whole = None
    for token_id in ids:
        deltas, stops = processor.process(one_step(NewTokens("r", 0, [token_id])))
        for delta in deltas:
            whole = merge_delta(whole, delta)
        if stops:
            assert (stops[0].request_id, stops[0].index, stops[0].stop) == ("r", 0, "in the")
            break
    assert whole.finished and whole.outputs[0].text == "The dog sleeps "
    assert whole.outputs[0].finish_reason == "stop" and whole.outputs[0].stop_reason == "in the"
    assert "r" not in processor.requests


def test_a_request_is_scheduled_when_its_first_completion_was_and_deltas_say_so_once():
    tokenizer = build_tiny_tokenizer()
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(n=2, max_tokens=50))
    # completion 1 reports first, though completion 0 was scheduled earlier
    [delta], _ = processor.process(one_step(NewTokens("r", 1, [5], first_scheduled_time=5.0)))
    assert delta.metrics.first_scheduled_time == 5.0
    [delta], _ = processor.process(one_step(NewTokens("r", 0, [5], first_scheduled_time=3.0)))
    assert delta.metrics.first_scheduled_time == 3.0
    # nothing new: no metrics on the next deltas
    [delta], _ = processor.process(one_step(NewTokens("r", 0, [6]), NewTokens("r", 1, [6])))
    assert delta.metrics is None
    whole = merge_delta(None, delta)
    assert whole.metrics is None
    assert merge_delta(whole, processor.abort_request("r")).metrics is None


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_string_completed_inside_a_multi_token_step_drops_the_tokens_after_it(include_stop):
    # a speculated step brings several tokens at once: the output ends where one token by
    # one would have, at the token that completed the stop string
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.encode("The dog sleeps in the sun.")
    stop_end = ids.index(tokenizer.encode(" the")[0]) + 1  # "in the" completes with " the"
    params = SamplingParams(stop=["in the"], max_tokens=50, include_stop_str_in_output=include_stop)
    one_by_one = OutputProcessor(tokenizer)
    one_by_one.add_request("r", None, [1], params)
    whole_one = None
    for token_id in ids[:stop_end]:
        deltas, _ = one_by_one.process(one_step(NewTokens("r", 0, [token_id])))
        whole_one = merge_delta(whole_one, deltas[0])
    in_chunks = OutputProcessor(tokenizer)
    in_chunks.add_request("r", None, [1], params)
    whole = merge_delta(None, in_chunks.process(one_step(NewTokens("r", 0, ids[:2])))[0][0])
    deltas, stops = in_chunks.process(one_step(NewTokens("r", 0, ids[2:])))  # the stop, then three more tokens
    whole = merge_delta(whole, deltas[0])
    assert [s.stop for s in stops] == ["in the"]
    assert whole.outputs[0].text == whole_one.outputs[0].text == ("The dog sleeps in the" if include_stop
                                                                  else "The dog sleeps ")
    assert list(whole.outputs[0].token_ids) == list(whole_one.outputs[0].token_ids) == ids[:stop_end]
    assert whole.outputs[0].finish_reason == "stop"


def test_stop_strings_progress_agrees_with_checking_every_prefix():
    """StopStrings (one KMP state a stop string) against the direct reading: which stop
    strings end inside each piece, and the longest end of the text that begins one."""
    from actors.detokenizer.stop_strings import StopStrings

    rng = random.Random(7)
    for _ in range(3000):
        alphabet = rng.choice(["ab", "abc", "aab"])
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        tracker, text = StopStrings(stops), ""
        for _ in range(rng.randint(1, 10)):
            piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
            old_len, text = len(text), text + piece
            tracker.feed(piece)
            ended = {index for index, stop in enumerate(stops) if text.find(stop, max(0, old_len - len(stop) + 1)) >= 0}
            assert tracker.completed == ended, (stops, text)
            held = max((length for stop in stops for length in range(1, len(stop)) if text.endswith(stop[:length])),
                       default=0)
            assert tracker.held_back() == held, (stops, text)


def test_sixty_long_stop_strings_cost_the_detokenizer_less_than_twice_none():
    """Issue 41's flood: requests with 60 stop strings of 900 characters each. Checking every
    prefix of every stop string at every token cost ~23 ms a token; each token's characters
    are now read once per stop string in progress."""
    import time

    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun. " * 6)[:200]
    stops = [f"{index} and so the story ends, said the narrator to the quick brown fox. " * 12
             for index in range(60)]

    def run(params: SamplingParams) -> float:
        processor = OutputProcessor(tokenizer)
        for request in range(20):
            processor.add_request(f"r{request}", None, [1], params)
        start = time.process_time()
        for token_id in ids:
            processor.process(one_step(*[NewTokens(f"r{request}", 0, [token_id]) for request in range(20)]))
        return time.process_time() - start

    none = min(run(SamplingParams(max_tokens=1000)) for _ in range(3))
    with_stops = min(run(SamplingParams(max_tokens=1000, stop=stops)) for _ in range(3))
    assert with_stops < 2 * none + 0.05, (with_stops, none)


@pytest.mark.parametrize("abort", [False, True])
def test_the_whole_output_from_the_state_is_what_merging_every_delta_gives(abort):
    # the offline engine takes RequestState.whole_output() when a request ends; a streamed
    # request's caller merges its deltas: n = 2, logprobs, prompt logprobs, a stop string,
    # first-scheduled times and a cached prefix, both ways
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.encode("The dog sleeps in the sun. 猫 é")
    params = SamplingParams(n=2, max_tokens=50, stop=["sun"], logprobs=1, prompt_logprobs=1)
    entry = TokenLogprobs([5], [-0.5], [1])
    for makes_deltas in (True, False):
        processor = OutputProcessor(tokenizer, makes_deltas=makes_deltas)
        processor.add_request("r", "a prompt", [1, 2, 3], params)
        state, whole = processor.requests["r"], None
        steps = [one_step(NewTokens("r", 0, [], prompt_logprobs=[entry, entry], num_cached_tokens=2,
                                    first_scheduled_time=2.0))]
        steps += [one_step(NewTokens("r", 0, [t], new_logprobs=[entry]),
                           NewTokens("r", 1, [t], new_logprobs=[entry], first_scheduled_time=1.0 if i == 0 else None))
                  for i, t in enumerate(ids[:4 if abort else len(ids)])]
        for step in steps:
            for delta in processor.process(step)[0]:
                whole = merge_delta(whole, delta)
        if abort:
            whole = merge_delta(whole, processor.abort_request("r"))
        if makes_deltas:
            merged = whole
        assert whole.finished
    assert state.whole_output() == merged
    assert merged.outputs[0].finish_reason == ("abort" if abort else "stop")


def test_a_plain_request_without_deltas_still_ends_with_its_whole_output():
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.encode("The dog sleeps in the sun. 猫 é")
    outputs = []
    for makes_deltas in (True, False):
        processor = OutputProcessor(tokenizer, makes_deltas=makes_deltas)
        processor.add_request("r", None, [1, 2], SamplingParams(max_tokens=50))
        state, whole = processor.requests["r"], None
        steps = [one_step(NewTokens("r", 0, [ids[0]], num_cached_tokens=1, first_scheduled_time=1.0))]
        steps += [StepOutputs(0, [], ["r"], [0], [t]) for t in ids[1:-1]]
        steps += [one_step(NewTokens("r", 0, [ids[-1]], finish_reason="length"))]
        num_deltas = 0
        for step in steps:
            for delta in processor.process(step)[0]:
                whole, num_deltas = merge_delta(whole, delta), num_deltas + 1
        assert num_deltas == (len(ids) if makes_deltas else 2)  # without: the first and the last only
        outputs.append(whole if makes_deltas else state.whole_output())
    assert outputs[0] == outputs[1] and outputs[0].outputs[0].text == "The dog sleeps in the sun. 猫 é"
