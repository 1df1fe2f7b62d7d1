"""Weight uploads (service_weights.WeightsMixin): in-process, the 507 of a replacement that
does not fit says how the free bytes it names were counted, an upload cancelled while it is
committed leaves disk and memory alike, and a PUT retried after a timeout is not refused for
its first attempt's bytes; against a real process, an upload its first bytes condemn is
refused from them, before the rest of its body arrives."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from server_testutils import (
    GatedEngine,
    LiveServer,
    live_server,
    mm_ref,
    read_http_response,
    served,
    st_body,
    st_load,
    wait_event,
)
from starlette.requests import Request

import moe_gemm_client as mgc
from moe_gemm_server import Settings, create_app
from moe_gemm_server import service_weights as service_mod
from moe_gemm_server import storage as storage_mod
from moe_gemm_server.engine import Engine


def _wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 30
    while client.get("/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_refused_replacement_says_its_old_version_counts_as_free(tmp_path):
    # 5000-byte budget, one 4096-byte set: replacing it by an 8192-byte version finds the whole
    # budget free (its own 4096 bytes are released by the swap) though 4096 bytes are held.
    app = create_app(Settings(data_dir=tmp_path, max_resident_bytes=5000),
                     engine=Engine("cpu", warmup_rows=[1]))
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/a",
                          content=st_body({"w": torch.randn(4, 16, 16)})).status_code == 201
        r = client.put("/v1/weights/a", content=st_body({"w": torch.randn(8, 16, 16)}))
        assert r.status_code == 507
        msg = r.json()["error"]
        assert "needs 8192 bytes but only 5000 of the 5000-byte resident budget" in msg
        assert "4096 bytes held by 1 set(s)" in msg
        assert "4096 of them by the version of 'a' this upload replaces" in msg
        # a new set (nothing replaced) keeps the plain message
        r = client.put("/v1/weights/b", content=st_body({"w": torch.randn(4, 16, 16)}))
        assert r.status_code == 507
        assert "only 904 of the 5000-byte" in r.json()["error"]
        assert "replaces" not in r.json()["error"]
        assert client.get("/v1/weights/a").json()["experts"] == 4  # the old version serves


def _put_request(name: str, body: bytes) -> Request:
    """The request a PUT of `body` to /v1/weights/{name} hands the service."""
    scope = {"type": "http", "method": "PUT", "path": f"/v1/weights/{name}",
             "query_string": b"", "headers": [(b"content-type", b"application/octet-stream"),
                                              (b"content-length", str(len(body)).encode())]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, object]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # (the client is still there)
        raise AssertionError("unreachable")
    return Request(scope, receive)


async def _weights_lock_free(service) -> None:  # type: ignore[no-untyped-def]
    async with service._weights_lock:
        pass


def test_an_upload_cancelled_while_it_is_committed_leaves_disk_and_memory_alike(
        tmp_path, monkeypatch):
    """The upload's task is cancelled (its client gone, the server shutting down) after its
    file was renamed into place, while the directory is flushed. It used to stop there: the
    new file on disk, the old version in memory, and the next rescan or restart made the
    upload live. Now what is served is what is on disk, and a rescan has nothing to do."""
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0),
                     engine=Engine("cpu", warmup_rows=[1]))
    service = app.state.service
    v1, v2 = torch.randn(2, 16, 8), torch.randn(2, 16, 8)
    entered, release, flushed = threading.Event(), threading.Event(), threading.Event()
    real_flush = storage_mod._fsync_dir

    def held_flush(path) -> None:  # type: ignore[no-untyped-def]
        entered.set()
        assert release.wait(30)
        real_flush(path)
        flushed.set()

    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/w", content=st_body({"w": v1})).status_code == 201
        monkeypatch.setattr(storage_mod, "_fsync_dir", held_flush)
        upload = client.portal.start_task_soon(service.put_weights, "w",
                                               _put_request("w", st_body({"w": v2})))
        wait_event(entered, "the upload did not reach its commit")
        assert upload.cancel()
        release.set()
        wait_event(flushed, "the commit did not finish")
        client.portal.call(_weights_lock_free, service)
        monkeypatch.undo()
        on_disk = st_load((tmp_path / "w.safetensors").read_bytes())["w"]
        assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
        assert served(client, "w", on_disk)
        assert service.watcher.loaded["w"] == service.watcher.file_id("w")
        assert client.portal.call(service.watcher.rescan) == 0
        assert served(client, "w", on_disk)
        assert service._reserved_bytes == 0


ONE = 2 * 16 * 32 * 4  # bytes of one (2, 16, 32) float32 set


def test_a_put_retried_after_a_timeout_is_not_refused_for_its_first_attempt(
        tmp_path, monkeypatch):
    """The client's first PUT times out while the server still warms the set; the client
    sends it again, with room in the resident budget for one copy only. The retry used to be
    refused 507 (the first attempt's bytes counted against it) while the first attempt went on
    to store the set: the caller was told the upload failed. Now the retry of the same content
    answers with the set stored."""
    engine = GatedEngine("w")
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0,
                              max_resident_bytes=ONE + ONE // 2), engine=engine)
    service = app.state.service
    w = np.random.default_rng(7).standard_normal((2, 16, 32), dtype=np.float32)
    # The retry's body read in full: the first attempt may finish now (either order works).
    real_read, reads = service_mod.read_weight_file, []

    def read_then_release(path, check_values=False):  # type: ignore[no-untyped-def]
        out = real_read(path, check_values)
        reads.append(path)
        if len(reads) == 2:
            engine.release.set()
        return out
    monkeypatch.setattr(service_mod, "read_weight_file", read_then_release)

    with TestClient(app) as server:
        _wait_ready(server)
        first: list[httpx.Response] = []
        threads: list[threading.Thread] = []

        def forward(request: httpx.Request) -> httpx.Response:
            r = server.request(request.method, str(request.url), content=request.read(),
                               headers=dict(request.headers))
            return httpx.Response(r.status_code, headers=r.headers.multi_items(),
                                  content=r.content)

        class FirstPutTimesOut(httpx.BaseTransport):
            """Sends the first PUT on, and times it out once the server warms its set."""

            def handle_request(self, request: httpx.Request) -> httpx.Response:
                if request.method == "PUT" and not threads:
                    threads.append(threading.Thread(
                        target=lambda: first.append(forward(request))))
                    threads[0].start()
                    wait_event(engine.entered, "the first attempt did not start warming")
                    raise httpx.ReadTimeout("timed out", request=request)
                return forward(request)

        client = mgc.Client("http://testserver",
                            http_client=httpx.Client(transport=FirstPutTimesOut()))
        client._sleep = lambda seconds: None  # type: ignore[method-assign]
        try:
            info = client.put_weights("w", w)
        finally:
            engine.release.set()
            for t in threads:
                t.join(30)
        assert len(reads) == 2  # (the retry was sent and received)
        assert first[0].status_code == 201, first[0].text
        assert info.name == "w" and info.bytes == ONE
        assert served(server, "w", torch.from_numpy(w))
        assert service.engine.resident_bytes == ONE and service._reserved_bytes == 0
        assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def test_a_put_of_other_content_while_one_is_in_progress_still_counts_its_bytes(tmp_path):
    """What lets a retry through is its content: another tensor of the same name and size
    arriving while the first upload warms is refused 507 near the budget, as before."""
    engine = GatedEngine("w")
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0,
                              max_resident_bytes=ONE + ONE // 2), engine=engine)
    w = torch.randn(2, 16, 32)
    with TestClient(app) as client:
        _wait_ready(client)
        first: list[int] = []
        t = threading.Thread(target=lambda: first.append(client.put(
            "/v1/weights/w", content=st_body({"w": w})).status_code))
        t.start()
        try:
            wait_event(engine.entered, "the first upload did not start warming")
            r = client.put("/v1/weights/w", content=st_body({"w": w + 1}))
        finally:
            engine.release.set()
            t.join(30)
        assert r.status_code == 507 and "resident budget" in r.json()["error"], r.text
        assert first == [201]
        assert served(client, "w", w)
        assert app.state.service._reserved_bytes == 0


def test_two_replacements_in_flight_do_not_both_count_the_old_version_as_freed(tmp_path):
    """Room for two copies of a set, one resident: a replacement warming counts the version
    it replaces as freed, and a second replacement arriving meanwhile did too, so both were
    admitted while the device held three copies. Now only one replacement at a time counts
    the old version as freed: the second is 507, the first completes, and the old version
    serves until the swap."""
    engine = GatedEngine("w")
    budget = 2 * ONE + ONE // 2
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0,
                              max_resident_bytes=budget), engine=engine)
    service = app.state.service
    v1, v2, v3 = torch.randn(2, 16, 32), torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    with TestClient(app) as client:
        _wait_ready(client)
        engine.release.set()
        assert client.put("/v1/weights/w", content=st_body({"w": v1})).status_code == 201
        engine.release.clear()
        engine.entered.clear()
        answers: dict[str, httpx.Response] = {}

        def put(key: str, w: torch.Tensor) -> threading.Thread:
            t = threading.Thread(target=lambda: answers.__setitem__(key, client.put(
                "/v1/weights/w", content=st_body({"w": w}))))
            t.start()
            return t

        first = put("first", v2)
        try:
            wait_event(engine.entered, "the first replacement did not start warming")
            assert served(client, "w", v1)  # (requests on the old version go on meanwhile)
            second = put("second", v3)
            second.join(10)
            assert not second.is_alive(), "the second replacement was admitted"
        finally:
            engine.release.set()
            first.join(30)
        r = answers["second"]
        assert r.status_code == 507, r.text
        msg = r.json()["error"]
        assert f"needs {ONE} bytes" in msg and f"{budget}-byte resident budget" in msg, msg
        assert "another replacement of it in progress counts as freed" in msg, msg
        assert answers["first"].status_code == 200, answers["first"].text
        assert served(client, "w", v2)
        assert torch.equal(st_load((tmp_path / "w.safetensors").read_bytes())["w"], v2)
        assert service.engine.resident_bytes == ONE
        assert service._reserved_bytes == 0 and not service._credited
        # the replacement over, the next one counts the resident version as freed again
        assert client.put("/v1/weights/w", content=st_body({"w": v3})).status_code == 200
        assert served(client, "w", v3)


# ------------------------------------------------------------------------------ early refusals
# Against a real process with raw sockets: a request announces a large body, sends only its
# first bytes and waits for the answer. An upload the header already condemns is answered at
# once; before, the server waited for (and buffered) the whole body to refuse it.

MiB = 1 << 20
WEIGHT_LIMIT = 256 * MiB
DECLARED = 200 * MiB  # under --max-weight-bytes: the body limit alone does not refuse it


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("early") / "data"
    with live_server(data, "--max-resident-bytes", str(MiB), "--max-body-bytes", str(MiB),
                     "--max-weight-bytes", str(WEIGHT_LIMIT), "--body-timeout-s", "30",
                     "--warmup-rows", "1") as s:
        yield s


def _header(entries: dict[str, dict[str, object]]) -> bytes:
    raw = json.dumps(entries).encode()
    return len(raw).to_bytes(8, "little") + raw


def _first_bytes_only(server: LiveServer, first: bytes, length: int | None,
                      ctype: str = "application/octet-stream") -> tuple[int, str]:
    """PUT announcing `length` body bytes (None: chunked), of which only `first` are sent;
    the status and error message of the answer, which must come within 10 s and close the
    connection (the rest of the body is not read)."""
    framing = (f"Content-Length: {length}" if length is not None
               else "Transfer-Encoding: chunked")
    if length is None:
        first = f"{len(first):x}\r\n".encode() + first + b"\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"PUT /v1/weights/big HTTP/1.1\r\nHost: t\r\nContent-Type: {ctype}\r\n"
                     f"{framing}\r\n\r\n".encode() + first)
        status, headers, body = read_http_response(sock)
    assert headers.get("connection") == "close", headers
    return status, json.loads(body)["error"]


def test_a_malformed_header_is_refused_from_the_first_bytes(small_server) -> None:
    status, msg = _first_bytes_only(small_server, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!}"
                                    + bytes(1000), DECLARED)
    assert status == 400 and "header is not valid JSON" in msg
    # a header length past the announced body, from its 8 bytes alone
    status, msg = _first_bytes_only(small_server, (DECLARED).to_bytes(8, "little"), DECLARED)
    assert status == 400 and f"header length {DECLARED} does not fit" in msg
    # tensors the route does not take
    head = _header({"x": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}})
    status, msg = _first_bytes_only(small_server, head, len(head) + 64)
    assert status == 422 and "expected one tensor, 'w'" in msg


def test_a_set_over_the_budget_is_refused_from_its_header(small_server) -> None:
    n = DECLARED // 4 // (64 * 64)
    head = _header({"w": {"dtype": "F32", "shape": [n, 64, 64], "data_offsets": [0, DECLARED]}})
    status, msg = _first_bytes_only(small_server, head, len(head) + DECLARED)
    assert status == 507, msg
    assert f"needs {DECLARED} bytes" in msg and "--max-resident-bytes" in msg
    assert not list(small_server.data_dir.glob("*.safetensors"))


def test_a_chunked_body_over_the_limit_is_refused_from_its_header(small_server) -> None:
    size = 2 * WEIGHT_LIMIT
    head = _header({"w": {"dtype": "F32", "shape": [size // 4 // 4096, 64, 64],
                          "data_offsets": [0, size]}})
    status, msg = _first_bytes_only(small_server, head, None)
    assert status == 413 and f"limit of {WEIGHT_LIMIT} bytes (--max-weight-bytes)" in msg


def test_a_json_upload_takes_the_request_body_limit(small_server) -> None:
    """A JSON upload is parsed whole in memory: past --max-body-bytes it is refused from its
    Content-Length, before a byte is read (it used to be read up to --max-weight-bytes)."""
    status, msg = _first_bytes_only(small_server, b'{"w": [[[', DECLARED, "application/json")
    assert status == 413 and f"limit of {MiB} bytes (--max-body-bytes)" in msg
    # chunked: refused once the count passes it
    with httpx.Client(base_url=small_server.url, timeout=30) as c:
        r = c.put("/v1/weights/big", headers={"Content-Type": "application/json"},
                  content=iter([b'{"w": [[[' + b"1, " * (MiB // 3)] * 2))
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]
        # small JSON uploads work as before
        r = c.put("/v1/weights/tiny", json={"w": [[[1, 0], [0, 1]]]})
        assert r.status_code == 201, r.text
        assert c.delete("/v1/weights/tiny").status_code == 200


def test_uploads_sent_in_small_pieces_are_checked_and_stored(small_server) -> None:
    """The header check sees the body's bytes as they come, however they are cut: a header
    split over many pieces, chunked or with a Content-Length, ends in a stored set."""
    w = torch.randn(2, 16, 8)
    body = st_body({"w": w})
    pieces = [body[i:i + 5] for i in range(0, len(body), 5)]
    with httpx.Client(base_url=small_server.url, timeout=30) as c:
        r = c.put("/v1/weights/pieces", content=iter(pieces))  # chunked
        assert r.status_code == 201, r.text
        r = c.put("/v1/weights/pieces", content=iter(pieces),
                  headers={"Content-Length": str(len(body))})
        assert r.status_code == 200, r.text
        x = torch.randn(3, 16)
        r = c.post("/v1/weights/pieces/grouped-mm",
                   content=st_body({"x": x, "counts": torch.tensor([1, 2])}))
        y = st_load(r.content)["y"]
        assert torch.allclose(y.double(), mm_ref(x, w, torch.tensor([1, 2])), atol=1e-4)
        assert c.delete("/v1/weights/pieces").status_code == 200


def test_a_set_installed_after_a_delete_counts_its_requests(tmp_path):
    """An upload that warms longer than a later upload of the same name, which is then deleted,
    is installed last: its requests count in its statistics (they were dropped as requests of
    the deleted version, whose number was higher)."""
    entered, release = threading.Event(), threading.Event()

    class SlowWarmUp(Engine):
        def warm_up(self, ws):  # type: ignore[no-untyped-def]
            if ws.E == 3:  # the first upload: held in its warm-up
                entered.set()
                assert release.wait(30)
            return super().warm_up(ws)

    app = create_app(Settings(data_dir=tmp_path), engine=SlowWarmUp("cpu", warmup_rows=[1]))
    with TestClient(app) as client:
        _wait_ready(client)
        first: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: first.setdefault("r", client.put(
            "/v1/weights/a", content=st_body({"w": torch.ones(3, 4, 4)}))))
        t.start()
        assert entered.wait(30)
        assert client.put("/v1/weights/a",
                          content=st_body({"w": torch.ones(2, 4, 4)})).status_code == 201
        assert client.delete("/v1/weights/a").status_code == 200
        release.set()
        t.join(30)
        assert first["r"].status_code == 201, first["r"].text
        r = client.post("/v1/weights/a/grouped-mm", content=st_body(
            {"x": torch.ones(3, 4), "counts": torch.tensor([1, 1, 1], dtype=torch.int32)}))
        assert r.status_code == 200, r.text
        stats = client.get("/v2/models/a/stats").json()["model_stats"][0]
        assert stats["inference_count"] == 3 and stats["execution_count"] == 1
        assert stats["inference_stats"]["success"]["count"] == 1
