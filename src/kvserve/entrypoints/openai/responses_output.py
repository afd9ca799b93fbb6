"""A response's output items, whole or as the stream of events OpenAI's clients expect.

The answer is read by the chat path (:class:`~kvserve.entrypoints.openai.chat_answer.ChatAnswer`:
text, or the tool calls in it), and becomes output items: a ``message`` with
one ``output_text`` part for the text, and a ``function_call`` item per call.
An answer with calls and no text has no message item; an empty answer has an
empty one. Streamed, each item is announced, filled and closed in order:

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added,
    response.output_text.delta ..., response.output_text.done,
    response.content_part.done, response.output_item.done,
    response.output_item.added (function_call), response.function_call_arguments.delta,
    response.function_call_arguments.done, response.output_item.done, ...,
    response.completed (or response.incomplete when max_output_tokens cut it short)

every event with its ``sequence_number``, counting from 0.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from kvserve.entrypoints.openai.protocol import ChatMessage
from kvserve.entrypoints.openai.protocol_responses import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
)
from kvserve.entrypoints.openai.protocol_tools import (
    DeltaToolCall,
    FunctionCallIn,
    ToolCall,
    ToolCallIn,
)

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_status(finish_reason: str | None) -> ItemStatus:
    """An answer cut short by ``max_output_tokens`` is incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(
    content: str | None, calls: list[ToolCall], status: ItemStatus
) -> list[OutputItem]:
    """A whole answer's output items: its text (if any, or if nothing else), then its calls."""
    items: list[OutputItem] = []
    if content or not calls:
        text = OutputText(text=content or "")
        items.append(OutputMessage(id=new_item_id("msg"), status=status, content=[text]))
    for call in calls:
        items.append(
            OutputFunctionCall(
                id=new_item_id("fc"),
                call_id=call.id,
                name=call.function.name,
                arguments=call.function.arguments,
                status="completed",
            )
        )
    return items


def answer_message(output: list[OutputItem]) -> ChatMessage:
    """The output as the assistant message a continuation of the conversation shows the model."""
    texts = [
        part.text for item in output if isinstance(item, OutputMessage) for part in item.content
    ]
    calls = [
        ToolCallIn(
            id=item.call_id,
            type="function",
            function=FunctionCallIn(name=item.name, arguments=item.arguments),
        )
        for item in output
        if isinstance(item, OutputFunctionCall)
    ]
    text = "\n".join(text for text in texts if text)
    return ChatMessage(
        role="assistant", content=text or (None if calls else ""), tool_calls=calls or None
    )


class ResponseEvents:
    """The events of one streamed answer; ``output`` holds its items as they complete."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.output: list[OutputItem] = []
        self._message: OutputMessage | None = None  # the message item being written

    def event(self, kind: str, **fields: Any) -> str:
        """One Server-Sent Event, named by its type as OpenAI names them."""
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def text(self, text: str) -> Iterator[str]:
        """Text of the answer: into the open message item, opened first if needed."""
        if not text:
            return
        if self._message is None:
            yield from self._open_message()
        assert self._message is not None
        self._message.content[0].text += text
        yield self.event(
            "response.output_text.delta",
            item_id=self._message.id,
            output_index=len(self.output),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def calls(self, deltas: list[DeltaToolCall]) -> Iterator[str]:
        """Tool calls of the answer (the chat path sends each whole): an item each."""
        for delta in deltas:
            yield from self._close_message("completed")
            assert delta.id is not None
            item = OutputFunctionCall(
                id=new_item_id("fc"),
                call_id=delta.id,
                name=delta.function.name or "",
                arguments="",
                status="in_progress",
            )
            index = len(self.output)
            yield self.event("response.output_item.added", output_index=index, item=_dump(item))
            arguments = delta.function.arguments or ""
            yield self.event(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=index,
                delta=arguments,
            )
            yield self.event(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                name=item.name,
                arguments=arguments,
            )
            item.arguments, item.status = arguments, "completed"
            self.output.append(item)
            yield self.event("response.output_item.done", output_index=index, item=_dump(item))

    def finish(self, status: ItemStatus) -> Iterator[str]:
        """Close the open item; an answer with no item at all gets an empty message."""
        if not self.output and self._message is None:
            yield from self._open_message()
        yield from self._close_message(status)

    def _open_message(self) -> Iterator[str]:
        message = OutputMessage(id=new_item_id("msg"), status="in_progress", content=[])
        index = len(self.output)
        yield self.event("response.output_item.added", output_index=index, item=_dump(message))
        part = OutputText(text="")
        message.content.append(part)
        self._message = message
        yield self.event(
            "response.content_part.added",
            item_id=message.id,
            output_index=index,
            content_index=0,
            part=_dump(part),
        )

    def _close_message(self, status: ItemStatus) -> Iterator[str]:
        message = self._message
        if message is None:
            return
        index = len(self.output)
        part = message.content[0]
        where = {"item_id": message.id, "output_index": index, "content_index": 0}
        yield self.event("response.output_text.done", **where, text=part.text, logprobs=[])
        yield self.event("response.content_part.done", **where, part=_dump(part))
        message.status = status
        self.output.append(message)
        self._message = None
        yield self.event("response.output_item.done", output_index=index, item=_dump(message))


def _dump(item: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = item.model_dump()
    return dumped
