"""Which device the engine runs on."""

from __future__ import annotations

import torch

from kvserve.config.model import DeviceName
from kvserve.errors import InvalidParameterError


def resolve_device(name: DeviceName) -> torch.device:
    """``cpu``, ``cuda`` (refused when PyTorch sees no GPU), or ``auto``: CUDA when there is one."""
    has_cuda = torch.cuda.is_available()
    if name == "cuda" and not has_cuda:
        raise InvalidParameterError(
            "device", "cuda was asked for, but PyTorch sees no CUDA device; use cpu or auto"
        )
    if name == "cuda" or (name == "auto" and has_cuda):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
