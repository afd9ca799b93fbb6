"""Benchmarks that talk HTTP to a running server (kvserve's or any OpenAI-compatible one).

``kvserve bench serve`` (timed rounds), ``routing`` (Ray Serve's request
routers side by side on one load), ``soak`` (long mixed and hostile load,
then checks that the server gave everything back) and ``dashboard`` (the same
load with and without dashboard clients watching). ``serve_client.py`` and ``sse.py`` send and stream
requests; ``server_probe.py`` reads a server's metrics and memory from outside.
"""
