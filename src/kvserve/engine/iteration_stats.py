"""What the async engine's loop reports after each iteration, for metrics and logs.

An iteration applies the callers' commands (add, abort) and runs at most one
step. What the step did is the engine's own :class:`StepReport`, carried
here as it is; this record adds what only the loop knows: the requests'
latencies and ends as their streams saw them, and the queues and blocks after
the commands too (an abort frees blocks without a step).

Plain data, no Prometheus: the server's metrics module turns these into
gauges, counters and histograms, and a test can read them directly. Names
follow vLLM's (``IterationStats``, ``FinishedRequestStats``). Times are
seconds, measured with ``time.monotonic()`` by the loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.step_report import StepReport


@dataclass(frozen=True)
class FinishedRequestStats:
    """One request that ended in this iteration (finished, aborted or failed)."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float


@dataclass
class IterationStats:
    """The engine's state after one loop iteration and what happened in it.

    num_running, num_waiting: sequences in the scheduler's running set and in
        its queue after the iteration.
    ran_step: a forward pass ran (False when only commands were applied).
    batch_size: sequences in the running set during the step, those that
        finished in it included (0 when no step ran).
    num_prompt_tokens: prompt tokens of requests that got their first token.
    num_generation_tokens: tokens sampled in this step, over all sequences.
    time_to_first_token, queue_time: one entry per request that got its first token.
    inter_token_latency: one entry per request that got a later token.
    report: the report of the step that ran (None when none ran, or it raised).
    """

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    ran_step: bool = False
    batch_size: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    report: StepReport | None = None
