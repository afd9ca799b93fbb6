"""kvserve on Ray Serve: engine replicas, an OpenAI ingress and prefix-aware routing.

- ``engine_replica.py``: the deployment that wraps one ``AsyncEngine`` per replica.
- ``remote_engine.py``: the ingress's ``EngineClient``, whose steps run on the
  replicas, so the single-process serving code runs unchanged in the ingress.
- ``ingress.py``: the OpenAI ingress deployment (the routes of ``build_app``).
- ``router.py``: the prefix-aware and round-robin request routers.
- ``kv_aware_router.py``: the router fed by the replicas' KV cache events
  (``kv_event_subscriber.py`` reads them into ``replica_block_map.py``).
- ``metrics_board.py``: replicas' Prometheus text, gathered and summed for ``/metrics``.
- ``app.py``: the app builder (``serve run`` config) and ``RayServeOptions``.
- ``local_cluster.py``: starting a local Ray cluster, deploying and removing the app.
- ``cli.py``: ``kvserve serve --ray``.

Nothing here is imported by the rest of kvserve: ``ray`` stays an optional extra.
"""
