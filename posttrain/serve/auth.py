"""API keys, as vLLM's `--api-key`: with keys set, every request but `GET /health` needs
`Authorization: Bearer <key>` with one of them, else 401 in OpenAI's error shape.

    keys = resolve_api_keys(args.api_key, os.environ)  # --api-key values, else $POSTTRAIN_API_KEY
    app.add_middleware(APIKeyAuth, keys=keys)

The check is a plain ASGI middleware (no BaseHTTPMiddleware: it would buffer streams and hide disconnects),
outside the routes, so a refused request never reaches the body parser or the engine. Keys are kept only as
SHA-256 digests and compared with hmac.compare_digest against every key (no early exit): the time taken tells
nothing about a key's bytes or its length. Nothing here logs or echoes a key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse

from posttrain.errors import PosttrainError
from posttrain.serve.errors import error_body

ENV_VAR = "POSTTRAIN_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # a load balancer's probe needs no key, as in vLLM

Receive = Any  # the ASGI callables; typed loosely, as starlette does
Send = Any


def resolve_api_keys(flags: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The keys from `--api-key` values if any were given, else from $POSTTRAIN_API_KEY; each value may hold
    several keys separated by commas. [] means no key: the server is open. Refused (without showing the key):
    an empty key, a set but empty variable, and characters that cannot travel in an HTTP header."""
    if flags:
        values, source = list(flags), "--api-key"
    elif ENV_VAR in environ:
        values, source = [environ[ENV_VAR]], ENV_VAR
        if not values[0].strip():
            raise PosttrainError(f"{ENV_VAR} is set but empty: unset it to serve without a key, or set a key")
    else:
        return []
    keys: list[str] = []
    for key in (piece.strip() for value in values for piece in value.split(",")):
        number = len(keys) + 1
        if not key:
            raise PosttrainError(f"{source}: key {number} is empty (keys are separated by commas)")
        bad = next((i for i, ch in enumerate(key) if not "!" <= ch <= "~"), None)
        if bad is not None:  # Bearer tokens are printable ASCII; a space or a non-ASCII letter would never match
            raise PosttrainError(
                f"{source}: key {number} has a space, control or non-ASCII character at "
                f"position {bad + 1}; use printable ASCII"
            )
        keys.append(key)
    return list(dict.fromkeys(keys))


class APIKeyAuth:
    """ASGI middleware: HTTP requests outside OPEN_PATHS need a Bearer token equal to one of `keys`."""

    def __init__(self, app: Any, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("APIKeyAuth needs at least one key")
        self.app = app
        self._digests = [_digest(key.encode()) for key in keys]

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        token = bearer_token(scope["headers"])
        if token is None:
            refusal = error_body(
                "You didn't provide an API key. Send it in an Authorization header as Bearer "
                "auth (Authorization: Bearer YOUR_KEY)."
            )
        elif not self.accepts(token):
            refusal = error_body("Incorrect API key provided.", code="invalid_api_key")
        else:
            return await self.app(scope, receive, send)
        response = JSONResponse(refusal, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def accepts(self, token: bytes) -> bool:
        candidate = _digest(token)
        matched = False
        for digest in self._digests:  # every key, whatever matched: the time does not say which one
            matched |= hmac.compare_digest(digest, candidate)
        return matched


def bearer_token(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first `Authorization: Bearer <token>` header (scheme case-insensitive); None if there
    is no such header, another scheme, or no token."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
