"""The scheduler's side of pipeline parallelism: keep one plan in flight per stage.

With P stages, P plans in flight let every stage work at once, on different plans. Two
things change against async scheduling's two plans (scheduler/actor.py):
- a decode's input is the previous step's sample, which the first stage has only once the
  last stage has sampled it: a request whose sample is in flight is left out of the next
  plans (Scheduler.skip_sampling_in_flight), so the plans in flight hold disjoint decodes
  and none waits for another (prefill chunks of one prompt may still follow each other:
  each stage runs the plans in order, so a chunk's KV is written before the next needs it);
- the next plan is sent at once, not timed to the end of the running one (StepTimer): it
  runs on the first stage while the running one moves on to the next stages;
- each plan gets 1/P of max_num_batched_tokens: P micro-batches of the step budget, so
  that requests arriving together are admitted into P groups of similar size (and decode
  in those groups) rather than one big plan and a few small ones, and its admissions are
  capped at its share of the requests (BalancedAdmission) for requests that all fit one
  plan's budget; on the offline workload at P = 2 the stages' busy share went from ~0.62
  to ~0.75 (benchmarks/pipeline.py)."""

from __future__ import annotations

from actors.scheduler.priority import PriorityScheduler


class SendAtOnce:
    """StepTimer's interface, never asking to wait."""

    def sent(self, step_id: int, num_tokens: int, now: float) -> None:
        pass

    def finished(self, step_id: int, now: float) -> None:
        pass

    def dispatch_delay(self, now: float) -> float:
        return 0.0


def keep_pipeline_full(actor, pipeline_parallel_size: int) -> None:
    """Sets a SchedulerActor up for pipeline_parallel_size stages (with async scheduling on;
    off, one plan at a time still runs, stage after stage)."""
    if pipeline_parallel_size == 1:
        return
    actor.scheduler.skip_sampling_in_flight = True
    if actor.max_plans_in_flight > 1:
        actor.max_plans_in_flight = max(2, pipeline_parallel_size)
        actor.step_timer = SendAtOnce()
        # a plan's share of the step budget: requests arriving together are admitted over P
        # plans, and their decodes stay in those P groups, so no stage waits on one big plan
        scheduler = actor.scheduler
        scheduler.max_num_batched_tokens = -(-scheduler.max_num_batched_tokens // actor.max_plans_in_flight)
        if not isinstance(scheduler, PriorityScheduler):  # whose cap would make urgent requests preempt others
            scheduler.schedule = BalancedAdmission(scheduler, actor.max_plans_in_flight)


class BalancedAdmission:
    """Scheduler.schedule with a plan's admissions capped at its share of the requests:
    requests that fit one plan's budget (16 prompts of 64 tokens, say) would otherwise all
    start in the first plan and decode as one group, leaving the other plans empty."""

    def __init__(self, scheduler, num_plans: int) -> None:
        self.scheduler = scheduler
        self.schedule = scheduler.schedule  # the bound method, before this replaces it
        self.num_plans = num_plans
        self.max_num_seqs = scheduler.max_num_seqs

    def __call__(self):
        scheduler = self.scheduler
        in_other_plans = sum(1 for seq in scheduler.running if seq.num_pending_tokens)
        share = -(-(len(scheduler.running) + len(scheduler.waiting)) // self.num_plans)
        scheduler.max_num_seqs = min(self.max_num_seqs, in_other_plans + share)
        try:
            return self.schedule()
        finally:
            scheduler.max_num_seqs = self.max_num_seqs
