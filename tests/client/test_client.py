"""Client and AsyncClient over httpx.MockTransport: error mapping, retries, backoff, Retry-After,
timeouts, headers, local validation and numeric round trips. Every test runs on both clients."""

from __future__ import annotations

import asyncio
import email.utils
import inspect
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from moe_client_testutils import (
    ContractHandler,
    error,
    grouped_mm_ref,
    make_async_client,
    make_client,
    sequence,
)

import moe_gemm_client as mgc
from moe_gemm_client import _constants as C
from moe_gemm_client._base import parse_retry_after
from moe_gemm_client._calls import _Call
from moe_gemm_client._tensors import BFLOAT16

MODES = ["sync", "async"]


def make(mode: str, handler: Any, **kwargs: Any) -> Any:
    return (make_client if mode == "sync" else make_async_client)(handler, **kwargs)


def run(client: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    out = getattr(client, method)(*args, **kwargs)
    return asyncio.run(out) if inspect.iscoroutine(out) else out


def ok_json(data: Any, **headers: str) -> httpx.Response:
    return httpx.Response(200, json=data, headers=headers)


INFO = {"name": "l0", "experts": 2, "k": 3, "n": 4, "dtype": "float32", "bytes": 96,
        "layout": "w"}


# ------------------------------------------------------------------------------------------
# error mapping


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "status, cls",
    [
        (400, mgc.BadRequestError),
        (401, mgc.AuthenticationError),
        (403, mgc.PermissionDeniedError),
        (404, mgc.NotFoundError),
        (413, mgc.PayloadTooLargeError),
        (422, mgc.UnprocessableEntityError),
        (429, mgc.RateLimitError),
        (500, mgc.ServerError),
        (503, mgc.ServiceUnavailableError),
        (504, mgc.GatewayTimeoutError),
        (502, mgc.ServerError),
        (418, mgc.APIStatusError),
    ],
)
def test_status_maps_to_exception_class(mode, status, cls):
    handler, seen = sequence(error(status, f"boom {status}", request_id="rid-7",
                                   **{"Retry-After": "3"}))
    client = make(mode, handler, max_retries=0)
    with pytest.raises(cls) as info:
        run(client, "get_weights", "l0")
    exc = info.value
    assert type(exc) is cls
    assert isinstance(exc, mgc.APIStatusError) and isinstance(exc, mgc.MoeGemmError)
    assert exc.status_code == status
    assert exc.message == f"boom {status}"
    assert exc.request_id == "rid-7"
    assert exc.response.status_code == status
    assert exc.retry_after == 3.0
    assert f"Error code: {status} - boom {status}" in str(exc) and "rid-7" in str(exc)
    assert len(seen) == 1


def test_5xx_hierarchy_and_aliases():
    assert mgc.InternalServerError is mgc.ServerError
    assert issubclass(mgc.ServiceUnavailableError, mgc.ServerError)
    assert issubclass(mgc.GatewayTimeoutError, mgc.ServerError)
    assert issubclass(mgc.APITimeoutError, mgc.APIConnectionError)
    assert issubclass(mgc.APIConnectionError, mgc.APIError)
    assert not issubclass(mgc.APIConnectionError, mgc.APIStatusError)


@pytest.mark.parametrize("mode", MODES)
def test_error_message_from_non_json_and_fastapi_bodies(mode):
    handler, _ = sequence(httpx.Response(502, text="<html>bad gateway</html>"))
    with pytest.raises(mgc.ServerError) as info:
        run(make(mode, handler, max_retries=0), "list_weights")
    assert info.value.message == "<html>bad gateway</html>"
    assert info.value.request_id is None
    detail = [{"loc": ["body"], "msg": "field required"}]
    handler, _ = sequence(httpx.Response(422, json={"detail": detail}))
    with pytest.raises(mgc.UnprocessableEntityError) as info:
        run(make(mode, handler), "list_weights")
    assert "field required" in info.value.message
    # request id only in the body
    handler, _ = sequence(httpx.Response(400, json={"error": "bad", "request_id": "body-id"}))
    with pytest.raises(mgc.BadRequestError) as info:
        run(make(mode, handler), "list_weights")
    assert info.value.request_id == "body-id"


@pytest.mark.parametrize("mode", MODES)
def test_request_id_on_errors_falls_back_to_the_one_sent(mode):
    handler, seen = sequence(httpx.Response(404, json={"error": "nope"}))
    with pytest.raises(mgc.NotFoundError) as info:
        run(make(mode, handler), "get_weights", "l0", request_id="mine-1")
    assert seen[0].headers["X-Request-Id"] == "mine-1"
    assert info.value.request_id == "mine-1"


@pytest.mark.parametrize("mode", MODES)
def test_malformed_success_body_is_a_validation_error(mode):
    for resp in (httpx.Response(200, text="not json"), ok_json({"weights": "nope"}),
                 ok_json({"weights": [{"name": "x"}]})):
        handler, _ = sequence(resp)
        with pytest.raises(mgc.APIResponseValidationError):
            run(make(mode, handler), "list_weights")
    # a matmul answer whose y has the wrong number of rows
    handler, _ = sequence(httpx.Response(
        200, content=mgc._tensors.encode_safetensors({"y": np.zeros((2, 4), np.float32)})
        .to_bytes()))
    with pytest.raises(mgc.APIResponseValidationError, match=r"\(3, N\)"):
        run(make(mode, handler), "grouped_mm", "l0", np.ones((3, 2), np.float32), counts=[3])
    handler, _ = sequence(httpx.Response(200, content=b"\x00garbage"))
    with pytest.raises(mgc.APIResponseValidationError, match="safetensors"):
        run(make(mode, handler), "grouped_mm", "l0", np.ones((3, 2), np.float32), counts=[3])



def _st_answer(**tensors: np.ndarray) -> httpx.Response:
    return httpx.Response(200, content=mgc._tensors.encode_safetensors(tensors).to_bytes())


@pytest.mark.parametrize("mode", MODES)
def test_an_answer_in_another_dtype_or_for_another_set_is_a_validation_error(mode):
    # y / d_i come back in x's / a_i's dtype; answers of int32 or float64 were returned as
    # they came, and get_weights("a") took an answer describing "b".
    x = np.ones((3, 2), np.float32)
    for wrong in (np.int32, np.float64, np.float16):
        handler, _ = sequence(_st_answer(y=np.zeros((3, 4), wrong)))
        with pytest.raises(mgc.APIResponseValidationError,
                           match=f"expected y in x's dtype float32; got {np.dtype(wrong)}"):
            run(make(mode, handler), "grouped_mm", "l0", x, counts=[3])
    handler, _ = sequence(_st_answer(y=np.zeros((3, 4), np.float32)))
    assert run(make(mode, handler), "grouped_mm", "l0", x, counts=[3]).dtype == np.float32
    handler, _ = sequence(_st_answer(**{"d.0": np.zeros((3, 5), np.float32),
                                        "d.1": np.zeros((1, 5), np.float32)}))
    a, b = [x, np.ones((1, 2), np.float16)], [np.ones((2, 5), np.float32),
                                              np.ones((2, 5), np.float16)]
    with pytest.raises(mgc.APIResponseValidationError,
                       match=r"expected d.1 in a_list\[1\]'s dtype float16; got float32"):
        run(make(mode, handler), "grouped_gemm", a, b)
    handler, _ = sequence(ok_json({**INFO, "name": "b"}))
    with pytest.raises(mgc.APIResponseValidationError, match="describes 'b'"):
        run(make(mode, handler), "get_weights", "a")
    handler, _ = sequence(ok_json(INFO))
    assert run(make(mode, handler), "get_weights", "l0").name == "l0"


