"""What the executor receives: plans from the scheduler, results from rank 0."""

from __future__ import annotations

from messages.common import Ping, Shutdown
from messages.scheduler import StepResult
from messages.worker import StepPlan

ExecutorInbox = StepPlan | StepResult | Ping | Shutdown
