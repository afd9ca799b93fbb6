"""The CPU fast path: C kernels in the layers, and decode-only steps in one C call.

Models describe their architecture with the shared layers and never mention
the kernels. After loading, the worker calls :func:`enable_native_kernels`,
which hands the kernels to every layer that can use them (linear products,
norms, rotary embeddings, activations), and builds a :class:`NativeDecoder`
when every decoder layer has a shape the one-call kernel walks (see
:mod:`decode_layouts`: the Llama, Qwen, Gemma and GPT-2 layouts).

A decode-only step (one token per sequence, no prefill chunk) then runs every
decoder layer in ``kv_decode_layers``: at batch 1 the Python between thirty
layers' calls cost more than a third of the step.

The decoder module around the layers is read the same way: its layers
(``layers`` or ``h``), its final norm (``norm`` or ``ln_f``, with
``add_and_norm``), its embedding (``embed(input_ids, positions)`` where the
family has one, else ``embed_tokens``) and its RoPE tables
(``rope_tables(positions)``, else ``rotary_emb(positions)`` as the only one,
else none).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvserve.attention import AttentionLayout
from kvserve.kernels import NativeOps, native_ops
from kvserve.layers.activation import GELU, GeluAndMul, SiluAndMul
from kvserve.layers.attention import Attention
from kvserve.layers.linear import Linear
from kvserve.layers.norm import LayerNorm, RMSNorm
from kvserve.layers.rotary import RotaryQK
from kvserve.worker.decode_layouts import LAYOUTS, part, read_decode_layer
from kvserve.worker.decode_stack import DecodeStack


def enable_native_kernels(model: nn.Module, ops: NativeOps | None = None) -> int:
    """Hand the C kernels to every layer that can use them; returns how many took them.

    For float32 activations on CPU (the weights may be bfloat16). Does nothing
    (returns 0) when the kernels are unavailable.
    """
    ops = ops if ops is not None else native_ops()
    if ops is None:
        return 0
    count = 0
    for module in model.modules():
        takes_kernels = isinstance(
            module, RMSNorm | LayerNorm | SiluAndMul | GELU | GeluAndMul | RotaryQK
        ) or (isinstance(module, Linear) and not module.packed)
        if takes_kernels:
            setattr(module, "native", ops)  # noqa: B010  (mypy: nn.Module's __setattr__)
            count += 1
    return count


def _first(module: object, *names: str) -> Any:
    for name in names:
        found = getattr(module, name, None)
        if found is not None:
            return found
    return None


class NativeDecoder:
    """Runs a decode-only step's decoder layers in one C call.

    decoder: the model's decoder module (see the module docstring for what is
    read of it), after its KV caches are bound. Build it with :meth:`for_model`,
    which returns None when the layers do not have a shape the kernel walks.
    """

    def __init__(self, decoder: Any, stack: DecodeStack, ops: NativeOps) -> None:
        self.decoder = decoder
        self.stack = stack
        self.ops = ops
        self.final_norm = _first(decoder, "norm", "ln_f")

    @classmethod
    def for_model(cls, model: nn.Module, ops: NativeOps | None = None) -> NativeDecoder | None:
        ops = ops if ops is not None else native_ops()
        decoder: Any = _first(model, "model", "transformer")
        layers = _first(decoder, "layers", "h")
        if ops is None or not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            return None
        if not hasattr(_first(decoder, "norm", "ln_f"), "add_and_norm"):
            return None
        if not (hasattr(decoder, "embed") or hasattr(decoder, "embed_tokens")):
            return None
        weights = [read_decode_layer(layer) for layer in layers]
        caches: list[torch.Tensor] = []
        for layer in layers:
            for layout in LAYOUTS:
                attention = part(layer, layout.attention)
                if isinstance(attention, Attention):
                    caches.append(attention.kv_cache)
                    break
        if any(w is None for w in weights) or len(caches) != len(layers):
            return None
        if any(cache.numel() == 0 for cache in caches):
            return None
        stack = DecodeStack([w for w in weights if w is not None], caches)
        return cls(decoder, stack, ops)

    def applies(self, layouts: tuple[AttentionLayout, ...]) -> bool:
        """The step has decode rows only (every group's layout lists the same requests)."""
        return not layouts[0].prefills

    def rope_tables(self, positions: torch.Tensor) -> list[torch.Tensor]:
        if hasattr(self.decoder, "rope_tables"):
            return list(self.decoder.rope_tables(positions))
        if hasattr(self.decoder, "rotary_emb"):
            return [self.decoder.rotary_emb(positions)]
        return []

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layouts: tuple[AttentionLayout, ...]
    ) -> torch.Tensor:
        """input_ids, positions ``[T]`` of decode rows → final hidden states ``[T, H]``.

        layouts: one per KV cache group; the stack attends with its own kernel, so no
        backend's metadata is built for these steps.
        """
        if hasattr(self.decoder, "embed"):
            hidden = self.decoder.embed(input_ids, positions)
        else:
            hidden = self.decoder.embed_tokens(input_ids)
        hidden = hidden.float().contiguous()
        # hidden becomes the residual stream, updated in place.
        out = self.ops.decode_layers(
            self.stack,
            hidden,
            self.rope_tables(positions),
            [layout.slot_mapping for layout in layouts],
            [layout.decode_block_tables for layout in layouts],
            layouts[0].decode_seq_lens,  # a request's length is the same in every group
        )
        return self.final_norm.add_and_norm(out, hidden)[0]
