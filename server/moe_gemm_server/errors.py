"""One exception type for every answer that is not a success, and its JSON rendering.

Handlers and helpers raise `APIError(status, message)`; the app turns it into
`{"error": message, "request_id": id}` with the status and any extra headers (Retry-After,
WWW-Authenticate), plus `"code"` where a client must tell one cause of a status from the
others (a 503 that retrying cannot cure). Status codes follow docs/HTTP-API.md.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import Request
from fastapi.responses import JSONResponse

# The `code` of a 503 that lasts until the client acts: a stored weight set whose file cannot
# be read as a set (an upload of the set, or its delete, ends it). Every other 503 passes
# (starting, draining, out of memory for one request) and comes with Retry-After.
WEIGHT_SET_UNREADABLE = "weight_set_unreadable"


class APIError(Exception):
    """An HTTP error answer: status code, message and optional headers; `reason`, where
    given, is the moe_gemm_rejections_total label the answer is counted under (once, when it
    is sent: the same refusal met by a load of the data directory answers nobody); `code`,
    where given, goes into the body for clients to act on (messages are for people)."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None,
                 reason: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
        self.reason = reason
        self.code = code


def bad_request(message: str) -> APIError:
    return APIError(400, message)


def unprocessable(message: str) -> APIError:
    return APIError(422, message)


def too_large(message: str) -> APIError:
    return APIError(413, message)


def unavailable(message: str, retry_after: int = 1, reason: str | None = None) -> APIError:
    return APIError(503, message, {"Retry-After": str(retry_after)}, reason)


def request_id_of(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id", ""))


def error_response(
    status: int, message: str, request_id: str = "", headers: Mapping[str, str] | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = {"error": message, "request_id": request_id}
    if code is not None:
        body["code"] = code
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))
