"""A batch job on Ray Data: prompts from a file through kvserve replicas, results to a folder.

    python examples/ray_data_batch.py prompts.jsonl results/ \\
        --model smollm2-135m-instruct --replicas 2 --threads-per-replica 1 --max-tokens 64

Each input row has an ``id`` and a ``prompt`` (JSON Lines or Parquet). The
results folder gets one ``part-*.jsonl`` file per batch, one object per row
(the input columns plus ``text``, ``finish_reason`` and, in process,
``token_ids``). Run the same command again after a failure: rows already
written are skipped. ``--url http://host:8000`` sends the prompts to a
running ``kvserve serve`` instead of starting engines in the replicas.

With no Ray cluster running, Ray starts a local one on this machine.
"""

from __future__ import annotations

import argparse
from typing import Any

import ray

from kvserve.batch.ray_data import HTTPGenerator, InProcessGenerator, run_batch_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="a .jsonl or .parquet file of rows with id and prompt")
    parser.add_argument("output", help="the results folder (created; reruns resume it)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--url", help="a kvserve server to post to, instead of in-process engines")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads-per-replica", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    generator: type
    kwargs: dict[str, Any]
    if args.url is None:
        generator = InProcessGenerator
        kwargs = {
            "model": args.model,
            "sampling": sampling,
            "num_threads": args.threads_per_replica,
        }
    else:
        generator = HTTPGenerator
        kwargs = {"base_url": args.url, "model": args.model, "sampling": sampling}
    ray.init(ignore_reinit_error=True)
    result = run_batch_job(
        args.input,
        args.output,
        generator=generator,
        generator_kwargs=kwargs,
        replicas=args.replicas,
        # HTTP replicas only wait on the network; in-process ones compute.
        cpus_per_replica=args.threads_per_replica if args.url is None else 0.1,
        batch_size=args.batch_size,
    )
    print(
        f"wrote {len(result.processed_ids)} rows to {args.output} "
        f"({result.num_skipped} already there)"
    )


if __name__ == "__main__":
    main()