DEEP = b'{"error": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("mode", MODES)
def test_json_nested_past_the_parser_stack_is_a_clear_error(mode):
    """A body of arrays nested deeper than json's stack raised a bare RecursionError from
    every call, for success and error answers alike."""
    deep = httpx.Response(200, content=DEEP, headers={"content-type": "application/json"})
    for method, args in (("list_weights", ()), ("get_weights", ("l0",)),
                         ("grouped_mm", ("l0", np.ones((1, 2), np.float32)))):
        kwargs = {"counts": [1]} if method == "grouped_mm" else {}
        handler, _ = sequence(deep)
        with pytest.raises(mgc.APIResponseValidationError, match="expected a JSON body"):
            run(make(mode, handler), method, *args, **kwargs)
    handler, _ = sequence(httpx.Response(400, content=DEEP,
                                         headers={"content-type": "application/json"}))
    with pytest.raises(mgc.BadRequestError):
        run(make(mode, handler), "list_weights")
    handler, _ = sequence(deep)
    assert run(make(mode, handler), "ready") is True  # 200 is the answer; the body is optional


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("y", [[[1.0, None], [3.0, 4.0]], [[1.0, True], [3.0, 4.0]],
                               [[10**400, 2.0], [3.0, 4.0]], [["1", "2"], ["3", "4"]]],
                         ids=["null", "bool", "huge-int", "strings"])
def test_json_answer_that_is_not_numbers_is_a_validation_error(mode, y):
    """numpy read a null as NaN and true as 1.0 (a broken answer passed as a result), and an
    integer beyond float64 raised a bare OverflowError."""
    handler, _ = sequence(ok_json({"y": y, "dtype": "float32"}))
    with pytest.raises(mgc.APIResponseValidationError, match="only numbers"):
        run(make(mode, handler), "grouped_mm", "l0", np.ones((2, 3), np.float32), counts=[2])
    handler, _ = sequence(ok_json({"d": [y], "dtype": "float32"}))
    with pytest.raises(mgc.APIResponseValidationError, match="only numbers"):
        run(make(mode, handler), "grouped_gemm", [np.ones((2, 1), np.float32)],
            [np.ones((1, 2), np.float32)])


# ------------------------------------------------------------------------------------------
# retries


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422, 500, 504])
def test_no_retry_on_non_retryable_statuses(mode, status):
    handler, seen = sequence(error(status, "no"))
    client = make(mode, handler, max_retries=5)
    with pytest.raises(mgc.APIStatusError):
        run(client, "grouped_mm", "l0", np.ones((2, 2), np.float32), counts=[2])
    assert len(seen) == 1 and client.sleeps == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("status", [408, 429, 502, 503])
def test_retryable_statuses_then_success(mode, status):
    handler, seen = sequence(error(status, "busy"), error(status, "busy"), ok_json(INFO))
    client = make(mode, handler, max_retries=2)
    client._random = lambda: 0.0  # no jitter: exact delays
    info = run(client, "get_weights", "l0")
    assert info == mgc.WeightInfo(**INFO)
    assert len(seen) == 3
    assert client.sleeps == [0.5, 1.0]


def _unreadable_set() -> httpx.Response:
    """The server's 503 for a stored weight set whose file cannot be read: no Retry-After,
    and the code that says it lasts."""
    return httpx.Response(503, json={"error": "weight set 'l0' is stored but its file could "
                                              "not be loaded: malformed safetensors",
                                     "request_id": "srv-id", "code": "weight_set_unreadable"})


@pytest.mark.parametrize("mode", MODES)
def test_a_503_that_lasts_is_not_retried(mode):
    """The 503 of a stored set whose file cannot be read lasts until the set is uploaded
    again or deleted: the client retried it like any 503, and its caller got the error
    after about 1.5 s of backoff. Its code now ends the retries at once; a 503 without it (or
    with another code: a gateway's, a proxy's) is still retried."""
    handler, seen = sequence(_unreadable_set())
    client = make(mode, handler, max_retries=2)
    with pytest.raises(mgc.ServiceUnavailableError, match="file could not be loaded") as info:
        run(client, "get_weights", "l0")
    assert len(seen) == 1 and client.sleeps == []
    assert info.value.code == "weight_set_unreadable" and info.value.retry_after is None
    transient = httpx.Response(503, json={"error": "draining", "code": "something_else"})
    handler, seen = sequence(transient, error(503, "not ready"), ok_json(INFO))
    client = make(mode, handler, max_retries=2)
    assert run(client, "get_weights", "l0") == mgc.WeightInfo(**INFO)
    assert len(seen) == 3 and len(client.sleeps) == 2


@pytest.mark.parametrize("mode", MODES)
def test_retries_exhausted_raise_the_last_error(mode):
    handler, seen = sequence(error(429, "queue full"))
    client = make(mode, handler, max_retries=3)
    with pytest.raises(mgc.RateLimitError, match="queue full"):
        run(client, "list_weights")
    assert len(seen) == 4 and len(client.sleeps) == 3


@pytest.mark.parametrize("mode", MODES)
def test_max_retries_zero_and_per_call_override(mode):
    handler, seen = sequence(error(503, "warming"))
    client = make(mode, handler, max_retries=0)
    with pytest.raises(mgc.ServiceUnavailableError):
        run(client, "list_weights")
    assert len(seen) == 1
    with pytest.raises(mgc.ServiceUnavailableError):
        run(client, "list_weights", max_retries=4)
    assert len(seen) == 1 + 5


@pytest.mark.parametrize("mode", MODES)
def test_exponential_backoff_caps_at_8s(mode):
    handler, seen = sequence(httpx.ConnectError("refused"))
    client = make(mode, handler, max_retries=7)
    client._random = lambda: 0.0
    with pytest.raises(mgc.APIConnectionError) as info:
        run(client, "list_weights")
    assert not isinstance(info.value, mgc.APITimeoutError)
    assert client.sleeps == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert len(seen) == 8


