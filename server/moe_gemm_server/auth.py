"""API keys: `Authorization: Bearer <key>`, compared in constant time.

Reader routes (matmuls, weight listing, v2 model routes) need one of the --api-key values
when any is configured; the admin key is accepted there too. Weight changes (PUT/DELETE)
need --admin-key; with no admin key they are refused (403), unless no key of any kind is
configured, i.e. a fully open local server. Missing key: 401 with WWW-Authenticate; wrong
key: 403. Every configured key is compared, whatever the outcome, so timing reveals nothing.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from .config import Settings
from .errors import APIError


def bearer_token(request: Request) -> str | None:
    """The bearer token, or None without one. Authorization sent more than once with different
    values is a 400, as the other headers the service reads (routers/common.single_header):
    acting on the first would let a proxy's or a client's second credential go unread."""
    values = request.headers.getlist("authorization")
    if len({v.strip() for v in values}) > 1:
        raise APIError(400, f"authorization is given {len(values)} times with different values")
    if not values:
        return None
    value = values[0]
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _matches(token: str, keys: list[str]) -> bool:
    given = token.encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key.encode())
    return ok


def _missing() -> APIError:
    return APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                    {"WWW-Authenticate": "Bearer"})


def check_reader(request: Request, settings: Settings) -> None:
    keys = list(settings.api_key)
    if not keys:
        return
    if settings.admin_key is not None:
        keys.append(settings.admin_key)
    token = bearer_token(request)
    if token is None:
        raise _missing()
    if not _matches(token, keys):
        raise APIError(403, "invalid API key")


def check_admin(request: Request, settings: Settings) -> None:
    if settings.open_admin:
        return
    token = bearer_token(request)
    if settings.admin_key is None:
        raise APIError(403, "weight changes are disabled: the server has no --admin-key")
    if token is None:
        raise _missing()
    if not _matches(token, [settings.admin_key]):
        raise APIError(403, "invalid admin key")
