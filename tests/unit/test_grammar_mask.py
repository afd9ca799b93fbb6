"""The batched grammar mask against a per-token loop over the bits."""

from __future__ import annotations

import pytest
import torch

from kvserve.sample.grammar_mask import apply_token_bitmask


@pytest.mark.parametrize("vocab", [40, 64, 97])
def test_mask_matches_a_bit_by_bit_reference(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=generator)
    words = 2  # 64 tokens of bits: narrower than 97, wider than 40
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, words), dtype=torch.int32, generator=generator)
    rows = torch.tensor([3, 1])
    want = logits.clone()
    for index, row in enumerate(rows.tolist()):
        for token in range(vocab):
            allowed = token < 32 * words and (int(bitmask[index, token // 32]) >> (token % 32)) & 1
            if not allowed:
                want[row, token] = float("-inf")
    got = logits.clone()
    apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, want)  # allowed logits kept bit for bit, other rows untouched
