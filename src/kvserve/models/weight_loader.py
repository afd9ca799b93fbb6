"""Copy a checkpoint's tensors into a model's parameters, and refuse any checkpoint that does not fit.

Every model class loads through :func:`load_checkpoint`; what differs between
families is only where each checkpoint name goes (a :class:`WeightTarget`).
The strictness is shared: a tensor with no place in the model, a tensor given
twice, one of the wrong shape or kind, and a parameter left unloaded are all
a :class:`ModelLoadError` naming the tensor.

A checkpoint may hand over tensors kept in their quantized blocks
(:class:`QuantizedTensor`, from a GGUF file). A module that takes them says
so by having a ``load(param_name, tensor, shard)`` method
(:class:`TakesQuantized`, as :class:`Linear` does); every other module gets
the tensor dequantized, as it would from a load that dequantizes everything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from kvserve.errors import ModelLoadError
from kvserve.kernels.quant_weight import QuantizedTensor
from kvserve.layers.linear import Linear
from kvserve.layers.weight_copy import copy_weight


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes.

    param: the full name of the model's parameter (``model.layers.0.self_attn.qkv_proj.weight``).
    shard: the named row range of a fused :class:`Linear` it fills, or None for all of it.
    transpose: the checkpoint stores the matrix as ``[in, out]`` (Hugging Face's
        Conv1D, used by GPT-2); it is transposed to the ``[out, in]`` of ``Linear``.
        A :class:`QuantizedTensor` is always ``[out, in]`` (its rows are whole
        blocks) and is never transposed.
    """

    param: str
    shard: str | None = None
    transpose: bool = False


# A checkpoint name → its target, or None for a tensor the model does not need
# (a derived buffer, the stored copy of a tied LM head).
TargetOf = Callable[[str], WeightTarget | None]


@runtime_checkable
class TakesQuantized(Protocol):
    """A module that loads its own checkpoint tensors, quantized ones included (``Linear``).

    ``load`` copies (or keeps) ``tensor`` as its parameter ``param_name``, or
    as the named shard of it; it raises ValueError on a mismatch.
    """

    def load(
        self, param_name: str, tensor: torch.Tensor | QuantizedTensor, shard: str | None = None
    ) -> None: ...


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]],
    target_of: TargetOf,
) -> None:
    """Copy each ``(checkpoint name, tensor)`` into its parameter, one tensor at a time.

    A :class:`QuantizedTensor` goes as it is to a layer that keeps quantized
    weights (:class:`TakesQuantized`); any other layer gets its float32 values.

    Raises ModelLoadError when a tensor is unknown, given twice, mis-shaped or
    not floating point, or when a parameter was never loaded.
    """
    modules = dict(model.named_modules())
    expected = expected_tensors(model)
    loaded: set[tuple[str, str | None]] = set()
    for name, tensor in weights:
        target = target_of(name)
        if target is None:
            continue
        key = (target.param, target.shard)
        module_name, _, param_name = target.param.rpartition(".")
        module = modules.get(module_name)
        if module is None or key not in expected:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} has no place in the model", field=name
            )
        if key in loaded:
            raise ModelLoadError(f"checkpoint tensor {name!r} appears twice", field=name)
        if isinstance(tensor, QuantizedTensor):
            if not isinstance(module, TakesQuantized):
                tensor = tensor.dequantize()
        elif target.transpose and tensor.dim() == 2:
            tensor = tensor.t()
        try:
            if isinstance(module, TakesQuantized):
                # The layer's own load: it decides what it keeps of a QuantizedTensor.
                module.load(param_name, tensor, target.shard)
            else:
                assert isinstance(tensor, torch.Tensor)  # dequantized above
                copy_weight(getattr(module, param_name).data, tensor, "it")
        except (RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"checkpoint tensor {name!r}: {exc}", field=name) from exc
        loaded.add(key)
    unloaded = expected - loaded
    if unloaded:
        names = sorted(f"{n}[{s}]" if s else n for n, s in unloaded)
        raise ModelLoadError(
            f"checkpoint lacks {len(unloaded)} tensors, e.g. {', '.join(names[:5])}",
            field=names[0],
        )


def expected_tensors(model: nn.Module) -> set[tuple[str, str | None]]:
    """Every (parameter, shard) a complete checkpoint fills; shard None for unfused ones.

    A parameter shared by two modules (a tied LM head) counts once, under the
    name it was first registered with (the embedding's).
    """
    modules = dict(model.named_modules())
    expected: set[tuple[str, str | None]] = set()
    for full_name, _ in model.named_parameters():
        module = modules[full_name.rpartition(".")[0]]
        shards = module.shard_rows if isinstance(module, Linear) else {}
        expected.update((full_name, shard) for shard in shards or [None])
    return expected
