"""Clients that stall a body, leave in the middle of an upload, or put log syntax in a name,
against a real process: raw sockets, so that the test decides every byte that is sent."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from server_testutils import LiveServer, live_server, read_http_response, st_body

ADMIN = "hostile-admin-key"
BODY_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("hostile") / "data"
    with live_server(data, "--admin-key", ADMIN, "--body-timeout-s", str(BODY_TIMEOUT_S),
                     "--warmup-rows", "1") as s:
        yield s


def _open(server: LiveServer, method: str, path: str, length: int, first: bytes = b"",
          auth: bool = True) -> socket.socket:
    """A request announcing `length` body bytes, of which only `first` are sent."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=15)
    head = (f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\n"
            + (f"Authorization: Bearer {ADMIN}\r\n" if auth else "")
            + f"Content-Length: {length}\r\n\r\n")
    sock.sendall(head.encode() + first)
    return sock


def _upload_start() -> tuple[int, bytes]:
    """The length of a weight upload of about 100 KB and its first bytes: its safetensors
    header and 100 bytes of data (an upload stalls after a header it takes; one whose header
    it refuses is answered from its first bytes)."""
    body = st_body({"w": torch.randn(2, 125, 100)})
    return len(body), body[:8 + int.from_bytes(body[:8], "little") + 100]


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) // 1024


def _log_lines(server: LiveServer, marker: str, n: int) -> list[str]:
    deadline = time.monotonic() + 10
    while True:
        lines = [ln for ln in server.log().splitlines() if marker in ln]
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_a_body_that_stalls_gets_408_and_the_connection_is_closed(server) -> None:
    """A request that announces a body and never sends it used to wait for ever."""
    for method, path, length, first in (("POST", "/v1/grouped-gemm", 100_000, b"x" * 100),
                                        ("PUT", "/v1/weights/stalled", *_upload_start())):
        t0 = time.monotonic()
        with _open(server, method, path, length, first) as sock:
            status, headers, body = read_http_response(sock)
            waited = time.monotonic() - t0
            assert status == 408 and "--body-timeout-s" in body.decode(), body
            assert BODY_TIMEOUT_S * 0.9 <= waited < BODY_TIMEOUT_S + 5, waited
            assert headers.get("connection") == "close"
            assert sock.recv(1) == b""  # closed: the rest of the body cannot be a request
    lines = _log_lines(server, "audit action=put_weights name=stalled ", 1)
    assert len(lines) == 1 and " status=408 " in lines[0], lines
    assert not list(server.data_dir.glob(".upload-*"))  # the partial upload is gone


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_announced_bodies_cost_only_the_bytes_that_came(server) -> None:
    """20 requests announcing 60 MB and sending 100 bytes each took ~1.2 GB of memory (the
    buffer was allocated from Content-Length); they must cost about nothing."""
    assert server.proc is not None
    before = _rss_mib(server.proc.pid)
    socks = [_open(server, "POST", "/v1/grouped-gemm", 60_000_000, b"x" * 100)
             for _ in range(20)]
    try:
        peak = before
        end = time.monotonic() + BODY_TIMEOUT_S * 0.8  # (before the 408s)
        while time.monotonic() < end:
            peak = max(peak, _rss_mib(server.proc.pid))
            time.sleep(0.02)
    finally:
        for s in socks:
            s.close()
    assert peak - before < 150, (before, peak)


def test_a_client_that_leaves_mid_upload_is_audited_499(server) -> None:
    """It was audited as status=500 'internal error' while the access log said 499."""
    body = st_body({"w": torch.randn(2, 64, 64)})
    with _open(server, "PUT", "/v1/weights/left", len(body), body[:1000]):
        time.sleep(0.3)  # the upload is under way
    lines = _log_lines(server, "audit action=put_weights name=left ", 1)
    assert len(lines) == 1 and " status=499 " in lines[0], lines
    assert "internal error" not in lines[0]
    assert _log_lines(server, "PUT /v1/weights/left 499", 1)


def test_a_name_cannot_forge_audit_or_access_log_lines(server) -> None:
    forged = "FORGED audit action=delete_weights name=prod outcome=ok status=200"
    url = f"{server.url}/v1/weights/x%0A{forged.replace(' ', '%20')}"
    r = httpx.delete(url, timeout=10)  # no key: 401, and still audited
    assert r.status_code == 401
    escaped = "x%0AFORGED%20audit%20action%3Ddelete_weights%20name%3Dprod"
    lines = _log_lines(server, escaped, 2)
    assert [("audit action=delete_weights" in ln, "DELETE /v1/weights/x%0A" in ln)
            for ln in lines] == [(True, False), (False, True)], lines
    assert " status=401 " in lines[0]
    assert not [ln for ln in server.log().splitlines() if ln.startswith("FORGED")]


def test_a_stalled_upload_does_not_hold_the_drain(tmp_path: Path) -> None:
    """SIGTERM while a body stalls: the server answers it 408 after --body-timeout-s and exits,
    long before --drain-timeout-s."""
    s = LiveServer(tmp_path / "data", "--body-timeout-s", str(BODY_TIMEOUT_S),
                   "--drain-timeout-s", "60", "--warmup-rows", "1")
    try:
        s.start()
        assert s.proc is not None
        with _open(s, "PUT", "/v1/weights/stall", *_upload_start(), auth=False) as sock:
            time.sleep(0.2)
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            assert read_http_response(sock)[0] == 408
            assert s.proc.wait(timeout=20) == 0
            assert time.monotonic() - t0 < BODY_TIMEOUT_S + 10
    finally:
        s.stop()


