"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API.

A thin layer over the chat endpoint: the request becomes a chat request
(``responses_request.py``), :meth:`ChatServing.start` checks, renders and
queues it exactly as for ``/v1/chat/completions`` (template, tools, forced
calls and ``text.format`` as constrained output, sampling, the API key's
cache salt), and :class:`ChatAnswer` reads the answer's text and tool calls,
which become output items (``responses_output.py``). Errors are the chat
path's, renamed to the fields this request sent.

With ``store`` (the default, as at OpenAI) a finished response is kept in the
:class:`ResponseStore` under the request's API key, for ``GET``, ``DELETE``
and ``previous_response_id``. A streamed response is stored once it ends.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.entrypoints.openai import auth
from kvserve.entrypoints.openai.access_log import AccessLog
from kvserve.entrypoints.openai.api_errors import ApiError
from kvserve.entrypoints.openai.chat_answer import ChatAnswer
from kvserve.entrypoints.openai.protocol import ChatMessage
from kvserve.entrypoints.openai.protocol_responses import (
    FunctionToolChoice,
    IncompleteDetails,
    OutputItem,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from kvserve.entrypoints.openai.response_store import ResponseStore, StoredResponse
from kvserve.entrypoints.openai.responses_output import (
    ItemStatus,
    ResponseEvents,
    answer_message,
    item_status,
    new_item_id,
    output_items,
)
from kvserve.entrypoints.openai.responses_request import (
    chat_request,
    check_supported,
    function_tools,
    renamed,
    tool_choice,
)
from kvserve.entrypoints.openai.serving_chat import ChatServing, StartedChat


class ResponsesServing:
    """Serves /v1/responses through ``chat``, keeping stored responses in ``store``."""

    def __init__(self, chat: ChatServing, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, request: Request) -> Response:
        log = AccessLog(new_item_id("resp"), "/v1/responses", time.perf_counter())
        return await self.chat.serve(request, log, lambda log: self._create(request, log))

    async def retrieve(self, request: Request, response_id: str) -> Response:
        _refuse_query(request)
        stored = self.store.get(auth.tenant(request), response_id)
        return JSONResponse(stored.response.model_dump())

    async def delete(self, request: Request, response_id: str) -> Response:
        _refuse_query(request)
        self.store.delete(auth.tenant(request), response_id)
        return JSONResponse(ResponseDeleted(id=response_id).model_dump())

    async def _create(self, request: Request, log: AccessLog) -> Response:
        body = await self.chat.parse_body(request, ResponsesRequest)
        check_supported(body)
        tenant = auth.tenant(request)
        history: list[ChatMessage] = []
        if body.previous_response_id is not None:
            previous = self.store.get(tenant, body.previous_response_id, "previous_response_id")
            history = previous.conversation
        chat_body = chat_request(body, history)
        # What a continuation of this response will start from: all but the instructions.
        conversation = (
            chat_body.messages[1:] if body.instructions is not None else chat_body.messages
        )
        try:
            started = await self.chat.start(request, chat_body, log)
        except ApiError as exc:
            raise renamed(exc) from None
        created_at = int(time.time())
        if body.stream:
            events = ResponseEvents()
            stream = self._events(body, events, started, log, created_at, tenant, conversation)
            return self.chat.event_stream(
                started.stream,
                stream,
                log,
                error_event=lambda error: events.event(
                    "error", code=error.code, message=error.message, param=error.param
                ),
                last_event=None,  # OpenAI's response streams end with their last event
            )
        text, finish_reason = "", None
        for delta in await self.chat.collect(request, started.stream, log):
            for piece in delta.outputs:
                text += piece.text
                finish_reason = piece.finish_reason or finish_reason
        message, _ = ChatAnswer(started.mode).message(text, finish_reason)
        status = item_status(finish_reason)
        output = output_items(message.content, message.tool_calls, status)
        response = self._response(body, log, created_at, status, output)
        self._store(body, tenant, response, conversation)
        return JSONResponse(response.model_dump())

    async def _events(
        self,
        body: ResponsesRequest,
        events: ResponseEvents,
        started: StartedChat,
        log: AccessLog,
        created_at: int,
        tenant: str | None,
        conversation: list[ChatMessage],
    ) -> AsyncIterator[str]:
        begun = self._response(body, log, created_at, "in_progress", []).model_dump()
        yield events.event("response.created", response=begun)
        yield events.event("response.in_progress", response=begun)
        answer = ChatAnswer(started.mode)
        finish_reason = None
        async for delta in started.stream:
            log.count(delta)
            for output in delta.outputs:
                text, calls = answer.feed(output.text)
                for event in (*events.text(text), *events.calls(calls)):
                    yield event
                if output.finish_reason is not None:
                    finish_reason = output.finish_reason
                    text, calls, _ = answer.finish(finish_reason)
                    for event in (*events.text(text), *events.calls(calls)):
                        yield event
        status = item_status(finish_reason)
        for event in events.finish(status):
            yield event
        response = self._response(body, log, created_at, status, events.output)
        self._store(body, tenant, response, conversation)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield events.event(kind, response=response.model_dump())

    def _response(
        self,
        body: ResponsesRequest,
        log: AccessLog,
        created_at: int,
        status: ItemStatus,
        output: list[OutputItem],
    ) -> ResponseObject:
        """The response object: the request's settings echoed, and what is done so far."""
        done = status != "in_progress"
        choice = tool_choice(body.tool_choice) or "auto"
        text_format = {"type": "text"}
        if body.text is not None and body.text.format is not None:
            text_format = body.text.format.model_dump(by_alias=True, exclude_none=True)
        return ResponseObject(
            id=log.request_id,
            created_at=created_at,
            completed_at=int(time.time()) if done else None,
            status=status,
            incomplete_details=(
                IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
            ),
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            metadata=body.metadata or {},
            model=self.chat.config.served_model_name,
            output=output,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            store=body.store is not False,
            temperature=body.temperature,
            top_p=body.top_p,
            text={"format": text_format},
            tool_choice=choice.model_dump() if isinstance(choice, FunctionToolChoice) else choice,
            tools=[tool.model_dump() for tool in function_tools(body.tools)],
            usage=_usage(log) if done else None,
            user=body.user,
            safety_identifier=body.safety_identifier,
        )

    def _store(
        self,
        body: ResponsesRequest,
        tenant: str | None,
        response: ResponseObject,
        conversation: list[ChatMessage],
    ) -> None:
        if body.store is not False:
            history = [*conversation, answer_message(response.output)]
            self.store.put(tenant, StoredResponse(response, history))


def install_responses_routes(app: FastAPI, chat: ChatServing, store: ResponseStore) -> None:
    """Add ``POST /v1/responses`` and ``GET``/``DELETE /v1/responses/{response_id}`` to ``app``."""
    responses = ResponsesServing(chat, store)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create(request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return await responses.retrieve(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await responses.delete(request, response_id)


def _usage(log: AccessLog) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=log.num_prompt_tokens,
        output_tokens=log.num_generated_tokens,
        total_tokens=log.num_prompt_tokens + log.num_generated_tokens,
    )


def _refuse_query(request: Request) -> None:
    """``include`` and ``stream`` on a stored response are not implemented: say so."""
    for name in request.query_params:
        raise ApiError.invalid(name, f"The query parameter '{name}' is not supported here.")
