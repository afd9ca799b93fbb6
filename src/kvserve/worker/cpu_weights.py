"""CPU fast paths for the linear layers, chosen once after loading.

bf16 on CPUs with native bf16 units: pre-packed weights.

PyTorch's plain bf16 ``linear`` on CPU hands oneDNN the weight in its
row-major layout, and oneDNN re-packs it into its blocked layout inside every
call: at decode batch sizes that copy costs more than the product itself.
Packing each weight once at load time (the same values, another layout)
makes decode 2-3x faster per matmul and large batches ~1.5x faster, with
bit-identical results.

bf16 on CPUs without bf16 arithmetic: linear weights stored in bf16, all
arithmetic in float32 through the C kernel (half the bytes to stream).

float32: products with up to a few hundred rows go to kvserve's own C
kernel (see ``kernels/csrc/linear.c``), BLAS keeps larger ones; norms,
rotary embeddings and activations get one-pass C kernels too.

Each choice is the layer's weight format (``layers/weight_format.py``).
Layers that kept a GGUF file's quantized blocks stay quantized whatever the
dtype: only their kernels change.

Last, the weights the kernels stream move onto transparent huge pages
(``kernels/huge_pages.py``), where the kernel gives them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.config.dtype import cpu_has_native_bf16
from kvserve.kernels import NativeOps
from kvserve.kernels.heap import release_free_heap
from kvserve.kernels.huge_pages import to_huge_pages
from kvserve.kernels.quant_weight import QuantWeight
from kvserve.layers.embedding import VocabEmbedding
from kvserve.layers.linear import Linear
from kvserve.layers.weight_format import PackedBF16Weights, QuantizedWeights, TorchWeights

if TYPE_CHECKING:
    from kvserve.loader.repacked_cache import RepackedCache


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """Packing pays off (and is supported) for bf16 on CPUs with native bf16 units."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and cpu_has_native_bf16()
    )


def prepack_linear_weights(model: nn.Module) -> int:
    """Replace every Linear's weight by a packed copy; returns how many were packed.

    Each packed weight is a new parameter, so a weight shared with another
    module (a tied embedding) keeps its plain layout there.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.format, TorchWeights):
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
            module.weight = nn.Parameter(packed, requires_grad=False)
            module.format = PackedBF16Weights()
            count += 1
    return count


def store_linear_weights_in_bf16(model: nn.Module) -> int:
    """Keep every Linear's weight in bfloat16 (activations stay float32); returns how many.

    For CPUs without bf16 arithmetic: the C kernel widens each weight to
    float32 as it streams it, so decode reads half the bytes. A weight shared
    with another module (a tied embedding) is copied, and the other keeps its
    float32 weight.
    """
    count = 0
    for module in model.modules():
        if (
            isinstance(module, Linear)
            and isinstance(module.format, TorchWeights)
            and module.weight.dtype == torch.float32
        ):
            narrowed = module.weight.detach().to(torch.bfloat16)
            module.weight = nn.Parameter(narrowed, requires_grad=False)
            count += 1
    return count


def use_linear_kernels(
    model: nn.Module, ops: NativeOps, repacked: RepackedCache | None = None
) -> None:
    """Hand every Linear the C kernels: each format picks the kernel for its weight
    (float32, bfloat16, quantized); a packed layer keeps oneDNN's matmul. repacked:
    the cached segments in the kernels' layout, found by each layer's module name."""
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            segments = None if repacked is None else repacked.for_weight(name)
            module.format = module.format.with_kernels(module, ops, segments)


# Smaller tensors (norms, biases) stay where they are: they sit in the caches anyway.
HUGE_PAGES_MIN_BYTES = 1 << 16
# Nor does a model whose weights come to less than this move: a decode step finds them
# in the last-level cache (16 MiB or more on the CPUs kvserve is measured on), so the
# copy and a page fault per 2 MiB would buy nothing. The test suite's tiny models are
# such models, and it builds hundreds of engines.
HUGE_PAGES_MIN_MODEL_BYTES = 16 << 20


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Copy the model's large float parameters and every quantized weight's blocks (the
    layers' and a quantized embedding table's) into one mapping on huge pages
    (:func:`~kvserve.kernels.huge_pages.to_huge_pages`); returns the bytes moved (0 for
    a model under :data:`HUGE_PAGES_MIN_MODEL_BYTES`, which stays where it was loaded).

    Call it after the layers have their kernels' formats and before anything takes a
    weight's address (the one-call decode stack). A weight two modules share (a tied
    LM head) moves once and stays shared. oneDNN-packed weights stay where they are.
    """
    params = [
        param
        for param in model.parameters()
        if param.dtype.is_floating_point
        and param.is_contiguous()
        and param.numel() * param.element_size() >= HUGE_PAGES_MIN_BYTES
        and not param.is_mkldnn
    ]
    holders: list[tuple[QuantizedWeights | VocabEmbedding, QuantWeight]] = []
    qweights: dict[int, QuantWeight] = {}
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.format, QuantizedWeights):
            holders.append((module.format, module.format.qweight))
        elif isinstance(module, VocabEmbedding) and module.qweight is not None:
            holders.append((module, module.qweight))
    for _, qweight in holders:
        qweights.setdefault(id(qweight), qweight)
    segments = [segment for qweight in qweights.values() for segment in qweight.segments]
    sources = [param.data for param in params] + [segment.data for segment in segments]
    total = sum(source.numel() * source.element_size() for source in sources)
    if total < HUGE_PAGES_MIN_MODEL_BYTES:
        return 0
    # Loading's freed temporaries go back first, or the copies would stack on top of them.
    release_free_heap()
    copies = to_huge_pages(sources)
    for param, copy in zip(params, copies, strict=False):
        param.data = copy
    copied = iter(copies[len(params) :])
    moved: dict[int, QuantWeight] = {
        key: QuantWeight(
            qweight.in_features,
            [dataclasses.replace(segment, data=next(copied)) for segment in qweight.segments],
        )
        for key, qweight in qweights.items()
    }
    for holder, qweight in holders:
        holder.qweight = moved[id(qweight)]
    return total
