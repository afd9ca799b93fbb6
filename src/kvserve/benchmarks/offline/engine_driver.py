"""Drive an LLMEngine step by step and record when every token of every request appeared."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.benchmarks.common import percentile
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


@dataclass
class RequestTrace:
    """Wall-clock times (perf_counter seconds) of one request's life."""

    arrival: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def finish(self) -> float:
        return self.token_times[-1]

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass
class DecodeStep:
    """A step that computed decode tokens only: its duration and each row's context length.

    wait_seconds: the part of ``seconds`` the host spent waiting for the device to finish
    the step's work (0 on a CPU, which does all of it itself); the rest is host time.
    """

    seconds: float
    context_lens: list[int]
    wait_seconds: float = 0.0

    @property
    def host_seconds(self) -> float:
        return self.seconds - self.wait_seconds


@dataclass
class DriveResult:
    traces: list[RequestTrace]
    wall_s: float
    num_steps: int
    decode_steps: list[DecodeStep] = field(default_factory=list)

    def output_tokens(self) -> int:
        return sum(len(t.token_times) for t in self.traces)

    def itl_percentile(self, q: float, indices: Sequence[int] | None = None) -> float:
        chosen = self.traces if indices is None else [self.traces[i] for i in indices]
        return percentile([gap for t in chosen for gap in t.inter_token_latencies], q)

    def mean_ms_per_token_per_seq(self) -> float:
        """Mean over requests of (decode time / decode tokens): what one stream's user sees."""
        per_seq = [
            (t.finish - t.token_times[0]) / (len(t.token_times) - 1)
            for t in self.traces
            if len(t.token_times) > 1
        ]
        return 1000 * sum(per_seq) / len(per_seq) if per_seq else 0.0

    def full_decode_steps(self, batch: int) -> list[DecodeStep]:
        """The decode-only steps that ran ``batch`` rows."""
        return [step for step in self.decode_steps if len(step.context_lens) == batch]

    def decode_tok_per_s(self, batch: int) -> float:
        """Tokens per second of the decode-only steps that ran ``batch`` rows (0.0 if none).

        The pure decode rate, prompt processing excluded: what llama.cpp's
        ``llama-batched-bench`` reports as S_TG.
        """
        full = self.full_decode_steps(batch)
        seconds = sum(step.seconds for step in full)
        return batch * len(full) / seconds if seconds else 0.0

    def mean_ttft(self) -> float:
        return sum(t.ttft for t in self.traces) / len(self.traces)


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
