"""PoolingParams: what an embedding request asks of the pooled vector (vLLM's name).

An embedding request computes its prompt once and returns one vector, pooled
from the model's last hidden states as the model's pooling configuration says
(mean, CLS or last token; normalised or not: ``layers/pooler.py``). The
request itself chooses only what the model allows it to: a shorter vector
(``dimensions``) where the model was trained for truncation, and how a prompt
past the model's limit is handled (``truncate_prompt_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import InvalidParameterError


@dataclass(frozen=True)
class PoolingParams:
    """dimensions: keep the first this-many values of the vector (then normalise again,
        if the model normalises); None keeps them all. Allowed only for the
        sizes the model declares (``matryoshka_dimensions``) and its full size.
    truncate_prompt_tokens: a prompt longer than this keeps its first this-many
        tokens (text is cut by the tokenizer, which keeps the special tokens that
        frame it, as sentence-transformers does); -1 means the model's limit;
        None refuses a prompt past the model's limit.
    """

    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InvalidParameterError(name, f"must be a positive integer, got {value!r}")
            if (
                value is not None
                and value < 1
                and not (name == "truncate_prompt_tokens" and value == -1)
            ):
                raise InvalidParameterError(
                    name,
                    f"must be a positive integer{' or -1' if name == 'truncate_prompt_tokens' else ''}, got {value}",
                )
