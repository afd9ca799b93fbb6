"""The engine as its serving fronts see it: :class:`EngineClient` and :class:`EngineLimits`.

The OpenAI server (``entrypoints/openai/``), the dashboard's built-in load and
the Ray ingress (``serve/ray/``) talk to an engine only through this
interface. Two classes implement it: :class:`~kvserve.engine.AsyncEngine`
(the engine's steps on a thread of this process) and the Ray ingress's
``RemoteAsyncEngine`` (the steps on engine replicas). A front never reaches
past it into the engine's scheduler, KV cache or model: what it must know
of them is in :class:`EngineLimits`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvserve.engine.async_commands import PreparedRequest
from kvserve.engine.output_stream import RequestStream
from kvserve.layers.pooler import PoolingConfig
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.structured import CompiledGrammar

if TYPE_CHECKING:
    from kvserve.loader.fast_tokenizer import AnyTokenizer

# A prompt is text, a list of token ids, or a dict with "prompt" or "prompt_token_ids".
PromptType = str | Sequence[int] | Mapping[str, Any]


class TokenizedPrompt(NamedTuple):
    """A prompt as the engine runs it.

    text: the prompt's text when it was given as text (or alongside its ids), else None.
    token_ids: its token ids, each checked against the vocabulary; never empty.
    """

    text: str | None
    token_ids: list[int]


@dataclass(frozen=True)
class EngineLimits:
    """An engine's fixed limits, as its fronts read them; they never change while it runs.

    max_model_len: the most tokens (prompt + output) one sequence may hold.
    vocab_size: token ids run from 0 to ``vocab_size - 1``.
    kv_cache_tokens: the tokens the whole KV cache holds (usable blocks × block size).
    generates: the model takes generation requests (an encoder does not).
    pooling: how the model pools embeddings; None when it takes no embedding requests.
    max_embed_tokens: the longest prompt an embedding request may have (the model's
        limit, within the context and one step's token budget); 0 without pooling.
    """

    max_model_len: int
    vocab_size: int
    kv_cache_tokens: int
    generates: bool = True
    pooling: PoolingConfig | None = None
    max_embed_tokens: int = 0

    @property
    def max_sequence_len(self) -> int:
        """The longest sequence that could ever run: it outgrows neither the context nor the
        whole KV cache."""
        return min(self.max_model_len, self.kv_cache_tokens)


class EngineClient(Protocol):
    """What a serving front needs of an engine, wherever its steps run.

    Validation (:meth:`tokenize`, :meth:`prepare`, :meth:`compile_grammar`) runs
    in the caller's process, on the event loop or the tokenizer pool, and
    changes nothing: a bad request fails before anything is queued.
    """

    @property
    def tokenizer(self) -> AnyTokenizer:
        """The model's tokenizer (chat template included)."""
        ...

    @property
    def limits(self) -> EngineLimits: ...

    @property
    def is_healthy(self) -> bool:
        """True while the engine can take requests (``GET /health``)."""
        ...

    def start(self) -> None:
        """Begin serving; called once, from the app's start-up."""
        ...

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop serving; open streams end with ``EngineDeadError``. Blocks up to ``timeout``."""
        ...

    def tokenize(self, prompt: PromptType) -> TokenizedPrompt:
        """The prompt's text and token ids; raises InvalidParameterError."""
        ...

    def prepare(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """The request, checked against the engine's limits (InvalidParameterError if it could
        never run); nothing is queued. cache_salt: only requests with the same salt share
        prefix-cache blocks."""
        ...

    def prepare_embedding(
        self, request_id: str, prompt: PromptType, pooling: PoolingParams, param: str = "prompt"
    ) -> PreparedRequest:
        """An embedding request, tokenized (and truncated if ``pooling`` asks) and checked;
        InvalidParameterError naming ``param`` for a prompt past the model's limit, or
        ``dimensions``. Nothing is queued."""
        ...

    def compile_grammar(self, params: SamplingParams) -> futures.Future[CompiledGrammar] | None:
        """Start (or find in the cache) the compile of ``params``' structured-outputs spec;
        None when unconstrained. The future raises InvalidParameterError for a bad spec."""
        ...

    def generate(self, requests: Sequence[PreparedRequest]) -> RequestStream:
        """Queue ``requests`` (all or none); their deltas arrive on the returned stream.

        Raises EngineOverloadedError or EngineDeadError (nothing queued), or
        InvalidParameterError when the call has more sequences than may ever wait.
        The stream's ``accepted()`` returns once the engine has queued them.
        Must be called on the event loop that will read the stream.
        """
        ...

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored) and free their KV blocks."""
        ...
