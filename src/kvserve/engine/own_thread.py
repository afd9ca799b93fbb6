"""Building an object on a thread of its own, so that thread's OpenMP team goes with it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

_T = TypeVar("_T")


def build_on_own_thread(factory: Callable[[], _T]) -> _T:
    """``factory()`` run on a short-lived thread; its result, or its exception, comes back here.

    Loading a model runs OpenMP parallel regions, and the OpenMP runtime keeps a
    team of worker threads for every thread that has run one. With two teams alive
    (the loading thread's and the engine loop's) there are more OpenMP threads than
    cores, and the runtime stops spinning between regions: every kernel then waits
    for its workers to be woken, and a 32-row decode step took 40 ms instead of 24.
    A team goes when its thread exits, so the server builds its engine this way and
    the loop thread's team is the only one.
    """
    outcome: list[Any] = []

    def build() -> None:
        try:
            outcome.append((True, factory()))
        except BaseException as exc:  # handed to the caller below
            outcome.append((False, exc))

    thread = threading.Thread(target=build, name="kvserve-load")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return cast(_T, value)