@pytest.mark.parametrize("mode", MODES)
def test_backoff_never_overflows_with_a_huge_max_retries(mode):
    """max_retries has no upper bound; 0.5 * 2.0 ** 1024 raised OverflowError at the 1025th
    retry, though the delay had been capped at 8 s since the 5th."""
    failures = 1100
    handler, seen = sequence(*[httpx.ConnectError("refused")] * failures, ok_json(INFO))
    client = make(mode, handler, max_retries=10**30)
    client._random = lambda: 0.0
    assert run(client, "get_weights", "l0") == mgc.WeightInfo(**INFO)
    assert len(seen) == failures + 1
    assert client.sleeps[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert set(client.sleeps[4:]) == {8.0} and len(client.sleeps) == failures
    state = client._state(_Call("GET", "/v1/weights", lambda r: None))
    state.retries_done = 10**30
    assert client._retry_delay(state, None) == 8.0


@pytest.mark.parametrize("mode", MODES)
def test_a_call_on_a_closed_client_is_refused_before_any_request(mode):
    """After close() a call failed deep inside httpx ("Cannot send a request, as the client
    has been closed"); it is now the client's own error, raised before anything is sent."""
    handler, seen = sequence(ok_json(INFO))
    client = make(mode, handler)
    run(client, "close")
    assert client.is_closed
    for method, args in [("get_weights", ("l0",)), ("health", ()),
                         ("grouped_mm", ("l0", np.ones((2, 3), np.float32))),
                         ("wait_until_ready", (5.0,))]:
        kwargs = {"counts": [2, 0]} if method == "grouped_mm" else {}
        with pytest.raises(mgc.ClientClosedError, match=r"is closed \(close\(\) was called\)"):
            run(client, method, *args, **kwargs)
    assert seen == [] and client.sleeps == []
    assert issubclass(mgc.ClientClosedError, mgc.MoeGemmError)
    assert issubclass(mgc.ClientClosedError, RuntimeError)  # (what httpx raised before)
    assert not issubclass(mgc.ClientClosedError, mgc.APIError)  # (no request was made)
    # an owned pool, closed by close(), and an http_client its owner closed
    owned = mgc.Client() if mode == "sync" else mgc.AsyncClient()
    run(owned, "close")
    with pytest.raises(mgc.ClientClosedError, match="is closed"):
        run(owned, "list_weights")
    client = make(mode, handler)
    run(client._http, "close" if mode == "sync" else "aclose")
    assert client.is_closed
    with pytest.raises(mgc.ClientClosedError, match="http_client .* has been closed"):
        run(client, "list_weights")
    assert seen == []


@pytest.mark.parametrize("mode", MODES)
def test_jitter_stays_within_25_percent(mode):
    handler, _ = sequence(httpx.ConnectError("refused"))
    client = make(mode, handler, max_retries=6)
    client._random = lambda: 0.999999
    with pytest.raises(mgc.APIConnectionError):
        run(client, "list_weights")
    expected = [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    for got, base in zip(client.sleeps, expected):
        assert 0.75 * base <= got <= base and got < base
    # and with the real random source the delays vary but stay in bounds
    client = make(mode, handler, max_retries=6)
    with pytest.raises(mgc.APIConnectionError):
        run(client, "list_weights")
    for got, base in zip(client.sleeps, expected):
        assert 0.75 * base <= got <= base


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "headers, expected",
    [
        ({"Retry-After": "2"}, 2.0),
        ({"Retry-After": "0.25"}, 0.25),
        ({"Retry-After": "0"}, 0.0),
        ({"Retry-After": "3600"}, C.MAX_RETRY_AFTER),  # capped
        ({"Retry-After-Ms": "1500", "Retry-After": "9"}, 1.5),
        ({"Retry-After": "soon"}, 0.5),  # unparsable: exponential backoff
        ({"Retry-After": "-4"}, 0.5),
    ],
)
def test_retry_after_is_honoured(mode, headers, expected):
    handler, seen = sequence(error(429, "full", **headers), ok_json({"weights": []}))
    client = make(mode, handler)
    client._random = lambda: 0.0
    assert run(client, "list_weights") == []
    assert client.sleeps == [pytest.approx(expected)]


@pytest.mark.parametrize("mode", MODES)
def test_retry_after_http_date(mode):
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    handler, _ = sequence(error(503, "draining", **{"Retry-After": when}), ok_json({"weights": []}))
    client = make(mode, handler)
    run(client, "list_weights")
    assert 27.0 <= client.sleeps[0] <= 30.5
    past = email.utils.formatdate(time.time() - 30, usegmt=True)
    assert parse_retry_after(httpx.Headers({"Retry-After": past})) == 0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("when", ["Wed, 21 Oct 99999 07:28:00 GMT",
                                  "Wed, 21 Oct 99999999999999999999 07:28:00 GMT"])
def test_retry_after_date_beyond_the_calendar_is_ignored(mode, when):
    # A date the platform cannot represent is no delay: the answer's own status error is
    # raised (or retried with the backoff), never a ValueError/OverflowError from the date.
    assert parse_retry_after(httpx.Headers({"Retry-After": when})) is None
    handler, _ = sequence(error(503, "draining", **{"Retry-After": when}),
                          ok_json({"weights": []}))
    client = make(mode, handler)
    client._random = lambda: 0.0
    assert run(client, "list_weights") == []
    assert client.sleeps == [pytest.approx(0.5)]
    handler, _ = sequence(error(429, "full", **{"Retry-After": when}))
    with pytest.raises(mgc.RateLimitError) as info:
        run(make(mode, handler), "list_weights", max_retries=0)
    assert info.value.retry_after is None


@pytest.mark.parametrize("mode", MODES)
def test_connection_errors_are_retried_for_every_route(mode, rng):
    # All routes are safe to repeat, so a connection that broke mid-request is retried too,
    # including the POST matmuls (pure functions of their body).
    handler = ContractHandler()
    handler.weights["l0"] = (rng.standard_normal((1, 2, 3)).astype(np.float32), "w")
    fails = [httpx.ReadError("reset"), httpx.RemoteProtocolError("closed"),
             httpx.WriteError("broken pipe")]

    def flaky(request: httpx.Request) -> httpx.Response:
        if fails:
            request.read()
            raise fails.pop(0)
        return handler(request)

    client = make(mode, flaky, max_retries=3)
    x = rng.standard_normal((4, 2)).astype(np.float32)
    y = run(client, "grouped_mm", "l0", x, counts=[4])
    np.testing.assert_allclose(y, x @ handler.weights["l0"][0][0], rtol=1e-5)
    assert len(client.sleeps) == 3


@pytest.mark.parametrize("mode", MODES)
def test_unsafe_calls_retry_only_what_never_reached_the_server(mode):
    # No public route is unsafe to repeat, but the rule is enforced by _Call.retry_safe.
    handler, seen = sequence(httpx.ReadError("reset"), ok_json({}))
    client = make(mode, handler, max_retries=3)
    call = _Call("POST", "/v1/not-idempotent", lambda r: r.json(), retry_safe=False)
    with pytest.raises(mgc.APIConnectionError):
        run(client, "_request", call)
    assert len(seen) == 1
    handler, seen = sequence(error(503, "busy"), ok_json({}))
    client = make(mode, handler, max_retries=3)
    with pytest.raises(mgc.ServiceUnavailableError):
        run(client, "_request", _Call("POST", "/v1/x", lambda r: r.json(), retry_safe=False))
    assert len(seen) == 1
    handler, seen = sequence(httpx.ConnectError("refused"), ok_json({"ok": 1}))
    client = make(mode, handler, max_retries=3)
    assert run(client, "_request", _Call("POST", "/v1/x", lambda r: r.json(),
                                         retry_safe=False)) == {"ok": 1}
    assert len(seen) == 2


@pytest.mark.parametrize("mode", MODES)
def test_delete_retried_after_lost_answer_reports_success(mode):
    handler, seen = sequence(httpx.ReadError("reset after delete"),
                             error(404, "unknown weight set"))
    client = make(mode, handler)
    assert run(client, "delete_weights", "l0") == mgc.WeightDeleted(deleted="l0")
    assert len(seen) == 2 and all(r.method == "DELETE" for r in seen)
    # without the lost answer, a 404 is a 404
    handler, _ = sequence(error(404, "unknown weight set"))
    with pytest.raises(mgc.NotFoundError):
        run(make(mode, handler), "delete_weights", "l0")
    # after a 503 the server certainly did nothing: the 404 is real
    handler, _ = sequence(error(503, "draining"), error(404, "unknown weight set"))
    with pytest.raises(mgc.NotFoundError):
        run(make(mode, handler), "delete_weights", "l0")


@pytest.mark.parametrize("mode", MODES)
def test_delete_retried_after_a_gateway_502_reports_success(mode):
    # A 502 is a proxy's answer for an upstream answer it lost: the delete may have been
    # done, so the retry's 404 means "already gone", as after a reset connection.
    handler, seen = sequence(error(502, "bad gateway"), error(404, "unknown weight set"))
    client = make(mode, handler)
    assert run(client, "delete_weights", "l0") == mgc.WeightDeleted(deleted="l0")
    assert len(seen) == 2 and all(r.method == "DELETE" for r in seen)


# ------------------------------------------------------------------------------------------
# timeouts


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("exc", [httpx.ReadTimeout("timed out"), httpx.WriteTimeout("slow"),
                                 httpx.ConnectTimeout("slow"), httpx.PoolTimeout("full")])
def test_timeouts_map_to_timeout_error_after_retries(mode, exc):
    handler, seen = sequence(exc)
    client = make(mode, handler, max_retries=2)
    with pytest.raises(mgc.APITimeoutError) as info:
        run(client, "list_weights", request_id="t-1")
    assert isinstance(info.value, mgc.APIConnectionError)
    assert info.value.request_id == "t-1" and info.value.status_code is None
    assert info.value.__cause__ is exc
    assert len(seen) == 3 and len(client.sleeps) == 2


@pytest.mark.parametrize("mode", MODES)
def test_read_timeout_of_an_unsafe_call_is_not_retried(mode):
    handler, seen = sequence(httpx.ReadTimeout("timed out"), ok_json({}))
    client = make(mode, handler, max_retries=2)
    with pytest.raises(mgc.APITimeoutError):
        run(client, "_request", _Call("POST", "/v1/x", lambda r: r.json(), retry_safe=False))
    assert len(seen) == 1
    handler, seen = sequence(httpx.ConnectTimeout("slow"), ok_json({"ok": 1}))
    client = make(mode, handler, max_retries=2)
    assert run(client, "_request", _Call("POST", "/v1/x", lambda r: r.json(),
                                         retry_safe=False)) == {"ok": 1}


@pytest.mark.parametrize("mode", MODES)
def test_timeouts_then_success(mode):
    handler, seen = sequence(httpx.ConnectTimeout("slow"), httpx.ReadTimeout("stalled"),
                             ok_json({"weights": []}))
    client = make(mode, handler)
    assert run(client, "list_weights") == []
    assert len(seen) == 3


@pytest.mark.parametrize("mode", MODES)
def test_timeout_argument_reaches_each_request(mode):
    handler = ContractHandler()
    client = make(mode, handler, timeout=7.0)
    run(client, "list_weights")
    run(client, "list_weights", timeout=httpx.Timeout(1.0, connect=0.5))
    run(client, "list_weights", timeout=2.5)
    t = [s.timeout for s in handler.seen]
    assert t[0] == {"connect": 7.0, "read": 7.0, "write": 7.0, "pool": 7.0}
    assert t[1] == {"connect": 0.5, "read": 1.0, "write": 1.0, "pool": 1.0}
    assert t[2]["read"] == 2.5
    default = make(mode, handler)
    run(default, "list_weights")
    assert handler.seen[-1].timeout["connect"] == 5.0 and handler.seen[-1].timeout["read"] == 300


def _silent_server() -> socket.socket:
    """A listening socket that accepts connections (in the backlog) and never answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


@pytest.mark.parametrize("mode", MODES)
def test_real_socket_read_timeout(mode):
    sock = _silent_server()
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        client = (mgc.Client if mode == "sync" else mgc.AsyncClient)(url, timeout=0.3,
                                                                     max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(mgc.APITimeoutError):
            run(client, "health")
        assert 0.25 <= time.monotonic() - t0 < 3.0
        run(client, "close")
    finally:
        sock.close()


@pytest.mark.parametrize("mode", MODES)
def test_real_connection_refused_is_retried_then_raised(mode):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    client = (mgc.Client if mode == "sync" else mgc.AsyncClient)(f"http://127.0.0.1:{port}",
                                                                 max_retries=2)
    sleeps: list[float] = []
    if mode == "sync":
        client._sleep = sleeps.append
    else:
        async def fake(s: float) -> None:
            sleeps.append(s)
        client._sleep = fake
    with pytest.raises(mgc.APIConnectionError) as info:
        run(client, "health")
    assert not isinstance(info.value, mgc.APITimeoutError)
    assert len(sleeps) == 2
    run(client, "close")


# ------------------------------------------------------------------------------------------
# headers, configuration


@pytest.mark.parametrize("mode", MODES)
def test_headers_sent(mode):
    handler = ContractHandler()
    client = make(mode, handler, api_key="sekret", default_headers={"X-Team": "a"})
    run(client, "list_weights", request_id="r-1", extra_headers={"X-Extra": "1"})
    h = handler.seen[-1].headers
    assert h["Authorization"] == "Bearer sekret"
    assert h["X-Request-Id"] == "r-1" and h["X-Team"] == "a" and h["X-Extra"] == "1"
    assert h["User-Agent"].startswith(f"moe-gemm-client/{mgc.__version__}")
    handler.weights["l0"] = (np.ones((1, 2, 2), np.float32), "w")
    run(client, "grouped_mm", "l0", np.ones((1, 2), np.float32), counts=[1], priority=1,
        request_timeout_us=250_000)
    h = handler.seen[-1].headers
    assert h["X-Priority"] == "1" and h["X-Timeout-Us"] == "250000"
    assert h["Content-Type"] == "application/octet-stream"
    assert int(h["Content-Length"]) == len(handler.seen[-1].body)
    assert "X-Request-Id" not in h
    anon = make(mode, handler)
    run(anon, "list_weights")
    assert "Authorization" not in handler.seen[-1].headers


@pytest.mark.parametrize("mode", MODES)
def test_environment_defaults(mode, monkeypatch):
    monkeypatch.setenv("MOE_GEMM_BASE_URL", "http://example.invalid:9/prefix")
    monkeypatch.setenv("MOE_GEMM_API_KEY", "from-env")
    handler, seen_all = sequence(ok_json({"live": True}))
    client = make(mode, handler)
    assert run(client, "health") is True
    seen = seen_all[-1]
    assert seen.url.path == "/prefix/v2/health/live" and seen.url.port == 9
    assert seen.headers["Authorization"] == "Bearer from-env"
    assert "from-env" not in repr(client)


def test_constructor_validation():
    with pytest.raises(ValueError, match="http"):
        mgc.Client("ftp://x")
    with pytest.raises(ValueError, match="max_retries"):
        mgc.Client(max_retries=-1)
    with pytest.raises(TypeError, match="max_retries"):
        mgc.Client(max_retries=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        mgc.Client(timeout=0)
    for bad in (float("nan"), float("inf")):  # not at the first request, deep in httpx
        with pytest.raises(ValueError, match="timeout must be finite"):
            mgc.Client(timeout=bad)
        with pytest.raises(ValueError, match="timeout must be finite"):
            mgc.AsyncClient(timeout=bad)
    with pytest.raises(TypeError, match="api_key"):
        mgc.Client(api_key=123)  # type: ignore[arg-type]
    c = mgc.Client(timeout=None)
    assert c.timeout.read is None
    c.close()
    with pytest.raises(TypeError, match="httpx.Client"):
        mgc.Client(http_client=httpx.AsyncClient())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="httpx.AsyncClient"):
        mgc.AsyncClient(http_client=httpx.Client())  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", MODES)
def test_bad_per_call_options(mode):
    handler = ContractHandler()
    client = make(mode, handler)
    x = np.ones((1, 2), np.float32)
    for kwargs in ({"priority": -1}, {"request_timeout_us": -1}, {"priority": 10**18},
                   {"request_timeout_us": 10**18}, {"request_timeout_us": 1.5},
                   {"priority": True}, {"max_retries": -2}):
        with pytest.raises(ValueError, match="priority|request_timeout_us|max_retries"):
            run(client, "grouped_mm", "l0", x, counts=[1], **kwargs)
    assert handler.seen == []  # refused before anything was sent


@pytest.mark.parametrize("mode", MODES)
def test_zero_timeout_and_priority_mean_the_servers_default(mode):
    """The wire contract reads X-Timeout-Us: 0 and X-Priority: 0 as the server's default
    (`--default-timeout-us`, the default level): both are sent as given."""
    handler = ContractHandler()
    handler.weights["l0"] = (np.ones((1, 2, 2), np.float32), "w")
    client = make(mode, handler)
    y = run(client, "grouped_mm", "l0", np.ones((1, 2), np.float32), counts=[1],
            request_timeout_us=0, priority=0)
    np.testing.assert_array_equal(y, np.full((1, 2), 2, np.float32))
    h = handler.seen[-1].headers
    assert h["X-Timeout-Us"] == "0" and h["X-Priority"] == "0"
    run(client, "grouped_mm", "l0", np.ones((1, 2), np.float32), counts=[1],
        request_timeout_us=10**18 - 1)
    assert handler.seen[-1].headers["X-Timeout-Us"] == str(10**18 - 1)


@pytest.mark.parametrize("mode", MODES)
def test_list_weights_names_the_sets_not_loaded(mode):
    handler = ContractHandler()
    handler.weights["l0"] = (np.ones((2, 3, 4), np.float32), "w")
    client = make(mode, handler)
    listed = run(client, "list_weights")  # an older server: no "not_loaded" key
    assert isinstance(listed, list) and [w.name for w in listed] == ["l0"]
    assert listed.not_loaded == () and listed == [run(client, "get_weights", "l0")]
    handler.not_loaded = [{"name": "big", "status": 507, "error": "does not fit"},
                          {"name": "bad", "status": 503, "error": "could not be loaded"}]
    listed = run(client, "list_weights")
    assert listed.not_loaded == (mgc.NotLoadedInfo("big", 507, "does not fit"),
                                 mgc.NotLoadedInfo("bad", 503, "could not be loaded"))
    assert listed.to_json() == {"weights": [listed[0].to_json()],
                                "not_loaded": handler.not_loaded}
    assert mgc.WeightList.from_json(listed.to_json()) == listed
    assert listed != mgc.WeightList(listed, ())  # not_loaded takes part in equality
    for bad in ([{"name": "big", "status": "507", "error": "x"}], [{"name": "big"}], ["big"],
                {"big": 507}):
        handler.not_loaded = bad
        with pytest.raises(mgc.APIResponseValidationError):
            run(client, "list_weights")
    with pytest.raises(TypeError):
        run(client, "list_weights", request_id=5)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="timeout must be finite"):
            run(client, "list_weights", timeout=bad)


@pytest.mark.parametrize("mode", MODES)
def test_header_values_are_checked_before_sending(mode):
    """A request id, key or header httpx cannot send failed deep inside it: a non-ASCII one
    as a bare UnicodeEncodeError, a line break as an APIConnectionError; and an id the server
    does not echo (a space, over 128 characters) was silently replaced."""
    handler, seen = sequence(ok_json({"weights": []}))
    client = make(mode, handler)
    for rid in ("caf\u00e9", "a\nb", "a b", "x" * 129):
        with pytest.raises(ValueError, match="request_id must be 1-128 printable ASCII"):
            run(client, "list_weights", request_id=rid)
    with pytest.raises(ValueError, match="extra_headers: header 'X-Tag' must hold printable"):
        run(client, "list_weights", extra_headers={"X-Tag": "caf\u00e9"})
    with pytest.raises(ValueError, match="extra_headers: header 'X-Tag' must hold printable"):
        run(client, "list_weights", extra_headers={"X-Tag": "v\r\nX-Injected: 1"})
    with pytest.raises(TypeError, match="extra_headers: header 'X-Tag' must be a str"):
        run(client, "list_weights", extra_headers={"X-Tag": 1})
    with pytest.raises(ValueError, match="not a valid HTTP header name"):
        run(client, "list_weights", extra_headers={"X Tag": "v"})
    with pytest.raises(TypeError, match="extra_headers must be a mapping"):
        run(client, "list_weights", extra_headers=[("X-Tag", "v")])
    assert seen == []
    cls = mgc.Client if mode == "sync" else mgc.AsyncClient
    # (a blank at either end, or inside: the server's keys have none, and a trailing one was
    # refused by h11 at every request, reported as a connection error and retried)
    for key in ("k\u00e9y", "key\nX-Injected: 1", "key ", " ", "a key"):
        with pytest.raises(ValueError, match="api_key must be printable ASCII"):
            cls(api_key=key)
    with pytest.raises(TypeError, match="default_headers: header 'X-Tag' must be a str"):
        cls(default_headers={"X-Tag": None})
    with pytest.raises(TypeError, match="default_headers must be a mapping"):
        cls(default_headers=[("X-Tag", "v")])
    # what the server echoes still goes out as given
    assert run(client, "list_weights", request_id="req-1:a/b", extra_headers={"X-Tag": "a b"}) == []
    assert seen[-1].headers["x-request-id"] == "req-1:a/b"


@pytest.mark.parametrize("mode", MODES)
def test_wait_until_ready_checks_its_arguments(mode):
    """wait_until_ready(None) was a bare "unsupported operand" TypeError, a NaN deadline a
    ValueError saying the timeout may be None, a negative interval a failure at the first
    sleep (sync) or a busy loop (async)."""
    handler, seen = sequence(httpx.Response(503, json={"ready": False}))
    client = make(mode, handler)
    with pytest.raises(TypeError, match="wait_until_ready timeout must be seconds"):
        run(client, "wait_until_ready", None)
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="wait_until_ready timeout must be seconds >= 0"):
            run(client, "wait_until_ready", bad)
    for bad in (float("nan"), -0.5):
        with pytest.raises(ValueError, match="wait_until_ready interval must be seconds >= 0"):
            run(client, "wait_until_ready", 1.0, interval=bad)
    assert seen == []


def test_context_managers_close_owned_clients_only():
    with mgc.Client() as c:
        assert not c.is_closed
    assert c.is_closed
    mine = httpx.Client()
    with mgc.Client(http_client=mine):
        pass
    assert not mine.is_closed
    mine.close()

    async def go() -> None:
        async with mgc.AsyncClient() as ac:
            assert not ac.is_closed
        assert ac.is_closed

    asyncio.run(go())


def test_sync_and_async_have_the_same_methods():
    names = [n for n in dir(mgc.Client) if not n.startswith("_") and callable(
        getattr(mgc.Client, n))]
    assert {"health", "ready", "list_weights", "put_weights", "get_weights", "delete_weights",
            "grouped_mm", "grouped_gemm", "close", "upload_safetensors",
            "wait_until_ready"} <= set(names)
    for n in names:
        a = getattr(mgc.AsyncClient, n)
        assert inspect.iscoroutinefunction(a), n
        ps = inspect.signature(getattr(mgc.Client, n)).parameters
        pa = inspect.signature(a).parameters
        assert [(p.name, p.kind, p.default) for p in ps.values()] == [
            (p.name, p.kind, p.default) for p in pa.values()], n
    assert hasattr(mgc.AsyncClient, "__aenter__") and hasattr(mgc.Client, "__enter__")


# ------------------------------------------------------------------------------------------
# health


@pytest.mark.parametrize("mode", MODES)
def test_health_and_ready(mode):
    handler, seen = sequence(ok_json({"live": True}))
    assert run(make(mode, handler), "health") is True
    assert seen[0].url.path == "/v2/health/live"
    handler, seen = sequence(httpx.Response(503, json={"ready": False, "reason": "warm-up"}))
    client = make(mode, handler)
    assert run(client, "ready") is False
    assert len(seen) == 1 and client.sleeps == []  # a probe's 503 is an answer, not retried
    handler, _ = sequence(httpx.Response(200))  # an empty 200 still means yes
    assert run(make(mode, handler), "ready") is True
    handler, _ = sequence(error(401, "key"))
    with pytest.raises(mgc.AuthenticationError):
        run(make(mode, handler), "ready")


@pytest.mark.parametrize("mode", MODES)
def test_wait_until_ready(mode):
    handler, seen = sequence(httpx.ConnectError("starting"),
                             httpx.Response(503, json={"ready": False}),
                             ok_json({"ready": True}))
    client = make(mode, handler)
    assert run(client, "wait_until_ready", 5.0, interval=0.01) is True
    assert len(seen) == 3 and client.sleeps == [0.01, 0.01]
    handler, seen = sequence(httpx.Response(503, json={"ready": False}))
    client = make(mode, handler)
    client._sleep = (lambda s: time.sleep(s)) if mode == "sync" else asyncio.sleep
    t0 = time.monotonic()
    assert run(client, "wait_until_ready", 0.2, interval=0.05) is False
    assert 0.15 <= time.monotonic() - t0 < 2.0
    # raise_unreachable: a server never reached raises; one that answered "no" is False
    for flag, want in ((False, False), (True, mgc.APIConnectionError)):
        handler, _ = sequence(httpx.ConnectError("down"))
        client = make(mode, handler)
        if want is False:
            assert run(client, "wait_until_ready", 0.05, interval=0.01,
                       raise_unreachable=flag) is False
        else:
            with pytest.raises(want):
                run(client, "wait_until_ready", 0.05, interval=0.01, raise_unreachable=flag)
    handler, _ = sequence(httpx.Response(503, json={"ready": False}))
    assert run(make(mode, handler), "wait_until_ready", 0.05, interval=0.01,
               raise_unreachable=True) is False


@pytest.mark.parametrize("mode", MODES)
def test_wait_until_ready_waits_through_a_gateway_whose_server_is_not_up(mode):
    """A gateway in front of a starting server answers 502 (its upstream refuses): not yet,
    as a refused connection is, not an error that ends the wait. A status that says the poll
    itself is wrong (a gateway's 401) still raises at once."""
    handler, seen = sequence(httpx.Response(502, text="<html>Bad Gateway</html>"),
                             httpx.Response(429, headers={"Retry-After": "1"}),
                             ok_json({"ready": True}))
    client = make(mode, handler)
    assert run(client, "wait_until_ready", 5.0, interval=0.01) is True
    assert len(seen) == 3
    handler, _ = sequence(httpx.Response(502, text="Bad Gateway"))
    assert run(make(mode, handler), "wait_until_ready", 0.05, interval=0.01) is False
    handler, seen = sequence(httpx.Response(401, json={"error": "key"}))
    with pytest.raises(mgc.AuthenticationError):
        run(make(mode, handler), "wait_until_ready", 5.0, interval=0.01)
    assert len(seen) == 1


# ------------------------------------------------------------------------------------------
# weights


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16], ids=["f32", "f16", "bf16"])
def test_weights_lifecycle(mode, dtype, rng):
    handler = ContractHandler()
    client = make(mode, handler, api_key="admin")
    w = rng.standard_normal((3, 4, 5)).astype(dtype)
    info = run(client, "put_weights", "layer-0.up", w)
    assert info == mgc.WeightInfo("layer-0.up", 3, 4, 5, mgc._tensors.dtype_name(np.dtype(dtype)),
                                  w.nbytes, "w")
    assert info.shape == (3, 4, 5)
    sent = handler.seen[-1]
    assert sent.method == "PUT" and sent.path == "/v1/weights/layer-0.up"
    t = sent.tensors()
    assert list(t) == ["w"] and t["w"].dtype == w.dtype and t["w"].tobytes() == w.tobytes()
    assert run(client, "list_weights") == [info]
    assert run(client, "get_weights", "layer-0.up") == info
    assert run(client, "delete_weights", "layer-0.up") == mgc.WeightDeleted("layer-0.up")
    assert run(client, "list_weights") == []
    with pytest.raises(mgc.NotFoundError):
        run(client, "get_weights", "layer-0.up")


