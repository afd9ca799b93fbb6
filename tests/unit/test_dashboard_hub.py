"""The dashboard's hub: a latest-value slot per client, nobody waits, closed clients leave."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from kvserve.dashboard.hub import StateHub
from waiting import run_with_deadline


def frame(number: int) -> Any:
    return {"time": float(number)}


async def next_frame(events: AsyncIterator[bytes]) -> dict[str, Any]:
    """The next data event of a stream, skipping the retry line and heartbeats."""
    while True:
        event = await asyncio.wait_for(events.__anext__(), 5)
        if event.startswith(b"data: "):
            parsed: dict[str, Any] = json.loads(event[len(b"data: ") :])
            return parsed


def test_a_slow_client_gets_the_newest_frame_and_never_a_backlog() -> None:
    async def main() -> None:
        hub = StateHub(extra=lambda: {"load": None})
        hub.publish(frame(0))
        events = hub.events()
        assert (await next_frame(events))["time"] == 0  # a new client starts from the latest
        for number in range(1, 100):
            hub.publish(frame(number))  # the client reads none of these as they come
        assert await next_frame(events) == {"time": 99.0, "load": None}
        hub.publish(frame(100))
        assert (await next_frame(events))["time"] == 100
        await events.aclose()  # type: ignore[attr-defined]

    run_with_deadline(main())


def test_closed_clients_are_removed_and_the_rest_still_get_frames() -> None:
    async def main() -> None:
        hub = StateHub()
        streams = [hub.events() for _ in range(5)]
        for stream in streams:
            await stream.__anext__()  # the retry line: the client is registered by now
        assert hub.num_clients == 5 and hub.has_watchers()
        for stream in streams[:4]:
            await stream.aclose()  # type: ignore[attr-defined]
        assert hub.num_clients == 1
        hub.publish(frame(7))
        assert (await next_frame(streams[4]))["time"] == 7
        await streams[4].aclose()  # type: ignore[attr-defined]
        assert hub.num_clients == 0 and not hub.has_watchers()

    run_with_deadline(main())


def test_a_cancelled_stream_is_removed_too() -> None:
    async def main() -> None:
        hub = StateHub()
        events = hub.events()

        async def read_forever() -> None:
            async for _ in events:
                pass

        async def joined() -> None:
            while hub.num_clients == 0:
                await asyncio.sleep(0.001)

        task = asyncio.create_task(read_forever())
        await asyncio.wait_for(joined(), 10)
        task.cancel()  # what Starlette does when the browser goes away
        await asyncio.gather(task, return_exceptions=True)
        await events.aclose()  # type: ignore[attr-defined]
        assert hub.num_clients == 0

    run_with_deadline(main())


def test_close_ends_every_stream() -> None:
    async def main() -> None:
        hub = StateHub()
        events = hub.events()
        await events.__anext__()
        hub.close()
        assert [event async for event in events] == []
        assert hub.num_clients == 0

    run_with_deadline(main())


def test_publishing_from_another_thread_never_waits_for_clients() -> None:
    async def main() -> None:
        hub = StateHub()
        hub.attach(asyncio.get_running_loop())
        events = hub.events()
        await events.__anext__()
        # The engine's loop thread publishes 1000 frames while nobody reads.
        thread = threading.Thread(
            target=lambda: [hub.publish_threadsafe(frame(n)) for n in range(1000)]
        )
        thread.start()
        await asyncio.to_thread(thread.join, 5)
        assert not thread.is_alive()
        await asyncio.sleep(0.05)  # the queued publishes run on this loop
        assert (await next_frame(events))["time"] == 999
        await events.aclose()  # type: ignore[attr-defined]

    run_with_deadline(main())


def test_publishing_before_attach_or_after_the_loop_closed_is_dropped() -> None:
    hub = StateHub()
    hub.publish_threadsafe(frame(1))  # not attached: nothing to do, and no error
    loop = asyncio.new_event_loop()
    hub.attach(loop)
    loop.close()
    hub.publish_threadsafe(frame(2))
    assert hub.latest is None
