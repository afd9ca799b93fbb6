"""Batch jobs on Ray Data: outputs as if run alone, exactly once, resumable.

One local Ray cluster (2 CPUs, no dashboard) for the module; two replicas of
a tiny model. The reference for every row is the same prompt generated
alone by a plain in-process ``LLM``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvserve[ray]')")

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.batch.ray_data import BatchJobResult, InProcessGenerator, run_batch_job  # noqa: E402
from kvserve.batch.results import read_results  # noqa: E402
from model_fixtures import save_tiny_model, train_tiny_tokenizer  # noqa: E402

# A job that has not finished by then is a failure, not a reason to hang.
JOB_TIMEOUT_S = 120
NUM_ROWS = 12
BATCH_SIZE = 3
SAMPLING: dict[str, Any] = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
ENGINE_ARGS: dict[str, Any] = {"dtype": "float32", "block_size": 4, "num_blocks": 128}


class DiesOnce(InProcessGenerator):
    """A replica whose process exits the first time it gets the row ``fatal_id``."""

    def __init__(self, marker: str, fatal_id: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.marker = Path(marker)
        self.fatal_id = fatal_id

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.fatal_id in batch["id"].tolist() and not self.marker.exists():
            self.marker.touch()
            os._exit(1)
        return super().__call__(batch)


@pytest.fixture(scope="module")
def ray_cluster(ray_session: None) -> Any:
    # The actors unpickle DiesOnce; this module is not importable in them.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.data.DataContext.get_current().enable_progress_bars = False
    return None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("input") / "prompts.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "block", "ray"]
    with path.open("w") as out:
        for row_id in range(NUM_ROWS):
            prompt = " ".join(words[(row_id + k) % len(words)] for k in range(2 + row_id % 5))
            out.write(json.dumps({"id": row_id, "prompt": prompt}) + "\n")
    return path


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts_file: Path) -> dict[int, list[int]]:
    """Each prompt's greedy tokens, generated alone."""
    llm = LLM(str(model_dir), **ENGINE_ARGS)
    params = SamplingParams(**SAMPLING)
    expected = {}
    for line in prompts_file.read_text().splitlines():
        row = json.loads(line)
        (output,) = llm.generate(row["prompt"], params, use_tqdm=False)
        expected[row["id"]] = list(output.outputs[0].token_ids)
    return expected


def run(model_dir: Path, prompts_file: Path, output_dir: Path, **kwargs: Any) -> BatchJobResult:
    """The job on two replicas, in a thread: the test fails instead of hanging."""
    generator_kwargs = {"model": str(model_dir), "sampling": SAMPLING, "engine_args": ENGINE_ARGS}
    generator_kwargs.update(kwargs.pop("generator_kwargs", {}))
    outcome: list[Any] = []

    def job() -> None:
        try:
            outcome.append(
                run_batch_job(
                    prompts_file,
                    output_dir,
                    generator_kwargs=generator_kwargs,
                    replicas=2,
                    batch_size=BATCH_SIZE,
                    **kwargs,
                )
            )
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    thread.join(JOB_TIMEOUT_S)
    assert outcome, f"the batch job did not finish in {JOB_TIMEOUT_S} s"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    result: BatchJobResult = outcome[0]
    return result


def check_every_row_once(output_dir: Path, reference: dict[int, list[int]]) -> None:
    rows = list(read_results(output_dir))
    counts = Counter(row["id"] for row in rows)
    assert counts == Counter(range(NUM_ROWS))
    for row in rows:
        assert row["token_ids"] == reference[row["id"]], f"row {row['id']}"
        assert row["finish_reason"] == "length"


def test_every_row_matches_the_prompt_run_alone(
    ray_cluster: None,
    model_dir: Path,
    prompts_file: Path,
    reference: dict[int, list[int]],
    tmp_path: Path,
) -> None:
    result = run(model_dir, prompts_file, tmp_path / "out")
    assert sorted(result.processed_ids) == list(range(NUM_ROWS))
    assert result.num_skipped == 0
    check_every_row_once(tmp_path / "out", reference)
    # A rerun over a partly written folder computes the missing rows only.
    parts = sorted((tmp_path / "out").glob("part-*.jsonl"))
    assert len(parts) == NUM_ROWS // BATCH_SIZE
    lost = [json.loads(line)["id"] for line in parts[1].read_text().splitlines()]
    parts[1].unlink()
    rerun = run(model_dir, prompts_file, tmp_path / "out")
    assert sorted(rerun.processed_ids) == sorted(lost)
    assert rerun.num_skipped == NUM_ROWS - len(lost)
    check_every_row_once(tmp_path / "out", reference)


def test_a_replica_that_dies_has_its_batch_retried(
    ray_cluster: None,
    model_dir: Path,
    prompts_file: Path,
    reference: dict[int, list[int]],
    tmp_path: Path,
) -> None:
    marker = tmp_path / "died"
    result = run(
        model_dir,
        prompts_file,
        tmp_path / "out",
        generator=DiesOnce,
        generator_kwargs={"marker": str(marker), "fatal_id": 7},
    )
    assert marker.exists(), "the fault was never injected"
    assert sorted(result.processed_ids) == list(range(NUM_ROWS))
    check_every_row_once(tmp_path / "out", reference)