@pytest.mark.parametrize("mode", MODES)
def test_put_weights_transposed_layout_and_torch(mode):
    handler = ContractHandler()
    client = make(mode, handler)
    w_t = torch.randn(2, 5, 3).to(torch.bfloat16)  # (E, N, K)
    info = run(client, "put_weights", "wt", w_t, layout="w_t")
    assert (info.experts, info.k, info.n, info.layout, info.dtype) == (2, 3, 5, "w_t", "bfloat16")
    t = handler.seen[-1].tensors()
    assert list(t) == ["w_t"] and t["w_t"].dtype == BFLOAT16
    assert t["w_t"].view(np.int16).tolist() == w_t.view(torch.int16).tolist()
    with pytest.raises(ValueError, match="layout"):
        run(client, "put_weights", "wt", w_t, layout="wt")
    with pytest.raises(ValueError, match=r"3-D \(E, K, N\)"):
        run(client, "put_weights", "wt", np.ones((2, 3), np.float32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "../etc", "a b", "x" * 129, "é"])
def test_bad_names_never_reach_the_wire(mode, name):
    handler = ContractHandler()
    client = make(mode, handler)
    with pytest.raises(ValueError, match="A-Za-z0-9"):
        run(client, "get_weights", name)
    with pytest.raises(ValueError):
        run(client, "grouped_mm", name, np.ones((1, 1), np.float32), counts=[1])
    assert handler.seen == []


