"""Verification: greedy acceptance cases, and rejection sampling's output distribution
checked against the target's with a chi-square test over many seeded draws."""

import pytest
import torch
from scipy.stats import chisquare

from actors.spec_decode.rejection import PLACEHOLDER_TOKEN_ID as PAD, greedy_accept, rejection_sample

VOCAB_SIZE = 8
NUM_DRAWS = 40_000
# the chance that a correct sampler fails one of these tests; the seeds are fixed, so a pass is stable
SIGNIFICANCE = 1e-4


def tokens(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def test_greedy_accepts_all_drafts_then_the_bonus_token():
    num_accepted, output = greedy_accept(tokens([1, 2, 3]), tokens([1, 2, 3, 4]), torch.tensor([3]))
    assert num_accepted.tolist() == [3]
    assert output.tolist() == [[1, 2, 3, 4]]


def test_greedy_first_draft_rejected_emits_the_target_token():
    num_accepted, output = greedy_accept(tokens([1, 2, 3]), tokens([7, 2, 3, 4]), torch.tensor([3]))
    assert num_accepted.tolist() == [0]
    assert output.tolist() == [[7, PAD, PAD, PAD]]


def test_greedy_mid_rejection_ignores_later_agreement():
    # position 1 disagrees; position 2 agrees again but comes after the rejection
    num_accepted, output = greedy_accept(tokens([1, 2, 3]), tokens([1, 9, 3, 4]), torch.tensor([3]))
    assert num_accepted.tolist() == [1]
    assert output.tolist() == [[1, 9, PAD, PAD]]


def test_greedy_variable_draft_lengths_in_one_batch():
    # the padding past a row's drafts equals the target in rows 1 and 3, and must still not count
    draft = tokens([1, 2, 3], [5, 6, 7], [8, 0, 0], [3, 3, 3])
    target = tokens([1, 2, 3, 4], [5, 6, 7, 7], [8, 9, 9, 9], [3, 3, 3, 3])
    num_accepted, output = greedy_accept(draft, target, torch.tensor([3, 2, 1, 0]))
    # row 1 has 2 drafts: its bonus token is the target's at position 2
    assert num_accepted.tolist() == [3, 2, 1, 0]
    assert output.tolist() == [[1, 2, 3, 4], [5, 6, 7, PAD], [8, 9, PAD, PAD], [3, PAD, PAD, PAD]]


def make_distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target p and a draft q over 8 tokens that disagree a lot: q puts its mass where p has little."""
    generator = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(3, VOCAB_SIZE, generator=generator), dim=-1)  # [k+1, vocab]
    q = torch.softmax(-2 * p.log()[:2] + torch.randn(2, VOCAB_SIZE, generator=generator), dim=-1)  # [k, vocab]
    return p, q


def assert_distributed_as(samples: torch.Tensor, probs: torch.Tensor) -> None:
    observed = torch.bincount(samples, minlength=VOCAB_SIZE).double()
    expected = probs.double() / probs.double().sum() * len(samples)  # float32 p sums to 1 only roughly
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > SIGNIFICANCE, (observed, expected)


@pytest.mark.parametrize("draft_kind", ["one_hot", "probabilistic"])
def test_rejection_sampling_emits_the_target_distribution(draft_kind):
    p, q = make_distributions(seed=1)
    torch.manual_seed(2)
    if draft_kind == "one_hot":
        # an n-gram draft: always the same token, one p gives only ~2% of its mass
        draft = torch.full((NUM_DRAWS, 2), int(p[0].argmin()))
        draft[:, 1] = int(p[1].argmin())
        draft_probs = None
    else:
        # drafts sampled from q, which is what makes min(1, p/q) the right acceptance
        draft = torch.multinomial(q, NUM_DRAWS, replacement=True).T.contiguous()
        draft_probs = q.expand(NUM_DRAWS, 2, VOCAB_SIZE)
    target_probs = p.expand(NUM_DRAWS, 3, VOCAB_SIZE)
    num_accepted, output = rejection_sample(draft, torch.full((NUM_DRAWS,), 2), draft_probs, target_probs)
    # the draft disagrees often: most first drafts are rejected, so the residual path is exercised
    assert (num_accepted == 0).float().mean() > 0.5
    # 1. the first emitted token, accepted draft or correction, follows p at position 0
    assert_distributed_as(output[:, 0], p[0])
    # 2. given that the first draft was accepted, the second emitted token follows p at position 1
    second = output[num_accepted >= 1, 1]
    assert len(second) > 500
    assert_distributed_as(second, p[1])


def test_rejection_sampling_bonus_token_follows_p_after_the_last_draft():
    p, _ = make_distributions(seed=3)
    torch.manual_seed(4)
    # q == p: every draft is accepted (u * q < p holds for u < 1), so each row ends in a bonus token
    draft = torch.multinomial(p[:2], NUM_DRAWS, replacement=True).T.contiguous()
    num_accepted, output = rejection_sample(draft, torch.full((NUM_DRAWS,), 2), p[:2].expand(NUM_DRAWS, 2, VOCAB_SIZE),
                                            p.expand(NUM_DRAWS, 3, VOCAB_SIZE))
    assert num_accepted.tolist() == [2] * NUM_DRAWS
    assert torch.equal(output[:, :2], draft)
    assert_distributed_as(output[:, 2], p[2])


def test_equal_draft_and_target_accept_every_draft_of_every_length():
    p = torch.softmax(torch.randn(5, 4, VOCAB_SIZE, generator=torch.Generator().manual_seed(5)), dim=-1)
    draft = torch.multinomial(p[:, :3].reshape(-1, VOCAB_SIZE), 1).reshape(5, 3)
    num_draft = torch.tensor([3, 2, 1, 0, 3])
    num_accepted, output = rejection_sample(draft, num_draft, p[:, :3], p)
    assert num_accepted.tolist() == num_draft.tolist()
    for row, count in enumerate(num_draft.tolist()):
        assert output[row, :count].tolist() == draft[row, :count].tolist()
        assert output[row, count] != PAD and (output[row, count + 1:] == PAD).all()


def test_a_draft_the_target_rules_out_is_rejected_and_never_resampled():
    # p gives the one-hot draft's token 0 no mass: always rejected, and the correction avoids it
    p = torch.full((200, 2, VOCAB_SIZE), 1.0 / (VOCAB_SIZE - 1))
    p[:, :, 0] = 0.0
    num_accepted, output = rejection_sample(torch.zeros(200, 1, dtype=torch.int64), torch.ones(200, dtype=torch.int64),
                                            None, p)
    assert (num_accepted == 0).all() and (output[:, 0] != 0).all()


def test_seeded_requests_reproduce_whatever_the_batch_around_them():
    p, q = make_distributions(seed=6)
    draft = torch.multinomial(q, 2, replacement=True).T.contiguous()[:1]  # [1, 2]

    def run_seeded(seed: int, batch_size: int, position: int) -> list[int]:
        generators = [None] * batch_size
        generators[position] = torch.Generator().manual_seed(seed)
        _, output = rejection_sample(draft.expand(batch_size, 2), torch.full((batch_size,), 2),
                                     q.expand(batch_size, 2, VOCAB_SIZE), p.expand(batch_size, 3, VOCAB_SIZE),
                                     generators)
        return output[position].tolist()

    for seed in range(20):
        alone = run_seeded(seed, batch_size=1, position=0)
        assert run_seeded(seed, batch_size=5, position=3) == alone
    # the seeds do steer the draws: twenty seeds do not all give one output
    assert len({tuple(run_seeded(seed, 1, 0)) for seed in range(20)}) > 1
