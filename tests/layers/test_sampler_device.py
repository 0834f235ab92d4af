"""The sampler and the logits processors make every tensor on the logits' device, with
no GPU needed to check it:

- the processors run whole on `meta` logits, and every tensor made meanwhile must be on
  `meta` (one made on the CPU by name, or by default, shows up);
- the whole sampler runs on CPU logits with `meta` as the default device, and every
  tensor made meanwhile must be on the CPU (one made without naming the logits' device,
  which on a GPU would land on the CPU, shows up as `meta`);
- on CUDA (marked gpu), temperature 1.0 and everything else, every tensor on CUDA but the
  pinned host buffers that carry values to and from it (a copy from pageable memory could
  wait for the device)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from actors.layers.sampler import Sampler
from messages.common import SamplingParams
from tests.layers.test_sampler import EOS, KINDS, VOCAB

EVERY_PROCESSOR = KINDS + [SamplingParams(logits_processors=[lambda output, row: row.mul_(0.5)])]


class TensorDevices(TorchFunctionMode):
    """Records the device of every tensor a torch function returns, with the function."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[torch.device, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor) and not (value.device.type == "cpu" and value.is_pinned()):
                self.made.setdefault(value.device, getattr(func, "__name__", repr(func)))
        return result


def add_every_kind(sampler: Sampler) -> list[int]:
    keys = list(range(len(EVERY_PROCESSOR)))
    for key, params in zip(keys, EVERY_PROCESSOR):
        sampler.add_request(key, params, [3, 4, 5, 9], [8, 30, 31, 5, 5])
    return keys


def test_the_logits_processors_make_nothing_off_a_meta_device():
    sampler = Sampler(EOS, seed=0)
    keys = add_every_kind(sampler)
    logits = torch.empty(len(keys), VOCAB, device="meta")
    for _ in range(2):  # the first step builds the per-slot tables, the second reuses them
        rows = sampler.batch.rows(keys, logits.device)
        with TensorDevices() as record:
            for processor in sampler.processors:
                assert processor.wants(rows), type(processor).__name__
                processor.apply(logits, rows)
                processor.on_sampled(rows, torch.zeros(len(keys), dtype=torch.long, device="meta"))
        assert set(record.made) == {torch.device("meta")}, record.made
        sampler.batch.append_tokens(rows, [2] * len(keys))


def run_every_kind(device: str) -> dict[torch.device, str]:
    sampler = Sampler(EOS, seed=0)
    keys = add_every_kind(sampler)
    made: dict[torch.device, str] = {}
    for step in range(3):
        logits = torch.randn(len(keys), VOCAB, generator=torch.Generator().manual_seed(step), device="cpu").to(device)
        with TensorDevices() as record:
            tokens, logprobs = sampler.sample(logits, keys)
        made.update(record.made)
        assert len(tokens) == len(keys)
    return made


def test_the_sampler_makes_nothing_on_the_default_device():
    with torch.device("meta"):
        made = run_every_kind("cpu")
    assert set(made) == {torch.device("cpu")}, made


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_sampler_makes_nothing_off_the_gpu():
    params = SamplingParams(temperature=1.0)  # the OpenAI default, which once failed on CUDA
    sampler = Sampler(EOS, seed=0)
    sampler.add_request("default", params, [3, 4], [])
    with TensorDevices() as record:
        tokens, _ = sampler.sample(torch.randn(1, VOCAB, device="cuda"), ["default"])
    assert 0 <= tokens[0] < VOCAB and set(record.made) == {torch.device("cuda", 0)}, record.made
    made = run_every_kind("cuda")
    assert set(made) == {torch.device("cuda", 0)}, made
