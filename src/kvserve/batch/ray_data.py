"""Batch inference on Ray Data: a dataset of prompts through kvserve replicas.

Two callable classes for ``Dataset.map_batches(cls, concurrency=N)``, one
Ray actor (a replica) each:

- :class:`InProcessGenerator` holds one in-process :class:`~kvserve.LLM`
  and runs each batch of prompts through it, continuously batched;
- :class:`HTTPGenerator` posts each prompt to a running ``kvserve serve``
  (``/v1/completions``), a few at a time.

:func:`run_batch_job` is the whole job: read prompts (JSON Lines or
Parquet, one row per prompt with a row id), skip the rows whose result is
already in the output folder, map the rest through the replicas, and write
each batch's results keyed by row id (``results.py``). A replica that dies
is restarted and its batch retried (Ray Data's actor pools default to
``max_restarts=-1`` and ``max_task_retries=-1``); a job that dies is rerun
and computes only the missing rows. Either way each row is written exactly
once.

Batches are NumPy dicts (Ray Data's default format): one array per column.
"""

from __future__ import annotations

import functools
import json
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvserve.batch.results import write_part, written_ids
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams

Batch = dict[str, np.ndarray]


class InProcessGenerator:
    """One kvserve engine per Ray actor; adds ``text``, ``token_ids``, ``finish_reason``.

    model, engine_args: as for ``LLM(model, **engine_args)``.
    sampling: ``SamplingParams`` fields, the same for every row.
    num_threads: torch threads of this actor (ask Ray Data for as many CPUs).
    prompt_column: the column holding each row's prompt text.
    """

    def __init__(
        self,
        model: str,
        sampling: Mapping[str, Any] | None = None,
        engine_args: Mapping[str, Any] | None = None,
        num_threads: int = 1,
        prompt_column: str = "prompt",
    ) -> None:
        import torch

        from kvserve.llm import LLM

        torch.set_num_threads(num_threads)
        self.params = SamplingParams(**dict(sampling or {}))
        self.prompt_column = prompt_column
        self.llm = LLM(model, **dict(engine_args or {}))

    def __call__(self, batch: Batch) -> Batch:
        prompts = [str(prompt) for prompt in batch[self.prompt_column]]
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        completions = [output.outputs[0] for output in outputs]
        # One list per row; lists of unequal length need an object array.
        token_ids = np.empty(len(completions), dtype=object)
        for index, completion in enumerate(completions):
            token_ids[index] = list(completion.token_ids)
        return {
            **batch,
            "text": np.array([c.text for c in completions], dtype=object),
            "token_ids": token_ids,
            "finish_reason": np.array([c.finish_reason for c in completions], dtype=object),
        }