@pytest.mark.parametrize("mode", MODES)
def test_large_upload_streams_with_progress_and_retries_whole_body(mode, rng, monkeypatch):
    monkeypatch.setattr(C, "STREAM_THRESHOLD_BYTES", 1000)
    monkeypatch.setattr(C, "STREAM_CHUNK_BYTES", 256)
    handler = ContractHandler()
    attempts: list[int] = []

    def first_busy(request: httpx.Request) -> httpx.Response:
        attempts.append(1)
        if len(attempts) == 1:
            request.read()
            return error(503, "draining", **{"Retry-After": "0"})
        return handler(request)

    client = make(mode, first_busy)
    w = rng.standard_normal((2, 16, 24)).astype(np.float32)  # 3 KiB > threshold
    progress: list[tuple[int, int]] = []
    info = run(client, "put_weights", "big", w, progress=lambda s, t: progress.append((s, t)))
    assert info.bytes == w.nbytes and len(attempts) == 2
    body = handler.seen[-1].body
    np.testing.assert_array_equal(handler.seen[-1].tensors()["w"], w)
    total = len(body)
    assert all(t == total for _, t in progress)
    sent = [s for s, _ in progress]
    # two passes (the 503'd attempt and the retry), each from 0 up to the total, in order
    assert sent.count(0) == 2 and sent[-1] == total
    second = sent[sent.index(0, 1):]
    assert second == sorted(second) and len(second) > 3


