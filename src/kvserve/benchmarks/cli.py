"""``kvserve bench MODE``: one subcommand per benchmark."""

from __future__ import annotations

from typing import Any

from kvserve.benchmarks.isa_switch import add_cpu_isa_arg, with_cpu_isa
from kvserve.benchmarks.offline import (
    chunked_prefill,
    embed,
    latency,
    perplexity,
    prefix,
    spec,
    structured,
    sweep,
    throughput,
)
from kvserve.benchmarks.online import dashboard_clients, routing, serve, serve_memory, soak

MODES = (
    throughput.register,
    latency.register,
    sweep.register,
    chunked_prefill.register,
    prefix.add_parser,
    serve.register,
    serve_memory.register,
    routing.register,
    soak.register,
    dashboard_clients.register,
    structured.register,
    embed.register,
    perplexity.register,
    spec.register,
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help=(
            "benchmarks: throughput, latency, sweep, chunked-prefill, prefix, serve, serve-memory, "
            "routing, soak, dashboard, structured, embed, perplexity, spec"
        ),
        description=(
            "Measure kvserve (and, where it applies, transformers on the same weights); "
            "serve measures any OpenAI-compatible server; serve-memory starts kvserve's server and "
            "llama-server on one GGUF and compares their resident memory; "
            "routing compares Ray Serve routers; soak puts a kvserve server under long, "
            "hostile load; dashboard measures a kvserve server's throughput with many dashboard clients; "
            "embed measures sentence embeddings against sentence-transformers and llama-server; "
            "perplexity scores a fixed passage with kvserve and llama-perplexity; "
            "spec compares speculative decoding settings with none, one stream at a time."
        ),
    )
    add_cpu_isa_arg(parser)
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for register_mode in MODES:
        register_mode(modes)
    for mode in modes.choices.values():
        mode.set_defaults(run=with_cpu_isa(mode.get_default("run")))