class HTTPGenerator:
    """Posts each row's prompt to a kvserve server; adds ``text`` and ``finish_reason``.

    base_url: the server, such as ``http://127.0.0.1:8000``.
    model: the ``model`` field of each request.
    sampling: extra fields of each ``/v1/completions`` body (``max_tokens``,
        ``temperature``, ...).
    num_threads: requests in flight at once from this actor.
    api_key: sent as a bearer token when the server wants one.
    timeout_s: per request.
    prompt_column: the column holding each row's prompt text.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        sampling: Mapping[str, Any] | None = None,
        num_threads: int = 4,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        prompt_column: str = "prompt",
    ) -> None:
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.body = {"model": model, **dict(sampling or {})}
        self.headers = {"Content-Type": "application/json"}
        if api_key is not None:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s
        self.prompt_column = prompt_column
        self.pool = ThreadPoolExecutor(num_threads)

    def _complete(self, prompt: str) -> dict[str, Any]:
        body = json.dumps({**self.body, "prompt": prompt}).encode("utf-8")
        request = urllib.request.Request(self.url, body, self.headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            choice: dict[str, Any] = json.load(response)["choices"][0]
            return choice

    def __call__(self, batch: Batch) -> Batch:
        prompts = [str(prompt) for prompt in batch[self.prompt_column]]
        choices = list(self.pool.map(self._complete, prompts))
        return {
            **batch,
            "text": np.array([c["text"] for c in choices], dtype=object),
            "finish_reason": np.array([c["finish_reason"] for c in choices], dtype=object),
        }


def write_batch(batch: Batch, output_dir: str, id_column: str) -> Batch:
    """Write a batch of results as one part file; pass on only the row ids."""
    columns = {name: values.tolist() for name, values in batch.items()}
    rows = [
        dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)
    ]
    for row in rows:
        if isinstance(row.get("token_ids"), np.ndarray):
            row["token_ids"] = row["token_ids"].tolist()
    write_part(output_dir, rows, id_column)
    return {id_column: batch[id_column]}


def drop_written(batch: Batch, done: frozenset[Any], id_column: str) -> Batch:
    """The rows of ``batch`` whose id has no result yet."""
    keep = np.array([row_id not in done for row_id in batch[id_column].tolist()], dtype=bool)
    return {name: values[keep] for name, values in batch.items()}


class BatchJobResult(NamedTuple):
    """What one run of a job did.

    num_skipped: rows whose result was already in the output folder.
    processed_ids: the ids of the rows this run computed and wrote.
    """

    num_skipped: int
    processed_ids: list[Any]


def run_batch_job(
    input_path: str | Path,
    output_dir: str | Path,
    generator: type = InProcessGenerator,
    generator_kwargs: Mapping[str, Any] | None = None,
    replicas: int = 1,
    cpus_per_replica: float = 1.0,
    batch_size: int = 16,
    id_column: str = "id",
) -> BatchJobResult:
    """Map the prompts of ``input_path`` through ``replicas`` generator actors into ``output_dir``.

    input_path: a ``.jsonl`` or ``.parquet`` file (or folder of them) whose
        rows have an ``id_column`` (unique, stable across runs) and the
        generator's prompt column.
    generator, generator_kwargs: the callable class and its constructor's
        arguments (:class:`InProcessGenerator` or :class:`HTTPGenerator`).
    replicas: generator actors at most (fewer when there are fewer batches).
    cpus_per_replica: CPUs Ray reserves for each (its ``num_threads``).
    batch_size: rows per batch, and per part file.
    id_column: the column that names each row in the results.

    Needs a Ray cluster (``ray.init()`` first, or Ray starts a local one).
    """
    for name, value in (("replicas", replicas), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidParameterError(name, f"must be a positive integer, got {value!r}")
    try:
        import ray.data
    except ImportError as exc:
        raise ImportError("batch jobs on Ray Data need Ray: pip install 'kvserve[ray]'") from exc
    path = str(input_path)
    if path.endswith(".parquet") or (Path(path).is_dir() and any(Path(path).glob("*.parquet"))):
        dataset = ray.data.read_parquet(path)
    else:
        dataset = ray.data.read_json(path, lines=True)
    if id_column not in dataset.columns():
        raise InvalidParameterError(
            "id_column", f"{id_column!r} is not a column of {path}; it has {dataset.columns()}"
        )
    done = frozenset(written_ids(output_dir, id_column))
    num_rows = dataset.count()
    if done:
        dataset = dataset.map_batches(
            functools.partial(drop_written, done=done, id_column=id_column)
        )
    # One block per batch, so the replicas share the work batch by batch. The
    # prompts are read and split before the replicas start: once they hold
    # the cluster's CPUs, no read task could be scheduled.
    dataset = dataset.repartition(target_num_rows_per_block=batch_size, strict=True).materialize()
    num_batches = dataset.num_blocks() if dataset.count() else 0
    if num_batches == 0:
        return BatchJobResult(num_rows, [])
    results = dataset.map_batches(
        generator,
        fn_constructor_kwargs=dict(generator_kwargs or {}),
        batch_size=batch_size,
        concurrency=min(replicas, num_batches),  # no replica starts without work
        num_cpus=cpus_per_replica,
    ).map_batches(
        functools.partial(write_batch, output_dir=str(output_dir), id_column=id_column),
        batch_size=None,
        num_cpus=0,
    )
    processed = [row[id_column] for row in results.iter_rows()]
    return BatchJobResult(num_rows - len(processed), processed)