@pytest.mark.parametrize("mode", MODES)
def test_upload_safetensors_file(mode, rng, tmp_path):
    import safetensors.numpy

    handler = ContractHandler()
    client = make(mode, handler)
    w = rng.standard_normal((2, 3, 4)).astype(np.float16)
    path = tmp_path / "weights.safetensors"
    safetensors.numpy.save_file({"bias": np.zeros(4, np.float32), "experts": w}, str(path))
    info = run(client, "upload_safetensors", "from-file", path, tensor="experts")
    assert (info.experts, info.k, info.n, info.dtype, info.layout) == (2, 3, 4, "float16", "w")
    np.testing.assert_array_equal(handler.weights["from-file"][0], w)
    info = run(client, "upload_safetensors", "t", path, tensor="experts", layout="w_t")
    assert (info.k, info.n, info.layout) == (4, 3, "w_t")
    with pytest.raises(ValueError, match="name the tensor"):
        run(client, "upload_safetensors", "t", path)
    with pytest.raises(ValueError, match="no tensor 'nope'"):
        run(client, "upload_safetensors", "t", path, tensor="nope")
    with pytest.raises(ValueError, match="3-D"):
        run(client, "upload_safetensors", "t", path, tensor="bias")
    only = tmp_path / "w_t.safetensors"
    safetensors.numpy.save_file({"w_t": w}, str(only))
    assert run(client, "upload_safetensors", "t2", only).layout == "w_t"


@pytest.mark.parametrize("mode", MODES)
def test_upload_safetensors_refuses_a_file_descriptor(mode, rng, tmp_path):
    # An int is no path: opened as a descriptor it would upload whatever that descriptor
    # reads and close it under its owner.
    import os

    import safetensors.numpy

    handler = ContractHandler()
    client = make(mode, handler)
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"w": rng.standard_normal((1, 2, 3)).astype(np.float32)},
                                str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
            run(client, "upload_safetensors", "w", fd)
        os.fstat(fd)  # still open: not closed by the refused call
    finally:
        os.close(fd)
    assert handler.weights == {}


# ------------------------------------------------------------------------------------------
# grouped_mm


def _setup(handler: ContractHandler, rng: np.random.Generator, dtype: Any, E: int = 4,
           K: int = 24, N: int = 40) -> np.ndarray:
    w = rng.standard_normal((E, K, N)).astype(np.float32).astype(dtype)
    handler.weights["l0"] = (w, "w")
    return w


def _tol(dtype: Any) -> float:
    return {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3, BFLOAT16: 1e-2}[
        np.dtype(dtype)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("counts", [[5, 0, 7, 1], [0, 0, 0, 1], [13, 0, 0, 0], [0, 0, 0, 0]])
def test_grouped_mm_numpy_round_trip(mode, dtype, counts, rng):
    handler = ContractHandler()
    w = _setup(handler, rng, dtype)
    T = sum(counts)
    x = rng.standard_normal((T, 24)).astype(np.float32).astype(dtype)
    y = run(make(mode, handler), "grouped_mm", "l0", x, counts=np.array(counts, np.int64))
    assert isinstance(y, np.ndarray) and y.dtype == np.dtype(dtype) and y.shape == (T, 40)
    ref = grouped_mm_ref(x, w, np.array(counts))
    scale = max(np.abs(ref).max(initial=0.0), 1.0)
    assert np.abs(y.astype(np.float64) - ref).max(initial=0.0) <= _tol(dtype) * scale * 4
    if T:
        assert np.abs(ref).max() > 0  # never compare zeros with zeros
    sent = handler.seen[-1].tensors()
    assert sent["counts"].dtype == np.int32  # counts travel as I32
    assert sent["x"].dtype == np.dtype(dtype) and sent["x"].tobytes() == x.tobytes()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_grouped_mm_torch_in_torch_out(mode, dtype, rng):
    handler = ContractHandler()
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16,
                torch.bfloat16: BFLOAT16}[dtype]
    w = _setup(handler, rng, np_dtype, E=3, K=16, N=8)
    x = torch.randn(9, 16).to(dtype)
    offs = torch.tensor([2, 2, 9], dtype=torch.int32)
    y, rid = run(make(mode, handler), "grouped_mm", "l0", x, offs=offs, return_request_id=True,
                 request_id="mine")
    assert rid == "mine"
    assert isinstance(y, torch.Tensor) and y.dtype == dtype and y.shape == (9, 8)
    assert y.device == x.device
    xs = handler.seen[-1].tensors()["x"]
    assert xs.dtype == np.dtype(np_dtype)
    assert xs.view(np.int16 if dtype != torch.float32 else np.int32).tobytes() == \
        x.contiguous().view(torch.int16 if dtype != torch.float32 else torch.int32).numpy() \
        .tobytes()
    assert "offs" in handler.seen[-1].tensors()
    ref = grouped_mm_ref(x.float().numpy(), w, np.array([2, 0, 7]))
    torch.testing.assert_close(y.double(), torch.from_numpy(ref),
                               rtol=_tol(np_dtype) * 4, atol=_tol(np_dtype) * 4 * np.abs(ref).max())


