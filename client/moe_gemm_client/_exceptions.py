"""Exceptions raised by the client, one class per kind of failure.

The hierarchy follows openai-python so that code written against one reads the same here:

    MoeGemmError                      everything this package raises on purpose
    ├── APIError                      something went wrong talking to the server
    │   ├── APIStatusError            the server answered with a 4xx/5xx status
    │   │   ├── BadRequestError            400  malformed body
    │   │   ├── AuthenticationError        401  missing API key
    │   │   ├── PermissionDeniedError      403  wrong key, or weight changes not allowed
    │   │   ├── NotFoundError              404  unknown weight set or route
    │   │   ├── PayloadTooLargeError       413  body or rows over the server's limits
    │   │   ├── UnprocessableEntityError   422  shapes/dtypes/counts that do not fit
    │   │   ├── RateLimitError             429  queue full (retry_after set)
    │   │   └── ServerError                5xx
    │   │       ├── ServiceUnavailableError    503  not ready / draining / out of memory
    │   │       └── GatewayTimeoutError        504  the request's deadline passed before it ran
    │   ├── APIConnectionError        no answer: refused, reset, DNS, ...
    │   │   └── APITimeoutError       no answer in time (a kind of connection error, as in openai)
    │   └── APIResponseValidationError  an answer that does not follow the HTTP contract
    ├── ClientClosedError             a call on a closed client (also a RuntimeError), raised
    │                                 before any request
    └── (local argument errors are plain ValueError / TypeError, raised before any request)

Every `APIError` carries `message`, `status_code` (None when there was no answer) and
`request_id` (the server's X-Request-Id, or the one the caller sent).
"""

from __future__ import annotations

from typing import Any

import httpx

__all__ = [
    "MoeGemmError",
    "APIError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "PayloadTooLargeError",
    "UnprocessableEntityError",
    "RateLimitError",
    "ServerError",
    "InternalServerError",
    "ServiceUnavailableError",
    "GatewayTimeoutError",
    "APIConnectionError",
    "APITimeoutError",
    "APIResponseValidationError",
    "ClientClosedError",
]


class MoeGemmError(Exception):
    """Base class of every exception this package raises on purpose."""


class APIError(MoeGemmError):
    """A request to the server failed.

    Attributes:
        message: What went wrong, from the server's `{"error": ...}` body when there is one.
        status_code: The HTTP status, or None when no answer came back.
        request_id: The X-Request-Id of the exchange (the server's, else the one sent), or None.
        request: The `httpx.Request` that failed, when known.
        body: The decoded JSON error body (or the text) when the server sent one.
    """

    status_code: int | None

    def __init__(
        self,
        message: str,
        *,
        request: httpx.Request | None = None,
        status_code: int | None = None,
        request_id: str | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request = request
        self.status_code = status_code
        self.request_id = request_id
        self.body = body

    def __str__(self) -> str:
        parts = []
        if self.status_code is not None:
            parts.append(f"Error code: {self.status_code} - ")
        parts.append(self.message)
        if self.request_id:
            parts.append(f" (request id: {self.request_id})")
        return "".join(parts)


class APIStatusError(APIError):
    """The server answered with a 4xx or 5xx status.

    Attributes:
        response: The `httpx.Response`.
        status_code: Its status.
        retry_after: The server's Retry-After in seconds (429/503), or None.
        code: The error body's machine-readable `code`, where the server gives one (a 503
            "weight_set_unreadable": a stored set that lasts unreadable until it is uploaded
            again or deleted, never retried), else None.
    """

    status_code: int

    def __init__(
        self,
        message: str,
        *,
        response: httpx.Response,
        request_id: str | None = None,
        body: Any = None,
        retry_after: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(
            message,
            request=response.request if _has_request(response) else None,
            status_code=response.status_code,
            request_id=request_id,
            body=body,
        )
        self.response = response
        self.retry_after = retry_after
        self.code = code


class BadRequestError(APIStatusError):
    """400: the body is malformed (bad safetensors or JSON, missing tensor)."""


class AuthenticationError(APIStatusError):
    """401: the server wants an API key and none was sent."""


class PermissionDeniedError(APIStatusError):
    """403: the key is wrong, or weight changes need the admin key."""


class NotFoundError(APIStatusError):
    """404: unknown weight set or route."""


class PayloadTooLargeError(APIStatusError):
    """413: the body or the number of rows is over the server's limits."""


class UnprocessableEntityError(APIStatusError):
    """422: shapes, dtypes or counts that do not fit (K mismatch, counts not summing to T, ...)."""


class RateLimitError(APIStatusError):
    """429: the server's queue is full; `retry_after` says when to come back."""


class ServerError(APIStatusError):
    """5xx: the server failed."""


InternalServerError = ServerError  # openai-python's name for the same class


class ServiceUnavailableError(ServerError):
    """503: not ready yet, draining, or out of GPU memory (`retry_after` says when to come
    back), or a stored weight set whose file cannot be read (`code` "weight_set_unreadable":
    no retry cures it)."""


class GatewayTimeoutError(ServerError):
    """504: the request's server-side timeout (X-Timeout-Us) expired before it ran."""


class APIConnectionError(APIError):
    """No answer came back: connection refused or reset, DNS failure, protocol error."""

    def __init__(
        self,
        message: str = "Connection error.",
        *,
        request: httpx.Request | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message, request=request, request_id=request_id)


class APITimeoutError(APIConnectionError):
    """No answer came back within the client's timeout."""

    def __init__(
        self,
        message: str = "Request timed out.",
        *,
        request: httpx.Request | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message, request=request, request_id=request_id)


class APIResponseValidationError(APIError):
    """The server answered 2xx, but the body does not follow the HTTP contract."""

    def __init__(
        self,
        message: str,
        *,
        response: httpx.Response | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(
            message,
            request=response.request if response is not None and _has_request(response) else None,
            status_code=response.status_code if response is not None else None,
            request_id=request_id,
        )
        self.response = response


class ClientClosedError(MoeGemmError, RuntimeError):
    """A call on a client after its `close()`, or whose `http_client` its owner has closed:
    raised before any request is sent. A RuntimeError too: httpx raised one from deep inside
    the send, and code written against that may catch it."""


_STATUS_CLASSES: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    413: PayloadTooLargeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
    503: ServiceUnavailableError,
    504: GatewayTimeoutError,
}


def status_error_class(status_code: int) -> type[APIStatusError]:
    """The exception class for an error status (APIStatusError for statuses without their own)."""
    cls = _STATUS_CLASSES.get(status_code)
    if cls is not None:
        return cls
    if status_code >= 500:
        return ServerError
    return APIStatusError


def _has_request(response: httpx.Response) -> bool:
    # A Response built by hand (tests) has no request; reading .request then raises.
    try:
        response.request
    except RuntimeError:
        return False
    return True
