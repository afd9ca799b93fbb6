"""Batched sampling: per-step metadata from the requests, and the sampler."""

from __future__ import annotations

from kvserve.sample.metadata import SamplingMetadata, SamplingRequest
from kvserve.sample.sampler import LogprobsTensors, Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRequest",
]
