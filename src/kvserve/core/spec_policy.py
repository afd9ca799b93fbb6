"""When speculation pays: per step and per request, from acceptance and step costs measured here.

Verifying k proposals adds k query rows to a request's share of the step.
While a step is bound by reading the weights (a few sequences on a CPU), rows
are nearly free and any accepted proposal is a token gained; once the step is
bound by arithmetic (many sequences), every row costs its share and the
rejected ones slow every request of the batch. Where one regime turns into
the other depends on the machine, the model and the thread count, so nothing
here is a constant: the policy learns the step's cost at each row count from
the engine's own decode-only steps (the fastest of the last few at each
count: other work on the machine, a first use, a page fault only ever add
time to a step, so the fastest is the step's own cost), and each request's
acceptance from its own verifications (accepted
over proposed, starting from the average over all requests).

For a request deciding in a step that already holds ``R`` rows for ``B``
decoding requests, ``k`` proposals are worth their rows when they raise the
step's expected tokens per second:

    (B + E(k)) / t(R + k)  >  B / t(R),    E(k) = a + a^2 + ... + a^k

with ``a`` the request's acceptance (each proposal is kept only if every one
before it was). The policy grants the ``k`` (0 to the limit) that maximises
the left side. A row count never measured takes the cost of the nearest
measured ones (interpolated between two, the slope of the two largest carried
past them, the cost of the one below when it is the only one): optimistic,
so that a count is tried and then known. Below the fewest rows measured the
estimate is in proportion to them instead, which makes extra rows look dear
and declining cheap: fewer rows are only ever measured by declining (under
load every step holds the batch's rows and their proposals, and were those
counts taken as costing what the fewest measured cost, extra rows would look
free and the policy would grant them for good). Past the most rows measured,
and in the first steps before anything is, only one request a step is
granted rows: the estimate there is a guess, and a large batch acting on it
at once would make the step several times its cost before the guess could
be corrected. A count counts as measured after
:data:`MIN_SAMPLES` steps, so one slow first step (a first use, another
program) does not rule it out for good; past 31 rows a step counts for the
nearest count below it on a grid 1/16 of the count apart (:func:`sample_key`),
so that counts become known under load too, where a step rarely has the same
count twice. Costs go stale: a count measured while the machine was busier
(a first step, another program, a load that has gone) would otherwise never
be chosen again and so never measured again. So one step in
:data:`PROBE_EVERY` whose decisions would grant less than the limit grants
one request the limit anyway (counted in steps, not decisions: a probe's rows
cost the whole batch, so a large batch probes no more often than one stream),
and a step at a count whose samples are older than
:data:`COST_HORIZON` decode steps drops them: the count is then estimated
from its neighbours again, tried, and known afresh after a few steps. Under
load the measured cost of the extra rows outweighs the expected tokens and
speculation stops; when load falls the smaller counts' costs apply again and
it resumes.

Two cases are declined outright. A grant must raise the step's expected
tokens per second by :data:`MIN_GAIN` at least: costs read from step times
on a shared machine are good to a few percent, so a grant the model calls
break-even (under load, with high acceptance, every request sits near it) is
as likely to lose as to win, and what it loses is the whole batch's time. And
a step that also computes prompt tokens (a request being admitted, a prompt
in chunks) gets no proposals: its prompt rows make it compute-bound whatever
the decode rows alone would cost, so verification rows cost their full share
of it, and the policy's costs, learned from decode-only steps, do not
describe it. Under load about half of the engine's time is in such steps.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

# Step times kept per row count (the fastest is its cost), and how many make it known.
COST_SAMPLES = 9
MIN_SAMPLES = 3
# One step in this many that would grant less than the limit grants it once, to measure again.
PROBE_EVERY = 64
# Decode-only steps after which a row count's samples are stale: the next step at that
# count replaces them (see the module's docstring).
COST_HORIZON = 256
# A request's acceptance is its accepted / proposed with this many proposals' worth of
# the global average added, so that its first verifications do not swing it to 0 or 1.
PRIOR_PROPOSALS = 4.0
# The least relative gain in expected tokens per second a grant must promise (see the
# module's docstring).
MIN_GAIN = 0.02
# The global average before any verification.
INITIAL_ACCEPTANCE = 0.5
# Weight of each verification in the global average.
GLOBAL_SMOOTHING = 0.05


def sample_key(rows: int) -> int:
    """The row count a step of ``rows`` rows is filed under: itself up to 31, then rounded
    down to a multiple of ``rows // 16`` (2 from 32, 4 from 64, ...).

    Under load a step's rows are the batch plus however many proposals each request got,
    rarely the same count twice in a row; filed exactly, few counts would ever reach
    :data:`MIN_SAMPLES` and the policy would go on estimating from too few. Rounding down
    files a step under a count at most 1/16 smaller than its own, so its cost errs high,
    on the side of speculating less.
    """
    step = max(rows // 16, 1)
    return rows - rows % step


def expected_accepted(acceptance: float, k: int) -> float:
    """``a + a^2 + ... + a^k``: proposals kept when each is kept with probability ``a`` once
    every earlier one was."""
    total, term = 0.0, 1.0
    for _ in range(k):
        term *= acceptance
        total += term
    return total


@dataclass
class _Acceptance:
    proposed: int = 0
    accepted: int = 0


@dataclass
class SpeculationPolicy:
    """The number of proposals each decoding request gets (see the module's docstring).

    Call :meth:`begin_step` as a step is scheduled, :meth:`num_proposals` per decoding
    request and :meth:`add_rows` with the proposals it then got,
    :meth:`observe_verification` with each verification's outcome,
    :meth:`observe_step` with each decode-only step's rows and seconds, and
    :meth:`forget` when a request ends. ``num_declined`` counts the requests it gave no
    proposal to although their limit allowed some.
    """

    global_acceptance: float = INITIAL_ACCEPTANCE
    num_declined: int = 0
    _samples: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)
    _costs: dict[int, float] = field(default_factory=dict)
    _rows_known: list[int] = field(default_factory=list)
    _since_probe: int = 0
    _counted_for_probe: bool = False
    _explored: bool = False
    _num_steps: int = 0
    _requests: dict[str, _Acceptance] = field(default_factory=dict)
    _batch: int = 1
    _rows: int = 1
    _computes_prompts: bool = False

    def begin_step(self, num_decoding: int, computes_prompts: bool = False) -> None:
        """A step is being scheduled with about ``num_decoding`` decoding requests;
        ``computes_prompts``: it also computes prompt tokens (no proposals then)."""
        self._batch = max(num_decoding, 1)
        self._rows = self._batch
        self._computes_prompts = computes_prompts
        self._counted_for_probe = False
        self._explored = False

    def acceptance(self, request_id: str) -> float:
        """The request's expected share of proposals kept."""
        seen = self._requests.get(request_id, _Acceptance())
        prior = PRIOR_PROPOSALS * self.global_acceptance
        return (seen.accepted + prior) / (seen.proposed + PRIOR_PROPOSALS)

    def cost(self, rows: int) -> float | None:
        """The step's expected seconds at ``rows`` rows; None before any decode step."""
        known = self._rows_known
        if not known:
            return None
        if rows in self._costs:
            return self._costs[rows]
        above = bisect.bisect_left(known, rows)
        if above == 0:
            # Fewer rows than any measured: in proportion to the fewest measured. For a
            # cost that is a fixed part and a part per row that is at most the true cost,
            # so declining looks cheap and extra rows dear: the count gets measured.
            return self._costs[known[0]] * rows / known[0]
        low = known[above - 1]
        if above < len(known):
            high = known[above]
            share = (rows - low) / (high - low)
            return self._costs[low] + share * (self._costs[high] - self._costs[low])
        if len(known) >= 2:
            before = known[-2]
            slope = max(self._costs[low] - self._costs[before], 0.0) / (low - before)
            return self._costs[low] + slope * (rows - low)
        return self._costs[low]

    def num_proposals(self, request_id: str, limit: int) -> int:
        """How many of up to ``limit`` proposals the request may get in the step being
        scheduled (the rows it then takes are counted by :meth:`add_rows`)."""
        if limit < 1:
            return 0
        if self._computes_prompts:
            self.num_declined += 1
            return 0
        base = self.cost(self._rows)
        if base is None or base <= 0.0:  # nothing measured yet: one request speculates
            if self._explored:
                self.num_declined += 1
                return 0
            self._explored = True
            return limit
        acceptance = self.acceptance(request_id)
        best, best_rate = 0, self._batch / base
        top = self._rows_known[-1]
        for k in range(1, limit + 1):
            if self._rows + k > top and self._explored:
                break  # past the counts measured, one request a step finds out
            cost = self.cost(self._rows + k)
            assert cost is not None
            rate = (self._batch + expected_accepted(acceptance, k)) / max(cost, 1e-9)
            if rate > best_rate:
                best, best_rate = k, rate
        if best_rate < (1.0 + MIN_GAIN) * self._batch / base:
            best = 0  # break-even at best: not worth the batch's time
        if best < limit:
            if not self._counted_for_probe:
                self._counted_for_probe = True
                self._since_probe += 1
            if self._since_probe >= PROBE_EVERY:
                self._since_probe = 0
                self._explored = True
                return limit
        if self._rows + best > top:
            self._explored = True
        if best == 0:
            self.num_declined += 1
        return best

    def add_rows(self, rows: int) -> None:
        """A request of the step being scheduled took ``rows`` proposal rows."""
        self._rows += rows

    def observe_verification(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification of ``proposed`` proposals kept ``accepted`` of them."""
        if proposed <= 0:
            return
        seen = self._requests.setdefault(request_id, _Acceptance())
        seen.proposed += proposed
        seen.accepted += accepted
        rate = accepted / proposed
        self.global_acceptance += GLOBAL_SMOOTHING * (rate - self.global_acceptance)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of ``rows`` rows (verifications included) took ``seconds``."""
        if rows < 1 or seconds <= 0.0:
            return
        self._num_steps += 1
        rows = sample_key(rows)
        samples = self._samples.setdefault(rows, deque(maxlen=COST_SAMPLES))
        while samples and samples[0][0] < self._num_steps - COST_HORIZON:
            samples.popleft()
        samples.append((self._num_steps, seconds))
        if len(samples) < MIN_SAMPLES:
            if rows in self._costs:  # its samples were stale: estimated until known again
                del self._costs[rows]
                self._rows_known.remove(rows)
            return  # not known yet: estimated from its neighbours, so tried again
        if rows not in self._costs:
            bisect.insort(self._rows_known, rows)
        self._costs[rows] = min(seconds for _, seconds in samples)

    def forget(self, request_id: str) -> None:
        """The request ended: drop its acceptance."""
        self._requests.pop(request_id, None)
