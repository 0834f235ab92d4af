"""Random choice of the next token for a batch of rows, by inverse transform: one uniform
number per row, looked up in the row's cumulative distribution.

The exponential race this replaces (argmax of probs / Exp(1) noise) drew a random number
for every vocabulary entry of every row: 3.1 M for 64 rows of SmolLM2's 49,152, most of a
step's time on a 2-core CPU (158 ms of sampling against a ~360 ms decode step, measured),
and its top-p sorted whole rows (another ~300 ms). Here a row costs an exp and a
cumulative sum over the vocabulary, and top-k / top-p work on a short list of candidates
from one topk; a row whose top-p needs more than that list (a flat distribution) falls
back to sorting its whole row. Both give each token the probability softmax(logits / T)
restricted and renormalised as top-k, top-p and min-p say.

Order of the filters (as before, and as vLLM): temperature, top-k, top-p (on the top-k
renormalised distribution), then min-p (relative to the most likely token).

On a GPU nothing here waits for the device (a step launched ahead would stall behind it):
the per-row parameters go up from pinned memory, top-k / top-p rows are sorted whole
(deciding which rows need it would read a flag back), and a row whose choice rounded onto a
token of probability 0 is fixed without asking whether any did."""

from __future__ import annotations

import torch

def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values as a tensor on device; on a GPU through pinned memory, so the copy is queued
    behind the device's work instead of waiting for it (as a copy from pageable memory may)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, device="cpu", pin_memory=True).to(device, non_blocking=True)


# Top-p rows look for their nucleus among this many most likely tokens first.
_TOP_P_CANDIDATES = 1024


def sample_random(logits: torch.Tensor,  # [rows, vocab] float, temperature not yet applied
                  temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float],
                  uniforms: torch.Tensor  # [rows] float64 in [0, 1), best on logits' device
                  ) -> torch.Tensor:  # [rows] int64 token ids, on logits' device
    device, vocab = logits.device, logits.shape[-1]
    scaled = logits.float()
    if any(t != 1.0 for t in temperature):
        scaled = scaled / on_device(temperature, torch.float32, device).unsqueeze(1)
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    truncated = [k < vocab or p < 1.0 for k, p in zip(ks, top_p)]
    uniforms = uniforms.to(device)
    if not any(truncated):
        return _inverse_cdf(scaled, min_p, uniforms)
    result = torch.empty(len(ks), dtype=torch.long, device=device)
    whole = [i for i, t in enumerate(truncated) if not t]
    if whole:
        index = on_device(whole, torch.long, device)
        result[index] = _inverse_cdf(scaled.index_select(0, index), [min_p[i] for i in whole], uniforms[index])
    rows = [i for i, t in enumerate(truncated) if t]
    width = min(vocab, max(ks[i] if ks[i] < vocab else _TOP_P_CANDIDATES for i in rows))
    index = on_device(rows, torch.long, device)
    subset = scaled if len(rows) == len(ks) else scaled.index_select(0, index)
    if device.type == "cuda":  # whole rows sorted: no read-back of which rows need it
        values, token_ids = subset.sort(-1, descending=True)
        keep = _top_k_top_p_mask(values, subset, [ks[i] for i in rows], [top_p[i] for i in rows])
        choice = _inverse_cdf(values.masked_fill(~keep, float("-inf")), [min_p[i] for i in rows], uniforms[index])
        result[index] = token_ids.gather(1, choice.unsqueeze(1)).squeeze(1)
        return result
    values, token_ids = subset.topk(width, dim=-1)  # sorted, largest first
    keep = _top_k_top_p_mask(values, subset, [ks[i] for i in rows], [top_p[i] for i in rows])
    complete = _nucleus_found(keep, [ks[i] for i in rows], [top_p[i] for i in rows], width, vocab)
    candidates = values.masked_fill(~keep, float("-inf"))
    choice = _inverse_cdf(candidates, [min_p[i] for i in rows], uniforms[index])
    result[index] = token_ids.gather(1, choice.unsqueeze(1)).squeeze(1)
    short = [rows[j] for j, ok in enumerate(complete) if not ok]
    if short:  # the nucleus reaches past the candidates: sort those rows whole
        short_index = on_device(short, torch.long, device)
        values, token_ids = scaled.index_select(0, short_index).sort(-1, descending=True)
        keep = _top_k_top_p_mask(values, values, [ks[i] for i in short], [top_p[i] for i in short])
        choice = _inverse_cdf(values.masked_fill(~keep, float("-inf")), [min_p[i] for i in short],
                              uniforms[short_index])
        result[short_index] = token_ids.gather(1, choice.unsqueeze(1)).squeeze(1)
    return result


