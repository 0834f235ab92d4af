"""Verification of drafts against the target model's scores of all 1+k positions: greedy
acceptance for greedy requests and rejection sampling (Leviathan et al. 2023; Chen et al.
2023) for sampled ones, which keeps the output distribution exactly the target's. Plain
torch, the reference the worker calls; tensors in, tensors out.

Both return (num_accepted [n], output_tokens [n, k+1]): request i emits
output_tokens[i, :num_accepted[i] + 1] (its accepted drafts, then one token of the
target's: the correction at the first rejection or the bonus token after all its drafts);
the rest of the row is PLACEHOLDER_TOKEN_ID."""

from __future__ import annotations

import torch

PLACEHOLDER_TOKEN_ID = -1


def _check_drafts(draft_tokens: torch.Tensor, num_draft: torch.Tensor, num_positions: int) -> None:
    assert draft_tokens.dim() == 2, f"draft_tokens must be [n, k], got {tuple(draft_tokens.shape)}"
    n, k = draft_tokens.shape
    assert k >= 1, "k >= 1 draft slots (a request with none passes num_draft 0)"
    assert num_draft.shape == (n,), f"num_draft must be [{n}], got {tuple(num_draft.shape)}"
    assert num_positions == k + 1, f"the target scores k+1 = {k + 1} positions, got {num_positions}"
    assert bool(((num_draft >= 0) & (num_draft <= k)).all()), "num_draft must be in [0, k]"


def _emit(num_accepted: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """Rows of target_tokens [n, k+1] cut after position num_accepted (kept), padded."""
    positions = torch.arange(target_tokens.shape[1], device=target_tokens.device)
    keep = positions[None, :] <= num_accepted[:, None]
    return torch.where(keep, target_tokens, torch.full_like(target_tokens, PLACEHOLDER_TOKEN_ID))


def _leading_true(accepted: torch.Tensor) -> torch.Tensor:
    """[n, k] bool -> [n]: how many leading positions are True (acceptance stops at the first no)."""
    return accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)


def greedy_accept(
    draft_tokens: torch.Tensor,  # [n, k] int: drafts; row i uses its first num_draft[i]
    target_argmax: torch.Tensor,  # [n, k+1] int: the target's argmax at each scored position
    num_draft: torch.Tensor,  # [n] int: drafts per request (0 = a plain decode)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepts the longest prefix of drafts equal to the target's argmax, then the target's
    token at the first mismatch (or after the last draft): exactly greedy decoding's output."""
    _check_drafts(draft_tokens, num_draft, target_argmax.shape[1])
    n, k = draft_tokens.shape
    positions = torch.arange(k, device=draft_tokens.device)
    matches = (draft_tokens == target_argmax[:, :k]) & (positions[None, :] < num_draft[:, None])
    num_accepted = _leading_true(matches)
    # accepted drafts equal the argmax, so the emitted row is the argmax row cut after them
    return num_accepted, _emit(num_accepted, target_argmax)


def _draw_uniform(n: int, k: int, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[n, k] uniforms: a request with its own generator draws its row from it (so a seeded
    request's output does not depend on what else is in the batch); the others share the
    global generator in one call."""
    uniform = torch.rand(n, k, dtype=torch.float64, device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand(k, dtype=torch.float64, device=device, generator=generator)
    return uniform


def _sample_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [n, vocab], rows with a generator drawn from it."""
    tokens = torch.multinomial(probs, 1).squeeze(1)
    for row, generator in enumerate(generators):
        if generator is not None:
            tokens[row] = torch.multinomial(probs[row], 1, generator=generator)[0]
    return tokens


def rejection_sample(
    draft_tokens: torch.Tensor,  # [n, k] int: drafts; row i uses its first num_draft[i]
    num_draft: torch.Tensor,  # [n] int: drafts per request
    draft_probs: torch.Tensor | None,  # [n, k, vocab] float: q; None for deterministic proposers (q one-hot)
    target_probs: torch.Tensor,  # [n, k+1, vocab] float: p at each scored position, after the request's
    # temperature/top-k/top-p, so the accepted tokens follow what plain sampling would give
    generators: list[torch.Generator | None] | None = None,  # [n]: per-request seeded generators
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepts draft x at position j with probability min(1, p_j(x) / q_j(x)), left to right;
    at the first rejection emits a token from the normalised residual max(0, p_j - q_j);
    after all drafts, a bonus token from p at the next position. Each emitted token is then
    distributed exactly as p (the proof is Leviathan et al.'s appendix A)."""
    _check_drafts(draft_tokens, num_draft, target_probs.shape[1])
    n, k = draft_tokens.shape
    vocab_size = target_probs.shape[2]
    assert draft_probs is None or draft_probs.shape == (n, k, vocab_size), "draft_probs must be [n, k, vocab]"
    generators = generators if generators is not None else [None] * n
    assert len(generators) == n, "one generator (or None) per request"
    device = target_probs.device
    rows = torch.arange(n, device=device)
    target = target_probs.to(torch.float64)  # float32 residuals of near-equal p and q lose mass
    draft_index = draft_tokens.long()  # gather wants int64; token ids may come as int32

    # 1. The acceptance test of every draft at once; u * q < p is u < p / q without dividing by q.
    p_draft = target[:, :k].gather(2, draft_index.unsqueeze(2)).squeeze(2)  # [n, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.to(torch.float64).gather(2, draft_index.unsqueeze(2)).squeeze(2)
    uniform = _draw_uniform(n, k, generators, device)
    positions = torch.arange(k, device=device)
    accepted = (uniform * q_draft < p_draft) & (positions[None, :] < num_draft[:, None])
    num_accepted = _leading_true(accepted)

    # 2. The distribution of the one token the target adds: the residual where a draft was
    #    rejected, p itself where every draft was accepted (num_accepted == num_draft).
    stop = num_accepted  # the position of that token, in [0, num_draft]
    p_stop = target[rows, stop]  # [n, vocab]
    rejected = num_accepted < num_draft
    # where every draft was accepted no draft sits at `stop` and q is unused (clamped index)
    stop_draft = stop.clamp(max=k - 1)
    if draft_probs is None:
        q_stop = torch.zeros_like(p_stop).scatter_(1, draft_index.gather(1, stop_draft.unsqueeze(1)), 1.0)
    else:
        q_stop = draft_probs.to(torch.float64)[rows, stop_draft]
    residual = (p_stop - q_stop).clamp(min=0)
    residual_mass = residual.sum(dim=1, keepdim=True)
    # a rejection only happens where p(x) < q(x), which leaves residual mass; a zero mass
    # here is rounding, and p is then the right fallback
    residual = torch.where(residual_mass > 0, residual / residual_mass.clamp(min=1e-300), p_stop)
    final_probs = torch.where(rejected[:, None], residual, p_stop)

    # 3. Drafts up to the stop, then the sampled token; the draft row is the emitted row.
    final_tokens = _sample_rows(final_probs, generators)
    tokens = torch.full((n, k + 1), PLACEHOLDER_TOKEN_ID, dtype=draft_tokens.dtype, device=device)
    tokens[:, :k] = draft_tokens
    tokens[rows, stop] = final_tokens.to(draft_tokens.dtype)
    return num_accepted, _emit(num_accepted, tokens)
