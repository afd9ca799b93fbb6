"""The step trace records each step's speculative proposals and acceptances.

A tiny random Llama with n-gram speculation decodes prompts that repeat a
pattern (so proposals exist, and some are accepted). Each step record holds
that step's share; the shares must add up to the engine's own cumulative
counters, and only steps that decoded can have verified anything.
"""

from __future__ import annotations

from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.trace import TraceMemory, runs_from_records
from model_fixtures import save_tiny_model, train_tiny_tokenizer

# Every decoding request proposes (not adaptive): what the tests count never depends
# on how long steps took.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


def test_step_records_add_up_to_the_engine_s_speculation_counters(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "llama", "llama", train_tiny_tokenizer())
    llm = LLM(str(model_dir), dtype="float32", block_size=4, speculative_config=SPEC)
    engine = llm.llm_engine
    trace = TraceMemory()
    engine.set_trace(trace)
    prompts = [{"prompt_token_ids": [5, 17, 42, 9] * 6}, {"prompt_token_ids": [88, 3, 120] * 5}]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
    engine.set_trace(None)
    steps = runs_from_records(trace.records)[0].steps
    proposed = sum(step["spec_proposed"] for step in steps)
    accepted = sum(step["spec_accepted"] for step in steps)
    assert proposed == engine.stats.num_spec_proposed_tokens > 0
    assert accepted == engine.stats.num_spec_accepted_tokens > 0
    for step in steps:
        assert 0 <= step["spec_accepted"] <= step["spec_proposed"]
        if step["spec_proposed"]:
            # Proposals are extra query rows of a decoding request.
            assert any(entry["phase"] == "decode" for entry in step["scheduled"])
            assert step["num_tokens"] >= step["spec_proposed"]
