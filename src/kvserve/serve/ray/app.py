"""Building the Ray Serve application: engine replicas behind the OpenAI ingress.

:func:`build_application` is what ``kvserve serve --ray`` deploys;
:func:`app_builder` is the same for ``serve run`` on an existing cluster
(``import_path: kvserve.serve.ray.app:app_builder``, its ``args`` as in
``docs/scaling.md``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from kvserve.config import EngineConfig
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.errors import InvalidParameterError
from kvserve.serve.ray.engine_replica import EngineReplica, replica_env
from kvserve.serve.ray.ingress import OpenAIIngress

ROUTERS = {
    "prefix": "kvserve.serve.ray.router.PrefixAwareRouter",
    "kv-aware": "kvserve.serve.ray.kv_aware_router.KVAwareRouter",
    "round-robin": "kvserve.serve.ray.router.RoundRobinRouter",
    "power-of-two": None,  # Ray Serve's default router
}
ENGINE_DEPLOYMENT = "KVServeEngine"
INGRESS_DEPLOYMENT = "KVServeIngress"


@dataclass(frozen=True)
class RayServeOptions:
    """How the app spreads over Ray.

    replicas: engine replicas (each a full copy of the model and its KV cache).
    threads_per_replica: CPUs reserved for each replica and torch threads of its loop.
    routing: ``prefix`` (prefix-aware), ``kv-aware`` (by the replicas' KV cache events;
        needs ``kv_events_endpoint`` on the engine), ``round-robin``, or
        ``power-of-two`` (Ray's default).
    num_prefix_blocks: leading prompt blocks that key the prefix- and KV-aware routers.
    saturation_queue_len: requests in flight past which the prefix- and KV-aware routers
        pass a replica over; None means the engine's ``max_num_seqs`` (a full running batch).
    app_name: the Ray Serve application's name (also names its metrics board).
    """

    replicas: int = 2
    threads_per_replica: int = 1
    routing: str = "prefix"
    num_prefix_blocks: int = 8
    saturation_queue_len: int | None = None
    app_name: str = "kvserve"

    def __post_init__(self) -> None:
        for name in ("replicas", "threads_per_replica", "num_prefix_blocks"):
            _check_positive(name, getattr(self, name))
        if self.saturation_queue_len is not None:
            _check_positive("saturation_queue_len", self.saturation_queue_len)
        if self.routing not in ROUTERS:
            raise InvalidParameterError(
                "routing", f"must be one of {', '.join(ROUTERS)}, got {self.routing!r}"
            )
        if not self.app_name:
            raise InvalidParameterError("app_name", "must be a non-empty string")

    @property
    def board_name(self) -> str:
        return f"{self.app_name}-metrics"


def build_application(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    options: RayServeOptions,
    chat_template: str | None = None,
) -> Application:
    """The app: ``options.replicas`` engines, their router, and the OpenAI ingress.

    The dashboard needs an engine in process, so ``server_config``'s is turned off.
    """
    check_routing(engine_config, options)
    server_config = dataclasses.replace(server_config, enable_dashboard=False)
    scheduler = engine_config.scheduler_config
    router_class = ROUTERS[options.routing]
    router_config: dict[str, Any] = {}
    if router_class is not None:
        kwargs: dict[str, Any] = {}
        if options.routing in ("prefix", "kv-aware"):
            kwargs = {
                "block_size": engine_config.cache_config.block_size,
                "num_prefix_blocks": options.num_prefix_blocks,
                "saturation_queue_len": options.saturation_queue_len or scheduler.max_num_seqs,
            }
        if options.routing == "kv-aware":
            kwargs["kv_events_topic"] = engine_config.kv_events_config.kv_events_topic
        router_config["request_router_config"] = RequestRouterConfig(
            request_router_class=router_class,  # type: ignore[arg-type]  # a str is allowed
            request_router_kwargs=kwargs,
        )
    threads = options.threads_per_replica
    engine = serve.deployment(
        name=ENGINE_DEPLOYMENT,
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": threads, "runtime_env": {"env_vars": replica_env(threads)}},
        # The engine queues and refuses (503) by itself; Ray must not queue in front of it.
        max_ongoing_requests=server_config.max_waiting_requests + scheduler.max_num_seqs,
        **router_config,
    )(EngineReplica).bind(
        engine_config,
        server_config.served_model_name,
        server_config.max_waiting_requests,
        threads,
        options.board_name,
    )
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        # It tokenizes and relays; a CPU of its own would leave one fewer for a replica.
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=server_config.limit_concurrency,
    )(OpenAIIngress)
    return ingress.bind(engine, server_config, options.board_name, chat_template)


def check_routing(engine_config: EngineConfig, options: RayServeOptions) -> None:
    """InvalidParameterError when ``options.routing`` needs what the engines lack:
    kv-aware routing reads the replicas' KV cache events, which must be published."""
    if options.routing == "kv-aware" and engine_config.kv_events_config.kv_events_endpoint is None:
        raise InvalidParameterError(
            "routing",
            "kv-aware routes by the replicas' KV cache events: set kv_events_endpoint "
            "(--kv-events-endpoint, such as tcp://127.0.0.1:5557; each replica adds its "
            "rank on the node to the port)",
        )


def app_builder(args: dict[str, Any]) -> Application:
    """``serve run``'s builder; ``args`` keys:

    model (required); replicas, threads_per_replica, routing, num_prefix_blocks,
    saturation_queue_len, app_name (RayServeOptions' fields); engine: EngineConfig
    keyword arguments (``block_size``, ``max_num_seqs``, ...); server: ServerConfig
    fields (``api_keys`` as a list); chat_template: a template's text.
    """
    args = dict(args)
    if "model" not in args:
        raise InvalidParameterError("model", "is required")
    model = str(args.pop("model"))
    engine_config = EngineConfig.from_kwargs(model, **args.pop("engine", {}))
    server = dict(args.pop("server", {}))
    server["api_keys"] = tuple(server.get("api_keys", ()))
    server.setdefault("served_model_name", model)
    chat_template = args.pop("chat_template", None)
    known = {field.name for field in dataclasses.fields(RayServeOptions)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise InvalidParameterError("args", f"unknown keys {unknown}; allowed: {sorted(known)}")
    options = RayServeOptions(**args)
    return build_application(engine_config, ServerConfig(**server), options, chat_template)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidParameterError(name, f"must be a positive integer, got {value!r}")
