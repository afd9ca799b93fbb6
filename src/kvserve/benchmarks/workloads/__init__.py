"""What the benchmarks send: seeded prompts and the workloads built from them.

``text.py`` (seeded English and prose) and ``prompts.py`` (prompts of it, as
token ids or words) are the benchmarks' one prompt generator;
``throughput.py`` is ``kvserve bench throughput``'s workload and its rates;
``structured_schemas.py`` the JSON schemas of ``kvserve bench structured``
(and of the structured-output tests).
"""
