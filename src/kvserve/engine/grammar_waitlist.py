"""Structured outputs in the step loop: sequences wait for their grammar, then obey it.

A constrained sequence waits in a :class:`GrammarWaitlist`, outside the
scheduler, until its grammar compiled (on the compiler's threads), so no step
ever waits for a compile. After each forward pass :func:`advance_grammars`
feeds every constrained sequence the token it sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent import futures

from kvserve.core.request import Request
from kvserve.core.scheduler import Scheduler
from kvserve.engine.request_group import RequestGroup, SequenceState

# A sequence id → its request's group and the sequence itself.
SequenceTable = Mapping[str, tuple[RequestGroup, SequenceState]]


class GrammarWaitlist:
    """The constrained sequences whose grammar is still compiling."""

    def __init__(self) -> None:
        self._requests: list[Request] = []

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request: Request) -> None:
        """Hold ``request`` (its ``grammar`` set) until its grammar compiled."""
        self._requests.append(request)

    def admit(
        self,
        sequences: SequenceTable,
        scheduler: Scheduler,
        enqueue: Callable[[Request], None] | None = None,
    ) -> list[RequestGroup]:
        """Queue the sequences whose grammar compiled; fail those whose compile raised.

        enqueue: how a ready sequence is queued (the engine's, which may first
        read its prefix from disk); ``scheduler.add_request`` by default.
        Returns the groups that failed now (finished, with ``error`` set).
        """
        failed: dict[str, RequestGroup] = {}
        still: list[Request] = []
        for request in self._requests:
            grammar = request.grammar
            assert grammar is not None
            if not grammar.ready:
                still.append(request)
                continue
            group = sequences[request.request_id][0]
            if group.error is not None:
                continue  # a sibling's compile failed; the group is finished already
            try:
                grammar.start()
            except Exception as exc:
                group.fail(scheduler, "compiling its structured-outputs grammar", exc)
                failed[group.request_id] = group
                continue
            (enqueue or scheduler.add_request)(request)
        self._requests = [r for r in still if sequences[r.request_id][0].error is None]
        return list(failed.values())

    def drop(self, group: RequestGroup) -> None:
        """Forget the group's sequences still waiting for their grammar (an abort)."""
        for seq in group.sequences:
            seq.request.grammar = None
        ids = set(group.seq_ids)
        self._requests = [r for r in self._requests if r.request_id not in ids]

    def wait_for_one(self, timeout: float) -> None:
        """Block until one waiting grammar is ready, or ``timeout`` seconds passed."""
        pending = [r.grammar.compiled for r in self._requests if r.grammar is not None]
        futures.wait(pending, timeout=timeout, return_when=futures.FIRST_COMPLETED)


def advance_grammars(
    sequences: SequenceTable, sampled: dict[str, int], failed: dict[str, Exception]
) -> None:
    """Feed each constrained sequence its sampled token; a refused token fails the sequence.

    A refused token moves from ``sampled`` to ``failed`` (both seq id-keyed, changed in place).
    """
    for seq_id, token_id in list(sampled.items()):
        grammar = sequences[seq_id][1].request.grammar
        if grammar is None:
            continue
        try:
            grammar.accept(token_id)
        except ValueError as exc:
            failed[seq_id] = exc
            del sampled[seq_id]
