"""Random-weight models of published shapes, built where they run: no weights travel.

Each shape is its model's published ``config.json`` (the fields that decide
the shape and the math); the weights are drawn by transformers' own
initialisation and saved as bfloat16 safetensors beside SmolLM2's tokenizer
files, so kvserve and transformers load the same Hugging Face folder. The
tokenizer's 49,152 tokens cover fewer ids than Qwen3's and Gemma 2's
vocabularies: prompts use its ids, which every model accepts.

The embedding (tied to the LM head in all three) is redrawn wider than the
initialisation's, with a standard deviation of ``4 / sqrt(hidden_size)``: the
logits then spread by about 4, so most positions have a clear greedy winner and
the token comparisons of the parity check have something to compare.

The dry run builds each architecture tiny (``TINY``): the same model classes
and features (q/k norms, soft caps, sliding windows) at a few layers, with
the tokenizer's vocabulary.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any

# Published configs: HuggingFaceTB/SmolLM2-135M-Instruct, Qwen/Qwen3-0.6B, google/gemma-2-2b.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "initializer_range": 0.041666666666666664,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "use_sliding_window": False,
        "sliding_window": None,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "gemma2-2b": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
    },
}

# The dry run's versions: a few layers, narrow, the tokenizer's vocabulary; each family's
# features stay (Gemma 2's window shrinks to 16 so that prompts cross it).
TINY: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
    # head_dim other than hidden_size / num_heads, as in the real one.
    "qwen3-0.6b": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "head_dim": 32,
    },
    "gemma2-2b": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "query_pre_attn_scalar": 24,
        "sliding_window": 16,
    },
}
TINY_HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def shape_config(name: str, tiny: bool, tokenizer_size: int | None = None) -> dict[str, Any]:
    """The ``config.json`` fields of model ``name`` (a key of ``SHAPES``); tiny for the dry
    run, with a vocabulary of ``tokenizer_size`` tokens where given."""
    config = dict(SHAPES[name])
    if tiny:
        config.update(TINY_HEADS, **({"vocab_size": tokenizer_size} if tokenizer_size else {}))
        config.update(TINY[name])
    return config


def tokenizer_size(tokenizer_dir: Path) -> int:
    """Token ids the tokenizer of ``tokenizer_dir`` produces (added tokens included)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(True)


def parameter_count(config: dict[str, Any]) -> int:
    """Parameters of a model of this shape: layers' matrices, one (tied) embedding; no norms."""
    hidden, heads, kv_heads = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    head_dim = config["head_dim"]
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * config["intermediate_size"]
    return config["num_hidden_layers"] * (attention + mlp) + config["vocab_size"] * hidden


def build_model(
    name: str, folder: Path, tokenizer_dir: Path, device: str, tiny: bool, seed: int = 0
) -> dict[str, Any]:
    """Write a random-weight model ``name`` (config, bf16 safetensors, tokenizer) into ``folder``.

    The weights are drawn in float32 on ``device`` (the GPU: seconds even for Gemma 2
    2B) and saved in bfloat16, so float32 runs see the same rounded weights.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    start = time.perf_counter()
    copy_tokenizer(tokenizer_dir, folder)
    fields = shape_config(name, tiny, tokenizer_size(tokenizer_dir) if tiny else None)
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:  # built on the CPU (slower), then moved
        print(f"building {name} on {device} failed ({type(exc).__name__}: {exc}); on the CPU")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding.normal_(0.0, 4.0 / math.sqrt(fields["hidden_size"]))
    model.to(torch.bfloat16).save_pretrained(folder)
    del model
    weights = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    return {
        "path": str(folder),
        "architecture": fields["architectures"][0],
        "parameters": parameter_count(fields),
        "weights_bytes": weights,
        "tiny": tiny,
        "shape": {k: v for k, v in fields.items() if k not in ("architectures",)},
        "seconds": round(time.perf_counter() - start, 2),
    }


def copy_tokenizer(tokenizer_dir: Path, folder: Path) -> None:
    """Copy the tokenizer files (``TOKENIZER_FILES``, those present) into a model folder."""
    folder.mkdir(parents=True, exist_ok=True)
    copied = 0
    for file_name in TOKENIZER_FILES:
        path = tokenizer_dir / file_name
        if path.exists():
            shutil.copyfile(path, folder / file_name)
            copied += 1
    if not (tokenizer_dir / "tokenizer.json").exists() or not copied:
        raise FileNotFoundError(
            f"no tokenizer.json in {tokenizer_dir}: run `make gpu-wheels` before the device "
            "call and carry .gpu-check (docs/cuda.md)"
        )
