"""The CPU's decode fast path: a decode-only step's decoder layers in one C call.

A decode-only step (decode rows only, no prefill chunk; a request verifying
speculative proposals is one decode row per token, see ``input_batch.py``)
runs every decoder layer in ``kv_decode_layers``: at batch 1 the Python between thirty
layers' calls cost more than a third of the step. :class:`NativeDecoder`
walks the model through its :class:`~kvserve.models.decoder_model.DecoderModel`
interface (embedding, RoPE tables, layers, final norm) and reads each layer's
declared parts once (:mod:`decode_layouts`) into a
:class:`~kvserve.kernels.decode_stack.DecodeStack`. The CPU plan
(``platform/cpu.py``) builds it when every layer has a shape the kernel walks.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import AttentionLayout
from kvserve.kernels import NativeOps, native_ops
from kvserve.kernels.decode_stack import DecodeStack
from kvserve.models.decoder_model import DecoderLayer, DecoderModel, HasDecoder
from kvserve.worker.decode_layouts import read_decode_layer


class NativeDecoder:
    """Runs a decode-only step's decoder layers in one C call (a ``DecodeFastPath``).

    decoder: the model's decoder, after its KV caches are bound. Build it with
    :meth:`for_model`, which returns None when the layers do not have a shape
    the kernel walks.
    """

    def __init__(self, decoder: DecoderModel, stack: DecodeStack, ops: NativeOps) -> None:
        self.decoder = decoder
        self.stack = stack
        self.ops = ops
        self.final_norm = decoder.final_norm()

    @classmethod
    def for_model(cls, model: nn.Module, ops: NativeOps | None = None) -> NativeDecoder | None:
        """The one-call decoder of ``model``, or None where the kernel cannot walk it."""
        ops = ops if ops is not None else native_ops()
        if ops is None or not isinstance(model, HasDecoder):
            return None
        decoder = model.decoder()
        modules = decoder.decoder_layers()
        layers = [layer for layer in modules if isinstance(layer, DecoderLayer)]
        if not layers or len(layers) != len(modules):
            return None
        weights = [read_decode_layer(layer) for layer in modules]
        caches = [layer.decode_layout().attention.kv_cache for layer in layers]
        if any(w is None for w in weights) or any(cache.numel() == 0 for cache in caches):
            return None
        stack = DecodeStack([w for w in weights if w is not None], caches)
        return cls(decoder, stack, ops)

    def applies(self, layouts: tuple[AttentionLayout, ...]) -> bool:
        """The step has decode rows only (every group's layout lists the same requests)."""
        return not layouts[0].prefills

    def rope_tables(self, positions: torch.Tensor) -> list[torch.Tensor]:
        return self.decoder.rope_tables(positions)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layouts: tuple[AttentionLayout, ...]
    ) -> torch.Tensor:
        """input_ids, positions ``[T]`` of decode rows → final hidden states ``[T, H]``.

        layouts: one per KV cache group; the stack attends with its own kernel, so no
        backend's metadata is built for these steps. Each layer writes every row's
        K/V before it attends, so a verifying request's rows see each other's.
        """
        hidden = self.decoder.embed(input_ids, positions).float().contiguous()
        # hidden becomes the residual stream, updated in place.
        out = self.ops.decode_layers(
            self.stack,
            hidden,
            self.rope_tables(positions),
            [layout.slot_mapping for layout in layouts],
            [layout.decode_block_tables for layout in layouts],
            layouts[0].decode_seq_lens,  # a row's length is the same in every group
        )
        return self.final_norm.add_and_norm(out, hidden)[0]
