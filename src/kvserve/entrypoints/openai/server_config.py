"""The HTTP server's settings: the model name it answers to, the API keys, and its limits."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.errors import InvalidParameterError

# The defaults, shared with the ``serve`` command's help.
DEFAULT_MAX_REQUEST_BODY_BYTES = 1024 * 1024
DEFAULT_MAX_N = 8
DEFAULT_MAX_PROMPTS_PER_REQUEST = 16
DEFAULT_MAX_STOP_TOKEN_IDS = 128
DEFAULT_MAX_CHAT_MESSAGES = 512
DEFAULT_MAX_WAITING_REQUESTS = 256
# Connections (streams included) the server keeps open at once; past it, 503.
DEFAULT_LIMIT_CONCURRENCY = 512
# Seconds an idle keep-alive connection stays open (uvicorn's own default).
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0
# Seconds a client has to send a request's head, from connecting or from the end of
# the previous response: far more than any real client needs, yet a connection that
# sends nothing cannot hold its slot for ever.
DEFAULT_TIMEOUT_HEADER = 10.0
# Connections one peer (an IPv4 address, an IPv6 /64) may hold at once: its newer ones get
# 503, so one address cannot take every slot; eight addresses are needed to fill them.
DEFAULT_LIMIT_CONCURRENCY_PER_PEER = 64
# Seconds a client has, once a request's head is in, to send its body; each
# DEFAULT_MIN_BODY_RATE bytes received add a second. A stalled body is cut after 10 s, a
# slower trickle soon after, and even a 1 MiB body at that rate never needs more.
DEFAULT_TIMEOUT_BODY = 10.0
DEFAULT_MIN_BODY_RATE = 4096  # bytes per second (32 kbit/s)
# Seconds a client may read nothing of a response while the server has bytes waiting.
DEFAULT_TIMEOUT_WRITE = 30.0
# The server's default for SchedulerConfig.max_prefill_tokens_while_decoding (offline
# runs leave it uncapped). On the Zen 5 machine of docs/benchmarks.md, 32 streams with
# 100-token prompts: p99 gap between tokens 84 ms and 758 output tok/s at 96, against
# 316 ms and 692 tok/s uncapped; an offline batch lost 8% of its throughput to it.
DEFAULT_SERVE_PREFILL_TOKENS_WHILE_DECODING = 96

_POSITIVE_INTEGERS = (
    "max_request_body_bytes",
    "max_n",
    "max_prompts_per_request",
    "max_stop_token_ids",
    "max_chat_messages",
    "max_waiting_requests",
    "retry_after_seconds",
    "limit_concurrency",
    "limit_concurrency_per_peer",
    "min_body_rate",
)
_POSITIVE_NUMBERS = ("timeout_keep_alive", "timeout_header", "timeout_body", "timeout_write")


@dataclass(frozen=True)
class ServerConfig:
    """What the server accepts.

    served_model_name: the ``model`` clients must name (or omit); /v1/models lists it.
    api_keys: when any, every endpoint except /health needs ``Authorization: Bearer <key>``
        with one of them.
    salt_cache_by_api_key: each key's requests get a prefix-cache salt of their own
        (derived from the key, never the key itself), so clients with different keys
        never share cached blocks and cannot time each other's prompts.
    max_request_body_bytes: a larger request body gets 413 before it is parsed.
    max_n: the largest ``n`` (completions per prompt) a request may ask for.
    max_prompts_per_request: the most prompts one /v1/completions request may carry.
    max_stop_token_ids: the most ``stop_token_ids`` one request may carry.
    max_chat_messages: the most ``messages`` one /v1/chat/completions request may carry.
    max_waiting_requests: when a request's sequences would take the sequences waiting
        for their first step past this, it gets 503 with a ``Retry-After`` header.
    retry_after_seconds: the ``Retry-After`` value sent with 503.
    limit_concurrency: connections open at once; past it, new requests get 503
        (except /health). A peer's connections past its own cap are not counted.
    limit_concurrency_per_peer: connections one peer (an IPv4 address, an IPv6 /64)
        may hold at once; requests on its newer ones get 503 (except /health).
    timeout_keep_alive: seconds an idle keep-alive connection stays open.
    timeout_header: seconds a client has to send a request's head before the
        connection is closed.
    timeout_body: seconds a client has, once a request's head is in, to send its
        body, plus a second per ``min_body_rate`` bytes received; then 408 and close.
    min_body_rate: bytes per second a body must keep up after ``timeout_body``.
    timeout_write: seconds a client may read nothing of a response while the
        server has bytes waiting for it; then the connection is closed.
    enable_dashboard: serve the live dashboard (``GET /dashboard``) and its state stream.
    """

    served_model_name: str
    api_keys: tuple[str, ...] = ()
    salt_cache_by_api_key: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_n: int = DEFAULT_MAX_N
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    retry_after_seconds: int = 1
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE
    timeout_header: float = DEFAULT_TIMEOUT_HEADER
    limit_concurrency_per_peer: int = DEFAULT_LIMIT_CONCURRENCY_PER_PEER
    timeout_body: float = DEFAULT_TIMEOUT_BODY
    min_body_rate: int = DEFAULT_MIN_BODY_RATE
    timeout_write: float = DEFAULT_TIMEOUT_WRITE
    enable_dashboard: bool = True

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise InvalidParameterError("served_model_name", "must be a non-empty string")
        if not isinstance(self.api_keys, tuple) or not all(
            isinstance(key, str) and key for key in self.api_keys
        ):
            raise InvalidParameterError(
                "api_keys", "must be a tuple of non-empty strings; leave it empty for no key"
            )
        if self.salt_cache_by_api_key and not self.api_keys:
            raise InvalidParameterError("salt_cache_by_api_key", "needs at least one API key")
        for name in _POSITIVE_INTEGERS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(name, f"must be a positive integer, got {value!r}")
        for name in _POSITIVE_NUMBERS:
            value = getattr(self, name)
            valid = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not valid or not math.isfinite(value) or value <= 0:
                raise InvalidParameterError(name, f"must be a positive number, got {value!r}")
