"""Drive an engine step by step and note, per step and per request, what happened.

The demos measure the engine from outside: they call ``LLMEngine.step`` and
look at the scheduler's running set and the outputs after each step. A
request counts as scheduled in a step when it is running after it or
finished in it; the tokens whose K/V it holds during the step are its
computed tokens then (for one that finished: prompt + output - 1, since the
last sampled token is never fed back).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepRecord:
    """One engine step.

    index: 1-based, counted over the whole log (a log may span several batches).
    end_s: seconds from the log's origin to the end of the step.
    tokens_held: request id -> tokens whose K/V the request held during the step.
    finished: ids of the requests that finished in this step.
    """

    index: int
    end_s: float
    tokens_held: dict[str, int]
    finished: tuple[str, ...]


@dataclass
class RequestSpan:
    """One request's life, in steps and in seconds from the log's origin; None until it happens.

    first_step, first_s: the first step that computed any of its tokens (and its start).
    first_token_s: the end of the step that produced its first token.
    finish_step, finish_s: the step that produced its last token (and its end).
    """

    request_id: str
    num_prompt_tokens: int
    submit_s: float
    first_step: int | None = None
    first_s: float | None = None
    first_token_s: float | None = None
    finish_step: int | None = None
    finish_s: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def _finished(self) -> tuple[int, float, int, float]:
        """first_step, first_s, finish_step, finish_s of a finished request."""
        if self.first_step is None or self.first_s is None:
            raise RuntimeError(f"request {self.request_id} has not been scheduled")
        if self.finish_step is None or self.finish_s is None:
            raise RuntimeError(f"request {self.request_id} has not finished")
        return self.first_step, self.first_s, self.finish_step, self.finish_s

    @property
    def num_steps(self) -> int:
        """Steps from its first scheduled step to its last, both included."""
        first_step, _, finish_step, _ = self._finished()
        return finish_step - first_step + 1

    @property
    def latency_s(self) -> float:
        """From submission to its last token."""
        return self._finished()[3] - self.submit_s

    @property
    def ttft_s(self) -> float:
        """From submission to its first token."""
        if self.first_token_s is None:
            raise RuntimeError(f"request {self.request_id} has no token yet")
        return self.first_token_s - self.submit_s

    def to_json(self) -> dict[str, Any]:
        """The finished request's span."""
        first_step, first_s, finish_step, finish_s = self._finished()
        return {
            "request_id": self.request_id,
            "prompt_tokens": self.num_prompt_tokens,
            "answer_tokens": len(self.output_token_ids),
            "finish_reason": self.finish_reason,
            "submit_s": self.submit_s,
            "first_step": first_step,
            "first_s": first_s,
            "first_token_s": self.first_token_s,
            "finish_step": finish_step,
            "finish_s": finish_s,
            "latency_s": self.latency_s,
        }


class StepLog:
    """Records the steps an engine takes; ``origin`` is ``time.monotonic()`` at time zero.

    Requests submitted through the log must have ``n == 1``: a span per request id.
    """

    def __init__(self, engine: LLMEngine, origin: float | None = None) -> None:
        self.engine = engine
        self.origin = time.monotonic() if origin is None else origin
        self.steps: list[StepRecord] = []
        self.spans: dict[str, RequestSpan] = {}

    def now(self) -> float:
        return time.monotonic() - self.origin

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        queued_s: float | None = None,
    ) -> None:
        """Queue a request on the engine and start its span.

        queued_s: when the request joined the demo's queue, if the demo held it
            back before submitting it (static batching); default now.
        """
        self.engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params)
        submit_s = self.now() if queued_s is None else queued_s
        self.spans[request_id] = RequestSpan(request_id, len(prompt_token_ids), submit_s)

    def run(self) -> None:
        """Step until every request submitted so far has finished."""
        while any(span.finish_reason is None for span in self.spans.values()):
            self.step()

    def step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        end_s = self.now()
        index = len(self.steps) + 1
        tokens_held = {
            request.request_id: request.num_computed_tokens
            for request in self.engine.scheduler.running
        }
        finished = []
        for output in outputs:
            span = self.spans[output.request_id]
            completion = output.outputs[0]
            if span.first_token_s is None:
                span.first_token_s = end_s
            if output.finished:
                span.output_token_ids = list(completion.token_ids)
                span.finish_reason = completion.finish_reason
                span.finish_step, span.finish_s = index, end_s
                finished.append(output.request_id)
                tokens_held[output.request_id] = (
                    len(output.prompt_token_ids) + len(completion.token_ids) - 1
                )
        start_s = self.steps[-1].end_s if self.steps else 0.0
        for request_id in _first_seen(tokens_held, self.spans):
            span = self.spans[request_id]
            span.first_step, span.first_s = index, max(start_s, span.submit_s)
        self.steps.append(StepRecord(index, end_s, tokens_held, tuple(finished)))
        return outputs


def _first_seen(request_ids: Iterable[str], spans: dict[str, RequestSpan]) -> list[str]:
    return [rid for rid in request_ids if rid in spans and spans[rid].first_step is None]


def warm_up(engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int = 4) -> None:
    """Run ``prompts`` together through ``engine`` for a few tokens, so that one-time costs
    (first allocations, kernel set-up for this batch size) land outside the measured run."""
    log = StepLog(engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for index, prompt in enumerate(prompts):
        log.submit(f"warm-up-{index}", prompt, params)
    log.run()