def _top_k_top_p_mask(values: torch.Tensor,  # [rows, width] sorted, largest first
                      full_rows: torch.Tensor,  # [rows, vocab]: the same rows whole, for the softmax's total
                      ks: list[int], top_p: list[float]) -> torch.Tensor:  # [rows, width] bool: kept
    """Which of the sorted candidates top-k and then top-p keep: the first k, then the
    smallest prefix of them whose mass (within the top k) reaches top_p; the first always stays."""
    rows, width = values.shape
    device = values.device
    position = torch.arange(width, device=device).unsqueeze(0)
    keep = position < on_device(ks, torch.long, device).unsqueeze(1)
    if any(p < 1.0 for p in top_p):
        # the top-k mass: the whole row's where k is the vocabulary, else the first k's
        k_limited = on_device([k < full_rows.shape[-1] for k in ks], torch.bool, device).unsqueeze(1)
        row_max = values[:, :1]
        total = torch.where(k_limited, values.masked_fill(~keep, float("-inf")).sub(row_max).exp().sum(-1, True),
                            (full_rows - row_max).exp().sum(-1, True))
        probs = (values - row_max).exp() / total
        mass_before = probs.cumsum(-1) - probs
        keep &= mass_before < on_device(top_p, values.dtype, device).unsqueeze(1)
    return keep


def _nucleus_found(keep: torch.Tensor, ks: list[int], top_p: list[float], width: int, vocab: int) -> list[bool]:
    """Per row, whether the candidates held everything top-k and top-p keep: the row kept
    fewer than all of them, or it could not have kept more (its k, or the whole vocabulary)."""
    kept_all = keep[:, -1].tolist() if width < vocab else [False] * len(ks)
    return [not all_kept or k <= width for all_kept, k in zip(kept_all, ks)]


def _inverse_cdf(logits: torch.Tensor,  # [rows, n]; -inf where a token may not be chosen
                 min_p: list[float], uniforms: torch.Tensor) -> torch.Tensor:  # [rows] int64 in [0, n)
    """The first index whose cumulative probability exceeds uniform x the row's total.

    The sum runs in float32 (in float64 it took 10x longer): a token's share moves by at
    most an ulp of the running total (~6e-8), and a token of probability 0 is never chosen."""
    probs = logits.softmax(-1)
    if any(p > 0.0 for p in min_p):
        threshold = on_device(min_p, probs.dtype, probs.device).unsqueeze(1)
        probs = probs.masked_fill(probs < threshold * probs.amax(-1, keepdim=True), 0.0)
    cdf = probs.cumsum(-1)
    target = (uniforms.unsqueeze(1) * cdf[:, -1:].double()).to(cdf.dtype)
    choice = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    # rounding can put the target at the total itself: never return a token of probability 0
    zero = probs.gather(1, choice.unsqueeze(1)).squeeze(1) <= 0
    if choice.is_cuda or bool(zero.any()):  # (on a GPU without asking: a read-back would wait)
        choice = torch.where(zero, probs.argmax(-1), choice)
    return choice


def filtered_probs(logits: torch.Tensor,  # [rows, vocab] float, temperature not yet applied
                   temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float]
                   ) -> torch.Tensor:  # [rows, vocab] float32: the distribution sample_random draws from
    """Each row's distribution after temperature, top-k, top-p and min-p, as sample_random
    applies them (the target distribution that speculative decoding's rejection sampling
    keeps). Sorts whole rows: it serves the few rows of speculated decodes."""
    device, vocab = logits.device, logits.shape[-1]
    scaled = logits.float() / on_device(temperature, torch.float32, device).unsqueeze(1)
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    values, token_ids = scaled.sort(-1, descending=True)
    keep = _top_k_top_p_mask(values, values, ks, top_p)
    probs = values.masked_fill(~keep, float("-inf")).softmax(-1)
    if any(p > 0.0 for p in min_p):
        threshold = on_device(min_p, probs.dtype, device).unsqueeze(1)
        probs = probs.masked_fill(probs < threshold * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, token_ids, probs)