def test_a_chunked_body_over_the_limit_gets_413_and_the_connection_is_closed(
        tmp_path: Path) -> None:
    """Refused once its counted bytes passed --max-body-bytes, a chunked body was answered
    413 on a connection left open: the server went on receiving and discarding the rest of
    the body, however long, as a 413 from Content-Length (or a 408) never does."""
    with live_server(tmp_path / "data", "--max-body-bytes", "100000",
                     "--warmup-rows", "1") as s:
        with socket.create_connection(("127.0.0.1", s.port), timeout=15) as sock:
            sock.sendall(b"POST /v1/grouped-gemm HTTP/1.1\r\nHost: t\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"\0" * 60_000
            for _ in range(2):  # 120 KB: past the limit, and more is still to come
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            status, headers, body = read_http_response(sock)
            assert status == 413 and b"--max-body-bytes" in body, (status, body)
            assert headers.get("connection") == "close", headers
            assert sock.recv(1) == b""  # closed: the rest of the body is not received


@pytest.mark.parametrize("what, head, want", [
    ("no token", b"PUT /v1/weights/w HTTP/1.1\r\nHost: t\r\n", 401),
    ("an unknown path", b"POST /v1/nowhere HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
     + ADMIN.encode() + b"\r\n", 404),
])
def test_an_early_answer_to_a_body_still_arriving_closes_the_connection(server, what, head,
                                                                         want):
    """Answered before its body is in (401 without a token, 404 on an unknown path), a chunked
    or announced body would keep the connection open while the server received the rest,
    however long, only to discard it (or read it as the next request): the answer says
    Connection: close and the connection ends after it."""
    for framing in (b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
                    b"Content-Length: 10000000\r\n\r\n" + b"\0" * 1000):
        with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
            sock.sendall(head + framing)
            status, headers, _ = read_http_response(sock)
            assert status == want, (what, status)
            assert headers.get("connection") == "close", (what, headers)
            assert sock.recv(1) == b""


def test_an_early_answer_reaches_an_async_client_still_sending_its_body(tmp_path: Path
                                                                          ) -> None:
    """httpx's async client reads the answer only once its body is out. Answered early and
    closed at once, the socket's unread bytes made the kernel reset the connection, and the
    client saw ReadError instead of the 401 / 404 / 413 already sent (moe_gemm_client retried
    it twice, sending the body three times). The server now drains the rest of the body for a
    few seconds before the close: the client gets the answer."""
    import asyncio

    from moe_gemm_client import AsyncClient, NotFoundError

    with live_server(tmp_path / "data", "--admin-key", ADMIN, "--api-key", "reader",
                     "--max-body-bytes", str(16 << 20), "--max-resident-bytes", "20000",
                     "--warmup-rows", "1") as s:
        url = f"http://127.0.0.1:{s.port}"
        body = b"\0" * (12 << 20)
        cases = [("/v1/weights/nope/grouped-mm", {"Authorization": "Bearer reader"}, body, 404),
                 ("/v1/weights/nope/grouped-mm", {}, body, 401),
                 ("/v1/grouped-gemm", {"Authorization": "Bearer reader"}, b"\0" * (40 << 20),
                  413),
                 # refused from its safetensors header: over --max-resident-bytes
                 ("/v1/weights/big", {"Authorization": f"Bearer {ADMIN}"},
                  st_body({"w": torch.zeros(4, 1024, 1024)}), 507)]

        async def post_all() -> list[tuple[int, dict]]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                res = []
                for path, headers, data, _ in cases:
                    call = c.put if path == "/v1/weights/big" else c.post
                    r = await call(path, content=data, headers={
                        **headers, "Content-Type": "application/octet-stream"})
                    res.append((r.status_code, r.json()))
                return res

        for (path, _, _, want), (status, doc) in zip(cases, asyncio.run(post_all())):
            assert status == want and "error" in doc, (path, status, doc)

        async def client_call() -> float:
            async with AsyncClient(url, api_key="reader") as c:
                t0 = time.monotonic()
                with pytest.raises(NotFoundError):
                    await c.grouped_mm("nope", torch.ones(12000, 256), counts=[12000])
                return time.monotonic() - t0

        assert asyncio.run(client_call()) < 5  # answered, not retried after a reset


def test_a_client_waiting_for_100_continue_is_answered_and_closed_at_once(server):
    """Expect: 100-continue and an early answer: nothing of the body was sent, and none will
    be, so the server neither asks for it (no 100 Continue) nor lingers before the close."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
        sock.sendall(b"POST /v1/nowhere HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
                     + ADMIN.encode() + b"\r\nContent-Length: 10000000\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        t0 = time.monotonic()
        status, headers, _ = read_http_response(sock)
        assert status == 404 and headers.get("connection") == "close", (status, headers)
        assert sock.recv(1) == b""
        assert time.monotonic() - t0 < BODY_TIMEOUT_S / 2