@pytest.mark.parametrize("mode", MODES)
def test_grouped_mm_float32_x_against_bf16_weights(mode, rng):
    handler = ContractHandler()
    _setup(handler, rng, BFLOAT16, E=2, K=8, N=8)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    y = run(make(mode, handler), "grouped_mm", "l0", x, counts=[1, 2])
    assert y.dtype == np.float32  # y comes back in x's dtype


@pytest.mark.parametrize("mode", MODES)
def test_grouped_mm_local_validation(mode):
    handler = ContractHandler()
    client = make(mode, handler)
    x = np.ones((4, 3), np.float32)
    cases = [
        ((np.ones(4, np.float32),), {"counts": [4]}, ValueError, r"2-D \(T, K\)"),
        ((np.ones((4, 3), np.float64),), {"counts": [4]}, TypeError, "float32"),
        (([[1.0, 2.0]],), {"counts": [1]}, TypeError, "numpy array or torch tensor"),
        ((x,), {}, ValueError, "neither"),
        ((x,), {"counts": [4], "offs": [4]}, ValueError, "not both"),
        ((x,), {"counts": [4.0]}, TypeError, "counts"),
        ((x,), {"counts": np.array([[4]])}, ValueError, r"1-D \(E,\)"),
        ((x,), {"offs": np.array([4.0])}, TypeError, "offs"),
        ((x,), {"counts": 4}, TypeError, "counts"),
    ]
    for args, kwargs, exc, words in cases:
        with pytest.raises(exc, match=words):
            run(client, "grouped_mm", "l0", *args, **kwargs)
    assert handler.seen == []


@pytest.mark.parametrize("mode", MODES)
def test_grouped_mm_server_side_errors(mode, rng):
    handler = ContractHandler()
    _setup(handler, rng, np.float32, E=2, K=8, N=4)
    client = make(mode, handler)
    with pytest.raises(mgc.UnprocessableEntityError, match="K=8"):
        run(client, "grouped_mm", "l0", np.ones((2, 5), np.float32), counts=[1, 1])
    with pytest.raises(mgc.UnprocessableEntityError, match="summing"):
        run(client, "grouped_mm", "l0", np.ones((2, 8), np.float32), counts=[1, 2])
    with pytest.raises(mgc.NotFoundError):
        run(client, "grouped_mm", "other", np.ones((2, 8), np.float32), counts=[1, 1])


@pytest.mark.parametrize("mode", MODES)
def test_grouped_mm_json_answer_is_understood(mode):
    handler, _ = sequence(ok_json({"y": [[1.0, 2.0], [3.0, 4.0]], "dtype": "bfloat16"}))
    y = run(make(mode, handler), "grouped_mm", "l0", np.ones((2, 3), BFLOAT16), counts=[2])
    assert y.dtype == BFLOAT16 and y.astype(np.float32).tolist() == [[1, 2], [3, 4]]


# ------------------------------------------------------------------------------------------
# grouped_gemm


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16], ids=["f32", "f16", "bf16"])
def test_grouped_gemm_round_trip(mode, dtype, rng):
    handler = ContractHandler()
    sizes = [(1, 7, 5), (0, 3, 4), (17, 9, 33), (64, 1, 2)]  # (M, N, K), incl. M=0 and M=1
    a = [rng.standard_normal((m, k)).astype(np.float32).astype(dtype) for m, n, k in sizes]
    b = [rng.standard_normal((k, n)).astype(np.float32).astype(dtype) for m, n, k in sizes]
    d, rid = run(make(mode, handler), "grouped_gemm", a, b, return_request_id=True)
    assert rid == "generated-id"
    assert len(d) == len(sizes)
    for i, (m, n, k) in enumerate(sizes):
        ref = a[i].astype(np.float64) @ b[i].astype(np.float64)
        assert d[i].shape == (m, n) and d[i].dtype == np.dtype(dtype)
        np.testing.assert_allclose(d[i].astype(np.float64), ref, rtol=_tol(dtype) * 4,
                                   atol=_tol(dtype) * 4 * max(np.abs(ref).max(initial=0), 1))
    names = set(handler.seen[-1].tensors())
    assert names == {"a.0", "b.0", "a.1", "b.1", "a.2", "b.2", "a.3", "b.3"}


@pytest.mark.parametrize("mode", MODES)
def test_grouped_gemm_torch_and_validation(mode):
    handler = ContractHandler()
    client = make(mode, handler)
    a = [torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(2, 5, dtype=torch.bfloat16)]
    b = [torch.randn(4, 6, dtype=torch.bfloat16), torch.randn(5, 1, dtype=torch.bfloat16)]
    d = run(client, "grouped_gemm", a, b)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in d)
    torch.testing.assert_close(d[0].float(), a[0].float() @ b[0].float(), rtol=2e-2, atol=2e-2)
    n = len(handler.seen)
    assert run(client, "grouped_gemm", [], []) == []
    assert len(handler.seen) == n  # nothing to send
    with pytest.raises(ValueError, match="one b per a"):
        run(client, "grouped_gemm", a, b[:1])
    with pytest.raises(TypeError, match="list or tuple"):
        run(client, "grouped_gemm", np.ones((2, 3, 4), np.float32), [])
    with pytest.raises(ValueError, match=r"b_list\[0\] must be 2-D"):
        run(client, "grouped_gemm", [np.ones((2, 3), np.float32)], [np.ones(3, np.float32)])
    with pytest.raises(mgc.UnprocessableEntityError, match="K mismatch"):
        run(client, "grouped_gemm", [np.ones((2, 3), np.float32)],
            [np.ones((4, 3), np.float32)])


# ------------------------------------------------------------------------------------------
# light: no torch unless the caller brings it


