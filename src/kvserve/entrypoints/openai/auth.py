"""API keys: a Bearer check in front of every route but /health, and a cache salt per key.

The check is ASGI middleware rather than a dependency on each route, so a
route nobody remembered to protect (FastAPI's /openapi.json, a path added
later, a 404) still needs the key. /health stays open for load balancers.

With ``salt_cache_by_api_key`` each key's requests carry a prefix-cache salt
(see :func:`cache_salt`): requests of different keys then never share KV
blocks, so one client cannot learn from the time to its first token whether
another client sent the same prompt prefix. A key's salt is an HMAC of the key
under a secret drawn when the app is built: it never contains the key, and
the prefix cache lives no longer than the process, so a fresh secret on each
start costs nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.datastructures import Headers, QueryParams
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.entrypoints.openai.api_errors import ApiError

# The paths anyone may reach.
OPEN_PATHS = frozenset({"/health"})
# Where an authenticated request's scope carries its key's cache salt (None without one).
_TENANT_SALT_SCOPE_KEY = "kvserve.tenant_salt"
# Where an authenticated request's scope names its key (the key's place in the list):
# what a client stores (/v1/responses) belongs to its key alone.
_TENANT_SCOPE_KEY = "kvserve.tenant"


@dataclass(frozen=True)
class _Key:
    digest: bytes  # SHA-256 of the key
    cache_salt: str | None
    tenant: str  # names the key without holding it


class ApiKeys:
    """The keys the server accepts, each with its cache salt when ``salt_cache`` is set."""

    def __init__(
        self, keys: Sequence[str], salt_cache: bool, salt_secret: bytes | None = None
    ) -> None:
        # salt_secret: one kept across restarts (the prefix cache's disk tier keeps one,
        # so that a key's blocks on disk are found again); otherwise one for this run.
        secret = salt_secret if salt_secret is not None else secrets.token_bytes(32)
        self._keys = [
            _Key(
                _digest(key.encode()),
                hmac.new(secret, key.encode(), hashlib.sha256).hexdigest() if salt_cache else None,
                f"key-{index}",
            )
            for index, key in enumerate(keys)
        ]

    def match(self, authorization: str) -> _Key | None:
        """The key an ``Authorization`` header value presents, or None."""
        scheme, _, token = authorization.partition(" ")
        # Starlette decodes headers as latin-1; encoding back gives the bytes sent.
        provided = _digest(token.strip().encode("latin-1"))
        # Digests all have one length, and every key is compared, so the time taken
        # tells neither a key's bytes or length nor which key matched.
        found = None
        for key in self._keys:
            if hmac.compare_digest(provided, key.digest):
                found = key
        return found if scheme.lower() == "bearer" else None


class ApiKeyMiddleware:
    """Refuses a request without a valid key (401, OpenAI's error body), except to open paths.

    open_paths: paths anyone may reach (OPEN_PATHS and, with the dashboard,
        its page and static files, which hold no data).
    query_key_paths: paths that also take the key as an ``api_key`` query
        parameter, for clients that cannot set headers (a browser's
        EventSource); the header wins when both are sent.
    """

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeys,
        open_paths: frozenset[str] = OPEN_PATHS,
        query_key_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths
        self.query_key_paths = query_key_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or (
            scope["type"] == "http" and scope["path"] in self.open_paths
        ):
            await self.app(scope, receive, send)
            return
        authorization = Headers(scope=scope).get("authorization", "")
        if not authorization and scope["path"] in self.query_key_paths:
            query_key = QueryParams(scope.get("query_string", b"")).get("api_key", "")
            # As a header's bytes arrive: the key's UTF-8 bytes, read as latin-1.
            authorization = "Bearer " + query_key.encode().decode("latin-1")
        key = self.keys.match(authorization)
        if key is None:
            if scope["type"] == "http":
                await _unauthorized().response()(scope, receive, send)
            else:  # a WebSocket (the app has none): refuse the handshake
                await send({"type": "websocket.close", "code": 1008})
            return
        scope[_TENANT_SALT_SCOPE_KEY] = key.cache_salt
        scope[_TENANT_SCOPE_KEY] = key.tenant
        await self.app(scope, receive, send)


def cache_salt(connection: HTTPConnection, client_salt: str | None) -> str | None:
    """The salt a request runs under: its key's salt, the ``cache_salt`` it sent, or both."""
    key_salt = connection.scope.get(_TENANT_SALT_SCOPE_KEY)
    if key_salt is None:
        return client_salt
    assert isinstance(key_salt, str)
    # Key salts are 64 hex digits, so no two keys' requests can end up with one salt.
    return key_salt if client_salt is None else f"{key_salt}:{client_salt}"


def tenant(connection: HTTPConnection) -> str | None:
    """The API key a request came with, by name; None on a server without keys."""
    name = connection.scope.get(_TENANT_SCOPE_KEY)
    assert name is None or isinstance(name, str)
    return name


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _unauthorized() -> ApiError:
    return ApiError(
        401,
        "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
