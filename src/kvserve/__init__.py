"""kvserve: a small, readable LLM inference engine in Python and PyTorch."""

from __future__ import annotations

from kvserve.cpu_isa import apply_library_restriction
from kvserve.errors import InvalidParameterError, ModelLoadError
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.structured_params import StructuredOutputsParams

__all__ = [
    "LLM",
    "InvalidParameterError",
    "ModelLoadError",
    "PoolingParams",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"

# Before PyTorch is imported: KVSERVE_CPU_ISA restricts PyTorch's and oneDNN's kernels too.
apply_library_restriction()


def __getattr__(name: str) -> object:
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from kvserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
