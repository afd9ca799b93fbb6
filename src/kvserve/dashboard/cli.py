"""``kvserve dashboard --trace FILE``: replay a step trace in the dashboard's page.

The command only parses its flags here; the app (FastAPI, uvicorn) is
imported when it runs, so ``kvserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """The ``kvserve dashboard`` subcommand (see ``kvserve/cli.py``)."""
    parser = subparsers.add_parser(
        "dashboard",
        help="replay a step trace (--trace FILE) in the dashboard, in a browser",
        description=(
            "Serve the dashboard's page over a step trace recorded with --trace FILE "
            "(kvserve generate, serve or bench), with play / pause / step / speed controls. "
            "The live dashboard of a running server is at /dashboard on `kvserve serve`."
        ),
    )
    parser.add_argument(
        "--trace", type=Path, required=True, metavar="FILE", help="a trace written with --trace"
    )
    parser.add_argument(
        "--run",
        dest="run_index",
        metavar="N",
        type=int,
        default=0,
        help="which run of the trace to replay (default 0)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8001, help="port to bind")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Build the frames, then serve the page until interrupted."""
    import uvicorn

    from kvserve.dashboard.replay_app import build_replay_app

    app = build_replay_app(args.trace, args.run_index)
    print(f"replaying {args.trace} on http://{args.host}:{args.port}/dashboard")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
