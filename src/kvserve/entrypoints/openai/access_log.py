"""The access log: one line per HTTP request, on the ``kvserve.access`` logger.

``cmpl-... /v1/completions status=200 prompt_tokens=12 generated_tokens=64
ttft=0.084s total=1.520s finish=length``. Times are seen from the server:
from the request's arrival to its first generated token and to its end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvserve.engine.output_stream import RequestDelta
from kvserve.entrypoints.openai.protocol import UsageInfo

access_logger = logging.getLogger("kvserve.access")
# Set in a request's ASGI scope when the server cut its body off (connection_limits.py):
# its line then says 408, the server's decision, rather than 499, the client leaving.
BODY_TIMEOUT_SCOPE_KEY = "kvserve.body_timed_out"


@dataclass
class AccessLog:
    """One line per request: id, status, tokens, time to first token, total time."""

    request_id: str
    endpoint: str
    started: float
    status: int = 200
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None

    def count(self, delta: RequestDelta) -> None:
        """Add a delta's tokens."""
        num_new = sum(len(output.token_ids) for output in delta.outputs)
        if num_new and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.num_generated_tokens += num_new
        for output in delta.outputs:
            self.finish_reason = output.finish_reason or self.finish_reason

    def usage(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_generated_tokens,
            total_tokens=self.num_prompt_tokens + self.num_generated_tokens,
        )

    def write(self) -> None:
        now = time.perf_counter()
        ttft = "-" if self.first_token_at is None else f"{self.first_token_at - self.started:.3f}s"
        access_logger.info(
            "%s %s status=%d prompt_tokens=%d generated_tokens=%d ttft=%s total=%.3fs finish=%s",
            self.request_id,
            self.endpoint,
            self.status,
            self.num_prompt_tokens,
            self.num_generated_tokens,
            ttft,
            now - self.started,
            self.finish_reason or "-",
        )
