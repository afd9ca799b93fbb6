"""The tools people use instead of kvserve, run on the benchmarks' workloads.

- transformers: ``hf_baseline.py`` (``generate()`` with static batching, its
  own continuous batching, single requests for latency);
- llama.cpp in process through llama-cpp-python: ``llamacpp_baseline.py``,
  ``llamacpp_batched.py``; the GGUF file it runs (the model's own or a BF16
  copy): ``llamacpp_weights.py``;
- llama.cpp's own ``llama-bench`` and ``llama-batched-bench``, built per
  instruction set: ``llamacpp_build.py``, ``llamacpp_tools.py``;
- ``throughput_baselines.py`` runs transformers and llama.cpp on ``kvserve
  bench throughput``'s workload.
"""
