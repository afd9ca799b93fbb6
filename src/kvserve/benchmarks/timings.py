"""What a run recorded: when each request's tokens appeared, and the decode-only steps.

Any system driven token by token records these, so its figures (TTFT,
inter-token latency, decode rate) are computed one way: kvserve's engine
(:func:`kvserve.benchmarks.offline.engine_driver.drive`) and llama.cpp's
batched decoder (:mod:`kvserve.benchmarks.baselines.llamacpp_batched`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.benchmarks.common import percentile


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
