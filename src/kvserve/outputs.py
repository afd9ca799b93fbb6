"""What the engine hands back: vLLM-shaped request and completion outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """Log probability of one token under the model, its rank (1 = most likely) and text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per generated token: {token_id: Logprob} holding the sampled token and the top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position: None for the first token (nothing comes before it), then
# {token_id: Logprob} holding the prompt token and the top alternatives.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a prompt (a request with ``n > 1`` has several).

    finish_reason: None while running, then ``stop`` (EOS, stop token or
        stop string), ``length`` (max_tokens or max_model_len), ``abort``, or
        ``error`` (the request failed; :attr:`RequestOutput.error` says why).
    stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request reached each stage, in ``time.monotonic()`` seconds.

    first_scheduled_time: the first step that computed any of its tokens
        (``first_scheduled_time - arrival_time`` is its time in the queue).
    first_token_time, last_token_time: when a step produced its first and its
        latest token (any of its n sequences).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and every completion so far (cumulative).

    error: set when a step failed on this request alone (sampling its next
        token, turning its tokens into text); it is then finished, and its
        unfinished completions end with ``error``. Other requests are unaffected.
    embedding: an embedding request's pooled vector, once finished (None for
        generation); its one completion is empty and ends with ``stop``.
    prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per
        prompt token (see :data:`PromptLogprobs`), complete from the output
        that carries the first generated token on; None otherwise.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None
    embedding: list[float] | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class EmbeddingOutput:
    """One prompt's vector (vLLM's name): ``embedding`` is float32 values as Python floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What :meth:`kvserve.LLM.embed` returns per prompt, shaped as vLLM's."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
