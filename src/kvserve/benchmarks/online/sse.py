"""Server-Sent Events, read the way OpenAI-compatible servers stream them.

A stream is lines of ``field: value``; an event is the ``data:`` lines before
a blank line. Servers send one JSON object per event, then ``data: [DONE]``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

# SSE ends a line at CRLF, LF or CR, and nowhere else.
_LINE_END = re.compile(rb"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The body's lines, split at CRLF, LF and CR only.

    Not httpx's ``aiter_lines``: it splits like ``str.splitlines``, also at
    U+2028 and U+0085, which JSON leaves unescaped inside a generated string.
    """
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        # A CR at the end may be the first half of a CRLF whose LF is still in transit.
        end = len(buffer) - 1 if buffer.endswith(b"\r") else len(buffer)
        *lines, rest = _LINE_END.split(buffer[:end])
        buffer = rest + buffer[end:]
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if buffer.rstrip(b"\r"):
        yield buffer.rstrip(b"\r").decode("utf-8", errors="replace")


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data of each Server-Sent Event, as soon as its closing blank line arrives."""
    data: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            value = line[len("data:") :]
            data.append(value[1:] if value.startswith(" ") else value)
        elif not line and data:
            yield "\n".join(data)
            data = []
        # Other fields (event:, id:, retry:) and comments (":") carry nothing measured.
    if data:
        yield "\n".join(data)
