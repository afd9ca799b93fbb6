"""One chat choice's answer: its text, or the tool calls in it, whole or streamed.

Without tools (or with ``tool_choice="none"``) the text is the answer. With
``auto`` the text is parsed for calls (:mod:`tool_parsers`); with a forced
call the whole text is the constrained JSON of the calls, turned into
``tool_calls`` when it is complete. An answer with calls that ended normally
finishes with ``tool_calls``.
"""

from __future__ import annotations

from kvserve.entrypoints.openai.protocol import AssistantMessage
from kvserve.entrypoints.openai.protocol_tools import DeltaFunctionCall, DeltaToolCall, ToolCall
from kvserve.entrypoints.openai.tool_calls import ToolMode, forced_calls, parse_auto
from kvserve.entrypoints.openai.tool_parsers import StreamingToolParser


class ChatAnswer:
    """Builds one choice's message (:meth:`message`) or its stream (:meth:`feed`, :meth:`finish`)."""

    def __init__(self, mode: ToolMode | None) -> None:
        self.mode = mode if mode is not None and mode.kind != "none" else None
        self._text = ""
        self._streaming = None if self.mode is None else StreamingToolParser(self.mode.names)
        self.num_calls = 0

    def message(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        """The whole answer as a message, and its finish reason."""
        if self.mode is None:
            return AssistantMessage(content=text), finish_reason
        if self.mode.forced:
            calls = forced_calls(self.mode, text) if finish_reason == "stop" else []
            content = None if calls else text
        else:
            content, calls = parse_auto(text, self.mode)
        self.num_calls = len(calls)
        return AssistantMessage(content=content, tool_calls=calls), self.finish_reason(
            finish_reason
        )

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        """A streamed piece of text: (content to send now, tool-call deltas to send now)."""
        if self.mode is None:
            return text, []
        if self.mode.forced:
            self._text += text
            return "", []
        assert self._streaming is not None
        content, calls = self._streaming.feed(text)
        return content, self._deltas(calls)

    def finish(self, finish_reason: str | None) -> tuple[str, list[DeltaToolCall], str | None]:
        """What the stream still holds when the choice ends, and the finish reason to send."""
        if self.mode is None:
            return "", [], finish_reason
        if self.mode.forced:
            calls = forced_calls(self.mode, self._text) if finish_reason == "stop" else []
            content = "" if calls else self._text
        else:
            assert self._streaming is not None
            content, calls = self._streaming.finish()
        return content, self._deltas(calls), self.finish_reason(finish_reason)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls else reason

    def _deltas(self, calls: list[ToolCall]) -> list[DeltaToolCall]:
        deltas = []
        for call in calls:
            function = DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments)
            deltas.append(
                DeltaToolCall(index=self.num_calls, id=call.id, type="function", function=function)
            )
            self.num_calls += 1
        return deltas
