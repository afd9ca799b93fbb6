"""The dashboard's "send load" button: a few chat prompts, so a newcomer sees the engine move.

The load goes straight to the :class:`AsyncEngine` (no HTTP round trip, no
API key to pass around): ``num_requests`` prompts of different lengths and
answer lengths, at most ``concurrency`` at once, started a little apart so
the scheduler mixes prefill chunks with decodes. It is bounded in every way
(count, concurrency, tokens) and only one load runs at a time; a second
press while one runs is refused. A request the engine refuses (its queue is
full) counts as failed; the load goes on with the rest.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from kvserve.chat.encode import encode_chat
from kvserve.engine.async_errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from kvserve.engine.engine_client import EngineClient
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Short and long questions: long ones prefill in several chunks, short ones decode at once.
LOAD_PROMPTS = (
    "What is a KV cache, in two sentences?",
    "Write a haiku about a scheduler that never sleeps.",
    "Explain continuous batching to a new engineer. Compare it with static batching, where a "
    "batch waits for its longest request, and say why GPUs and CPUs both benefit from it.",
    "List five uses of a hash map.",
    "Tell a short story about a block of memory that is shared by three requests, and what "
    "happens to it when the first of them finishes, then the second, then the last one.",
    "Why is the sky blue?",
    "Summarize the rules of chess for someone who has never played a board game before, "
    "covering how each piece moves, check and checkmate, castling and promotion.",
    "Give three tips for writing readable Python.",
    "What does a paged attention kernel read, and in what order?",
    "Describe a quiet harbour at dawn in one paragraph.",
    "How do you make a cup of tea? Answer step by step.",
    "Name the planets of the solar system in order, with one fact about each.",
)
# Answer lengths, cycled: some requests finish early and free their blocks while others run on.
_MAX_TOKENS = (96, 160, 64, 128, 192, 48)
# Seconds between the first starts, so arrivals are staggered.
_START_GAP_S = 0.15
_ids = itertools.count()


class BuiltinLoad:
    """One bounded load at a time, through ``engine``.

    tokenizer_pool: renders chat templates off the event loop.
    on_change: called on the event loop when a load starts or ends.
    """

    def __init__(
        self,
        engine: EngineClient,
        tokenizer_pool: Executor,
        num_requests: int = len(LOAD_PROMPTS),
        concurrency: int = 6,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        if num_requests < 1:
            raise InvalidParameterError("num_requests", f"must be >= 1, got {num_requests}")
        if concurrency < 1:
            raise InvalidParameterError("concurrency", f"must be >= 1, got {concurrency}")
        self.engine = engine
        self.tokenizer_pool = tokenizer_pool
        self.num_requests = num_requests
        self.concurrency = concurrency
        self.on_change = on_change
        self._task: asyncio.Task[None] | None = None
        self.num_done = 0
        self.num_failed = 0

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def status(self) -> dict[str, Any]:
        """What the page shows beside the button."""
        return {
            "load": {
                "running": self.running,
                "done": self.num_done,
                "failed": self.num_failed,
                "total": self.num_requests,
            }
        }

    def start(self) -> bool:
        """Start a load on the running event loop; False (nothing started) while one runs."""
        if self.running:
            return False
        self.num_done = 0
        self.num_failed = 0
        self._task = asyncio.create_task(self._run())
        self._changed()
        return True

    async def stop(self) -> None:
        """Cancel a running load (its requests are aborted) and wait for it."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        semaphore = asyncio.Semaphore(self.concurrency)

        async def one(index: int) -> None:
            await asyncio.sleep(min(index, self.concurrency) * _START_GAP_S)
            async with semaphore:
                ok = await self._request(index)
            self.num_done += 1
            self.num_failed += not ok
            self._changed()

        try:
            await asyncio.gather(*(one(index) for index in range(self.num_requests)))
        finally:
            self._task = None
            self._changed()

    async def _request(self, index: int) -> bool:
        prompt = LOAD_PROMPTS[index % len(LOAD_PROMPTS)]
        loop = asyncio.get_running_loop()
        try:
            token_ids = await loop.run_in_executor(self.tokenizer_pool, self._render, prompt)
            # A small model's context may be short: the answer takes what room is left.
            room = self.engine.limits.max_model_len - len(token_ids)
            max_tokens = max(min(_MAX_TOKENS[index % len(_MAX_TOKENS)], room), 1)
            params = SamplingParams(temperature=0.8, top_p=0.95, seed=index, max_tokens=max_tokens)
            prepared = self.engine.prepare(f"load-{next(_ids)}", token_ids, params)
            async with self.engine.generate([prepared]) as stream:
                async for _ in stream:
                    pass
        except (
            InvalidParameterError,
            EngineOverloadedError,
            EngineDeadError,
            RequestFailedError,
        ) as exc:
            logger.warning("the dashboard's load request %d failed: %s", index, exc)
            return False
        return True

    def _render(self, prompt: str) -> list[int]:
        """The prompt through the chat template, or as plain text for a model without one."""
        tokenizer = self.engine.tokenizer
        if tokenizer.chat_template:
            return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
        return list(tokenizer.encode(prompt))

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
