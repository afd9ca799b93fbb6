"""The parity check's comparisons: kvserve's logprobs and tokens against a reference.

A kvserve run is ``{"requests": [{"prompt", "tokens", "logprobs"}, ...]}``, where
``logprobs`` holds, at each generated position, the top-20 tokens' logprobs.
A reference scores the prompt and kvserve's tokens in one teacher-forced
forward pass (``reference_logprobs``), so a token that differs costs one
position, not the rest of the run.
"""

from __future__ import annotations

from typing import Any


def reference_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> Any:
    """``model``'s log-probabilities ``[len(tokens), V]`` (float32, on the CPU) at each generated
    position, from one forward pass over the prompt and the tokens."""
    import torch

    ids = torch.tensor([prompt + tokens], device=model.device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return logits.float().log_softmax(-1).cpu()


def compare(run: dict[str, Any], references: list[Any], tolerance: float) -> dict[str, Any]:
    """kvserve's logprobs on its top tokens, and its greedy tokens, against the reference rows
    of each request; a token counts where the reference's top two are more than
    ``tolerance`` apart (a decisive position)."""
    import torch

    errors: list[float] = []
    decisive = mismatched = 0
    for request, reference in zip(run["requests"], references, strict=True):
        for row, token, ref in zip(request["logprobs"], request["tokens"], reference, strict=True):
            ids = list(row)
            ours = torch.tensor([row[t] for t in ids])
            errors.append(float((ours - ref[ids]).abs().max()))
            top2 = ref.topk(2).values
            if float(top2[0] - top2[1]) > tolerance:
                decisive += 1
                mismatched += int(token != int(ref.argmax()))
    return {
        "positions": len(errors),
        "max_error": max(errors),
        "mean_error": sum(errors) / len(errors),
        "decisive_positions": decisive,
        "mismatched_tokens": mismatched,
    }


def agreement(run: dict[str, Any], cpu: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """A GPU run against the CPU's: tokens equal up to the first position where they
    differ, which must be a near-tie on the CPU (top two within ``tolerance``)."""
    errors: list[float] = []
    identical = at_ties = decisive = 0
    for ours, theirs in zip(run["requests"], cpu["requests"], strict=True):
        pairs = list(zip(ours["tokens"], theirs["tokens"], strict=True))
        first = next((j for j, (a, b) in enumerate(pairs) if a != b), len(pairs))
        for j in range(first):
            shared = ours["logprobs"][j].keys() & theirs["logprobs"][j].keys()
            errors += [abs(ours["logprobs"][j][t] - theirs["logprobs"][j][t]) for t in shared]
        if first == len(pairs):
            identical += 1
            continue
        top = sorted(theirs["logprobs"][first].values(), reverse=True)
        near_tie = len(top) < 2 or top[0] - top[1] <= tolerance
        at_ties += near_tie
        decisive += not near_tie
    return {
        "identical_requests": identical,
        "diverged_at_near_ties": at_ties,
        "diverged_decisively": decisive,
        "max_error_before_divergence": max(errors, default=0.0),
    }


def drift(run: dict[str, Any], refs: list[Any], truth_model: Any) -> dict[str, Any]:
    """How far kvserve's and the reference's low-precision logprobs are from float32 math's
    (``truth_model``): for each, the mean over positions of the largest error on kvserve's
    top tokens."""
    import torch

    ours: list[float] = []
    theirs: list[float] = []
    for request, ref in zip(run["requests"], refs, strict=True):
        truth = reference_logprobs(truth_model, request["prompt"], request["tokens"])
        for j, row in enumerate(request["logprobs"]):
            ids = list(row)
            exact = truth[j, ids]
            ours.append(float((torch.tensor([row[t] for t in ids]) - exact).abs().max()))
            theirs.append(float((ref[j, ids] - exact).abs().max()))
    return {
        "mean_error_vs_float32": sum(ours) / len(ours),
        "reference_error_vs_float32": sum(theirs) / len(theirs),
    }
