"""``python -m kvserve.benchmarks.gpu_check``: see ``driver.py``."""

from kvserve.benchmarks.gpu_check.driver import main

raise SystemExit(main())
