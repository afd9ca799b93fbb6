"""Frames from a recorded step trace, for ``kvserve dashboard --trace FILE``.

A step trace (see ``kvserve/trace/records.py``) says what each step computed
for which request (token ranges, phases), which requests were preempted or
finished, and the pool's totals; it does not record block ids, arrival
times or the ids of requests that never ran yet. So the replay:

- places blocks itself (``layout: "simulated"``): a request holds
  ``ceil(computed / block_size)`` blocks, handed out in the real pool's
  order (``core/block_pool.py``): written blocks that keep no prefix first,
  the most recently released first, then never-written blocks, then cached
  ones, least recently released first; a request gives its blocks back last
  block first. With prefix caching, a released request's full blocks stay
  marked cached until reused, and a request readmitted with a prefix hit takes its own
  cached blocks back while they last. Prefixes shared *between* requests
  are not in the trace, so the grid shows no shared blocks. The totals are
  the trace's own: ``blocks_cached`` exactly, ``blocks_used`` less the
  blocks of the requests that finished in the step (the trace counts them
  while the forward pass ran, the frame shows the pool after it; exact
  without prefix caching);
- lists the running requests and the preempted ones waiting to resume;
  waiting requests that never ran are only counted;
- measures ages from a request's first step (its arrival is unknown), and
  leaves the time to first token out; inter-token latency comes from the
  ends of consecutive steps that gave a request a token;
- shows speculative decoding when the run verified any proposal (a trace
  does not say whether it was on), from the steps' proposed and accepted
  tokens; the adaptive policy's declines are not recorded. The disk tier
  shows when the steps carry its loads and writes, its only counters there.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field

from kvserve.dashboard.rolling import (
    NUM_LATENCY_SAMPLES,
    RATE_WINDOW_S,
    RateWindow,
    latency_percentiles,
)
from kvserve.dashboard.state import (
    MAX_LISTED_WAITING,
    NUM_RECENT_STEPS,
    DiskTierState,
    Frame,
    Phase,
    RequestState,
    SpecState,
    StepState,
    block_runs,
    spec_state,
)
from kvserve.trace.reader import TraceRun
from kvserve.trace.records import StepRecord


@dataclass
class _Sequence:
    """What the replay knows of one sequence so far."""

    id: str
    prompt_tokens: int
    first_seen: float
    computed: int = 0
    output_tokens: int = 0
    phase: Phase = "prefilling"
    preemptions: int = 0
    blocks: list[int] = field(default_factory=list)
    cached_blocks: list[int] = field(default_factory=list)  # its full blocks when released
    last_token_at: float | None = None


class _SimulatedPool:
    """Block placement for the replay: the free blocks in the real pool's order, and which
    free blocks keep a prefix."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.block_size = block_size
        self.caching = caching
        # Released blocks that keep no prefix, most recently released last; then the
        # never-written blocks, followed by cached ones in eviction order.
        self.reusable: dict[int, None] = {}
        self.queue: dict[int, None] = dict.fromkeys(range(1, num_blocks + 1))
        self.cached: set[int] = set()

    @property
    def free(self) -> list[int]:
        """Every free block, next to be handed out first."""
        return [*reversed(self.reusable), *self.queue]

    def _take(self) -> int:
        if self.reusable:
            block_id, _ = self.reusable.popitem()
            return block_id
        block_id = next(iter(self.queue))
        del self.queue[block_id]
        return block_id

    def grow(self, seq: _Sequence, start: int, num_tokens: int) -> None:
        """Give ``seq`` the blocks ``num_tokens`` tokens need, or as many as are free.

        start: where the step's chunk begins; past 0 on a request holding no
        blocks, it is a prefix-cache hit of ``start`` tokens.
        """
        if not seq.blocks and start > 0:
            self._take_hit(seq, start)
        missing = -(-num_tokens // self.block_size) - len(seq.blocks)
        for _ in range(min(missing, len(self.reusable) + len(self.queue))):
            block_id = self._take()
            self.cached.discard(block_id)  # reused for new content: its old prefix is gone
            seq.blocks.append(block_id)

    def _take_hit(self, seq: _Sequence, num_hit_tokens: int) -> None:
        """A prefix hit: the request's own cached blocks back, while they are still cached."""
        for block_id in seq.cached_blocks[: num_hit_tokens // self.block_size]:
            if block_id not in self.cached or block_id not in self.queue:
                break
            del self.queue[block_id]
            seq.blocks.append(block_id)

    def release(self, seq: _Sequence) -> None:
        """Return every block of ``seq`` to the back of the queue, its last block first."""
        num_full = seq.computed // self.block_size
        seq.cached_blocks = seq.blocks[:num_full] if self.caching else []
        self.cached.update(seq.cached_blocks)
        for block_id in reversed(seq.blocks):
            if block_id in self.cached:
                self.queue[block_id] = None
            else:
                self.reusable[block_id] = None
        seq.blocks = []


class TraceReplay:
    """Frames of one run of a trace, one per step, encoded as JSON once."""

    def __init__(self, trace_run: TraceRun) -> None:
        header = trace_run.header
        self.header = header
        self._pool = _SimulatedPool(
            header["num_blocks"], header["block_size"], header["enable_prefix_caching"]
        )
        self._running: dict[str, _Sequence] = {}  # in order of (re)admission
        self._preempted: dict[str, _Sequence] = {}  # in order of preemption
        self._steps: deque[StepState] = deque(maxlen=NUM_RECENT_STEPS)
        self._rates = RateWindow(RATE_WINDOW_S)
        self._itl: deque[float] = deque(maxlen=NUM_LATENCY_SAMPLES)
        self._num_preemptions = 0
        self._speculates = any(step.get("spec_proposed", 0) > 0 for step in trace_run.steps)
        self._has_disk_tier = any("disk_loads" in step for step in trace_run.steps)
        self._spec_rates = RateWindow(RATE_WINDOW_S)  # proposed, accepted
        self._spec_totals = (0, 0)  # proposed, accepted
        self._disk_totals = (0, 0)  # loads, writes
        self.frames: list[bytes] = [self._encode(self._apply(step)) for step in trace_run.steps]

    @staticmethod
    def _encode(frame: Frame) -> bytes:
        return json.dumps(frame, separators=(",", ":")).encode()

    def _apply(self, record: StepRecord) -> Frame:
        """Advance the replay by one step record; the frame after it."""
        now = record["end_s"]
        for seq_id in record["preempted"]:
            seq = self._running.pop(seq_id, None)
            if seq is not None:
                self._pool.release(seq)
                seq.computed, seq.phase = 0, "preempted"
                seq.preemptions += 1
                self._preempted[seq_id] = seq
        self._num_preemptions += len(record["preempted"])
        num_decode = num_generated = 0
        for entry in record["scheduled"]:
            seq = self._running.get(entry["id"]) or self._preempted.pop(entry["id"], None)
            if seq is None:
                seq = _Sequence(entry["id"], entry["prompt_len"], first_seen=record["start_s"])
            self._running[seq.id] = seq
            self._pool.grow(seq, entry["start"], entry["start"] + entry["tokens"])
            seq.computed = entry["start"] + entry["tokens"]
            num_decode += entry["tokens"] if entry["phase"] == "decode" else 0
            if entry["partial"]:
                seq.phase = "prefilling"
                continue
            # The chunk reached the last known token: the step sampled one more.
            num_generated += 1
            seq.output_tokens = max(seq.output_tokens, seq.computed + 1 - seq.prompt_tokens)
            if seq.last_token_at is not None and entry["phase"] == "decode":
                self._itl.append(now - seq.last_token_at)
            seq.last_token_at = now
            seq.phase = "decoding"
        # The trace counts blocks while the forward pass ran; finished requests free
        # theirs after it, and the frame shows the pool after the step.
        num_released = 0
        for finished in record["finished"]:
            seq = self._running.pop(finished["id"], None)
            if seq is not None:
                num_released += len(seq.blocks)
                self._pool.release(seq)
        num_tokens = record["num_tokens"]
        self._steps.append(
            StepState(
                step=record["step"],
                decode=num_decode,
                prefill=num_tokens - num_decode,
                preempted=len(record["preempted"]),
                t=round(now, 4),
            )
        )
        self._rates.add(now, num_generated, num_tokens)
        self._add_counters(record)
        return self._frame(record, max(record["blocks_used"] - num_released, 0))

    def _add_counters(self, record: StepRecord) -> None:
        """Sum the step's speculation and disk-tier shares into the run's totals."""
        proposed, accepted = record.get("spec_proposed", 0), record.get("spec_accepted", 0)
        self._spec_rates.add(record["end_s"], proposed, accepted)
        total_proposed, total_accepted = self._spec_totals
        self._spec_totals = (total_proposed + proposed, total_accepted + accepted)
        loads, writes = self._disk_totals
        self._disk_totals = (
            loads + record.get("disk_loads", 0),
            writes + record.get("disk_writes", 0),
        )

    def _spec_state(self, now: float) -> SpecState | None:
        if not self._speculates:
            return None
        proposed, accepted = self._spec_totals
        return spec_state(proposed, accepted, self._spec_rates.rates(now), None, None)

    def _disk_state(self) -> DiskTierState | None:
        if not self._has_disk_tier:
            return None
        loads, writes = self._disk_totals
        return DiskTierState(
            query_tokens=None,
            pool_hit_tokens=None,
            disk_hits=None,
            loads=loads,
            writes=writes,
            evictions=None,
            bytes_read=None,
            bytes_written=None,
            num_bytes=None,
            enabled=True,
        )

    def _frame(self, record: StepRecord, blocks_used: int) -> Frame:
        now = record["end_s"]
        header = self.header
        waiting = list(self._preempted.values())[:MAX_LISTED_WAITING]
        requests = [self._state(seq, now) for seq in [*self._running.values(), *waiting]]
        output_tok_s, computed_tok_s = self._rates.rates(now)
        return Frame(
            time=round(now, 4),
            layout="simulated",
            num_blocks=header["num_blocks"],
            block_size=header["block_size"],
            requests=requests,
            num_running=record["num_running"],
            num_waiting=record["num_waiting"],
            num_waiting_unlisted=max(record["num_waiting"] - len(waiting), 0),
            cached_free=block_runs(sorted(self._pool.cached & self._pool.queue.keys())),
            blocks_used=blocks_used,
            blocks_cached=record["blocks_cached"],
            steps=list(self._steps),
            num_steps=record["step"] + 1,
            num_preemptions=self._num_preemptions,
            budget=header["max_num_batched_tokens"],
            prefill_cap=header["max_prefill_tokens_while_decoding"],
            output_tok_s=round(output_tok_s, 2),
            computed_tok_s=round(computed_tok_s, 2),
            ttft=None,
            itl=latency_percentiles(self._itl),
            spec=self._spec_state(now),
            disk=self._disk_state(),
        )

    @staticmethod
    def _state(seq: _Sequence, now: float) -> RequestState:
        return RequestState(
            id=seq.id,
            phase=seq.phase,
            prompt_tokens=seq.prompt_tokens,
            output_tokens=seq.output_tokens,
            computed_tokens=seq.computed,
            age_s=round(max(now - seq.first_seen, 0.0), 3),
            preemptions=seq.preemptions,
            blocks=block_runs(seq.blocks),
        )
