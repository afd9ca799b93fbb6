"""OpenAI's ``/v1/embeddings`` request and response bodies (pydantic v2, strict as the rest).

``input`` is a string, a list of strings, one list of token ids or a list of
them, as OpenAI takes it; ``truncate_prompt_tokens`` is vLLM's extension
(the ``openai`` client sends it through ``extra_body``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # Floats, or (encoding_format base64) the little-endian float32 bytes in base64.
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
