"""Benchmarks: each module offers ``add_parser(subparsers)``, ``run(args)`` and ``main()``."""
