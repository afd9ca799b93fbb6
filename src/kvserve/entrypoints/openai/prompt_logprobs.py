"""Prompt logprobs in the server's two shapes.

vLLM's ``prompt_logprobs`` field (completions and chat) returns the engine's
entries as they are: null for the first token, then ``{token id: {logprob,
rank, decoded_token}}``. OpenAI's legacy ``echo`` with ``logprobs`` instead
puts the prompt's tokens ahead of the completion's in the choice's parallel
lists, the first with null logprobs (nothing comes before it).
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.entrypoints.openai.protocol import (
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobsBody,
)
from kvserve.outputs import PromptLogprobs


def prompt_logprobs_body(prompt_logprobs: PromptLogprobs) -> PromptLogprobsBody:
    """vLLM's JSON shape of a request's prompt logprobs."""
    return [
        None
        if entry is None
        else {
            str(token_id): PromptLogprob(
                logprob=value.logprob, rank=value.rank, decoded_token=value.decoded_token
            )
            for token_id, value in entry.items()
        }
        for entry in prompt_logprobs
    ]


def echo_logprobs(
    prompt_token_ids: list[int],
    prompt_logprobs: PromptLogprobs,
    num_top: int,
    decode_first: Callable[[list[int]], str],
) -> CompletionLogprobs:
    """The prompt's part of a legacy ``logprobs`` object, for ``echo``.

    decode_first: the text of the first prompt token, which has no entry to carry it.
    """
    echoed = CompletionLogprobs()
    offset = 0
    for position, token_id in enumerate(prompt_token_ids):
        entry = prompt_logprobs[position] if position < len(prompt_logprobs) else None
        if entry is None:
            token = decode_first([token_id])
            echoed.token_logprobs.append(None)
            echoed.top_logprobs.append(None)
        else:
            own = entry[token_id]
            token = own.decoded_token or ""
            top = sorted((e for e in entry.values() if e.rank <= num_top), key=lambda e: e.rank)
            echoed.token_logprobs.append(own.logprob)
            echoed.top_logprobs.append({e.decoded_token or "": e.logprob for e in top})
        echoed.tokens.append(token)
        echoed.text_offset.append(offset)
        offset += len(token)
    return echoed
