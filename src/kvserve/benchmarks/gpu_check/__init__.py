"""The GPU check: kvserve's CUDA path run end to end on a lent GPU machine, in one call.

``scripts/gpu_check.sh`` (``make gpu-check``) runs ``python -m
kvserve.benchmarks.gpu_check``, which runs a list of steps (``steps.py``), each in
a child process under a time budget, and writes what it finds under ``$OUT``:
``results.json``, ``pytest.log``, ``bench.md`` and ``gpu_check.log``. A step
that fails, crashes or runs out of time is recorded and the next one runs.

- ``driver.py``, ``record.py``: the steps' runner and what it writes;
  ``steps.py``: the steps, in order;
- ``models.py``: random-weight models of published shapes (SmolLM2-135M,
  Qwen3-0.6B, Gemma 2 2B), built on the machine, with SmolLM2's tokenizer;
- ``parity.py``, ``compare.py``: kvserve on the GPU against transformers on
  the same weights;
- ``figures.py``, ``report.py``: ``kvserve bench`` runs, their figures, the
  goals and bench.md;
- ``prepare.py``: what must travel with the call (wheels, tokenizer) and its size.

``--dry-run`` runs the same steps on the CPU with tiny models of the same
architectures, so that a broken check shows up here, not on the device's clock.
docs/cuda.md says how to run it.
"""
