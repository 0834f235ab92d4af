"""Suffix decoding: the request's own repeats, the global cache of finished outputs, its
bound and eviction, the adaptive draft length and the probability cut-off."""

import pytest

from actors.config.speculative import parse_speculative_config
from actors.spec_decode.suffix import SuffixDecodingProposer, _SuffixTrie


def make_proposer(**overrides) -> SuffixDecodingProposer:
    options = dict(max_tree_depth=8, max_cached_requests=4, max_spec_factor=1.0, min_token_prob=0.1)
    return SuffixDecodingProposer(**{**options, **overrides})


def test_repeated_text_in_the_request_is_proposed():
    proposer = make_proposer(max_tree_depth=16)
    # the prompt holds a passage; the output has begun to copy it (1 2 3)
    proposer.start_request("a", [1, 2, 3, 4, 5, 6, 7, 0])
    proposer.add_tokens("a", [1, 2, 3])
    # a 3-token match earns 3 drafts at factor 1
    assert proposer.propose("a", k=5) == [4, 5, 6]
    proposer.add_tokens("a", [4, 5, 6])
    assert proposer.propose("a", k=5) == [7, 0, 1, 2, 3]


def test_most_frequent_continuation_wins():
    proposer = make_proposer(min_token_prob=0.0)
    # after 1: 2 twice, 3 once; "8 1" never occurred before, so only the 1-token match counts
    proposer.start_request("a", [5, 1, 2, 6, 1, 3, 7, 1, 2, 8, 1])
    assert proposer.propose("a", k=1) == [2]


def test_unmatched_context_proposes_nothing():
    proposer = make_proposer()
    proposer.start_request("a", [1, 2, 3, 4])
    assert proposer.propose("a", k=4) == []


def test_draft_length_adapts_to_the_match_length():
    # "9 1 2 3 4 5 6 7" then a context ending "1"; a 1-token match earns 1 draft, a 3-token one 3
    proposer = make_proposer()
    proposer.start_request("short", [9, 1, 2, 3, 4, 5, 6, 7, 8, 1])
    assert proposer.propose("short", k=6) == [2]
    proposer.start_request("long", [9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    assert proposer.propose("long", k=6) == [3, 4, 5]
    # the factor scales the earnings; k caps them, and so does the depth: a trie of depth 8
    # holds no path beyond the 3 matched tokens plus 5
    generous = make_proposer(max_spec_factor=2.0, max_tree_depth=16)
    generous.start_request("long", [9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    assert generous.propose("long", k=8) == [3, 4, 5, 6, 7, 8]
    assert generous.propose("long", k=2) == [3, 4]
    shallow = make_proposer(max_spec_factor=2.0, max_tree_depth=8)
    shallow.start_request("long", [9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    assert shallow.propose("long", k=8) == [3, 4, 5, 6, 7]


def test_drafting_stops_where_the_path_becomes_improbable():
    # after "1 2" comes 3 every time, then 4, 5 or 6 equally often (path probability 1/3)
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 6, 1, 2]
    confident = make_proposer(min_token_prob=0.5, max_spec_factor=4.0)
    confident.start_request("a", prompt)
    assert confident.propose("a", k=4) == [3]
    # past the branch the first-seen continuation (4) is taken, and each later step is certain
    permissive = make_proposer(min_token_prob=0.3, max_spec_factor=4.0)
    permissive.start_request("a", prompt)
    assert permissive.propose("a", k=4) == [3, 4, 1, 2]


def test_finished_outputs_serve_later_requests():
    proposer = make_proposer()
    proposer.start_request("a", [50, 51])
    proposer.add_tokens("a", [1, 2, 3, 4, 5])
    proposer.stop_request("a")
    # b's own tokens never continued "1 2"; a's output did
    proposer.start_request("b", [60, 1, 2])
    assert proposer.propose("b", k=3) == [3, 4]


def test_prompts_are_not_cached_globally():
    proposer = make_proposer()
    proposer.start_request("a", [1, 2, 3, 4, 5])
    proposer.stop_request("a")
    proposer.start_request("b", [1, 2])
    assert proposer.propose("b", k=3) == []


def test_the_global_cache_evicts_the_oldest_finished_request():
    proposer = make_proposer(max_cached_requests=2)
    outputs = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 10, 11, 12]}
    for request_id, output in outputs.items():
        proposer.start_request(request_id, [0])
        proposer.add_tokens(request_id, output)
        proposer.stop_request(request_id)
    assert list(proposer.cached_outputs) == ["b", "c"]
    proposer.start_request("after_a", [1, 2])
    assert proposer.propose("after_a", k=2) == []
    proposer.start_request("after_c", [9, 10])
    assert proposer.propose("after_c", k=2) == [11, 12]
    # memory follows the contents: the trie is the size of one built from b and c alone
    rebuilt = _SuffixTrie(max_depth=8)
    rebuilt.add_substrings(outputs["b"], 1)
    rebuilt.add_substrings(outputs["c"], 1)
    assert proposer.global_trie.num_nodes == rebuilt.num_nodes == 1 + 2 * (4 + 3 + 2 + 1)


def test_tries_hold_no_string_longer_than_the_depth():
    proposer = make_proposer(max_tree_depth=3)
    proposer.start_request("a", list(range(100)))
    # 100 distinct tokens: each start holds a path of at most 3 nodes
    assert proposer.requests["a"].trie.num_nodes == 1 + 100 + 99 + 98


def test_request_lifecycle_errors_and_a_disabled_cache():
    proposer = make_proposer(max_cached_requests=0)
    proposer.start_request("a", [1, 2])
    with pytest.raises(ValueError, match="already started"):
        proposer.start_request("a", [1])
    proposer.add_tokens("a", [3])
    proposer.stop_request("a")
    proposer.stop_request("a")  # an abort racing the finish
    assert proposer.requests == {} and proposer.global_trie.num_nodes == 1


def test_built_from_a_parsed_config():
    proposer = SuffixDecodingProposer.from_config(parse_speculative_config(
        {"method": "suffix", "suffix_decoding_max_tree_depth": 12, "suffix_decoding_max_cached_requests": 7,
         "suffix_decoding_max_spec_factor": 2.5, "suffix_decoding_min_token_prob": 0.2}))
    assert (proposer.max_tree_depth, proposer.max_cached_requests, proposer.max_spec_factor,
            proposer.min_token_prob) == (12, 7, 2.5, 0.2)
