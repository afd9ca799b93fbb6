"""Ways in: the ``kvserve`` command line (``cli.py``, flag helpers in ``args.py``) and the OpenAI-compatible HTTP server (``openai/``)."""
