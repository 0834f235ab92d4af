"""One model step of the model runner, in two halves (ModelRunner mixes this in):

- launch(plan): the plan's state changes, the flat inputs, the forward, the logits and the
  sampler's choice of tokens, all queued on the device; nothing is read back. On a GPU the
  call returns while the step runs.
- finish(launched): the sampled tokens read back (the one wait on the device), appended to
  the requests, and the StepResult.

execute(plan) is finish(launch(plan)). Asynchronous steps (the worker's run_ahead, issue
"Keep the GPU busy") launch step N + 1 before finishing step N: a decode of N + 1 whose
input is N's token takes it from N's sampled tensor on the device (step_inputs.py), so the
host prepares N + 1 while the device still computes N. Only a step that reads nothing of
N on the host may run ahead (runs_ahead): no drafts, no processor that reads the outputs on
the host (grammars, bad words, custom processors), no tensor parallelism, images, pooling
or KV-tier copies. A request the plan drops while N still samples it is let go when N is
finished (its sampler slot and block-table row must outlive N)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from actors.lora.batch import LoRABatch, segments_of
from actors.layers.sampler import SampledStep, prompt_token_logprobs
from actors.spec_decode.speculator import StepDrafts
from messages.pooling import PooledData
from messages.scheduler import StepResult, TokenLogprobs
from messages.worker import StepPlan


@dataclass
class LaunchedStep:
    """A step launched and not yet finished: what finish() needs."""

    plan: StepPlan
    failed_loads: list[int]
    samplers: list = field(default_factory=list)  # the requests that sample a token, in row order
    sampled: SampledStep | None = None
    drafts: StepDrafts = field(default_factory=lambda: StepDrafts({}))
    emitted: list[list[int]] = field(default_factory=list)  # verified drafts (read back at launch)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    pooled: dict[str, PooledData] = field(default_factory=dict)
    has_logits: bool = False
    event: torch.cuda.Event | None = None  # recorded after the step's work (CUDA)

    def done(self) -> bool:
        """Whether the device has finished the step (finish() would not wait)."""
        return self.event is None or self.event.query()

    @property
    def sampled_tokens(self) -> torch.Tensor | None:
        """[samplers] int64 on the device: what a step launched after this one reads."""
        return self.sampled.sampled if self.sampled is not None else None


class StepExecution:
    """The step methods of ModelRunner (see the module docstring)."""

    steps_run_ahead = 0  # steps launched before the one before them was finished

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def runs_ahead(self, plan: StepPlan) -> bool:
        """Whether this plan may be launched before the step launched last is finished."""
        if not self.can_run_ahead or plan.blocks_to_swap_out or plan.blocks_to_swap_in or plan.blocks_to_save \
                or plan.blocks_to_load or plan.num_lookahead_tokens:
            return False
        requests = self.requests
        for new in plan.new_requests:  # (a request resumed while the last step still samples it)
            if new.request_id in requests and requests[new.request_id].sampled_row is not None:
                return False
        readers = self.sampler.output_readers()
        if not readers:
            return True
        for request_id in plan.num_scheduled_tokens:
            request = requests.get(request_id)
            if request is not None and request.sampled_row is not None \
                    and self.sampler.reads_output(request_id, readers):
                return False
        return True

    @property
    def can_run_ahead(self) -> bool:
        """Whether any step of this runner may run ahead (the features that read back at launch are off)."""
        return (self.speculator is None and self.vision is None and self.pooling is None and self.encoder is None
                and not self.parallel.enabled)

    def step_ahead(self, plan: StepPlan, launched: LaunchedStep | None
                   ) -> tuple[list[tuple[StepPlan, StepResult]], LaunchedStep | None]:
        """One step of asynchronous scheduling: launches plan before finishing `launched` (the
        step launched last, or None) where plan may run ahead, else after it. Returns the steps
        finished now with their results, in order, and the step left launched (None when plan
        has no tokens: it is finished at once)."""
        finished = []
        if launched is not None and (not plan.num_scheduled_tokens or not self.runs_ahead(plan)):
            finished.append((launched.plan, self.finish(launched)))
            launched = None
        new = self.launch(plan, launched)
        if launched is not None:
            finished.append((launched.plan, self.finish(launched)))
        if plan.num_scheduled_tokens:
            return finished, new
        finished.append((plan, self.finish(new)))
        return finished, None

    @torch.inference_mode()
    def launch(self, plan: StepPlan, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queues the plan's step; previous: the step launched before it, not yet finished
        (its sampled tokens feed this step's decodes), or None."""
        if previous is not None:
            self.steps_run_ahead += 1
        self.update_states(plan)
        # the plan's copies between the KV tiers, before its forward; the host blocks whose disk load failed
        failed_loads = self.host_kv.run(plan) if self.host_kv is not None else []
        if not plan.num_scheduled_tokens:
            return LaunchedStep(plan, failed_loads)
        scheduled = [(self.requests[request_id], num_tokens)
                     for request_id, num_tokens in plan.num_scheduled_tokens.items()]
        # 1. drafts: a decode granted some verifies them as a causal chunk after its token
        #    (appended to its tokens for this step only)
        drafts = self._propose(plan, scheduled)
        # 2. order the batch: decodes first, then prefill chunks (each by LoRA adapter)
        batch, lora = self._order_batch([(request, num_tokens + drafts.num_drafts(request))
                                         for request, num_tokens in scheduled] if drafts else scheduled)
        # 3. flat inputs and attention metadata
        input_ids, positions, attention = self._prepare_inputs(
            batch, lora, previous.sampled_tokens if previous is not None else None)
        # 4. rows that need logits: each sampling request's last token (every scored position
        #    of a speculated decode), prompt-logprob positions
        sample_rows, samplers, prompt_rows = self._logit_rows(batch)
        sample_rows, samplers, spec_rows = drafts.split_rows(sample_rows, samplers)
        embeds, positions = self.vision.step_inputs(self.model, input_ids, positions, batch) \
            if self.vision is not None else (None, positions)  # (Qwen2-VL: M-RoPE's positions too)
        hidden = self._forward(input_ids, positions, attention, lora, embeds)
        launched = LaunchedStep(plan, failed_loads, samplers, drafts=drafts, pooled=self._pool(hidden, batch))
        rows = sample_rows + spec_rows + [row for _, rows_of_request, _ in prompt_rows for row in rows_of_request]
        # (a collective under tensor parallelism: the logits end up on rank 0 only)
        if rows and rows != list(range(hidden.shape[0])):  # (every row, as a decode step has: no gather)
            hidden = hidden.index_select(0, self.stager.index(np.array(rows, np.int64)))
        logits = self.model.compute_logits(hidden) if rows else None
        # 5. sample (rank 0, which then hands its tokens to the other ranks) and verify, and
        #    advance every scheduled request
        if logits is not None:
            launched.has_logits = True
            if samplers:
                launched.sampled = self.sampler.launch(logits[: len(sample_rows)], [r.request_id for r in samplers])
            if drafts:
                launched.emitted = drafts.verify(logits[len(sample_rows): len(sample_rows) + len(spec_rows)])
            launched.prompt_logprobs = self._prompt_logprobs(logits, len(sample_rows) + len(spec_rows), prompt_rows)
        for request, num_tokens in batch:  # (a speculated decode advances by what verify accepts)
            if not drafts or not drafts.num_drafts(request):
                request.num_computed_tokens += num_tokens
        for row, request in enumerate(samplers):  # (its token stays on the device until finish)
            request.sampled_row, request.sampled_by = row, launched
        if self.device.type == "cuda":
            launched.event = torch.cuda.Event()
            launched.event.record()
        return launched

    def finish(self, launched: LaunchedStep) -> StepResult:
        """The launched step's result: its tokens read back and appended to their requests."""
        plan, samplers, drafts = launched.plan, launched.samplers, launched.drafts
        tokens, logprobs = self.sampler.finish(launched.sampled) if launched.sampled is not None else ([], None)
        tokens = self.parallel.broadcast_tokens(tokens, len(samplers), self.device)
        emitted = self.parallel.broadcast_token_rows(launched.emitted, len(drafts), drafts.width, self.device)
        for request, token in zip(samplers, tokens):
            request.token_ids.append(token)
            if request.sampled_by is launched:  # (else a step launched since samples it again)
                request.sampled_row = request.sampled_by = None
        drafts.apply(emitted, self.sampler if launched.has_logits else None)
        self.release_dropped()
        if not plan.num_scheduled_tokens:
            return StepResult(step_id=plan.step_id, request_ids=[], sampled_token_ids=[],
                              failed_loads=launched.failed_loads)
        if logprobs is not None and drafts:  # a request asking for logprobs never speculates
            logprobs = logprobs + [TokenLogprobs([], [], [])] * len(drafts)
        return StepResult(step_id=plan.step_id, request_ids=[r.request_id for r in samplers + drafts.requests],
                          sampled_token_ids=tokens + [t[-1] for t in emitted], logprobs=logprobs,
                          prompt_logprobs=launched.prompt_logprobs, pooled=launched.pooled,
                          **drafts.result_fields(emitted), failed_loads=launched.failed_loads)

    def _propose(self, plan: StepPlan, scheduled: list) -> StepDrafts:
        """The drafts of the decodes the plan granted some, appended to their tokens."""
        if self.speculator is None:
            return StepDrafts({})
        return self.speculator.propose_step(plan.num_lookahead_tokens, scheduled)

    def _pool(self, hidden: torch.Tensor, batch: list) -> dict[str, PooledData]:
        """The pooled outputs of the pooling requests whose prompt ends this step (rank 0,
        which answers the scheduler, pools; every rank has the whole hidden states)."""
        if self.pooling is None or self.parallel.rank != 0:
            return {}
        spans, row = [], 0
        for request, num_tokens in batch:
            if request.pooling is not None:
                spans.append(self.pooling.span(request.request_id, row, request.num_computed_tokens, num_tokens,
                                               request.num_prompt_tokens))
            row += num_tokens
        return self.pooling.outputs(hidden, spans) if spans else {}

    def _order_batch(self, batch: list) -> tuple[list, LoRABatch | None]:
        """Decodes first, then prefill chunks; with LoRA adapters in the step, each kind
        grouped by adapter slot, and the step's LoRABatch."""
        loras = [request.lora for request, _ in batch if request.lora is not None]
        if not loras:
            return sorted(batch, key=lambda item: item[1] != 1), None
        slot_of = self.lora_slots.slots_for(loras)

        def slot(request) -> int:
            return -1 if request.lora is None else slot_of[(request.lora.lora_int_id, request.lora.lora_path)]

        batch = sorted(batch, key=lambda item: (item[1] != 1, slot(item[0])))
        return batch, LoRABatch(self.lora_slots, segments_of([(slot(request), n) for request, n in batch]))

    @staticmethod
    def _logit_rows(batch: list):
        sample_rows: list[int] = []
        samplers: list = []
        prompt_rows: list[tuple] = []  # request, rows, next tokens
        offset = 0
        for request, num_tokens in batch:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
            if request.pooling is not None:  # pooled, never sampled (_pool)
                offset += num_tokens
                continue
            # (a token the last step sampled and the device still holds counts as known)
            if end == len(request.token_ids) + (request.sampled_row is not None):
                sample_rows.append(offset + num_tokens - 1)
                samplers.append(request)
            if request.params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                # position p predicts prompt token p + 1
                last = min(end, request.num_prompt_tokens - 1)
                prompt_rows.append((request, list(range(offset, offset + last - start)),
                                    request.token_ids[start + 1: last + 1]))
            offset += num_tokens
        return sample_rows, samplers, prompt_rows

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor | None, first_row: int,
                         prompt_rows: list) -> dict[str, list[TokenLogprobs]]:
        result = {}
        row = first_row
        for request, rows, next_tokens in prompt_rows:
            chunk = logits[row: row + len(rows)]
            result[request.request_id] = prompt_token_logprobs(chunk, next_tokens,
                                                               request.params.prompt_logprobs)
            row += len(rows)
        return result
