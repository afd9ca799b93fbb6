"""Min-p, top-k and top-p filtering of a batch of logits, vectorised over rows.

Every function masks the dropped tokens with ``-inf`` in place and returns the
same tensor. Disabled rows carry neutral values (``min_p`` 0, ``top_k`` equal
to the vocabulary size, ``top_p`` 1) so that no row needs its own branch.
"""

from __future__ import annotations

import torch


def apply_min_p(logits_NV: torch.Tensor, min_p_N: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability."""
    probs_NV = torch.softmax(logits_NV, dim=-1)
    threshold_N1 = probs_NV.amax(dim=-1, keepdim=True) * min_p_N[:, None]
    # The top token has probability >= its threshold, so every row keeps one token.
    return logits_NV.masked_fill_(probs_NV < threshold_N1, float("-inf"))


def apply_top_k_top_p(
    logits_NV: torch.Tensor, top_k_N: torch.Tensor | None, top_p_N: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` most likely tokens, then its top-``p`` nucleus.

    ``top_k_N`` holds values in [1, V]; ``top_p_N`` values in (0, 1]. Ties with
    the k-th logit are all kept. Uses one sort of the batch; top-k alone takes
    the cheaper ``torch.topk`` path.
    """
    if top_p_N is None:
        if top_k_N is None:
            return logits_NV
        return _apply_top_k_only(logits_NV, top_k_N)

    vocab_size = logits_NV.shape[1]
    sorted_logits_NV, sorted_ids_NV = logits_NV.sort(dim=-1)  # ascending
    if top_k_N is not None:
        # Ascending order puts the k-th largest logit at column V - k.
        kth_logit_N1 = sorted_logits_NV.gather(1, (vocab_size - top_k_N)[:, None])
        sorted_logits_NV.masked_fill_(sorted_logits_NV < kth_logit_N1, float("-inf"))

    # A token is dropped when the tokens up to and including it (the least
    # likely ones) hold at most 1 - p of the mass: what remains is the smallest
    # set of top tokens with mass >= p.
    cumulative_NV = torch.softmax(sorted_logits_NV, dim=-1).cumsum(dim=-1)
    drop_NV = cumulative_NV <= (1.0 - top_p_N)[:, None]
    drop_NV[:, -1] = False  # the most likely token always survives rounding
    sorted_logits_NV.masked_fill_(drop_NV, float("-inf"))
    return logits_NV.scatter_(1, sorted_ids_NV, sorted_logits_NV)


def _apply_top_k_only(logits_NV: torch.Tensor, top_k_N: torch.Tensor) -> torch.Tensor:
    """Top-k without a full sort: only the largest k over the enabled rows is computed."""
    vocab_size = logits_NV.shape[1]
    enabled_N = top_k_N < vocab_size
    k_N = torch.where(enabled_N, top_k_N, torch.ones_like(top_k_N))
    max_k = int(k_N.max())
    top_values_NK = logits_NV.topk(max_k, dim=-1).values  # [N, max_k], descending
    kth_logit_N1 = top_values_NK.gather(1, (k_N - 1)[:, None])
    kth_logit_N1.masked_fill_(~enabled_N[:, None], float("-inf"))
    return logits_NV.masked_fill_(logits_NV < kth_logit_N1, float("-inf"))