def test_numpy_use_never_imports_torch():
    code = """
import sys, httpx, numpy as np
import moe_gemm_client as mgc
from moe_gemm_client._tensors import encode_safetensors, decode_safetensors
def h(req):
    t = decode_safetensors(req.read())
    return httpx.Response(200, content=encode_safetensors({"y": t["x"] * 2}).to_bytes())
c = mgc.Client(http_client=httpx.Client(transport=httpx.MockTransport(h)))
y = c.grouped_mm("l0", np.ones((2, 2), np.float32), counts=[2])
assert y.tolist() == [[2.0, 2.0], [2.0, 2.0]]
import moe_gemm_client.cli
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("cls", [mgc.Client, mgc.AsyncClient])
def test_base_url_that_cannot_be_used_is_a_value_error(cls, monkeypatch):
    """An unparsable URL raised httpx.InvalidURL (a traceback from the command line), and a
    port past 65535 was wrapped modulo 2^16 by getaddrinfo: 127.0.0.1:84267 reached the
    service on 18731. "http://h/moe?x=1" kept neither prefix nor query: "/" was appended
    inside the query, and every request went to http://h/v2/... (a proxy's /moe/ route
    bypassed, silently)."""
    for bad, match in (("http://[::1", "base_url"), ("http://127.0.0.1:84267", "base_url"),
                       ("http://127.0.0.1:0", "base_url"),
                       ("http://h/moe?x=1", "query or fragment"),
                       ("http://h/moe#frag", "query or fragment"),
                       ("http://h/?token=t", "query or fragment")):
        with pytest.raises(ValueError, match=match):
            cls(bad)
        monkeypatch.setenv("MOE_GEMM_BASE_URL", bad)
        with pytest.raises(ValueError, match=match):
            cls()
        monkeypatch.delenv("MOE_GEMM_BASE_URL")
    client = cls("http://127.0.0.1:65535", http_client=(
        httpx.Client() if cls is mgc.Client else httpx.AsyncClient()))
    assert client.base_url.port == 65535


@pytest.mark.parametrize("cls", [mgc.Client, mgc.AsyncClient])
def test_credentials_in_base_url_are_refused_and_never_echoed(cls, monkeypatch):
    """httpx made "http://user:pw@host" Basic auth, which replaced the bearer api_key on every
    request without a word, and repr() showed the password. The server takes bearer keys
    only, so a URL with credentials is refused, and no message echoes them."""
    secret = "s3cret-pw"
    for url in (f"http://user:{secret}@127.0.0.1:8000/", f"https://{secret}@h/moe",
                f"http://:{secret}@h", f"http://user:{secret}@h:8000/moe/"):
        with pytest.raises(ValueError, match="credentials") as info:
            cls(url, api_key="key")
        assert secret not in str(info.value) and "api_key" in str(info.value)
        monkeypatch.setenv("MOE_GEMM_BASE_URL", url)
        with pytest.raises(ValueError, match="credentials") as info:
            cls()
        assert secret not in str(info.value)
        monkeypatch.delenv("MOE_GEMM_BASE_URL")
    # Other faults in a URL that also has credentials: the message masks them too.
    for url in (f"ftp://u:{secret}@h", f"http://u:{secret}@[::1", f"http://u:{secret}@h:99999",
                f"http://u:{secret}@h/?q=1"):
        with pytest.raises(ValueError, match="base_url") as info:
            cls(url)
        assert secret not in str(info.value), str(info.value)
    client = cls("http://127.0.0.1:8000/moe", api_key=secret)
    assert secret not in repr(client) and "127.0.0.1:8000/moe" in repr(client)


def test_credentials_in_the_url_flag_are_a_usage_error(capsys):
    from moe_gemm_client import cli

    assert cli.main(["--url", "http://admin:hunter2@127.0.0.1:8000", "health"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "credentials" in err and "hunter2" not in err


def test_async_client_is_reused_across_event_loops():
    """One AsyncClient driven by two asyncio.run() calls: the pooled keep-alive connection
    belonged to the first (closed) loop, and the first call in the second loop failed with
    "RuntimeError: Event loop is closed". Real sockets: a mock transport has no loop."""
    from moe_client_testutils import running_fake_server

    handler = ContractHandler()
    handler.weights["l0"] = (np.arange(12, dtype=np.float32).reshape(2, 3, 2), "w")
    with running_fake_server(handler) as url:
        client = mgc.AsyncClient(url, max_retries=0)
        for _ in range(3):
            assert asyncio.run(client.health()) is True
            assert [w.name for w in asyncio.run(client.list_weights())] == ["l0"]

        async def concurrent() -> list[bool]:
            return list(await asyncio.gather(*(client.health() for _ in range(4))))

        assert asyncio.run(concurrent()) == [True] * 4
        # Closed from yet another loop: no "Event loop is closed", and closed for good.
        asyncio.run(client.close())
        assert client.is_closed
        with pytest.raises(RuntimeError, match="closed"):
            asyncio.run(client.health())
    assert len(handler.seen) == 3 * 2 + 4


@pytest.mark.parametrize("mode", MODES)
def test_a_timeout_too_long_for_a_socket_is_refused_up_front(mode):
    """timeout=1e10 (finite, > 0) passed the check and failed at the first request with an
    OverflowError from socket.settimeout (a traceback from `moe-gemm-client --timeout 1e10`);
    an httpx.Timeout was not checked at all."""
    cls = mgc.Client if mode == "sync" else mgc.AsyncClient
    for bad in (1e10, httpx.Timeout(1e10), httpx.Timeout(5.0, read=float("inf")),
                httpx.Timeout(5.0, connect=float("nan"))):
        with pytest.raises(ValueError, match="timeout"):
            cls(timeout=bad)
    client = make(mode, ContractHandler())
    with pytest.raises(ValueError, match="timeout"):
        run(client, "list_weights", timeout=1e10)
    assert run(client, "list_weights", timeout=1e9) == []
    assert run(client, "list_weights", timeout=httpx.Timeout(1e9, pool=0)) == []


@pytest.mark.parametrize("mode", MODES)
def test_header_names_are_merged_case_insensitively(mode):
    """Header names were merged in a dict, case-sensitively: an extra "x-request-id" went out
    beside request_id='s X-Request-Id (the server echoed the other one), an "authorization"
    beside the key's, and a "content-length" made the request fail as a connection error."""
    handler = ContractHandler()
    handler.weights["l0"] = (np.ones((1, 2, 2), np.float32), "w")
    client = make(mode, handler, api_key="sekret", default_headers={"accept": "text/plain"})
    y, rid = run(client, "grouped_mm", "l0", np.ones((1, 2), np.float32), counts=[1],
                 request_id="mine", return_request_id=True,
                 extra_headers={"x-request-id": "other", "authorization": "Bearer other",
                                "content-length": "5"})
    h = handler.seen[-1].headers
    assert rid == "mine" and h.get_list("X-Request-Id") == ["mine"]
    assert h.get_list("Authorization") == ["Bearer other"]  # extra_headers override, alone
    assert h.get_list("Content-Length") == [str(len(handler.seen[-1].body))]
    assert h.get_list("Accept") == ["application/octet-stream, application/json;q=0.9"]
    np.testing.assert_array_equal(y, [[2.0, 2.0]])
    run(client, "list_weights")
    assert handler.seen[-1].headers.get_list("Accept") == ["text/plain"]  # default_headers win


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["replaced", "rewritten in place"])
def test_upload_safetensors_refuses_a_file_changed_after_its_header_was_read(mode, how, rng,
                                                                            tmp_path):
    """The body is read after the header (and again on each retry): a file replaced or
    rewritten in between was read at the old offsets, its new header bytes uploaded as
    weights, with no error."""
    import os

    import safetensors.numpy

    handler = ContractHandler()
    client = make(mode, handler)
    w = rng.standard_normal((2, 3, 4)).astype(np.float32)
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"w": w}, str(path))

    def change(sent: int, total: int) -> None:
        if sent == 0:  # after the header was read, before the body is
            new = {"a_bias": np.full(16, 9.0, np.float32), "w": np.ones_like(w)}
            if how == "replaced":
                safetensors.numpy.save_file(new, str(tmp_path / "new.safetensors"))
                os.replace(tmp_path / "new.safetensors", path)
            else:
                safetensors.numpy.save_file(new, str(path))

    with pytest.raises(OSError, match="changed since its header was read"):
        run(client, "upload_safetensors", "w", path, progress=change)
    assert "w" not in handler.weights
    # An unchanged file still goes through, and the same client goes on working.
    safetensors.numpy.save_file({"w": w}, str(path))
    run(client, "upload_safetensors", "w", path, progress=lambda s, t: None)
    np.testing.assert_array_equal(handler.weights["w"][0], w)


def test_a_file_replaced_while_its_body_streams_cuts_the_upload_short(rng, tmp_path):
    """Replaced by a rename after part of the body went out: the open file is still the old
    one (its bytes consistent), but the upload is of a file that no longer is at the path,
    which client/README.md promises is an OSError before the body's last bytes."""
    import os

    import safetensors.numpy

    from moe_gemm_client._tensors import FileTensorPayload, read_safetensors_header

    w = rng.standard_normal((4, 64, 32)).astype(np.float32)
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"w": w}, str(path))
    payload = FileTensorPayload(path, read_safetensors_header(path)["w"], "w")
    chunks = payload.iter_chunks(4096)
    assert next(chunks) == payload.header and len(next(chunks)) == 4096
    safetensors.numpy.save_file({"w": w + 1}, str(tmp_path / "new.safetensors"))
    os.replace(tmp_path / "new.safetensors", path)
    with pytest.raises(OSError, match="changed since its header was read"):
        list(chunks)
    # The file now at the path goes through whole.
    payload = FileTensorPayload(path, read_safetensors_header(path)["w"], "w")
    body = b"".join(payload.iter_chunks(4096))
    assert len(body) == payload.nbytes


def test_pooled_connections_expire_before_the_servers_keep_alive() -> None:
    """Both clients drop an idle connection before moe-gemm-server's default keep-alive
    closes it, so a request is never sent on a connection the server is closing."""
    server_config = pytest.importorskip("moe_gemm_server.config")
    server_keep_alive = server_config.Settings.model_fields["timeout_keep_alive"].default
    assert 0 < C.KEEPALIVE_EXPIRY < server_keep_alive
    assert C.DEFAULT_CONNECTION_LIMITS.keepalive_expiry == C.KEEPALIVE_EXPIRY
