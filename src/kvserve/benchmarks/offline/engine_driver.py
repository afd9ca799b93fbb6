"""Drive an LLMEngine step by step and record when every token of every request appeared."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.benchmarks.timings import DecodeStep, DriveResult, RequestTrace
from kvserve.engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from kvserve.structured import StructuredOutputsParams


@dataclass
class BenchRequest:
    """A request of a workload: prompt tokens, exact output length, and when it arrives.

    arrival_step: the engine step before which the request is added (0 = at the start).
    structured_outputs: what the output is constrained to, if anything.
    """

    prompt_token_ids: list[int]
    output_len: int
    arrival_step: int = 0
    structured_outputs: StructuredOutputsParams | None = None


def drive(engine: LLMEngine, requests: Sequence[BenchRequest]) -> DriveResult:
    """Run ``requests`` to completion, adding each one before its arrival step.

    Every request is greedy with ``ignore_eos`` so it produces exactly
    ``output_len`` tokens.
    """
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_step)
    traces: list[RequestTrace | None] = [None] * len(requests)
    decode_steps: list[DecodeStep] = []
    next_index = 0
    step = 0
    start = time.perf_counter()
    while next_index < len(order) or engine.has_unfinished_requests():
        while next_index < len(order) and requests[order[next_index]].arrival_step <= step:
            index = order[next_index]
            request = requests[index]
            params = SamplingParams(
                temperature=0,
                max_tokens=request.output_len,
                ignore_eos=True,
                structured_outputs=request.structured_outputs,
            )
            traces[index] = RequestTrace(time.perf_counter())
            engine.add_request(
                f"bench-{index}", {"prompt_token_ids": request.prompt_token_ids}, params
            )
            next_index += 1
        waited = engine.runner.device_wait_s
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        waited = engine.runner.device_wait_s - waited
        decode_only = engine.stats.num_prefill_tokens == 0 and engine.stats.num_decode_tokens > 0
        contexts = []
        for output in outputs:
            index = int(output.request_id.removeprefix("bench-"))
            trace = traces[index]
            assert trace is not None
            # The step's input is the latest output token: it attends to the prompt and to
            # every output so far, itself included.
            contexts.append(len(requests[index].prompt_token_ids) + len(trace.token_times))
            trace.token_times.extend(
                [now] * (len(output.outputs[0].token_ids) - len(trace.token_times))
            )
        if decode_only:
            decode_steps.append(DecodeStep(now - before, contexts, waited))
        step += 1
    wall = time.perf_counter() - start
    done = [t for t in traces if t is not None]
    for trace, request in zip(done, requests, strict=True):
        if len(trace.token_times) != request.output_len:
            raise RuntimeError("a benchmark request did not produce its exact output length")
    return DriveResult(done, wall, step, decode_steps)
