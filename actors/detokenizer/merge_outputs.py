"""RequestOutput deltas folded into the whole output so far: what offline callers, awaited
streams and non-streaming HTTP responses get."""

from __future__ import annotations

from messages.common import CompletionOutput, RequestOutput


def merge_delta(accumulated: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Folds a delta into the request's whole output so far. The accumulated output is
    updated in place and returned."""
    merger = OutputMerger(accumulated)
    merger.add(delta)
    return merger.result()


class OutputMerger:
    """merge_delta over a request's deltas as they come, keeping each completion's text as
    pieces joined once, when result() is read: merging step by step would copy the whole
    text each step. The deltas themselves are not kept (they die at once, no garbage to
    collect)."""

    __slots__ = ("whole", "_by_index", "_texts")

    def __init__(self, accumulated: RequestOutput | None = None) -> None:
        self.whole = accumulated  # updated in place; None until the first delta
        self._by_index = {c.index: c for c in accumulated.outputs} if accumulated is not None else {}
        self._texts: dict[int, list[str]] = {}  # completion index -> its text pieces, not yet joined

    def add(self, delta: RequestOutput) -> None:
        whole = self.whole
        if whole is None:
            whole = self.whole = RequestOutput(request_id=delta.request_id, prompt=delta.prompt)
        if delta.prompt_token_ids:
            whole.prompt_token_ids = delta.prompt_token_ids
        if delta.prompt_logprobs:
            whole.prompt_logprobs = (whole.prompt_logprobs or []) + delta.prompt_logprobs
        if delta.num_cached_tokens > whole.num_cached_tokens:
            whole.num_cached_tokens = delta.num_cached_tokens
        if delta.metrics is not None:
            whole.metrics = delta.metrics
        whole.finished = delta.finished
        for part in delta.outputs:
            completion = self._by_index.get(part.index)
            if completion is None:
                completion = self._by_index[part.index] = CompletionOutput(index=part.index)
                whole.outputs.append(completion)
                whole.outputs.sort(key=lambda c: c.index)
            pieces = self._texts.get(part.index)
            if pieces is None:
                pieces = self._texts[part.index] = [completion.text]
            pieces.append(part.text)
            completion.token_ids.extend(part.token_ids)
            if part.logprobs is not None:  # (a list of its own: extended in place, never the delta's)
                if completion.logprobs is None:
                    completion.logprobs = list(part.logprobs)
                else:
                    completion.logprobs.extend(part.logprobs)
            completion.cumulative_logprob = part.cumulative_logprob
            completion.finish_reason, completion.stop_reason = part.finish_reason, part.stop_reason

    def result(self) -> RequestOutput | None:
        """The whole output so far (None before any delta)."""
        for index, pieces in self._texts.items():
            self._by_index[index].text = "".join(pieces)
        self._texts.clear()
        return self.whole
