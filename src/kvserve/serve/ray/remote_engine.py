"""The ingress's engine client: validation here, steps on the engine replicas.

The serving layer (``entrypoints/openai/serving_*.py``) uses an engine through
:class:`~kvserve.engine.engine_client.EngineClient`. :class:`RemoteAsyncEngine`
implements it over the engine deployment's handle, so ``build_app``'s routes
run unchanged in the ingress replica:

- tokenizing, chat templates and every request check run here, on the
  :class:`EngineFront` (the tokenizer and a validator on the replicas'
  limits, no weights), so bad input gets the same 400 before anything is
  sent, and the router gets token ids to hash;
- ``generate`` makes one streaming DeploymentHandle call per client call; a
  pump task moves its items into a ``RequestStream`` whose ``accepted`` waits
  for the replica's first item (accepted, or the refusal), so the serving
  layer starts no response before it knows: one extra item per call, none
  per token;
- closing the stream early cancels the call, which aborts the requests on
  their replica and frees their blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from typing import cast

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from kvserve.chat.render import install_chat_template
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.engine.async_commands import PreparedRequest
from kvserve.engine.async_errors import EngineDeadError, RequestFailedError
from kvserve.engine.engine_client import PromptType, TokenizedPrompt
from kvserve.engine.output_stream import OutputStream, RequestStream
from kvserve.engine.request_checks import RequestValidator
from kvserve.errors import new_error_id
from kvserve.loader import load_tokenizer, resolve_model
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.serve.ray.engine_replica import Accepted, EngineFacts
from kvserve.structured import CompiledGrammar
from kvserve.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class EngineFront:
    """An engine's request checks without its model: what the ingress validates with.

    The checks are the engine's own (a :class:`RequestValidator`, as LLMEngine
    builds one), on the replicas' limits: the ingress and the replicas can
    never disagree.
    """

    def __init__(self, facts: EngineFacts, chat_template: str | None = None) -> None:
        # Resolved here, not taken from the replica: its path may not exist on this node.
        model_config = facts.config.model_config
        self.tokenizer = load_tokenizer(resolve_model(model_config.model, model_config.revision))
        if chat_template is not None:
            install_chat_template(self.tokenizer, chat_template)
        self.limits = facts.limits
        # Bookkeeping only (no tensors): the validator asks it whether a request fits.
        kv_cache_manager = KVCacheManager(
            facts.num_blocks,
            facts.config.cache_config.block_size,
            enable_caching=facts.enable_caching,
            sliding_windows=facts.sliding_windows,
        )
        grammar_compiler = GrammarCompiler(
            self.tokenizer, facts.limits.vocab_size, facts.eos_token_ids
        )
        self.validator = RequestValidator(
            facts.limits,
            self.tokenizer,
            facts.config.scheduler_config,
            kv_cache_manager,
            grammar_compiler,
        )


class RemoteAsyncEngine:
    """An :class:`~kvserve.engine.engine_client.EngineClient` over the engine deployment's
    handle; ``front`` validates here, the replicas run the steps."""

    def __init__(self, front: EngineFront, handle: DeploymentHandle) -> None:
        self.tokenizer = front.tokenizer
        self.limits = front.limits
        self._validator = front.validator
        self._handle = handle.options(stream=True)
        self._calls: dict[str, asyncio.Task[None]] = {}  # request id → its call's pump
        self._running = False

    def start(self) -> None:
        self._running = True

    def shutdown(self, timeout: float = 30.0) -> None:
        self._running = False
        for pump in set(self._calls.values()):
            pump.cancel()

    @property
    def is_healthy(self) -> bool:
        return self._running

    def tokenize(self, prompt: PromptType) -> TokenizedPrompt:
        """The prompt's text (if given as text) and token ids; raises InvalidParameterError."""
        return self._validator.tokenize_prompt(prompt)

    def prepare(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """The request, checked against the replicas' limits; nothing is sent."""
        return self._validator.prepare(request_id, prompt_token_ids, params, prompt, cache_salt)

    def prepare_embedding(
        self, request_id: str, prompt: PromptType, pooling: PoolingParams, param: str = "prompt"
    ) -> PreparedRequest:
        """An embedding request, checked against the replicas' limits; nothing is sent."""
        return self._validator.prepare_embedding(request_id, prompt, pooling, param)

    def compile_grammar(self, params: SamplingParams) -> futures.Future[CompiledGrammar] | None:
        """The compile of ``params``' grammar here (None without one), so a bad one is a 400
        before anything is sent; each replica compiles its own again."""
        return self._validator.compile_grammar(params)

    def generate(self, requests: Sequence[PreparedRequest]) -> RequestStream:
        """One call to a replica; its deltas (or its error) arrive on the returned stream."""
        if not self._running:
            raise EngineDeadError("not started")
        loop = asyncio.get_running_loop()
        queue = OutputStream(loop)
        acceptance: asyncio.Future[None] = loop.create_future()
        response = cast(DeploymentResponseGenerator, self._handle.generate.remote(list(requests)))
        ids = {request.request_id for request in requests}
        pump = asyncio.ensure_future(_pump(response, queue, acceptance))
        for request_id in ids:
            self._calls[request_id] = pump
        pump.add_done_callback(lambda _: self._forget(ids))
        return RemoteRequestStream(queue, ids, self.abort, acceptance)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Cancel the calls of ``request_ids``: the replica aborts them and frees their blocks.

        A call is all-or-nothing (its requests share one stream), as in AsyncEngine.
        """
        for request_id in request_ids:
            pump = self._calls.get(request_id)
            if pump is not None:
                pump.cancel()

    def _forget(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._calls.pop(request_id, None)


class RemoteRequestStream(RequestStream):
    """A remote call's stream: :meth:`accepted` waits for the replica's answer.

    acceptance: resolved by the pump when the replica accepts the call; holds
        the refusal (or the replica's loss) otherwise.
    """

    def __init__(
        self,
        queue: OutputStream,
        request_ids: set[str],
        abort: Callable[[set[str]], None],
        acceptance: asyncio.Future[None],
    ) -> None:
        super().__init__(queue, request_ids, abort)
        self._acceptance = acceptance

    async def accepted(self) -> None:
        """Return once the replica has queued the call; raise its refusal otherwise."""
        try:
            await self._acceptance
        except asyncio.CancelledError:
            self.close()  # the client left before the answer: the replica must not run it
            raise


async def _pump(
    response: DeploymentResponseGenerator, queue: OutputStream, acceptance: asyncio.Future[None]
) -> None:
    """Move the replica's items into ``queue``, its first into ``acceptance``; a lost
    replica fails the call's requests."""
    try:
        async for item in response:
            if acceptance.done():  # accepted (or the client left while waiting)
                queue.put(item)
            elif isinstance(item, Accepted):
                acceptance.set_result(None)
            else:  # refused: the replica queued nothing
                acceptance.set_exception(item)
    except asyncio.CancelledError:
        response.cancel()  # reaches the replica: its generator leaves `async with` and aborts
        raise
    except Exception:
        error_id = new_error_id()
        logger.exception("error %s: the replica serving a call failed", error_id)
        error = RequestFailedError("the replica serving this request failed", error_id)
        if acceptance.done():
            queue.put(error)
        else:
            acceptance.set_exception(error)
    finally:
        if not acceptance.done():  # shut down while the call was on its way
            acceptance.set_exception(EngineDeadError("the call ended before its replica answered"))
