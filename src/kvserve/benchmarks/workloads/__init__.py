"""What the benchmarks send: seeded prompts and the workloads built from them.

``corpus.py`` (English passages), ``text.py`` (generated prose) and
``prompts.py`` (``kvserve bench serve``'s prompts); ``throughput.py`` is
``kvserve bench throughput``'s workload and its rates; ``structured_schemas.py``
the JSON schemas of ``kvserve bench structured`` (and of the structured-output
tests).
"""
