"""Detokenization logic without processes: exact incremental decoding for byte-level BPE
and SentencePiece-style (Metaspace + byte fallback) tokenizers, and stop strings held
back while streaming."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from actors.detokenizer import OutputProcessor, merge_delta
from actors.incremental_decode import IncrementalDecoder
from messages.common import SamplingParams
from messages.detokenizer import NewTokens
from tests.conftest import build_tiny_tokenizer


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


@pytest.mark.parametrize("make_tokenizer", [lambda: build_tiny_tokenizer().backend_tokenizer,
                                            sentencepiece_style_tokenizer], ids=["byte-level-bpe", "sentencepiece"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_is_always_a_prefix_and_ends_as_the_whole_decode(make_tokenizer, skip_special_tokens):
    tokenizer = make_tokenizer()
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randint(1, 50))]
        decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        shown, position = "", 0
        while position < len(ids):
            step = rng.randint(1, 3)
            decoder.add(ids[position:position + step])
            position += step
            assert decoder.stable_text.startswith(shown)
            shown = decoder.stable_text
        assert decoder.text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


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
        deltas, stops = processor.process([NewTokens("r", 0, [token_id], finish_reason="length" if last else None)])
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
        deltas, stops = processor.process([NewTokens("r", 0, [token_id])])
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
    [delta], _ = processor.process([NewTokens("r", 1, [5], first_scheduled_time=5.0)])
    assert delta.metrics.first_scheduled_time == 5.0
    [delta], _ = processor.process([NewTokens("r", 0, [5], first_scheduled_time=3.0)])
    assert delta.metrics.first_scheduled_time == 3.0
    # nothing new: no metrics on the next deltas
    [delta], _ = processor.process([NewTokens("r", 0, [6]), NewTokens("r", 1, [6])])
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
        deltas, _ = one_by_one.process([NewTokens("r", 0, [token_id])])
        whole_one = merge_delta(whole_one, deltas[0])
    in_chunks = OutputProcessor(tokenizer)
    in_chunks.add_request("r", None, [1], params)
    whole = merge_delta(None, in_chunks.process([NewTokens("r", 0, ids[:2])])[0][0])
    deltas, stops = in_chunks.process([NewTokens("r", 0, ids[2:])])  # the stop, then three more tokens
    whole = merge_delta(whole, deltas[0])
    assert [s.stop for s in stops] == ["in the"]
    assert whole.outputs[0].text == whole_one.outputs[0].text == ("The dog sleeps in the" if include_stop
                                                                  else "The dog sleeps ")
    assert list(whole.outputs[0].token_ids) == list(whole_one.outputs[0].token_ids) == ids[:stop_end]
    assert whole.outputs[0].finish_reason == "stop"


def test_stop_strings_progress_agrees_with_checking_every_prefix():
    """StopStrings (one KMP state a stop string) against the direct reading: which stop
    strings end inside each piece, and the longest end of the text that begins one."""
    from actors.stop_strings import StopStrings

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
            processor.process([NewTokens(f"r{request}", 0, [token_id]) for request in range(20)])
        return time.process_time() - start

    none = min(run(SamplingParams(max_tokens=1000)) for _ in range(3))
    with_stops = min(run(SamplingParams(max_tokens=1000, stop=stops)) for _ in range(3))
    assert with_stops < 2 * none + 0.05, (with_stops, none)
