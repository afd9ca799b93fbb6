"""Bench models in a real model's shape as GGUF files: BF16, then quantized by llama.cpp.

kvserve runs a user's quantized GGUF as stored, and the figure that matters
is its speed beside llama.cpp's on the same file. The shipped models are too
small for that figure to be about bandwidth, so this writes a llama-shaped
model of :data:`~kvserve.benchmarks.workloads.shaped_models.SHAPES` (SmolLM2-1.7B's, say)
with random weights:

- ``bf16``: written here with gguf-py, one tensor at a time (the 1.7B file
  is 3.4 GB; it never has to fit in memory): matrices in BF16, norms in F32,
  the ``llama.*`` hyperparameters kvserve's GGUF loader and llama.cpp read,
  and SmolLM2's tokenizer and chat template copied byte for byte from the
  shipped SmolLM2 GGUF (the same copy the llama.cpp baseline's BF16 file
  makes, :mod:`kvserve.benchmarks.baselines.llamacpp_weights`);
- ``q8_0`` and ``q4_k_m``: that file quantized by llama.cpp's own
  ``llama-quantize`` from the benchmarks' build of llama.cpp
  (:mod:`kvserve.benchmarks.baselines.llamacpp_build`), so the blocks are
  exactly what a user downloads.

The weights are the random numbers the Hugging Face folder of the same shape
and seed holds, drawn in the same order. llama.cpp's converter stores the
rows of ``attn_q``/``attn_k`` interleaved per head and kvserve's loader undoes
that on load; random rows need no reordering, so kvserve computes with a row
permutation of the folder's weights: the same speed, other noise.

The files are written on demand into
``$KVSERVE_CACHE_DIR/bench-models/<shape>-seed<seed>/`` and reused after:

    python -m kvserve.benchmarks.workloads.shaped_models smollm2-1.7b --gguf q4_k_m

prints the path. Never used by the tests' real runs, never shipped.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from kvserve.benchmarks.baselines.llamacpp_tools import ToolBuild, tool_build
from kvserve.benchmarks.baselines.llamacpp_weights import (
    TensorPlan,
    copy_metadata,
    write_tensors_streamed,
)
from kvserve.benchmarks.workloads.shaped_models import (
    GGUF_TYPES,
    INIT_STD,
    SHAPES,
    TOKENIZER_MODEL,
    Shape,
)
from kvserve.loader import resolve_model
from kvserve.loader.gguf_file import open_gguf
from kvserve.private_cache import (
    atomic_target,
    exclusive_lock,
    is_trusted_file,
    private_cache_dir,
)

# llama-quantize's name for each quantized type of GGUF_TYPES (bf16 is written here).
QUANTIZE_NAMES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
# Part of the folder name: bump it when the written files change for the same shape and seed.
_FORMAT_VERSION = "v1"

Q = gguf.GGMLQuantizationType

# Hugging Face tensor names of the llama family and the names llama.cpp gives them.
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF name of a llama checkpoint tensor (``model.layers.3.mlp.up_proj.weight``...)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_TENSOR.match(hf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise ValueError(f"no GGUF name for the llama tensor {hf_name!r}")
    return f"blk.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def llama_shape(name: str) -> Shape:
    """The llama-family shape ``name``; raises ValueError naming the allowed ones."""
    allowed = sorted(key for key, shape in SHAPES.items() if shape.config["model_type"] == "llama")
    if name not in allowed:
        raise ValueError(f"shape must be one of {allowed} to be written as GGUF, got {name!r}")
    return SHAPES[name]


def shaped_gguf_path(name: str, gguf_type: str, seed: int = 0) -> Path:
    """Where the GGUF of shape ``name`` in ``gguf_type`` is cached (it may not exist yet)."""
    folder = f"{name}-seed{seed}-{_FORMAT_VERSION}"
    return private_cache_dir("bench-models", folder) / f"{name}.{gguf_type}.gguf"


def shaped_gguf(
    name: str, gguf_type: str = "bf16", seed: int = 0, build: ToolBuild | None = None
) -> Path:
    """The cached GGUF of shape ``name`` in ``gguf_type``, written first if missing.

    A quantized type is made from the BF16 file (written first when missing)
    by ``llama-quantize`` of ``build``, by default the benchmarks' build for
    this machine; without the tools that raises InvalidParameterError saying
    how to build them, before anything is written. Two processes asking at
    once write each file once: the second waits for the first's.
    """
    llama_shape(name)
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"gguf_type must be one of {list(GGUF_TYPES)}, got {gguf_type!r}")
    target = shaped_gguf_path(name, gguf_type, seed)
    if is_trusted_file(target):
        return target
    quant_name = QUANTIZE_NAMES.get(gguf_type)
    if quant_name is not None:
        build = build if build is not None else tool_build("gguf")
        bf16 = shaped_gguf(name, "bf16", seed)
    with exclusive_lock(target.parent / f".{gguf_type}.lock"):
        if is_trusted_file(target):
            return target
        with atomic_target(target, ".part") as tmp_path:
            if quant_name is None:
                print(f"writing {name} (random weights, bf16) to {target}", flush=True)
                write_shaped_gguf(name, tmp_path, seed)
            else:
                assert build is not None
                print(f"quantizing {bf16.name} to {quant_name} with {build.describe()}", flush=True)
                quantize_gguf(build, bf16, tmp_path, quant_name)
    return target


def write_shaped_gguf(name: str, target: Path, seed: int = 0) -> None:
    """Write the llama-shaped model ``name`` with random weights as a BF16 GGUF at ``target``."""
    shape = llama_shape(name)
    c = shape.config
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])  # type: ignore[call-overload]
    writer = gguf.GGUFWriter(target, "llama")
    writer.add_name(f"kvserve bench {name} (random weights)")
    writer.add_block_count(int(c["num_hidden_layers"]))  # type: ignore[call-overload]
    writer.add_context_length(int(c["max_position_embeddings"]))  # type: ignore[call-overload]
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(c["intermediate_size"]))  # type: ignore[call-overload]
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(c["num_key_value_heads"]))  # type: ignore[call-overload]
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(float(c["rope_theta"]))  # type: ignore[arg-type]
    writer.add_layer_norm_rms_eps(float(c["rms_norm_eps"]))  # type: ignore[arg-type]
    writer.add_vocab_size(int(c["vocab_size"]))  # type: ignore[call-overload]
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    # SmolLM2's tokenizer, ids and chat template: every shape here uses its vocabulary.
    tokenizer_file = open_gguf(resolve_model(TOKENIZER_MODEL).path)
    copy_metadata(tokenizer_file, writer, lambda key: key.startswith("tokenizer."))
    tensors = list(shape.tensors())
    plans = [
        TensorPlan(gguf_tensor_name(hf_name), dims, Q.F32 if len(dims) == 1 else Q.BF16)
        for hf_name, dims in tensors
    ]
    write_tensors_streamed(writer, plans, _random_values(tensors, seed))


def _random_values(tensors: list[tuple[str, tuple[int, ...]]], seed: int) -> Iterator[np.ndarray]:
    """Each tensor's values as the GGUF stores them, drawn as the Hugging Face folder draws them."""
    generator = torch.Generator().manual_seed(seed)
    for _, dims in tensors:
        if len(dims) == 1:  # the norms (llama has no biases): unit gains keep activations in range
            yield np.ones(dims, dtype=np.float32)
            continue
        value = torch.randn(dims, generator=generator) * INIT_STD
        yield value.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        del value


def quantize_gguf(build: ToolBuild, source: Path, target: Path, quant_name: str) -> None:
    """``llama-quantize source target quant_name``; raises with the tool's own message on failure."""
    command = [str(build.tool("llama-quantize")), str(source), str(target), quant_name]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"llama-quantize failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
        )
