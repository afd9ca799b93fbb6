"""Copy a checkpoint tensor into a parameter, refusing anything but the exact shape.

``Tensor.copy_`` broadcasts and converts: a one-element tensor would fill a
whole norm weight, a ``(1, hidden)`` row a whole embedding, an integer tensor
would become float weights. A checkpoint that does any of that is the wrong
file, so every weight goes through :func:`copy_weight`.
"""

from __future__ import annotations

import torch


def copy_weight(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    """Copy ``tensor`` into ``target`` (a parameter or a view of its rows).

    Raises ValueError naming ``what`` when the shapes differ or ``tensor`` is
    not floating point; ``target`` is untouched then.
    """
    if tensor.shape != target.shape:
        raise ValueError(f"{what} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"{what} has dtype {tensor.dtype}; weights must be floating point")
    target.copy_(tensor)
