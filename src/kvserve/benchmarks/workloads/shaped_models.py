"""Bench models in a real model's shape with random weights, written on demand.

The shipped models are small enough that per-token overhead, not bandwidth,
decides their speed; a benchmark of a model family or of a bigger size needs
the shape, not the weights. This writes a Hugging Face folder (config.json,
bf16 safetensors) whose weights are drawn from a seeded normal distribution,
with SmolLM2's tokenizer (49,152 entries, so every shape here uses that
vocabulary: the figures are for speed only; the text is noise).

    python -m kvserve.benchmarks.workloads.shaped_models gpt2-124m OUT_DIR

A llama-shaped model can also be written as a GGUF file, BF16 or quantized
by llama.cpp (:mod:`kvserve.benchmarks.workloads.shaped_gguf`), into
kvserve's cache; the path is printed:

    python -m kvserve.benchmarks.workloads.shaped_models smollm2-1.7b --gguf q4_k_m

Never used by the tests or the demo, and never shipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve.loader import resolve_model
from kvserve.loader.tokenizer import load_tokenizer

TOKENIZER_MODEL = "smollm2-135m-instruct"
VOCAB_SIZE = 49152  # SmolLM2's tokenizer
INIT_STD = 0.02
# The GGUF file types a llama-shaped model can be written as (see shaped_gguf.py).
GGUF_TYPES = ("bf16", "q8_0", "q4_k_m")


@dataclass(frozen=True)
class Shape:
    """A published model's shape: the config.json to write and its tensors."""

    description: str
    config: dict[str, object]

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Checkpoint names and shapes, as the family's Hugging Face class stores them."""
        if self.config["model_type"] == "gpt2":
            yield from _gpt2_tensors(self.config)
        else:
            yield from _llama_tensors(self.config)


def _gpt2_tensors(c: dict[str, object]) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, n, v, p = (int(c[k]) for k in ("n_embd", "n_layer", "vocab_size", "n_positions"))  # type: ignore[call-overload]
    yield "transformer.wte.weight", (v, h)
    yield "transformer.wpe.weight", (p, h)
    for i in range(n):
        pre = f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            yield pre + norm + ".weight", (h,)
            yield pre + norm + ".bias", (h,)
        # GPT-2 stores its projections as Conv1D: [in, out].
        for name, shape in (
            ("attn.c_attn", (h, 3 * h)),
            ("attn.c_proj", (h, h)),
            ("mlp.c_fc", (h, 4 * h)),
            ("mlp.c_proj", (4 * h, h)),
        ):
            yield pre + name + ".weight", shape
            yield pre + name + ".bias", (shape[1],)
    yield "transformer.ln_f.weight", (h,)
    yield "transformer.ln_f.bias", (h,)


def _llama_tensors(c: dict[str, object]) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, n, v, m = (
        int(c[k])  # type: ignore[call-overload]
        for k in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")
    )
    heads, kv_heads = int(c["num_attention_heads"]), int(c["num_key_value_heads"])  # type: ignore[call-overload]
    d = h // heads
    yield "model.embed_tokens.weight", (v, h)
    for i in range(n):
        pre = f"model.layers.{i}."
        yield pre + "input_layernorm.weight", (h,)
        yield pre + "post_attention_layernorm.weight", (h,)
        yield pre + "self_attn.q_proj.weight", (heads * d, h)
        yield pre + "self_attn.k_proj.weight", (kv_heads * d, h)
        yield pre + "self_attn.v_proj.weight", (kv_heads * d, h)
        yield pre + "self_attn.o_proj.weight", (h, heads * d)
        yield pre + "mlp.gate_proj.weight", (m, h)
        yield pre + "mlp.up_proj.weight", (m, h)
        yield pre + "mlp.down_proj.weight", (h, m)
    yield "model.norm.weight", (h,)
    if not c.get("tie_word_embeddings", False):
        yield "lm_head.weight", (v, h)


SHAPES: dict[str, Shape] = {
    "gpt2-124m": Shape(
        "GPT-2 124M (openai-community/gpt2): 12 layers, 768 wide, 12 heads, learned positions",
        {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": 768,
            "n_layer": 12,
            "n_head": 12,
            "n_positions": 2048,  # GPT-2 has 1,024; 2,048 lets the benches' prompts fit
            "vocab_size": VOCAB_SIZE,
            "layer_norm_epsilon": 1e-5,
            "activation_function": "gelu_new",
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "bfloat16",
        },
    ),
    # For the tests of the writers: SmolLM2's vocabulary, everything else minimal.
    "tiny-llama": Shape(
        "a tiny llama (tests only): 2 layers, 64 wide, 4 heads and 2 KV heads, MLP 128",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "vocab_size": VOCAB_SIZE,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "bfloat16",
        },
    ),
    "smollm2-1.7b": Shape(
        "SmolLM2-1.7B: 24 layers, 2048 wide, 32 heads and 32 KV heads, MLP 8192",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 2048,
            "num_hidden_layers": 24,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "intermediate_size": 8192,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 130000.0,
            "hidden_act": "silu",
            "vocab_size": VOCAB_SIZE,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "bfloat16",
        },
    ),
}


def write_shaped_model(name: str, out: Path, seed: int = 0) -> Path:
    """Write the model ``name`` of :data:`SHAPES` into ``out``; returns ``out``."""
    if name not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {name!r}")
    shape = SHAPES[name]
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for tensor_name, dims in shape.tensors():
        if tensor_name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
            value = torch.ones(dims)  # unit norms keep the activations in range
        elif tensor_name.endswith(".bias"):
            value = torch.zeros(dims)
        else:
            value = torch.randn(dims, generator=generator) * INIT_STD
        tensors[tensor_name] = value.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(shape.config, indent=2) + "\n")
    load_tokenizer(resolve_model(TOKENIZER_MODEL)).save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES), help="which model's shape")
    parser.add_argument(
        "out",
        type=Path,
        nargs="?",
        help="folder to write (a Hugging Face model folder); not with --gguf",
    )
    parser.add_argument(
        "--gguf",
        choices=GGUF_TYPES,
        help="write (or find) the model as a GGUF file of this type in kvserve's cache "
        "and print its path; q8_0 and q4_k_m need llama.cpp's tools (make bench-deps)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    if args.gguf is not None:
        if args.out is not None:
            parser.error("--gguf writes into kvserve's cache; give no output folder")
        from kvserve.benchmarks.workloads.shaped_gguf import llama_shape, shaped_gguf
        from kvserve.errors import InvalidParameterError

        try:
            llama_shape(args.shape)
            print(shaped_gguf(args.shape, args.gguf, args.seed))
        except (ValueError, InvalidParameterError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.out is None:
        parser.error("give the folder to write, or --gguf TYPE")
    path = write_shaped_model(args.shape, args.out, args.seed)
    print(f"wrote {SHAPES[args.shape].description} with random weights to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
