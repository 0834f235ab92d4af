"""Scheduler.update: what a StepResult means for the sequences its plan scheduled.

The second half of the Scheduler (scheduler.py builds the plans): the computed tokens
count, the sampled tokens are appended and checked against the stop conditions, the
blocks they filled are offered to the prefix cache, and each sequence that gained tokens,
prompt logprobs or finished tells the detokenizer what it gained (StepOutputs).

Most of a step's sequences are decodes that sampled one token and ask for nothing more;
they take a short path, in update()'s loop, that touches only what such a step changes, and
those that go on reach the detokenizer as columns (StepOutputs.decode_*), not a NewTokens
each. It runs once per sequence and step, which at a few hundred sequences is the
engine's host cost, so it checks the stop conditions only for a token that can stop the
sequence.
"""

from __future__ import annotations

from actors.scheduler.in_flight import PlanInFlight, check_result
from actors.scheduler.request import Sequence
from actors.scheduler.speculation import append_until_stop
from messages.detokenizer import NewTokens, StepOutputs
from messages.frontend import PoolingResult
from messages.scheduler import StepResult, TokenLogprobs
from messages.worker import StepPlan


class SchedulerUpdates:
    """Scheduler's update(); the attributes it reads are the Scheduler's."""

    _in_flight: dict[int, PlanInFlight]

    def update(self, plan: StepPlan, result: StepResult) -> StepOutputs:
        """Applies one step's result: computed tokens, sampled tokens, finished sequences.
        What each sequence that gained tokens, prompt logprobs or finished gained, for the
        detokenizer. Raises ValueError when the result does not answer the plan."""
        if plan.blocks_to_load:
            self.kv_tiers.loaded(plan, result.failed_loads)
        if not plan.num_scheduled_tokens:
            return StepOutputs(plan.step_id, [])
        in_flight = self._in_flight.get(plan.step_id)
        if in_flight is None:
            raise ValueError(f"update() for step {plan.step_id}, which has no plan in flight")
        sample_index = check_result(plan, result, in_flight)
        del self._in_flight[plan.step_id]
        updates: list[NewTokens] = []
        decode_request_ids: list[str] = []
        decode_indexes: list[int] = []
        decode_token_ids: list[int] = []
        num_step_tokens = 0
        kv_cache, eos_token_ids, sampled_token_ids = self.kv_cache_manager, self.eos_token_ids, result.sampled_token_ids
        caches_blocks, block_size = kv_cache.enable_prefix_caching, kv_cache.block_size
        for seq, generation, num_computed_before, num_new_tokens, samples, num_drafts in in_flight.entries:
            if seq.generation != generation:
                continue  # finished, aborted or preempted since the plan was built (each bumps it)
            plain_decode = samples and not num_drafts and seq.decodes_plainly \
                and num_computed_before >= seq.num_prompt_tokens
            if not plain_decode:
                output = self._apply_step(seq, num_computed_before, num_new_tokens, samples, num_drafts, result,
                                          sample_index.get(seq.seq_id))
                if output is not None:
                    updates.append(output)
                    num_step_tokens += len(output.new_token_ids)
                    if output.first_scheduled_time is not None and output.index == 0:
                        num_step_tokens += output.num_prompt_tokens  # the request's first token: its prompt, once
                continue
            # A plain decode, past its prompt, sampled one token (no drafts, logprobs or
            # pooling): what _apply_step does, in the same order, minus what cannot apply.
            num_computed_after = num_computed_before + num_new_tokens
            seq.prompt_computed = True
            if caches_blocks and num_computed_after >= (seq.num_cached_blocks + 1) * block_size:
                kv_cache.cache_blocks(seq, num_computed_after)  # it filled a block
            seq.num_pending_tokens -= 1
            token_id = sampled_token_ids[sample_index[seq.seq_id]]
            token_ids = seq.token_ids
            token_ids.append(token_id)
            num_step_tokens += 1
            if ((token_id in seq.stopping_token_ids or len(token_ids) >= seq.max_num_tokens)
                    and (stop := seq.stop_condition(eos_token_ids)) is not None):
                self._retire(seq, *stop)
                updates.append(NewTokens(seq.request_id, seq.index, [token_id], None, None, seq.finish_reason,
                                         seq.stop_reason, seq.num_prompt_tokens, seq.num_cached_tokens))
            else:
                decode_request_ids.append(seq.request_id)
                decode_indexes.append(seq.index)
                decode_token_ids.append(token_id)
        if num_step_tokens:
            self.iteration_tokens.observe(num_step_tokens)
        return StepOutputs(plan.step_id, updates, decode_request_ids, decode_indexes, decode_token_ids)

    def _apply_step(self, seq: Sequence, num_computed_before: int, num_new_tokens: int, samples: bool,
                    num_drafts: int, result: StepResult, sample_index: int | None) -> NewTokens | None:
        num_computed_after = num_computed_before + num_new_tokens
        if num_computed_before < seq.num_prompt_tokens:
            self.num_computed_prefill_tokens += min(num_computed_after, seq.num_prompt_tokens) - num_computed_before
        if num_computed_after >= seq.num_prompt_tokens:
            seq.prompt_computed = True
        self.kv_cache_manager.cache_blocks(seq, num_computed_after)
        prompt_logprobs = seq.take_prompt_logprobs(num_computed_before,
                                                     result.prompt_logprobs.get(seq.seq_id))

        new_token_ids: list[int] = []
        new_logprobs: list[TokenLogprobs] | None = None
        if samples and seq.pooling_params is not None:  # its prompt is done: so is the request
            self.pooling_results.append(PoolingResult(seq.request_id, result.pooled[seq.seq_id], seq.token_ids,
                                                      seq.num_cached_tokens))
            self._retire(seq, "stop", None)
            return None
        if samples:
            # accepted drafts come before the sampled token; none unless drafts were granted
            accepted = result.accepted_token_ids.get(seq.seq_id, []) if num_drafts else []
            if seq.params.logprobs is not None and result.logprobs is not None:
                new_logprobs = [result.logprobs[sample_index]]  # a request with logprobs never speculates
            seq.num_pending_tokens -= 1
            seq.num_drafts_in_flight -= num_drafts
            if self.draft_slots is not None:
                self.draft_slots.observe(seq, num_drafts, result.num_draft_tokens.get(seq.seq_id, 0),
                                         len(accepted))
            new_token_ids, stop = append_until_stop(seq, [*accepted, result.sampled_token_ids[sample_index]],
                                                    self.eos_token_ids)
            if stop is not None:
                self._retire(seq, *stop)
            elif accepted:  # their KV is verified: the scheduler catches up with the worker
                seq.num_computed_tokens += len(accepted)
                self.kv_cache_manager.cache_blocks(seq, num_computed_after + len(accepted))

        if not new_token_ids and prompt_logprobs is None:
            return None
        is_first_token = bool(new_token_ids) and seq.num_output_tokens == 1
        return NewTokens(request_id=seq.request_id, index=seq.index, new_token_ids=new_token_ids,
                         new_logprobs=new_logprobs, prompt_logprobs=prompt_logprobs,
                         finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                         num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                         first_scheduled_time=seq.first_scheduled_time if is_first_token else None)
