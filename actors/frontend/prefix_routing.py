"""Prefix-aware routing of requests over data-parallel replicas (--routing-logic prefixaware,
the name and value of vLLM production-stack's router flag).

A replica that has served a prompt still holds its KV blocks in its prefix cache, so a
later prompt sharing that prefix is cheaper there. The DataParallelClient cannot see the
replicas' caches (they live in other processes), so it remembers what it sent: per
replica, a bounded LRU of the chained hashes of the prompts' block-aligned prefixes. A
prompt given as token ids is cut into blocks of the engine's block_size tokens (the prefix
cache's own blocks); a text prompt or a chat conversation, which the replica's input
processor tokenizes later, into chunks of TEXT_CHUNK_CHARS characters (a prefix of the
text is near enough to a prefix of the tokens). Each chain starts from the cache salt and
the LoRA adapter, as the prefix cache's does, so prompts that could not share blocks do
not share keys.

The choice: the live replica holding the longest prefix of the prompt, unless it is
much busier than the least-loaded one (more than balance_abs more unfinished requests and
more than balance_rel times as many), or no replica holds any of it: then the
least-loaded replica, as the default routing does."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from messages.input_processor import AddRequest

TEXT_CHUNK_CHARS = 64
# per replica: enough for thousands of distinct long prompts, a few MB at most
DEFAULT_CAPACITY = 65536
# vLLM's router falls back to the least loaded replica past both thresholds (64 and 1.5 there;
# lower here: a troupe replica runs fewer requests at once)
BALANCE_ABS_THRESHOLD = 16
BALANCE_REL_THRESHOLD = 1.5


def prefix_keys(request: AddRequest, block_size: int) -> list[int]:
    """The chained hashes of the request's block-aligned prompt prefixes, shortest first
    (a partial last block or chunk has none)."""
    if isinstance(request.prompt, list):
        units, size = request.prompt, block_size
    elif isinstance(request.prompt, str):
        units, size = request.prompt, TEXT_CHUNK_CHARS
    elif request.messages is not None:
        units, size = msgspec.json.encode(request.messages).decode(), TEXT_CHUNK_CHARS
    else:
        return []
    lora = request.lora_request.lora_name if request.lora_request is not None else None
    key = hash((request.cache_salt, lora))
    keys = []
    for start in range(0, len(units) - size + 1, size):
        key = hash((key, tuple(units[start:start + size]) if isinstance(units, list) else units[start:start + size]))
        keys.append(key)
    return keys


class PrefixRouter:
    """The replicas' remembered prefixes and the routing choice over them."""

    def __init__(self, num_replicas: int, capacity: int = DEFAULT_CAPACITY,
                 balance_abs: int = BALANCE_ABS_THRESHOLD, balance_rel: float = BALANCE_REL_THRESHOLD) -> None:
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.capacity = capacity
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def matched(self, replica: int, keys: Sequence[int]) -> int:
        """How many leading blocks of the prompt the replica has been sent."""
        seen = self.seen[replica]
        count = 0
        for key in keys:
            if key not in seen:
                break
            count += 1
        return count

    def choose(self, keys: Sequence[int], loads: dict[int, int]) -> int:
        """The replica (an index among loads' keys, the live ones) for a prompt with these
        prefix keys; loads are the replicas' unfinished requests."""
        least = min(loads, key=lambda index: (loads[index], index))
        best, best_match = least, 0
        for index in sorted(loads):
            match = self.matched(index, keys)
            if match > best_match or (match == best_match and match and loads[index] < loads[best]):
                best, best_match = index, match
        if best_match == 0:
            return least
        busier = loads[best] - loads[least]
        if busier > self.balance_abs and loads[best] > self.balance_rel * loads[least]:
            return least
        return best

    def record(self, replica: int, keys: Sequence[int]) -> None:
        """Remembers that the replica was sent these prefixes (the least recently sent
        forgotten past capacity)."""
        seen = self.seen[replica]
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
