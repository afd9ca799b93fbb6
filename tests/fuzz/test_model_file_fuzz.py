"""A short run of the model-file fuzzer (``make fuzz`` runs 10,000 cases)."""

from __future__ import annotations

from fuzz.model_file_fuzz import run_cases

# Enough to meet every base model and mutation kind several times, in well under a minute.
NUM_CASES = 300


def test_damaged_model_files_load_or_raise_model_load_error() -> None:
    summary = run_cases(NUM_CASES, seed=0)
    assert summary.failures == [], summary.format()
    # The mutations must reach both sides: loads that succeed and ones that are refused.
    assert summary.outcomes["ok"] > 0, summary.format()
    assert summary.outcomes["ModelLoadError"] > NUM_CASES // 2, summary.format()
