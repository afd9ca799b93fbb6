"""Ways in: the ``kvserve`` command line (``cli.py``) and its shared flag helpers (``args.py``)."""
