"""prefix-cache: hit tokens per request, checked against the prompts' shared blocks."""

from __future__ import annotations

from pathlib import Path

from kvserve.demos import DemoResult
from kvserve.demos.prefix_cache import Sizes, build_prompts, shared_prefix_length
from kvserve.engine import LLMEngine


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


def test_each_request_hits_the_blocks_an_earlier_prompt_shares(
    demo_results: dict[str, DemoResult], tiny_model_dir: Path
) -> None:
    """Expected hits come from the token ids: the longest prefix shared with any earlier
    prompt, in whole blocks of 16 tokens (the engine's default block size)."""
    result = demo_results["prefix-cache"]
    engine = LLMEngine.from_engine_args(str(tiny_model_dir), dtype="float32")
    sizes = Sizes(**result.context["sizes"])
    prompts = build_prompts(engine, sizes, result.context["seed"])
    block_size = engine.config.cache_config.block_size
    requests = result.data["requests"]
    assert [r["prompt_tokens"] for r in requests] == [len(p) for p in prompts]
    assert result.data["shared_prefix_tokens"] == shared_prefix_length(prompts) > block_size
    for index, (request, prompt) in enumerate(zip(requests, prompts, strict=True)):
        shared = max((_common_prefix(prompt, earlier) for earlier in prompts[:index]), default=0)
        assert request["cached_tokens"] == shared // block_size * block_size


def test_summary_agrees_with_the_requests(demo_results: dict[str, DemoResult]) -> None:
    result = demo_results["prefix-cache"]
    data = result.data
    requests = data["requests"]
    assert data["same_answers"]
    on, off = data["summary"]["on"], data["summary"]["off"]
    assert off["cached_tokens"] == 0 and off["hit_rate_percent"] == 0.0
    assert on["cached_tokens"] == sum(r["cached_tokens"] for r in requests)
    assert on["prompt_tokens"] == off["prompt_tokens"] == sum(r["prompt_tokens"] for r in requests)
    assert on["hit_rate_percent"] == 100.0 * on["cached_tokens"] / on["prompt_tokens"]
    per_request, summary = result.tables
    for row, request in zip(per_request.rows, requests, strict=True):
        assert row[1:3] == (request["prompt_tokens"], request["cached_tokens"])
        assert row[3:5] == (1000 * request["ttft_off_s"], 1000 * request["ttft_on_s"])
    assert [row[3] for row in summary.rows] == [off["hit_rate_percent"], on["hit_rate_percent"]]
