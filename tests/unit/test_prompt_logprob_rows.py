"""Which rows give prompt logprobs (``prepare_inputs``), and their values
(``compute_prompt_logprobs``) against a plain log-softmax of the same logits."""

from __future__ import annotations

import pytest
import torch

from kvserve.core.request import Request
from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.sampling_params import SamplingParams
from kvserve.worker import prompt_logprobs
from kvserve.worker.input_batch import PromptLogprobRows, prepare_inputs
from kvserve.worker.prompt_logprobs import compute_prompt_logprobs

CPU = torch.device("cpu")
TABLE = ([1, 2, 3, 4, 5, 6],)


def scheduled(
    request_id: str, prompt: list[int], num_computed: int, num_new: int, top: int | None
) -> ScheduledRequest:
    request = Request(request_id, prompt, SamplingParams(prompt_logprobs=top))
    request.num_computed_tokens = num_computed
    return ScheduledRequest(request, num_new, TABLE, num_computed + num_new == len(prompt))


def test_runs_cover_the_chunk_up_to_the_prompts_last_position() -> None:
    prompt = list(range(100, 110))  # 10 tokens: positions 0..8 predict tokens 1..9
    items = [
        scheduled("first", prompt, 0, 4, 2),  # positions 0..3
        scheduled("plain", prompt, 0, 5, None),  # asks for nothing
        scheduled("last", prompt, 6, 4, 0),  # positions 6..9; 9 is sampled, not a run
        scheduled("decode", [*prompt, 7], 10, 1, 0),  # its prompt's last token: sampled only
    ]
    inputs = prepare_inputs(items, 4, CPU, sliding_windows=(None,))
    # The decode goes first (row 0), then the chunks in order: rows 1-4, 5-9, 10-13.
    assert inputs.prompt_logprob_rows == (
        PromptLogprobRows("first", 2, 1, 0, prompt[1:5]),
        PromptLogprobRows("last", 0, 10, 6, prompt[7:10]),
    )


def test_no_request_asking_gives_no_runs() -> None:
    prompt = list(range(8))
    inputs = prepare_inputs([scheduled("a", prompt, 0, 8, None)], 4, CPU, (None,))
    assert inputs.prompt_logprob_rows == ()


def test_values_ranks_and_top_k_equal_a_plain_log_softmax_across_slices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    vocab, hidden_size = 50, 8
    head = torch.randn(vocab, hidden_size)
    hidden_TH = torch.randn(12, hidden_size)
    targets = torch.randint(0, vocab, (9,)).tolist()
    # Three rows of logits a slice: a run of 9 rows takes three slices.
    monkeypatch.setattr(prompt_logprobs, "_MAX_LOGITS_PER_SLICE", 3 * vocab)
    run = PromptLogprobRows("r", 4, 2, 5, targets)
    chunks = compute_prompt_logprobs(hidden_TH, (run,), lambda h: h @ head.T, vocab)
    chunk = chunks["r"]
    assert chunk.first_token_index == 6
    expected = (hidden_TH[2:11] @ head.T).log_softmax(-1)
    assert len(chunk.entries) == 9
    for row, (entry, target) in enumerate(zip(chunk.entries, targets, strict=True)):
        assert entry[target].logprob == pytest.approx(expected[row, target].item(), abs=1e-6)
        assert entry[target].rank == int((expected[row] > expected[row, target]).sum()) + 1
        top = expected[row].topk(4)
        for rank, (value, token) in enumerate(zip(top.values, top.indices, strict=True), 1):
            assert entry[int(token)].logprob == pytest.approx(value.item(), abs=1e-6)
            if int(token) != target:
                assert entry[int(token)].rank == rank
        assert len(entry) == 4 + (target not in top.indices.tolist())
