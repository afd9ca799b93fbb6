"""API keys: a Bearer check in front of every route but /health.

The check is ASGI middleware rather than a dependency on each route, so a
route nobody remembered to protect (FastAPI's /openapi.json, a path added
later, a 404) still needs the key. /health stays open for load balancers.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.entrypoints.openai.api_errors import ApiError

# The paths anyone may reach.
OPEN_PATHS = frozenset({"/health"})


class ApiKeys:
    """The keys the server accepts."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = [_digest(key.encode()) for key in keys]

    def match(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header value presents one of the keys."""
        scheme, _, token = authorization.partition(" ")
        # Starlette decodes headers as latin-1; encoding back gives the bytes sent.
        provided = _digest(token.strip().encode("latin-1"))
        # Digests all have one length, and every key is compared, so the time taken
        # tells neither a key's bytes or length nor which key matched.
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(provided, digest)
        return found and scheme.lower() == "bearer"


class ApiKeyMiddleware:
    """Refuses a request without a valid key (401, OpenAI's error body), except to OPEN_PATHS."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or (scope["type"] == "http" and scope["path"] in OPEN_PATHS):
            await self.app(scope, receive, send)
            return
        if not self.keys.match(Headers(scope=scope).get("authorization", "")):
            if scope["type"] == "http":
                await _unauthorized().response()(scope, receive, send)
            else:  # a WebSocket (the app has none): refuse the handshake
                await send({"type": "websocket.close", "code": 1008})
            return
        await self.app(scope, receive, send)


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _unauthorized() -> ApiError:
    return ApiError(
        401,
        "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
