"""Suffix decoding (Arctic Inference's method, which vLLM adopted): drafts from a trie of
every substring (up to `max_tree_depth` tokens) of a request's own tokens, and from one
over the outputs of recently finished requests. The longest recent suffix of the request
that the trie holds is followed along its most frequent continuation, for as many tokens
as the match earns (`max_spec_factor` x match length, capped by k and by the depth left
below the match: a path holds at most max_tree_depth tokens) while the path stays probable.

Receives request starts, new tokens and stops; sends nothing; owns one trie per live
request and the global trie with the outputs it was built from (to evict them).

Cost: a trie holds up to (tokens x max_tree_depth) nodes, built at O(max_tree_depth) per
token: in CPython ~26 MB and ~0.3 s for a 4000-token prompt of distinct text at depth 24,
~65 us a proposal while copying. Arctic's C++ tree compresses unary paths; this one does
not, which is what to change if long prompts make it the bottleneck."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from actors.config.speculative import SpeculativeConfig


class _Node:
    """A trie node: the path from the root is a token string that occurred `count` times."""

    __slots__ = ("children", "count", "num_continuations")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}  # next token -> node of the one-longer string
        self.count = 0
        # sum of the children's counts: occurrences followed by another token. Smaller than
        # `count` where an occurrence ends the sequence, so probabilities divide by this.
        self.num_continuations = 0


class _SuffixTrie:
    """All substrings of up to `max_depth` tokens of the sequences added, with counts."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 1

    def add_substrings(self, tokens: Sequence[int], delta: int) -> None:
        """Adds (delta=1) or removes (delta=-1) every substring of `tokens` up to max_depth
        long; a node whose count reaches zero is dropped so memory follows the contents."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                child = node.children.get(token)
                if child is None:
                    assert delta > 0, "removing a string the trie does not hold"
                    child = node.children[token] = _Node()
                    self.num_nodes += 1
                child.count += delta
                node.num_continuations += delta
                if child.count == 0:
                    self.num_nodes -= _subtree_size(child)
                    del node.children[token]
                    break  # the longer strings through it were counted by this occurrence too
                node = child

    def find(self, pattern: Sequence[int]) -> _Node | None:
        node: _Node | None = self.root
        for token in pattern:
            node = node.children.get(token)
            if node is None:
                return None
        return node


def _subtree_size(node: _Node) -> int:
    return 1 + sum(_subtree_size(child) for child in node.children.values())


class _RequestState:
    """A live request's tokens and trie, built incrementally: `open_nodes` are the trie
    nodes of the suffixes of the tokens so far shorter than max_depth, so a new token
    extends each by one child (O(max_depth) per token, not a rebuild)."""

    def __init__(self, max_depth: int) -> None:
        self.trie = _SuffixTrie(max_depth)
        self.tokens: list[int] = []
        self.prompt_len = 0
        self.open_nodes: list[_Node] = [self.trie.root]

    def append(self, tokens: Sequence[int]) -> None:
        trie = self.trie
        for token in tokens:
            extended = [trie.root]
            for node in self.open_nodes:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                    trie.num_nodes += 1
                child.count += 1
                node.num_continuations += 1
                if len(extended) < trie.max_depth:  # the node at depth max_depth takes no children
                    extended.append(child)
            self.open_nodes = extended
            self.tokens.append(token)


def _follow(node: _Node, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
    """Drafts along the most frequent children from `node`, and their score (the expected
    number accepted: the sum of the path's running probability). Stops where the running
    probability of the whole path, as in Arctic Inference, falls under min_token_prob."""
    drafts: list[int] = []
    prob = 1.0
    score = 0.0
    while len(drafts) < max_tokens and node.num_continuations > 0:
        # ties go to the first-seen continuation (dict order), which keeps proposals deterministic
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        prob *= child.count / node.num_continuations
        if prob < min_token_prob:
            break
        drafts.append(token)
        score += prob
        node = child
    return drafts, score


class SuffixDecodingProposer:
    """Per-request tries plus a global trie over the outputs of the last
    `max_cached_requests` finished requests (the oldest finished is evicted first)."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        if max_tree_depth < 1 or max_cached_requests < 0 or max_spec_factor < 0 or not 0 <= min_token_prob <= 1:
            raise ValueError("suffix decoding: max_tree_depth >= 1, max_cached_requests >= 0, "
                             "max_spec_factor >= 0 and min_token_prob in [0, 1] are required")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.requests: dict[str, _RequestState] = {}
        self.global_trie = _SuffixTrie(max_tree_depth)
        self.cached_outputs: OrderedDict[str, list[int]] = OrderedDict()  # request_id -> output tokens

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> SuffixDecodingProposer:
        return cls(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                   config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)

    def start_request(self, request_id: str, prompt: Sequence[int]) -> None:
        if request_id in self.requests:
            raise ValueError(f"suffix decoding: request {request_id!r} already started")
        state = self.requests[request_id] = _RequestState(self.max_tree_depth)
        state.append(prompt)
        state.prompt_len = len(prompt)

    def add_tokens(self, request_id: str, tokens: Sequence[int]) -> None:
        """Accepted output tokens of a live request, in order."""
        self.requests[request_id].append(tokens)

    def stop_request(self, request_id: str) -> None:
        """Frees the request's trie and caches its output for later requests. Harmless for
        an unknown id (an abort can race the finish)."""
        state = self.requests.pop(request_id, None)
        if state is None or self.max_cached_requests == 0:
            return
        output = state.tokens[state.prompt_len:]
        if not output:
            return
        if request_id in self.cached_outputs:  # a reused id replaces its older output
            self.global_trie.add_substrings(self.cached_outputs.pop(request_id), -1)
        self.cached_outputs[request_id] = output
        self.global_trie.add_substrings(output, 1)
        while len(self.cached_outputs) > self.max_cached_requests:
            _, evicted = self.cached_outputs.popitem(last=False)
            self.global_trie.add_substrings(evicted, -1)

    def propose(self, request_id: str, k: int) -> list[int]:
        """Up to k drafts for a live request; [] when its recent tokens match nothing."""
        state = self.requests[request_id]
        # the request trie's open nodes are already its suffix matches, indexed by length
        own_drafts, own_score = self._best_drafts(state.open_nodes[1:], k)
        global_drafts, global_score = self._best_drafts(self._global_matches(state.tokens), k)
        return global_drafts if global_score > own_score else own_drafts

    def _global_matches(self, tokens: list[int]) -> Iterator[_Node]:
        """The global trie's nodes of the suffixes of `tokens`, by length from 1. Stops at the
        first missing one: every longer suffix is missing too, so an unrepetitive context
        costs a lookup or two."""
        for match_len in range(1, min(len(tokens), self.max_tree_depth - 1) + 1):
            node = self.global_trie.find(tokens[-match_len:])
            if node is None:
                return
            yield node

    def _best_drafts(self, matches: Iterable[_Node], k: int) -> tuple[list[int], float]:
        """The best-scoring drafts over the matched suffixes (matches[i] has length i+1; a
        tie goes to the longer match). A short match earns few tokens, so it wins only when
        the long ones lead nowhere probable."""
        best: list[int] = []
        best_score = 0.0
        for match_len, node in enumerate(matches, start=1):
            max_tokens = min(k, int(match_len * self.max_spec_factor + 1e-6), self.max_tree_depth - match_len)
            if max_tokens <= 0:
                continue
            drafts, score = _follow(node, max_tokens, self.min_token_prob)
            if drafts and score >= best_score:
                best, best_score = drafts, score
        return best, best_score
