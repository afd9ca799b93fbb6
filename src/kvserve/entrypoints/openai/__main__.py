"""``python -m kvserve.entrypoints.openai``: ``kvserve serve`` on its own.

For processes that must start the server from this interpreter without the
``kvserve`` script on the path (the HTTP API fuzzer's server). Nothing imports
this module.
"""

from __future__ import annotations

import argparse
import sys

from kvserve.entrypoints.openai.cli_serve import (
    DESCRIPTION,
    HelpFormatter,
    add_serve_arguments,
    run_serve,
)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.entrypoints.openai",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    add_serve_arguments(parser)
    sys.exit(run_serve(parser.parse_args()))


if __name__ == "__main__":
    main()
